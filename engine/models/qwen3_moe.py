"""Qwen3-MoE (Qwen3-30B-A3B, Qwen3-235B-A22B): Qwen3's attention (RMSNorm on each q and k
head) with sparse blocks every `decoder_sparse_step` layers (dense MLPs in
`mlp_only_layers`), top-k weights renormalised when `norm_topk_prob`; no shared expert."""
from __future__ import annotations

import dataclasses

from engine.config import ModelConfig
from engine.models.moe import MoEConfig, MoeForCausalLM, qwen_moe_config, refuse_unsupported_routing


class Qwen3MoeForCausalLM(MoeForCausalLM):
    def __init__(self, config: ModelConfig):
        super().__init__(dataclasses.replace(config, qk_norm=True))

    @classmethod
    def read_moe_config(cls, config: ModelConfig) -> MoEConfig:
        hf = config.hf_config
        refuse_unsupported_routing(hf, "shared_expert_intermediate_size")  # Qwen3-Next's, not run here
        return qwen_moe_config(hf)
