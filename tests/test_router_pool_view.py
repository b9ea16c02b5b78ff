"""The two pool views answer every question a policy asks identically, and a policy
choosing through either picks the same worker; router modules import without torch."""

from __future__ import annotations

import random

from tandem.common.registry import WorkerCapacity, WorkerInfo, WorkerLoad, WorkerRecord, WorkerRole
from tandem.router.kv_index.index import PrefixMatch
from tandem.router.routing.policy import LeastLoaded, RoundRobin, RoutingRequest
from tandem.router.routing.pool_view import IndexedPool, ListPool
from tandem.router.routing.prefix_aware import PrefixAwarePolicy


def record(i: int, queued: int, running: int = 0, busy: float = 0.0) -> WorkerRecord:
    capacity = WorkerCapacity(num_kv_blocks=100, block_size=16, max_num_seqs=8)
    info = WorkerInfo(f"w{i:02d}", WorkerRole.PREFILL, f"h:{i}", "m", capacity)
    return WorkerRecord(info, WorkerLoad(100 - running, running, 0, queued, 0.0, busy))


def test_indexed_pool_answers_like_a_list_pool_through_updates_and_removals() -> None:
    rng = random.Random(1)
    policy = PrefixAwarePolicy()
    indexed = IndexedPool(policy.load_key)
    current: dict[int, WorkerRecord] = {}
    for step in range(400):
        i = rng.randrange(30)
        if rng.random() < 0.1 and i in current:
            del current[i]
            indexed.remove(f"w{i:02d}")
        else:
            queued = rng.choice([0, 0, rng.randrange(1, 500)])
            current[i] = record(i, queued, rng.randrange(4), rng.choice([0.0, 0.25, 0.5]))
            indexed.update(current[i])
        listed = ListPool(list(current.values()), policy.load_key)
        assert len(indexed) == len(listed)
        assert indexed.mean_load() == listed.mean_load()
        assert abs(indexed.mean_busy() - listed.mean_busy()) < 1e-9
        assert indexed.cheapest(5) == listed.cheapest(5)
        skip = {f"w{j:02d}" for j in range(0, 30, 3)}
        assert indexed.cheapest(4, skip) == listed.cheapest(4, skip)
        for u in (0.0, 0.37, 0.99):
            assert indexed.idle_at(u) == listed.idle_at(u)
        for after in (None, "w05", "w29"):
            assert indexed.first_after(after) == listed.first_after(after)
        req = RoutingRequest(
            f"r{step}", 800, matched_blocks=PrefixMatch.of({f"w{j:02d}": 20 for j in range(5)})
        )
        for p in (policy, LeastLoaded(), RoundRobin()):
            assert p.choose(req, indexed) == p.choose(req, listed)


def test_replace_all_makes_the_given_records_the_whole_pool() -> None:
    pool = IndexedPool(LeastLoaded().load_key)
    pool.replace_all([record(i, 10 * i) for i in range(5)])
    pool.replace_all([record(i, 10 * i) for i in range(2, 7)])
    assert len(pool) == 5 and pool.get("w00") is None
    assert [r.info.worker_id for r in pool.cheapest(10)] == [f"w{i:02d}" for i in range(2, 7)]
