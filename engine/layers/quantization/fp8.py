"""FP8 (e4m3) linear weights that stay FP8 in memory: HF / vLLM `quant_method: "fp8"` checkpoints,
and the online method (`quantization="fp8"` on an unquantized checkpoint) that quantizes at load.

Each quantized layer holds `weight` float8_e4m3fn [out, in] and its scales:

    tensor   weight_scale [num_parts] (one per fused part: q/k/v, gate/up), input_scale [num_parts]
             when activations are static
    channel  weight_scale [out, 1]  (compressed-tensors' channel strategy)
    block    weight_scale_inv [ceil(out / bn), ceil(in / bk)]  (`weight_block_size`, DeepSeek-V3's layout;
             compressed-tensors names it weight_scale)

How a layer computes is chosen once, when it creates its weights, by its device (`choose_compute`):
on CUDA with FP8 math (sm >= 8.9), W8A8: torch._scaled_mm, or the Triton block GEMM
(kernels/triton_fp8_gemm.py), the activations quantized as the checkpoint says. Elsewhere,
weight-only, the activations left as they are, as vLLM's Marlin W8A16 fallback does on GPUs without
FP8 math: the exact product of the checkpoint's dequantized weights. On CPU that is the C kernel
(kernels/cpu_fp8.c: FP8 converted in registers, faster than dense fp32 at decode since it reads a
quarter of the bytes); without it, or on GPUs, tiles of FP8 rows dequantized by torch inside the matmul.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from engine.layers.quantization.base import LinearMethodBase, QuantizationConfig, new_param
from kernels import cpu_fp8

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8_DTYPE).max  # 448
MIN_SCALE = 1e-12  # an all-zero tensor's scale (x / 0 would be NaN)
# Weight-only: rows dequantized per tile, ~1 MiB of fp32 each, so no layer is ever dense in memory.
TILE_ELEMS = 1 << 18
# CpuFp8Kernel: the fused kernel up to this many rows, C-dequantized tiles + torch's GEMM above,
# where GEMM blocking outweighs converting each tile once (loadtest.cpu_quant_bench).
FUSED_MAX_ROWS = 256

# What HF's and vLLM's fp8 configs hold (`fmt` and `dequantize` are HF's; ignored_layers is vLLM's
# spelling of the ignore list, modules_to_not_convert HF's).
_KEYS = ("quant_method", "activation_scheme", "weight_block_size", "ignored_layers", "modules_to_not_convert",
         "fmt", "dequantize")


@dataclass(frozen=True)
class Fp8Scheme:
    strategy: str                          # the weight scales: "tensor", "channel" or "block"
    static_input: bool = False             # activations quantized with the checkpoint's per-tensor input_scale
    block: tuple[int, int] | None = None   # (bn, bk) for "block"
    scale_name: str = "weight_scale"       # "weight_scale_inv" in HF's block checkpoints

    def __post_init__(self):
        if self.strategy not in ("tensor", "channel", "block"):
            raise ValueError(f"fp8 weight strategy {self.strategy!r} is not supported (tensor, channel, block)")
        if (self.strategy == "block") != (self.block is not None):
            raise ValueError(f"fp8 strategy {self.strategy!r} with block {self.block!r}: a block size goes with "
                             "strategy 'block' only")
        if self.block is not None and self.static_input:
            raise ValueError("fp8 block-wise weights with static activation scales are not supported "
                             "(block-wise activations are quantized per token group, dynamically)")


class Fp8Config(QuantizationConfig):
    name = "fp8"

    def __init__(self, scheme: Fp8Scheme | None, ignored: list[str] | None = None):
        super().__init__(ignored)
        self.scheme = scheme  # None: online, the checkpoint is full precision

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> "Fp8Config":
        if not config:  # quantization="fp8" asked for on an unquantized checkpoint
            return cls(None)
        extra = sorted(set(config) - set(_KEYS))
        if extra:
            raise ValueError(f"quantization_config keys {extra} are not supported for quant_method='fp8'")
        if config.get("fmt", "e4m3") != "e4m3":
            raise ValueError(f"fp8 fmt={config['fmt']!r} is not supported (only e4m3)")
        scheme = config.get("activation_scheme", "dynamic")
        if scheme not in ("dynamic", "static"):
            raise ValueError(f"fp8 activation_scheme={scheme!r} is not supported (dynamic, static)")
        block = config.get("weight_block_size")
        if block is not None:
            if not (isinstance(block, (list, tuple)) and len(block) == 2
                    and all(isinstance(v, int) and v > 0 for v in block)):
                raise ValueError(f"fp8 weight_block_size={block!r} is invalid: expected [bn, bk] positive ints")
            block = (block[0], block[1])
        ignored = list(config.get("ignored_layers") or []) + list(config.get("modules_to_not_convert") or [])
        return cls(Fp8Scheme("block" if block else "tensor", static_input=scheme == "static", block=block,
                             scale_name="weight_scale_inv" if block else "weight_scale"), ignored)

    def get_linear_method(self, layer: nn.Module, prefix: str) -> LinearMethodBase:
        return Fp8OnlineLinearMethod() if self.scheme is None else Fp8LinearMethod(self.scheme)


class Fp8LinearMethod(LinearMethodBase):
    """A checkpoint's FP8 weight and scales (`scheme`), kept FP8."""

    def __init__(self, scheme: Fp8Scheme):
        self.scheme = scheme
        self.compute = None  # set in create_weights, by the device the layer lives on

    def create_weights(self, layer: nn.Module) -> None:
        s, out, inp = self.scheme, layer.output_size, layer.input_size
        layer.register_parameter("weight", new_param((out, inp), FP8_DTYPE, output_dim=0, input_dim=1))
        if s.strategy == "tensor":
            scale = new_param((len(part_sizes(layer)),), torch.float32, per_shard=True)
        elif s.strategy == "channel":
            scale = new_param((out, 1), torch.float32, output_dim=0)
        else:
            bn, bk = s.block
            scale = new_param((-(-out // bn), -(-inp // bk)), torch.float32, output_dim=0, input_dim=1,
                              output_block=(bn, 1), input_block=(bk, 1))
        layer.register_parameter(s.scale_name, scale)
        if s.static_input:
            layer.register_parameter("input_scale", new_param((len(part_sizes(layer)),), torch.float32,
                                                              per_shard=True))
        self.compute = choose_compute(s.block, torch.empty(0).device, inp, out)

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        scale = getattr(layer, self.scheme.scale_name)
        if self.scheme.static_input:  # one scale for the fused matmul's input: the parts' max (vLLM's rule)
            layer.input_scale.data = layer.input_scale.data.max().reshape(1)
        if self.scheme.strategy == "tensor":
            scale.data = self.compute.fuse_part_scales(layer.weight.data, scale.data, part_sizes(layer))

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        input_scale = layer.input_scale if self.scheme.static_input else None
        return self.compute(x, layer.weight, getattr(layer, self.scheme.scale_name), input_scale, bias)


class Fp8OnlineLinearMethod(LinearMethodBase):
    """A full-precision checkpoint's weight, quantized to FP8 with one per-tensor scale once it is loaded
    (dynamic activations on CUDA, as vLLM's online fp8); the full-precision copy is then freed."""

    def __init__(self):
        self.compute = None

    def create_weights(self, layer: nn.Module) -> None:
        layer.register_parameter("weight", new_param((layer.output_size, layer.input_size),
                                                     torch.get_default_dtype(), output_dim=0, input_dim=1))
        self.compute = choose_compute(None, torch.empty(0).device, layer.input_size, layer.output_size)

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        q, scale = quantize_per_tensor(layer.weight.data)
        # Replacing the parameter drops the last reference to the full-precision weight.
        layer.weight = nn.Parameter(q, requires_grad=False)
        layer.weight_scale = nn.Parameter(scale, requires_grad=False)

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return self.compute(x, layer.weight, layer.weight_scale, None, bias)


def part_sizes(layer: nn.Module) -> list[int]:
    """This rank's output rows of each fused part, in order ([output_size] for an unfused layer)."""
    if hasattr(layer, "q_size"):  # QKVParallelLinear
        return [layer.q_size, layer.kv_size, layer.kv_size]
    return list(getattr(layer, "shard_sizes", [layer.output_size]))


def quantize_per_tensor(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w -> (FP8 w / scale, scale [1] fp32), the scale bringing |w|'s max to FP8's 448."""
    scale = (w.abs().max().float() / FP8_MAX).clamp(min=MIN_SCALE).reshape(1)
    return (w.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE), scale


def quantize_per_token(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (FP8 [M, K], scale [M, 1] fp32): each row's max brought to 448."""
    scale = (x.abs().amax(-1, keepdim=True).float() / FP8_MAX).clamp(min=MIN_SCALE)
    return (x.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE), scale


def requantize_parts_to_max(w: torch.Tensor, scales: torch.Tensor, sizes: list[int]) -> torch.Tensor:
    """vLLM's rule for a fused layer's per-part scales: one matmul takes one scale, so each part's rows
    are requantized (in place) to the parts' max scale, which is returned as [1]. Lossy by at most half
    an FP8 step per element; exact where the scales agree."""
    max_scale = scales.max()
    if len(sizes) > 1 and not bool((scales == max_scale).all()):
        start = 0
        for s, size in zip(scales, sizes):
            part = w[start:start + size]
            part.copy_((part.float() * (s / max_scale)).to(FP8_DTYPE))
            start += size
    return max_scale.reshape(1)


class WeightOnlyTiles:
    """Anywhere: y = x @ dequant(w).T, `w` dequantized TILE_ELEMS at a time in fp32 (as a checkpoint's
    dequantized weight is), cast to x's dtype, multiplied; the activations are not quantized. The
    dequantization here is torch's (12-15 ns an element on CPU): CpuFp8Kernel replaces it where it can."""

    tile_elems = TILE_ELEMS

    def __init__(self, block: tuple[int, int] | None):
        self.block = block

    def fuse_part_scales(self, w: torch.Tensor, scales: torch.Tensor, sizes: list[int]) -> torch.Tensor:
        # Exact: the parts' scales become one per row ([out, 1]), where they differ.
        if bool((scales == scales[0]).all()):
            return scales[:1].clone()
        return torch.cat([s.expand(n) for s, n in zip(scales, sizes)]).reshape(-1, 1)

    def __call__(self, x, w, scale, input_scale, bias):
        out, k = w.shape
        rows = max(1, self.tile_elems // k)
        if self.block is not None:  # tiles start on block rows
            rows = max(self.block[0], rows // self.block[0] * self.block[0])
        if rows >= out:
            return nn.functional.linear(x, self._dequant(w, scale, 0, out).to(x.dtype), bias)
        y = torch.empty((*x.shape[:-1], out), dtype=x.dtype, device=x.device)
        for r0 in range(0, out, rows):
            r1 = min(out, r0 + rows)
            y[..., r0:r1] = x @ self._dequant(w, scale, r0, r1).to(x.dtype).T
        return y if bias is None else y + bias

    def _dequant(self, w, scale, r0: int, r1: int) -> torch.Tensor:
        return cpu_fp8.dequantize_reference(w, scale, self.block, r0, r1)


class CpuFp8Kernel(WeightOnlyTiles):
    """CPU with the C kernel (kernels/cpu_fp8.c). Up to FUSED_MAX_ROWS rows (decode), the fused
    kernel: FP8 converted in registers and dotted with every row, w read once at a quarter of fp32's
    bytes. More rows (prefill), the tiles above, dequantized by C and multiplied by torch's GEMM, whose
    blocking beats the fused loop once the conversion is spread over that many rows."""

    # 4 MiB fp32 tiles: MKL blocks larger tiles better at prefill row counts (loadtest.cpu_quant_bench).
    tile_elems = 1 << 20

    def __call__(self, x, w, scale, input_scale, bias):
        if x.numel() <= FUSED_MAX_ROWS * x.shape[-1]:
            return cpu_fp8.fp8_linear(x, w, scale, self.block, bias)
        return super().__call__(x, w, scale, input_scale, bias)

    def _dequant(self, w, scale, r0: int, r1: int) -> torch.Tensor:
        return cpu_fp8.dequantize_rows(w, scale, self.block, r0, r1)


class ScaledMM:
    """CUDA W8A8: the activations quantized per token (or with the static input_scale), then
    torch._scaled_mm with fp32 accumulation; the fused parts share one scale (`requantize_parts_to_max`)."""

    fuse_part_scales = staticmethod(requantize_parts_to_max)

    def __call__(self, x, w, scale, input_scale, bias):
        if input_scale is None:
            q, x_scale = quantize_per_token(x)
        else:
            q, x_scale = (x.float() / input_scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE), input_scale
        y = fp8_scaled_mm(q, x_scale, w, scale, x.dtype)
        return y if bias is None else y + bias


def fp8_scaled_mm(q, q_scale, w, w_scale, out_dtype: torch.dtype) -> torch.Tensor:
    """q [M, K] fp8 (scale [1] or [M, 1]) @ w [N, K] fp8 (scale [1] or [N, 1]) -> [M, N] out_dtype."""
    if q_scale.numel() == 1 and w_scale.numel() == 1:
        return torch._scaled_mm(q, w.T, scale_a=q_scale.reshape(()), scale_b=w_scale.reshape(()),
                                out_dtype=out_dtype)
    q_scale = q_scale.reshape(-1, 1).expand(q.shape[0], 1).contiguous()
    w_scale = w_scale.reshape(1, -1).expand(1, w.shape[0]).contiguous()
    if out_dtype == torch.bfloat16 or q.device.type != "cuda":  # CUDA's row-wise scaling writes bf16 only
        return torch._scaled_mm(q, w.T, scale_a=q_scale, scale_b=w_scale, out_dtype=out_dtype)
    one = torch.ones((), device=q.device)
    y = torch._scaled_mm(q, w.T, scale_a=one, scale_b=one, out_dtype=torch.float32)
    return (y * q_scale * w_scale).to(out_dtype)


class TritonBlock:
    """CUDA W8A8 block-wise: kernels/triton_fp8_gemm.py."""

    def __init__(self, block: tuple[int, int]):
        self.block = block

    def __call__(self, x, w, scale, input_scale, bias):
        from kernels.triton_fp8_gemm import fp8_block_linear  # triton only on this path

        return fp8_block_linear(x, w, scale, self.block, bias)


def choose_compute(block: tuple[int, int] | None, device: torch.device, input_size: int, output_size: int):
    """The layer's arithmetic, once: W8A8 where the GPU has FP8 math and the shape suits the kernel,
    weight-only elsewhere: through the C kernel on CPU where it builds, else torch's tiles."""
    fp8_math = device.type == "cuda" and torch.cuda.get_device_capability(device) >= (8, 9)
    if fp8_math and block is not None and block[1] >= 16 and block[1] & (block[1] - 1) == 0:
        return TritonBlock(block)
    if fp8_math and block is None and input_size % 16 == 0 and output_size % 16 == 0:  # _scaled_mm's rule
        return ScaledMM()
    if device.type == "cpu" and cpu_fp8.available():
        return CpuFp8Kernel(block)
    return WeightOnlyTiles(block)


__all__ = ["Fp8Config", "Fp8LinearMethod", "Fp8OnlineLinearMethod", "Fp8Scheme", "ScaledMM", "WeightOnlyTiles",
           "CpuFp8Kernel", "choose_compute", "fp8_scaled_mm", "quantize_per_tensor", "requantize_parts_to_max"]
