"""Write the planner simulation's traces (``bench/traces/*.csv``).

    python bench/traces/make_traces.py [--out bench/traces]

Every trace is a real-time trace (no time compression): ``t_s`` in seconds, a
piecewise-constant rate, mean prompt and output lengths per segment; the format is
``tandem.bench.sim.trace``'s. The shapes are written out below as functions of the hour;
nothing is random here (the simulation draws the requests, seeded).

* ``diurnal_burst`` — the trace the planner simulation was developed on: a real 24 h
  at 10-minute steps, 2.5 req/s at night to 16 req/s in the evening, with a 5x burst at
  11:00 (ramping up over two minutes in 30 s steps, held 20 minutes, back down over 5);
  RAG-like requests of 3,000 prompt and 400 output tokens on average.
* ``slow_ramp`` (held out) — 6 h: 2 req/s rising linearly to 40 over 4 h (5-minute
  steps), 1 h at 40, down to 2 over the last hour; 2,000 / 250 tokens.
* ``double_peak`` (held out) — 24 h at 15-minute steps, a morning peak of long prompts
  (4,000 / 300) and an evening peak of chat (1,000 / 500) three times the night's rate,
  so the mix, and with it what a replica can carry, changes through the day.
* ``flat_spike`` (held out) — 4 h flat at 8 req/s with a 4x step at 2:00 held for
  10 minutes (no ramp at all); 3,000 / 400 tokens.
* ``business_day`` (held out, added after the planner's changes) — 12 h at 5-minute steps:
  2 req/s at 06:00 rising to 20 by 09:00, a lunch dip to 10, 22 in the afternoon, down to
  2 by 18:00 and after; chat requests of 1,200 / 300 tokens.
* ``bursts`` (held out, added after the planner's changes) — 8 h at 10 req/s with three
  3x bursts of 5 minutes (up over a minute in 15 s steps) at 1:00, 3:30 and 6:00, and the
  mix turning from 3,000 / 400 to 5,000 / 200 tokens at 4:00.
* ``weekly`` (held out, added after the second round of planner changes) — a week
  compressed into 14 h, 2 h a day at 5-minute steps: five weekdays peaking at 18 req/s
  (the peak one day later in the "day" each time), a weekend peaking at 7; 2,500 / 300
  tokens on weekdays, 1,500 / 500 at the weekend.
* ``sawtooth`` (held out, added after the second round of planner changes) — 6 h of
  ramps from 4 to 24 req/s over 20 minutes at 1-minute steps, each ending with a drop
  straight back to 4; 1,500 / 350 tokens.
"""

from __future__ import annotations

import argparse
import itertools
import math
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

HERE = Path(__file__).resolve().parent
Row = tuple[float, float, float, float]
"""(t_s, rate_rps, prompt_tokens, output_tokens)"""


def sampled(
    end_s: float, step_s: float, shape: Callable[[float], tuple[float, float, float]]
) -> list[Row]:
    """``shape(t)`` -> (rate, prompt, output) at every ``step_s`` up to ``end_s``, then
    the closing row."""
    rows = []
    for i in range(round(end_s / step_s)):
        t = i * step_s
        rows.append((t, *shape(t)))
    return [*rows, (end_s, 0.0, rows[-1][2], rows[-1][3])]


def with_burst(
    rows: list[Row], start_s: float, factors: Sequence[tuple[float, float]]
) -> list[Row]:
    """``rows`` with the rate multiplied from ``start_s`` on: ``factors`` are
    (duration, factor) pieces in order; the rows' own rate and lengths are kept."""

    def base(t: float) -> Row:
        return [r for r in rows if r[0] <= t][-1]

    pieces, t = [], start_s
    for duration, factor in factors:
        row = base(t)
        pieces.append((t, row[1] * factor, row[2], row[3]))
        t += duration
    after = base(t)
    pieces.append((t, after[1], after[2], after[3]))
    kept = [r for r in rows if r[0] < start_s or r[0] > t]
    return sorted([*kept, *pieces])


def diurnal_burst() -> list[Row]:
    def shape(t: float) -> tuple[float, float, float]:
        hour = t / 3600
        day = 0.5 - 0.5 * math.cos(2 * math.pi * (hour - 4) / 24)  # 0 at 04:00, 1 at 16:00
        return round(2.5 + 13.5 * day**1.5, 3), 3000, 400

    rows = sampled(24 * 3600, 600, shape)
    ramp = [(30, 2), (30, 3), (30, 4), (30, 5)]
    hold = [(20 * 60 - 120, 5)]
    down = [(60, 4), (60, 3), (60, 2), (120, 1.5)]
    return with_burst(rows, 11 * 3600, [*ramp, *hold, *down])


def slow_ramp() -> list[Row]:
    def shape(t: float) -> tuple[float, float, float]:
        hour = t / 3600
        if hour < 4:
            rate = 2 + 38 * hour / 4
        elif hour < 5:
            rate = 40
        else:
            rate = 40 - 38 * (hour - 5)
        return round(rate, 3), 2000, 250

    return sampled(6 * 3600, 300, shape)


def double_peak() -> list[Row]:
    def bump(hour: float, centre: float, width: float) -> float:
        return math.exp(-(((hour - centre) / width) ** 2))

    def shape(t: float) -> tuple[float, float, float]:
        hour = t / 3600
        morning, evening = bump(hour, 10, 2), bump(hour, 20, 1.5)
        rate = 3 + 6 * morning + 6 * evening
        if morning >= evening and morning > 0.2:
            return round(rate, 3), 4000, 300
        if evening > 0.2:
            return round(rate, 3), 1000, 500
        return round(rate, 3), 2000, 250

    return sampled(24 * 3600, 900, shape)


def flat_spike() -> list[Row]:
    rows = sampled(4 * 3600, 1800, lambda t: (8.0, 3000, 400))
    return with_burst(rows, 2 * 3600, [(600, 4)])


def business_day() -> list[Row]:
    points = [
        (0, 2),
        (6, 2),
        (9, 20),
        (11.5, 20),
        (12, 10),
        (13, 10),
        (13.5, 22),
        (16, 22),
        (18, 2),
    ]

    def shape(t: float) -> tuple[float, float, float]:
        hour = t / 3600 + 6  # the trace starts at 06:00
        for (h0, r0), (h1, r1) in itertools.pairwise(points):
            if h0 <= hour < h1:
                return round(r0 + (r1 - r0) * (hour - h0) / (h1 - h0), 3), 1200, 300
        return 2.0, 1200, 300

    return sampled(12 * 3600, 300, shape)


def bursts() -> list[Row]:
    rows = sampled(
        8 * 3600, 1800, lambda t: (10.0, 3000, 400) if t < 4 * 3600 else (10.0, 5000, 200)
    )
    ramp = [(15, 1.5), (15, 2), (15, 2.5), (15, 3), (240, 3)]
    for start in (1 * 3600, 3.5 * 3600, 6 * 3600):
        rows = with_burst(rows, start, ramp)
    return rows


def weekly() -> list[Row]:
    day_s = 2 * 3600

    def shape(t: float) -> tuple[float, float, float]:
        day, phase = divmod(t / day_s, 1.0)
        if day >= 5:  # the weekend: lower, later, longer answers
            return round(2 + 5 * math.sin(math.pi * phase) ** 2, 3), 1500, 500
        centre = 0.45 + 0.05 * day
        peak = math.exp(-(((phase - centre) / 0.18) ** 2))
        return round(2 + 16 * peak, 3), 2500, 300

    return sampled(7 * day_s, 300, shape)


def sawtooth() -> list[Row]:
    def shape(t: float) -> tuple[float, float, float]:
        into = (t % 1200) / 1200  # 20-minute teeth
        return round(4 + 20 * into, 3), 1500, 350

    return sampled(6 * 3600, 60, shape)


TRACES: dict[str, Callable[[], list[Row]]] = {
    "diurnal_burst": diurnal_burst,
    "slow_ramp": slow_ramp,
    "double_peak": double_peak,
    "flat_spike": flat_spike,
    "business_day": business_day,
    "bursts": bursts,
    "weekly": weekly,
    "sawtooth": sawtooth,
}


def write(rows: list[Row], path: Path) -> None:
    lines = ["t_s,rate_rps,prompt_tokens,output_tokens"]
    lines += [f"{t:g},{rate:g},{prompt:g},{output:g}" for t, rate, prompt, output in rows]
    path.write_text("\n".join(lines) + "\n")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=HERE)
    args = parser.parse_args(argv)
    for name, make in TRACES.items():
        path = args.out / f"{name}.csv"
        write(make(), path)
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
