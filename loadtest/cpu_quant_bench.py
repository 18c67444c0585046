"""CPU quantized linear layers against the engine's fp32 oneDNN linear, interleaved in one run.

    python -m loadtest.cpu_quant_bench [--shapes 512x1024,2048x2048] [--rows 1,8,64,256]
        [--variants ...] [--repeats 15] [--threads 2] [--stream [--cache-mib 32]]
        [--stat median|best] [--out bench_out/cpu_quant_bench.json]

Each variant is a real layer, built as the model runner builds it: a `RowParallelLinear` under
`quantized_build()`, given its quant method, every checkpoint tensor through its parameter's
`weight_loader`, then `process_weights_after_loading()` (and, for the dense ones, the runner's oneDNN
packing); the figure is `layer(x)`. Shapes are `INxOUT` features: by default the bench model's four
linears (loadtest.cpu_kernel_bench) and 2048x2048. Activations are fp32, as in an fp32 engine,
except for bf16 oneDNN, which gets bf16 ones (a bf16 engine's).

Before it is timed, each variant's output is checked against x @ W.T in float64 on the weight it
holds, dequantized (its `tolerance`: max |y - ref| / max |ref|); a miss stops the run. Then every
variant of a (shape, rows) case is timed once per repeat, round robin (the order rotated each
repeat), after one warm-up call each. `--stream` builds enough copies of each layer that one pass
over them reads twice the last-level cache, and times whole passes (reported per layer): decode
reads a model's weights from memory, not from cache. Ratios are fp32 oneDNN's time over the
variant's (above 1: faster than the peer); absolute times vary with the box.
"""
from __future__ import annotations

import argparse
import contextlib
import math
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
from torch import nn

from engine.layers.cpu_gemm import pack_module_weight
from engine.layers.linear import RowParallelLinear
from engine.layers.quantization import UnquantizedLinearMethod, quantized_build
from engine.layers.quantization.awq import AWQ_ORDER, AWQConfig
from engine.layers.quantization.fp8 import FP8_DTYPE, FP8_MAX, MIN_SCALE, Fp8LinearMethod, Fp8Scheme
from engine.layers.quantization.gguf import GGUFBlocks, GGUFConfig
from engine.layers.quantization.int8 import (Int8Config, Int8W8A8LinearMethod, quantize_per_channel,
                                             w8a8_linear_torch)
from kernels import cpu_fp8, cpu_gguf, cpu_int4, cpu_int8
from kernels.torch_gguf import BLOCK_LAYOUTS, Q4_K, Q8_0, dequantize
from loadtest.cpu_gguf_bench import random_blocks
from loadtest.cpu_kernel_bench import LAYER_SHAPES
from loadtest.report import base_metadata, format_table, write_json

DEFAULT_SHAPES = [*LAYER_SHAPES, (2048, 2048)]  # (in, out)
DEFAULT_ROWS = (1, 8, 64, 256)
PEER = "fp32 oneDNN"
GROUP = 128  # AWQ's group of inputs
# --stream: one pass over a variant's copies reads this many times the last-level cache.
STREAM_FACTOR = 2


class Unsupported(Exception):
    """A variant that cannot take a shape (a GGUF or int4 block that does not divide it)."""


@dataclass(frozen=True)
class Variant:
    # dense fp32 W [out, in] -> (a function building one layer from the checkpoint tensors made
    # once here, the weight that layer holds, dequantized to fp32); Unsupported for a shape it cannot take
    make: Callable[[torch.Tensor], tuple[Callable[[], nn.Module], torch.Tensor]]
    tolerance: float  # max |y - ref| / max |ref| allowed, and why
    why: str
    act_dtype: torch.dtype = torch.float32


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype):
    prev = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(prev)


def _layer(method_for: Callable[[nn.Module], object], shape: tuple[int, int], tensors: dict,
           dtype: torch.dtype = torch.float32) -> RowParallelLinear:
    """RowParallelLinear(in, out) as the runner builds a quantized model (no process group: rank 0
    of 1); `tensors` are checkpoint tensors by parameter name, each through its weight_loader."""
    out_features, in_features = shape
    with _default_dtype(dtype):
        with quantized_build():
            layer = RowParallelLinear(in_features, out_features)
        layer.set_quant_method(method_for(layer))
    for name, t in tensors.items():
        param = getattr(layer, name)
        param.weight_loader(param, t)
    layer.process_weights_after_loading()
    return layer


def _dense(dtype: torch.dtype, packed: bool):
    def make(w):
        def build():
            layer = _layer(lambda _: UnquantizedLinearMethod(), w.shape, {"weight": w}, dtype)
            if packed:  # the runner's step after loading; False (kept dense): no oneDNN, or no native bf16
                pack_module_weight(layer)
            return layer
        return build, w.to(dtype).float()
    return make


def _fp8(w):
    scale = (w.abs().amax(1, keepdim=True) / FP8_MAX).clamp(min=MIN_SCALE)  # per output row
    q = (w / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    build = lambda: _layer(lambda _: Fp8LinearMethod(Fp8Scheme("channel")), w.shape,  # noqa: E731
                           {"weight": q, "weight_scale": scale})
    return build, q.float() * scale


def _int8_w8a16(w):  # quantization="int8": the dense weight loaded, quantized per channel at load
    q, scale = quantize_per_channel(w, round_scale_to=torch.bfloat16)  # what the method computes
    build = lambda: _layer(lambda layer: Int8Config().get_linear_method(layer, "bench"), w.shape,  # noqa: E731
                           {"weight": w})
    return build, q.float() * scale[:, None]


class TorchInt8W8A8(Int8W8A8LinearMethod):
    """W8A8 on its torch path (activations quantized by torch ops, `_int_mm`) where the VNNI kernel
    would run: that kernel's baseline."""

    def choose_matmul(self, layer: nn.Module):
        return w8a8_linear_torch


class VnniInt8W8A8(Int8W8A8LinearMethod):
    """The C kernel held to AVX-512 VNNI at every row count (what a CPU without AMX runs): the
    AMX tiles' baseline."""

    def choose_matmul(self, layer: nn.Module):
        if super().choose_matmul(layer) is w8a8_linear_torch:
            return w8a8_linear_torch
        return lambda layer, x, input_scale: cpu_int8.int8_linear_cpu(x, layer.vnni, input_scale, isa="vnni")


def _int8_w8a8(method: type[Int8W8A8LinearMethod]):
    """compressed-tensors' int8 channel-wise, dynamic per-token activations, through `method`."""
    def make(w):
        if method is not TorchInt8W8A8 and not cpu_int8.available():
            raise Unsupported("no AVX-512 VNNI here (or no C compiler): the layer would take the torch path")
        if method is Int8W8A8LinearMethod and not cpu_int8.amx_available():
            raise Unsupported("no AMX here: the layer runs VNNI, the variant before it")
        q, scale = quantize_per_channel(w)
        build = lambda: _layer(lambda _: method("channel", static_input_scale=False),  # noqa: E731
                               w.shape, {"weight": q, "weight_scale": scale[:, None]})
        return build, q.float() * scale[:, None]
    return make


def _awq(w):
    out_features, in_features = w.shape
    if in_features % GROUP or out_features % 8:
        raise Unsupported(f"AWQ g{GROUP} needs in % {GROUP} == 0 and out % 8 == 0")
    # Asymmetric min/max per group of GROUP inputs: [G, GROUP, N].
    wg = w.T.reshape(in_features // GROUP, GROUP, out_features)
    lo, hi = wg.amin(1), wg.amax(1)
    scales = ((hi - lo) / 15).clamp(min=1e-6).half()
    zeros = torch.round(-lo / scales.float()).clamp(0, 15)
    codes = torch.round(wg / scales.float()[:, None] + zeros[:, None]).clamp(0, 15)
    dequantized = ((codes - zeros[:, None]) * scales.float()[:, None]).reshape(in_features, out_features).T
    tensors = {"qweight": _awq_pack(codes.reshape(in_features, out_features)), "qzeros": _awq_pack(zeros),
               "scales": scales}
    config = AWQConfig.from_config({"quant_method": "awq", "bits": 4, "group_size": GROUP, "zero_point": True,
                                    "version": "gemm"})
    build = lambda: _layer(lambda layer: config.get_linear_method(layer, "bench"), w.shape, tensors)  # noqa: E731
    return build, dequantized.contiguous()


def _awq_pack(codes: torch.Tensor) -> torch.Tensor:
    """[R, C] codes 0..15 -> [R, C / 8] int32, AutoAWQ's order: nibble i of word j holds column
    8j + AWQ_ORDER[i]."""
    c = codes.long().reshape(codes.shape[0], -1, 8)
    words = sum(c[:, :, o] << (4 * i) for i, o in enumerate(AWQ_ORDER))
    return torch.where(words >= 1 << 31, words - (1 << 32), words).to(torch.int32)


def _gguf(qtype: int):
    def make(w):
        elems = BLOCK_LAYOUTS[qtype][0]
        if w.shape[1] % elems:
            raise Unsupported(f"in {w.shape[1]} is not a multiple of the block of {elems}")
        # Random blocks with small scales (loadtest.cpu_gguf_bench): the kernels' cost is the same.
        blocks = random_blocks(qtype, *w.shape)
        build = lambda: _layer(lambda layer: GGUFConfig().get_linear_method(layer, "bench"), w.shape,  # noqa: E731
                               {"weight": GGUFBlocks(blocks, qtype)})
        return build, dequantize(blocks, qtype)
    return make


VARIANTS = {
    PEER: Variant(_dense(torch.float32, True), 1e-4, "fp32, summed in another order"),
    "fp32 F.linear": Variant(_dense(torch.float32, False), 1e-4, "fp32, summed in another order"),
    "bf16 oneDNN": Variant(_dense(torch.bfloat16, True), 1e-2, "bf16 output (8-bit mantissa)",
                           torch.bfloat16),
    "FP8 W8A16": Variant(_fp8, 1e-4, "fp32 math on the dequantized FP8 weight"),
    "int8 W8A16": Variant(_int8_w8a16, 1e-2, "activations and output rounded to bf16"),
    "int8 W8A8": Variant(_int8_w8a8(TorchInt8W8A8), 5e-2, "activations quantized to int8 per token"),
    "int8 W8A8 VNNI": Variant(_int8_w8a8(VnniInt8W8A8), 5e-2, "activations quantized to int8 per token"),
    "int8 W8A8 AMX": Variant(_int8_w8a8(Int8W8A8LinearMethod), 5e-2,
                             "activations quantized to int8 per token (AMX from 8 rows, VNNI below)"),
    "int4 AWQ g128": Variant(_awq, 1e-4, "fp32 math on the dequantized int4 weight"),
    "GGUF Q4_K": Variant(_gguf(Q4_K), 1e-4, "fp32 math on the dequantized blocks"),
    "GGUF Q8_0": Variant(_gguf(Q8_0), 1e-4, "fp32 math on the dequantized blocks"),
}


def weight_bytes(layer: nn.Module) -> int:
    """Bytes the layer keeps for its weight: parameters but the bias, buffers, oneDNN's packed copy."""
    tensors = [p for name, p in layer.named_parameters(recurse=False) if name != "bias"]
    tensors += list(layer.buffers(recurse=False))
    if layer.packed_weight is not None:
        tensors.append(layer.packed_weight)
    return sum(t.numel() * t.element_size() for t in tensors)


def engine_path(layer: nn.Module) -> str:
    """Which arithmetic the layer chose (a C kernel or a torch fallback), for the JSON."""
    if layer.packed_weight is not None:
        return "oneDNN packed"
    method = layer.quant_method
    # fp8's, int4's, int8 W8A8's choice
    compute = getattr(method, "compute", None) or getattr(method, "gemm", None) or getattr(method, "matmul", None)
    return getattr(compute, "__name__", type(compute).__name__) if compute is not None else type(method).__name__


def last_level_cache_bytes() -> int | None:
    """The largest CPU cache's size from sysfs (Linux), or None."""
    sizes = []
    for f in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*/size"):
        text = f.read_text().strip().upper()
        scale = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:], 1)
        sizes.append(int(text.rstrip("KMG")) * scale)
    return max(sizes, default=None)


def _check(name: str, case: str, y: torch.Tensor, ref: torch.Tensor, tolerance: float) -> float:
    error = (y.double() - ref).abs().max().item() / max(ref.abs().max().item(), 1e-30)
    if not error <= tolerance:
        raise RuntimeError(f"{name}, {case}: output differs from x @ W.T on its dequantized weight by "
                           f"{error:.2e} (relative), above its tolerance {tolerance:.0e}")
    return error


def _time_round_robin(fns: dict[str, Callable], repeats: int) -> dict[str, list[float]]:
    """Seconds per call of each fn: one warm-up call each, then each once per repeat, in turn."""
    for fn in fns.values():
        fn()
    names, times = list(fns), {name: [] for name in fns}
    for r in range(repeats):
        for name in names[r % len(names):] + names[:r % len(names)]:
            start = time.perf_counter()
            fns[name]()
            times[name].append(time.perf_counter() - start)
    return times


def shape_rows(shape: tuple[int, int], rows: list[int], names: list[str], args, gen) -> list[dict]:
    """Every (variant, rows) result for one (in, out) shape."""
    in_features, out_features = shape
    w = torch.randn(out_features, in_features, generator=gen) * in_features ** -0.5
    built, results = {}, []
    for name in names:
        try:
            build, dequantized = VARIANTS[name].make(w)
        except Unsupported as e:
            results += [{"shape": list(shape), "rows": n, "variant": name, "skipped": str(e)} for n in rows]
            continue
        layers = [build()]
        if args.stream:
            target = STREAM_FACTOR * args.cache_bytes
            layers += [build() for _ in range(math.ceil(target / weight_bytes(layers[0])) - 1)]
        built[name] = (layers, dequantized.double())
    for n in rows:
        x = torch.randn(n, in_features, generator=gen)
        case, fns, meta = f"{in_features}x{out_features}, {n} rows", {}, {}
        for name, (layers, dequantized) in built.items():
            v = VARIANTS[name]
            xv = x.to(v.act_dtype)
            error = _check(name, case, layers[0](xv), xv.double() @ dequantized.T, v.tolerance)
            fns[name] = lambda layers=layers, xv=xv: [layer(xv) for layer in layers]
            meta[name] = {"shape": list(shape), "rows": n, "variant": name, "copies": len(layers),
                          "bytes_per_weight": weight_bytes(layers[0]) / (in_features * out_features),
                          "path": engine_path(layers[0]), "max_rel_error": error, "tolerance": v.tolerance}
        for name, t in _time_round_robin(fns, args.repeats).items():
            per_layer = [1e3 * s / meta[name]["copies"] for s in t]
            meta[name].update(best_ms=min(per_layer), median_ms=statistics.median(per_layer))
        for m in meta.values():
            peer = meta[PEER]
            m.update(ratio_best=peer["best_ms"] / m["best_ms"], ratio_median=peer["median_ms"] / m["median_ms"])
        results += [meta[name] for name in names if name in meta]
    return results


def table(results: list[dict], names: list[str], stat: str) -> str:
    """One row per (shape, rows): `ratio (ms)` per variant; a `B/w` row per shape: bytes per weight."""
    cells: dict[tuple, dict] = {}
    for r in results:
        cells.setdefault((tuple(r["shape"]), r["rows"]), {})[r["variant"]] = r
    lines, last_shape = [], None
    for (shape, n), by_name in cells.items():
        if shape != last_shape:
            lines.append([f"{shape[0]}x{shape[1]}", "B/w"] + [
                f"{by_name[v]['bytes_per_weight']:.3g}" if "skipped" not in by_name[v] else "n/a" for v in names])
            last_shape = shape
        lines.append(["", n] + [f"{by_name[v][f'ratio_{stat}']:.2f} ({by_name[v][f'{stat}_ms']:.3g})"
                                if "skipped" not in by_name[v] else "n/a" for v in names])
    return format_table(["in x out", "rows", *names], lines)


def _int_list(text: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",")]
    except ValueError:
        values = []
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected positive integers separated by commas, got {text!r}")
    return values


def _shape_list(text: str) -> list[tuple[int, int]]:
    try:
        shapes = [tuple(int(v) for v in s.split("x")) for s in text.split(",")]
    except ValueError:
        shapes = []
    if not shapes or any(len(s) != 2 or min(s) < 1 for s in shapes):
        raise argparse.ArgumentTypeError(f"expected INxOUT shapes separated by commas, got {text!r}")
    return shapes


def _variant_list(text: str) -> list[str]:
    names = [v.strip() for v in text.split(",")]
    unknown = [v for v in names if v not in VARIANTS]
    if unknown:
        raise argparse.ArgumentTypeError(f"unknown variant(s) {unknown}; known: {', '.join(VARIANTS)}")
    return [PEER] + [v for v in names if v != PEER]  # the peer is always measured


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m loadtest.cpu_quant_bench", description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", type=_shape_list, default=DEFAULT_SHAPES, help="INxOUT,... features")
    ap.add_argument("--rows", type=_int_list, default=list(DEFAULT_ROWS), help="rows of x, e.g. 1,8,64,256")
    ap.add_argument("--variants", type=_variant_list, default=list(VARIANTS), help="comma-separated names")
    ap.add_argument("--repeats", type=int, default=15, help="timed rounds per case (default 15)")
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    ap.add_argument("--stream", action="store_true", help="copies of each layer past the last-level cache")
    ap.add_argument("--cache-mib", type=float, default=None, help="--stream's cache size (default: sysfs)")
    ap.add_argument("--stat", choices=("median", "best"), default="median", help="the table's figure")
    ap.add_argument("--out", default="bench_out/cpu_quant_bench.json")
    args = ap.parse_args(argv)
    if args.repeats < 1:
        ap.error(f"--repeats must be at least 1, got {args.repeats}")
    if args.threads is not None and args.threads < 1:
        ap.error(f"--threads must be at least 1, got {args.threads}")
    if args.cache_mib is not None and args.cache_mib <= 0:
        ap.error(f"--cache-mib must be positive, got {args.cache_mib}")
    args.cache_bytes = int(args.cache_mib * (1 << 20)) if args.cache_mib is not None else last_level_cache_bytes()
    if args.stream and not args.cache_bytes:
        ap.error("--stream: sysfs names no CPU cache here; give its size with --cache-mib")
    return args


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    gen = torch.Generator().manual_seed(0)
    with torch.inference_mode():
        results = [r for shape in args.shapes for r in shape_rows(shape, args.rows, args.variants, args, gen)]
    kernels = {"cpu_fp8": cpu_fp8.available(), "cpu_int4": cpu_int4.available(), "cpu_gguf": cpu_gguf.available(),
               "cpu_int8_vnni": cpu_int8.available(), "cpu_int8_amx": cpu_int8.amx_available(),
               "onednn_bf16": bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())}
    report = {**base_metadata(sys.argv if argv is None else ["cpu_quant_bench", *argv]),
              "torch_threads": torch.get_num_threads(), "repeats": args.repeats, "stream": args.stream,
              "cache_bytes": args.cache_bytes, "peer": PEER, "c_kernels": kernels,
              "tolerances": {n: f"{VARIANTS[n].tolerance:.0e}: {VARIANTS[n].why}" for n in args.variants},
              "rows": results}
    print(f"wrote {write_json(args.out, report)}")
    print(f"{torch.get_num_threads()} threads, C kernels {kernels}"
          + (f", --stream: each pass reads >= {STREAM_FACTOR} x {args.cache_bytes / (1 << 20):.3g} MiB" if args.stream
             else ""))
    print(f"cells: {PEER} {args.stat} ms / variant's (above 1: faster), ({args.stat} ms per layer call); "
          "B/w: bytes per weight held")
    print(table(results, args.variants, args.stat))
    return report


if __name__ == "__main__":
    main()
