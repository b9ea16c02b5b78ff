"""The ``tandem`` system: Tandem's offline engine (``engine.LLM``), vLLM-style API.

Run by ``throughput.py`` as ``python -m tandem.bench._tandem_runner JOB.json RESULT.json`` from the
repository root, so ``engine`` imports from the working tree.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

import torch

from tandem.bench._runner import RunnerJob, run
from tandem.bench.workloads import Request


class TandemOffline:
    """``engine.LLM`` over a float32 checkpoint, fed token-id prompts."""

    def __init__(self, job: RunnerJob) -> None:
        from tandem.engine import LLM

        torch.set_num_threads(job.threads)
        self.llm = LLM(job.model_dir, dtype="float32", **job.limits.as_kwargs())

    def generate(self, requests: Sequence[Request]) -> list[list[int]]:
        from tandem.engine import SamplingParams

        prompts = [list(r.prompt_token_ids) for r in requests]
        params = [
            SamplingParams(temperature=0.0, max_tokens=r.max_tokens, ignore_eos=True)
            for r in requests
        ]
        return [list(o.token_ids) for o in self.llm.generate(prompts, params)]

    def kv_waste(self) -> float | None:
        """Paged waste at the engine's peak: slots allocated in used blocks but holding no token."""
        usage = self.llm.engine.peak_kv_usage
        slots = usage.used_blocks * usage.block_size
        return 1 - usage.stored_tokens / slots if slots else None

    def settings(self) -> dict[str, str]:
        usage = self.llm.engine.peak_kv_usage
        return {
            "torch": torch.__version__,
            "torch_threads": str(torch.get_num_threads()),
            "block_size": str(usage.block_size),
            "kv_bytes_per_token": str(usage.bytes_per_token),
            "peak_used_blocks": str(usage.used_blocks),
            "peak_stored_tokens": str(usage.stored_tokens),
        }


def _load(job: RunnerJob) -> TandemOffline:
    return TandemOffline(job)


if __name__ == "__main__":
    sys.exit(run(_load))
