"""The step plan: what rank 0 tells the other ranks of a replica before each forward.

The scheduler, the KV-cache manager, sampling and everything else that decides runs on
rank 0 only; the other ranks run the forward they are told to, on their slice of the
weights and their heads' KV cache. A plan is small and typed: a ``PlanKind``, and for a
forward the flattened batch's token ids, positions, KV slots, block table, sequence
lengths and the rows whose logits are wanted — about ``8 * (4T + N(B + 2))`` bytes for T
tokens of N sequences with B blocks each. It travels as two int64 broadcasts on the
plan group (a fixed header, then the payload), no pickling.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

import numpy as np
import torch

from tandem.engine.attention.metadata import AttentionMetadata
from tandem.engine.parallel.group import TensorParallelGroup

_HEADER = 8


class PlanKind(enum.IntEnum):
    FORWARD = 1
    ALLOCATE_KV = 2
    """``header[1]`` blocks: allocate the KV cache (rank 0 sized it)."""
    STOP = 3
    """The replica is shutting down: leave the loop."""
    UNPACK_KV = 4
    """Write the KV staged by transfer ``header[1]`` into the payload's block ids."""
    FILL_LORA = 5
    """Put the LoRA adapter the payload names (``encode_text``) in slot ``header[1]``."""


@dataclass(frozen=True)
class ForwardPlan:
    """One forward pass over a flattened batch, decodes first (see ``AttentionMetadata``)."""

    input_ids: np.ndarray
    positions: np.ndarray
    slots: np.ndarray
    block_table: np.ndarray
    """``[N, B]``."""
    seq_lens: np.ndarray
    query_start_loc: np.ndarray
    """``[N + 1]``."""
    logit_rows: np.ndarray
    """Rows of the hidden states to compute logits for (empty: none)."""
    num_decodes: int
    lora_slots: np.ndarray | None = None
    """``[T]``: the LoRA slot each token runs under (-1: base); ``None``: no adapters."""

    def metadata(self, block_size: int, device: torch.device) -> AttentionMetadata:
        return AttentionMetadata(
            slot_mapping=torch.from_numpy(self.slots).to(device),
            block_table=torch.from_numpy(self.block_table).to(device),
            seq_lens=torch.from_numpy(self.seq_lens).to(device),
            query_start_loc=tuple(self.query_start_loc.tolist()),
            seq_lens_list=tuple(self.seq_lens.tolist()),
            num_decodes=self.num_decodes,
            block_size=block_size,
        )

    def encode(self) -> tuple[np.ndarray, np.ndarray]:
        t, (n, b), r = len(self.input_ids), self.block_table.shape, len(self.logit_rows)
        payload = np.concatenate(
            [
                self.input_ids,
                self.positions,
                self.slots,
                self.block_table.reshape(-1),
                self.seq_lens,
                self.query_start_loc,
                self.logit_rows,
                *(() if self.lora_slots is None else (self.lora_slots,)),
            ]
        ).astype(np.int64, copy=False)
        has_lora = int(self.lora_slots is not None)
        header = np.array([PlanKind.FORWARD, t, n, b, r, self.num_decodes, len(payload), has_lora])
        return header.astype(np.int64), payload

    @classmethod
    def decode(cls, header: np.ndarray, payload: np.ndarray) -> ForwardPlan:
        _, t, n, b, r, num_decodes = (int(x) for x in header[:6])
        has_lora = bool(header[7])
        sizes = [t, t, t, n * b, n, n + 1, r, *((t,) if has_lora else ())]
        parts = np.split(payload, np.cumsum(sizes)[:-1])
        ids, positions, slots, table, seq_lens, qsl, rows = parts[:7]
        lora = parts[7] if has_lora else None
        table = table.reshape(n, b)
        return cls(ids, positions, slots, table, seq_lens, qsl, rows, num_decodes, lora)


def encode_text(text: str) -> np.ndarray:
    """A string as an int64 payload (its UTF-8 bytes, zero-padded to 8)."""
    data = text.encode()
    data += b"\0" * (-len(data) % 8)
    return np.frombuffer(data, dtype=np.int64).copy()


def decode_text(payload: np.ndarray) -> str:
    return payload.astype(np.int64).tobytes().rstrip(b"\0").decode()


class PlanChannel:
    """Rank 0's side sends, the others' receive; one message at a time, in order."""

    def __init__(self, group: TensorParallelGroup) -> None:
        self.group = group

    def send_forward(self, plan: ForwardPlan) -> None:
        header, payload = plan.encode()
        self._send(header, payload)

    def send(self, kind: PlanKind, value: int = 0, payload: np.ndarray | None = None) -> None:
        header = np.zeros(_HEADER, dtype=np.int64)
        header[0], header[1] = kind, value
        if payload is not None:
            payload = np.asarray(payload, dtype=np.int64)
            header[6] = len(payload)
        self._send(header, payload)

    def receive(self) -> tuple[PlanKind, np.ndarray, np.ndarray | None]:
        """The next message: its kind, header and payload (``None`` when it has none)."""
        header = torch.zeros(_HEADER, dtype=torch.int64)
        self.group.broadcast_plan(header)
        size = int(header[6])
        payload = None
        if size:
            buffer = torch.empty(size, dtype=torch.int64)
            self.group.broadcast_plan(buffer)
            payload = buffer.numpy()
        return PlanKind(int(header[0])), header.numpy(), payload

    def _send(self, header: np.ndarray, payload: np.ndarray | None) -> None:
        self.group.broadcast_plan(torch.from_numpy(header))
        if payload is not None and len(payload):
            self.group.broadcast_plan(torch.from_numpy(np.ascontiguousarray(payload)))
