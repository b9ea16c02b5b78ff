"""How the prefix-aware policy chooses, one behaviour per test: affinity, the load
guard, KV room, tie-breaks, temperature, and that the choice is pure and the same on
every router replica."""

from __future__ import annotations

import dataclasses
import random

import pytest

from tandem.common.registry import WorkerCapacity, WorkerInfo, WorkerLoad, WorkerRecord, WorkerRole
from tandem.router.kv_index.index import PrefixMatch
from tandem.router.routing.policy import PolicyName, RoutingRequest, make_policy
from tandem.router.routing.pool_view import ListPool
from tandem.router.routing.prefix_aware import DIRECT_HOLDERS, PrefixAwarePolicy, PrefixCost

BLOCK = 16


def prefill(worker_id: str, queued: int = 0, free: int = 1000) -> WorkerRecord:
    return _record(worker_id, WorkerRole.PREFILL, WorkerLoad(free, 0, 0, queued))


def decode(worker_id: str, running: int = 0, free: int = 1000) -> WorkerRecord:
    return _record(worker_id, WorkerRole.DECODE, WorkerLoad(free, running, 0, 0))


def _record(worker_id: str, role: WorkerRole, load: WorkerLoad) -> WorkerRecord:
    capacity = WorkerCapacity(num_kv_blocks=1000, block_size=BLOCK, max_num_seqs=64)
    return WorkerRecord(WorkerInfo(worker_id, role, f"{worker_id}:1", "m", capacity), load)


def request(
    tokens: int = 1600, matched: dict[str, int] | None = None, rid: str = "r"
) -> RoutingRequest:
    return RoutingRequest(rid, tokens, matched_blocks=PrefixMatch.of(matched or {}))


def choose(policy: PrefixAwarePolicy, req: RoutingRequest, workers: list[WorkerRecord]) -> str:
    choice = policy.select(req, workers)
    assert choice is not None
    return choice.info.worker_id


POLICY = PrefixAwarePolicy()
UNGUARDED = PrefixAwarePolicy(PrefixCost(imbalance_limit=100.0))  # the cost alone decides
IDLE = [prefill("a"), prefill("b"), prefill("c")]


def test_same_prefix_goes_to_the_worker_that_holds_it() -> None:
    for holder in ("a", "b", "c"):
        assert choose(POLICY, request(matched={holder: 90}), IDLE) == holder


def test_the_deepest_match_wins_between_holders() -> None:
    assert choose(POLICY, request(matched={"a": 20, "b": 90, "c": 50}), IDLE) == "b"


def test_affinity_is_worth_exactly_the_tokens_it_saves() -> None:
    # b holds 50 blocks (800 tokens) but has 900 tokens queued: a is cheaper (1600 < 1700).
    workers = [prefill("a"), prefill("b", queued=900)]
    assert choose(UNGUARDED, request(matched={"b": 50}), workers) == "a"
    workers = [prefill("a"), prefill("b", queued=700)]
    assert choose(UNGUARDED, request(matched={"b": 50}), workers) == "b"


def test_imbalance_overrides_affinity() -> None:
    # The holder saves 1,440 tokens, more than its excess queue, but sits beyond the guard.
    cost = PrefixCost(imbalance_limit=1.25, imbalance_slack=0)
    workers = [prefill("a", queued=1200), prefill("b", queued=100), prefill("c", queued=100)]
    req = request(matched={"a": 90})
    assert choose(PrefixAwarePolicy(cost), req, workers) == "b"
    decision = PrefixAwarePolicy(cost).decide(
        req, ListPool(workers, PrefixAwarePolicy(cost).load_key)
    )
    assert decision is not None and decision.num_guarded == 1 and decision.matched_blocks == 0
    # Without the guard the cost alone keeps the work on the holder.
    unguarded = PrefixCost(imbalance_limit=100.0)
    assert choose(PrefixAwarePolicy(unguarded), req, workers) == "a"


def test_a_hot_prefix_spreads_once_its_holder_is_loaded() -> None:
    """Dispatch one prefix repeatedly, updating loads like in-flight accounting does:
    the guard keeps max/mean queued tokens bounded while most requests still hit."""
    cost = PrefixCost(imbalance_limit=1.25, imbalance_slack=0)
    policy = PrefixAwarePolicy(cost)
    queued = {w: 0 for w in "abcd"}
    holders: set[str] = set()
    hits = 0
    for i in range(400):
        workers = [prefill(w, queued=q) for w, q in queued.items()]
        req = request(2000, matched={h: 120 for h in holders}, rid=f"r{i}")
        chosen = choose(policy, req, workers)
        hit = chosen in holders
        hits += hit
        queued[chosen] += 80 if hit else 2000
        holders.add(chosen)
        for w in queued:  # the workers drain
            queued[w] = max(0, queued[w] - 300)
    loads = list(queued.values())
    assert max(loads) <= 1.25 * (sum(loads) / len(loads)) + 2000
    assert hits >= 390


def test_a_removed_worker_is_never_chosen_even_if_the_index_still_names_it() -> None:
    workers = [prefill("b"), prefill("c")]  # "a" left the pool
    assert choose(POLICY, request(matched={"a": 99}), workers) in {"b", "c"}


def test_without_a_match_the_least_loaded_worker_is_chosen() -> None:
    workers = [prefill("a", queued=50), prefill("b", queued=10), prefill("c", queued=30)]
    assert choose(POLICY, request(), workers) == "b"


def test_ties_go_to_more_matched_blocks_then_less_load_then_a_draw_by_request_id() -> None:
    # a: 1600 uncached + 0 queued; b: 800 uncached + 800 queued -> equal cost, b matched more
    workers = [prefill("a"), prefill("b", queued=800)]
    assert choose(UNGUARDED, request(matched={"b": 50}), workers) == "b"
    # a: 1600 uncached + 100 queued; b: (1600 - 160) + 260: equal cost, b matched more
    workers = [prefill("a", queued=100), prefill("b", queued=260)]
    assert choose(UNGUARDED, request(matched={"b": 10}), workers) == "b"  # same cost, more match
    # equal cost, match and load: drawn by request id, the same for the same id
    busy = [prefill("a", queued=5), prefill("b", queued=5), prefill("c", queued=5)]
    picks = [choose(POLICY, request(rid=f"t{i}"), busy) for i in range(60)]
    assert set(picks) == {"a", "b", "c"}
    assert picks == [choose(POLICY, request(rid=f"t{i}"), busy[::-1]) for i in range(60)]


def test_ties_between_idle_workers_spread_evenly_and_replicas_agree() -> None:
    workers = [prefill(f"w{i}") for i in range(8)] + [prefill("busy", queued=10)]
    picks = [choose(POLICY, request(rid=f"r{i}"), workers) for i in range(400)]
    counts = {w.info.worker_id: picks.count(w.info.worker_id) for w in workers}
    assert counts["busy"] == 0
    assert min(v for w, v in counts.items() if w != "busy") >= 30  # not all on "w0": ~50 each
    replica = PrefixAwarePolicy()  # another router process
    assert picks == [choose(replica, request(rid=f"r{i}"), workers) for i in range(400)]


def test_a_miss_leans_to_the_least_busy_of_the_idle_workers_drawn() -> None:
    """All idle, all missing the prompt: each decision draws ``idle_choices`` of the tied
    workers by its request id and takes the one least busy lately, so over many misses the chosen
    workers' mean busy share is well below the pool's, yet the misses still spread over
    many workers (no flood onto the single least busy). The same on every replica and in
    any list order."""

    def idle(worker_id: str, share: float) -> WorkerRecord:
        return _record(
            worker_id, WorkerRole.PREFILL, WorkerLoad(1000, 0, 0, 0, busy_fraction=share)
        )

    draw = random.Random(0)
    workers = [idle(f"w{i}", round(draw.uniform(0.0, 0.4), 3)) for i in range(16)]
    by_id = {w.info.worker_id: w.load.busy_fraction for w in workers}
    rids = [f"m{i}" for i in range(400)]
    picks = [choose(POLICY, request(rid=rid), workers) for rid in rids]
    assert picks == [choose(POLICY, request(rid=rid), workers[::-1]) for rid in rids]
    replica = PrefixAwarePolicy()
    assert picks == [choose(replica, request(rid=rid), workers) for rid in rids]
    pool_mean = sum(by_id.values()) / len(by_id)
    assert sum(by_id[p] for p in picks) / len(picks) < pool_mean - 0.04
    assert len(set(picks)) >= 8
    with pytest.raises(ValueError, match="busy_limit"):
        PrefixCost(busy_limit=0.9)
    with pytest.raises(ValueError, match="idle_choices"):
        PrefixCost(idle_choices=0)


def test_ties_between_idle_holders_spread_evenly() -> None:
    holders = {f"w{i}": 90 for i in range(6)}
    workers = [prefill(f"w{i}") for i in range(8)]
    picks = [choose(POLICY, request(matched=holders, rid=f"r{i}"), workers) for i in range(300)]
    assert set(picks) == set(holders)
    assert min(picks.count(w) for w in holders) >= 25  # ~50 each


def test_a_worker_without_kv_room_is_avoided_unless_none_has_room() -> None:
    # 1600 tokens = 100 blocks; a holds 10 of them and has 50 free: no room for 90.
    workers = [prefill("a", free=50), prefill("b", queued=500)]
    assert choose(POLICY, request(matched={"a": 10}), workers) == "b"
    full = [prefill("a", free=50), prefill("b", free=20)]
    assert choose(POLICY, request(matched={"a": 10}), full) == "a"


def test_select_is_pure_and_ignores_candidate_order() -> None:
    workers = [prefill("a", queued=300), prefill("b", queued=200), prefill("c")]
    req = request(matched={"a": 40, "b": 10})
    first = choose(POLICY, req, workers)
    for seed in range(5):
        random.Random(seed).shuffle(workers)
        assert choose(POLICY, req, workers) == first


def test_temperature_spreads_choices_deterministically_per_request_id() -> None:
    policy = PrefixAwarePolicy(PrefixCost(temperature=1.0))
    workers = [prefill(w, queued=q) for w, q in (("a", 0), ("b", 100), ("c", 200), ("d", 300))]
    picks = [choose(policy, request(rid=f"req-{i}"), workers) for i in range(200)]
    assert len(set(picks)) >= 3  # softened: not always the cheapest
    assert picks.count("a") > picks.count("d")  # but cheaper is likelier
    replica = PrefixAwarePolicy(PrefixCost(temperature=1.0))  # another router process
    assert picks == [choose(replica, request(rid=f"req-{i}"), workers) for i in range(200)]


def test_with_many_holders_a_sample_of_them_finds_a_nearly_best_one() -> None:
    policy = PrefixAwarePolicy(PrefixCost(imbalance_limit=100.0))  # no guard: plain cost
    rng = random.Random(3)
    workers = [prefill(f"w{i:03d}", queued=rng.randrange(1, 3000)) for i in range(300)]
    for trial in range(30):
        holders = {w.info.worker_id: 90 for w in rng.sample(workers, 150)}
        assert len(holders) > DIRECT_HOLDERS
        req = request(matched=holders, rid=f"t{trial}")
        chosen = choose(policy, req, workers)
        costs = sorted(
            w.load.num_queued_prefill_tokens for w in workers if w.info.worker_id in holders
        )
        assert chosen in holders
        chosen_queue = next(w for w in workers if w.info.worker_id == chosen)
        assert chosen_queue.load.num_queued_prefill_tokens <= costs[len(costs) // 4]


def test_decode_prefers_a_holder_but_not_a_crowded_one() -> None:
    policy = make_policy(PolicyName.PREFIX_AWARE, WorkerRole.DECODE)
    workers = [decode("a", running=4), decode("b", running=4)]
    assert choose(policy, request(matched={"b": 90}), workers) == "b"  # fewer blocks to pull
    crowded = [decode("a", running=4), decode("b", running=40)]
    assert choose(policy, request(matched={"b": 90}), crowded) == "a"
    no_room = [decode("a", running=4), decode("b", running=4, free=5)]
    assert choose(policy, request(matched={"b": 10}), no_room) == "a"


def test_the_busy_guard_sees_a_holder_that_is_idle_now_but_busy_over_time() -> None:
    """Queues all empty (a lightly loaded pool at the moment of the decision), but the
    holders have been busy 40% of the time against 10% for the others: with the busy
    guard on, the prefix spreads to an idle non-holder; off, it stays."""

    def busy(worker_id: str, share: float) -> WorkerRecord:
        return _record(
            worker_id, WorkerRole.PREFILL, WorkerLoad(1000, 0, 0, 0, busy_fraction=share)
        )

    pool = [busy("a", 0.4), busy("b", 0.4), busy("c", 0.1), busy("d", 0.1)]
    req = request(matched={"a": 90, "b": 90})
    unguarded = PrefixAwarePolicy(PrefixCost(busy_slack=None))
    assert choose(unguarded, req, pool) in ("a", "b")
    guarded = PrefixAwarePolicy(PrefixCost(busy_slack=0.02))
    assert choose(guarded, req, pool) in ("c", "d")
    decision = guarded.decide(req, ListPool(pool, guarded.load_key))
    assert decision is not None and decision.num_guarded == 2
    # One holder within the limit (1.1 x mean 0.1875 + 0.02 = 0.226): it keeps the hit.
    pool[1] = busy("b", 0.2)
    assert choose(guarded, req, pool) == "b"
    # On in the prefill pool by default, off in the decode pool.
    assert PrefixCost.default_for(WorkerRole.PREFILL).busy_slack == 0.0
    assert PrefixCost.default_for(WorkerRole.DECODE).busy_slack is None
    # On a pool busy half the time or more it stands aside: queues show imbalance there,
    # and spilling misses onto a busy pool feeds on itself.
    loaded = [busy("a", 0.9), busy("b", 0.9), busy("c", 0.3), busy("d", 0.3)]  # mean 0.6
    assert choose(guarded, req, loaded) in ("a", "b")
    with pytest.raises(ValueError, match="busy_max_mean"):
        PrefixCost(busy_max_mean=0.0)
    with pytest.raises(ValueError, match="busy_slack"):
        PrefixCost(busy_slack=-0.1)
    with pytest.raises(ValueError, match="busy_min_holders"):
        PrefixCost(busy_min_holders=0)


def test_the_busy_guard_leaves_a_prefix_only_one_worker_holds() -> None:
    """A prefix held by one worker of the pool (a chat conversation) stays there however
    busy its holder has been: moving it would recompute it and keep a second copy. Held
    by two (once spread for load), the busier holder loses its credit. Holders in the
    other pool do not count."""

    def busy(worker_id: str, share: float, role: WorkerRole = WorkerRole.PREFILL):
        return _record(worker_id, role, WorkerLoad(1000, 0, 0, 0, busy_fraction=share))

    pool = [busy("a", 0.4), busy("b", 0.1), busy("c", 0.1)]
    guarded = PrefixAwarePolicy(PrefixCost(busy_slack=0.0))
    # "dec" holds it too but is not in this pool.
    assert choose(guarded, request(matched={"a": 90, "dec": 90}), pool) == "a"
    assert choose(guarded, request(matched={"a": 90, "b": 90}), pool) == "b"
    # With the minimum at 3, two holders are not enough: both keep their credit and the
    # cheaper tie-break (the deeper match) wins.
    strict = PrefixAwarePolicy(PrefixCost(busy_slack=0.0, busy_min_holders=3))
    assert choose(strict, request(matched={"a": 90, "b": 80}), pool) == "a"


def test_empty_pool_gives_none_and_bad_weights_are_refused() -> None:
    assert POLICY.select(request(), []) is None
    with pytest.raises(ValueError, match="imbalance_limit"):
        PrefixCost(imbalance_limit=0.5)
    with pytest.raises(ValueError, match="temperature"):
        dataclasses.replace(PrefixCost(), temperature=-1)


def test_router_flags_set_both_pools_costs_over_their_role_defaults() -> None:
    from tandem.cli.main import build_parser
    from tandem.cli.router import prefix_cost

    prefill, decode = WorkerRole.PREFILL, WorkerRole.DECODE
    base = ["router", "--model", "m", "--redis-url", "redis://x"]
    args = build_parser().parse_args(base)
    assert args.prefill_policy == args.decode_policy == "prefix_aware"
    for role in (prefill, decode):
        assert prefix_cost(role, args) == PrefixCost.default_for(role)
    assert prefix_cost(prefill, args).busy_slack == 0.0  # the busy guard is on
    assert prefix_cost(decode, args).busy_slack is None  # and off for the decode pool
    flags = ["--routing-temperature", "0.5", "--imbalance-limit", "2", "--imbalance-slack", "9"]
    busy = ["--imbalance-busy-slack", "0.02", "--imbalance-busy-limit", "1.5"]
    args = build_parser().parse_args([*base, *flags, *busy, "--idle-choices", "3"])
    for role in (prefill, decode):
        cost = prefix_cost(role, args)
        assert (cost.temperature, cost.imbalance_limit, cost.imbalance_slack) == (0.5, 2.0, 9.0)
        assert cost.idle_choices == 3
        # the role's own weights stay
        assert cost.decode_weight == PrefixCost.default_for(role).decode_weight
    assert (prefix_cost(prefill, args).busy_slack, prefix_cost(prefill, args).busy_limit) == (
        0.02,
        1.5,
    )
    assert prefix_cost(decode, args).busy_slack is None  # prefill pool only
    args = build_parser().parse_args(
        [*base, "--imbalance-busy-slack", "0", "--imbalance-busy-slack", "off"]
    )
    assert prefix_cost(prefill, args).busy_slack is None
    with pytest.raises(SystemExit):
        build_parser().parse_args([*base, "--imbalance-busy-slack", "sometimes"])
