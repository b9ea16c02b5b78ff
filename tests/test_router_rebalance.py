"""The rebalancer's decisions on load snapshots: when it moves streams, how much, and
the hysteresis that keeps streams from bouncing between decode workers."""

from __future__ import annotations

import pytest

from tandem.common.registry import (
    WorkerCapacity,
    WorkerInfo,
    WorkerLoad,
    WorkerRecord,
    WorkerRole,
)
from tandem.router.rebalance import Move, RebalanceConfig, Rebalancer

CONFIG = RebalanceConfig(interval_s=1.0, gap=0.25, min_usage=0.5, cooldown_s=10.0)


def decode(worker_id: str, used: int, blocks: int = 100, running: int = 1) -> WorkerRecord:
    capacity = WorkerCapacity(num_kv_blocks=blocks, block_size=16, max_num_seqs=8)
    info = WorkerInfo(worker_id, WorkerRole.DECODE, f"{worker_id}:1", "m", capacity)
    return WorkerRecord(info, WorkerLoad(blocks - used, running, 0, 0))


def rebalancer(config: RebalanceConfig = CONFIG) -> Rebalancer:
    return Rebalancer(None, None, config)  # plan() reads neither


def test_a_wide_gap_on_a_full_worker_moves_half_of_it() -> None:
    r = rebalancer()
    move = r.plan([decode("a", 90), decode("b", 30), decode("c", 50)], now=0.0)
    assert move == Move("a", 30, 0, pytest.approx(0.6))  # half of (0.9 - 0.3) of 100 blocks


def test_usage_is_a_share_of_each_pool() -> None:
    """A worker with the most blocks in use but a bigger pool is not the fullest."""
    r = rebalancer()
    move = r.plan([decode("big", 120, blocks=400), decode("small", 80)], now=0.0)
    assert move is not None and move.source == "small"
    assert move.num_blocks == int((0.8 - 0.3) / 2 * 100)


def test_a_full_batch_counts_like_a_full_pool() -> None:
    """Short sequences hold little KV but fill the batch (and slow its steps): 7 of 8
    running against 1 is a gap of 0.75, closed by half in sequences."""
    r = rebalancer()
    move = r.plan([decode("a", 20, running=7), decode("b", 10, running=1)], now=0.0)
    assert move == Move("a", 5, 3, pytest.approx(0.75))  # KV gap 0.1 -> 5 blocks too


@pytest.mark.parametrize(
    "workers",
    [
        [decode("a", 70), decode("b", 50)],  # gap 0.2 < 0.25
        [decode("a", 45), decode("b", 0)],  # fullest below 0.5
        [decode("a", 100)],  # nobody to move to
        [],
    ],
    ids=["narrow-gap", "nobody-short", "alone", "empty"],
)
def test_no_move(workers) -> None:
    assert rebalancer().plan(workers, now=0.0) is None


def test_after_a_move_it_waits_for_the_gap_to_close_or_the_cooldown() -> None:
    r = rebalancer()
    workers = [decode("a", 90), decode("b", 30)]
    move = r.plan(workers, now=0.0)
    r.moved(move, workers, now=0.0)
    assert r.num_moves == 1
    # The loads have not caught up yet (heartbeats lag): no second move.
    assert r.plan(workers, now=1.0) is None
    # The gap closed below half the trigger: re-armed, but nothing to do.
    assert r.plan([decode("a", 62), decode("b", 55)], now=2.0) is None
    # It reopens: a was the source, so it stays out until its cooldown ends.
    assert r.plan([decode("a", 90), decode("b", 30)], now=3.0) is None
    assert r.plan([decode("a", 90), decode("b", 30)], now=10.5) == Move(
        "a", 30, 0, pytest.approx(0.6)
    )


def test_a_gap_that_stays_open_is_acted_on_again_after_the_cooldown() -> None:
    r = rebalancer()
    workers = [decode("a", 95), decode("b", 20)]
    r.moved(r.plan(workers, now=0.0), workers, now=0.0)
    assert r.plan(workers, now=9.9) is None
    assert r.plan(workers, now=10.0) is not None


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("interval_s", -1.0, "interval must be >= 0"),
        ("gap", 0.0, r"gap must be in \(0, 1\]"),
        ("min_usage", 1.5, r"minimum usage must be in \[0, 1\]"),
    ],
)
def test_bad_settings_are_refused(field: str, value: float, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        RebalanceConfig(**{field: value})


def test_off_by_default() -> None:
    assert not RebalanceConfig().enabled and CONFIG.enabled
