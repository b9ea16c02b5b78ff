"""The offline API, vLLM-style::

from tandem.engine import LLM, SamplingParams
llm = LLM("path/to/checkpoint", dtype="float32")
outputs = llm.generate(["Hello", [1, 2, 3]], SamplingParams(temperature=0, max_tokens=32))
print(outputs[0].text, outputs[0].token_ids, outputs[0].finish_reason)

``generate`` without sampling parameters uses ``get_default_sampling_params()``: the
checkpoint's ``generation_config.json`` sampling values, as vLLM's ``LLM`` does
(``tandem.common.generation_config``); ``LLM(..., generation_config="vllm")`` ignores them.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from tandem.common.generation_config import AUTO, load_sampling_defaults
from tandem.common.lora import LoRARequest
from tandem.common.sampling_params import SamplingParams
from tandem.engine.config import EngineConfig
from tandem.engine.llm_engine import LLMEngine
from tandem.engine.outputs import RequestOutput
from tandem.engine.request import Request

Prompt = str | list[int]


class LLM:
    def __init__(self, model: str, generation_config: str = AUTO, **config: Any) -> None:
        """``generation_config``: where ``get_default_sampling_params`` comes from:
        ``auto`` (the checkpoint's ``generation_config.json``), ``vllm`` (Tandem's own
        defaults) or a directory holding a ``generation_config.json``.
        ``config``: any ``EngineConfig`` field (dtype, block_size, max_num_seqs, ...)."""
        defaults = load_sampling_defaults(generation_config, model)
        self._default_params = defaults.sampling_params()
        self.engine = LLMEngine(EngineConfig(model=str(model), **config))

    def close(self) -> None:
        """Stops the other ranks of a tensor-parallel model (they also end with this
        process); nothing to do otherwise. ``with LLM(...) as llm:`` calls it."""
        self.engine.close()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def get_tokenizer(self):
        return self.engine.tokenizer

    def get_default_sampling_params(self) -> SamplingParams:
        """What ``generate`` uses when given no sampling parameters: ``SamplingParams``'
        defaults, overridden by the model's (see ``__init__``). Frozen: derive others
        with ``dataclasses.replace``."""
        return self._default_params

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        priority: Sequence[int] | None = None,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """Run every prompt to completion; outputs come back in prompt order. Either all
        prompts are accepted or none is (a ``ValueError`` names the first bad one).
        ``sampling_params``: one for all prompts, one per prompt, or ``None``:
        ``get_default_sampling_params()``. ``lora_request``: the adapter every prompt
        runs under, or one per prompt (``None``: the base model); needs
        ``LLM(..., enable_lora=True)``."""
        prompt_list = _as_prompt_list(prompts)
        if sampling_params is None:
            sampling_params = self._default_params
        params = _as_params_list(sampling_params, len(prompt_list))
        priorities = list(priority) if priority is not None else [0] * len(prompt_list)
        adapters = _as_adapter_list(lora_request, len(prompt_list))
        outputs: dict[str, RequestOutput] = {}
        requests: dict[str, Request] = {}
        try:
            for prompt, p, prio, lora in zip(
                prompt_list, params, priorities, adapters, strict=True
            ):
                request = self.engine.add_request(prompt, p, priority=prio, lora_request=lora)
                requests[request.request_id] = request
                outputs[request.request_id] = RequestOutput(
                    request.request_id,
                    prompt if isinstance(prompt, str) else None,
                    list(request.prompt_token_ids),
                    [],
                    "",
                    None,
                    [] if p.logprobs is not None else None,
                )
            self._run(outputs, requests)
        except BaseException:
            for request_id in outputs:
                self.engine.abort_request(request_id)
            raise
        return list(outputs.values())

    def _run(self, outputs: dict[str, RequestOutput], requests: dict[str, Request]) -> None:
        pending = set(outputs)
        while pending:
            for delta in self.engine.step():
                out = outputs.get(delta.request_id)
                if out is None:
                    continue
                out.token_ids.extend(delta.new_token_ids)
                out.text += delta.new_text
                if out.logprobs is not None:
                    out.logprobs.extend(delta.new_logprobs)
                if delta.finished:
                    out.finish_reason = delta.finish_reason
                    out.num_cached_tokens = requests[delta.request_id].num_cached_tokens
                    pending.discard(delta.request_id)


def _as_prompt_list(prompts: Prompt | Sequence[Prompt]) -> list[Prompt]:
    if isinstance(prompts, str):
        return [prompts]
    items = list(prompts)
    if items and all(isinstance(t, int) for t in items):
        return [items]  # a single prompt given as token ids
    return [p if isinstance(p, str) else list(p) for p in items]


def _as_adapter_list(
    lora: LoRARequest | Sequence[LoRARequest | None] | None, n: int
) -> list[LoRARequest | None]:
    if lora is None or isinstance(lora, LoRARequest):
        return [lora] * n
    items = list(lora)
    if len(items) != n:
        raise ValueError(f"got {len(items)} lora_request entries for {n} prompts")
    return items


def _as_params_list(
    params: SamplingParams | Sequence[SamplingParams], n: int
) -> list[SamplingParams]:
    if isinstance(params, SamplingParams):
        return [params] * n
    items = list(params)
    if len(items) != n:
        raise ValueError(f"got {len(items)} sampling_params for {n} prompts")
    return items
