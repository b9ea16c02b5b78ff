"""Parsing the fault plan, and when a fault fires."""

from __future__ import annotations

import time

import pytest

from tandem.common.faults import parse_faults


def test_a_plan_names_points_actions_and_calls() -> None:
    faults = parse_faults("kv.send:corrupt@2, engine.step:delay=0.01@3+, decode.stream:drop")
    assert set(faults) == {"kv.send", "engine.step", "decode.stream"}
    corrupt = faults["kv.send"]
    assert [corrupt.fire() for _ in range(4)] == [False, True, False, False]
    delay = faults["engine.step"]
    start = time.monotonic()
    assert [delay.fire() for _ in range(5)] == [False, False, True, True, True]
    assert time.monotonic() - start >= 0.03  # slept on each of the three calls that fired
    assert all(faults["decode.stream"].fire() for _ in range(3))
    assert parse_faults("") == {}


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("kv.recv:drop", "unknown point 'kv.recv'"),
        ("kv.send:explode", "cannot read 'kv.send:explode'"),
        ("engine.step:delay", "delay takes =SECONDS"),
        ("kv.send:drop=3", "delay takes =SECONDS"),
        ("engine.step:corrupt", "engine.step cannot corrupt"),
    ],
)
def test_a_plan_it_cannot_read_is_refused_by_name(text: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        parse_faults(text)


def test_a_probabilistic_fault_fires_on_about_that_share_of_calls() -> None:
    sometimes = parse_faults("kv.send:drop~0.25")["kv.send"]
    fired = sum(sometimes.fire() for _ in range(4000))
    assert 800 < fired < 1200  # 1000 expected; outside this is ~1e-10 likely
    assert sum(parse_faults("kv.send:drop~1")["kv.send"].fire() for _ in range(50)) == 50
    with pytest.raises(ValueError, match="cannot read"):
        parse_faults("kv.send:drop~1.5")
