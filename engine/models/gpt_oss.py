"""gpt-oss (openai/gpt-oss-20b, -120b): the Llama graph with

- attention: q/k/v and o biases, a learned sink logit per head (`Attention(sinks=True)`),
  sliding (window 128 on the real models) and full layers alternating, yarn RoPE;
- every MLP a mixture of experts: a router with a bias whose top-k logits are softmaxed
  (HF's GptOssTopKRouter), experts with biases and a clamped SwiGLU
  (`ClampedSwiGLU(swiglu_alpha, swiglu_limit)`).

Checkpoint layout (transformers' GptOssForCausalLM), per layer:

    mlp.router.weight [E, H], .bias [E]
    mlp.experts.gate_up_proj [E, H, 2I]  x @ W, gate and up columns interleaved (g0 u0 g1 u1 ...)
    mlp.experts.gate_up_proj_bias [E, 2I]  interleaved as well
    mlp.experts.down_proj [E, I, H], down_proj_bias [E, H]
    self_attn.{q,k,v,o}_proj.{weight,bias}, self_attn.sinks [num_heads]

`checkpoint_tensors` turns the experts into FusedMoE's [E, out, in] (a transposed view; FusedMoE
splits the interleaved rows as it loads, `gate_up_interleaved`). The hub's MXFP4 checkpoints
(quantization_config {"quant_method": "mxfp4"}) store the experts as `*_blocks` / `*_scales`,
already [E, out, in / 32, 16]: they are dequantized to the model dtype as they load
(engine/loader/mxfp4.py).
"""
from __future__ import annotations

import torch
from torch import nn

from engine.config import ModelConfig
from engine.layers.attention import Attention
from engine.layers.fused_moe import FusedMoE, ReplicatedLinear
from engine.layers.linear import RowParallelLinear
from engine.layers.rotary import RotaryEmbedding
from engine.loader.mxfp4 import dequantized_stream
from engine.models.llama import LlamaAttention, LlamaForCausalLM
from engine.models.moe import MoEConfig, MoeForCausalLM, hf_value, refuse_unsupported_routing
from kernels.torch_fused_moe import ClampedSwiGLU

_EXPERT_WEIGHTS = (".experts.gate_up_proj", ".experts.down_proj")


class GptOssAttention(LlamaAttention):
    """LlamaAttention (fused biased qkv, RoPE, paged attention) with o_proj's bias and the sinks."""

    def __init__(self, config: ModelConfig, rotary_emb: RotaryEmbedding, sliding_window: int | None):
        super().__init__(config, rotary_emb, sliding_window)
        # Replaced before any weight is loaded (one layer's unbiased o_proj, freed at once).
        self.o_proj = RowParallelLinear(config.num_attention_heads * self.head_dim, config.hidden_size, bias=True)
        self.attn = Attention(self.num_heads, self.head_dim, self.head_dim ** -0.5, self.num_kv_heads,
                              sliding_window=sliding_window, sinks=True)


class GptOssMoeBlock(nn.Module):
    """[T, H] -> [T, H]: the biased router's top-k logits, softmaxed, weigh each token's experts."""

    def __init__(self, config: ModelConfig, moe: MoEConfig):
        super().__init__()
        hf = config.hf_config
        self.router = ReplicatedLinear(config.hidden_size, moe.num_experts, bias=True)
        self.experts = FusedMoE(moe.num_experts, moe.top_k, config.hidden_size, moe.intermediate_size,
                                renormalize=True, softmax_first=False, has_bias=True,
                                activation=ClampedSwiGLU(float(hf.get("swiglu_alpha", 1.702)),
                                                         float(hf.get("swiglu_limit", 7.0))),
                                gate_up_interleaved=True)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.experts(hidden_states, self.router(hidden_states))


class GptOssForCausalLM(MoeForCausalLM):
    packed_modules_mapping = {k: LlamaForCausalLM.packed_modules_mapping[k] for k in ("q_proj", "k_proj", "v_proj")}
    expert_params_mapping = {}  # the experts come stacked, one tensor per layer and kind
    moe_block = GptOssMoeBlock

    @classmethod
    def read_moe_config(cls, config: ModelConfig) -> MoEConfig:
        hf = config.hf_config
        refuse_unsupported_routing(hf)
        return MoEConfig(num_experts=hf_value(hf, "num_local_experts", "num_experts"),
                         top_k=hf_value(hf, "num_experts_per_tok", "experts_per_token"),
                         intermediate_size=config.intermediate_size, renormalize=True)

    def make_attention(self, layer_idx: int, rotary_emb: RotaryEmbedding) -> nn.Module:
        return GptOssAttention(self.config, rotary_emb, self.config.layer_sliding_window(layer_idx))

    def checkpoint_tensors(self, tensors):
        """The checkpoint stream (file name, name, tensor thunk) as our parameters take it: MXFP4
        pairs dequantized (already [E, out, in]), unpacked experts transposed to it, sinks renamed
        to the attention layer's."""
        for file_name, name, tensor in dequantized_stream(tensors, self.lm_head.weight.dtype):
            if name.endswith(".self_attn.sinks"):
                name = name[: -len("sinks")] + "attn.sinks"
            elif name.endswith(_EXPERT_WEIGHTS) and file_name == name:  # not from MXFP4 blocks
                tensor = (lambda t: lambda: t().transpose(1, 2))(tensor)  # [E, in, out] -> [E, out, in]
            yield file_name, name, tensor
