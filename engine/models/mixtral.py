"""Mixtral: the Llama graph with every MLP a sparse block of `num_local_experts` experts,
top-`num_experts_per_tok` routing renormalised. Checkpoints name the block
`block_sparse_moe` and each expert's projections w1 (gate), w3 (up), w2 (down)."""
from __future__ import annotations

from engine.config import ModelConfig
from engine.models.llama import LlamaForCausalLM
from engine.models.moe import MoEConfig, MoeForCausalLM, hf_value, refuse_unsupported_routing


class MixtralForCausalLM(MoeForCausalLM):
    # block_sparse_moe -> mlp only renames (shard id None): our layers call it `mlp`, as
    # transformers 5 does (its fused checkpoints name `mlp.experts.gate_up_proj`).
    packed_modules_mapping = {**LlamaForCausalLM.packed_modules_mapping, "block_sparse_moe": ("mlp", None)}
    expert_params_mapping = {"w1": ("gate_up_proj", 0), "w3": ("gate_up_proj", 1), "w2": ("down_proj", None)}

    @classmethod
    def read_moe_config(cls, config: ModelConfig) -> MoEConfig:
        hf = config.hf_config
        refuse_unsupported_routing(hf, "shared_expert_intermediate_size")
        window = hf.get("sliding_window")
        if window is not None and window < config.max_position_embeddings and config.sliding_window is None:
            raise ValueError(f"sliding_window={window} is not supported for MixtralForCausalLM")
        return MoEConfig(num_experts=hf_value(hf, "num_local_experts", "num_experts"),
                         top_k=hf_value(hf, "num_experts_per_tok"),
                         intermediate_size=config.intermediate_size,  # Mixtral's experts are its MLPs
                         renormalize=True)
