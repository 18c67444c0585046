"""Engine configuration: plain values, validated once, resolved once.

`EngineConfig` (engine.py) never touches disk; `ModelConfig.from_pretrained` (model.py) is the
one place that reads a checkpoint's config.json, so a scheduler can be built in a test from
numbers alone. `EngineConfig.resolve` is the one place where "auto" and the None defaults become
concrete values; every stage after it reads only those. What a config.json says about RoPE
(rope.py) and about which layers slide (sliding_window.py) is read in a module of its own.
Torch-free: the HTTP tier imports it.
"""
from engine.config.engine import (ATTENTION_BACKENDS, DEFAULT_CPU_KV_CACHE_GB, DEFAULT_CUDA_KV_OFFLOAD_GB, DEVICES,
                                  DTYPES, SCHEDULING_POLICIES, EngineConfig)
from engine.config.model import HIDDEN_ACTS, ModelConfig
from engine.config.rope import ROPE_TYPES
from engine.config.sliding_window import LAYER_TYPES, SLIDING_WINDOW_ARCHITECTURES
from engine.config.speculative import SPECULATIVE_METHODS, SpeculativeConfig

__all__ = ["ATTENTION_BACKENDS", "DEFAULT_CPU_KV_CACHE_GB", "DEFAULT_CUDA_KV_OFFLOAD_GB", "DEVICES", "DTYPES",
           "EngineConfig", "HIDDEN_ACTS", "LAYER_TYPES", "ModelConfig", "ROPE_TYPES", "SCHEDULING_POLICIES",
           "SLIDING_WINDOW_ARCHITECTURES", "SPECULATIVE_METHODS", "SpeculativeConfig"]
