"""Speculative decoding: tokens/s and tokens per target forward, with and without.

    python bench/specdec.py [--cases ngram-copy,trained-draft,random-draft] [--quick]
        [--repeats 3]

Every case runs the same requests in this process, one request at a time (batch 1,
where decode is most memory-bound and speculation pays most): plainly, then in each
speculative configuration. Greedy output must be identical (checked). Cases:

* ``ngram-copy``: n-gram prompt lookup, k = 4 and k = 8, on a copy-heavy workload —
  prompts holding a block of code and asking for it again (editing and extraction look
  like this). The 3M-parameter trained target does not copy on request (it has not
  learned to); its greedy output repeats *itself* instead, and that repetition is what
  the lookup catches (``copy_sources`` measures both);
* ``trained-draft``: the trained draft proposing for the trained target
  (``engine/assets/trained``), on held-out snippets of the training corpus, with k = 4
  fixed and with the adaptive k;
* ``random-draft``: a random ``tiny`` draft for a random ``medium`` target — near-zero
  acceptance, where adaptive k must keep throughput at least 0.95x of plain decoding.

Figures: output tokens/s over the whole run; tokens per target forward (output tokens /
target passes); acceptance rate (accepted / proposed drafts); accepted drafts per
verification, and tokens per verification (those plus the target's own token: the
"acceptance length" of the literature); proposer time share. Writes
``bench/results/specdec.json``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path

import torch

from tandem.bench.machine_load import OtherLoad
from tandem.engine import LLM, SamplingParams
from tandem.engine.spec_decode.speculator import SpecDecodeStats

RESULTS = Path("bench/results")
HELD_OUT_FILES = 8  # well inside the 2% of the corpus that training holds out
COPY_SNIPPET_CHARS = 320  # ~100 tokens: prompt + answer stay within the 256 trained positions
COPY_MAX_TOKENS = 96
NGRAM_KS = (4, 8)  # n-gram drafts cost nothing to propose; only verification limits k
ASSETS = Path(__file__).resolve().parent.parent / "engine" / "assets" / "trained"


@dataclass(frozen=True)
class Case:
    name: str
    target: str
    variants: dict[str, dict]
    """Speculative configurations to compare with plain decoding: label -> engine kwargs."""
    prompts: list[list[int]]
    max_tokens: int


@dataclass(frozen=True)
class Run:
    tokens_per_s: float
    tokens_per_forward: float
    """Output tokens per target forward pass (batch 1: per step)."""
    acceptance_rate: float | None
    """Accepted / proposed draft tokens."""
    mean_accepted: float | None
    """Accepted draft tokens per verification."""
    tokens_per_verification: float | None
    """Tokens a verification yields: accepted drafts plus the target's own (the
    "acceptance length" of the EAGLE / Medusa papers; 1.0 means no draft accepted)."""
    proposer_share: float | None
    seconds: float
    other_load: float | None


def measure(case: Case, repeats: int) -> dict[str, tuple[Run, list[list[int]]]]:
    """Every mode of ``case`` (plain first), each on its own engine, the timed passes
    interleaved (plain, variant, ..., plain, variant, ...) so drifts in machine speed hit
    every mode alike; tok/s is the median pass, the other figures cover all passes."""
    greedy = SamplingParams(temperature=0, max_tokens=case.max_tokens, ignore_eos=True)
    engines = {}
    for label, kwargs in {"plain": {}, **case.variants}.items():
        llm = LLM(case.target, dtype="float32", num_kv_blocks=1024, max_model_len=2048, **kwargs)
        llm.generate([case.prompts[-1]], greedy)  # warm up: one whole request, not timed
        spec = llm.engine.speculator
        engines[label] = (llm, llm.engine.num_steps, replace(spec.stats) if spec else None)
    passes: dict[str, list[float]] = {label: [] for label in engines}
    outputs: dict[str, list[list[int]]] = {}
    meter = OtherLoad.start()
    for _ in range(repeats):
        for label, (llm, _, _) in engines.items():
            start = time.perf_counter()
            outputs[label] = [llm.generate([p], greedy)[0].token_ids for p in case.prompts]
            passes[label].append(time.perf_counter() - start)
    other_load = meter.cores()
    runs = {}
    for label, (llm, steps_before, before) in engines.items():
        tokens = sum(len(o) for o in outputs[label])
        seconds = statistics.median(passes[label])
        stats = None
        if before is not None:
            stats = _delta(llm.engine.speculator.stats, before)
        runs[label] = (
            Run(
                tokens_per_s=tokens / seconds,
                tokens_per_forward=tokens * repeats / (llm.engine.num_steps - steps_before),
                acceptance_rate=stats.acceptance_rate if stats else None,
                mean_accepted=stats.mean_accepted_per_verification if stats else None,
                tokens_per_verification=stats.tokens_per_verification if stats else None,
                proposer_share=stats.proposer_seconds / sum(passes[label]) if stats else None,
                seconds=seconds,
                other_load=other_load,
            ),
            outputs[label],
        )
    return runs


def _delta(after: SpecDecodeStats, before: SpecDecodeStats) -> SpecDecodeStats:
    return SpecDecodeStats(
        **{f.name: getattr(after, f.name) - getattr(before, f.name) for f in fields(after)}
    )


def build_cases(names: list[str], quick: bool) -> list[Case]:
    from tandem.common.tokenizer import Tokenizer
    from tandem.tools.checkpoint_maker import make_model

    n, max_tokens = (2, 32) if quick else (8, 128)
    cases = []
    target, draft = ASSETS / "target", ASSETS / "draft"
    tokenizer = Tokenizer.from_dir(target)
    if "ngram-copy" in names:
        cases.append(
            Case(
                "ngram-copy",
                str(target),
                {
                    f"ngram k={k}": {"speculative_method": "ngram", "num_speculative_tokens": k}
                    for k in NGRAM_KS
                },
                [tokenizer.encode(p) for p in copy_prompts(n)],
                min(max_tokens, COPY_MAX_TOKENS),
            )
        )
    if "trained-draft" in names:
        with_draft = {"draft_model": str(draft), "num_speculative_tokens": 4}
        cases.append(
            Case(
                "trained-draft",
                str(target),
                {
                    "k=4": {**with_draft, "speculative_adaptive": False},
                    "adaptive": with_draft,
                },
                [tokenizer.encode(p) for p in corpus_prompts(n)],
                max_tokens,
            )
        )
    if "random-draft" in names:
        models = RESULTS / "models"
        medium = models / "llama-medium"
        if not (medium / "config.json").exists():
            make_model(medium, arch="llama", size="tiny" if quick else "medium")
        tiny = make_model(models / "llama-tiny-draft", arch="llama", size="tiny", seed=5)
        rng = torch.Generator().manual_seed(0)
        prompts = [torch.randint(10, 4000, (64,), generator=rng).tolist() for _ in range(n)]
        cases.append(
            Case(
                "random-draft",
                str(medium),
                {"adaptive": {"draft_model": str(tiny), "num_speculative_tokens": 4}},
                prompts,
                max_tokens,
            )
        )
    return cases


def copy_prompts(n: int) -> list[str]:
    """Code followed by a request to write it out again (from its first quarter on)."""
    snippets = corpus_snippets(n, length=COPY_SNIPPET_CHARS)
    return [f"{s}\n\n# The same code again:\n{s[: len(s) // 4]}" for s in snippets]


def copy_sources(
    prompts: list[list[int]], outputs: list[list[int]], n: int = 4
) -> tuple[float, float]:
    """Where the outputs' n-grams come from: the share found in the prompt, and the share
    found only earlier in the output (repetition)."""
    total = in_prompt = in_output = 0
    for prompt, output in zip(prompts, outputs, strict=True):
        seen_prompt = {tuple(prompt[i : i + n]) for i in range(len(prompt) - n + 1)}
        seen_output: set[tuple[int, ...]] = set()
        for end in range(n, len(output) + 1):
            gram = tuple(output[end - n : end])
            total += 1
            if gram in seen_prompt:
                in_prompt += 1
            elif gram in seen_output:
                in_output += 1
            seen_output.add(gram)
    return (in_prompt / total, in_output / total) if total else (0.0, 0.0)


def corpus_prompts(n: int) -> list[str]:
    return corpus_snippets(n, length=200)


def corpus_snippets(n: int, length: int) -> list[str]:
    """``n`` pieces of the training corpus's held-out tail (the last standard-library
    sources in corpus order, which the trained models never trained on), evenly spaced."""
    from tandem.tools.checkpoint_tokenizer import corpus_files, corpus_texts

    files = corpus_files(None)
    text = "\n".join(corpus_texts(files[-HELD_OUT_FILES:]))
    step = max(1, (len(text) - length) // n)
    return [text[i * step : i * step + length] for i in range(n)]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", default="ngram-copy,trained-draft,random-draft")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3, help="timed passes per mode")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    results = {}
    print(
        f"{'case':14} {'mode':11} {'tok/s':>8} {'speedup':>8} {'tok/fwd':>8} {'accept':>7} "
        f"{'acc/ver':>7} {'tok/ver':>7} {'proposer':>8} {'other load':>10}"
    )
    for case in build_cases(args.cases.split(","), args.quick):
        measured = measure(case, args.repeats)
        plain, reference = measured["plain"]
        for label, (_, outputs) in measured.items():
            if outputs != reference:
                raise SystemExit(f"{case.name} {label}: greedy output differs from plain decoding")
        results[case.name] = {label: asdict(run) for label, (run, _) in measured.items()}
        if case.name == "ngram-copy":
            from_prompt, from_output = copy_sources(case.prompts, reference)
            results[case.name]["copy_sources"] = {"prompt": from_prompt, "output": from_output}
            print(
                f"ngram-copy: output 4-grams found in the prompt {from_prompt:.1%}, "
                f"only earlier in the output {from_output:.1%}"
            )
        for label, (run, _) in measured.items():
            speedup = run.tokens_per_s / plain.tokens_per_s
            print(
                f"{case.name:14} {label:11} {run.tokens_per_s:8.1f} {speedup:7.2f}x "
                f"{run.tokens_per_forward:8.2f} {_pct(run.acceptance_rate):>7} "
                f"{_num(run.mean_accepted):>7} {_num(run.tokens_per_verification):>7} "
                f"{_pct(run.proposer_share):>8} {_num(run.other_load):>10}"
            )
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "specdec.json").write_text(json.dumps(results, indent=2))
    return 0


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{100 * value:.0f}%"


def _num(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


if __name__ == "__main__":
    sys.exit(main())
