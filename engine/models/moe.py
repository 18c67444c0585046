"""What the mixture-of-experts models share: their MoE settings, the sparse block, and a
Llama-graph base class whose sparse layers swap the dense MLP for that block.

Mixtral, Qwen2-MoE and Qwen3-MoE are the Llama decoder with some (or all) MLPs replaced
by `SparseMoeBlock`: a router (`gate`, [E, H]) and the experts (`FusedMoE`). Each
model class reads its own config.json keys into a `MoEConfig` (from `ModelConfig.hf_config`)
and refuses the routing features it would otherwise ignore, before any weight exists.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from engine.config import ModelConfig
from engine.layers.fused_moe import FusedMoE, ReplicatedLinear
from engine.models.llama import LlamaForCausalLM

# Routing variants of other MoE families (DeepSeek, GLM, ...): key -> the values that mean
# "plain softmax top-k", which is all these models run. Any other value is refused by name.
_PLAIN_ROUTING = {
    "scoring_func": (None, "softmax"),
    "topk_method": (None, "greedy"),
    "n_group": (None, 0, 1),
    "topk_group": (None, 0, 1),
    "routed_scaling_factor": (None, 1, 1.0),
    "n_shared_experts": (None, 0),
}


@dataclass(frozen=True)
class MoEConfig:
    """One model's MoE settings, as plain values."""

    num_experts: int
    top_k: int                      # experts per token
    intermediate_size: int          # each expert's MLP width
    renormalize: bool               # top-k weights rescaled to sum to 1
    shared_expert_intermediate_size: int = 0  # Qwen2-MoE's always-on expert; 0: none
    decoder_sparse_step: int = 1    # layer i is sparse when (i + 1) % step == 0 ...
    mlp_only_layers: tuple[int, ...] = ()     # ... and i is not listed here

    def __post_init__(self) -> None:
        for name in ("num_experts", "top_k", "intermediate_size", "decoder_sparse_step"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"MoE {name}={value!r} is invalid: must be an int >= 1")
        if self.top_k > self.num_experts:
            raise ValueError(f"num_experts_per_tok={self.top_k} exceeds the {self.num_experts} experts")
        if self.shared_expert_intermediate_size < 0:
            raise ValueError(f"shared_expert_intermediate_size={self.shared_expert_intermediate_size} is invalid")

    def is_sparse(self, layer_idx: int) -> bool:
        """Whether layer `layer_idx` has the MoE block (else a dense MLP), as HF decides it."""
        return layer_idx not in self.mlp_only_layers and (layer_idx + 1) % self.decoder_sparse_step == 0


def hf_value(hf: dict[str, Any], *keys: str) -> Any:
    """The first of `keys` set in config.json (hub and transformers 5 spell some differently);
    ValueError naming them when none is."""
    for key in keys:
        if hf.get(key) is not None:
            return hf[key]
    raise ValueError(f"config.json lacks {' / '.join(keys)}, which a {hf.get('architectures')} MoE model needs")


def qwen_moe_config(hf: dict[str, Any], shared_expert_intermediate_size: int = 0) -> MoEConfig:
    """Qwen2-MoE / Qwen3-MoE keys (hub configs say num_experts, transformers 5 num_local_experts)."""
    return MoEConfig(num_experts=hf_value(hf, "num_experts", "num_local_experts"),
                     top_k=hf_value(hf, "num_experts_per_tok"),
                     intermediate_size=hf_value(hf, "moe_intermediate_size"),
                     renormalize=bool(hf.get("norm_topk_prob", False)),
                     shared_expert_intermediate_size=shared_expert_intermediate_size,
                     decoder_sparse_step=hf.get("decoder_sparse_step", 1),
                     mlp_only_layers=tuple(hf.get("mlp_only_layers") or ()))


def refuse_unsupported_routing(hf: dict[str, Any], *extra_keys: str) -> None:
    """ValueError naming the first routing feature these models do not run; `extra_keys` are
    refused when set at all (e.g. a shared expert on a model without one)."""
    for key, plain in _PLAIN_ROUTING.items():
        if hf.get(key) not in plain:
            raise ValueError(f"{key}={hf[key]!r} is not supported (MoE routing here is softmax top-k)")
    for key in extra_keys:
        if hf.get(key):
            raise ValueError(f"{key}={hf[key]!r} is not supported for {hf.get('architectures')}")


class SparseMoeBlock(nn.Module):
    """[T, H] -> [T, H]: router logits, then each token through its top-k experts. The
    experts all-reduce their partial sums over the TP ranks (FusedMoE.forward)."""

    def __init__(self, config: ModelConfig, moe: MoEConfig):
        super().__init__()
        self.gate = ReplicatedLinear(config.hidden_size, moe.num_experts)  # the router
        self.experts = FusedMoE(moe.num_experts, moe.top_k, config.hidden_size, moe.intermediate_size,
                                moe.renormalize)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.experts(hidden_states, self.gate(hidden_states))


class MoeForCausalLM(LlamaForCausalLM):
    """The Llama graph with `SparseMoeBlock`s where `MoEConfig.is_sparse` says so.

    Subclasses define `read_moe_config(config) -> MoEConfig` and may set `moe_block`."""

    # Checkpoint projection of one expert -> (our stacked FusedMoE parameter, part): the loader
    # maps `...experts.{e}.gate_proj.weight` to `...experts.gate_up_proj`, shard id (e, 0).
    expert_params_mapping = {"gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1),
                             "down_proj": ("down_proj", None)}
    moe_block = SparseMoeBlock

    def __init__(self, config: ModelConfig):
        # Read (and refused) before any weight is allocated; make_mlp reads it during super().__init__.
        self.moe = self.read_moe_config(config)
        super().__init__(config)

    @classmethod
    def read_moe_config(cls, config: ModelConfig) -> MoEConfig:
        raise NotImplementedError

    def make_mlp(self, layer_idx: int) -> nn.Module | None:
        if not self.moe.is_sparse(layer_idx):
            return None  # a dense LlamaMLP of config.intermediate_size
        return self.moe_block(self.config, self.moe)
