"""Model definitions, one file per architecture family, and the architecture registry."""

from __future__ import annotations

from torch import nn

from tandem.common.model_config import Architecture, ModelConfig


def model_class(config: ModelConfig) -> type[nn.Module]:
    from tandem.engine.models.llama import LlamaForCausalLM
    from tandem.engine.models.mistral import MistralForCausalLM
    from tandem.engine.models.qwen2 import Qwen2ForCausalLM

    return {
        Architecture.LLAMA: LlamaForCausalLM,
        Architecture.QWEN2: Qwen2ForCausalLM,
        Architecture.MISTRAL: MistralForCausalLM,
    }[config.architecture]
