"""Quantized linear layers: the formats' registry, and the build-time pass that gives each layer its method.

A model is built with every `LinearBase` waiting for its method (`quantized_build`), then
`quantize_linear_layers` asks the config for each layer's method by module name (so a
checkpoint's ignore list is honoured) and the method creates the layer's parameters in its
packed layout, before any weight is read. Unquantized models never enter this module: their
layers create a dense weight at construction, as they always have.
"""
from __future__ import annotations

import contextlib
import importlib
from typing import Any

from torch import nn

from engine.layers.quantization.base import (LinearMethodBase, QuantizationConfig, UnquantizedLinearMethod,
                                             new_param, set_layout)

# method name (engine.config.quantization) -> "module:Config class", imported on first use.
QUANTIZATION_CONFIGS: dict[str, str] = {
    "mxfp4": "engine.layers.quantization.mxfp4:Mxfp4Config",
    "fp8": "engine.layers.quantization.fp8:Fp8Config",
    "compressed-tensors": "engine.layers.quantization.compressed_tensors:CompressedTensorsConfig",
    "int8": "engine.layers.quantization.int8:Int8Config",
    "awq": "engine.layers.quantization.awq:AWQConfig",
    "gptq": "engine.layers.quantization.gptq:GPTQConfig",
    "gguf": "engine.layers.quantization.gguf:GGUFConfig",
}

_building_quantized = False


def get_quantization_config(method: str, checkpoint_config: dict[str, Any] | None) -> QuantizationConfig:
    """The config that runs `method`, read from the checkpoint's `quantization_config` (None for an
    online method on an unquantized checkpoint). ValueError naming what it cannot run."""
    if method not in QUANTIZATION_CONFIGS:
        raise ValueError(f"quantization={method!r} is not supported (supported: {', '.join(QUANTIZATION_CONFIGS)})")
    module, _, cls = QUANTIZATION_CONFIGS[method].partition(":")
    return getattr(importlib.import_module(module), cls).from_config(dict(checkpoint_config or {}))


@contextlib.contextmanager
def quantized_build():
    """Inside: `LinearBase` layers create no weights (`quantize_linear_layers` does, by name)."""
    global _building_quantized
    prev, _building_quantized = _building_quantized, True
    try:
        yield
    finally:
        _building_quantized = prev


def is_building_quantized() -> bool:
    return _building_quantized


def quantize_linear_layers(model: nn.Module, config: QuantizationConfig) -> None:
    """Give every linear layer built under `quantized_build` its method and parameters.
    Run under the same default device and dtype as the model's construction."""
    from engine.layers.fused_moe.layer import FusedMoE
    from engine.layers.linear import LinearBase

    for prefix, module in model.named_modules():
        if isinstance(module, FusedMoE) and config.handles_experts is False \
                and not config.is_ignored(checkpoint_prefixes(model, prefix)):
            raise ValueError(f"quantization {config.name!r}: quantized MoE experts ({prefix}) are not supported yet")
        if isinstance(module, LinearBase) and module.quant_method is None:
            ckpt = checkpoint_prefixes(model, prefix)
            method = UnquantizedLinearMethod() if config.is_ignored(ckpt) else config.get_linear_method(module, prefix)
            module.set_quant_method(method)


def checkpoint_prefixes(model: nn.Module, prefix: str) -> list[str]:
    """The checkpoint's module names that load into our module `prefix` (a fused qkv_proj is
    q_proj, k_proj and v_proj there), by the model's `packed_modules_mapping`."""
    mapping = getattr(model, "packed_modules_mapping", {})
    for ckpt, (ours, shard) in mapping.items():  # renames first (Mixtral's mlp is block_sparse_moe)
        if shard is None and f".{ours}." in f".{prefix}.":
            prefix = f".{prefix}.".replace(f".{ours}.", f".{ckpt}.")[1:-1]
    leaf = prefix.rpartition(".")[2]
    parts = [ckpt for ckpt, (ours, shard) in mapping.items() if ours == leaf and shard is not None]
    return [f"{prefix[: len(prefix) - len(leaf)]}{p}" for p in parts] or [prefix]


__all__ = ["LinearMethodBase", "QUANTIZATION_CONFIGS", "QuantizationConfig", "UnquantizedLinearMethod",
           "checkpoint_prefixes", "get_quantization_config", "is_building_quantized", "new_param",
           "quantize_linear_layers", "quantized_build", "set_layout"]
