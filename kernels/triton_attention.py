"""Host wrapper for the Triton paged-attention kernel: validation and launch config."""

import math

import torch
import triton

from kernels._validate import check_paged_attention
from kernels.triton_attention_kernel import paged_attention_kernel

_LOG2_E = math.log2(math.e)
MIN_HEAD_DIM = 16   # tl.dot needs K >= 16
MAX_HEAD_DIM = 256  # beyond this the fp32 accumulator no longer fits in registers
# Launch knobs (module-level so the benchmark can sweep them).
TILE_CAP = 32
NUM_STAGES = 3


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
    return dict(
        GROUP=group,
        GROUP_P=group_p,
        HEAD_DIM=head_dim,
        HEAD_DIM_P=head_dim_p,
        BLOCK_Q=block_m // group_p,
        TILE_N=min(block_size, tile_cap) if one_block else tile_cap,
        ONE_BLOCK_TILES=one_block,
        UPCAST=_interpreted() and dtype == torch.bfloat16,
        IEEE_DOT=dtype == torch.float32,
        # From ptxas register counts on sm_90: 4 warps spill once head_dim > 64.
        num_warps=4 if head_dim_p <= 64 else 8,
        # fp32 tiles are twice as large; two stages keep shared memory in budget.
        num_stages=2 if dtype == torch.float32 else NUM_STAGES,
    )


def paged_attention(query, k_cache, v_cache, block_tables, seq_lens, cu_seqlens_q,
                    max_seqlen_q, softmax_scale, out=None):
    """Causal attention of new query rows over the paged cache (Triton, one launch).

    query:            [num_tokens, num_heads, head_dim]  (strided view allowed)
    k_cache, v_cache: [num_blocks, block_size, num_kv_heads, head_dim]  contiguous
    block_tables:     [num_seqs, max_blocks_per_seq]  int32 (int64 accepted)
    seq_lens:         [num_seqs]  context length incl. the new rows (already cached)
    cu_seqlens_q:     [num_seqs + 1]  query rows of seq s are cu[s]:cu[s+1]
    max_seqlen_q:     python int, the longest query chunk (picks tile sizes only)
    out:              [num_tokens, num_heads, head_dim]  or None to allocate
    Returns out.
    """
    check_paged_attention(query, k_cache, v_cache, block_tables, seq_lens, cu_seqlens_q,
                          max_seqlen_q, softmax_scale, out)
    _check_backend(query)
    if out is None:
        out = torch.empty(query.shape, dtype=query.dtype, device=query.device)
    num_tokens, num_heads, head_dim = query.shape
    num_seqs = block_tables.shape[0]
    if num_tokens == 0 or num_seqs == 0:
        return out
    num_kv_heads = k_cache.shape[2]
    cfg = _launch_config(max_seqlen_q, num_heads // num_kv_heads, head_dim, k_cache.shape[1],
                         query.dtype)
    # Upper bound on query tiles, see the kernel module docstring.
    grid = (num_tokens // cfg["BLOCK_Q"] + num_seqs, num_kv_heads)
    paged_attention_kernel[grid](
        out, query, k_cache, v_cache, block_tables, seq_lens, cu_seqlens_q,
        float(softmax_scale) * _LOG2_E,
        num_seqs, block_tables.shape[1],
        query.stride(0), query.stride(1), query.stride(2),
        out.stride(0), out.stride(1), out.stride(2),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        block_tables.stride(0),
        BLOCK_SIZE=k_cache.shape[1],
        **cfg,
    )
    return out
