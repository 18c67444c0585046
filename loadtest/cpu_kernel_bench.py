"""CPU micro-benchmark of the choices the engine's CPU path makes per call.

    python -m loadtest.cpu_kernel_bench [--out bench_out/cpu_kernel_bench.json] [--repeats 15]

- linear: the bench model's 24 linears (6 layers of qkv, o, gate_up, down; hidden 512,
  8 / 4 KV heads, MLP 1408), one pass over all of them per timing so weights come from
  memory as in a forward, through `F.linear` (MKL repacks the weight each call) against
  oneDNN on weights packed once (engine.layers.cpu_gemm), at decode and prefill row counts.
- decode: a decode step of 64 sequences through the C kernel against the torch path, and the
  kernel's K/V bytes per second as a share of reading the same caches once (`--only decode`).
- attention: one chunk (8 heads, 4 KV heads, head_dim 64, block 16) through the C
  paged-attention row kernel against one SDPA over the gathered blocks
  (kernels.torch_attention.prefill_cached), in fp32 and bf16, either side of
  `kernel_max_q_len`, the q_len up to which kernels/cpu_attention.py uses the row kernel
  (512; for bf16 on a CPU with AMX-BF16, 16 with the AMX chunk kernel, 64 without); bf16 where the
  AMX chunk kernel (kernels/cpu_chunk_attention.c) runs: that kernel against SDPA too.
- ops: the fused C ops of a layer (kernels.cpu_ops: the residual add with RMSNorm, SiLU-and-mul)
  against the torch ops the layers run without them, in fp32 and bf16, at decode and prefill rows;
  where AMX runs, the INT8 gate_up projection with SiLU-and-mul in one pass
  (kernels.cpu_int8.int8_linear_silu_cpu) against the int8 matmul and then the C op.

Peers alternate within each repeat; times are medians. The ratio column (peer / ours,
above 1: ours is faster) is the figure; absolute CPU times vary with the box.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch
import torch.nn.functional as F

from engine.layers.cpu_gemm import can_pack, pack, packed_linear
from kernels import cpu_int8, cpu_ops
from kernels.cpu_attention import (AMX_BF16_KERNEL_MAX_Q_LEN, KERNEL_MAX_Q_LEN, _chunk_kernel, _kernel,
                                   chunk_kernel_applies, kernel_max_q_len, run_kernel)
from kernels.torch_attention import ScoreOptions, paged_attention_torch, prefill_cached
from loadtest.report import base_metadata, format_table, write_json

HIDDEN, INTERMEDIATE, HEADS, KV_HEADS, HEAD_DIM, BLOCK = 512, 1408, 8, 4, 64, 16  # the bench model
# [in, out] of one bench-model layer: qkv, o, gate_up, down.
LAYER_SHAPES = [(HIDDEN, (HEADS + 2 * KV_HEADS) * HEAD_DIM), (HEADS * HEAD_DIM, HIDDEN), (HIDDEN, 2 * INTERMEDIATE),
                (INTERMEDIATE, HIDDEN)]
NUM_LAYERS = 6
LINEAR_ROWS = (32, 64, 2048)
DTYPES = (torch.float32, torch.bfloat16)  # the attention and ops cases: the engine's CPU dtypes
# (q_len, keys): chunks with a cached prefix, either side of the kernel's limits.
ATTENTION_CASES = ((16, 216), (32, 32), (AMX_BF16_KERNEL_MAX_Q_LEN, AMX_BF16_KERNEL_MAX_Q_LEN + 200), (100, 250),
                   (136, 136), (KERNEL_MAX_Q_LEN, KERNEL_MAX_Q_LEN + 200),
                   (2 * KERNEL_MAX_Q_LEN, 2 * KERNEL_MAX_Q_LEN + 200))
ATTENTION_TOLS = {torch.float32: 1e-4, torch.bfloat16: 2e-2}  # bf16: SDPA rounds P to bf16 before P @ V
# Decode steps: (sequences, their context lengths' range, dtype, query heads, kv heads, head_dim).
# The bench model's shape first: the first two fit in a 32 MB L3, the third (~65 MB of K/V) does
# not, as the engine's six layers do not. Then the demo model's (SmolLM2-135M: 3 query heads per
# kv head) and Llama-3.1-8B's (4 per kv head, head_dim 128).
DECODE_CASES = ((64, (100, 300), torch.float32, HEADS, KV_HEADS, HEAD_DIM),
                (64, (100, 300), torch.bfloat16, HEADS, KV_HEADS, HEAD_DIM),
                (64, (800, 1200), torch.bfloat16, HEADS, KV_HEADS, HEAD_DIM),
                (32, (400, 800), torch.bfloat16, 9, 3, 64),
                (32, (400, 800), torch.bfloat16, 32, 8, 128))
OPS_ROWS = (8, 64, 2048)


def _median_ms(fns: list, repeats: int) -> list[float]:
    """Each fn timed once per repeat, the fns interleaved; one warm-up round first."""
    for fn in fns:
        fn()
    times = [[] for _ in fns]
    for _ in range(repeats):
        for t, fn in zip(times, fns):
            start = time.perf_counter()
            fn()
            t.append(time.perf_counter() - start)
    return [statistics.median(t) * 1e3 for t in times]


def linear_rows(repeats: int, gen: torch.Generator) -> list[dict]:
    weights = [torch.randn(o, i, generator=gen) * i ** -0.5 for _ in range(NUM_LAYERS) for i, o in LAYER_SHAPES]
    if not all(can_pack(w) for w in weights):
        print("torch has no oneDNN linear ops: the engine runs F.linear; linear cases skipped")
        return []
    packed = [pack(w) for w in weights]
    rows = []
    for n in LINEAR_ROWS:
        xs = {i: torch.randn(n, i, generator=gen) for i, _ in LAYER_SHAPES}
        dense = lambda: [F.linear(xs[w.shape[1]], w) for w in weights]  # noqa: E731
        onednn = lambda: [packed_linear(xs[w.shape[1]], p, None) for w, p in zip(weights, packed)]  # noqa: E731
        ours, peer = _median_ms([onednn, dense], repeats)
        rows.append({"case": f"linear x{len(weights)}, {n} rows", "ours": "oneDNN packed", "ours_ms": ours,
                     "peer": "F.linear", "peer_ms": peer, "ratio": peer / ours})
    return rows


def attention_rows(repeats: int, gen: torch.Generator) -> list[dict]:
    fn = _kernel()
    if fn is None:
        print("the C attention kernel is not built (no compiler, or disabled): attention cases skipped")
        return []
    rows = []
    for dtype in DTYPES:
        for q_len, seq_len in ATTENTION_CASES:
            rows += _attention_rows(fn, q_len, seq_len, dtype, repeats, gen)
    return rows


def _attention_rows(fn, q_len: int, seq_len: int, dtype: torch.dtype, repeats: int,
                    gen: torch.Generator) -> list[dict]:
    num_blocks = -(-seq_len // BLOCK)
    k_cache, v_cache = (torch.randn(num_blocks + 3, BLOCK, KV_HEADS, HEAD_DIM, generator=gen).to(dtype)
                        for _ in "kv")
    table = torch.randperm(num_blocks + 3, generator=gen)[:num_blocks].to(torch.int32)[None]
    query = torch.randn(q_len, HEADS, HEAD_DIM, generator=gen).to(dtype)
    seq_lens, cu = torch.tensor([seq_len], dtype=torch.int32), torch.tensor([0, q_len], dtype=torch.int32)
    out_k, out_s = torch.empty_like(query), torch.empty_like(query)
    scale = HEAD_DIM ** -0.5
    kernel = lambda: run_kernel(fn, query, k_cache, v_cache, table, seq_lens, cu, scale, out_k,  # noqa: E731
                                q_len)
    sdpa = lambda: prefill_cached(query, k_cache, v_cache, table[0], 0, q_len, seq_len, scale, out_s)  # noqa: E731
    chunk_fn = _chunk_kernel() if chunk_kernel_applies(dtype, HEAD_DIM, ScoreOptions()) else None
    out_c = torch.empty_like(query)
    chunk = lambda: run_kernel(fn, query, k_cache, v_cache, table, seq_lens, cu, scale, out_c,  # noqa: E731
                               0, chunk_fn=chunk_fn)
    ours, peer, *amx = _median_ms([kernel, sdpa] + ([chunk] if chunk_fn else []), repeats)
    tol = ATTENTION_TOLS[dtype]
    torch.testing.assert_close(out_k, out_s, rtol=tol, atol=tol)  # the same attention, two ways
    limit = kernel_max_q_len(dtype, HEAD_DIM)
    used = "row kernel" if q_len <= limit else "AMX chunk kernel" if chunk_fn else "SDPA"
    case = f"attention {str(dtype).removeprefix('torch.')} q_len {q_len} over {seq_len} keys (engine: {used})"
    rows = [{"case": case, "ours": "C row kernel", "ours_ms": ours, "peer": "SDPA", "peer_ms": peer,
             "ratio": peer / ours}]
    if chunk_fn:
        torch.testing.assert_close(out_c, out_s, rtol=tol, atol=tol)
        rows.append({"case": case, "ours": "AMX chunk kernel", "ours_ms": amx[0], "peer": "SDPA", "peer_ms": peer,
                     "ratio": peer / amx[0]})
    return rows


def decode_rows(repeats: int, gen: torch.Generator) -> list[dict]:
    """A decode step's attention through the C kernel against the torch path (what runs without
    it), and the kernel's K/V bytes per second against reading the same caches once (a sum)."""
    fn = _kernel()
    if fn is None:
        print("the C attention kernel is not built (no compiler, or disabled): decode cases skipped")
        return []
    rows = []
    for num_seqs, (lo, hi), dtype, heads, kv_heads, head_dim in DECODE_CASES:
        seq_lens = torch.randint(lo, hi + 1, (num_seqs,), generator=gen, dtype=torch.int32)
        per_seq = [-(-int(n) // BLOCK) for n in seq_lens]
        ids = torch.randperm(sum(per_seq), generator=gen).to(torch.int32)
        table = torch.zeros(num_seqs, max(per_seq), dtype=torch.int32)
        for s, start in enumerate(torch.tensor([0, *per_seq]).cumsum(0)[:-1].tolist()):
            table[s, :per_seq[s]] = ids[start:start + per_seq[s]]
        k_cache, v_cache = (torch.randn(sum(per_seq), BLOCK, kv_heads, head_dim, generator=gen).to(dtype)
                            for _ in "kv")
        query = torch.randn(num_seqs, heads, head_dim, generator=gen).to(dtype)
        cu = torch.arange(num_seqs + 1, dtype=torch.int32)
        out_k, out_t = torch.empty_like(query), torch.empty_like(query)
        scale = head_dim ** -0.5
        kernel = lambda: run_kernel(fn, query, k_cache, v_cache, table, seq_lens, cu, scale, out_k,  # noqa: E731
                                    1)
        torch_path = lambda: paged_attention_torch(query, k_cache, v_cache, table, seq_lens, cu, 1,  # noqa: E731
                                                   scale, out_t)
        read = lambda: (k_cache.view(torch.float32).sum(), v_cache.view(torch.float32).sum())  # noqa: E731
        ours, peer, read_ms = _median_ms([kernel, torch_path, read], repeats)
        torch.testing.assert_close(out_k.float(), out_t.float(), rtol=2e-2, atol=2e-2)  # one attention, two ways
        nbytes = 2 * int(seq_lens.sum()) * kv_heads * head_dim * query.element_size()
        rows.append({"case": f"decode {num_seqs} x {lo}-{hi} keys, {heads}/{kv_heads} heads x {head_dim}, "
                             f"{str(dtype).removeprefix('torch.')} ({nbytes / 2**20:.0f} MiB K/V)", "ours": "C kernel", "ours_ms": ours,
                     "peer": "torch path", "peer_ms": peer, "ratio": peer / ours,
                     "kv_gb_per_s": nbytes / ours / 1e6, "read_share": read_ms / ours})
    return rows


def ops_rows(repeats: int, gen: torch.Generator) -> list[dict]:
    """A layer's fused C ops (residual add + RMSNorm; SiLU-and-mul) against the torch ops they replace."""
    if cpu_ops._lib() is None:
        print("the C ops are not built (no compiler, or disabled): ops cases skipped")
        return []
    rows = []
    for dtype in DTYPES:
        name = str(dtype).removeprefix("torch.")
        weight = torch.randn(HIDDEN, generator=gen).to(dtype)
        for n in OPS_ROWS:
            x, res = (torch.randn(n, HIDDEN, generator=gen).to(dtype) for _ in "xr")
            gate_up = torch.randn(n, 2 * INTERMEDIATE, generator=gen).to(dtype)
            fused_norm = lambda: cpu_ops.add_rms_norm(x, res, weight, 1e-6)  # noqa: E731
            torch_norm = lambda: F.rms_norm(x + res, (HIDDEN,), weight, 1e-6)  # noqa: E731
            fused_silu = lambda: cpu_ops.silu_and_mul(gate_up)  # noqa: E731
            torch_silu = lambda: F.silu(gate_up[:, :INTERMEDIATE]) * gate_up[:, INTERMEDIATE:]  # noqa: E731
            for case, ours_fn, peer_fn in ((f"add + rms_norm {name} {n} x {HIDDEN}", fused_norm, torch_norm),
                                           (f"silu_and_mul {name} {n} x 2 x {INTERMEDIATE}", fused_silu, torch_silu)):
                ours, peer = _median_ms([ours_fn, peer_fn], repeats)
                rows.append({"case": case, "ours": "C op", "ours_ms": ours, "peer": "torch ops", "peer_ms": peer,
                             "ratio": peer / ours})
            rows += _gated_rows(x, n, name, repeats, gen)
    return rows


def _gated_rows(x: torch.Tensor, n: int, name: str, repeats: int, gen: torch.Generator) -> list[dict]:
    """Where AMX runs: the INT8 W8A8 gate_up projection with SiLU-and-mul in its epilogue (what the
    fused decoder layer calls) against the two calls it replaces."""
    if not cpu_int8.amx_available():
        return []
    q = torch.randint(-127, 128, (2 * INTERMEDIATE, HIDDEN), generator=gen, dtype=torch.int8)
    w = cpu_int8.pack_int8_vnni(q, torch.rand(2 * INTERMEDIATE, generator=gen) * 1e-2)
    one_pass = lambda: cpu_int8.int8_linear_silu_cpu(x, w)  # noqa: E731
    two_calls = lambda: cpu_ops.silu_and_mul(cpu_int8.int8_linear_cpu(x, w))  # noqa: E731
    ours, peer = _median_ms([one_pass, two_calls], repeats)
    assert torch.equal(one_pass(), two_calls())  # the same bits
    return [{"case": f"int8 gate_up + silu_and_mul {name} {n} x {HIDDEN} -> 2 x {INTERMEDIATE}",
             "ours": "one AMX pass", "ours_ms": ours, "peer": "int8 matmul, then the C op", "peer_ms": peer,
             "ratio": peer / ours}]


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(prog="python -m loadtest.cpu_kernel_bench", description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="bench_out/cpu_kernel_bench.json")
    ap.add_argument("--repeats", type=int, default=15, help="timed rounds per case (default 15)")
    ap.add_argument("--only", choices=("linear", "attention", "decode", "ops"), default=None,
                    help="run one group of cases")
    args = ap.parse_args(argv)
    if args.repeats < 1:
        ap.error(f"--repeats must be at least 1, got {args.repeats}")
    gen = torch.Generator().manual_seed(0)
    with torch.inference_mode():
        rows = linear_rows(args.repeats, gen) if args.only in (None, "linear") else []
        rows += attention_rows(args.repeats, gen) if args.only in (None, "attention") else []
        rows += decode_rows(args.repeats, gen) if args.only in (None, "decode") else []
        rows += ops_rows(args.repeats, gen) if args.only in (None, "ops") else []
    report = {**base_metadata(sys.argv if argv is None else ["cpu_kernel_bench", *argv]),
              "torch_threads": torch.get_num_threads(), "repeats": args.repeats, "rows": rows}
    print(f"wrote {write_json(args.out, report)}")
    print(format_table(["case", "ours", "ms", "peer", "ms", "peer / ours", "K/V GB/s", "of a plain read"],
                       [[r["case"], r["ours"], r["ours_ms"], r["peer"], r["peer_ms"], r["ratio"],
                         r.get("kv_gb_per_s", "-"), r.get("read_share", "-")] for r in rows]))
    return report


if __name__ == "__main__":
    main()
