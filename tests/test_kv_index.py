"""The KV index: what ``overlap`` answers, and how events and snapshots keep it honest
(gaps trigger resyncs, departed workers are purged, restarts are told apart)."""

from __future__ import annotations

import pytest

from tandem.common.hashing import hash_blocks
from tandem.common.kv_events.events import BlocksEvicted, BlocksStored, CacheCleared
from tandem.common.kv_events.wire import (
    CacheSnapshot,
    EventBatch,
    KVEventDecodeError,
    decode_batch,
    encode_batch,
    snapshot_from_proto,
    snapshot_to_proto,
)
from tandem.router.kv_index.index import PrefixIndex, PrefixMatch
from tandem.router.kv_index.indexer import KVIndexer

PROMPT = hash_blocks(list(range(160)), 16)  # 10 blocks
OTHER = hash_blocks(list(range(1000, 1160)), 16)


# ------------------------------------------------------------------ PrefixIndex


def test_overlap_counts_leading_blocks_per_worker() -> None:
    index = PrefixIndex()
    index.add("a", PROMPT[:4])
    index.add("b", PROMPT)
    index.add("c", OTHER)
    assert dict(index.overlap(PROMPT)) == {"a": 4, "b": 10}
    assert dict(index.overlap(PROMPT[:2])) == {"a": 2, "b": 2}
    assert dict(index.overlap(OTHER[:3])) == {"c": 3}
    assert dict(index.overlap([])) == {}


def test_a_missing_block_ends_the_match_even_if_later_blocks_are_held() -> None:
    index = PrefixIndex()
    index.add("a", PROMPT)
    index.remove("a", [PROMPT[3]])  # the engine's prefix match stops at block 3 too
    assert dict(index.overlap(PROMPT)) == {"a": 3}
    index.remove("a", [PROMPT[0]])
    assert dict(index.overlap(PROMPT)) == {}


def test_prefix_match_answers_like_a_mapping() -> None:
    index = PrefixIndex()
    index.add("a", PROMPT[:4])
    index.add("b", PROMPT)
    match = index.overlap(PROMPT)
    assert len(match) == 2 and match.max_blocks == 10
    assert match["a"] == 4 and match.get("b") == 10 and match.get("zz", 0) == 0
    assert "c" not in match
    assert PrefixMatch.of({"x": 2, "y": 0, "z": 5}) == {"x": 2, "z": 5}
    assert PrefixMatch.of({"x": 2, "z": 5}).max_blocks == 5


def test_dropped_worker_frees_its_slot_and_leaves_nothing_behind() -> None:
    index = PrefixIndex()
    index.add("a", PROMPT)
    index.add("b", PROMPT[:5])
    index.drop_worker("a")
    assert dict(index.overlap(PROMPT)) == {"b": 5}
    assert index.num_entries == 5 and index.num_hashes == 5
    index.add("c", OTHER)  # reuses a's slot
    assert dict(index.overlap(PROMPT)) == {"b": 5}
    assert dict(index.overlap(OTHER)) == {"c": 10}


def test_replace_worker_makes_a_snapshot_the_whole_truth() -> None:
    index = PrefixIndex()
    index.add("a", PROMPT)
    index.replace_worker("a", OTHER[:2])
    assert dict(index.overlap(PROMPT)) == {}
    assert dict(index.overlap(OTHER)) == {"a": 2}
    assert index.blocks_of("a") == frozenset(OTHER[:2])


def test_a_sample_of_holders_takes_the_deepest_first_and_spreads_over_the_rest() -> None:
    index = PrefixIndex()
    for i in range(100):
        index.add(f"w{i:03d}", PROMPT[: 5 if i < 90 else 10])
    match = index.overlap(PROMPT)
    sample = match.sample(20, 0.5)
    assert len(sample) == 20 and len({w for w, _ in sample}) == 20
    assert sample[:10] == [(f"w{i:03d}", 10) for i in range(90, 100)]
    assert all(blocks == 5 for _, blocks in sample[10:])
    assert match.sample(20, 0.0) != match.sample(20, 0.9)  # the offset moves the sample


def test_overlap_scales_with_prompt_blocks_not_with_holders() -> None:
    index = PrefixIndex()
    for i in range(1000):
        index.add(f"w{i:04d}", PROMPT)
    match = index.overlap(PROMPT)
    assert len(match) == 1000 and match.max_blocks == 10  # two groups' popcounts, no names
    assert match["w0500"] == 10


# ------------------------------------------------------------------ KVIndexer


def batch(seq: int, *events, worker: str = "a", epoch: int = 1) -> EventBatch:
    return EventBatch(worker, epoch, seq, tuple(events))


def stored(hashes, parent=None) -> BlocksStored:
    return BlocksStored(tuple(hashes), parent)


def live_indexer(*workers: str) -> KVIndexer:
    """Workers joined and synced from empty snapshots at seq 0 of epoch 1."""
    indexer = KVIndexer()
    for w in workers:
        assert indexer.worker_joined(w)
        indexer.apply_snapshot(CacheSnapshot(w, 1, 0, (), 16))
    return indexer


def test_events_in_order_change_the_index() -> None:
    indexer = live_indexer("a")
    assert not indexer.apply(batch(1, stored(PROMPT)))
    assert not indexer.apply(batch(2, BlocksEvicted(tuple(PROMPT[6:]))))
    assert dict(indexer.overlap(PROMPT)) == {"a": 6}
    assert not indexer.apply(batch(3, CacheCleared()))
    assert dict(indexer.overlap(PROMPT)) == {}
    assert indexer.last_seq("a") == 3


def test_a_gap_in_sequence_numbers_triggers_a_resync() -> None:
    indexer = live_indexer("a")
    indexer.apply(batch(1, stored(PROMPT[:4])))
    assert indexer.apply(batch(3, stored(PROMPT[4:6])))  # 2 was lost
    assert indexer.is_syncing("a") and indexer.stats.gaps == 1
    assert dict(indexer.overlap(PROMPT)) == {"a": 4}  # old entries answer meanwhile
    indexer.apply(batch(4, stored(PROMPT[6:8])))  # buffered
    # The snapshot reflects batches up to 3; 4 is replayed on top of it.
    assert not indexer.apply_snapshot(CacheSnapshot("a", 1, 3, tuple(PROMPT[:6]), 16))
    assert not indexer.is_syncing("a")
    assert dict(indexer.overlap(PROMPT)) == {"a": 8}
    assert indexer.last_seq("a") == 4


def test_a_watermark_ahead_of_the_index_triggers_a_resync() -> None:
    indexer = live_indexer("a")
    indexer.apply(batch(1, stored(PROMPT[:2])))
    assert not indexer.apply(batch(1))  # watermark agreeing with us
    assert indexer.apply(batch(2))  # watermark: batch 2 exists and we never saw it
    assert indexer.is_syncing("a")


def test_a_gap_found_while_replaying_asks_for_another_snapshot() -> None:
    indexer = live_indexer("a")
    assert indexer.apply(batch(2, stored(PROMPT[:2])))
    indexer.apply(batch(5, stored(PROMPT[2:4])))
    # the snapshot only covers up to 3: batch 4 is still missing
    assert indexer.apply_snapshot(CacheSnapshot("a", 1, 3, tuple(PROMPT[:2]), 16))
    assert indexer.is_syncing("a")
    assert not indexer.apply_snapshot(CacheSnapshot("a", 1, 5, tuple(PROMPT[:4]), 16))
    assert dict(indexer.overlap(PROMPT)) == {"a": 4}


def test_snapshot_replay_is_idempotent() -> None:
    indexer = live_indexer("a")
    assert indexer.apply(batch(2, stored(PROMPT[:4])))
    indexer.apply(batch(3, BlocksEvicted(tuple(PROMPT[2:4]))))
    # The snapshot was taken after batch 3 had already happened, but names seq 2.
    indexer.apply_snapshot(CacheSnapshot("a", 1, 2, tuple(PROMPT[:2]), 16))
    assert dict(indexer.overlap(PROMPT)) == {"a": 2}


def test_a_new_incarnation_starts_empty_and_an_old_one_is_ignored() -> None:
    indexer = live_indexer("a")
    indexer.apply(batch(1, stored(PROMPT)))
    assert not indexer.apply(batch(1, stored(OTHER[:3]), epoch=2))  # restarted worker
    assert dict(indexer.overlap(PROMPT)) == {}
    assert dict(indexer.overlap(OTHER)) == {"a": 3}
    assert not indexer.apply(batch(2, stored(PROMPT), epoch=1))  # a straggler of the old one
    assert dict(indexer.overlap(PROMPT)) == {}
    assert indexer.apply(batch(5, stored(PROMPT), epoch=3))  # restarted, and we missed 1-4
    assert indexer.is_syncing("a")


def test_events_of_workers_outside_the_registry_are_ignored() -> None:
    indexer = live_indexer("a")
    assert not indexer.apply(batch(1, stored(PROMPT), worker="ghost"))
    assert dict(indexer.overlap(PROMPT)) == {}
    assert indexer.stats.batches_ignored == 1


def test_a_worker_that_leaves_is_purged_at_once_and_never_comes_back_by_events() -> None:
    indexer = live_indexer("a", "b")
    indexer.apply(batch(1, stored(PROMPT)))
    indexer.apply(batch(1, stored(PROMPT[:3]), worker="b"))
    indexer.worker_left("a")
    assert dict(indexer.overlap(PROMPT)) == {"b": 3}
    assert "a" not in indexer.index.workers()
    indexer.apply(batch(2, stored(OTHER)))  # a late event of the departed worker
    assert dict(indexer.overlap(OTHER)) == {}


def test_a_joining_worker_buffers_until_its_snapshot() -> None:
    indexer = KVIndexer()
    assert indexer.worker_joined("a")
    indexer.apply(batch(7, stored(PROMPT[4:6])))
    assert dict(indexer.overlap(PROMPT)) == {}
    indexer.apply_snapshot(CacheSnapshot("a", 1, 6, tuple(PROMPT[:4]), 16))
    assert dict(indexer.overlap(PROMPT)) == {"a": 6}


def test_two_indexers_fed_the_same_stream_agree() -> None:
    stream = [
        batch(1, stored(PROMPT)),
        batch(1, stored(OTHER[:5]), worker="b"),
        batch(2, BlocksEvicted(tuple(PROMPT[5:]))),
        batch(2, stored(PROMPT[:7]), worker="b"),
    ]
    first, second = live_indexer("a", "b"), live_indexer("a", "b")
    for b in stream:
        first.apply(b)
        second.apply(b)
    for hashes in (PROMPT, OTHER, PROMPT[:3]):
        assert dict(first.overlap(hashes)) == dict(second.overlap(hashes))


# ------------------------------------------------------------------ wire codec


def test_event_batches_round_trip_through_the_wire_format() -> None:
    original = EventBatch(
        "prefill-0",
        123456789,
        42,
        (
            stored(PROMPT[:3]),
            stored(PROMPT[3:5], PROMPT[2]),
            BlocksEvicted((OTHER[0],)),
            CacheCleared(),
        ),
        1700000000.25,
    )
    assert decode_batch(encode_batch(original)) == original
    watermark = EventBatch("w", 1, 3, (), 2.0)
    assert decode_batch(encode_batch(watermark)).is_watermark


def test_snapshots_round_trip_through_the_rpc_message() -> None:
    snapshot = CacheSnapshot("decode-1", 9, 17, tuple(PROMPT), 16)
    assert snapshot_from_proto(snapshot_to_proto(snapshot)) == snapshot


@pytest.mark.parametrize("raw", [b"\xff\xff\xff", b"", b"\x08\x63"])
def test_garbage_is_refused_with_a_typed_error(raw: bytes) -> None:
    with pytest.raises(KVEventDecodeError):
        decode_batch(raw)
