"""Load traces for the planner simulation, and the requests they stand for.

A trace is a CSV with the columns ``t_s,rate_rps,prompt_tokens,output_tokens`` (others are
ignored). Each row starts a segment that lasts until the next row's ``t_s``: a constant
arrival rate and the mean prompt and output lengths of the requests arriving in it. The
first row is at ``t_s`` 0 and the last row closes the trace: its ``t_s`` is the end and its
rate must be 0 (nothing arrives after the end; its lengths are not used).

``arrivals`` turns a trace into requests: Poisson arrivals within each segment (the
segment's rate; a new segment restarts the clock at its start, which is exact for a
memoryless process) and lengths drawn uniformly within ``spread`` of the segment's means,
so the means hold. Seeded: the same trace and seed give the same requests.
"""

from __future__ import annotations

import csv
import io
import itertools
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np

COLUMNS = ("t_s", "rate_rps", "prompt_tokens", "output_tokens")


class TraceError(ValueError):
    """A trace that cannot be used; the message names the file, the row and the column."""


@dataclass(frozen=True)
class Segment:
    start_s: float
    end_s: float
    rate_rps: float
    prompt_tokens: float
    """Mean prompt length of the requests arriving in the segment."""
    output_tokens: float

    @property
    def duration_s(self) -> float:
        return self.end_s - self.start_s


@dataclass(frozen=True)
class Trace:
    name: str
    segments: tuple[Segment, ...]

    @property
    def end_s(self) -> float:
        return self.segments[-1].end_s

    @property
    def expected_requests(self) -> float:
        return sum(s.rate_rps * s.duration_s for s in self.segments)

    @classmethod
    def read(cls, path: Path) -> Trace:
        """The trace in ``path``; ``TraceError`` if it is malformed."""
        try:
            text = Path(path).read_text()
        except OSError as err:
            raise TraceError(f"trace {path}: {err.strerror or err}") from err
        return cls.parse(text, str(path))

    @classmethod
    def parse(cls, text: str, name: str = "trace") -> Trace:
        """The trace in CSV ``text``; ``TraceError`` naming what is wrong and where."""
        reader = csv.DictReader(io.StringIO(text))
        header = [c.strip() for c in reader.fieldnames or ()]
        for column in COLUMNS:
            if column not in header:
                raise TraceError(f"trace {name}: missing column {column!r} (has {header})")
        rows = [_row(name, i + 2, raw) for i, raw in enumerate(reader)]
        if len(rows) < 2:
            raise TraceError(f"trace {name}: needs at least two rows (a segment and the end)")
        if rows[0][0] != 0:
            raise TraceError(f"trace {name}: the first row must be at t_s 0, got {rows[0][0]}")
        for line, (row, after) in enumerate(itertools.pairwise(rows), 3):
            if not after[0] > row[0]:
                raise TraceError(
                    f"trace {name}, line {line}: t_s must increase, got {after[0]} after {row[0]}"
                )
        if rows[-1][1] != 0:
            raise TraceError(
                f"trace {name}, line {len(rows) + 1}: the last row closes the trace, so its "
                f"rate_rps must be 0, got {rows[-1][1]}"
            )
        segments = tuple(
            Segment(row[0], after[0], row[1], row[2], row[3])
            for row, after in itertools.pairwise(rows)
        )
        return cls(name, segments)


def _row(name: str, line: int, raw: dict[str, str | None]) -> tuple[float, float, float, float]:
    values = {k.strip(): v for k, v in raw.items() if k is not None}
    parsed = []
    for column in COLUMNS:
        text = (values.get(column) or "").strip()
        try:
            value = float(text)
        except ValueError:
            raise TraceError(
                f"trace {name}, line {line}: {column} must be a number, got {text!r}"
            ) from None
        if not math.isfinite(value):
            raise TraceError(f"trace {name}, line {line}: {column} must be finite, got {text}")
        parsed.append(value)
    t_s, rate, prompt, output = parsed
    if t_s < 0:
        raise TraceError(f"trace {name}, line {line}: t_s must be >= 0, got {t_s}")
    if rate < 0:
        raise TraceError(f"trace {name}, line {line}: rate_rps must be >= 0, got {rate}")
    for column, value in (("prompt_tokens", prompt), ("output_tokens", output)):
        if value < 1:
            raise TraceError(f"trace {name}, line {line}: {column} must be >= 1, got {value}")
    return t_s, rate, prompt, output


@dataclass(frozen=True)
class Arrivals:
    """Requests in arrival order: when each arrives and its lengths (parallel arrays)."""

    at_s: np.ndarray
    prompt_tokens: np.ndarray
    output_tokens: np.ndarray

    def __post_init__(self) -> None:
        n = len(self.at_s)
        if not len(self.prompt_tokens) == len(self.output_tokens) == n:
            raise ValueError("arrival arrays must have the same length")
        if n and (np.diff(self.at_s) < 0).any():
            raise ValueError("arrivals must be in time order")

    def __len__(self) -> int:
        return len(self.at_s)


def arrivals(trace: Trace, seed: int = 0, spread: float = 0.5) -> Arrivals:
    """Poisson arrivals per segment, lengths uniform in ``mean * (1 +- spread)`` (at
    least 1 token)."""
    if not 0 <= spread < 1:
        raise ValueError(f"spread must be in [0, 1), got {spread}")
    rng = np.random.default_rng(seed)
    times, prompts, outputs = [], [], []
    for s in trace.segments:
        if s.rate_rps == 0:
            continue
        count = rng.poisson(s.rate_rps * s.duration_s)
        times.append(np.sort(rng.uniform(s.start_s, s.end_s, count)))
        prompts.append(_lengths(rng, s.prompt_tokens, spread, count))
        outputs.append(_lengths(rng, s.output_tokens, spread, count))
    if not times:
        empty = np.zeros(0, dtype=np.int64)
        return Arrivals(np.zeros(0), empty, empty)
    return Arrivals(np.concatenate(times), np.concatenate(prompts), np.concatenate(outputs))


def _lengths(rng: np.random.Generator, mean: float, spread: float, count: int) -> np.ndarray:
    low = max(1, round(mean * (1 - spread)))
    high = max(low, round(mean * (1 + spread)))
    return rng.integers(low, high + 1, count)
