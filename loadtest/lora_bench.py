"""LoRA delta micro-benchmark (GPU): the Triton shrink + expand against the per-adapter torch loop.

    python -m loadtest.lora_bench [--out bench_out/lora_bench.json] [--dtype bf16] [--rank 16]
                                  [--max-loras 4] [--hidden 4096] [--q-size 4096] [--kv-size 1024]
                                  [--intermediate 14336]

One TP rank's Llama-3-8B layers by default: qkv_proj (3 parts), o_proj, gate_up_proj (2 parts),
down_proj, each at decode batches of 1, 16, 64, 256 rows and a 2048-row prefill chunk, the rows
spread round robin over the max_loras adapters and the base model. `triton` is
kernels/triton_lora.py's add_lora as the CUDA engine calls it; `torch` is the CPU path's
arithmetic (engine/layers/lora.py's LoRASlots: per adapter, gather its rows, two matmuls with the
whole block-diagonal B, scatter-add). Times are medians of triton.testing.do_bench (CUDA events);
GB/s counts the slots' A and diagonal blocks of B read once per adapter in the step, plus x read
and y read and written. Without CUDA it prints that it needs CUDA and exits 0.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import torch

DEVICE = "cuda"  # module-level so a CPU dry run can patch it
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
BATCHES = (1, 16, 64, 256, 2048)


def bench_ms(fn):
    from triton.testing import do_bench
    return do_bench(fn, warmup=25, rep=200, return_mode="median")


def make_layer(in_size: int, part_sizes: list[int], rank: int, max_loras: int, dtype, seed=0):
    """Slots laid out as engine/layers/lora.py lays them: lora_a [L, P*R, in], lora_b [L, out, P*R]
    (stored transposed)."""
    gen = torch.Generator().manual_seed(seed)
    num_parts, out = len(part_sizes), sum(part_sizes)
    a = torch.randn(max_loras, num_parts * rank, in_size, generator=gen) / in_size ** 0.5
    b = torch.zeros(max_loras, out, num_parts * rank)
    offsets = [sum(part_sizes[:p]) for p in range(num_parts + 1)]
    for p in range(num_parts):
        b[:, offsets[p]:offsets[p + 1], p * rank:(p + 1) * rank] = torch.randn(
            max_loras, part_sizes[p], rank, generator=gen) / rank ** 0.5
    b = b.transpose(1, 2).contiguous().transpose(1, 2)  # stored as B^T, as the engine keeps it
    return (a.to(DEVICE, dtype), b.to(DEVICE, dtype),
            torch.tensor(offsets, dtype=torch.int32, device=DEVICE))


def torch_delta(y, x, a, b, slot_rows):
    """The CPU path's loop: per adapter, its rows' (x @ A.T) @ B.T scattered into y."""
    for slot, rows in slot_rows:
        y.index_add_(0, rows, (x.index_select(0, rows) @ a[slot].T) @ b[slot].T)


def run_case(name: str, num_tokens: int, in_size: int, part_sizes: list[int], args, dtype) -> dict:
    from kernels.lora_mapping import sort_tokens_by_slot
    from kernels.triton_lora import add_lora
    a, b, offsets = make_layer(in_size, part_sizes, args.rank, args.max_loras, dtype)
    token_slots = [t % (args.max_loras + 1) - 1 for t in range(num_tokens)]  # base, 0, 1, ...
    sorted_ids, starts = sort_tokens_by_slot(token_slots, args.max_loras)
    index = dict(dtype=torch.int32, device=DEVICE)
    sorted_ids, starts = torch.tensor(sorted_ids, **index), torch.tensor(starts, **index)
    slot_rows = [(s, torch.tensor([t for t, ts in enumerate(token_slots) if ts == s], device=DEVICE))
                 for s in range(args.max_loras) if s in token_slots]
    x = torch.randn(num_tokens, in_size, device=DEVICE, dtype=dtype)
    y = torch.zeros(num_tokens, sum(part_sizes), device=DEVICE, dtype=dtype)
    y_ref = torch.zeros_like(y)
    add_lora(y, x, a, b, sorted_ids, starts, offsets)  # once from zero: the two paths' difference
    torch_delta(y_ref, x, a, b, slot_rows)
    diff = (y.float() - y_ref.float()).abs().max().item()
    triton_ms = bench_ms(lambda: add_lora(y, x, a, b, sorted_ids, starts, offsets))
    torch_ms = bench_ms(lambda: torch_delta(y, x, a, b, slot_rows))
    elem = x.element_size()
    # Per adapter in the step: its A [P*R, in] and B's diagonal blocks [out, R], read once.
    weights = len(slot_rows) * args.rank * (len(part_sizes) * in_size + sum(part_sizes)) * elem
    nbytes = weights + x.numel() * elem + 2 * y.numel() * elem
    return dict(case=f"{name} x{num_tokens}", layer=name, num_tokens=num_tokens, adapters=len(slot_rows),
                triton_ms=triton_ms, torch_ms=torch_ms, speedup=torch_ms / triton_ms, bytes=nbytes,
                gbps=nbytes / triton_ms / 1e6, max_abs_diff_vs_torch=diff)


def layers(args) -> dict[str, tuple[int, list[int]]]:
    """name -> (input size, its parts' output sizes)."""
    return {"qkv_proj": (args.hidden, [args.q_size, args.kv_size, args.kv_size]),
            "o_proj": (args.q_size, [args.hidden]),
            "gate_up_proj": (args.hidden, [args.intermediate, args.intermediate]),
            "down_proj": (args.intermediate, [args.hidden])}


def format_rows(rows: list[dict]) -> str:
    head = f"{'case':24s} {'adapters':>8s} {'triton ms':>10s} {'torch ms':>10s} {'speedup':>8s} {'GB/s':>8s}"
    lines = [head, "-" * len(head)]
    for r in rows:
        lines.append(f"{r['case']:24s} {r['adapters']:8d} {r['triton_ms']:10.4f} {r['torch_ms']:10.4f} "
                     f"{r['speedup']:8.2f} {r['gbps']:8.1f}")
    return "\n".join(lines)


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="bench_out/lora_bench.json")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    p.add_argument("--rank", type=int, default=16, help="max_lora_rank: every slot's width")
    p.add_argument("--max-loras", type=int, default=4)
    p.add_argument("--hidden", type=int, default=4096)
    p.add_argument("--q-size", type=int, default=4096)
    p.add_argument("--kv-size", type=int, default=1024)
    p.add_argument("--intermediate", type=int, default=14336)
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    if not torch.cuda.is_available():
        print("lora_bench needs CUDA (no GPU found); nothing to measure.")
        return 0
    dtype = DTYPES[args.dtype]
    rows = [run_case(name, n, in_size, parts, args, dtype)
            for name, (in_size, parts) in layers(args).items() for n in BATCHES]
    print(f"{torch.cuda.get_device_name()}  {args.dtype}  rank {args.rank}  max_loras {args.max_loras}")
    print(format_rows(rows))
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(dict(device=torch.cuda.get_device_name(), torch=torch.__version__, config=vars(args),
                       rows=rows), f, indent=2)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
