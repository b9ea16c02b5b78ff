"""How the routing policies choose a worker, one behaviour per test."""

from __future__ import annotations

import random

import pytest

from tandem.common.registry import WorkerCapacity, WorkerInfo, WorkerLoad, WorkerRecord, WorkerRole
from tandem.router.routing.policy import (
    LeastLoaded,
    PolicyName,
    RoundRobin,
    RoutingPolicy,
    RoutingRequest,
    make_policy,
)

REQUEST = RoutingRequest(request_id="r1", num_prompt_tokens=100)


def prefill(worker_id: str, queued_tokens: int = 0, waiting: int = 0) -> WorkerRecord:
    return _record(worker_id, WorkerRole.PREFILL, 64, WorkerLoad(64, 0, waiting, queued_tokens))


def decode(worker_id: str, free: int, total: int = 100, running: int = 0) -> WorkerRecord:
    return _record(worker_id, WorkerRole.DECODE, total, WorkerLoad(free, running, 0, 0))


def _record(worker_id: str, role: WorkerRole, blocks: int, load: WorkerLoad) -> WorkerRecord:
    capacity = WorkerCapacity(num_kv_blocks=blocks, block_size=16, max_num_seqs=8)
    info = WorkerInfo(worker_id, role, f"{worker_id}:50051", "llama-tiny", capacity)
    return WorkerRecord(info, load)


def dispatch(policy: RoutingPolicy, workers: list[WorkerRecord], times: int) -> list[str]:
    """What the router does: select, then record the choice; the ids chosen in order."""
    chosen = []
    for _ in range(times):
        choice = policy.select(REQUEST, workers)
        assert choice is not None
        policy.record(REQUEST, choice)
        chosen.append(choice.info.worker_id)
    return chosen


@pytest.mark.parametrize("name", list(PolicyName))
def test_empty_pool_gives_none(name: PolicyName) -> None:
    assert make_policy(name).select(REQUEST, []) is None


@pytest.mark.parametrize("name", list(PolicyName))
def test_select_is_pure(name: PolicyName) -> None:
    policy = make_policy(name)
    workers = [prefill("a", 10), prefill("b", 5), prefill("c", 7)]
    first = policy.select(REQUEST, workers)
    assert all(policy.select(REQUEST, workers) == first for _ in range(5))


def test_round_robin_cycles_in_worker_id_order_whatever_the_list_order() -> None:
    workers = [prefill("b"), prefill("c"), prefill("a")]
    policy = RoundRobin()
    assert dispatch(policy, workers, 3) == ["a", "b", "c"]
    random.Random(0).shuffle(workers)
    assert dispatch(policy, workers, 4) == ["a", "b", "c", "a"]


def test_round_robin_never_chooses_a_removed_worker_and_skips_no_one() -> None:
    policy = RoundRobin()
    assert dispatch(policy, [prefill("a"), prefill("b"), prefill("c")], 1) == ["a"]
    # "b" leaves: the cycle goes on with the rest, in order.
    assert dispatch(policy, [prefill("a"), prefill("c")], 3) == ["c", "a", "c"]
    # the last chosen worker leaves: its successor is next, not the start of the list.
    assert dispatch(policy, [prefill("a"), prefill("b"), prefill("d")], 2) == ["d", "a"]


def test_round_robin_includes_a_worker_that_joins() -> None:
    policy = RoundRobin()
    assert dispatch(policy, [prefill("a"), prefill("c")], 1) == ["a"]
    assert dispatch(policy, [prefill("a"), prefill("b"), prefill("c")], 3) == ["b", "c", "a"]


def test_least_loaded_prefill_picks_fewest_queued_tokens_then_fewest_waiting() -> None:
    policy = LeastLoaded()
    busy, idle = prefill("a", queued_tokens=500), prefill("b", queued_tokens=20)
    assert policy.select(REQUEST, [busy, idle]) == idle
    short_queue = prefill("c", queued_tokens=20, waiting=0)
    long_queue = prefill("d", queued_tokens=20, waiting=3)
    assert policy.select(REQUEST, [long_queue, short_queue]) == short_queue


def test_least_loaded_decode_picks_largest_free_share_then_fewest_running() -> None:
    policy = LeastLoaded()
    # 60 of 200 blocks free (30%) is busier than 40 of 100 (40%), despite more blocks.
    big_but_full, small_but_free = decode("a", free=60, total=200), decode("b", free=40)
    assert policy.select(REQUEST, [big_but_full, small_but_free]) == small_but_free
    crowded, quiet = decode("c", free=50, running=7), decode("d", free=50, running=2)
    assert policy.select(REQUEST, [crowded, quiet]) == quiet


def test_least_loaded_breaks_ties_by_smallest_worker_id() -> None:
    policy = LeastLoaded()
    same_prefill = [prefill("w3", 10), prefill("w1", 10), prefill("w2", 10)]
    assert policy.select(REQUEST, same_prefill).info.worker_id == "w1"
    # equal shares from different sizes (25/50 == 50/100) are a tie too.
    same_decode = [decode("y", free=50, total=100), decode("x", free=25, total=50)]
    assert policy.select(REQUEST, same_decode).info.worker_id == "x"


def test_least_loaded_never_chooses_a_removed_worker() -> None:
    policy = LeastLoaded()
    idlest = prefill("a", queued_tokens=0)
    rest = [prefill("b", queued_tokens=10), prefill("c", queued_tokens=30)]
    assert policy.select(REQUEST, [idlest, *rest]) == idlest
    assert policy.select(REQUEST, rest).info.worker_id == "b"


def test_least_loaded_follows_the_latest_load_report() -> None:
    policy = LeastLoaded()
    workers = [prefill("a", queued_tokens=0), prefill("b", queued_tokens=100)]
    assert policy.select(REQUEST, workers).info.worker_id == "a"
    workers = [prefill("a", queued_tokens=300), prefill("b", queued_tokens=100)]
    assert policy.select(REQUEST, workers).info.worker_id == "b"


def test_routing_request_rejects_a_negative_length() -> None:
    with pytest.raises(ValueError, match="num_prompt_tokens"):
        RoutingRequest(request_id="r", num_prompt_tokens=-1)
