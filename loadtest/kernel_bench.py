"""Kernel micro-benchmark: Triton paged attention / store_kv against the torch path.

    python -m loadtest.kernel_bench [--out bench_out/kernel_bench.json] [--dtype bf16]
                                    [--heads 32] [--kv-heads 8] [--head-dim 128]
                                    [--block-size 16] [--sweep]

Cases: decode 64 x ctx 1024, prefill 4 x 512, a mixed batch, a long-context
small-batch decode, and store_kv for both batch shapes. Times are medians of
triton.testing.do_bench (CUDA events). Achieved GB/s counts the bytes each
kernel must move at minimum (every context K/V byte read once, Q read, O
written); the reference line is a device-to-device copy's GB/s (read + write).
--sweep also times the attention cases for several launch knobs. Without CUDA
it prints that it needs CUDA and exits 0.
"""

import argparse
import json
import math
import os
import sys

import torch

DEVICE = "cuda"  # module-level so a CPU dry run can patch it
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def make_attention_case(q_lens, seq_lens, heads, kv_heads, head_dim, block_size, dtype, seed=0):
    """Paged batch on the GPU with shuffled block ids; returns (kwargs, host lists)."""
    gen = torch.Generator().manual_seed(seed)
    blocks = [math.ceil(n / block_size) for n in seq_lens]
    ids = torch.randperm(sum(blocks), generator=gen).to(torch.int32)
    table = torch.zeros(len(seq_lens), max(blocks), dtype=torch.int32)
    pos = 0
    for s, n in enumerate(blocks):
        table[s, :n] = ids[pos:pos + n]
        pos += n
    # [num_blocks, block_size, kv_heads, D]
    cache_shape = (sum(blocks), block_size, kv_heads, head_dim)
    cu = [0]
    for n in q_lens:
        cu.append(cu[-1] + n)
    dev = DEVICE
    kwargs = dict(
        query=torch.randn(cu[-1], heads, head_dim, device=dev, dtype=dtype),  # [tokens, heads, D]
        k_cache=torch.randn(cache_shape, device=dev, dtype=dtype),
        v_cache=torch.randn(cache_shape, device=dev, dtype=dtype),
        block_tables=table.to(dev),  # [num_seqs, max_blocks]
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=dev),
        cu_seqlens_q=torch.tensor(cu, dtype=torch.int32, device=dev),
        max_seqlen_q=max(q_lens),
        softmax_scale=1.0 / math.sqrt(head_dim),
    )
    return kwargs, dict(seq_lens_cpu=list(seq_lens), query_lens_cpu=list(q_lens))


def attention_bytes_flops(q_lens, seq_lens, heads, kv_heads, head_dim, elem):
    kv = sum(seq_lens) * kv_heads * head_dim * elem * 2
    qo = sum(q_lens) * heads * head_dim * elem * 2
    # Causal pairs: row i of a chunk of q attends to seq - q + i + 1 keys.
    pairs = sum(q * (s - q) + q * (q + 1) // 2 for q, s in zip(q_lens, seq_lens))
    return kv + qo, 4 * pairs * heads * head_dim


def bench_ms(fn):
    from triton.testing import do_bench
    return do_bench(fn, warmup=25, rep=200, return_mode="median")


def copy_gbps():
    src = torch.empty(256 * 2**20, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    ms = bench_ms(lambda: dst.copy_(src))
    return 2 * src.numel() / ms / 1e6


def run_attention_case(name, q_lens, seq_lens, args, dtype):
    from kernels import paged_attention
    from kernels.torch_attention import paged_attention_torch
    kwargs, host = make_attention_case(q_lens, seq_lens, args.heads, args.kv_heads,
                                       args.head_dim, args.block_size, dtype)
    out = torch.empty_like(kwargs["query"])
    tri = paged_attention(**kwargs, out=out).float()
    ref = paged_attention_torch(**kwargs, **host).float()
    max_err = (tri - ref).abs().max().item()
    nbytes, flops = attention_bytes_flops(q_lens, seq_lens, args.heads, args.kv_heads,
                                          args.head_dim, kwargs["query"].element_size())
    t_ms = bench_ms(lambda: paged_attention(**kwargs, out=out))
    torch_ms = bench_ms(lambda: paged_attention_torch(**kwargs, out=out, **host))
    return dict(case=name, kernel="paged_attention", triton_ms=t_ms, torch_ms=torch_ms,
                speedup=torch_ms / t_ms, bytes=nbytes, gbps=nbytes / t_ms / 1e6,
                tflops=flops / t_ms / 1e9, max_abs_diff_vs_torch=max_err)


def run_store_case(name, num_tokens, args, dtype):
    from kernels import store_kv
    from kernels.torch_attention import store_kv_torch
    blocks = math.ceil(4 * num_tokens / args.block_size)
    cache = torch.zeros(blocks, args.block_size, args.kv_heads, args.head_dim, dtype=dtype,
                        device=DEVICE)  # [num_blocks, block_size, kv_heads, D]
    cache2 = torch.zeros_like(cache)
    key = torch.randn(num_tokens, args.kv_heads, args.head_dim, dtype=dtype, device=DEVICE)
    value = torch.randn_like(key)
    slots = torch.randperm(blocks * args.block_size, device=DEVICE)[:num_tokens]
    nbytes = 4 * key.numel() * key.element_size()  # read K and V, write both
    t_ms = bench_ms(lambda: store_kv(key, value, cache, cache2, slots))
    torch_ms = bench_ms(lambda: store_kv_torch(key, value, cache, cache2, slots))
    return dict(case=name, kernel="store_kv", triton_ms=t_ms, torch_ms=torch_ms,
                speedup=torch_ms / t_ms, bytes=nbytes, gbps=nbytes / t_ms / 1e6)


ATTENTION_CASES = {
    "decode 64x1024": ([1] * 64, [1024] * 64),
    "prefill 4x512": ([512] * 4, [512] * 4),
    "mixed 32 dec x2048 + 2x256 chunk": ([1] * 32 + [256] * 2, [2048] * 32 + [1024] * 2),
    "decode 4x8192": ([1] * 4, [8192] * 4),
}
STORE_CASES = {"store_kv 64 tok": 64, "store_kv 2048 tok": 2048}


def sweep(args, dtype):
    """Re-time the attention cases for each launch-knob setting (for tuning)."""
    import kernels.triton_attention as ta
    saved = (ta.TILE_CAP, ta.NUM_STAGES)
    rows = []
    for tile_cap in (16, 32, 64):
        for stages in (1, 2, 3):
            ta.TILE_CAP, ta.NUM_STAGES = tile_cap, stages
            for name, (q_lens, seq_lens) in ATTENTION_CASES.items():
                row = run_attention_case(name, q_lens, seq_lens, args, dtype)
                rows.append(dict(row, tile_cap=tile_cap, num_stages=stages))
    ta.TILE_CAP, ta.NUM_STAGES = saved
    return rows


def format_rows(rows, copy_rate):
    head = (f"{'case':36s} {'triton ms':>10s} {'torch ms':>10s} {'speedup':>8s} "
            f"{'GB/s':>8s} {'%copy':>6s}")
    lines = [head, "-" * len(head)]
    for r in rows:
        lines.append(f"{r['case']:36s} {r['triton_ms']:10.4f} {r['torch_ms']:10.4f} "
                     f"{r['speedup']:8.2f} {r['gbps']:8.1f} {100 * r['gbps'] / copy_rate:6.1f}")
    return "\n".join(lines)


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="bench_out/kernel_bench.json")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--sweep", action="store_true", help="also time launch-knob variants")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    if not torch.cuda.is_available():
        print("kernel_bench needs CUDA (no GPU found); nothing to measure.")
        return 0
    dtype = DTYPES[args.dtype]
    copy_rate = copy_gbps()
    rows = [run_attention_case(name, q, s, args, dtype) for name, (q, s) in ATTENTION_CASES.items()]
    rows += [run_store_case(name, n, args, dtype) for name, n in STORE_CASES.items()]
    print(f"{torch.cuda.get_device_name()}  {args.dtype}  heads {args.heads}/{args.kv_heads}  "
          f"head_dim {args.head_dim}  block {args.block_size}  copy {copy_rate:.0f} GB/s")
    print(format_rows(rows, copy_rate))
    result = dict(device=torch.cuda.get_device_name(), torch=torch.__version__,
                  config=vars(args), copy_gbps=copy_rate, rows=rows)
    if args.sweep:
        result["sweep"] = sweep(args, dtype)
        for r in result["sweep"]:
            print(f"tile_cap {r['tile_cap']:3d} stages {r['num_stages']}  {r['case']:36s} "
                  f"{r['triton_ms']:.4f} ms  {r['gbps']:.0f} GB/s")
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=2)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
