"""Batch-1 decode step time of int8 and int4 weights against float32, same run.

    python bench/quantization.py [--model DIR] [--isa native,avx2] [--steps 64] [--rounds 5]

For each instruction-set setting the measurement runs in its own subprocess, because
``ATEN_CPU_CAPABILITY`` must be set before torch is imported: ``native`` (the best the
CPU has: AVX-512 where present) and ``avx2`` (``TANDEM_CPU_ISA=avx2`` for Tandem's
kernels, which makes float32 linears use the native AVX2 GEMM, ``ATEN_CPU_CAPABILITY=avx2``
for torch's own and ``ONEDNN_MAX_CPU_ISA=AVX2`` for oneDNN's, as ``throughput.py --isa
avx2`` sets them). In each,
float32, int8 and int4 (group 64) engines are built once, then measured in alternating
rounds (so a burst of load from other processes hits all three alike): a round decodes
``--steps`` tokens of one 32-token prompt and takes the median step time. The figure
reported is the median over rounds; the ratios are to float32 in the same process.
Writes ``bench/results/quantization.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results" / "quantization.json"
SETTINGS = {
    "native": {},
    "avx2": {"TANDEM_CPU_ISA": "avx2", "ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2"},
}
METHODS: dict[str, dict[str, object]] = {
    "float32": {},
    "int8": {"quantization": "int8"},
    "int4": {"quantization": "int4"},
    "int8+lm_head": {"quantization": "int8", "quantize_lm_head": True},
    "int4+lm_head": {"quantization": "int4", "quantize_lm_head": True},
}
"""The output projection stays float unless asked (``quantize_lm_head``); the last two
rows show what quantizing it adds."""


def _decode_step_ms(engine, steps: int) -> float:
    from tandem.engine import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=steps + 1, ignore_eos=True)
    engine.add_request(list(range(100, 132)), params)
    engine.step()  # the prefill
    times = []
    while engine.has_unfinished_requests():
        start = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def measure(model: str, steps: int, rounds: int, threads: int) -> dict[str, object]:
    """Runs in the subprocess: median step time (ms) per method over ``rounds``."""
    import torch

    from tandem.engine.config import EngineConfig
    from tandem.engine.llm_engine import LLMEngine
    from tandem.engine.native_build import select_isa

    engines = {
        name: LLMEngine(
            EngineConfig(
                model, num_kv_blocks=16, max_model_len=256, num_threads=threads, **settings
            ),
            detokenize=False,
        )
        for name, settings in METHODS.items()
    }
    for engine in engines.values():
        _decode_step_ms(engine, 4)  # warm-up
    samples: dict[str, list[float]] = {name: [] for name in engines}
    for _ in range(rounds):
        for name, engine in engines.items():
            samples[name].append(_decode_step_ms(engine, steps))
    step = {name: statistics.median(v) for name, v in samples.items()}
    return {
        "torch_cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "kernel_isa": select_isa().value,
        "threads": threads,
        "step_ms": step,
        "samples_ms": samples,
        "ratio_to_float32": {k: v / step["float32"] for k, v in step.items()},
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="/tmp/tandem-medium", help="medium checkpoint")
    parser.add_argument("--isa", default="native,avx2", help="settings to run")
    parser.add_argument("--steps", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        print(json.dumps(measure(args.model, args.steps, args.rounds, args.threads)))
        return 0
    if not (Path(args.model) / "config.json").exists():
        subprocess.run(["tandem", "make-model", args.model, "--size", "medium"], check=True)
    report: dict[str, object] = {"machine": _machine(), "model": args.model, "runs": {}}
    for name in args.isa.split(","):
        env = {**os.environ, **SETTINGS[name]}
        command = [sys.executable, __file__, "--worker", name, "--model", args.model]
        command += ["--steps", str(args.steps), "--rounds", str(args.rounds)]
        command += ["--threads", str(args.threads)]
        out = subprocess.run(command, env=env, capture_output=True, text=True, check=True)
        result = json.loads(out.stdout.strip().splitlines()[-1])
        report["runs"][name] = result  # type: ignore[index]
        step, ratio = result["step_ms"], result["ratio_to_float32"]
        print(f"{name} (torch {result['torch_cpu_capability']}, kernels {result['kernel_isa']}):")
        for method in METHODS:
            print(f"  {method:13s} {step[method]:7.2f} ms  {ratio[method]:.2f}x")
    RESULTS.parent.mkdir(exist_ok=True)
    RESULTS.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {RESULTS}")
    return 0


def _machine() -> dict[str, str]:
    model = ""
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.exists():
        line = next((ln for ln in cpuinfo.read_text().splitlines() if "model name" in ln), "")
        model = line.partition(":")[2].strip()
    return {"cpu": model, "cores": str(os.cpu_count()), "python": platform.python_version()}


if __name__ == "__main__":
    sys.exit(main())
