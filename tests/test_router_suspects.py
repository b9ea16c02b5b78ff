"""Suspects: a worker a call just failed on is avoided for a hold, then trusted again."""

from __future__ import annotations

from tandem.router.suspects import Suspects


def test_a_suspect_is_held_for_the_hold_then_released() -> None:
    now = [100.0]
    suspects = Suspects(hold_s=5.0, clock=lambda: now[0])
    assert suspects.current() == frozenset()
    suspects.mark("decode-0")
    now[0] += 2.0
    suspects.mark("decode-1")
    assert suspects.current() == {"decode-0", "decode-1"}
    now[0] += 3.5  # decode-0's hold is over, decode-1's is not
    assert suspects.current() == {"decode-1"}
    suspects.mark("decode-1")  # failing again extends the hold
    now[0] += 4.0
    assert suspects.current() == {"decode-1"}
    now[0] += 1.5
    assert suspects.current() == frozenset()
