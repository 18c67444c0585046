"""The host KV tier's copy bandwidth: swap-out (device -> host) and swap-in (host -> device), GB/s.

    python -m loadtest.kv_offload_bench [--device cuda] [--num-blocks 512] [--layers 32] [--kv-heads 8]
                                        [--head-dim 128] [--block-size 16] [--dtype bfloat16] [--rounds 5]

Times `HostKVCache.swap` (engine/worker/host_kv_cache.py), the code the engine runs before a step,
on caches shaped like a model's (the defaults: Llama-3-8B's, 2 MiB per block of every layer), for
host blocks in one run (one copy per staging chunk) and scattered (one copy per block). On CUDA,
the figure to hold against the host link's limit (its PCIe generation and lanes); on CPU, a
memcpy between two host buffers. The fastest of `--rounds` counts.
"""
from __future__ import annotations

import argparse
import random
import time
from types import SimpleNamespace

import torch

from loadtest.measure import run_metadata
from loadtest.report import format_table, write_json


def make_cache(args):
    from engine.worker.host_kv_cache import HostKVCache

    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    shape = (args.num_blocks, args.block_size, args.kv_heads, args.head_dim)
    layers = [SimpleNamespace(k_cache=torch.zeros(shape, dtype=dtype, device=device),
                              v_cache=torch.zeros(shape, dtype=dtype, device=device)) for _ in range(args.layers)]
    return HostKVCache(layers, args.num_blocks, device)


def time_swap(cache, out, into, rounds: int) -> float:
    """Seconds of the fastest of `rounds` swaps, waited for to the end on CUDA."""
    best = float("inf")
    for _ in range(rounds):
        if cache.device.type == "cuda":
            torch.cuda.synchronize(cache.device)
        start = time.perf_counter()
        cache.swap(out, into)
        if cache.device.type == "cuda":
            torch.cuda.synchronize(cache.device)
        best = min(best, time.perf_counter() - start)
    return best


def measure(args) -> dict:
    cache = make_cache(args)
    n = args.num_blocks
    block_bytes = cache.block_bytes  # every layer's K and V of one block
    scattered = list(range(n))
    random.Random(0).shuffle(scattered)
    results = {}
    for layout, host_ids in (("one run", list(range(n))), ("scattered", scattered)):
        pairs = list(zip(range(n), host_ids))
        out_s = time_swap(cache, pairs, [], args.rounds)
        in_s = time_swap(cache, [], [(h, d) for d, h in pairs], args.rounds)
        results[layout] = {"swap_out_gb_per_s": n * block_bytes / out_s / 1e9,
                           "swap_in_gb_per_s": n * block_bytes / in_s / 1e9}
    return {"benchmark": "kv_offload_copy", **run_metadata([]), "device": args.device,
            "num_blocks": n, "bytes_per_block": block_bytes, "results": results}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", choices=("cpu", "cuda"))
    ap.add_argument("--num-blocks", type=int, default=512)
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--dtype", default="bfloat16", choices=("float32", "bfloat16", "float16"))
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--out", default="bench_out/kv_offload_bench.json")
    args = ap.parse_args(argv)
    for flag in ("num_blocks", "layers", "kv_heads", "head_dim", "block_size", "rounds"):
        if getattr(args, flag) < 1:
            ap.error(f"--{flag.replace('_', '-')}={getattr(args, flag)} must be >= 1")
    return args


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    report = measure(args)
    rows = [[layout, r["swap_out_gb_per_s"], r["swap_in_gb_per_s"]] for layout, r in report["results"].items()]
    print(format_table(["host blocks", "swap-out GB/s", "swap-in GB/s"], rows))
    print(f"{report['num_blocks']} blocks of {report['bytes_per_block'] / 2**20:.2f} MiB on {args.device}")
    write_json(args.out, report)
    return report


if __name__ == "__main__":
    main()
