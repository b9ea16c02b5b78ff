"""Per-request sampling parameters, validated once at construction.

Torch-free so the router can validate a request before it reaches any worker. The
field names and defaults follow vLLM's ``SamplingParams`` where they overlap, so code
written against vLLM's offline API reads the same here.
"""

from __future__ import annotations

import enum
import json
from collections.abc import Mapping
from dataclasses import dataclass, field

MAX_LOGPROBS = 20
MAX_SPECULATIVE_TOKENS = 16


class SpecMethod(enum.Enum):
    NGRAM = "ngram"
    """Prompt lookup: propose what followed the last n tokens where they occurred before."""
    DRAFT = "draft"
    """A smaller draft model proposes, autoregressively."""


@dataclass(frozen=True)
class SpeculativeOptions:
    """Per-request control of speculative decoding; ``None`` fields take the engine's
    defaults (speculation runs only on engines configured with a proposer)."""

    enabled: bool | None = None
    method: SpecMethod | None = None
    num_tokens: int | None = None
    """Most tokens proposed per step (k); the engine's adaptive k may use fewer."""

    def __post_init__(self) -> None:
        if self.num_tokens is not None and not 1 <= self.num_tokens <= MAX_SPECULATIVE_TOKENS:
            raise ValueError(
                f"speculative.num_tokens must be in [1, {MAX_SPECULATIVE_TOKENS}], "
                f"got {self.num_tokens}"
            )


class StructuredKind(enum.Enum):
    JSON_SCHEMA = "json_schema"
    """``spec`` is a JSON schema (JSON text); the output is JSON matching it."""
    JSON_OBJECT = "json_object"
    """Any JSON object (``spec`` is empty)."""
    REGEX = "regex"
    """The whole output matches the regular expression ``spec``."""
    GRAMMAR = "grammar"
    """``spec`` is a grammar in Lark syntax whose start rule is ``start``."""


MAX_STRUCTURED_SPEC_CHARS = 64 * 1024


@dataclass(frozen=True)
class StructuredOutput:
    """A constraint on the whole output: every token is drawn from the tokens it allows
    at that point, and the request stops when the output is complete."""

    kind: StructuredKind
    spec: str = ""

    def __post_init__(self) -> None:
        if self.kind is StructuredKind.JSON_OBJECT:
            _check(not self.spec, "structured", "json_object takes no spec")
            return
        name = f"structured.{self.kind.value}"
        _check(bool(self.spec.strip()), name, "must not be empty")
        _check(
            len(self.spec) <= MAX_STRUCTURED_SPEC_CHARS,
            name,
            f"is {len(self.spec)} characters; the limit is {MAX_STRUCTURED_SPEC_CHARS}",
        )
        if self.kind is StructuredKind.JSON_SCHEMA:
            try:
                schema = json.loads(self.spec)
            except json.JSONDecodeError as err:
                raise ValueError(f"{name} is not valid JSON: {err}") from None
            except RecursionError:
                raise ValueError(f"{name} is JSON nested too deep to read") from None
            _check(isinstance(schema, dict | bool), name, "must be a JSON object (or true/false)")

    @classmethod
    def json_schema(cls, schema: str | dict) -> StructuredOutput:
        text = schema if isinstance(schema, str) else json.dumps(schema)
        return cls(StructuredKind.JSON_SCHEMA, text)


GREEDY_BELOW = 1e-5
"""Temperatures below this sample greedily (as vLLM's): dividing logits by a smaller one
overflows float32, and the distribution is one token anyway."""
FLOAT32_TINY = 1.1754943508222875e-38
"""The smallest normal float32: a repetition penalty below it is 0 in the sampler's
float32 arithmetic (and a masked ``-inf`` times 0 is NaN)."""


@dataclass(frozen=True)
class SamplingParams:
    """How to pick each next token and when to stop.

    ``temperature`` below ``GREEDY_BELOW`` (0 included) means greedy. ``top_k=None`` and
    ``top_p=1.0`` disable those filters. ``seed`` makes a request's random draws
    reproducible whatever else shares its batch. ``logprobs=n`` returns the top-n
    log-probabilities (of the raw model distribution) plus the chosen token's at every
    step.
    """

    max_tokens: int = 16
    min_tokens: int = 0
    temperature: float = 1.0
    top_k: int | None = None
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    stop: tuple[str, ...] = field(default_factory=tuple)
    stop_token_ids: tuple[int, ...] = field(default_factory=tuple)
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    logprobs: int | None = None
    skip_special_tokens: bool = True
    speculative: SpeculativeOptions = field(default_factory=SpeculativeOptions)
    structured: StructuredOutput | None = None
    """Constrained decoding (``None``: free text)."""
    logit_bias: tuple[tuple[int, float], ...] = field(default_factory=tuple)
    """``(token id, bias)`` pairs added to the logits before sampling (OpenAI's
    ``logit_bias``, each in [-100, 100]); a mapping is accepted and stored sorted."""

    def __post_init__(self) -> None:
        # Accept lists (and a bare string for `stop`) from callers; store tuples.
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        bias = self.logit_bias
        pairs = bias.items() if isinstance(bias, Mapping) else bias
        object.__setattr__(self, "logit_bias", tuple(sorted((int(t), float(b)) for t, b in pairs)))
        self._validate()

    def _validate(self) -> None:
        _check(self.max_tokens >= 1, "max_tokens", f"must be >= 1, got {self.max_tokens}")
        _check(
            0 <= self.min_tokens <= self.max_tokens,
            "min_tokens",
            f"must be in [0, max_tokens={self.max_tokens}], got {self.min_tokens}",
        )
        _check(self.temperature >= 0, "temperature", f"must be >= 0, got {self.temperature}")
        _check(
            self.top_k is None or self.top_k >= 1,
            "top_k",
            f"must be >= 1 (or None to disable), got {self.top_k}",
        )
        _check(0 < self.top_p <= 1, "top_p", f"must be in (0, 1], got {self.top_p}")
        _check(0 <= self.min_p <= 1, "min_p", f"must be in [0, 1], got {self.min_p}")
        _check(
            self.repetition_penalty >= FLOAT32_TINY,
            "repetition_penalty",
            f"must be > 0 (at least {FLOAT32_TINY:.3g}, the smallest normal float32), got "
            f"{self.repetition_penalty}",
        )
        _check(
            -2 <= self.presence_penalty <= 2,
            "presence_penalty",
            f"must be in [-2, 2], got {self.presence_penalty}",
        )
        _check(
            -2 <= self.frequency_penalty <= 2,
            "frequency_penalty",
            f"must be in [-2, 2], got {self.frequency_penalty}",
        )
        _check(
            self.logprobs is None or 0 <= self.logprobs <= MAX_LOGPROBS,
            "logprobs",
            f"must be in [0, {MAX_LOGPROBS}], got {self.logprobs}",
        )
        _check(all(s for s in self.stop), "stop", "stop strings must be non-empty")
        _check(
            all(t >= 0 for t in self.stop_token_ids),
            "stop_token_ids",
            f"must be non-negative token ids, got {list(self.stop_token_ids)}",
        )
        for token_id, bias in self.logit_bias:
            _check(token_id >= 0, "logit_bias", f"keys must be token ids, got {token_id}")
            _check(
                -100 <= bias <= 100,
                "logit_bias",
                f"values must be in [-100, 100], got {bias} for token {token_id}",
            )

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW

    @property
    def uses_penalties(self) -> bool:
        return (
            self.repetition_penalty != 1.0
            or self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
        )


def _check(ok: bool, name: str, message: str) -> None:
    if not ok:
        raise ValueError(f"{name} {message}")
