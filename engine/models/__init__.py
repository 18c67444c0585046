"""The model registry: the one table of the architectures the engine runs, keyed by the HF
`architectures` name in config.json.

Values are "module:Class" strings, imported on first use: `engine.config` validates a
checkpoint's architecture against this table without importing torch or model code (the
HTTP tier imports the config).
"""
from __future__ import annotations

import importlib

MODEL_REGISTRY: dict[str, str] = {
    "LlamaForCausalLM": "engine.models.llama:LlamaForCausalLM",
    "MistralForCausalLM": "engine.models.llama:LlamaForCausalLM",  # same graph, with its sliding window (layer_types)
    "Qwen2ForCausalLM": "engine.models.llama:LlamaForCausalLM",    # q/k/v bias and tied embeddings come from ModelConfig
    "Qwen3ForCausalLM": "engine.models.qwen3:Qwen3ForCausalLM",
    "MixtralForCausalLM": "engine.models.mixtral:MixtralForCausalLM",
    "Qwen2MoeForCausalLM": "engine.models.qwen2_moe:Qwen2MoeForCausalLM",
    "Qwen3MoeForCausalLM": "engine.models.qwen3_moe:Qwen3MoeForCausalLM",
    "GptOssForCausalLM": "engine.models.gpt_oss:GptOssForCausalLM",  # sinks, biased MoE, clamped SwiGLU, MXFP4
    "Phi3ForCausalLM": "engine.models.phi3:Phi3ForCausalLM",        # fused qkv / gate_up tensors, LongRoPE
    "Gemma2ForCausalLM": "engine.models.gemma2:Gemma2ForCausalLM",  # soft-caps, (1 + w) norms, alternating windows
    "Gemma3ForCausalLM": "engine.models.gemma3:Gemma3ForCausalLM",  # text only: Gemma 2 + q/k norm, local RoPE
}
SUPPORTED_ARCHITECTURES = tuple(MODEL_REGISTRY)


def check_architecture(architecture: str) -> None:
    """ValueError naming the architecture and the supported ones, unless it is in the registry."""
    if architecture not in MODEL_REGISTRY:
        raise ValueError(f"architecture {architecture!r} is not supported; "
                         f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}")


def get_model_class(architecture: str):
    """The nn.Module class that runs `architecture` (imports its module)."""
    check_architecture(architecture)
    module, _, name = MODEL_REGISTRY[architecture].partition(":")
    return getattr(importlib.import_module(module), name)


__all__ = ["MODEL_REGISTRY", "SUPPORTED_ARCHITECTURES", "check_architecture", "get_model_class"]
