"""A worker's engine, built with progress lines on stdout: what is being loaded, then
how long it took and what the KV cache holds. They are printed (not logged), so that a
quiet ``tandem serve`` still shows start-up progress beside each ``READY`` line."""

from __future__ import annotations

import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from tandem.common.worker_host import WorkerOptions
    from tandem.engine.llm_engine import LLMEngine

GIB = 2**30


def load_engine(options: WorkerOptions, **engine_kwargs: Any) -> LLMEngine:
    """``LLMEngine`` for ``options`` (``engine_kwargs``: its callbacks), announced."""
    from tandem.engine.config import EngineConfig
    from tandem.engine.llm_engine import LLMEngine

    weights = sum(p.stat().st_size for p in Path(options.model_dir).glob("*.safetensors"))
    print(f"LOADING {options.model_dir} ({weights / GIB:.2f} GiB of weights on disk)", flush=True)
    start = time.monotonic()
    engine = LLMEngine(EngineConfig(model=options.model_dir, **options.engine), **engine_kwargs)
    kv_bytes = engine.runner.layout.bytes_per_block * engine.num_kv_blocks
    runtime = engine.runtime
    print(
        f"LOADED in {time.monotonic() - start:.1f} s: {str(runtime.dtype).removeprefix('torch.')} "
        f"on {runtime.device.type}, KV cache {engine.num_kv_blocks} blocks of "
        f"{runtime.block_size} tokens ({kv_bytes / GIB:.2f} GiB), max_model_len "
        f"{runtime.max_model_len}, {engine.config.max_num_seqs} sequences at once",
        flush=True,
    )
    for lora in options.lora_modules:
        engine.add_lora(lora)  # a bad adapter stops the start with its ValueError
        print(f"LORA {lora.lora_name} from {lora.lora_path}", flush=True)
    return engine
