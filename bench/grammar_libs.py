"""Compare grammar-constrained decoding libraries on CPU for the Tandem tokenizer.

Libraries: ``xgrammar``, ``llguidance`` and ``outlines-core``. A library that can't be
imported is skipped. Constraints:

* ``json_object``: any JSON object (the JSON schema ``{"type": "object"}``)
* ``json_schema``: an object with ``name`` (string), ``age`` (integer) and ``tags``
  (array of strings); ``name`` and ``age`` are required
* ``regex``: ``[0-9]{3}-[0-9]{4}``
* ``lark``: a small arithmetic-expression grammar in Lark syntax (not supported by
  outlines-core, which only does regex/JSON schema)

Measured for each (library, constraint):

* tokenizer-info build time, from the ``tokenizers`` JSON with special tokens masked out
  (done once per library)
* grammar compile time (the mean of ``--compile-reps`` runs, with caches disabled where
  the library has one), per-request matcher creation time, and the time of the first
  mask fill on a fresh matcher
* per-step mask fill, and fill + advance, as the mean and p99 in microseconds over
  ``--steps`` steps, at each ``--batch`` size. A step fills one shared ``int32`` bitmask
  ``[B, ceil(V/32)]`` for all B matchers through the library's batched API (if it has
  one), then advances each matcher by one token. Matchers follow a fixed valid string,
  tokenized by the real tokenizer and followed by EOS; when a matcher reaches the end,
  it is reset (the reset isn't timed). In a batch, matcher ``i`` starts ``i`` tokens
  into the walk, so the rows are in different states. At batch 1 every mask is checked:
  it must allow the next walk token and must not allow the non-stop special tokens.
* for speculative decoding, at batch 1: validating up to 4 draft tokens without changing
  the state, and accepting 4 tokens then rolling them back
* applying the bitmask to float32 logits ``[B, V]`` with the library's own apply function,
  next to a plain-torch unpack + ``masked_fill_`` for reference
* whether a mask fill lets go of the GIL: the pure-Python throughput of the main thread
  while another thread fills masks nonstop, as a fraction of the throughput when it runs
  alone, with the switch interval raised to 1 s (about 1.0 = released, about 0 = held)

Each library runs in its own subprocess (``--in-process`` to turn that off). Per-request
matchers come from the cheapest path each library offers: ``GrammarMatcher(compiled)``
for xgrammar, ``deep_copy()`` of a warmed template ``LLMatcher`` for llguidance (a fresh
``LLMatcher`` costs 0.5-1 ms), and ``Guide(index)`` for outlines-core. The machine's load
average is printed, since the figures are only as quiet as the machine.

Run it from the repository root (it isn't importable as ``tandem.bench.grammar_libs``
until the package is installed):

    python bench/grammar_libs.py                      # every library, constraint and batch
    python bench/grammar_libs.py --libs xgrammar --constraints regex --batch 1
    python bench/grammar_libs.py --json /tmp/grammar_libs.json

It prints Markdown tables. ``--json PATH`` also writes the raw numbers.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import statistics
import sys
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

DEFAULT_ASSETS = Path(__file__).resolve().parent.parent / "engine" / "assets" / "trained" / "target"

PERSON_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer"},
        "tags": {"type": "array", "items": {"type": "string"}},
    },
    "required": ["name", "age"],
}

PHONE_REGEX = r"[0-9]{3}-[0-9]{4}"

ARITH_LARK = r"""
start: expr
expr: term (("+" | "-") term)*
term: factor (("*" | "/") factor)*
factor: NUMBER | "(" expr ")" | "-" factor
NUMBER: /[0-9]+/
"""


@dataclass(frozen=True)
class Constraint:
    """A constraint and a valid string used to walk it (single spaces: outlines-core's
    JSON regexes only allow ``[ ]?`` between tokens)."""

    name: str
    kind: str  # "json_schema" | "regex" | "lark"
    spec: str
    walk_text: str


CONSTRAINTS: dict[str, Constraint] = {
    c.name: c
    for c in (
        Constraint(
            "json_object",
            "json_schema",
            json.dumps({"type": "object"}),
            '{"id": 17, "name": "Alice Smith", "tags": ["red", "green"], '
            '"nested": {"ok": true, "score": -3.5}, "note": "done"}',
        ),
        Constraint(
            "json_schema",
            "json_schema",
            json.dumps(PERSON_SCHEMA),
            '{"name": "Alice Smith", "age": 42, "tags": ["red", "green", "blue"]}',
        ),
        Constraint("regex", "regex", PHONE_REGEX, "555-1234"),
        Constraint("lark", "lark", ARITH_LARK, "(12+3)*45-6/(7+8)*-9"),
    )
}


# --------------------------------------------------------------------------- tokenizer


def _byte_decoder() -> dict[str, int]:
    """The inverse of GPT-2's ``bytes_to_unicode``: byte-level BPE symbol -> byte."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
    bs += list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(bs, cs, strict=True)}


@dataclass
class TokenizerData:
    """What every library needs, read once from the HF ``tokenizers`` files."""

    tokenizer: Any  # tokenizers.Tokenizer
    json_str: str
    vocab_size: int  # model vocab (config.json), the mask width
    stop_ids: list[int]  # generation_config eos_token_id(s)
    special_ids: set[int]  # all special added tokens, stop tokens included
    symbols: list[str]  # byte-level BPE symbol per id ("" for ids without a token)
    token_bytes: list[bytes | None]  # decoded bytes per id, None for special tokens

    @property
    def non_stop_special_ids(self) -> list[int]:
        return sorted(self.special_ids - set(self.stop_ids))

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False).ids)


def load_tokenizer(assets: Path) -> TokenizerData:
    import tokenizers

    tok = tokenizers.Tokenizer.from_file(str(assets / "tokenizer.json"))
    spec = json.loads(tok.to_str())
    pre, dec = spec.get("pre_tokenizer") or {}, spec.get("decoder") or {}
    if pre.get("type") != "ByteLevel" or dec.get("type") != "ByteLevel":
        raise SystemExit(
            f"expected a byte-level BPE tokenizer, got pre={pre.get('type')} dec={dec.get('type')}"
        )
    config = json.loads((assets / "config.json").read_text())
    vocab_size = int(config["vocab_size"])
    gen_path = assets / "generation_config.json"
    eos: Any = json.loads(gen_path.read_text()).get("eos_token_id") if gen_path.exists() else None
    if eos is None:
        eos = config["eos_token_id"]
    stop_ids = [int(e) for e in (eos if isinstance(eos, list) else [eos])]
    special = {i: t.content for i, t in tok.get_added_tokens_decoder().items() if t.special}
    decoder = _byte_decoder()
    symbols = [""] * vocab_size
    token_bytes: list[bytes | None] = [None] * vocab_size
    for sym, i in tok.get_vocab(with_added_tokens=True).items():
        if i >= vocab_size:
            continue
        symbols[i] = sym
        if i not in special:
            token_bytes[i] = bytes(decoder[c] for c in sym)
    return TokenizerData(
        tok, tok.to_str(), vocab_size, stop_ids, set(special), symbols, token_bytes
    )


# --------------------------------------------------------------------------- backends


class Unsupported(Exception):
    """The library has no way to express this constraint."""


class Backend(ABC):
    """One library behind the operations the benchmark times."""

    name: str
    dist: str  # distribution name for the version
    apply_name: str

    def __init__(self, threads: int) -> None:
        self.threads = threads

    @property
    def version(self) -> str:
        return importlib.metadata.version(self.dist)

    @abstractmethod
    def build_tokenizer(self, tok: TokenizerData) -> None: ...

    @abstractmethod
    def compile(self, c: Constraint) -> Any: ...

    @abstractmethod
    def new_matcher(self, compiled: Any) -> Any: ...

    @abstractmethod
    def fill(self, matcher: Any, bitmask: torch.Tensor, row: int) -> None: ...

    def fill_batch(self, matchers: Sequence[Any], bitmask: torch.Tensor) -> None:
        for i, m in enumerate(matchers):
            self.fill(m, bitmask, i)

    @abstractmethod
    def advance(self, matcher: Any, token: int) -> bool: ...

    def advance_batch(self, matchers: Sequence[Any], tokens: Sequence[int]) -> list[bool]:
        return [self.advance(m, t) for m, t in zip(matchers, tokens, strict=True)]

    @abstractmethod
    def reset(self, matcher: Any) -> None: ...

    @abstractmethod
    def validate(self, matcher: Any, drafts: Sequence[int]) -> int:
        """How many leading drafts the grammar allows; the matcher's state is unchanged."""

    @abstractmethod
    def rollback(self, matcher: Any, k: int) -> None: ...

    @abstractmethod
    def apply(self, logits: torch.Tensor, bitmask: torch.Tensor) -> None: ...


class XGrammarBackend(Backend):
    name, dist, apply_name = "xgrammar", "xgrammar", "xgr.apply_token_bitmask_inplace (cpu)"

    def __init__(self, threads: int) -> None:
        super().__init__(threads)
        import xgrammar as xgr

        self.xgr = xgr

    def build_tokenizer(self, tok: TokenizerData) -> None:
        # Built from the vocab directly: TokenizerInfo.from_huggingface keeps <|bos|>,
        # <|pad|> and <|im_start|> as plain text (they'd be allowed inside JSON strings);
        # an empty string marks a token as special, which is never allowed.
        xgr = self.xgr
        encoded = ["" if i in tok.special_ids else s for i, s in enumerate(tok.symbols)]
        self.info = xgr.TokenizerInfo(
            encoded,
            xgr.VocabType.BYTE_LEVEL,
            vocab_size=tok.vocab_size,
            stop_token_ids=tok.stop_ids,
        )
        self.compiler = xgr.GrammarCompiler(
            self.info, max_threads=self.threads, cache_enabled=False
        )
        self.batcher = xgr.BatchGrammarMatcher(max_threads=self.threads)

    def compile(self, c: Constraint) -> Any:
        if c.kind == "json_schema":
            return self.compiler.compile_json_schema(c.spec)
        if c.kind == "regex":
            return self.compiler.compile_regex(c.spec)
        return self.compiler.compile_lark(c.spec)

    def new_matcher(self, compiled: Any) -> Any:
        return self.xgr.GrammarMatcher(compiled)  # max_rollback_tokens=-1: unlimited

    def fill(self, matcher: Any, bitmask: torch.Tensor, row: int) -> None:
        matcher.fill_next_token_bitmask(bitmask, row)

    def fill_batch(self, matchers: Sequence[Any], bitmask: torch.Tensor) -> None:
        self.batcher.batch_fill_next_token_bitmask(list(matchers), bitmask)

    def advance(self, matcher: Any, token: int) -> bool:
        return bool(matcher.accept_token(token))

    def advance_batch(self, matchers: Sequence[Any], tokens: Sequence[int]) -> list[bool]:
        return list(self.xgr.BatchGrammarMatcher.batch_accept_token(list(matchers), list(tokens)))

    def reset(self, matcher: Any) -> None:
        matcher.reset()

    def validate(self, matcher: Any, drafts: Sequence[int]) -> int:
        n = 0
        for t in drafts:  # a rejected token leaves the state as it was
            if not matcher.accept_token(t):
                break
            n += 1
        if n:
            matcher.rollback(n)
        return n

    def rollback(self, matcher: Any, k: int) -> None:
        matcher.rollback(k)

    def apply(self, logits: torch.Tensor, bitmask: torch.Tensor) -> None:
        self.xgr.apply_token_bitmask_inplace(logits, bitmask)


class LLGuidanceBackend(Backend):
    name, dist = "llguidance", "llguidance"
    apply_name = "llguidance.torch.apply_token_bitmask_inplace (torch.compile)"

    def __init__(self, threads: int) -> None:
        super().__init__(threads)
        import llguidance
        import llguidance.torch

        self.llg = llguidance
        self.llt = llguidance.torch

    def build_tokenizer(self, tok: TokenizerData) -> None:
        # Special tokens are recognised from the tokenizer JSON and never match grammar text.
        self.tok = self.llg.LLTokenizer(
            tok.json_str, n_vocab=tok.vocab_size, eos_token=tok.stop_ids
        )
        self.executor = self.llg.LLExecutor(num_threads=self.threads)

    def compile(self, c: Constraint) -> Any:
        M = self.llg.LLMatcher
        if c.kind == "json_schema":
            grammar = M.grammar_from_json_schema(c.spec)
        elif c.kind == "regex":
            grammar = M.grammar_from_regex(c.spec)
        else:
            grammar = M.grammar_from_lark(c.spec)
        # There is no separate compiled artefact: the first matcher parses and checks the
        # grammar (LLMatcher never raises; errors put it in an error state) and its first
        # mask builds the lexer lazily. Keep it as a template: deep_copy() shares that work.
        template = M(self.tok, grammar, log_level=0)
        if template.is_error():
            raise RuntimeError(template.get_error())
        scratch = self.llt.allocate_token_bitmask(1, self.tok.vocab_size)
        self.llt.fill_next_token_bitmask(template, scratch, 0)
        return template

    def new_matcher(self, compiled: Any) -> Any:
        return compiled.deep_copy()  # ~1 µs; LLMatcher(tok, grammar) would be 0.5-1 ms

    def fill(self, matcher: Any, bitmask: torch.Tensor, row: int) -> None:
        self.llt.fill_next_token_bitmask(matcher, bitmask, row)

    def fill_batch(self, matchers: Sequence[Any], bitmask: torch.Tensor) -> None:
        self.llt.fill_next_token_bitmask_par(
            self.executor, [(m, i) for i, m in enumerate(matchers)], bitmask
        )

    def advance(self, matcher: Any, token: int) -> bool:
        return bool(matcher.consume_token(token))

    def advance_batch(self, matchers: Sequence[Any], tokens: Sequence[int]) -> list[bool]:
        return list(
            self.llt.consume_token_par(self.executor, list(zip(matchers, tokens, strict=True)))
        )

    def reset(self, matcher: Any) -> None:
        matcher.reset()

    def validate(self, matcher: Any, drafts: Sequence[int]) -> int:
        return int(matcher.validate_tokens(list(drafts)))

    def rollback(self, matcher: Any, k: int) -> None:
        matcher.rollback(k)

    def apply(self, logits: torch.Tensor, bitmask: torch.Tensor) -> None:
        self.llt.apply_token_bitmask_inplace(logits, bitmask)


class OutlinesCoreBackend(Backend):
    name, dist = "outlines-core", "outlines-core"
    apply_name = "outlines_core.kernels.torch.apply_token_bitmask_inplace (torch.compile)"
    MAX_ROLLBACK = 64

    def __init__(self, threads: int) -> None:
        super().__init__(threads)
        import outlines_core
        import outlines_core.kernels.torch

        self.oc = outlines_core
        self.okt = outlines_core.kernels.torch

    def build_tokenizer(self, tok: TokenizerData) -> None:
        # A single EOS id only: the second stop token (<|im_end|>) must be handled by the
        # caller. Special tokens are left out of the vocabulary so they can't be allowed.
        by_bytes: dict[bytes, list[int]] = {}
        for i, b in enumerate(tok.token_bytes):
            if b is not None:
                by_bytes.setdefault(b, []).append(i)
        self.eos = tok.stop_ids[0]
        self.vocab = self.oc.Vocabulary(self.eos, by_bytes)
        self.words = (tok.vocab_size + 31) // 32

    def compile(self, c: Constraint) -> Any:
        if c.kind == "json_schema":
            regex = self.oc.json_schema.build_regex_from_schema(c.spec)
        elif c.kind == "regex":
            regex = c.spec
        else:
            raise Unsupported("outlines-core has no CFG/Lark support")
        return self.oc.Index(regex, self.vocab)

    def new_matcher(self, compiled: Any) -> Any:
        return _Guided(self.oc.Guide(compiled, max_rollback=self.MAX_ROLLBACK), compiled)

    def fill(self, matcher: Any, bitmask: torch.Tensor, row: int) -> None:
        # Rows of a contiguous [B, W] int32 tensor: row i starts at data_ptr + i * W * 4.
        matcher.guide.write_mask_into(
            bitmask.data_ptr() + row * bitmask.shape[1] * 4, bitmask.shape[1], 4
        )

    def advance(self, matcher: Any, token: int) -> bool:
        if token == self.eos:  # Guide.advance(eos) raises in a final state; the request ends
            return bool(matcher.guide.is_finished())
        matcher.guide.advance(token, return_tokens=False)  # raises on a disallowed token
        return True

    def reset(self, matcher: Any) -> None:
        matcher.guide.reset()

    def validate(self, matcher: Any, drafts: Sequence[int]) -> int:
        # Walk the Index from the Guide's state; the Guide itself is not touched.
        state = matcher.guide.get_state()
        n = 0
        for t in drafts:
            state = matcher.index.get_next_state(state, t)
            if state is None:
                break
            n += 1
        return n

    def rollback(self, matcher: Any, k: int) -> None:
        matcher.guide.rollback_state(k)

    def apply(self, logits: torch.Tensor, bitmask: torch.Tensor) -> None:
        self.okt.apply_token_bitmask_inplace(logits, bitmask)


@dataclass
class _Guided:
    """An outlines-core Guide with its Index (the Guide doesn't expose it)."""

    guide: Any
    index: Any


BACKENDS: dict[str, type[Backend]] = {
    b.name: b for b in (XGrammarBackend, LLGuidanceBackend, OutlinesCoreBackend)
}


# --------------------------------------------------------------------------- measuring


def _us(ns: float) -> float:
    return ns / 1e3


def _stats(samples_ns: Sequence[int]) -> dict[str, float]:
    s = sorted(samples_ns)
    p99 = s[min(len(s) - 1, round(0.99 * (len(s) - 1)))]
    return {"mean_us": _us(statistics.fmean(s)), "p99_us": _us(p99)}


def _unpack(bitmask: torch.Tensor, vocab: int) -> torch.Tensor:
    shifts = torch.arange(32, dtype=torch.int32)
    return ((bitmask.unsqueeze(-1) >> shifts) & 1).bool().reshape(bitmask.shape[0], -1)[:, :vocab]


def torch_native_apply(logits: torch.Tensor, bitmask: torch.Tensor) -> None:
    """Reference apply: unpack the bitmask to bools and ``masked_fill_`` the rest."""
    logits.masked_fill_(~_unpack(bitmask, logits.shape[1]), float("-inf"))


@dataclass
class WalkResult:
    batch: int
    fill: dict[str, float]
    step: dict[str, float]
    mean_allowed: float | None = None  # batch 1 only


@dataclass
class ConstraintResult:
    library: str
    constraint: str
    supported: bool = True
    error: str | None = None
    compile_ms: float | None = None
    matcher_us: float | None = None
    first_fill_us: float | None = None
    walks: list[WalkResult] = field(default_factory=list)
    validate4: dict[str, float] | None = None
    accept4_rollback4: dict[str, float] | None = None
    gil_free_ratio: float | None = None


@dataclass
class ApplyResult:
    function: str
    batch: int
    mean_us: float
    p99_us: float
    first_call_s: float


@dataclass
class LibraryResult:
    library: str
    version: str | None
    available: bool
    error: str | None = None
    tokenizer_info_ms: float | None = None
    constraints: list[ConstraintResult] = field(default_factory=list)
    apply: list[ApplyResult] = field(default_factory=list)


def walk(
    b: Backend, compiled: Any, seq: list[int], tok: TokenizerData, batch: int, steps: int
) -> WalkResult:
    """Fill + advance ``steps`` times for ``batch`` matchers cycling through ``seq``."""
    cycle = len(seq)
    matchers = [b.new_matcher(compiled) for _ in range(batch)]
    pos = [0] * batch
    for i, m in enumerate(matchers):  # stagger the rows through the walk
        for t in seq[: i % cycle]:
            assert b.advance(m, t)
        pos[i] = i % cycle
    bitmask = torch.full((batch, (tok.vocab_size + 31) // 32), -1, dtype=torch.int32)
    forbidden = tok.non_stop_special_ids
    fill_ns: list[int] = []
    step_ns: list[int] = []
    allowed: list[int] = []
    for _ in range(steps):
        tokens = [seq[p] for p in pos]
        t0 = time.perf_counter_ns()
        if batch == 1:
            b.fill(matchers[0], bitmask, 0)
        else:
            b.fill_batch(matchers, bitmask)
        t1 = time.perf_counter_ns()
        ok = (
            b.advance(matchers[0], tokens[0])
            if batch == 1
            else all(b.advance_batch(matchers, tokens))
        )
        t2 = time.perf_counter_ns()
        if not ok:
            raise RuntimeError(f"{b.name}: a walk token was rejected at positions {pos}")
        fill_ns.append(t1 - t0)
        step_ns.append(t2 - t0)
        if batch == 1:
            row = _unpack(bitmask, tok.vocab_size)[0]
            if not row[tokens[0]]:
                raise RuntimeError(f"{b.name}: mask disallows walk token {tokens[0]} at {pos[0]}")
            if forbidden and bool(row[forbidden].any()):
                raise RuntimeError(f"{b.name}: mask allows special tokens {forbidden}")
            allowed.append(int(row.sum()))
        for i in range(batch):
            pos[i] += 1
            if pos[i] == cycle:
                b.reset(matchers[i])
                pos[i] = 0
    return WalkResult(
        batch, _stats(fill_ns), _stats(step_ns), statistics.fmean(allowed) if allowed else None
    )


def spec_decode(
    b: Backend, compiled: Any, seq: list[int], steps: int, k: int = 4
) -> tuple[dict[str, float], dict[str, float]]:
    """At each walk position: validate up to k drafts (the real next tokens, the last one
    replaced by EOS so a rejection is likely), then accept k tokens and roll them back."""
    m = b.new_matcher(compiled)
    text_len = len(seq) - 1  # seq ends with EOS; drafts stay within the text
    val_ns: list[int] = []
    rb_ns: list[int] = []
    pos = 0
    for _ in range(steps):
        drafts = seq[pos : min(pos + k, text_len)]
        if len(drafts) > 1:
            drafts = [*drafts[:-1], seq[-1]]
        t0 = time.perf_counter_ns()
        b.validate(m, drafts)
        t1 = time.perf_counter_ns()
        val_ns.append(t1 - t0)
        run = seq[pos : min(pos + k, text_len)]
        if len(run) == k:
            t0 = time.perf_counter_ns()
            for t in run:
                b.advance(m, t)
            b.rollback(m, k)
            rb_ns.append(time.perf_counter_ns() - t0)
        b.advance(m, seq[pos])
        pos += 1
        if pos == text_len:
            b.reset(m)
            pos = 0
    return _stats(val_ns), _stats(rb_ns) if rb_ns else {}


def gil_free_ratio(fn: Callable[[], None], seconds: float = 0.2) -> float:
    """Main-thread Python throughput while another thread calls ``fn`` nonstop, relative
    to running alone.

    The switch interval is raised to 1 s and the main thread's time window is fixed
    before it sleeps, so the main thread gets to run in that window only if ``fn``
    drops the GIL: about 1.0 = released, about 0 = held for the whole call.
    """

    def spin_until(end: float) -> int:
        n = 0
        while time.perf_counter() < end:
            n += 1
        return n

    alone = spin_until(time.perf_counter() + seconds)
    stop = threading.Event()

    def loop() -> None:
        while not stop.is_set():
            fn()

    old = sys.getswitchinterval()
    sys.setswitchinterval(1.0)
    try:
        th = threading.Thread(target=loop, daemon=True)
        th.start()
        end = time.perf_counter() + 0.01 + seconds
        time.sleep(0.01)  # hands the GIL to the filler; waking up needs it back
        together = spin_until(end)
        stop.set()
        th.join()
    finally:
        sys.setswitchinterval(old)
    return together / alone


def measure_apply(
    fn: Callable[[torch.Tensor, torch.Tensor], None],
    name: str,
    batch: int,
    bitmask: torch.Tensor,
    vocab: int,
    reps: int,
) -> ApplyResult:
    base = torch.randn(batch, vocab, dtype=torch.float32)
    logits = base.clone()
    t0 = time.perf_counter()
    fn(logits, bitmask)  # first call: compiles, for torch.compile kernels
    first = time.perf_counter() - t0
    expect = _unpack(bitmask, vocab)
    if not torch.equal(torch.isfinite(logits), expect):
        raise RuntimeError(f"{name}: wrong logits after apply")
    samples: list[int] = []
    for _ in range(reps):
        logits.copy_(base)
        t0n = time.perf_counter_ns()
        fn(logits, bitmask)
        samples.append(time.perf_counter_ns() - t0n)
    s = _stats(samples)
    return ApplyResult(name, batch, s["mean_us"], s["p99_us"], first)


def _walk_tokens(tok: TokenizerData, c: Constraint) -> list[int]:
    return [*tok.encode(c.walk_text), tok.stop_ids[0]]


def run_library(name: str, tok: TokenizerData, args: argparse.Namespace) -> LibraryResult:
    try:
        b = BACKENDS[name](args.threads)
    except ImportError as e:
        return LibraryResult(name, None, False, error=f"not importable: {e}")
    res = LibraryResult(name, b.version, True)
    samples = []
    for _ in range(args.compile_reps):
        t0 = time.perf_counter()
        b.build_tokenizer(tok)
        samples.append(time.perf_counter() - t0)
    res.tokenizer_info_ms = statistics.fmean(samples) * 1e3
    last_mask: dict[int, torch.Tensor] = {}
    for cname in args.constraints:
        c = CONSTRAINTS[cname]
        cr = ConstraintResult(name, cname)
        res.constraints.append(cr)
        try:
            times = []
            for _ in range(args.compile_reps):
                t0 = time.perf_counter()
                compiled = b.compile(c)
                times.append(time.perf_counter() - t0)
        except Unsupported as e:
            cr.supported, cr.error = False, str(e)
            continue
        cr.compile_ms = statistics.fmean(times) * 1e3
        seq = _walk_tokens(tok, c)
        mt = []
        for _ in range(20):
            t0n = time.perf_counter_ns()
            m = b.new_matcher(compiled)
            mt.append(time.perf_counter_ns() - t0n)
        cr.matcher_us = _us(statistics.median(mt))
        bm1 = torch.full((1, (tok.vocab_size + 31) // 32), -1, dtype=torch.int32)
        t0n = time.perf_counter_ns()
        b.fill(m, bm1, 0)
        cr.first_fill_us = _us(time.perf_counter_ns() - t0n)
        for batch in args.batch:
            cr.walks.append(walk(b, compiled, seq, tok, batch, args.steps))
        cr.validate4, cr.accept4_rollback4 = spec_decode(b, compiled, seq, args.steps)
        # GIL probe: refill one mid-walk state nonstop.
        gm = b.new_matcher(compiled)
        for t in seq[: len(seq) // 2]:
            b.advance(gm, t)
        cr.gil_free_ratio = statistics.median(
            gil_free_ratio(lambda m=gm, bm=bm1: b.fill(m, bm, 0)) for _ in range(3)
        )
        for batch in args.batch:
            bm = torch.full((batch, bm1.shape[1]), -1, dtype=torch.int32)
            ms = [b.new_matcher(compiled) for _ in range(batch)]
            for i, mm in enumerate(ms):
                for t in seq[: i % (len(seq) - 1)]:
                    b.advance(mm, t)
            b.fill_batch(ms, bm)
            last_mask[batch] = bm
    for batch, bm in sorted(last_mask.items()):
        res.apply.append(
            measure_apply(b.apply, b.apply_name, batch, bm, tok.vocab_size, args.steps)
        )
    return res


# --------------------------------------------------------------------------- report


def _f(x: float | None, digits: int = 1) -> str:
    return "–" if x is None else f"{x:.{digits}f}"


def _ms(d: dict[str, float] | None) -> str:
    return "–" if not d else f"{d['mean_us']:.1f} / {d['p99_us']:.1f}"


def render(
    results: list[LibraryResult],
    native_apply: list[ApplyResult],
    tok: TokenizerData,
    args: argparse.Namespace,
) -> str:
    out: list[str] = []
    out.append(
        f"Tokenizer: byte-level BPE, vocab {tok.vocab_size}, stop ids {tok.stop_ids}, "
        f"special ids {sorted(tok.special_ids)}; torch {torch.__version__}, "
        f"{args.threads} thread(s), {args.steps} steps; load average at start "
        f"{args.load_at_start:.2f}, at end {os.getloadavg()[0]:.2f} (the timings are only "
        "as quiet as the machine)\n"
    )
    out.append("| library | version | tokenizer info (ms) |")
    out.append("|---|---|---|")
    for r in results:
        info = _f(r.tokenizer_info_ms, 2) if r.available else r.error
        out.append(f"| {r.library} | {r.version or '–'} | {info} |")
    out.append("")
    hdr = "| library | constraint | compile (ms) | new matcher (µs) | first fill (µs) |"
    sep = "|---|---|---|---|---|"
    for batch in args.batch:
        hdr += f" B={batch} fill mean / p99 (µs) | B={batch} fill+advance mean / p99 (µs) |"
        sep += "---|---|"
    hdr += " allowed (mean, B=1) |"
    sep += "---|"
    out += [hdr, sep]
    for r in results:
        for c in r.constraints:
            if not c.supported:
                blanks = " |" * (2 * len(args.batch) + 1)
                out.append(f"| {r.library} | {c.constraint} | unsupported | | |{blanks}")
                continue
            row = (
                f"| {r.library} | {c.constraint} | {_f(c.compile_ms, 2)}"
                f" | {_f(c.matcher_us)} | {_f(c.first_fill_us)} |"
            )
            allowed = None
            for w in c.walks:
                row += f" {_ms(w.fill)} | {_ms(w.step)} |"
                if w.mean_allowed is not None:
                    allowed = w.mean_allowed
            out.append(row + f" {_f(allowed)} |")
    out.append("")
    out.append("Speculative decoding (B=1) and GIL:\n")
    out.append(
        "| library | constraint | validate ≤4 drafts mean / p99 (µs)"
        " | accept 4 + rollback 4 mean / p99 (µs)"
        " | main-thread throughput while filling (1.0 = GIL free) |"
    )
    out.append("|---|---|---|---|---|")
    for r in results:
        for c in r.constraints:
            if c.supported:
                out.append(
                    f"| {r.library} | {c.constraint} | {_ms(c.validate4)}"
                    f" | {_ms(c.accept4_rollback4)} | {_f(c.gil_free_ratio, 2)} |"
                )
    out.append("")
    out.append(f"Applying the bitmask to float32 logits [B, {tok.vocab_size}]:\n")
    out.append("| function | B | mean / p99 (µs) | first call (s) |")
    out.append("|---|---|---|---|")
    for a in [a for r in results for a in r.apply] + native_apply:
        timing = f"{a.mean_us:.1f} / {a.p99_us:.1f}"
        out.append(f"| {a.function} | {a.batch} | {timing} | {a.first_call_s:.3f} |")
    return "\n".join(out)


def _run_isolated(name: str, argv: Sequence[str]) -> LibraryResult:
    """Run one library in a fresh interpreter, so thread pools, torch.compile caches and
    allocator state of one library don't affect the next."""
    import subprocess
    import tempfile

    rest = _strip_option(list(argv), "--libs", takes_values=True)
    rest = _strip_option(_strip_option(rest, "--json"), "--child-json")
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "result.json"
        cmd = [
            sys.executable,
            str(Path(__file__).resolve()),
            *rest,
            "--libs",
            name,
            "--child-json",
            str(out),
        ]
        proc = subprocess.run(cmd, stdout=subprocess.DEVNULL, check=False)
        if proc.returncode != 0 or not out.exists():
            return LibraryResult(
                name, None, False, error=f"subprocess failed (rc={proc.returncode})"
            )
        return _library_from_dict(json.loads(out.read_text()))


def _strip_option(argv: list[str], opt: str, takes_values: bool = False) -> list[str]:
    """Drop ``opt`` and its value (or values, up to the next option) from ``argv``."""
    out: list[str] = []
    i = 0
    while i < len(argv):
        a = argv[i]
        if a == opt or a.startswith(opt + "="):
            i += 1
            if "=" not in a:
                if takes_values:
                    while i < len(argv) and not argv[i].startswith("--"):
                        i += 1
                else:
                    i += 1
            continue
        out.append(a)
        i += 1
    return out


def _library_from_dict(d: dict[str, Any]) -> LibraryResult:
    r = LibraryResult(
        d["library"], d["version"], d["available"], d["error"], d["tokenizer_info_ms"]
    )
    for c in d["constraints"]:
        walks = [WalkResult(**w) for w in c.pop("walks")]
        r.constraints.append(ConstraintResult(**c, walks=walks))
    r.apply = [ApplyResult(**a) for a in d["apply"]]
    return r


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--assets",
        type=Path,
        default=DEFAULT_ASSETS,
        help="folder with tokenizer.json and config.json",
    )
    p.add_argument("--libs", nargs="+", default=list(BACKENDS), choices=list(BACKENDS))
    p.add_argument("--constraints", nargs="+", default=list(CONSTRAINTS), choices=list(CONSTRAINTS))
    p.add_argument("--batch", nargs="+", type=int, default=[1, 64])
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--compile-reps", type=int, default=3)
    p.add_argument(
        "--threads",
        type=int,
        default=os.cpu_count() or 1,
        help="worker threads for batched fills and compilers",
    )
    p.add_argument("--json", type=Path, help="also write the raw results here")
    p.add_argument(
        "--in-process",
        action="store_true",
        help="run all libraries in this process (default: one subprocess each)",
    )
    p.add_argument("--child-json", type=Path, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    args.load_at_start = os.getloadavg()[0]
    torch.set_num_threads(args.threads)

    tok = load_tokenizer(args.assets)
    results: list[LibraryResult] = []
    for name in args.libs:
        if not args.child_json:
            print(f"... {name}", file=sys.stderr, flush=True)
        if args.in_process or len(args.libs) == 1:
            results.append(run_library(name, tok, args))
        else:
            results.append(_run_isolated(name, argv if argv is not None else sys.argv[1:]))
    if args.child_json:
        args.child_json.write_text(json.dumps(asdict(results[0])))
        return 0

    native: list[ApplyResult] = []
    words = (tok.vocab_size + 31) // 32
    gen = torch.Generator().manual_seed(0)
    for batch in args.batch:
        bm = torch.randint(-(2**31), 2**31 - 1, (batch, words), dtype=torch.int32, generator=gen)
        name = "torch unpack + masked_fill_ (reference)"
        native.append(
            measure_apply(torch_native_apply, name, batch, bm, tok.vocab_size, args.steps)
        )

    print(render(results, native, tok, args))
    if args.json:
        payload = {
            "tokenizer": {
                "vocab_size": tok.vocab_size,
                "stop_ids": tok.stop_ids,
                "special_ids": sorted(tok.special_ids),
            },
            "torch": torch.__version__,
            "threads": args.threads,
            "load_average": {"start": args.load_at_start, "end": os.getloadavg()[0]},
            "steps": args.steps,
            "libraries": [asdict(r) for r in results],
            "native_apply": [asdict(a) for a in native],
        }
        args.json.write_text(json.dumps(payload, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
