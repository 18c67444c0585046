"""Model registry keyed by the HF `architectures` name in config.json."""
from __future__ import annotations

from torch import nn

from engine.models.llama import LlamaForCausalLM
from engine.models.qwen3 import Qwen3ForCausalLM

_MODEL_REGISTRY: dict[str, type[nn.Module]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,  # same graph; sliding window is refused by ModelConfig
    "Qwen2ForCausalLM": LlamaForCausalLM,    # q/k/v bias and tied embeddings come from ModelConfig
    "Qwen3ForCausalLM": Qwen3ForCausalLM,
}


def get_model_class(architecture: str) -> type[nn.Module]:
    try:
        return _MODEL_REGISTRY[architecture]
    except KeyError:
        raise ValueError(f"architecture {architecture!r} is not supported; "
                         f"supported: {', '.join(sorted(_MODEL_REGISTRY))}") from None


__all__ = ["LlamaForCausalLM", "Qwen3ForCausalLM", "get_model_class"]
