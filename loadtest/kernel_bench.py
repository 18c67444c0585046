"""Kernel micro-benchmark: Triton paged attention / store_kv / fused MoE against the torch path.

    python -m loadtest.kernel_bench [--out bench_out/kernel_bench.json] [--dtype bf16]
                                    [--heads 32] [--kv-heads 8] [--head-dim 128]
                                    [--block-size 16] [--sweep [KNOB ...]]
                                    [--moe-experts 128] [--moe-top-k 8] [--moe-hidden 2048]
                                    [--moe-inter 768]

Cases: decode 64 x ctx 1024, prefill 4 x 512, a mixed batch, long-context
small-batch decodes (4 x 8192, 2 x 16384), and store_kv for both batch shapes.
Attention rows time the Triton kernel as the engine calls it (split-KV chosen
by the heuristic; `splits` says how many segments it took), and for decode
cases also the plain kernel forced (num_splits=1), so split vs unsplit vs the
torch path come from one run. Times are medians of triton.testing.do_bench
(CUDA events). Achieved GB/s counts the bytes each kernel must move at minimum
(every context K/V byte read once, Q read, O written); the reference line is a
device-to-device copy's GB/s (read + write).

Fused MoE (kernels/triton_fused_moe.py) runs one layer's experts at decode batch sizes
1, 16, 64 and 256 against the sorted per-expert torch path (kernels/torch_fused_moe.py),
Qwen3-30B-A3B's expert shape by default (128 experts, top-8, hidden 2048, expert
width 768), softmax top-k routing of random logits. Its bytes are the weights of the
experts the batch reaches, read once, plus the activations in and out.

--sweep re-times the attention cases varying one launch knob at a time around
the defaults (kernels/triton_attention.py: TILE_CAP, NUM_STAGES, NUM_WARPS,
KV_TILE, NUM_SPLITS; kernels/triton_attention_split.py: SPLIT_TARGET_WAVES,
MIN_SEGMENT_LEN); name knobs after --sweep to sweep only those. Without CUDA it
prints that it needs CUDA and exits 0.
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


def run_attention_case(name, q_lens, seq_lens, args, dtype, compare=True):
    """One attention case; compare=False (the sweep) times only the engine's call."""
    from kernels import paged_attention
    from kernels import triton_attention as ta
    from kernels.torch_attention import paged_attention_torch
    kwargs, host = make_attention_case(q_lens, seq_lens, args.heads, args.kv_heads,
                                       args.head_dim, args.block_size, dtype)
    out = torch.empty_like(kwargs["query"])
    nbytes, flops = attention_bytes_flops(q_lens, seq_lens, args.heads, args.kv_heads,
                                          args.head_dim, kwargs["query"].element_size())
    splits = splits_taken(kwargs, ta.NUM_SPLITS)
    times = {splits: bench_ms(lambda: paged_attention(**kwargs, out=out))}
    if compare and max(q_lens) == 1:
        # Decode: split vs unsplit, whichever the heuristic took (a split it did not
        # take runs at FORCED_SPLITS segments).
        for n in (1, splits if splits > 1 else FORCED_SPLITS):
            if n not in times:
                times[n] = bench_ms(lambda: paged_attention(**kwargs, out=out, num_splits=n))
    t_ms = times[splits]
    row = dict(case=name, kernel="paged_attention", triton_ms=t_ms, bytes=nbytes,
               gbps=nbytes / t_ms / 1e6, tflops=flops / t_ms / 1e9, splits=splits)
    if len(times) > 1:
        split_n = max(times)
        row.update(unsplit_ms=times[1], split_ms=times[split_n], split_n=split_n,
                   unsplit_gbps=nbytes / times[1] / 1e6,
                   split_gbps=nbytes / times[split_n] / 1e6)
    if compare:
        tri = paged_attention(**kwargs, out=out).float()
        ref = paged_attention_torch(**kwargs, **host).float()
        torch_ms = bench_ms(lambda: paged_attention_torch(**kwargs, out=out, **host))
        row.update(torch_ms=torch_ms, speedup=torch_ms / t_ms,
                   max_abs_diff_vs_torch=(tri - ref).abs().max().item())
    return row


def splits_taken(kwargs, forced):
    """The segment count paged_attention uses for this batch (1: the plain kernel)."""
    from kernels import triton_attention_split as split_kv
    if forced is not None:
        return forced
    block_size = kwargs["k_cache"].shape[1]
    return split_kv.choose_num_splits(
        kwargs["block_tables"].shape[0], kwargs["k_cache"].shape[2], kwargs["max_seqlen_q"],
        kwargs["block_tables"].shape[1] * block_size, split_kv.num_sms(kwargs["query"].device))


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
    "decode 2x16384": ([1] * 2, [16384] * 2),
}
FORCED_SPLITS = 4  # a decode case the heuristic leaves unsplit is also timed split this way
STORE_CASES = {"store_kv 64 tok": 64, "store_kv 2048 tok": 2048}
MOE_BATCHES = (1, 16, 64, 256)  # decode: one token per sequence


def run_moe_case(num_tokens, args, dtype, seed=0):
    """One MoE layer at `num_tokens` rows: the Triton kernel against the torch path."""
    from kernels.torch_fused_moe import fused_moe_torch
    from kernels.triton_fused_moe import fused_moe
    gen = torch.Generator().manual_seed(seed)
    e, h, i, k = args.moe_experts, args.moe_hidden, args.moe_inter, args.moe_top_k
    x = torch.randn(num_tokens, h, generator=gen).to(DEVICE, dtype)
    w13 = (torch.randn(e, 2 * i, h, generator=gen) / h ** 0.5).to(DEVICE, dtype)  # [E, 2I, H]
    w2 = (torch.randn(e, h, i, generator=gen) / i ** 0.5).to(DEVICE, dtype)  # [E, H, I]
    weights, ids = torch.randn(num_tokens, e, generator=gen).softmax(-1).topk(k, dim=-1)
    weights, ids = weights.to(DEVICE), ids.to(DEVICE)
    experts_reached = ids.unique().numel()
    nbytes = (experts_reached * 3 * h * i + 2 * num_tokens * h) * x.element_size()
    t_ms = bench_ms(lambda: fused_moe(x, w13, w2, weights, ids))
    torch_ms = bench_ms(lambda: fused_moe_torch(x, w13, w2, weights, ids))
    diff = (fused_moe(x, w13, w2, weights, ids).float() - fused_moe_torch(x, w13, w2, weights, ids).float())
    return dict(case=f"moe decode {num_tokens}", kernel="fused_moe", triton_ms=t_ms, torch_ms=torch_ms,
                speedup=torch_ms / t_ms, bytes=nbytes, gbps=nbytes / t_ms / 1e6,
                experts_reached=experts_reached, max_abs_diff_vs_torch=diff.abs().max().item())


# knob -> (module, values); one knob varies at a time, the others stay at their defaults.
SWEEP_KNOBS = {
    "TILE_CAP": ("kernels.triton_attention", (16, 32, 64)),
    "NUM_STAGES": ("kernels.triton_attention", (1, 2, 3, 4)),
    "NUM_WARPS": ("kernels.triton_attention", (2, 4, 8)),
    "KV_TILE": ("kernels.triton_attention", (16, 32, 64, 128)),
    "NUM_SPLITS": ("kernels.triton_attention", (1, 2, 4, 8, 16, 32)),
    "SPLIT_TARGET_WAVES": ("kernels.triton_attention_split", (1, 2, 4, 8)),
    "MIN_SEGMENT_LEN": ("kernels.triton_attention_split", (64, 128, 256, 512, 1024)),
}
SPLIT_ONLY = ("NUM_SPLITS", "SPLIT_TARGET_WAVES", "MIN_SEGMENT_LEN")  # decode cases only


def sweep(args, dtype, knobs):
    """Re-time the attention cases (Triton only) for each value of each knob (for tuning)."""
    import importlib
    rows = []
    for knob in knobs:
        module_name, values = SWEEP_KNOBS[knob]
        module = importlib.import_module(module_name)
        saved = getattr(module, knob)
        for value in values:
            setattr(module, knob, value)
            for name, (q_lens, seq_lens) in ATTENTION_CASES.items():
                if knob in SPLIT_ONLY and max(q_lens) > 1:
                    continue
                try:
                    row = run_attention_case(name, q_lens, seq_lens, args, dtype,
                                             compare=False)
                except Exception as exc:  # e.g. out of shared memory: record, go on
                    row = dict(case=name, error=f"{type(exc).__name__}: {exc}"[:300])
                rows.append(dict(row, knob=knob, value=value))
                print(format_sweep_row(rows[-1]), flush=True)
        setattr(module, knob, saved)
    return rows


def format_sweep_row(r):
    head = f"{r['knob']:>18s} = {str(r['value']):5s}  {r['case']:36s}"
    if "error" in r:
        return f"{head} {r['error']}"
    return f"{head} {r['triton_ms']:.4f} ms  {r['gbps']:6.0f} GB/s  splits {r['splits']}"


def format_rows(rows, copy_rate):
    head = (f"{'case':36s} {'triton ms':>10s} {'torch ms':>10s} {'speedup':>8s} "
            f"{'GB/s':>8s} {'%copy':>6s} {'splits':>6s}")
    lines = [head, "-" * len(head)]
    for r in rows:
        lines.append(f"{r['case']:36s} {r['triton_ms']:10.4f} {r['torch_ms']:10.4f} "
                     f"{r['speedup']:8.2f} {r['gbps']:8.1f} {100 * r['gbps'] / copy_rate:6.1f} "
                     f"{r.get('splits', ''):>6}")
    decode = [r for r in rows if "unsplit_ms" in r]
    if decode:
        lines += ["", f"{'decode: split vs unsplit vs torch':36s} {'unsplit ms':>10s} "
                      f"{'split ms':>10s} {'n':>3s} {'%copy u/s':>11s} {'split/torch':>11s}"]
        for r in decode:
            lines.append(
                f"{r['case']:36s} {r['unsplit_ms']:10.4f} {r['split_ms']:10.4f} "
                f"{r['split_n']:3d} {100 * r['unsplit_gbps'] / copy_rate:5.1f}/"
                f"{100 * r['split_gbps'] / copy_rate:<5.1f} {r['torch_ms'] / r['split_ms']:11.2f}")
    return "\n".join(lines)


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="bench_out/kernel_bench.json")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--moe-experts", type=int, default=128)
    p.add_argument("--moe-top-k", type=int, default=8)
    p.add_argument("--moe-hidden", type=int, default=2048)
    p.add_argument("--moe-inter", type=int, default=768, help="each expert's intermediate size (one TP rank's)")
    p.add_argument("--sweep", nargs="*", choices=sorted(SWEEP_KNOBS), metavar="KNOB",
                   help="also time launch-knob variants (all knobs, or those named: "
                        + ", ".join(SWEEP_KNOBS) + ")")
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
    rows += [run_moe_case(n, args, dtype) for n in MOE_BATCHES]
    print(f"{torch.cuda.get_device_name()}  {args.dtype}  heads {args.heads}/{args.kv_heads}  "
          f"head_dim {args.head_dim}  block {args.block_size}  copy {copy_rate:.0f} GB/s")
    print(format_rows(rows, copy_rate))
    result = dict(device=torch.cuda.get_device_name(), torch=torch.__version__,
                  config=vars(args), copy_gbps=copy_rate, rows=rows)
    if args.sweep is not None:
        result["sweep"] = sweep(args, dtype, args.sweep or list(SWEEP_KNOBS))
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=2)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
