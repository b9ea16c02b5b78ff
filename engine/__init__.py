"""Tandem's model runtime: paged KV cache, continuous batching, chunked prefill, prefix
caching, sampling, and the offline ``LLM`` API.

``from engine import LLM, SamplingParams`` loads torch lazily, so torch-free modules
(``engine.scheduler``, ``engine.block_pool``, ...) stay importable without it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from tandem.sampling_params import SamplingParams

if TYPE_CHECKING:
    from engine.config import EngineConfig
    from engine.llm import LLM
    from engine.llm_engine import LLMEngine
    from engine.outputs import RequestDelta, RequestOutput

__all__ = ["LLM", "EngineConfig", "LLMEngine", "RequestDelta", "RequestOutput", "SamplingParams"]

_LAZY = {
    "LLM": "engine.llm",
    "LLMEngine": "engine.llm_engine",
    "EngineConfig": "engine.config",
    "RequestOutput": "engine.outputs",
    "RequestDelta": "engine.outputs",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'engine' has no attribute {name!r}")
