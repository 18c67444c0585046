"""Gemma 2 (`Gemma2ForCausalLM`), and the graph Gemma 3's text model (engine/models/gemma3.py)
shares. Llama's attention and MLP modules with Gemma's differences:

- every RMSNorm is Gemma's (1 + weight, in float32: GemmaRMSNorm), and a layer has four: the
  attention's and the MLP's outputs are normalised too before they join the residual stream;
- the embeddings are multiplied by sqrt(hidden_size) (rounded to the model's dtype, as HF does);
- the attention scale is query_pre_attn_scalar ** -0.5, scores are soft-capped
  (`attn_logit_softcapping`: cap * tanh(s / cap)) and so are the final logits
  (`final_logit_softcapping`);
- the MLP's activation is GELU with the tanh approximation (gelu_pytorch_tanh);
- even layers slide over `sliding_window` positions, odd ones see everything
  (ModelConfig.layer_types); the lm_head is the embedding (tied).

Module names are HF's, so checkpoint names map one-to-one except the fused projections
(`packed_modules_mapping`, as in the Llama graph).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from engine.config import ModelConfig
from engine.layers.activation import GeluAndMul
from engine.layers.attention import Attention
from engine.layers.embed_head import ParallelLMHead, VocabParallelEmbedding
from engine.layers.layernorm import GemmaRMSNorm
from engine.layers.rotary import RotaryEmbedding, get_rope
from engine.models.llama import LlamaAttention, LlamaForCausalLM, LlamaMLP


@dataclass(frozen=True)
class GemmaOptions:
    """Gemma's keys beyond ModelConfig, from config.json (hf_config) with the family's HF defaults."""

    query_pre_attn_scalar: float          # the attention scale is its ** -0.5
    attn_logit_softcapping: float | None  # None: scores not capped
    final_logit_softcapping: float | None
    qk_norm: bool                         # Gemma 3: a GemmaRMSNorm over each q and k head before RoPE


class GemmaMLP(LlamaMLP):
    def __init__(self, config: ModelConfig):
        super().__init__(config)
        self.act_fn = GeluAndMul(approximate="tanh")  # gelu_pytorch_tanh (ModelConfig checks hidden_act)


class GemmaAttention(LlamaAttention):
    """LlamaAttention (fused qkv, RoPE, paged attention, o_proj) with Gemma's scale and soft cap,
    and Gemma 3's per-head q/k norms."""

    def __init__(self, config: ModelConfig, options: GemmaOptions, rotary_emb: RotaryEmbedding,
                 sliding_window: int | None):
        super().__init__(config, rotary_emb, sliding_window)
        self.attn = Attention(self.num_heads, self.head_dim, options.query_pre_attn_scalar ** -0.5,
                              self.num_kv_heads, sliding_window=sliding_window,
                              logits_soft_cap=options.attn_logit_softcapping)
        self.qk_norm = options.qk_norm  # LlamaAttention.forward normalises each head, then rotates
        if options.qk_norm:
            self.q_norm = GemmaRMSNorm(self.head_dim, config.rms_norm_eps)
            self.k_norm = GemmaRMSNorm(self.head_dim, config.rms_norm_eps)


class GemmaDecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, options: GemmaOptions, rotary_emb: RotaryEmbedding,
                 sliding_window: int | None):
        super().__init__()
        self.self_attn = GemmaAttention(config, options, rotary_emb, sliding_window)
        self.mlp = GemmaMLP(config)
        size, eps = config.hidden_size, config.rms_norm_eps
        self.input_layernorm = GemmaRMSNorm(size, eps)
        self.post_attention_layernorm = GemmaRMSNorm(size, eps)
        self.pre_feedforward_layernorm = GemmaRMSNorm(size, eps)
        self.post_feedforward_layernorm = GemmaRMSNorm(size, eps)

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor, residual: torch.Tensor | None):
        """Returns (this layer's output, residual stream so far); the next norm adds them, as in the
        Llama graph. HF's residual + post_norm(branch) is that add, done by the next pre-norm."""
        if residual is None:
            residual = hidden_states
            hidden_states = self.input_layernorm(hidden_states)
        else:
            hidden_states, residual = self.input_layernorm(hidden_states, residual)
        hidden_states = self.post_attention_layernorm(self.self_attn(positions, hidden_states))
        hidden_states, residual = self.pre_feedforward_layernorm(hidden_states, residual)
        return self.post_feedforward_layernorm(self.mlp(hidden_states)), residual


class GemmaModel(nn.Module):
    def __init__(self, config: ModelConfig, options: GemmaOptions, local_layers: list[bool]):
        """local_layers[i]: layer i is a local (sliding_attention) one, which rotates with
        config.rope_local where the model has one (Gemma 3)."""
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size)
        # sqrt(hidden_size) in the model's dtype (the default dtype while the runner builds the model)
        self.register_buffer("normalizer", torch.tensor(config.hidden_size ** 0.5), persistent=False)
        rotary_emb = get_rope(config)  # one table per RoPE, shared by the layers that use it
        local_rotary_emb = rotary_emb if config.rope_local is None else get_rope(config, config.rope_local)
        self.layers = nn.ModuleList(
            GemmaDecoderLayer(config, options, local_rotary_emb if local_layers[i] else rotary_emb,
                              config.layer_sliding_window(i))
            for i in range(config.num_hidden_layers))
        self.norm = GemmaRMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        hidden_states, residual = self.embed_tokens(input_ids) * self.normalizer, None
        for layer in self.layers:
            hidden_states, residual = layer(positions, hidden_states, residual)
        hidden_states, _ = self.norm(hidden_states, residual)
        return hidden_states


class Gemma2ForCausalLM(nn.Module):
    packed_modules_mapping = LlamaForCausalLM.packed_modules_mapping
    # HF's defaults for a key config.json lacks (a null in it means none)
    option_defaults = dict(query_pre_attn_scalar=256, attn_logit_softcapping=50.0, final_logit_softcapping=30.0)
    qk_norm = False

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.config = config
        hf = config.hf_config
        self.options = GemmaOptions(**{k: hf.get(k, v) for k, v in self.option_defaults.items()},
                                    qk_norm=self.qk_norm)
        self.model = GemmaModel(config, self.options, self.local_layers(config))
        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    @staticmethod
    def local_layers(config: ModelConfig) -> list[bool]:
        """Which layers are local ones (Gemma 2 has one RoPE for all, so only the windows differ)."""
        return [config.layer_sliding_window(i) is not None for i in range(config.num_hidden_layers)]

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """input_ids, positions [num_tokens] int64 -> hidden states [num_tokens, hidden_size]."""
        return self.model(input_ids, positions)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """[n, hidden_size] -> [n, vocab_size] float32, soft-capped in the model's dtype as HF caps them."""
        logits = self.lm_head(hidden_states)
        cap = self.options.final_logit_softcapping
        if cap is not None:
            logits = torch.tanh(logits / cap) * cap
        return logits.float()
