"""Seeded benchmark workloads: which requests every system under test receives.

Torch-free and stdlib-only, so any runner (including one in a separate virtualenv) can
import it. Every request in every workload is greedy with ``ignore_eos``: a request
always produces exactly ``max_tokens`` tokens, so systems are compared on the same work.
The same spec and token pool always give the same requests (``random.Random(seed)``).
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path


@dataclass(frozen=True)
class Request:
    """One generation request: a prompt of token ids and how many tokens to generate."""

    prompt_token_ids: tuple[int, ...]
    max_tokens: int

    def __post_init__(self) -> None:
        object.__setattr__(self, "prompt_token_ids", tuple(self.prompt_token_ids))
        if not self.prompt_token_ids:
            raise ValueError("prompt_token_ids must be non-empty")
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")


@dataclass(frozen=True)
class IntRange:
    """An inclusive integer range drawn uniformly."""

    low: int
    high: int

    def __post_init__(self) -> None:
        if not 1 <= self.low <= self.high:
            raise ValueError(f"need 1 <= low <= high, got {self.low}..{self.high}")

    def draw(self, rng: random.Random) -> int:
        return rng.randint(self.low, self.high)

    def scaled(self, factor: float) -> IntRange:
        return IntRange(max(1, int(self.low * factor)), max(1, int(self.high * factor)))


@dataclass(frozen=True)
class WorkloadSpec:
    """A named workload. ``baseline`` is the peer system its headline ratio is taken against."""

    name: str
    title: str
    num_requests: int
    prompt_len: IntRange
    max_tokens: IntRange
    baseline: str
    seed: int

    def quick(self, num_requests: int = 8, factor: float = 1 / 8) -> WorkloadSpec:
        """A shrunken copy for smoke runs: fewer requests, shorter prompts and outputs."""
        return replace(
            self,
            num_requests=num_requests,
            prompt_len=self.prompt_len.scaled(factor),
            max_tokens=self.max_tokens.scaled(factor),
        )


WORKLOAD_A = WorkloadSpec(
    name="A",
    title="peer table",
    num_requests=64,
    prompt_len=IntRange(32, 256),
    max_tokens=IntRange(128, 128),
    baseline="vllm",
    seed=1,
)
WORKLOAD_B = WorkloadSpec(
    name="B",
    title="continuous batching matters",
    num_requests=64,
    prompt_len=IntRange(32, 512),
    max_tokens=IntRange(16, 256),
    baseline="hf",
    seed=2,
)
WORKLOADS: dict[str, WorkloadSpec] = {w.name: w for w in (WORKLOAD_A, WORKLOAD_B)}


@dataclass(frozen=True)
class TokenPool:
    """The token ids a synthetic prompt may contain: the vocabulary minus special ids."""

    allowed: tuple[int, ...]

    def __post_init__(self) -> None:
        if not self.allowed:
            raise ValueError("token pool is empty")

    @classmethod
    def from_vocab(cls, vocab_size: int, special_ids: Iterable[int] = ()) -> TokenPool:
        excluded = set(special_ids)
        return cls(tuple(i for i in range(vocab_size) if i not in excluded))

    @classmethod
    def from_checkpoint(cls, model_dir: str | Path) -> TokenPool:
        """Pool for an HF checkpoint directory (``config.json``, optional ``tokenizer.json``).

        The vocabulary is the smaller of the model's and the tokenizer's (an id the
        tokenizer cannot map is rejected by some engines); special ids are the config's
        bos/eos/pad ids and the tokenizer's special added tokens.
        """
        model_dir = Path(model_dir)
        config = json.loads((model_dir / "config.json").read_text())
        vocab_size = int(config["vocab_size"])
        special = set(_config_special_ids(config))
        tokenizer_path = model_dir / "tokenizer.json"
        if tokenizer_path.exists():
            tok_size, tok_special = _tokenizer_vocab(json.loads(tokenizer_path.read_text()))
            vocab_size = min(vocab_size, tok_size)
            special |= tok_special
        return cls.from_vocab(vocab_size, special)

    def sample(self, rng: random.Random, length: int) -> tuple[int, ...]:
        return tuple(rng.choices(self.allowed, k=length))


def _config_special_ids(config: dict[str, object]) -> Iterable[int]:
    for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
        value = config.get(key)
        if isinstance(value, int):
            yield value
        elif isinstance(value, list):
            yield from (v for v in value if isinstance(v, int))


def _tokenizer_vocab(tokenizer: dict[str, object]) -> tuple[int, set[int]]:
    """(number of ids the tokenizer maps, ids of its special added tokens)."""
    model = tokenizer.get("model")
    vocab = model.get("vocab", {}) if isinstance(model, dict) else {}
    added = tokenizer.get("added_tokens") or []
    ids = [int(i) for i in (vocab.values() if isinstance(vocab, dict) else [])]
    ids += [int(t["id"]) for t in added]
    special = {int(t["id"]) for t in added if t.get("special")}
    return (max(ids) + 1 if ids else 0), special


def make_requests(spec: WorkloadSpec, pool: TokenPool) -> tuple[Request, ...]:
    """The workload's requests: the same spec and pool always give the same requests."""
    rng = random.Random(spec.seed)
    requests = []
    for _ in range(spec.num_requests):
        prompt_len = spec.prompt_len.draw(rng)
        max_tokens = spec.max_tokens.draw(rng)
        requests.append(Request(pool.sample(rng, prompt_len), max_tokens))
    return tuple(requests)


def make_probe(
    pool: TokenPool, prompt_len: int, max_tokens: int, count: int, seed: int
) -> tuple[Request, ...]:
    """``count`` single-request probes with distinct prompts (so no prefix-cache hits)."""
    rng = random.Random(seed)
    return tuple(Request(pool.sample(rng, prompt_len), max_tokens) for _ in range(count))


def requests_to_json(requests: Sequence[Request]) -> list[dict[str, object]]:
    return [
        {"prompt_token_ids": list(r.prompt_token_ids), "max_tokens": r.max_tokens} for r in requests
    ]


def requests_from_json(items: Sequence[dict[str, object]]) -> tuple[Request, ...]:
    return tuple(Request(tuple(i["prompt_token_ids"]), int(i["max_tokens"])) for i in items)


def total_output_tokens(requests: Sequence[Request]) -> int:
    return sum(r.max_tokens for r in requests)
