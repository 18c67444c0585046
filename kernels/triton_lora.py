"""Multi-LoRA deltas on CUDA: a shrink and an expand kernel over the tokens grouped by slot (Punica's
idea, vLLM's lora_shrink / lora_expand at our size).

A step's rows run different adapters; each adapter sits in a slot s of the layer's stacked weights
(R = max rank, P = fused parts, N = P * R):

    lora_a [max_loras, N, K]      part p's A in rows p*R .. p*R + r, zero-padded
    lora_b [max_loras, out, N]    part p's (scaled) B in its output rows and columns p*R .. p*R + R:
                                  block-diagonal over the parts (off-diagonal blocks are never read)

The token -> slot mapping arrives as a sorted index (kernels/lora_mapping.py: `sorted_token_ids`,
the rows grouped by slot with base rows last, and `slot_starts`, where each slot's group begins),
so every BLOCK_M tile of one slot's rows multiplies by one adapter's weights, and base rows are in
no slot's range (never read, never written). Both grids are (row tiles of the whole step, ...,
max_loras): shape-static for a given number of rows, with the tiles past a slot's row count exiting
at once, so the pair runs inside CUDA graphs with the two index tensors in static buffers.

    shrink  buf[k_split, t, :] = x[t, k-range] @ lora_a[slot(t), :, k-range].T   fp32 partial sums
    expand  y[t, part p]      += sum_splits(buf[:, t, p*R : p*R + R]) @ lora_b[slot(t), part p, p*R : ..].T

The shrink splits K (the hidden size, long) over SPLIT_K programs so a decode step's few tiles fill
the GPU; the expand sums the splits as it loads them (no atomics: the result does not depend on
the order programs run). The expand reads only the diagonal blocks of B, so a fused layer's delta
costs its parts' FLOPs, not P times them.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.lora_mapping import check_lora_expand, check_lora_shrink



@triton.jit
def _lora_shrink_kernel(
    x_ptr,             # [num_tokens, K] the layer's input rows
    a_ptr,             # [max_loras, N, K] lora_a
    buf_ptr,           # [SPLIT_K, num_tokens, N] fp32 out, adapter rows only (base rows untouched)
    sorted_ids_ptr,    # [num_tokens] int32 rows grouped by slot
    slot_starts_ptr,   # [max_loras + 1] int32 slot s's entries of sorted_ids: starts[s] .. starts[s + 1]
    N, K, k_per_split,
    stride_xm, stride_xk, stride_as, stride_an, stride_ak, stride_bufs, stride_bufm,
    IEEE_DOT: tl.constexpr,  # fp32 inputs: exact fp32 products, not TF32
    UPCAST: tl.constexpr,    # half inputs computed in fp32 (the interpreter lacks a bf16 dot)
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    pid_m = tl.program_id(0)
    split = tl.program_id(1) // tl.cdiv(N, BLOCK_N)
    pid_n = tl.program_id(1) % tl.cdiv(N, BLOCK_N)
    slot = tl.program_id(2)
    start = tl.load(slot_starts_ptr + slot)
    count = tl.load(slot_starts_ptr + slot + 1) - start
    if pid_m * BLOCK_M >= count:
        return  # this slot has fewer rows (or none): the static grid's spare programs
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    m_ok = offs_m < count
    rows = tl.load(sorted_ids_ptr + start + offs_m, mask=m_ok, other=0).to(tl.int64)  # [BLOCK_M]
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    offs_k = tl.arange(0, BLOCK_K)
    k_lo = split * k_per_split
    k_hi = tl.minimum(k_lo + k_per_split, K)
    a_base = a_ptr + slot.to(tl.int64) * stride_as + offs_n[None, :] * stride_an  # [1, BLOCK_N]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, k_per_split, BLOCK_K):  # this split's K range, the last one cut at K
        k = k_lo + k0 + offs_k
        k_ok = k < k_hi
        x = tl.load(x_ptr + rows[:, None] * stride_xm + k[None, :] * stride_xk,
                    mask=m_ok[:, None] & k_ok[None, :], other=0.0)                 # [BLOCK_M, BLOCK_K]
        a = tl.load(a_base + k[:, None] * stride_ak, mask=k_ok[:, None] & n_ok[None, :], other=0.0)  # A^T tile
        if UPCAST:
            x = x.to(tl.float32)
            a = a.to(tl.float32)
        if IEEE_DOT:
            acc = tl.dot(x, a, acc, input_precision="ieee")
        else:
            acc = tl.dot(x, a, acc)
    # Every split stores, an empty K range too (zeros): the expand sums all SPLIT_K of them.
    buf_ptrs = buf_ptr + split * stride_bufs + rows[:, None] * stride_bufm + offs_n[None, :]
    tl.store(buf_ptrs, acc, mask=m_ok[:, None] & n_ok[None, :])


@triton.jit
def _lora_expand_kernel(
    buf_ptr,           # [SPLIT_K, num_tokens, N] fp32, the shrink's partial sums
    b_ptr,             # [max_loras, out, N] lora_b, block-diagonal over the parts
    y_ptr,             # [num_tokens, out] the layer's output: += the delta on adapter rows
    sorted_ids_ptr,    # [num_tokens] int32 rows grouped by slot
    slot_starts_ptr,   # [max_loras + 1] int32
    part_offsets_ptr,  # [NUM_PARTS + 1] int32 part p's output rows: offsets[p] .. offsets[p + 1]
    R,                 # rank columns per part (max_lora_rank)
    stride_bufs, stride_bufm, stride_bs, stride_bn, stride_bk, stride_ym, stride_yn,
    SPLIT_K: tl.constexpr, NUM_PARTS: tl.constexpr,
    IEEE_DOT: tl.constexpr, UPCAST: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    slot = tl.program_id(2) // NUM_PARTS
    part = tl.program_id(2) % NUM_PARTS
    start = tl.load(slot_starts_ptr + slot)
    count = tl.load(slot_starts_ptr + slot + 1) - start
    part_lo = tl.load(part_offsets_ptr + part)
    part_hi = tl.load(part_offsets_ptr + part + 1)
    n0 = part_lo + pid_n * BLOCK_N
    if (pid_m * BLOCK_M >= count) | (n0 >= part_hi):
        return  # no rows of this slot here, or past this part's outputs (the grid fits the widest part)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    m_ok = offs_m < count
    rows = tl.load(sorted_ids_ptr + start + offs_m, mask=m_ok, other=0).to(tl.int64)  # [BLOCK_M]
    offs_n = n0 + tl.arange(0, BLOCK_N)
    n_ok = offs_n < part_hi
    offs_r = tl.arange(0, BLOCK_R)
    r_ok = offs_r < R
    cols = part * R + offs_r  # this part's diagonal block of B, and its columns of buf
    t = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
    for s in range(SPLIT_K):
        t += tl.load(buf_ptr + s * stride_bufs + rows[:, None] * stride_bufm + cols[None, :],
                     mask=m_ok[:, None] & r_ok[None, :], other=0.0)
    # B^T tile [BLOCK_R, BLOCK_N]: rows of this part, its diagonal block's columns
    b = tl.load(b_ptr + slot.to(tl.int64) * stride_bs + offs_n[None, :].to(tl.int64) * stride_bn
                + cols[:, None] * stride_bk, mask=r_ok[:, None] & n_ok[None, :], other=0.0)
    if UPCAST:
        b = b.to(tl.float32)
    else:
        t = t.to(b_ptr.dtype.element_ty)  # the shrink's result in the weights' dtype, as the torch path rounds it
    if IEEE_DOT:
        delta = tl.dot(t, b, input_precision="ieee")
    else:
        delta = tl.dot(t, b)
    y_ptrs = y_ptr + rows[:, None] * stride_ym + offs_n[None, :] * stride_yn
    mask = m_ok[:, None] & n_ok[None, :]
    y = tl.load(y_ptrs, mask=mask, other=0.0).to(tl.float32)
    tl.store(y_ptrs, (y + delta).to(y_ptr.dtype.element_ty), mask=mask)


def _interpreted() -> bool:
    # triton.jit picks the interpreter at decoration time from TRITON_INTERPRET.
    return "Interpret" in type(_lora_shrink_kernel).__name__


def choose_config(num_tokens: int, k: int, dtype: torch.dtype) -> dict:
    """Tiles for Hopper by the step's row count (not tuned on a GPU yet).

    Decode-sized steps: 16-row tiles (the smallest tl.dot tile) and the shrink's K split up to
    8 ways, since a handful of row tiles would leave most SMs idle while each program walks the
    whole hidden size; the shrink is then a stream of A, read in wide BLOCK_K loads. Larger
    steps: 64-row tiles reuse each weight tile over more rows and need no split. fp32 halves
    BLOCK_K (same bytes per stage).
    """
    if num_tokens <= 64:
        config = dict(BLOCK_M=16, BLOCK_K=256, SPLIT_K=max(1, min(8, k // 512)), EXPAND_BLOCK_N=64)
    else:
        config = dict(BLOCK_M=64, BLOCK_K=64, SPLIT_K=1, EXPAND_BLOCK_N=128)
    if dtype == torch.float32:
        config["BLOCK_K"] //= 2
    return config


def shrink_meta(n: int, k: int, config: dict) -> dict:
    """The shrink's tiles for N = P * R outputs and K inputs, and each split's K length
    (whole BLOCK_K steps, so only the last split's last step is partial)."""
    block_k = config["BLOCK_K"]
    return dict(BLOCK_M=config["BLOCK_M"], BLOCK_N=max(16, min(64, triton.next_power_of_2(n))), BLOCK_K=block_k,
                k_per_split=triton.cdiv(triton.cdiv(k, config["SPLIT_K"]), block_k) * block_k)


def expand_meta(rank: int, config: dict) -> dict:
    """The expand's tiles: one BLOCK_R covers a part's rank columns (tl.dot needs >= 16)."""
    return dict(BLOCK_M=config["BLOCK_M"], BLOCK_N=config["EXPAND_BLOCK_N"],
                BLOCK_R=max(16, triton.next_power_of_2(rank)))


def _check_runs_here(t: torch.Tensor, name: str) -> None:
    if t.device.type != "cuda" and not _interpreted():
        raise ValueError(f"Triton {name} needs CUDA tensors, got device {t.device} (set TRITON_INTERPRET=1 "
                         "before importing triton to run it on CPU, or use engine/layers/lora.py's torch path)")


def lora_shrink(x: torch.Tensor, lora_a: torch.Tensor, sorted_token_ids: torch.Tensor,
                slot_starts: torch.Tensor, config: dict | None = None) -> torch.Tensor:
    """x [num_tokens, K] -> buf [SPLIT_K, num_tokens, N] fp32: the partial sums of x[t] @
    lora_a[slot(t)].T over SPLIT_K ranges of K, on the rows of a slot (base rows unwritten)."""
    check_lora_shrink(x, lora_a, sorted_token_ids, slot_starts)
    _check_runs_here(x, "lora_shrink")
    config = config or choose_config(x.shape[0], x.shape[1], x.dtype)
    max_loras, n, k = lora_a.shape
    buf = torch.empty(config["SPLIT_K"], x.shape[0], n, dtype=torch.float32, device=x.device)
    if x.shape[0] == 0:
        return buf
    meta = shrink_meta(n, k, config)
    k_per_split = meta.pop("k_per_split")
    grid = (triton.cdiv(x.shape[0], meta["BLOCK_M"]), config["SPLIT_K"] * triton.cdiv(n, meta["BLOCK_N"]), max_loras)
    _lora_shrink_kernel[grid](
        x, lora_a, buf, sorted_token_ids, slot_starts, n, k, k_per_split,
        x.stride(0), x.stride(1), lora_a.stride(0), lora_a.stride(1), lora_a.stride(2),
        buf.stride(0), buf.stride(1),
        IEEE_DOT=x.dtype == torch.float32, UPCAST=_interpreted() and x.dtype != torch.float32,
        num_warps=4, num_stages=3, **meta)
    return buf


def lora_expand(buf: torch.Tensor, lora_b: torch.Tensor, y: torch.Tensor, sorted_token_ids: torch.Tensor,
                slot_starts: torch.Tensor, part_offsets: torch.Tensor, config: dict | None = None) -> None:
    """y [num_tokens, out] += buf's split sums [num_tokens, N] @ lora_b[slot(t)].T, part by part
    (part p's output rows times its diagonal block), on the rows of a slot; base rows untouched."""
    check_lora_expand(buf, lora_b, y, sorted_token_ids, slot_starts, part_offsets)
    _check_runs_here(y, "lora_expand")
    num_tokens, out = y.shape
    if num_tokens == 0:
        return
    config = config or choose_config(num_tokens, 0, y.dtype)
    max_loras, _, n = lora_b.shape
    num_parts = part_offsets.shape[0] - 1
    meta = expand_meta(n // num_parts, config)
    # The widest part bounds the n tiles; a part's tiles past its own rows exit at once. Part
    # widths are not read from the device: `out` is an upper bound for any of them.
    grid = (triton.cdiv(num_tokens, meta["BLOCK_M"]), triton.cdiv(out, meta["BLOCK_N"]), max_loras * num_parts)
    _lora_expand_kernel[grid](
        buf, lora_b, y, sorted_token_ids, slot_starts, part_offsets, n // num_parts,
        buf.stride(0), buf.stride(1), lora_b.stride(0), lora_b.stride(1), lora_b.stride(2),
        y.stride(0), y.stride(1),
        SPLIT_K=buf.shape[0], NUM_PARTS=num_parts, IEEE_DOT=y.dtype == torch.float32,
        UPCAST=_interpreted() and y.dtype != torch.float32, num_warps=4, num_stages=1, **meta)


def add_lora(y: torch.Tensor, x: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor,
             sorted_token_ids: torch.Tensor, slot_starts: torch.Tensor, part_offsets: torch.Tensor) -> None:
    """y += (x @ lora_a[slot].T) @ lora_b[slot].T on each slot's rows: shrink, then expand."""
    config = choose_config(x.shape[0], x.shape[1], x.dtype)
    buf = lora_shrink(x, lora_a, sorted_token_ids, slot_starts, config)
    lora_expand(buf, lora_b, y, sorted_token_ids, slot_starts, part_offsets, config)
