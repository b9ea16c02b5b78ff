"""Where rank 0's step time goes: its forward and, when the model is split, its
collectives by kind, timed without touching the engine's code.

``instrument(runner, clock)`` wraps the runner's ``run_plan`` (the forward, on every
rank), points each parallel layer of rank 0's model at a stand-in for its
``TensorParallelGroup`` that times the layer's collective, and wraps the group's
``broadcast_plan`` (called only by the plan channel). Only a benchmark calls it, in its
own process: an engine that is not instrumented runs exactly the code it always did. The
other ranks are not instrumented; rank 0's time inside a collective includes waiting for
them to reach it.

Cost when instrumented: two ``perf_counter`` calls and two dict updates per timed call
(about a microsecond, against tens of microseconds for a gloo all-reduce).
"""

from __future__ import annotations

import enum
import time
from collections.abc import Callable
from typing import Any

from torch import nn

from tandem.engine.model_runner import ModelRunner
from tandem.engine.parallel.group import TensorParallelGroup
from tandem.engine.parallel.layers import (
    PackedRowParallelLinear,
    ParallelLMHead,
    RowParallelLinear,
    VocabParallelEmbedding,
)


class Span(enum.Enum):
    FORWARD = "forward"
    """``ModelRunner.run_plan``: the model and the logits, collectives included."""
    ROW_PARALLEL_ALL_REDUCE = "row_parallel_all_reduce"
    """``o_proj`` and ``down_proj``: two per layer."""
    EMBEDDING_ALL_REDUCE = "embedding_all_reduce"
    """The vocabulary-parallel embedding: one per forward, the ranks' first meeting."""
    LOGITS_GATHER = "logits_gather"
    PLAN_BROADCAST = "plan_broadcast"
    """Rank 0 sending the step plan (header, then payload), before the forward."""


COLLECTIVES = tuple(s for s in Span if s is not Span.FORWARD)

_LAYER_SPANS: dict[type[nn.Module], Span] = {
    RowParallelLinear: Span.ROW_PARALLEL_ALL_REDUCE,
    PackedRowParallelLinear: Span.ROW_PARALLEL_ALL_REDUCE,
    VocabParallelEmbedding: Span.EMBEDDING_ALL_REDUCE,
    ParallelLMHead: Span.LOGITS_GATHER,
}


class SpanClock:
    """Seconds and calls spent inside each ``Span`` since the last ``reset``."""

    def __init__(self) -> None:
        self.seconds: dict[Span, float] = {}
        self.calls: dict[Span, int] = {}
        self.reset()

    def reset(self) -> None:
        self.seconds = dict.fromkeys(Span, 0.0)
        self.calls = dict.fromkeys(Span, 0)

    def timed(self, span: Span, call: Callable[..., Any]) -> Callable[..., Any]:
        def run(*args: Any) -> Any:
            start = time.perf_counter()
            try:
                return call(*args)
            finally:
                self.seconds[span] += time.perf_counter() - start
                self.calls[span] += 1

        return run


class _TimedGroup:
    """Stands in for a parallel layer's group: the collectives it calls, timed as one
    span."""

    def __init__(self, group: TensorParallelGroup, clock: SpanClock, span: Span) -> None:
        self.all_reduce = clock.timed(span, group.all_reduce)
        self.gather_last_dim = clock.timed(span, group.gather_last_dim)


def instrument(runner: ModelRunner, clock: SpanClock) -> None:
    """Times rank 0's forwards and collectives into ``clock`` from now on. Irreversible:
    for a benchmark's engine only."""
    runner.run_plan = clock.timed(Span.FORWARD, runner.run_plan)
    if runner.tp is None:
        return
    for module in runner.model.modules():
        span = _LAYER_SPANS.get(type(module))
        if span is not None:
            module.group = _TimedGroup(module.group, clock, span)
    runner.tp.broadcast_plan = clock.timed(Span.PLAN_BROADCAST, runner.tp.broadcast_plan)
