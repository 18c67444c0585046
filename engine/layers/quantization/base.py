"""What every quantization format implements: a config read from the checkpoint, and a linear method.

As in vLLM: a `QuantizationConfig` says, per linear layer (by its module name), which
`LinearMethodBase` computes it; the method creates the layer's parameters in the format's packed
layout (`create_weights`), derives what it needs once every tensor is in
(`process_weights_after_loading`), and computes `x @ W.T + bias` from them (`apply`).

Each parameter a method creates says how it is laid out against the layer's logical
`[output_size, input_size]` weight (`set_layout`), so the layers' one weight loader can shard it
for tensor parallelism and cut a fused layer's parts out of it whatever the packing: a dimension
that packs `elems` logical features into `units` rows (AWQ: 8 outputs per int32, `(8, 1)`; a
128-wide block scale, `(128, 1)`; a GGUF Q4_K row, `(256, 144)` bytes) is narrowed in whole blocks.
"""
from __future__ import annotations

import re
from typing import Any

import torch
from torch import nn


def set_layout(param: nn.Parameter, output_dim: int | None = None, input_dim: int | None = None,
               output_block: tuple[int, int] = (1, 1), input_block: tuple[int, int] = (1, 1),
               per_shard: bool = False) -> nn.Parameter:
    """Record how `param` maps onto the logical weight (read by engine.layers.linear's loaders).

    output_dim / input_dim: the param's dimension that runs along the weight's output / input
    features (None: the param does not; it is copied whole to every rank). per_shard: the param
    holds one entry per fused part along dim 0 (a per-tensor scale of q, k and v each)."""
    param.output_dim, param.input_dim = output_dim, input_dim
    param.output_block, param.input_block, param.per_shard = output_block, input_block, per_shard
    return param


def new_param(shape, dtype: torch.dtype, **layout) -> nn.Parameter:
    """An uninitialised, frozen parameter of `shape` on the current default device, laid out by `layout`."""
    return set_layout(nn.Parameter(torch.empty(shape, dtype=dtype), requires_grad=False), **layout)


class LinearMethodBase:
    """How one linear layer stores and multiplies its weight."""

    def create_weights(self, layer: nn.Module) -> None:
        """Register the layer's parameters (`layer.register_parameter`), each laid out by `set_layout`.
        The layer's sizes are this rank's: `layer.output_size`, `layer.input_size`."""
        raise NotImplementedError

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        """Once every checkpoint tensor is in: repack, fold scales, free what `apply` does not read."""

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """x [n, input_size] -> [n, output_size] (+ bias)."""
        raise NotImplementedError


class UnquantizedLinearMethod(LinearMethodBase):
    """A dense `weight` in the engine dtype; on CPU fp32 the model runner packs it for oneDNN."""

    def create_weights(self, layer: nn.Module) -> None:
        layer.register_parameter("weight", new_param((layer.output_size, layer.input_size),
                                                     torch.get_default_dtype(), output_dim=0, input_dim=1))

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        from engine.layers.cpu_gemm import packed_linear

        if layer.packed_weight is not None:
            return packed_linear(x, layer.packed_weight, bias)
        return torch.nn.functional.linear(x, layer.weight, bias)


class QuantizationConfig:
    """A checkpoint's `quantization_config` (or an online method's settings), checked once.

    Subclasses set `name` and implement `from_config` (ValueError naming any value they cannot
    run: bit width, group size, scheme) and `get_linear_method`."""

    name: str = ""
    # Whether the format's MoE experts load (gpt-oss's MXFP4, dequantized by its model); the
    # others' experts are refused at build, naming the layer.
    handles_experts: bool = False

    def __init__(self, ignored: list[str] | None = None):
        # Module names (or "re:" patterns, compressed-tensors' spelling) left unquantized.
        self.ignored = list(ignored or [])

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> QuantizationConfig:
        raise NotImplementedError

    def get_linear_method(self, layer: nn.Module, prefix: str) -> LinearMethodBase:
        raise NotImplementedError

    def is_ignored(self, checkpoint_prefixes: list[str]) -> bool:
        """Whether the layer whose checkpoint modules are `checkpoint_prefixes` stays unquantized.
        A fused layer's parts must agree (vLLM's rule): half-quantized q/k/v cannot be one matmul."""
        hits = [any(_matches(rule, p) for rule in self.ignored) for p in checkpoint_prefixes]
        if any(hits) and not all(hits):
            raise ValueError(f"{self.name}: the fused parts {checkpoint_prefixes} are quantized differently "
                             "(some are in the ignore list); they cannot share one matmul")
        return all(hits)


def _matches(rule: str, prefix: str) -> bool:
    if rule.startswith("re:"):
        return re.fullmatch(rule[3:], prefix) is not None
    # A plain name matches whole dotted segments anywhere in the module's name: "lm_head",
    # "model.layers.0.mlp" (and every module under it), "mlp.gate" in any layer.
    return f".{rule}." in f".{prefix}."
