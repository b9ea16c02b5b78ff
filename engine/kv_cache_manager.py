"""Per-request block tables on top of the block pool, with prefix-cache reuse.

The scheduler asks two questions — "which leading blocks of this prompt are cached?"
and "can this request grow by n tokens?" — and reports progress once per step so
newly filled blocks become shareable. Torch-free.
"""

from __future__ import annotations

from dataclasses import dataclass

from tandem.common.hashing import BlockHash, hash_blocks, root_hash
from tandem.engine.block_pool import Block, BlockPool
from tandem.engine.request import Request


@dataclass(frozen=True)
class CachedPrefix:
    """Leading blocks of a request found in the prefix cache (no reference taken yet)."""

    blocks: tuple[Block, ...]
    block_size: int

    @property
    def num_tokens(self) -> int:
        return len(self.blocks) * self.block_size


class KVCacheManager:
    def __init__(self, pool: BlockPool, block_size: int) -> None:
        self.pool = pool
        self.block_size = block_size
        self._blocks: dict[str, list[Block]] = {}
        self._hashes: dict[str, list[BlockHash]] = {}
        self._num_published: dict[str, int] = {}

    def block_ids(self, request: Request) -> list[int]:
        return [b.block_id for b in self._blocks.get(request.request_id, ())]

    def num_blocks_held(self, request: Request) -> int:
        return len(self._blocks.get(request.request_id, ()))

    def find_cached_prefix(self, request: Request) -> CachedPrefix:
        """The longest run of cached leading blocks, leaving at least one token to compute
        (the last token's logits are needed to sample)."""
        max_blocks = (request.num_tokens - 1) // self.block_size
        hits: list[Block] = []
        for block_hash in self._block_hashes(request)[:max_blocks]:
            block = self.pool.lookup(block_hash)
            if block is None:
                break
            hits.append(block)
        return CachedPrefix(tuple(hits), self.block_size)

    def allocate(
        self, request: Request, num_new_tokens: int, prefix: CachedPrefix | None = None
    ) -> bool:
        """Reserve room for ``num_new_tokens`` after the computed ones (and after ``prefix``,
        whose blocks get a reference). Returns ``False`` and changes nothing when the pool
        is short."""
        held = self._blocks.setdefault(request.request_id, [])
        hits = list(prefix.blocks) if prefix else []
        num_tokens = request.num_computed_tokens + len(hits) * self.block_size + num_new_tokens
        num_needed = -(-num_tokens // self.block_size) - len(held) - len(hits)
        reviving = sum(1 for b in hits if b.ref_count == 0)
        if num_needed > self.pool.num_free_blocks - reviving:
            return False
        self.pool.touch(hits)
        fresh = self.pool.allocate(max(num_needed, 0)) or []
        held.extend(hits)
        held.extend(fresh)
        if hits:
            self._num_published[request.request_id] = len(hits)
        return True

    def publish_full_blocks(self, request: Request) -> None:
        """Make every fully computed block of ``request`` findable by its hash. Called after
        each step that advanced ``request.num_computed_tokens``."""
        rid = request.request_id
        num_full = request.num_computed_tokens // self.block_size
        start = self._num_published.get(rid, 0)
        if num_full <= start:
            return
        hashes = self._block_hashes(request)
        parent = hashes[start - 1] if start else None
        self.pool.cache(self._blocks[rid][start:num_full], hashes[start:num_full], parent)
        self._num_published[rid] = num_full

    def trim(self, request: Request) -> None:
        """Drop blocks beyond what ``request.num_tokens`` needs (after rejected speculative
        tokens were rolled back). Those blocks hold no published KV."""
        held = self._blocks.get(request.request_id, [])
        keep = -(-request.num_tokens // self.block_size)
        if len(held) > keep:
            self.pool.free(held[keep:][::-1])
            del held[keep:]

    def free(self, request: Request) -> None:
        """Return all of ``request``'s blocks (tail first, so the tail is evicted first)."""
        rid = request.request_id
        blocks = self._blocks.pop(rid, [])
        self.pool.free(blocks[::-1])
        self._num_published.pop(rid, None)

    def forget(self, request: Request) -> None:
        """Drop per-request bookkeeping once the request is gone for good."""
        self.free(request)
        self._hashes.pop(request.request_id, None)

    def _block_hashes(self, request: Request) -> list[BlockHash]:
        """Hashes of the request's full blocks, extended incrementally as tokens arrive."""
        hashes = self._hashes.setdefault(request.request_id, [])
        if (len(hashes) + 1) * self.block_size <= request.num_tokens:
            parent = hashes[-1] if hashes else root_hash(request.kv_namespace)
            hashes.extend(
                hash_blocks(request.all_token_ids, self.block_size, parent, start_block=len(hashes))
            )
        return hashes
