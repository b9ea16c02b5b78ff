"""Typed prefix-cache events: what a worker's KV cache gained or lost.

The engine's block pool produces them; workers publish them (Redis streams) and the
router's prefix index consumes them. Torch-free.
"""

from __future__ import annotations

from dataclasses import dataclass

from tandem.common.hashing import BlockHash


@dataclass(frozen=True)
class BlocksStored:
    """Full blocks became reusable, in prompt order; ``parent`` precedes the first one."""

    block_hashes: tuple[BlockHash, ...]
    parent: BlockHash | None


@dataclass(frozen=True)
class BlocksEvicted:
    """Blocks left the cache (their memory was reused for other tokens)."""

    block_hashes: tuple[BlockHash, ...]


@dataclass(frozen=True)
class CacheCleared:
    """Every cached block is gone (reset or restart)."""


KVCacheEvent = BlocksStored | BlocksEvicted | CacheCleared
