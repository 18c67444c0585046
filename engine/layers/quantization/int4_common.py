"""What AWQ and GPTQ share: reading their config's common fields, nibble unpacking, and the one
linear method both end in once their checkpoint layouts are repacked at load.

After `process_weights_after_loading` a layer of either format holds (kernels/triton_int4_gemm.py):

    qweight [K / 8, N] int32   4-bit codes packed along the input dim, lowest nibble first
    scales  [G, N]             the checkpoint's fp16 scales
    zeros   [G, N] uint8       the true zero point of each group and output
    g_idx   [K] int32          the group of each input row

so W[n, k] = (q[k, n] - zeros[g_idx[k], n]) * scales[g_idx[k], n]: about half a byte per weight,
as in the checkpoint. On CUDA the Triton kernel computes with it. On CPU, where the C kernel builds
(kernels/cpu_int4.py), the layer is repacked once more into that kernel's layout (the same bytes:
each output's codes contiguous along K, groups in order) because unpacking codes in registers beats
dequantizing fp32 tiles for torch at decode sizes; without the kernel, `int4_gemm_torch`.
"""
from __future__ import annotations

from typing import Any

import torch
from torch import nn

from engine.layers.quantization.base import LinearMethodBase
from kernels import cpu_int4
from kernels.triton_int4_gemm import int4_gemm, int4_gemm_torch

SHIFTS = torch.arange(0, 32, 4, dtype=torch.int32)


def check_choice(method: str, config: dict[str, Any], key: str, allowed: tuple, default=None):
    """The config's `key`, or ValueError naming it and its value when it is not in `allowed`."""
    value = config.get(key, default)
    if value not in allowed:
        raise ValueError(f"quant_method={method!r}: {key}={value!r} is not supported "
                         f"(supported: {', '.join(map(repr, allowed))})")
    return value


def unpack_cols(packed: torch.Tensor, order: list[int] | None = None) -> torch.Tensor:
    """[R, C / 8] int32 -> [R, C] int32 codes; column 8j + i is nibble `order[i]` of word j
    (order None: nibble i, GPTQ's sequential packing)."""
    codes = (packed[:, :, None] >> SHIFTS.to(packed.device)) & 0xF  # [R, C / 8, 8] by nibble
    if order is not None:
        codes = codes[:, :, order]
    return codes.reshape(packed.shape[0], -1)


def pack_rows(codes: torch.Tensor) -> torch.Tensor:
    """[K, N] codes 0..15 -> [K / 8, N] int32, row k in nibble k % 8 (the kernel's layout)."""
    k, n = codes.shape
    by_nibble = codes.to(torch.int32).reshape(k // 8, 8, n) << SHIFTS.to(codes.device)[None, :, None]
    packed = torch.zeros(k // 8, n, dtype=torch.int32, device=codes.device)
    for i in range(8):  # bitwise or of the nibbles (no integer sum: nibble 7 carries the sign bit)
        packed |= by_nibble[:, i]
    return packed


def check_layer_dims(method: str, layer: nn.Module, prefix: str, group_size: int | None) -> None:
    """ValueError naming the layer whose (this rank's) sizes do not fall on whole packed words or groups."""
    if layer.output_size % 8 or layer.input_size % 8:
        raise ValueError(f"quant_method={method!r}: {prefix} is [{layer.output_size}, {layer.input_size}] on "
                         "this rank; int4 packing needs both sizes to be multiples of 8")
    if group_size is not None and layer.input_size % group_size:
        raise ValueError(f"quant_method={method!r}: {prefix} has {layer.input_size} input features on this rank, "
                         f"not a multiple of group_size={group_size}")


def replace_params(layer: nn.Module, old: tuple[str, ...], **new: torch.Tensor) -> None:
    """Drop the checkpoint-layout params `old` and register `new` (frozen) in their place."""
    for name in old:
        delattr(layer, name)
    for name, t in new.items():
        layer.register_parameter(name, nn.Parameter(t.contiguous(), requires_grad=False))


def shared_layout_gemm(layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x [M, K] @ W^T (+ bias) from the shared layout: Triton on CUDA, tiled torch elsewhere."""
    gemm = int4_gemm if x.is_cuda else int4_gemm_torch
    y = gemm(x, layer.qweight, layer.scales, layer.zeros, layer.g_idx)
    return y if bias is None else y + bias


def cpu_kernel_gemm(layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x [M, K] @ W^T (+ bias) from the CPU kernel's layout (`repack_for_cpu_kernel`)."""
    return cpu_int4.int4_linear_cpu(x, layer.int4_cpu, bias)


def repack_for_cpu_kernel(layer: nn.Module) -> None:
    """Replace the shared layout's params by the C kernel's (same bytes; see kernels/cpu_int4.py).
    `layer.int4_cpu` views them, for the kernel's calls."""
    w = cpu_int4.pack_int4_cpu(layer.qweight.data, layer.scales.data, layer.zeros.data, layer.g_idx.data)
    replace_params(layer, ("qweight", "scales", "zeros", "g_idx"), codes=w.codes, code_scales=w.scales,
                   code_zeros=w.zeros, segment_bounds=w.bounds, k_perm=w.perm)
    # The params hold the same storage (replace_params keeps contiguous tensors as they are).
    layer.int4_cpu = cpu_int4.CpuInt4Weights(layer.codes.data, layer.code_scales.data, layer.code_zeros.data,
                                             layer.segment_bounds.data, layer.k_perm.data)


class Int4LinearMethod(LinearMethodBase):
    """`apply` for both formats, once their layers hold the shared layout above (`to_shared_layout`,
    per format); the arithmetic is chosen once, at the end of loading."""

    def to_shared_layout(self, layer: nn.Module) -> None:
        raise NotImplementedError

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        self.to_shared_layout(layer)
        self.gemm = shared_layout_gemm
        if (layer.qweight.device.type == "cpu" and layer.scales.dtype == torch.float16
                and cpu_int4.available()):
            repack_for_cpu_kernel(layer)
            self.gemm = cpu_kernel_gemm

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        y = self.gemm(layer, x.reshape(-1, x.shape[-1]), bias)
        return y.reshape(*x.shape[:-1], y.shape[-1])
