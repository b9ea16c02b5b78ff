"""The stall bound of a decode stream: scaled to the stream's own pace, with a floor."""

from __future__ import annotations

import pytest

from tandem.router import stall
from tandem.router.stall import StallPolicy, StreamClock


class FakeTime:
    def __init__(self) -> None:
        self.now = 100.0

    def monotonic(self) -> float:
        return self.now


@pytest.fixture
def clock_time(monkeypatch: pytest.MonkeyPatch) -> FakeTime:
    fake = FakeTime()
    monkeypatch.setattr(stall, "time", fake)
    return fake


def test_the_first_message_gets_the_longer_bound(clock_time: FakeTime) -> None:
    clock = StreamClock(StallPolicy(floor_s=2.0, first_message_multiple=3.0))
    assert clock.next_bound_s() == 6.0
    clock_time.now += 5.0  # admission and a KV pull took a while: not counted as pace
    clock.observe()
    assert clock.next_bound_s() == 2.0


def test_a_slow_stream_gets_a_bound_its_pace_scaled(clock_time: FakeTime) -> None:
    clock = StreamClock(StallPolicy(floor_s=1.0, tpot_multiple=20.0))
    clock.observe()
    for _ in range(4):
        clock_time.now += 0.01  # a fast stream: 10 ms per token stays on the floor
        clock.observe()
    assert clock.next_bound_s() == 1.0
    for _ in range(4):
        clock_time.now += 0.39  # slows down to a mean of 0.2 s per message
        clock.observe()
    assert clock.mean_gap_s == pytest.approx(0.2)
    assert clock.next_bound_s() == pytest.approx(4.0)


def test_bad_policies_are_refused() -> None:
    with pytest.raises(ValueError, match="floor_s"):
        StallPolicy(floor_s=0)
    with pytest.raises(ValueError, match="multiples"):
        StallPolicy(tpot_multiple=0.5)
