"""Phi-3 / Phi-3.5-mini / Phi-4-mini (`Phi3ForCausalLM`): the Llama graph with

- q/k/v and gate/up stored fused in the checkpoint, under our own module names (`qkv_proj`,
  `gate_up_proj`): each tensor goes whole to its layer's weight_loader, which splits it into its
  parts and cuts this TP rank's rows (engine/layers/linear.py, shard_id None);
- LongRoPE (`rope_scaling` "longrope", or "su" in early configs) and `partial_rotary_factor`
  (Phi-4-mini rotates 3/4 of each head), both in the shared rotary layer (engine/layers/rotary.py).

Phi-3's sliding window (2047 in the 4k checkpoints) slides on every layer, as Mistral's does
(ModelConfig.layer_types); the 128k checkpoints' window covers their whole context.
"""
from __future__ import annotations

from engine.config import ModelConfig
from engine.models.llama import LlamaForCausalLM


class Phi3ForCausalLM(LlamaForCausalLM):
    packed_modules_mapping = {}  # the checkpoint's names are ours: nothing to rename, nothing to gather

    def __init__(self, config: ModelConfig):
        if config.attention_bias or config.qk_norm:
            raise ValueError("Phi3ForCausalLM has no q/k/v bias and no q/k norm")
        super().__init__(config)
