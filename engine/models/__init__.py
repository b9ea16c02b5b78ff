"""Model definitions, one file per architecture family, and the architecture registry."""

from __future__ import annotations

from torch import nn

from tandem.common.model_config import Architecture, ModelConfig


def model_class(config: ModelConfig) -> type[nn.Module]:
    from tandem.engine.models.deepseek import DeepseekV2ForCausalLM, DeepseekV3ForCausalLM
    from tandem.engine.models.gemma import Gemma2ForCausalLM, Gemma3ForCausalLM
    from tandem.engine.models.llama import LlamaForCausalLM
    from tandem.engine.models.mistral import MistralForCausalLM
    from tandem.engine.models.mixtral import MixtralForCausalLM
    from tandem.engine.models.phi3 import Phi3ForCausalLM
    from tandem.engine.models.qwen2 import Qwen2ForCausalLM
    from tandem.engine.models.qwen3 import Qwen3ForCausalLM
    from tandem.engine.models.qwen3_moe import Qwen3MoeForCausalLM

    return {
        Architecture.LLAMA: LlamaForCausalLM,
        Architecture.QWEN2: Qwen2ForCausalLM,
        Architecture.MISTRAL: MistralForCausalLM,
        Architecture.QWEN3: Qwen3ForCausalLM,
        Architecture.PHI3: Phi3ForCausalLM,
        Architecture.GEMMA2: Gemma2ForCausalLM,
        Architecture.GEMMA3: Gemma3ForCausalLM,
        Architecture.MIXTRAL: MixtralForCausalLM,
        Architecture.QWEN3_MOE: Qwen3MoeForCausalLM,
        Architecture.DEEPSEEK_V2: DeepseekV2ForCausalLM,
        Architecture.DEEPSEEK_V3: DeepseekV3ForCausalLM,
    }[config.architecture]
