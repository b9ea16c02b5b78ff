"""The pool of fixed-size KV blocks: reference counts, prefix-cache lookup, LRU eviction.

Ownership: a block with ``ref_count > 0`` belongs to the running requests that share it
and is never reused. A freed block that holds a full, hashed block of tokens stays
findable by its hash (a prefix-cache entry) until its memory is needed; freed blocks
without a hash are reused first, and hashed ones are evicted least-recently-freed
first. Torch-free: a block is an id into the model runner's KV tensors.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from tandem.common.hashing import BlockHash
from tandem.common.kv_events.events import BlocksEvicted, BlocksStored, CacheCleared, KVCacheEvent


@dataclass(eq=False)
class Block:
    block_id: int
    ref_count: int = 0
    block_hash: BlockHash | None = None


class BlockPool:
    def __init__(self, num_blocks: int, enable_caching: bool = True) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        self._unhashed_free: list[Block] = list(reversed(self.blocks))  # a stack: pop() is O(1)
        self._evictable: OrderedDict[int, Block] = OrderedDict()  # freed, hashed; LRU first
        self._cached: dict[BlockHash, Block] = {}
        self._events: list[KVCacheEvent] = []

    @property
    def num_free_blocks(self) -> int:
        """Blocks an allocation can take right now (unhashed free + evictable cached)."""
        return len(self._unhashed_free) + len(self._evictable)

    @property
    def num_cached_blocks(self) -> int:
        return len(self._cached)

    def cached_hashes(self) -> list[BlockHash]:
        """Every hash now findable in the prefix cache (a snapshot for resyncing an index
        that missed events); O(cached blocks)."""
        return list(self._cached)

    def lookup(self, block_hash: BlockHash) -> Block | None:
        return self._cached.get(block_hash) if self.enable_caching else None

    def allocate(self, n: int) -> list[Block] | None:
        """``n`` fresh blocks with ``ref_count == 1``, or ``None`` (and no change) if short."""
        if n > self.num_free_blocks:
            return None
        out, evicted = [], []
        for _ in range(n):
            if self._unhashed_free:
                block = self._unhashed_free.pop()
            else:
                block = self._evict_lru()
                evicted.append(block.block_hash)
                block.block_hash = None
            block.ref_count = 1
            out.append(block)
        if evicted:
            self._events.append(BlocksEvicted(tuple(evicted)))
        return out

    def touch(self, blocks: list[Block]) -> None:
        """Take a reference on prefix-cache hits (reviving them if they were evictable)."""
        for block in blocks:
            if block.ref_count == 0:
                del self._evictable[block.block_id]
            block.ref_count += 1

    def free(self, blocks: list[Block]) -> None:
        """Drop one reference each; blocks reaching zero become reusable in the given order
        (so pass a request's blocks tail first: its tail is then evicted first)."""
        for block in blocks:
            block.ref_count -= 1
            if block.ref_count > 0:
                continue
            if block.block_hash is None:
                self._unhashed_free.append(block)
            else:
                self._evictable[block.block_id] = block

    def cache(self, blocks: list[Block], hashes: list[BlockHash], parent: BlockHash | None) -> None:
        """Publish newly filled blocks under their hashes. A hash already cached by another
        block (two identical prompts computed at once) keeps the first; the duplicate stays
        private to its request and is recycled when freed."""
        if not self.enable_caching:
            return
        stored = []
        for block, block_hash in zip(blocks, hashes, strict=True):
            if block_hash in self._cached:
                continue
            block.block_hash = block_hash
            self._cached[block_hash] = block
            stored.append(block_hash)
        if stored:
            self._events.append(BlocksStored(tuple(stored), parent))

    def reset_prefix_cache(self) -> bool:
        """Forget every cached block; refused (``False``) while any block is in use."""
        if any(b.ref_count for b in self.blocks):
            return False
        for block in self.blocks:
            block.block_hash = None
        self._cached.clear()
        self._evictable.clear()
        self._unhashed_free = list(reversed(self.blocks))
        self._events.append(CacheCleared())
        return True

    def take_events(self) -> list[KVCacheEvent]:
        """Events since the last call, oldest first (the engine drains this once a step)."""
        events, self._events = self._events, []
        return events

    def _evict_lru(self) -> Block:
        """Unlink the least recently freed cached block; the caller clears its hash."""
        _, block = self._evictable.popitem(last=False)
        del self._cached[block.block_hash]
        return block
