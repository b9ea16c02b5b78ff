"""Wall time from ``tandem serve`` to the first answer, on Ray and as local processes.

    python -m tandem.bench.ray_startup [--repeats 3] [--tensor-parallel-size 1 2]

Runs ``tandem serve --demo`` as a user would (a fresh process each time: the local
launcher, then ``--ray`` at each TP size, which starts its own local Ray) and times, from
the command's start: the cluster serving (the ``>>>`` line the demo prints once the router
answers health), the first token of the answer on stdout, the answer complete, and the
process gone (everything stopped, Ray included). Prints a table of medians and, last, one
JSON object with every run.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass

from tandem.cli.serve import DEMO_PROMPT


@dataclass(frozen=True)
class Run:
    mode: str
    serving_s: float
    first_token_s: float
    answered_s: float
    exited_s: float


def time_demo(extra: Sequence[str], mode: str, timeout_s: float = 300.0) -> Run:
    """One ``tandem serve --demo`` with ``extra`` flags, timed from its start."""
    command = [sys.executable, "-m", "tandem.cli", "serve", "--demo", *extra]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    start = time.monotonic()
    process = subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, env=env, text=False
    )
    marks: dict[str, float] = {}
    seen = b""
    prompt_line = f">>> {DEMO_PROMPT}\n".encode()
    while (byte := process.stdout.read(1)) != b"":
        seen += byte
        now = time.monotonic() - start
        if "serving" not in marks and seen.endswith(prompt_line):
            marks["serving"], seen = now, b""
        elif "serving" in marks and "first" not in marks and not byte.isspace():
            marks["first"] = now
        elif "first" in marks and seen.endswith(b"generated"):
            marks["answered"] = now
        if now > timeout_s:
            process.kill()
            raise TimeoutError(f"{mode}: no answer in {timeout_s:.0f} s")
    if process.wait() != 0 or len(marks) < 3:
        raise RuntimeError(f"{mode}: exit {process.returncode}, saw {sorted(marks)}")
    exited = time.monotonic() - start
    return Run(mode, marks["serving"], marks["first"], marks["answered"], exited)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--tensor-parallel-size", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--ray-num-cpus", type=int, default=4)
    args = parser.parse_args(argv)
    modes = {"local processes": []}
    for tp in args.tensor_parallel_size:
        flags = ["--ray", "--ray-num-cpus", str(args.ray_num_cpus)]
        modes[f"ray, TP={tp}"] = [*flags, "--tensor-parallel-size", str(tp)]
    runs = [time_demo(extra, mode) for _ in range(args.repeats) for mode, extra in modes.items()]
    print(f"{'mode':<18} {'serving s':>10} {'1st token s':>12} {'answered s':>11} {'exited s':>9}")
    for mode in modes:
        mine = [r for r in runs if r.mode == mode]
        row = [statistics.median(getattr(r, f) for r in mine) for f in list(asdict(mine[0]))[1:]]
        print(
            f"{mode:<18} "
            + " ".join(f"{v:>{w}.1f}" for v, w in zip(row, (10, 12, 11, 9), strict=True))
        )
    print(f"(medians of {args.repeats}; the built-in model, 1 prefill + 1 decode replica)")
    print(json.dumps({"runs": [asdict(r) for r in runs]}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
