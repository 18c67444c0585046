"""llm-compressor's checkpoints (`quant_method: "compressed-tensors"`): the scheme of the config group
that targets the Linear layers picks the linear method, once, when the config is read.

    config_groups: {"group_0": {"targets": ["Linear"],
                                "weights": {"num_bits": 8, "type": "float", "strategy": "channel",
                                            "symmetric": true, "dynamic": false, ...},
                                "input_activations": {"num_bits": 8, "type": "float", "strategy": "token",
                                                      "dynamic": true, ...} or null}}
    ignore: ["lm_head", "re:.*mlp.gate$"], format: "float-quantized"

Runs: FP8 W8A8 (weights tensor / channel / block, activations dynamic, or static per tensor) on
engine/layers/quantization/fp8.py; INT8 W8A8 and W8A16 (weights tensor / channel) on
engine/layers/quantization/int8.py. Anything else is refused, naming the scheme.
"""
from __future__ import annotations

import importlib
from typing import Any

from torch import nn

from engine.layers.quantization.base import LinearMethodBase, QuantizationConfig
from engine.layers.quantization.fp8 import Fp8Scheme

_KEYS = ("quant_method", "config_groups", "ignore", "format", "quantization_status", "global_compression_ratio",
         "kv_cache_scheme", "sparsity_config", "version", "transform_config")
# Unpacked formats: one fp8 / int8 element per weight entry (pack-quantized is 4-bit in int32s).
_FORMATS = ("float-quantized", "int-quantized", "naive-quantized")
_FP8 = "engine.layers.quantization.fp8:Fp8LinearMethod"
_INT8_W8A8 = "engine.layers.quantization.int8:Int8W8A8LinearMethod"
_INT8_W8A16 = "engine.layers.quantization.int8:Int8WeightOnlyLinearMethod"


class CompressedTensorsConfig(QuantizationConfig):
    name = "compressed-tensors"

    def __init__(self, method: tuple[str, dict], ignored: list[str] | None = None):
        super().__init__(ignored)
        self.method = method  # ("module:Class", its constructor's keyword arguments)

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> "CompressedTensorsConfig":
        extra = sorted(set(config) - set(_KEYS))
        if extra:
            raise ValueError(f"quantization_config keys {extra} are not supported for quant_method='compressed-tensors'")
        if config.get("kv_cache_scheme"):
            raise ValueError(f"compressed-tensors kv_cache_scheme={config['kv_cache_scheme']!r} is not supported")
        sparsity = config.get("sparsity_config") or {}
        if sparsity.get("format", "dense") != "dense":
            raise ValueError(f"compressed-tensors sparsity format {sparsity['format']!r} is not supported")
        groups = config.get("config_groups")
        if not isinstance(groups, dict) or len(groups) != 1:
            raise ValueError(f"compressed-tensors config_groups={groups!r} is not supported: expected one group "
                             "targeting Linear")
        (group,) = groups.values()
        fmt = group.get("format") or config.get("format")
        if fmt not in _FORMATS:
            raise ValueError(f"compressed-tensors format={fmt!r} is not supported (supported: {', '.join(_FORMATS)})")
        if group.get("targets") != ["Linear"]:
            raise ValueError(f"compressed-tensors targets={group.get('targets')!r} are not supported (only ['Linear'])")
        if group.get("output_activations"):
            raise ValueError("compressed-tensors output_activations quantization is not supported")
        return cls(scheme_method(group.get("weights"), group.get("input_activations")), config.get("ignore"))

    def get_linear_method(self, layer: nn.Module, prefix: str) -> LinearMethodBase:
        path, kwargs = self.method
        module, _, cls = path.partition(":")
        return getattr(importlib.import_module(module), cls)(**kwargs)  # int8's module: only when used


def scheme_method(weights: dict | None, acts: dict | None) -> tuple[str, dict]:
    """The linear method ("module:Class", kwargs) that runs a group's weights / input_activations;
    ValueError naming the scheme when none does."""
    if not isinstance(weights, dict):
        raise ValueError(f"compressed-tensors weights={weights!r} is not supported: expected an object")
    desc = _describe(weights, acts)
    kind, bits, strategy = weights.get("type"), weights.get("num_bits"), weights.get("strategy")
    if not weights.get("symmetric", True) or (acts and not acts.get("symmetric", True)):
        raise ValueError(f"compressed-tensors scheme {desc}: asymmetric quantization is not supported")
    if weights.get("dynamic"):
        raise ValueError(f"compressed-tensors scheme {desc}: dynamic weight quantization is not supported")
    if acts is not None and (acts.get("num_bits") != 8 or acts.get("type") != kind):
        raise ValueError(f"compressed-tensors scheme {desc}: activations must be 8-bit {kind}, like the weights")
    static = acts is not None and not acts.get("dynamic")
    if static and acts.get("strategy") != "tensor":
        raise ValueError(f"compressed-tensors scheme {desc}: static activations must be per tensor")
    if kind == "float" and bits == 8 and acts is not None and strategy in ("tensor", "channel", "block"):
        return _FP8, {"scheme": _fp8_scheme(weights, strategy, static, desc)}
    if kind == "int" and bits == 8 and strategy in ("tensor", "channel"):
        if acts is None:
            return _INT8_W8A16, {"strategy": strategy}
        return _INT8_W8A8, {"strategy": strategy, "static_input_scale": static}
    raise ValueError(f"compressed-tensors scheme {desc} is not supported (supported: FP8 W8A8 with tensor, channel "
                     "or block weights; INT8 W8A8 or W8A16 with tensor or channel weights)")


def _fp8_scheme(weights: dict, strategy: str, static: bool, desc: str) -> Fp8Scheme:
    block = weights.get("block_structure") if strategy == "block" else None
    if strategy == "block" and not (isinstance(block, list) and len(block) == 2
                                    and all(isinstance(v, int) and v > 0 for v in block)):
        raise ValueError(f"compressed-tensors scheme {desc}: block_structure={block!r} must be [bn, bk]")
    return Fp8Scheme(strategy, static_input=static, block=tuple(block) if block else None)


def _describe(weights: dict, acts: dict | None) -> str:
    def one(q):
        if not q:
            return "none"
        parts = [f"{q.get('type')}{q.get('num_bits')}", str(q.get("strategy"))]
        if q.get("group_size"):
            parts.append(f"group_size={q['group_size']}")
        if not q.get("symmetric", True):
            parts.append("asymmetric")
        parts.append("dynamic" if q.get("dynamic") else "static")
        return " ".join(parts)
    return f"weights [{one(weights)}], input_activations [{one(acts)}]"
