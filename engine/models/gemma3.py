"""Gemma 3's text model (`Gemma3ForCausalLM`, config `Gemma3TextConfig`, model_type gemma3_text):
the Gemma 2 graph (engine/models/gemma2.py) with

- a GemmaRMSNorm over each q and k head before RoPE (q_norm / k_norm);
- two RoPEs: the local (sliding) layers rotate with `rope_local_base_freq` (or
  rope_parameters["sliding_attention"]; ModelConfig.rope_local), the global ones with rope_theta
  and its scaling;
- five local layers to one global by default (`sliding_window_pattern`, or `layer_types`);
- no soft caps unless config.json sets them.

The multimodal Gemma3ForConditionalGeneration is refused at start (engine/config/model.py).
"""
from __future__ import annotations

from engine.config import ModelConfig
from engine.config.sliding_window import read_layer_types
from engine.models.gemma2 import Gemma2ForCausalLM


class Gemma3ForCausalLM(Gemma2ForCausalLM):
    option_defaults = dict(query_pre_attn_scalar=256, attn_logit_softcapping=None, final_logit_softcapping=None)
    qk_norm = True

    @staticmethod
    def local_layers(config: ModelConfig) -> list[bool]:
        """HF gives a sliding_attention layer the local RoPE even where its window covers the whole
        context (which ModelConfig then drops): read the layer types as HF builds them."""
        types = config.layer_types or read_layer_types(config.hf_config, config.architecture, config.num_hidden_layers)
        return [t == "sliding_attention" for t in types or ["full_attention"] * config.num_hidden_layers]
