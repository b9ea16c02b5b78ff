"""Tandem's model runtime: paged KV cache, continuous batching, chunked prefill, prefix
caching, sampling, and the offline ``LLM`` API.

``from tandem.engine import LLM, SamplingParams`` loads torch lazily, so torch-free modules
(``tandem.engine.scheduler``, ``tandem.engine.block_pool``, ...) stay importable without it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from tandem.common.sampling_params import SamplingParams

if TYPE_CHECKING:
    from tandem.engine.config import EngineConfig
    from tandem.engine.llm import LLM
    from tandem.engine.llm_engine import LLMEngine
    from tandem.engine.outputs import RequestDelta, RequestOutput

__all__ = ["LLM", "EngineConfig", "LLMEngine", "RequestDelta", "RequestOutput", "SamplingParams"]

_LAZY = {
    "LLM": "tandem.engine.llm",
    "LLMEngine": "tandem.engine.llm_engine",
    "EngineConfig": "tandem.engine.config",
    "RequestOutput": "tandem.engine.outputs",
    "RequestDelta": "tandem.engine.outputs",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'engine' has no attribute {name!r}")
