"""Time kernels/cpu_gguf.py against dequantize + F.linear in fp32 (what loading GGUF dense costs
per call if the dequantization is not hoisted) and against F.linear on the dense fp32 weight.

    python -m kernels.bench_cpu_gguf [--out 576] [--in 1536] [--rows 1 8 64]

Random blocks with small finite scales stand in for a real file: the kernels' cost does not
depend on the values. Prints the best of 30 calls in milliseconds.
"""
from __future__ import annotations

import argparse
import time

import numpy as np
import torch
import torch.nn.functional as F

from kernels import cpu_gguf
from kernels.torch_gguf import BLOCK_LAYOUTS, Q4_K, Q8_0, TYPE_NAMES, dequantize


def random_blocks(qtype: int, rows: int, cols: int, seed: int = 0) -> torch.Tensor:
    """uint8 [rows, row_bytes]: random bytes, every fp16 scale field set to a small finite value."""
    rng = np.random.default_rng(seed)
    elems, nbytes = BLOCK_LAYOUTS[qtype]
    b = rng.integers(0, 256, (rows, cols // elems, nbytes), dtype=np.uint8)
    scale_at = {Q8_0: (0, 1), Q4_K: (0, 2)}.get(qtype, (208, 1) if nbytes == 210 else (0, 2 if elems == 256 else 1))
    start, count = scale_at
    scales = rng.uniform(-0.02, 0.02, (rows, cols // elems, count)).astype(np.float16).view(np.uint8)
    b[..., start:start + 2 * count] = scales
    return torch.from_numpy(b.reshape(rows, -1))


def _best_ms(fn, repeats: int = 30) -> float:
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return 1e3 * min(times)  # the best run: this box is shared, the median measures the neighbours


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=int, default=576)
    parser.add_argument("--in", dest="in_features", type=int, default=1536)
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 8, 64])
    args = parser.parse_args()
    print(f"W [{args.out}, {args.in_features}], torch threads {torch.get_num_threads()}, "
          f"C library {'built' if cpu_gguf.available() else 'MISSING (torch fallback)'}")
    print(f"{'type':5} {'rows':>5} {'cpu_gguf':>10} {'deq+linear':>11} {'dense fp32':>11}  (ms)")
    for qtype in (Q8_0, Q4_K):
        w = random_blocks(qtype, args.out, args.in_features)
        dense = dequantize(w, qtype)
        for n in args.rows:
            x = torch.randn(n, args.in_features)
            ours = _best_ms(lambda: cpu_gguf.gguf_linear_cpu(x, w, qtype))
            deq = _best_ms(lambda: F.linear(x, dequantize(w, qtype)))
            base = _best_ms(lambda: F.linear(x, dense))
            print(f"{TYPE_NAMES[qtype]:5} {n:5d} {ours:10.3f} {deq:11.3f} {base:11.3f}")


if __name__ == "__main__":
    main()
