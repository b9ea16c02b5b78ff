"""Per-step description of where every token of the flattened batch lives in the KV cache.

Built once per step by the model runner and shared by all layers. Sequences are ordered
decodes first (exactly one query token each), then prefill chunks; a chunk may start
after a cached prefix, so its keys are the ``seq_len`` first tokens of its block table.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class AttentionMetadata:
    slot_mapping: torch.Tensor
    """``[T]`` int64: the cache slot (block_id * block_size + offset) of each new token."""
    block_table: torch.Tensor
    """``[N, max_blocks]`` int64 block ids per sequence, right-padded with 0."""
    seq_lens: torch.Tensor
    """``[N]`` int64: tokens each sequence attends to after this step (prefix + new)."""
    query_start_loc: tuple[int, ...]
    """``N + 1`` offsets of each sequence's query tokens in the flattened batch."""
    seq_lens_list: tuple[int, ...]
    num_decodes: int
    block_size: int

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens_list)

    def prefill_spans(self) -> list[tuple[int, int, int, int]]:
        """``(seq_index, q_start, q_end, context_start)`` for each prefill chunk, where
        ``context_start`` is the position of its first query token."""
        spans = []
        for i in range(self.num_decodes, self.num_seqs):
            q_start, q_end = self.query_start_loc[i], self.query_start_loc[i + 1]
            spans.append((i, q_start, q_end, self.seq_lens_list[i] - (q_end - q_start)))
        return spans


def visible_keys(
    query_positions: torch.Tensor, num_keys: int, sliding_window: int | None
) -> torch.Tensor:
    """``[Q, K]`` bool: key ``j`` is visible from a query at position ``p`` when
    ``j <= p`` and, with a sliding window ``W``, ``j > p - W`` (W positions, self included)."""
    keys = torch.arange(num_keys, device=query_positions.device)
    q = query_positions.unsqueeze(1)
    mask = keys.unsqueeze(0) <= q
    if sliding_window is not None:
        mask &= keys.unsqueeze(0) > q - sliding_window
    return mask


def gather_kv(cache: torch.Tensor, block_table: torch.Tensor) -> torch.Tensor:
    """Cache ``[num_blocks, block_size, KVH, D]`` gathered through ``block_table
    [N, B]`` into ``[N, B * block_size, KVH, D]`` (padding blocks included)."""
    n, b = block_table.shape
    gathered = cache.index_select(0, block_table.reshape(-1))
    return gathered.view(n, b * cache.shape[1], *cache.shape[2:])
