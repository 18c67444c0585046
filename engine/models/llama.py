"""Llama family: Llama, Mistral (same graph), Qwen2 (q/k/v bias, often tied embeddings)
and, via `config.qk_norm`, Qwen3's per-head q/k RMSNorm. One code path, driven by ModelConfig,
which also says which layers attend through a sliding window (Mistral's every layer, Qwen2's
from max_window_layers on).

Module names mirror HF's so checkpoint names map one-to-one, except the fused
projections listed in `packed_modules_mapping` (q/k/v -> qkv_proj, gate/up -> gate_up_proj).
"""
from __future__ import annotations

import torch
from torch import nn

from engine.config import ModelConfig
from engine.layers.activation import SiluAndMul
from engine.layers.attention import Attention
from engine.layers.embed_head import ParallelLMHead, VocabParallelEmbedding
from engine.layers.layernorm import RMSNorm
from engine.layers.linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from engine.layers.rotary import RotaryEmbedding, get_rope


class LlamaAttention(nn.Module):
    def __init__(self, config: ModelConfig, rotary_emb: RotaryEmbedding, sliding_window: int | None = None):
        super().__init__()
        head_dim = config.head_dim
        self.qkv_proj = QKVParallelLinear(config.hidden_size, head_dim, config.num_attention_heads,
                                          config.num_key_value_heads, bias=config.attention_bias)
        self.num_heads, self.num_kv_heads = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads  # per rank
        self.head_dim = head_dim
        self.q_size, self.kv_size = self.qkv_proj.q_size, self.qkv_proj.kv_size
        self.o_proj = RowParallelLinear(config.num_attention_heads * head_dim, config.hidden_size)
        if config.qk_norm:
            self.q_norm = RMSNorm(head_dim, config.rms_norm_eps)
            self.k_norm = RMSNorm(head_dim, config.rms_norm_eps)
        self.qk_norm = config.qk_norm
        self.rotary_emb = rotary_emb  # shared by all layers
        self.attn = Attention(self.num_heads, head_dim, head_dim ** -0.5, self.num_kv_heads,
                              sliding_window=sliding_window)

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor) -> torch.Tensor:
        n = hidden_states.shape[0]
        qkv = self.qkv_proj(hidden_states)  # [n, (H + 2 * KV) * D] on this rank
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)  # views, no copy
        if self.qk_norm:  # Qwen3: normalise each head before rotary (new tensors)
            q = self.q_norm(q.view(n, self.num_heads, self.head_dim))
            k = self.k_norm(k.view(n, self.num_kv_heads, self.head_dim))
            self.rotary_emb(positions, q, k)
        else:  # q and k heads are adjacent in qkv: rotate them in place in one pass
            qk = qkv[:, : self.q_size + self.kv_size].view(n, self.num_heads + self.num_kv_heads, self.head_dim)
            self.rotary_emb(positions, qk)
        o = self.attn(q.view(n, -1), k.view(n, -1), v)  # [n, H * D]
        return self.o_proj(o)


class LlamaMLP(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        inter = config.intermediate_size
        self.gate_up_proj = MergedColumnParallelLinear(config.hidden_size, [inter, inter])
        self.act_fn = SiluAndMul()
        self.down_proj = RowParallelLinear(inter, config.hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_up_proj(x)))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, rotary_emb: RotaryEmbedding, mlp: nn.Module | None = None,
                 sliding_window: int | None = None, self_attn: nn.Module | None = None):
        super().__init__()
        # sliding_window: Mistral, Qwen2's upper layers; self_attn: a model's own attention (gpt-oss)
        self.self_attn = LlamaAttention(config, rotary_emb, sliding_window) if self_attn is None else self_attn
        self.mlp = LlamaMLP(config) if mlp is None else mlp  # mlp: a mixture-of-experts block (engine/models/moe.py)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        # CPU, INT8 W8A8: the whole layer as one C call where a step allows it; set by the model
        # runner (engine/layers/cpu_fused_layer.py), bit-identical to the modules below.
        self.fused = None

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor, residual: torch.Tensor | None):
        """Returns (this layer's output, residual stream so far); the next norm adds them."""
        if self.fused is not None:
            out = self.fused(positions, hidden_states, residual)
            if out is not None:
                return out
        if residual is None:
            residual = hidden_states
            hidden_states = self.input_layernorm(hidden_states)
        else:
            hidden_states, residual = self.input_layernorm(hidden_states, residual)
        hidden_states = self.self_attn(positions, hidden_states)
        hidden_states, residual = self.post_attention_layernorm(hidden_states, residual)
        return self.mlp(hidden_states), residual


class LlamaModel(nn.Module):
    def __init__(self, config: ModelConfig, make_mlp=None, make_attention=None):
        """make_mlp(layer_idx) -> that layer's feed-forward module, or None for the dense LlamaMLP;
        make_attention(layer_idx, rotary_emb) -> its attention, or None for LlamaAttention."""
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size)
        # One cos/sin table for all layers ([max_position, head_dim] float32: 64 MiB for
        # Llama 3.1's 131072 positions, which a per-layer copy would multiply by 32).
        rotary_emb = get_rope(config)  # rope_scaling, partial_rotary_factor
        self.layers = nn.ModuleList(LlamaDecoderLayer(config, rotary_emb, make_mlp and make_mlp(i),
                                                      config.layer_sliding_window(i),
                                                      make_attention and make_attention(i, rotary_emb))
                                    for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        hidden_states, residual = self.embed_tokens(input_ids), None
        for layer in self.layers:
            hidden_states, residual = layer(positions, hidden_states, residual)
        hidden_states, _ = self.norm(hidden_states, residual)
        return hidden_states


class LlamaForCausalLM(nn.Module):
    # checkpoint module name -> (our fused module, shard id for its weight_loader)
    packed_modules_mapping = {
        "q_proj": ("qkv_proj", "q"),
        "k_proj": ("qkv_proj", "k"),
        "v_proj": ("qkv_proj", "v"),
        "gate_proj": ("gate_up_proj", 0),
        "up_proj": ("gate_up_proj", 1),
    }

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.config = config
        self.model = LlamaModel(config, self.make_mlp, self.make_attention)
        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def make_mlp(self, layer_idx: int) -> nn.Module | None:
        """Layer `layer_idx`'s feed-forward module; None: the dense LlamaMLP (MoE models override)."""
        return None

    def make_attention(self, layer_idx: int, rotary_emb: RotaryEmbedding) -> nn.Module | None:
        """Layer `layer_idx`'s attention; None: LlamaAttention (gpt-oss overrides)."""
        return None

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """input_ids, positions [num_tokens] int64 -> hidden states [num_tokens, hidden_size]."""
        return self.model(input_ids, positions)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """[n, hidden_size] (only the rows that sample) -> [n, vocab_size] float32, full vocab on every rank."""
        return self.lm_head(hidden_states).float()
