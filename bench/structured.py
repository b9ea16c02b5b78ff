"""What structured outputs cost per token, at batch 1 and 64, in the engine.

Per batch size and constraint: the same prompts decoded greedily with and without the
constraint (``ignore_eos``, so plain runs last ``--max-tokens``; a constrained request
may end earlier, when its constraint is complete), one after the other in one process.
Reported: time per output token of each run (the engine's wall time / tokens emitted),
the overhead per token and as a share of the plain figure (medians of ``--repeats``
interleaved runs), and how much of the mask
filling the forward pass hid (``fill``: time the mask thread worked; ``wait``: time the
engine then still waited for it).

    python -m tandem.bench.structured [--model DIR] [--batch 1 64] [--max-tokens 64]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from dataclasses import asdict, dataclass

from tandem.bench.workloads import TokenPool
from tandem.cli.serve import default_model
from tandem.common.sampling_params import SamplingParams, StructuredKind, StructuredOutput

CONSTRAINTS = {
    # Each needs far more than --max-tokens tokens to complete, so constrained runs last
    # as long as plain ones (same batch at every step).
    "regex": StructuredOutput(StructuredKind.REGEX, r"[a-z0-9_ ().,:=\n]{2000}"),
    "json_schema": StructuredOutput.json_schema(
        {
            "type": "array",
            "items": {
                "type": "object",
                "properties": {
                    "name": {"type": "string", "maxLength": 12},
                    "n": {"type": "integer"},
                },
                "required": ["name", "n"],
            },
            "minItems": 200,
        }
    ),
    "grammar": StructuredOutput(
        StructuredKind.GRAMMAR,
        'start: stmt{200,}\nstmt: NAME "=" expr "\\n"\nexpr: NAME | NUM | expr OP expr\n'
        'OP: "+" | "-" | "*"\nNAME: /[a-z_]{1,8}/\nNUM: /[0-9]{1,4}/\n',
    ),
}


@dataclass(frozen=True)
class Row:
    batch: int
    constraint: str
    plain_ms_per_token: float
    constrained_ms_per_token: float
    overhead_us_per_token: float
    overhead_share: float
    fill_ms_per_step: float
    wait_ms_per_step: float
    constrained_tokens: int


def run(
    model: str, batches: list[int], max_tokens: int, threads: int | None, repeats: int
) -> list[Row]:
    import random

    from tandem.engine import LLM

    config = {"dtype": "float32", "num_kv_blocks": 2048, "max_num_seqs": max(batches)}
    if threads:
        config["num_threads"] = threads
    llm = LLM(model, **config)
    pool = TokenPool.from_checkpoint(model)
    rng = random.Random(0)
    rows = []
    for batch in batches:
        prompts = [list(pool.sample(rng, 32)) for _ in range(batch)]
        plain = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
        constrained = {
            name: SamplingParams(
                max_tokens=max_tokens, temperature=0, ignore_eos=True, structured=structured
            )
            for name, structured in CONSTRAINTS.items()
        }
        llm.generate(prompts, plain)  # warm-up (and the prefix cache, for every run alike)
        for params in constrained.values():
            llm.generate(prompts[:1], params)  # compile outside the clock
        so = llm.engine.structured
        # Interleaved repetitions, median of each: the machine's noise hits all alike.
        times: dict[str, list[float]] = {name: [] for name in ("plain", *constrained)}
        fill: dict[str, list[float]] = {name: [] for name in constrained}
        wait: dict[str, list[float]] = {name: [] for name in constrained}
        tokens: dict[str, int] = {}
        for _ in range(repeats):
            seconds, tokens["plain"] = _timed(llm, prompts, plain)
            times["plain"].append(seconds / tokens["plain"])
            for name, params in constrained.items():
                fill0, wait0, steps0 = so.fill_seconds, so.wait_seconds, llm.engine.num_steps
                seconds, tokens[name] = _timed(llm, prompts, params)
                steps = max(1, llm.engine.num_steps - steps0)
                times[name].append(seconds / tokens[name])
                fill[name].append((so.fill_seconds - fill0) / steps)
                wait[name].append((so.wait_seconds - wait0) / steps)
        plain_per = statistics.median(times["plain"])
        for name in constrained:
            per = statistics.median(times[name])
            rows.append(
                Row(
                    batch,
                    name,
                    round(plain_per * 1e3, 3),
                    round(per * 1e3, 3),
                    round((per - plain_per) * 1e6, 1),
                    round(per / plain_per - 1, 3),
                    round(statistics.median(fill[name]) * 1e3, 3),
                    round(statistics.median(wait[name]) * 1e3, 3),
                    tokens[name],
                )
            )
            print(rows[-1], flush=True)
    return rows


def _timed(llm, prompts, params) -> tuple[float, int]:
    start = time.perf_counter()
    outputs = llm.generate(prompts, params)
    return time.perf_counter() - start, sum(len(o.token_ids) for o in outputs)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="checkpoint (default: the shipped one)")
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 64])
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--threads", type=int)
    parser.add_argument("--repeats", type=int, default=5, help="interleaved runs, median kept")
    parser.add_argument("--json", help="write the rows here")
    args = parser.parse_args(argv)
    rows = run(
        str(args.model or default_model()), args.batch, args.max_tokens, args.threads, args.repeats
    )
    print("\n| batch | constraint | plain ms/token | constrained ms/token | overhead µs/token "
          "| overhead | mask fill ms/step | engine waited ms/step |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r.batch} | {r.constraint} | {r.plain_ms_per_token} | "
            f"{r.constrained_ms_per_token} | {r.overhead_us_per_token} | "
            f"{r.overhead_share:+.1%} | {r.fill_ms_per_step} | {r.wait_ms_per_step} |"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump([asdict(r) for r in rows], f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
