"""The engine's CPU attention: fused C kernels over the paged cache, SDPA for what they skip.

Same contract as kernels.paged_attention, plus optional `key`/`value` (this
step's new K/V rows). Dispatch:

- fp32, bf16 or fp16 CPU tensors and the kernel built (kernels/cpu_paged_attention.c,
  see kernels.cpu_build; half types are widened to fp32 in registers): decode rows and chunks of up to
  `kernel_max_q_len(dtype, head_dim, opts)` rows (KERNEL_MAX_Q_LEN; bf16 on a CPU with AMX-BF16,
  16 where the chunk kernel below takes the longer chunks, else 64) run in the row kernel, which
  reads K/V straight from the cache blocks (no gather copy, no padding, online softmax), with or
  without a cached prefix.
- longer bf16 chunks on a CPU with AMX-BF16, head_dim a multiple of 32, no soft cap or sinks:
  the chunk kernel (kernels/cpu_chunk_attention.c: Q K^T and P V on AMX tiles, from the cache),
  every such chunk of the batch in the same call.
- other longer chunks run as one SDPA each: on `key`/`value` when it has no cached prefix
  (q_len == seq_len) and they are given (it needs no cache at all), else over K/V gathered
  from its blocks.
- anything else (other dtypes or devices, RAYLLM_DISABLE_CPU_KERNEL=1, no
  compiler): kernels.torch_attention.paged_attention_torch.

A sliding window, a soft cap and sinks (kernels.reference has their meaning) go
to every one of these paths alike (the chunk kernel takes windows only).
"""
from __future__ import annotations

import ctypes
import functools

import torch

from kernels._validate import check_paged_attention
from kernels.cpu_build import bind_signatures, cpu_flags, load_kernel_library
from kernels.cpu_dtypes import DT_CODES
from kernels import cpu_ops
from kernels._validate import check_store_kv
from kernels.torch_attention import (ScoreOptions, paged_attention_torch, prefill_cached,
                                     prefill_fresh, store_kv_torch)

_LIB_NAME = "cpu_chunk_attention"  # includes cpu_paged_attention.c: both entry points
# Chunks with more query rows run as SDPA instead, where one matmul over the chunk beats
# the kernel's per-row loop. `python -m loadtest.cpu_kernel_bench --only attention` times both
# either side of this limit (docs/benchmarks.md, "the C attention kernel against SDPA per chunk").
KERNEL_MAX_Q_LEN = 512
# bf16 on a CPU with AMX-BF16: SDPA's bf16 matmuls run on AMX tiles there and overtake the
# kernel from about 64 rows, fresh or with a prefix (docs/benchmarks.md, same command).
AMX_BF16_KERNEL_MAX_Q_LEN = 64
# ... and where the AMX chunk kernel (cpu_chunk_attention.c) takes the chunk, it overtakes the
# row kernel past one tile of 16 query rows (same command).
AMX_CHUNK_ROW_MAX_Q_LEN = 16
# Return codes of rayllm_paged_attention (cpu_paged_attention.c) and rayllm_chunk_attention.
_ERRORS = {
    1: "a sequence has q_len > seq_len, or seq_len beyond its block_tables row "
       "(max_blocks * block_size)",
    2: "block_tables holds a block id outside the cache",
    4: "cu_seqlens_q must start at 0, never decrease and end at num_tokens",
    5: "the tensors' dtype is not one the kernel takes",
    6: "the AMX chunk kernel does not take these (not bf16, a head_dim off 32, a soft cap or sinks)",
}
_ERR_NO_MEMORY = 3


class _Args(ctypes.Structure):
    """Mirror of `Args` in cpu_paged_attention.c (field order and types must match)."""

    _fields_ = [(name, ctypes.c_void_p) for name in
                ("query", "k_cache", "v_cache", "block_tables", "seq_lens", "cu_seqlens_q", "out")] + \
               [(name, ctypes.c_int64) for name in
                ("q_stride_tok", "q_stride_head", "o_stride_tok", "o_stride_head", "bt_stride",
                 "num_tokens", "num_seqs", "num_heads", "num_kv_heads", "head_dim", "block_size",
                 "num_blocks", "max_blocks")] + \
               [("scale", ctypes.c_float), ("max_q_len", ctypes.c_int64),
                ("sliding_window", ctypes.c_int64), ("soft_cap", ctypes.c_float), ("sinks", ctypes.c_void_p),
                ("dtype", ctypes.c_int64)]


def _kernel():
    """The loaded C entry point, or None (disabled or unbuildable: the torch path runs)."""
    lib = load_kernel_library(_LIB_NAME)
    if lib is None:
        return None
    fn = lib.rayllm_paged_attention
    fn.argtypes, fn.restype = [ctypes.POINTER(_Args)], ctypes.c_int
    return fn


@functools.lru_cache(maxsize=None)
def _chunk_kernel():
    """The AMX entry point for long bf16 chunks (cpu_chunk_attention.c), or None where it cannot
    run (no AMX-BF16, tiles refused, or the library unbuilt): SDPA runs those chunks then."""
    lib = bind_signatures(load_kernel_library(_LIB_NAME),
                          {"rayllm_chunk_attention_available": ([], ctypes.c_int),
                           "rayllm_chunk_attention": ([ctypes.POINTER(_Args)], ctypes.c_int)})
    return lib.rayllm_chunk_attention if lib is not None and lib.rayllm_chunk_attention_available() else None


def kernel_available() -> bool:
    return _kernel() is not None


def chunk_kernel_applies(dtype: torch.dtype, head_dim: int, opts: ScoreOptions) -> bool:
    """Whether the AMX kernel takes a long chunk's attention (else SDPA does)."""
    return (dtype == torch.bfloat16 and head_dim % 32 == 0 and opts.logits_soft_cap is None
            and opts.sinks is None and _chunk_kernel() is not None)


def kernel_max_q_len(dtype: torch.dtype, head_dim: int | None = None, opts: ScoreOptions = ScoreOptions()) -> int:
    """The most query rows a chunk may have to run in the row kernel; longer chunks run in the AMX
    chunk kernel where it takes them (bf16, `head_dim` given, chunk_kernel_applies), else as SDPA."""
    if dtype == torch.bfloat16 and "amx_bf16" in cpu_flags():
        if head_dim is not None and chunk_kernel_applies(dtype, head_dim, opts):
            return AMX_CHUNK_ROW_MAX_Q_LEN
        return AMX_BF16_KERNEL_MAX_Q_LEN
    return KERNEL_MAX_Q_LEN


def _as_int32(t: torch.Tensor) -> torch.Tensor:
    return t if t.dtype == torch.int32 and t.stride(-1) == 1 else t.to(torch.int32).contiguous()


def _unit_last_stride(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


def run_kernel(fn, query, k_cache, v_cache, block_tables, seq_lens, cu_seqlens_q, scale,
               out, max_q_len: int, opts: ScoreOptions = ScoreOptions(), chunk_fn=None) -> None:
    """Call the C kernel for the sequences with at most max_q_len query rows, and chunk_fn (the
    AMX entry point, when given) for the others.

    Every tensor on CPU with a unit last stride; query, caches and out one of DT_CODES,
    the index tensors int32. query, out: [num_tokens, num_heads, head_dim]; caches: [num_blocks, block_size, num_kv_heads, head_dim]
    contiguous; block_tables [num_seqs, max_blocks]; rows of longer chunks are not written.
    """
    dtypes = {t.dtype for t in (query, k_cache, v_cache, out)}
    if len(dtypes) != 1 or query.dtype not in DT_CODES:  # else the kernel misreads memory
        raise ValueError(f"cpu paged attention: query, caches and out must share one of "
                         f"{list(DT_CODES)}, got {sorted(map(str, dtypes))}")
    num_blocks, block_size, num_kv_heads, head_dim = k_cache.shape
    sinks = None if opts.sinks is None else opts.sinks.to(torch.float32).contiguous()  # [num_heads]
    args = _Args(query.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), block_tables.data_ptr(),
                 seq_lens.data_ptr(), cu_seqlens_q.data_ptr(), out.data_ptr(),
                 query.stride(0), query.stride(1), out.stride(0), out.stride(1), block_tables.stride(0),
                 query.shape[0], block_tables.shape[0], query.shape[1], num_kv_heads, head_dim,
                 block_size, num_blocks, block_tables.shape[1], scale, max_q_len,
                 opts.sliding_window or 0, opts.logits_soft_cap or 0.0,
                 None if sinks is None else sinks.data_ptr(), DT_CODES[query.dtype])
    for f in (fn,) if chunk_fn is None else (fn, chunk_fn):
        err = f(ctypes.byref(args))
        if err == _ERR_NO_MEMORY:
            raise MemoryError("cpu paged attention: scratch allocation failed")
        if err:
            raise ValueError(f"cpu paged attention: {_ERRORS.get(err, f'error {err}')}")


def _sdpa_chunks(query, k_cache, v_cache, block_tables, seq_lens, cu_seqlens_q, seq_lens_cpu,
                 query_lens_cpu, scale, out, key, value, opts, max_q_len: int) -> None:
    """The chunks the kernel skipped (over max_q_len rows), one SDPA each: fresh ones
    (q_len == seq_len) on their own new K/V when given, the others over their blocks."""
    seq_l = list(seq_lens_cpu) if seq_lens_cpu is not None else seq_lens.tolist()
    if query_lens_cpu is not None:
        q_l = list(query_lens_cpu)
    else:
        cu = cu_seqlens_q.tolist()
        q_l = [b - a for a, b in zip(cu, cu[1:])]
    start = 0
    for s, (q_len, seq_len) in enumerate(zip(q_l, seq_l)):
        if q_len > max_q_len and key is not None and q_len == seq_len:
            prefill_fresh(query, key, value, start, q_len, scale, out, opts)
        elif q_len > max_q_len:
            prefill_cached(query, k_cache, v_cache, block_tables[s], start, q_len, seq_len, scale, out,
                           opts)
        start += q_len


def paged_attention_cpu(query, k_cache, v_cache, block_tables, seq_lens, cu_seqlens_q,
                        max_seqlen_q, softmax_scale, out=None, *, seq_lens_cpu=None,
                        query_lens_cpu=None, key=None, value=None, sliding_window=None,
                        logits_soft_cap=None, sinks=None):
    """Paged attention, C kernel where it applies; same contract as kernels.paged_attention.

    query:        [num_tokens, num_heads, head_dim]
    k_cache:      [num_blocks, block_size, num_kv_heads, head_dim]
    block_tables: [num_seqs, max_blocks_per_seq];  seq_lens: [num_seqs]
    cu_seqlens_q: [num_seqs + 1]
    key, value:   optional [num_tokens, num_kv_heads, head_dim], the new rows already
        stored in the cache; fresh prefill chunks then skip the cache entirely.
    seq_lens_cpu, query_lens_cpu: optional host copies (see paged_attention_torch).
    sliding_window, logits_soft_cap, sinks: as kernels.reference.paged_attention_ref.
    """
    mods = dict(sliding_window=sliding_window, logits_soft_cap=logits_soft_cap, sinks=sinks)
    fn = _kernel() if query.device.type == "cpu" and query.dtype in DT_CODES else None
    if fn is None:
        return paged_attention_torch(query, k_cache, v_cache, block_tables, seq_lens, cu_seqlens_q,
                                     max_seqlen_q, softmax_scale, out, seq_lens_cpu=seq_lens_cpu,
                                     query_lens_cpu=query_lens_cpu, key=key, value=value, **mods)
    check_paged_attention(query, k_cache, v_cache, block_tables, seq_lens, cu_seqlens_q,
                          max_seqlen_q, softmax_scale, out, **mods)
    opts = ScoreOptions(**mods)
    if out is None:
        out = torch.empty(query.shape, dtype=query.dtype)
    if query.shape[0] == 0 or block_tables.shape[0] == 0:
        return out
    dst = out if out.stride(-1) == 1 else torch.empty(query.shape, dtype=query.dtype)
    head_dim = query.shape[-1]
    scale, max_q_len = float(softmax_scale), kernel_max_q_len(query.dtype, head_dim, opts)
    long_chunks = max_seqlen_q > max_q_len
    chunk_fn = _chunk_kernel() if long_chunks and chunk_kernel_applies(query.dtype, head_dim, opts) else None
    run_kernel(fn, _unit_last_stride(query), k_cache, v_cache, _as_int32(block_tables),
               _as_int32(seq_lens), _as_int32(cu_seqlens_q), scale, dst, max_q_len, opts, chunk_fn)
    if long_chunks and chunk_fn is None:
        _sdpa_chunks(query, k_cache, v_cache, block_tables, seq_lens, cu_seqlens_q, seq_lens_cpu,
                     query_lens_cpu, scale, dst, key, value, opts, max_q_len)
    if dst is not out:
        out.copy_(dst)
    return out


def store_kv_cpu(key, value, k_cache, v_cache, slot_mapping) -> None:
    """kernels.store_kv's contract: a C row copy for fp32, bf16 or fp16 CPU tensors, else store_kv_torch.

    key, value:       [num_tokens, num_kv_heads, head_dim]
    k_cache, v_cache: [num_blocks, block_size, num_kv_heads, head_dim]
    slot_mapping:     [num_tokens]  (< 0 skips the row)
    """
    check_store_kv(key, value, k_cache, v_cache, slot_mapping)
    if not cpu_ops.store_kv(key, value, k_cache, v_cache, slot_mapping):
        store_kv_torch(key, value, k_cache, v_cache, slot_mapping)
