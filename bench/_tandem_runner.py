"""The ``tandem`` systems: Tandem's offline engine (``engine.LLM``), vLLM-style API, over a
float32 checkpoint whose weights and KV cache are stored as the job's ``Storage`` says
(``tandem``: float32; ``tandem-int8-kv8`` and the other variants: quantized at load).

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
        self.job = job
        self.llm = LLM(
            job.model_dir,
            dtype="float32",
            kv_cache_memory_gb=job.kv_cache_memory_gb,
            **job.storage.engine_kwargs(),
            **job.limits.as_kwargs(),
        )

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
        from tandem.engine.native_build import select_isa

        engine, storage = self.llm.engine, self.job.storage
        usage = engine.peak_kv_usage
        return {
            "torch": torch.__version__,
            "torch_threads": str(torch.get_num_threads()),
            "cpu_capability": torch.backends.cpu.get_cpu_capability(),
            "tandem_isa": select_isa().value,
            "quantization": storage.weights or "none",
            "quantization_group_size": (
                str(engine.config.quantization_group_size) if storage.weights == "int4" else "-"
            ),
            "kv_cache_dtype": storage.kv_cache_dtype,
            "block_size": str(usage.block_size),
            "kv_bytes_per_token": str(usage.bytes_per_token),
            "num_kv_blocks": str(engine.num_kv_blocks),
            "kv_budget_blocks": str(self._budget_blocks()),
            "max_model_len": str(engine.runtime.max_model_len),
            "peak_used_blocks": str(usage.used_blocks),
            "peak_stored_tokens": str(usage.stored_tokens),
        }

    def _budget_blocks(self) -> int:
        """Blocks ``kv_cache_memory_gb`` holds: the engine's pool when the budget is
        given; without one, the pool (a default budget, capped at what ``max_num_seqs``
        full-length sequences need)."""
        if self.job.kv_cache_memory_gb is None:
            return self.llm.engine.num_kv_blocks
        budget = self.job.kv_cache_memory_gb * 2**30
        return int(budget // self.llm.engine.runner.layout.bytes_per_block)


def _load(job: RunnerJob) -> TandemOffline:
    return TandemOffline(job)


if __name__ == "__main__":
    sys.exit(run(_load))
