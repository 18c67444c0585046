"""Qwen3: the Llama graph plus RMSNorm over each q and k head before rotary, with an
explicit head_dim (often != hidden_size / num_heads). Both are ModelConfig fields
(`qk_norm`, `head_dim`), so the Llama code path runs it; this class pins the flag."""
from __future__ import annotations

from engine.config import ModelConfig
from engine.models.llama import LlamaForCausalLM


class Qwen3ForCausalLM(LlamaForCausalLM):
    def __init__(self, config: ModelConfig):
        if not config.qk_norm:
            raise ValueError("Qwen3ForCausalLM needs config.qk_norm=True (q_norm / k_norm weights)")
        super().__init__(config)
