"""Qwen2-MoE (Qwen1.5-MoE, Qwen2-57B-A14B): sparse blocks every `decoder_sparse_step`
layers (dense MLPs in `mlp_only_layers`), each with a shared expert that every token
goes through, scaled by sigmoid(shared_expert_gate(x)); q/k/v carry a bias (`qkv_bias`)."""
from __future__ import annotations

import dataclasses

import torch

from engine.config import ModelConfig
from engine.layers.fused_moe import ReplicatedLinear
from engine.models.llama import LlamaMLP
from engine.models.moe import (MoEConfig, MoeForCausalLM, SparseMoeBlock, hf_value, qwen_moe_config,
                               refuse_unsupported_routing)


class Qwen2MoeSparseMoeBlock(SparseMoeBlock):
    """The routed experts plus the gated shared expert (a dense Llama MLP of its own width,
    sharded and all-reduced as any dense MLP)."""

    def __init__(self, config: ModelConfig, moe: MoEConfig):
        super().__init__(config, moe)
        shared = dataclasses.replace(config, intermediate_size=moe.shared_expert_intermediate_size)
        self.shared_expert = LlamaMLP(shared)
        self.shared_expert_gate = ReplicatedLinear(config.hidden_size, 1)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        routed = super().forward(hidden_states)
        return routed + torch.sigmoid(self.shared_expert_gate(hidden_states)) * self.shared_expert(hidden_states)


class Qwen2MoeForCausalLM(MoeForCausalLM):
    moe_block = Qwen2MoeSparseMoeBlock

    def __init__(self, config: ModelConfig):
        # HF's Qwen2-MoE attention has q/k/v bias unless config.json says qkv_bias=false.
        super().__init__(dataclasses.replace(config, attention_bias=bool(config.hf_config.get("qkv_bias", True))))

    @classmethod
    def read_moe_config(cls, config: ModelConfig) -> MoEConfig:
        hf = config.hf_config
        refuse_unsupported_routing(hf)
        return qwen_moe_config(hf, shared_expert_intermediate_size=hf_value(hf, "shared_expert_intermediate_size"))
