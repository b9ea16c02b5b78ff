"""Measure the real engine's step costs for the fleet simulator.

    python bench/sim/calibrate.py --size tiny [--threads 1] [--out bench/sim/calibration_tiny.json]

Runs ``LLMEngine`` in this process on a random ``tandem make-model`` checkpoint (made
in a temporary directory) and times single engine steps: prefill steps of 1-1,000 new
tokens after 0 or 1,024 cached ones, and decode steps of 1-64 sequences at contexts of
128 and 1,024 tokens (median of repeats). A non-negative least-squares fit gives the
coefficients of ``tandem.bench.sim.calibration.Calibration``. The KV pull cost is not
measured here: it uses ``bench/kvtransfer.py``'s figures (``docs/benchmarks/kvtransfer.md``:
about 1 GB/s for pulls of a few MiB, plus a 1.5 ms call).
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from tandem.bench.machine_load import OtherLoad, wait_for_quiet
from tandem.bench.sim.calibration import HERE, Calibration

PULL_CALL_S = 1.5e-3
PULL_BYTES_PER_S = 1.0e9
REPEATS = 5


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", default="tiny")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", type=Path)
    parser.add_argument("--wait-quiet", type=float, default=0.0, metavar="S")
    args = parser.parse_args(argv)
    if args.wait_quiet:
        wait_for_quiet(args.wait_quiet)
    meter = OtherLoad.start()
    from tandem.engine.config import EngineConfig
    from tandem.engine.llm_engine import LLMEngine
    from tandem.tools.checkpoint_maker import make_model

    with tempfile.TemporaryDirectory() as tmp:
        model = make_model(Path(tmp) / args.size, arch="llama", size=args.size)
        config = EngineConfig(
            str(model), dtype="float32", num_kv_blocks=4096, num_threads=args.threads
        )
        engine = LLMEngine(config, detokenize=False)
        prefill = _fit_prefill(engine)
        decode = _fit_decode(engine)
    layout = engine.runner.layout
    calibration = Calibration(
        model=f"llama {args.size}, float32, {args.threads} thread(s), {_machine()}, "
        f"{meter.cores():.1f} other cores busy",
        block_size=engine.runtime.block_size,
        bytes_per_block=layout.bytes_per_block,
        prefill_step_s=prefill[0],
        prefill_token_s=prefill[1],
        prefill_context_token_s=prefill[2],
        decode_step_s=decode[0],
        decode_seq_s=decode[1],
        decode_kv_token_s=decode[2],
        pull_call_s=PULL_CALL_S,
        pull_byte_s=1 / PULL_BYTES_PER_S,
        max_num_batched_tokens=engine.runtime.max_num_batched_tokens,
    )
    out = args.out or HERE / f"calibration_{args.size}.json"
    calibration.save(out)
    print(f"wrote {out}:\n{out.read_text()}")
    print(f"other processes used {meter.cores():.2f} cores meanwhile")
    return 0


def _fit_prefill(engine) -> tuple[float, float, float]:
    """Rows (1, new, new * attended / 1000) -> step seconds, where a new token attends
    to the cached context and, on average, half of the chunk (causal)."""
    from tandem.common.sampling_params import SamplingParams

    rng = np.random.default_rng(0)
    rows, times = [], []
    for context in (0, 1024):
        for new in (1, 8, 32, 128, 256, 512, 1000):
            samples = []
            for _ in range(REPEATS):
                prefix = rng.integers(10, 4000, context).tolist()
                if context:
                    _run(engine, [*prefix, 1], SamplingParams(max_tokens=1, temperature=0))
                prompt = prefix + rng.integers(10, 4000, new).tolist()
                engine.add_request(prompt, SamplingParams(max_tokens=1, temperature=0))
                start = time.perf_counter()
                engine.step()
                samples.append(time.perf_counter() - start)
                _drain(engine)
            rows.append((1.0, new, new * Calibration.attended(new, context) / 1000))
            times.append(statistics.median(samples))
            print(f"prefill new={new:5d} context={context:5d}: {times[-1] * 1e3:7.2f} ms")
    return nonnegative_least_squares(rows, times)


def _fit_decode(engine) -> tuple[float, float, float]:
    """Rows (1, sequences, KV tokens) -> step seconds."""
    from tandem.common.sampling_params import SamplingParams

    rng = np.random.default_rng(1)
    rows, times = [], []
    params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    for context in (128, 1024):
        for batch in (1, 2, 4, 8, 16, 32, 64):
            for _ in range(batch):
                engine.add_request(rng.integers(10, 4000, context).tolist(), params)
            while any(r.num_computed_tokens < r.num_prompt_tokens for r in _running(engine)):
                engine.step()  # prefill everyone first
            samples = []
            for _ in range(2 * REPEATS):
                start = time.perf_counter()
                engine.step()
                samples.append(time.perf_counter() - start)
            _drain(engine)
            rows.append((1.0, batch, batch * (context + 5)))
            times.append(statistics.median(samples))
            print(f"decode batch={batch:3d} context={context:5d}: {times[-1] * 1e3:7.2f} ms")
    return nonnegative_least_squares(rows, times)


def nonnegative_least_squares(rows, times) -> tuple[float, ...]:
    """The least-squares coefficients under the constraint that none is negative (a
    step cannot cost less than nothing): exact, by trying every subset of the columns
    (there are three) and keeping the best fit whose coefficients are all >= 0."""
    a, b = np.array(rows, dtype=float), np.array(times, dtype=float)
    best, best_residual = np.zeros(a.shape[1]), float(np.sum(b**2))
    for size in range(1, a.shape[1] + 1):
        for columns in itertools.combinations(range(a.shape[1]), size):
            coef, *_ = np.linalg.lstsq(a[:, columns], b, rcond=None)
            if (coef < 0).any():
                continue
            residual = float(np.sum((a[:, columns] @ coef - b) ** 2))
            if residual < best_residual:
                best, best_residual = np.zeros(a.shape[1]), residual
                best[list(columns)] = coef
    return tuple(float(c) for c in best)


def _running(engine):
    return list(engine.scheduler.running) + list(engine.scheduler.waiting)


def _run(engine, prompt, params) -> None:
    engine.add_request(prompt, params)
    _drain(engine)


def _drain(engine) -> None:
    while engine.has_unfinished_requests():
        engine.step()


def _machine() -> str:
    import os

    return f"{os.cpu_count()} vCPUs"


if __name__ == "__main__":
    sys.exit(main())
