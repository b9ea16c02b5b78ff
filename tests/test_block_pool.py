"""Block pool and per-request KV accounting (torch-free)."""

from __future__ import annotations

from tandem.common.hashing import hash_blocks
from tandem.common.kv_events.events import BlocksEvicted, BlocksStored, CacheCleared
from tandem.common.sampling_params import SamplingParams
from tandem.engine.block_pool import BlockPool
from tandem.engine.kv_cache_manager import KVCacheManager
from tandem.engine.request import Request


def _request(rid: str, tokens: list[int]) -> Request:
    return Request(rid, tokens, SamplingParams())


def _compute_all(kv: KVCacheManager, request: Request) -> None:
    assert kv.allocate(request, request.num_tokens - request.num_computed_tokens)
    request.num_computed_tokens = request.num_tokens
    kv.publish_full_blocks(request)


def test_allocate_refuses_without_side_effects_when_short() -> None:
    pool = BlockPool(4)
    assert pool.allocate(5) is None
    assert pool.num_free_blocks == 4
    blocks = pool.allocate(4)
    assert blocks is not None and {b.ref_count for b in blocks} == {1}
    assert pool.num_free_blocks == 0


def test_prefix_hit_shares_blocks_and_leaves_last_token_to_compute() -> None:
    pool = BlockPool(16)
    kv = KVCacheManager(pool, block_size=4)
    a = _request("a", list(range(12)))
    _compute_all(kv, a)
    assert pool.num_cached_blocks == 3
    # Same 12 tokens: at most 2 blocks may be reused (the last token must be computed).
    b = _request("b", list(range(12)))
    prefix = kv.find_cached_prefix(b)
    assert prefix.num_tokens == 8
    assert kv.allocate(b, b.num_tokens - prefix.num_tokens, prefix)
    assert kv.block_ids(b)[:2] == kv.block_ids(a)[:2]
    assert pool.blocks[kv.block_ids(a)[0]].ref_count == 2
    # A diverging prompt shares only the common leading block.
    c = _request("c", [0, 1, 2, 3, 99, 5, 6, 7, 8])
    assert kv.find_cached_prefix(c).num_tokens == 4


def test_freed_cached_blocks_are_evicted_lru_and_only_when_needed() -> None:
    pool = BlockPool(4)
    kv = KVCacheManager(pool, block_size=2)
    old, new = _request("old", [1, 2, 3, 4]), _request("new", [5, 6, 7, 8])
    for r in (old, new):
        _compute_all(kv, r)
        kv.free(r)
    assert pool.num_free_blocks == 4 and pool.num_cached_blocks == 4
    pool.take_events()
    # Two fresh blocks: the least recently freed (old's, tail first) are evicted.
    assert pool.allocate(2) is not None
    events = pool.take_events()
    old_hashes = hash_blocks([1, 2, 3, 4], 2)
    assert events == [BlocksEvicted((old_hashes[1], old_hashes[0]))]
    assert kv.find_cached_prefix(_request("x", [5, 6, 7, 8, 9])).num_tokens == 4
    assert kv.find_cached_prefix(_request("y", [1, 2, 3, 4, 9])).num_tokens == 0


def test_unhashed_free_blocks_are_used_before_evicting_cache() -> None:
    pool = BlockPool(4)
    kv = KVCacheManager(pool, block_size=2)
    r = _request("r", [1, 2, 3, 4])
    _compute_all(kv, r)
    kv.free(r)
    assert pool.allocate(2) is not None
    assert pool.num_cached_blocks == 2  # nothing evicted: two plain free blocks existed


def test_stored_events_carry_parent_and_order() -> None:
    pool = BlockPool(8)
    kv = KVCacheManager(pool, block_size=2)
    r = _request("r", [1, 2, 3, 4, 5, 6])
    assert kv.allocate(r, 4)
    r.num_computed_tokens = 4
    kv.publish_full_blocks(r)
    assert kv.allocate(r, 2)
    r.num_computed_tokens = 6
    kv.publish_full_blocks(r)
    h = hash_blocks([1, 2, 3, 4, 5, 6], 2)
    assert pool.take_events() == [BlocksStored((h[0], h[1]), None), BlocksStored((h[2],), h[1])]


def test_duplicate_content_keeps_first_block_and_recycles_duplicate() -> None:
    pool = BlockPool(8)
    kv = KVCacheManager(pool, block_size=2)
    a, b = _request("a", [1, 2, 3]), _request("b", [1, 2, 3])
    for r in (a, b):  # both computed "at once": neither saw the other's cache entry
        assert kv.allocate(r, 3)
    for r in (a, b):
        r.num_computed_tokens = 3
        kv.publish_full_blocks(r)
    assert pool.num_cached_blocks == 1
    kv.free(a)
    kv.free(b)
    assert pool.num_free_blocks == 8 and pool.num_cached_blocks == 1


def test_reset_prefix_cache_refused_while_blocks_in_use() -> None:
    pool = BlockPool(4)
    kv = KVCacheManager(pool, block_size=2)
    r = _request("r", [1, 2, 3])
    _compute_all(kv, r)
    assert not pool.reset_prefix_cache()
    kv.free(r)
    pool.take_events()
    assert pool.reset_prefix_cache()
    assert pool.num_cached_blocks == 0 and pool.take_events() == [CacheCleared()]


def test_caching_disabled_never_hits() -> None:
    pool = BlockPool(8, enable_caching=False)
    kv = KVCacheManager(pool, block_size=2)
    r = _request("r", [1, 2, 3, 4, 5])
    _compute_all(kv, r)
    assert kv.find_cached_prefix(_request("s", [1, 2, 3, 4, 5])).num_tokens == 0
    assert pool.take_events() == []


def test_cached_hashes_lists_exactly_the_findable_blocks() -> None:
    pool = BlockPool(4)
    kv = KVCacheManager(pool, block_size=2)
    r = _request("r", [1, 2, 3, 4, 5])
    _compute_all(kv, r)
    assert pool.cached_hashes() == hash_blocks([1, 2, 3, 4], 2)
    kv.free(r)
    assert pool.allocate(4) is not None  # evicts both cached blocks
    assert pool.cached_hashes() == []
