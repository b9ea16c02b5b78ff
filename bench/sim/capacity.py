"""What one simulated replica can do, worked out from the engine's calibrated step costs
(``Calibration``), for sizing fleets the way an operator would from a benchmark: the
static fleet's replica counts, the autoscalers' starting fleet and the HPA's targets.
The simulation itself never uses these numbers; its workers spend the step costs.

* **Prefill**: a replica computes a prompt of ``P`` tokens in chunks of at most
  ``max_num_batched_tokens``; alone, it takes the sum of its chunks' step times. Its
  busy seconds per request are that time averaged over the prompt lengths drawn.
* **Decode**: a batch of ``b`` sequences steps in ``decode_time(b, b * kv)``, where a
  sequence holds on average its prompt and half its output (``kv``). A replica holds at
  most ``max_num_seqs`` sequences, and no more than keep the step within the TPOT
  target (``slo_batch``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from tandem.bench.sim.calibration import Calibration
from tandem.bench.sim.trace import Segment, Trace


@dataclass(frozen=True)
class Mix:
    """Mean request lengths and how far draws spread around them (see ``arrivals``)."""

    prompt_tokens: float
    output_tokens: float
    spread: float = 0.5

    @classmethod
    def of(cls, segment: Segment, spread: float = 0.5) -> Mix:
        return cls(segment.prompt_tokens, segment.output_tokens, spread)


@dataclass(frozen=True)
class ReplicaModel:
    """The calibration and the engine limits a simulated replica runs with."""

    calibration: Calibration
    max_num_seqs: int = 128
    """The engine's default (``EngineConfig.max_num_seqs``)."""

    def prefill_seconds(self, mix: Mix) -> float:
        """Mean busy seconds one prefill replica spends per request of ``mix``."""
        low = max(1, round(mix.prompt_tokens * (1 - mix.spread)))
        high = max(low, round(mix.prompt_tokens * (1 + mix.spread)))
        lengths = np.unique(np.linspace(low, high, min(64, high - low + 1)).round().astype(int))
        return float(np.mean([self._prompt_seconds(int(p)) for p in lengths]))

    def _prompt_seconds(self, tokens: int) -> float:
        cal, done, seconds = self.calibration, 0, 0.0
        while done < tokens:
            chunk = min(cal.max_num_batched_tokens, tokens - done)
            seconds += cal.prefill_time(chunk, done)
            done += chunk
        return seconds

    def prefill_tokens_per_s(self, mix: Mix) -> float:
        """Prompt tokens one replica computes per busy second on ``mix``."""
        return mix.prompt_tokens / self.prefill_seconds(mix)

    def decode_step_s(self, batch: float, mix: Mix) -> float:
        kv = mix.prompt_tokens + mix.output_tokens / 2
        return self.calibration.decode_time(batch, batch * kv)

    def slo_batch(self, mix: Mix, tpot_s: float) -> int:
        """The most sequences a decode replica holds with its step within ``tpot_s``:
        at most ``max_num_seqs``, at least 1 (even when one sequence already misses)."""
        lo, hi = 1, self.max_num_seqs
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if self.decode_step_s(mid, mix) <= tpot_s:
                lo = mid
            else:
                hi = mid - 1
        return lo

    def replicas_for(
        self, rate_rps: float, mix: Mix, tpot_s: float, utilisation: float
    ) -> tuple[int, int]:
        """(prefill, decode) replicas that carry ``rate_rps`` of ``mix`` with each
        replica at ``utilisation`` of what it can do: prefill busy that share of the time,
        decode holding that share of ``slo_batch`` sequences. At least one of each."""
        prefill = rate_rps * self.prefill_seconds(mix) / utilisation
        batch = max(1.0, utilisation * self.slo_batch(mix, tpot_s))
        per_replica_rps = batch / (mix.output_tokens * self.decode_step_s(batch, mix))
        decode = rate_rps / per_replica_rps
        return max(1, math.ceil(prefill - 1e-9)), max(1, math.ceil(decode - 1e-9))


def peak_fleet(
    trace: Trace, model: ReplicaModel, tpot_s: float, utilisation: float, spread: float = 0.5
) -> tuple[int, int]:
    """The static fleet sized for the trace's peak: per pool, the most replicas any
    segment needs at ``utilisation``."""
    needs = [
        model.replicas_for(s.rate_rps, Mix.of(s, spread), tpot_s, utilisation)
        for s in trace.segments
        if s.rate_rps > 0
    ]
    if not needs:
        return 1, 1
    return max(n[0] for n in needs), max(n[1] for n in needs)


def mean_mix(trace: Trace, spread: float = 0.5) -> Mix:
    """The request-weighted mean lengths over the trace."""
    weights = [s.rate_rps * s.duration_s for s in trace.segments]
    total = sum(weights)
    if total == 0:
        first = trace.segments[0]
        return Mix(first.prompt_tokens, first.output_tokens, spread)
    prompt = sum(w * s.prompt_tokens for w, s in zip(weights, trace.segments, strict=True))
    output = sum(w * s.output_tokens for w, s in zip(weights, trace.segments, strict=True))
    return Mix(prompt / total, output / total, spread)
