"""Time kernels/cpu_gguf.py against dequantize + F.linear in fp32 (what loading GGUF dense costs
per call if the dequantization is not hoisted) and against F.linear on the dense fp32 weight.

    python -m loadtest.cpu_gguf_bench [--out-features 576] [--in 1536] [--rows 1 8 64]
        [--types Q8_0 Q4_1 ...] [--repeats 30] [--out bench_out/cpu_gguf_bench.json]

Random blocks with small finite scales stand in for a real file: the kernels' cost does not
depend on the values. Each case is checked against dequantize + F.linear before it is timed.
Times are the best of --repeats calls in milliseconds (the box is shared: the median measures
the neighbours); `rows` is the row count of x (decode is 1, a batch of 64 requests 64).
"""
from __future__ import annotations

import argparse
import sys
import time

import numpy as np
import torch
import torch.nn.functional as F

from kernels import cpu_gguf
from kernels.torch_gguf import BLOCK_LAYOUTS, Q4_0, Q4_1, Q4_K, Q5_0, Q5_1, Q5_K, Q6_K, Q8_0, TYPE_NAMES, dequantize
from loadtest.report import base_metadata, format_table, write_json

# Where each type keeps its fp16 scale fields (d, and m / dmin where it has one): (byte offset, count).
_FP16_FIELDS = {Q8_0: (0, 1), Q4_0: (0, 1), Q4_1: (0, 2), Q5_0: (0, 1), Q5_1: (0, 2), Q4_K: (0, 2),
                Q5_K: (0, 2), Q6_K: (208, 1)}
_TYPE_IDS = {name: qtype for qtype, name in TYPE_NAMES.items()}
# A relative error above this means the kernel computed something else than the dequantized matmul.
_MAX_REL_ERROR = 1e-4


def random_blocks(qtype: int, rows: int, cols: int, seed: int = 0) -> torch.Tensor:
    """uint8 [rows, row_bytes]: random bytes, every fp16 scale field set to a small finite value."""
    rng = np.random.default_rng(seed)
    elems, nbytes = BLOCK_LAYOUTS[qtype]
    b = rng.integers(0, 256, (rows, cols // elems, nbytes), dtype=np.uint8)
    start, count = _FP16_FIELDS[qtype]
    scales = rng.uniform(-0.02, 0.02, (rows, cols // elems, count)).astype(np.float16).view(np.uint8)
    b[..., start:start + 2 * count] = scales
    return torch.from_numpy(b.reshape(rows, -1))


def _best_ms(fn, repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return 1e3 * min(times)


def _check(ours: torch.Tensor, expected: torch.Tensor, case: str) -> None:
    error = (ours - expected).abs().max().item() / max(expected.abs().max().item(), 1e-30)
    if error > _MAX_REL_ERROR:
        raise RuntimeError(f"{case}: cpu_gguf differs from dequantize + F.linear by {error:.2e} (relative)")


def type_rows(qtype: int, out_features: int, in_features: int, rows: list[int], repeats: int) -> list[dict]:
    w = random_blocks(qtype, out_features, in_features)
    dense = dequantize(w, qtype)
    results = []
    for n in rows:
        x = torch.randn(n, in_features, generator=torch.Generator().manual_seed(n))
        case = f"{TYPE_NAMES[qtype]}, {n} rows"
        _check(cpu_gguf.gguf_linear_cpu(x, w, qtype), F.linear(x, dense), case)
        results.append({"type": TYPE_NAMES[qtype], "rows": n,
                        "cpu_gguf_ms": _best_ms(lambda: cpu_gguf.gguf_linear_cpu(x, w, qtype), repeats),
                        "deq_linear_ms": _best_ms(lambda: F.linear(x, dequantize(w, qtype)), repeats),
                        "dense_ms": _best_ms(lambda: F.linear(x, dense), repeats)})
    return results


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(prog="python -m loadtest.cpu_gguf_bench", description=__doc__.splitlines()[0])
    ap.add_argument("--out-features", type=int, default=576)
    ap.add_argument("--in", dest="in_features", type=int, default=1536, help="a multiple of 256 for the K-quants")
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 8, 64])
    ap.add_argument("--types", nargs="+", choices=list(_TYPE_IDS), default=list(_TYPE_IDS))
    ap.add_argument("--repeats", type=int, default=30, help="timed calls per case (default 30)")
    ap.add_argument("--out", default="bench_out/cpu_gguf_bench.json")
    args = ap.parse_args(argv)
    if args.repeats < 1:
        ap.error(f"--repeats must be at least 1, got {args.repeats}")
    for name in args.types:
        if args.in_features % BLOCK_LAYOUTS[_TYPE_IDS[name]][0]:
            ap.error(f"--in {args.in_features} is not a multiple of {name}'s block of "
                     f"{BLOCK_LAYOUTS[_TYPE_IDS[name]][0]}")
    with torch.inference_mode():
        rows = [r for name in args.types
                for r in type_rows(_TYPE_IDS[name], args.out_features, args.in_features, args.rows, args.repeats)]
    report = {**base_metadata(sys.argv if argv is None else ["cpu_gguf_bench", *argv]),
              "torch_threads": torch.get_num_threads(), "c_library": cpu_gguf.available(),
              "shape": [args.out_features, args.in_features], "repeats": args.repeats, "rows": rows}
    print(f"wrote {write_json(args.out, report)}")
    print(f"W [{args.out_features}, {args.in_features}], C library "
          f"{'built' if cpu_gguf.available() else 'MISSING (torch fallback)'}")
    print(format_table(["type", "rows", "cpu_gguf ms", "deq+linear ms", "dense fp32 ms"],
                       [[r["type"], r["rows"], r["cpu_gguf_ms"], r["deq_linear_ms"], r["dense_ms"]] for r in rows]))
    return report


if __name__ == "__main__":
    main()
