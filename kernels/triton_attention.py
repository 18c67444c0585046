"""Host wrapper for the Triton paged-attention kernel: validation, launch config, split-KV choice.

One entry point, `paged_attention`, for every batch. It launches either the
plain kernel (grid (q_tiles, kv_heads), each program normalises and stores its
rows) or, for decode launches that would leave SMs idle, the split-KV pair:
the same kernel with a third grid axis over context segments writing fp32
partials, then `reduce_splits_kernel` (kernels/triton_attention_split.py has
the heuristic and the merge).
"""

import math

import torch
import triton

from kernels._validate import FP8_KV_DTYPE, check_paged_attention
from kernels import triton_attention_split as split_kv
from kernels.triton_attention_kernel import paged_attention_kernel

_LOG2_E = math.log2(math.e)
MIN_HEAD_DIM = 16   # tl.dot needs K >= 16
MAX_HEAD_DIM = 256  # beyond this the fp32 accumulator no longer fits in registers
# Launch knobs (module-level so loadtest.kernel_bench --sweep can try them; the
# defaults are the pre-Hopper-tuning ones, to be replaced by measured values).
TILE_CAP = 32       # keys per inner step, at most (half that for head_dim > 128)
NUM_STAGES = 3      # software-pipelining depth (fp32 always uses 2)
NUM_WARPS = None    # None: 4 for head_dim <= 64, else 8
KV_TILE = None      # None: min(block_size, cap), one cache block per tile; an int forces
                    # TILE_N (tiles spanning several blocks then take the per-key gather)
NUM_SPLITS = None   # None: split-KV heuristic; an int forces that many segments (1 = unsplit)


def _interpreted() -> bool:
    # triton.jit picks the interpreter at decoration time from TRITON_INTERPRET.
    return "Interpret" in type(paged_attention_kernel).__name__


def _check_backend(query) -> None:
    head_dim = query.shape[2]
    if not MIN_HEAD_DIM <= head_dim <= MAX_HEAD_DIM:
        raise ValueError(
            f"head_dim {head_dim} unsupported by the Triton kernel "
            f"(needs {MIN_HEAD_DIM}..{MAX_HEAD_DIM}); use paged_attention_torch"
        )
    if query.device.type != "cuda" and not _interpreted():
        raise ValueError(
            f"Triton paged_attention needs CUDA tensors, got device {query.device} (set "
            "TRITON_INTERPRET=1 before importing triton to run it on CPU, or use "
            "kernels.torch_attention.paged_attention_torch)"
        )


def _launch_config(max_seqlen_q: int, group: int, head_dim: int, block_size: int,
                   dtype) -> dict:
    """Tile sizes: BLOCK_M = BLOCK_Q * GROUP_P score rows per program."""
    group_p = triton.next_power_of_2(group)
    head_dim_p = triton.next_power_of_2(head_dim)
    # tl.dot wants >= 16 rows; more than 64 rows per program only adds
    # masked waste for short chunks and register pressure for long ones.
    # Larger heads get fewer rows and keys per step so nothing spills.
    rows_cap = 64 if head_dim_p <= 128 else 32
    block_m = min(max(16, triton.next_power_of_2(max_seqlen_q) * group_p), rows_cap)
    block_m = max(block_m, group_p)
    tile_cap = TILE_CAP if head_dim_p <= 128 else TILE_CAP // 2
    # Tiles inside one cache block address K/V from one scalar block id.
    one_block = block_size >= 16 and block_size & (block_size - 1) == 0
    tile_n = min(block_size, tile_cap) if one_block else tile_cap
    if KV_TILE is not None:
        if KV_TILE < 16 or KV_TILE & (KV_TILE - 1):
            raise ValueError(f"KV_TILE must be a power of two >= 16 (tl.dot), got {KV_TILE!r}")
        tile_n = KV_TILE
        one_block = block_size % tile_n == 0
    return dict(
        GROUP=group,
        GROUP_P=group_p,
        HEAD_DIM=head_dim,
        HEAD_DIM_P=head_dim_p,
        BLOCK_Q=block_m // group_p,
        TILE_N=tile_n,
        ONE_BLOCK_TILES=one_block,
        UPCAST=_interpreted() and dtype == torch.bfloat16,
        IEEE_DOT=dtype == torch.float32,
        # From ptxas register counts on sm_90: 4 warps spill once head_dim > 64.
        num_warps=NUM_WARPS or (4 if head_dim_p <= 64 else 8),
        # fp32 tiles are twice as large; two stages keep shared memory in budget.
        num_stages=2 if dtype == torch.float32 else NUM_STAGES,
    )


def paged_attention(query, k_cache, v_cache, block_tables, seq_lens, cu_seqlens_q,
                    max_seqlen_q, softmax_scale, out=None, num_splits=None, *,
                    sliding_window=None, logits_soft_cap=None, sinks=None,
                    k_scale=None, v_scale=None):
    """Causal attention of new query rows over the paged cache (Triton, one or two launches).

    query:            [num_tokens, num_heads, head_dim]  (strided view allowed)
    k_cache, v_cache: [num_blocks, block_size, num_kv_heads, head_dim]  contiguous
    block_tables:     [num_seqs, max_blocks_per_seq]  int32 (int64 accepted)
    seq_lens:         [num_seqs]  context length incl. the new rows (already cached)
    cu_seqlens_q:     [num_seqs + 1]  query rows of seq s are cu[s]:cu[s+1]
    max_seqlen_q:     python int, the longest query chunk (picks tile sizes only)
    out:              [num_tokens, num_heads, head_dim]  or None to allocate
    num_splits:       None (the split-KV heuristic, or the module's NUM_SPLITS), 1 (plain
                      kernel) or n > 1 (every sequence's context in n segments + a reduce);
                      any batch is correct either way, prefill chunks included
    sliding_window:   None, or a row at position p sees keys p - sliding_window + 1 .. p
    logits_soft_cap:  None, or scores become cap * tanh(scores / cap)
    sinks:            None, or [num_heads] logits that join the softmax's denominator
                      (the last three as kernels.reference.paged_attention_ref)
    k_scale, v_scale: [1] fp32, required for (and only for) an fp8 (e4m3) cache, which is
                      read as cached value * scale (kernels/fp8_kv.py)
    Returns out.
    """
    check_paged_attention(query, k_cache, v_cache, block_tables, seq_lens, cu_seqlens_q,
                          max_seqlen_q, softmax_scale, out, sliding_window=sliding_window,
                          logits_soft_cap=logits_soft_cap, sinks=sinks, k_scale=k_scale,
                          v_scale=v_scale)
    _check_backend(query)
    if num_splits is None:
        num_splits = NUM_SPLITS
    if num_splits is not None:
        split_kv.check_num_splits(num_splits)
    if out is None:
        out = torch.empty(query.shape, dtype=query.dtype, device=query.device)
    num_tokens, num_heads, head_dim = query.shape
    num_seqs = block_tables.shape[0]
    if num_tokens == 0 or num_seqs == 0:
        return out
    num_kv_heads, block_size = k_cache.shape[2], k_cache.shape[1]
    if num_splits is None:
        # Host-known context bound: the table's width (or the window), never seq_lens (no sync).
        max_seqlen_k = block_tables.shape[1] * block_size
        if sliding_window is not None:
            max_seqlen_k = min(max_seqlen_k, sliding_window + max_seqlen_q)
        num_splits = split_kv.choose_num_splits(
            num_seqs, num_kv_heads, max_seqlen_q, max_seqlen_k, split_kv.num_sms(query.device))
    cfg = _launch_config(max_seqlen_q, num_heads // num_kv_heads, head_dim, block_size,
                         query.dtype)
    if num_splits > 1:
        part_o, part_m, part_l = split_kv.alloc_partials(num_tokens, num_heads, head_dim,
                                                         num_splits, query.device)
    else:
        part_o = part_m = part_l = out  # never touched: SPLIT is off
    # Upper bound on query tiles, see the kernel module docstring.
    grid = (num_tokens // cfg["BLOCK_Q"] + num_seqs, num_kv_heads, num_splits)
    paged_attention_kernel[grid](
        out, query, k_cache, v_cache, block_tables, seq_lens, cu_seqlens_q,
        part_o, part_m, part_l, out if sinks is None else sinks,
        out if k_scale is None else k_scale, out if v_scale is None else v_scale,
        float(softmax_scale) * _LOG2_E, float(logits_soft_cap or 1.0) * _LOG2_E,
        sliding_window or 0,
        num_seqs, block_tables.shape[1], num_splits,
        query.stride(0), query.stride(1), query.stride(2),
        out.stride(0), out.stride(1), out.stride(2),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        block_tables.stride(0),
        part_o.stride(0), part_o.stride(1),
        part_m.stride(0), part_m.stride(1),
        BLOCK_SIZE=block_size,
        SPLIT=num_splits > 1,
        SLIDING=sliding_window is not None,
        SOFT_CAP=logits_soft_cap is not None,
        HAS_SINKS=sinks is not None,
        FP8_KV=k_cache.dtype == FP8_KV_DTYPE,
        **cfg,
    )
    if num_splits > 1:
        split_kv.reduce_splits(out, part_o, part_m, part_l)
    return out
