"""INT8 weights that stay int8 in memory: `[out, in]` int8 plus one float32 scale per output channel.

Three ways in, one storage:
- online (`EngineConfig(quantization="int8")` on a full-precision checkpoint): `Int8Config` loads
  the dense weight, then quantizes it symmetrically per output channel and frees the dense copy;
- compressed-tensors checkpoints (their dispatcher builds these methods): `Int8WeightOnlyLinearMethod`
  (W8A16) and `Int8W8A8LinearMethod` (int8 activations too, per token or a static scale), with a
  per-channel or per-tensor weight scale.

How it computes on CPU (candidates timed against our fp32 oneDNN path: `python -m
loadtest.cpu_quant_bench`, figures in docs/benchmarks.md):
- W8A16: activations in bf16 (the "16" of W8A16, even in an fp32 engine). Up to `_INT8PACK_MAX_ROWS`
  rows torch's `_weight_int8pack_mm` streams the int8 weight; above it that kernel falls behind, so
  the weight is widened to bf16 for one bf16 matmul (a temporary, per call) and the scale applied
  to its output.
- W8A8: with AVX-512 VNNI, one C call (kernels/cpu_int8.py) quantizes the activations, multiplies
  u8 x s8 into int32 (vpdpbusd, or AMX tiles from 8 rows where the CPU has them) on a weight
  repacked once at load, and scales; the same numbers as
  the torch path below, which runs on a CPU without VNNI: the activations quantized by torch ops,
  then `torch._int_mm` on the int8 weight's transposed view, int32 accumulate, then both scales.
CUDA (untested here: no GPU on the dev box): W8A8 through the torch path's `_int_mm`; W8A16 widens
the weight to the activation dtype for each call.
"""
from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from engine.layers.quantization.base import LinearMethodBase, QuantizationConfig, new_param
from kernels import cpu_int8

STRATEGIES = ("channel", "tensor")
# Rows up to which `_weight_int8pack_mm` beats widening the weight (loadtest.cpu_quant_bench).
_INT8PACK_MAX_ROWS = 8
_CPU_ACT_DTYPE = torch.bfloat16
# CUDA's _int_mm takes more than 16 rows only.
_CUDA_INT_MM_MIN_ROWS = 17


def quantize_per_channel(weight: torch.Tensor, round_scale_to: torch.dtype = torch.float32,
                         amax: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """[out, in] float -> (int8 [out, in], float32 scale [out]) with weight ~= q * scale[:, None].

    Symmetric, range +-127 (-128 left unused so negation stays exact). An all-zero row gets scale 1.
    round_scale_to: a dtype every scale is representable in (the CPU kernels read bf16 scales), so
    q * scale is exactly the weight the kernels multiply by. amax: each row's absmax when the row
    is wider than `weight` (a row-parallel shard's whole row)."""
    w = weight.float()
    amax = w.abs().amax(dim=1) if amax is None else amax
    scale = torch.where(amax > 0, amax / 127.0, torch.ones_like(amax))
    # Rounded up, so amax / scale stays <= 127 and nothing clips.
    rounded = scale.to(round_scale_to).float()
    scale = torch.where(rounded < scale, torch.nextafter(rounded.to(round_scale_to),
                                                         torch.tensor(float("inf"), dtype=round_scale_to)).float(),
                        rounded)
    q = torch.round(w / scale[:, None]).clamp_(-127, 127).to(torch.int8)
    return q, scale


def quantize_per_token(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[n, in] float -> (int8 [n, in], float32 scale [n, 1]): each row by its own absmax."""
    x = x.float()
    scale = (x.abs().amax(dim=1, keepdim=True) / 127.0).clamp_(min=1e-10)
    return torch.round(x / scale).clamp_(-127, 127).to(torch.int8), scale


def quantize_static(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return torch.round(x.float() / scale).clamp_(-127, 127).to(torch.int8)


# -- the matmuls ----------------------------------------------------------------------------------
def w8a16_matmul(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x [n, in] @ (q * scale[:, None]).T -> [n, out] in x's dtype; q int8 [out, in], scale [out]
    (bf16 on CPU: `_weight_int8pack_mm` takes its scales in the activations' dtype)."""
    if x.device.type == "cuda":  # untested here
        return torch.nn.functional.linear(x, q.to(x.dtype)) * scale.to(x.dtype)
    xa = x.to(_CPU_ACT_DTYPE)
    if x.shape[0] <= _INT8PACK_MAX_ROWS:
        y = torch._weight_int8pack_mm(xa, q, scale)
    else:  # one widening of the weight, amortised over the rows; int8 -> bf16 is exact, the scale
        # goes on the output
        y = torch.nn.functional.linear(xa, q.to(_CPU_ACT_DTYPE)).float() * scale.float()
    return y.to(x.dtype)


def w8a8_matmul(qx: torch.Tensor, x_scale: torch.Tensor, q: torch.Tensor, scale: torch.Tensor,
                out_dtype: torch.dtype) -> torch.Tensor:
    """(qx * x_scale) @ (q * scale[:, None]).T: int8 x int8 accumulated in int32, then scaled.
    qx int8 [n, in], x_scale [n, 1] or scalar, q int8 [out, in], scale [out]."""
    n = qx.shape[0]
    if qx.device.type == "cuda" and n < _CUDA_INT_MM_MIN_ROWS:  # untested here
        qx = torch.nn.functional.pad(qx, (0, 0, 0, _CUDA_INT_MM_MIN_ROWS - n))
    acc = torch._int_mm(qx, q.t())[:n]
    return (acc.float() * x_scale * scale).to(out_dtype)


# -- the linear methods ---------------------------------------------------------------------------
def _part_sizes(layer: nn.Module) -> list[int]:
    """This rank's output rows of each fused part (q, k, v / gate, up), or the whole layer's."""
    if hasattr(layer, "q_size") and hasattr(layer, "kv_size"):
        return [layer.q_size, layer.kv_size, layer.kv_size]
    return list(getattr(layer, "shard_sizes", [layer.output_size]))


def _check_strategy(strategy: str) -> str:
    if strategy not in STRATEGIES:
        raise ValueError(f"int8 weight strategy={strategy!r} is not supported (supported: {', '.join(STRATEGIES)})")
    return strategy


def _add_cpu_scale(layer: nn.Module) -> None:
    """The scale in the CPU kernels' activation dtype, once (2 bytes per output row), not per call."""
    layer.register_buffer("weight_scale_bf16", layer.weight_scale.data.to(_CPU_ACT_DTYPE), persistent=False)


def _replace(layer: nn.Module, name: str, value: torch.Tensor) -> None:
    """Swap a parameter for its processed form; the loaded one is freed with its last reference."""
    layer.register_parameter(name, nn.Parameter(value, requires_grad=False))


class Int8WeightOnlyLinearMethod(LinearMethodBase):
    """W8A16: `weight` int8 [out, in] and `weight_scale` ([out, 1] per channel, one per fused part per
    tensor); after loading `weight_scale` is float32 [out] whichever the checkpoint held."""

    def __init__(self, strategy: str):
        self.strategy = _check_strategy(strategy)

    def create_weights(self, layer: nn.Module) -> None:
        layer.register_parameter("weight", new_param((layer.output_size, layer.input_size), torch.int8,
                                                     output_dim=0, input_dim=1))
        self._create_scales(layer)

    def _create_scales(self, layer: nn.Module) -> None:
        if self.strategy == "channel":
            scale = new_param((layer.output_size, 1), torch.float32, output_dim=0)
        else:  # one per fused part: q, k and v were quantized as separate tensors
            scale = new_param((len(_part_sizes(layer)),), torch.float32, per_shard=True)
        layer.register_parameter("weight_scale", scale)

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        self._scale_per_output(layer)
        _add_cpu_scale(layer)

    def _scale_per_output(self, layer: nn.Module) -> None:
        scale = layer.weight_scale.data.float()
        if self.strategy == "tensor":  # each part's scalar over its rows
            sizes = torch.tensor(_part_sizes(layer), device=scale.device)
            scale = scale.repeat_interleave(sizes)
        _replace(layer, "weight_scale", scale.reshape(-1).contiguous())

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        scale = layer.weight_scale_bf16 if x.device.type == "cpu" else layer.weight_scale
        y = w8a16_matmul(x.reshape(-1, x.shape[-1]), layer.weight, scale)
        y = y.reshape(*x.shape[:-1], y.shape[-1])
        return y if bias is None else y + bias


class Int8W8A8LinearMethod(Int8WeightOnlyLinearMethod):
    """W8A8: the weight as in W8A16; activations quantized to int8 per token (dynamic) or by the
    checkpoint's `input_scale` (static: one per fused part, their max taken, as vLLM does)."""

    def __init__(self, strategy: str, static_input_scale: bool):
        super().__init__(strategy)
        self.static_input_scale = static_input_scale

    def create_weights(self, layer: nn.Module) -> None:
        super().create_weights(layer)
        if self.static_input_scale:
            layer.register_parameter("input_scale", new_param((len(_part_sizes(layer)),), torch.float32,
                                                              per_shard=True))

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        self._scale_per_output(layer)  # fp32 on both paths: no bf16 copy, unlike W8A16
        if self.static_input_scale:
            # One scale for the fused input: the largest part's, so no part's range is clipped.
            _replace(layer, "input_scale", layer.input_scale.data.float().amax().reshape(1))
        self.matmul = self.choose_matmul(layer)

    def choose_matmul(self, layer: nn.Module):
        """Once, at load: the VNNI kernel where it runs (the weight repacked for it); CUDA, and a
        CPU without AVX-512 VNNI (or without a C compiler), keep the torch ops and `_int_mm`."""
        if layer.weight.device.type == "cpu" and cpu_int8.available():
            _repack_for_vnni(layer)
            return w8a8_linear_vnni
        return w8a8_linear_torch

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        input_scale = layer.input_scale if self.static_input_scale else None
        y = self.matmul(layer, x.reshape(-1, x.shape[-1]), input_scale)
        y = y.reshape(*x.shape[:-1], y.shape[-1])
        return y if bias is None else y + bias


def w8a8_linear_torch(layer: nn.Module, x: torch.Tensor, input_scale: torch.Tensor | None) -> torch.Tensor:
    """x [n, in] -> [n, out] in x's dtype: x quantized by torch ops, then `w8a8_matmul`."""
    if input_scale is not None:
        qx, x_scale = quantize_static(x, input_scale), input_scale
    else:
        qx, x_scale = quantize_per_token(x)
    return w8a8_matmul(qx, x_scale, layer.weight, layer.weight_scale, x.dtype)


def w8a8_linear_vnni(layer: nn.Module, x: torch.Tensor, input_scale: torch.Tensor | None) -> torch.Tensor:
    """The same in one C call, on the weight `_repack_for_vnni` left."""
    return cpu_int8.int8_linear_cpu(x, layer.vnni, input_scale)


def _repack_for_vnni(layer: nn.Module) -> None:
    """`weight` [out, in] int8 -> `weight_packed` in the VNNI kernel's layout (the same bytes, padded
    to 16 outputs and 64 inputs) and `weight_comp`, its +128 offset's correction; `layer.vnni` views
    them and `weight_scale` for the kernel's calls."""
    w = cpu_int8.pack_int8_vnni(layer.weight.data, layer.weight_scale.data)
    del layer.weight  # the [out, in] copy goes; the packed one holds the same bytes
    _replace(layer, "weight_packed", w.packed)
    layer.register_buffer("weight_comp", w.comp)
    layer.vnni = cpu_int8.CpuInt8Weights(layer.weight_packed.data, layer.weight_comp, layer.weight_scale.data,
                                         w.in_features)


class Int8OnlineLinearMethod(Int8WeightOnlyLinearMethod):
    """Online W8A16: a dense `weight` in the engine dtype for the loader, quantized once it is in."""

    def __init__(self):
        super().__init__("channel")

    def create_weights(self, layer: nn.Module) -> None:
        layer.register_parameter("weight", new_param((layer.output_size, layer.input_size),
                                                     torch.get_default_dtype(), output_dim=0, input_dim=1))

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        amax = layer.weight.data.float().abs().amax(dim=1)
        if layer.tp_dim == 1 and layer.tp_size > 1:
            # A row-parallel rank holds part of each row: the row's absmax over every rank gives
            # the scale TP=1 would, so the quantized model is the same at any tensor_parallel_size.
            dist.all_reduce(amax, op=dist.ReduceOp.MAX)
        q, scale = quantize_per_channel(layer.weight.data, round_scale_to=_CPU_ACT_DTYPE, amax=amax)
        _replace(layer, "weight", q)  # the full-precision copy goes with the old parameter
        _replace(layer, "weight_scale", scale)
        _add_cpu_scale(layer)


class Int8Config(QuantizationConfig):
    """`quantization="int8"` on an unquantized checkpoint: every linear layer W8A16 per channel.
    (int8 checkpoints come as compressed-tensors, whose config builds the methods above.)"""

    name = "int8"

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> "Int8Config":
        if config:
            raise ValueError(f"quantization='int8' quantizes an unquantized checkpoint at load and takes no "
                             f"settings; got quantization_config keys {sorted(config)}")
        return cls()

    def get_linear_method(self, layer: nn.Module, prefix: str) -> LinearMethodBase:
        return Int8OnlineLinearMethod()
