"""Triton fused mixture-of-experts: two grouped GEMMs over tokens sorted by expert.

    topk_ids [T, K] --moe_align_block_size--> sorted_ids [P], expert_ids [P / BLOCK_M]

`sorted_ids` lists the flat rows (token * K + k) grouped by expert, each expert's group
padded with the sentinel T*K up to a multiple of BLOCK_M, so every BLOCK_M-row tile of
it belongs to one expert (`expert_ids[tile]`):

    sorted_ids  | e0 e0 e0 -- | e2 e2 e2 e2 | e2 -- -- -- | e3 -- -- -- | (unused tiles)
    expert_ids  |     0       |      2      |      2      |      3      |
                                               num_tokens_post_padded = 16 ^

GEMM 1 (gated): each program takes one tile of rows and BLOCK_N columns of the
intermediate dim, gathers the rows' hidden states (row // K), multiplies by the tile's
expert's gate and up rows of w13 in one K-loop (two accumulators) and writes
silu(gate) * up to act [T*K, I]. GEMM 2: act rows times the expert's w2, scaled by the
row's routing weight, into y [T*K, H]. The K rows of each token are then summed in torch.
With per-expert biases (gpt-oss) each GEMM adds its expert's bias row to the accumulator
before the activation / the routing weight, and `ClampedSwiGLU` may replace SiLU-and-mul;
both are constexpr switches, so the plain SiLU kernel compiles as before.

Everything is sync-free and shape-static for a given T (the tile count is the worst
case; tiles past num_tokens_post_padded exit at once), so it runs inside CUDA graphs.
Block sizes for Hopper: `choose_config`.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.torch_fused_moe import ClampedSwiGLU, check_fused_moe


@triton.jit(do_not_specialize=["num_valid_rows"])
def _fused_moe_kernel(
    a_ptr,            # [num_a_rows, K_DIM]: hidden states [T, H] (GEMM 1) or act [T*K, I] (GEMM 2)
    b_ptr,            # [E, *, K_DIM]: w13 [E, 2*I, H] (GEMM 1) or w2 [E, H, I] (GEMM 2)
    c_ptr,            # [T*K, N]: act (GEMM 1) or y (GEMM 2)
    weights_ptr,      # [T*K] routing weight of each flat row (read when MUL_WEIGHT)
    sorted_ids_ptr,   # [num_tiles * BLOCK_M] flat rows grouped by expert; >= num_valid_rows is padding
    expert_ids_ptr,   # [num_tiles] the expert of each tile of sorted_ids
    num_post_pad_ptr,  # [1] rows of sorted_ids in use (a multiple of BLOCK_M)
    bias_ptr,         # [E, *]: b13 [E, 2*I] (GEMM 1) or b2 [E, H] (GEMM 2); read when HAS_BIAS
    N, K_DIM, num_valid_rows,
    stride_am, stride_ak, stride_be, stride_bn, stride_bk, stride_cm, stride_cn, stride_bias_e,
    swiglu_alpha, swiglu_limit,  # CLAMPED_SWIGLU's constants
    A_ROW_DIV: tl.constexpr,   # flat row -> row of a: top_k for GEMM 1 (a is per token), 1 for GEMM 2
    GATED: tl.constexpr,       # b holds gate rows [0, N) and up rows [N, 2N): write silu(gate) * up
    CLAMPED_SWIGLU: tl.constexpr,  # GATED with gpt-oss's (up + 1) * g * sigmoid(alpha * g), both clamped
    HAS_BIAS: tl.constexpr,    # add the expert's bias row (gate and up halves when GATED)
    MUL_WEIGHT: tl.constexpr,  # scale each row by its routing weight
    IEEE_DOT: tl.constexpr,    # fp32 inputs: exact fp32 products, not TF32
    UPCAST: tl.constexpr,      # run the dots in fp32 (the interpreter lacks a bf16 dot)
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
):
    # Grouped launch order: GROUP_M row tiles sweep the N tiles together, so the expert
    # weights a group reads stay in L2.
    pid = tl.program_id(0)
    num_tiles_m = tl.num_programs(0) // tl.cdiv(N, BLOCK_N)
    num_tiles_n = tl.cdiv(N, BLOCK_N)
    group = pid // (GROUP_M * num_tiles_n)
    first_m = group * GROUP_M
    group_size = min(num_tiles_m - first_m, GROUP_M)
    pid_m = first_m + (pid % (GROUP_M * num_tiles_n)) % group_size
    pid_n = (pid % (GROUP_M * num_tiles_n)) // group_size

    if pid_m * BLOCK_M >= tl.load(num_post_pad_ptr):
        return  # a tile past the padded rows in use: the worst-case grid's spare programs
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rows = tl.load(sorted_ids_ptr + offs_m).to(tl.int64)  # [BLOCK_M] flat rows
    row_ok = rows < num_valid_rows
    expert = tl.load(expert_ids_ptr + pid_m).to(tl.int64)

    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # [BLOCK_N]
    n_ok = offs_n < N
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + (rows // A_ROW_DIV)[:, None] * stride_am + offs_k[None, :] * stride_ak  # [BLOCK_M, BLOCK_K]
    b_ptrs = (b_ptr + expert * stride_be + offs_n[None, :].to(tl.int64) * stride_bn
              + offs_k[:, None] * stride_bk)  # [BLOCK_K, BLOCK_N]: b^T tile
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K_DIM, BLOCK_K):
        k_ok = offs_k < K_DIM - k0
        a = tl.load(a_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        b = tl.load(b_ptrs, mask=k_ok[:, None] & n_ok[None, :], other=0.0)
        if UPCAST:
            a = a.to(tl.float32)
            b = b.to(tl.float32)
        if IEEE_DOT:
            acc = tl.dot(a, b, acc, input_precision="ieee")
        else:
            acc = tl.dot(a, b, acc)
        if GATED:
            b_up = tl.load(b_ptrs + N * stride_bn, mask=k_ok[:, None] & n_ok[None, :], other=0.0)
            if UPCAST:
                b_up = b_up.to(tl.float32)
            if IEEE_DOT:
                acc_up = tl.dot(a, b_up, acc_up, input_precision="ieee")
            else:
                acc_up = tl.dot(a, b_up, acc_up)
        a_ptrs += BLOCK_K * stride_ak
        b_ptrs += BLOCK_K * stride_bk

    if HAS_BIAS:
        bias_row = bias_ptr + expert * stride_bias_e
        acc += tl.load(bias_row + offs_n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
        if GATED:
            acc_up += tl.load(bias_row + N + offs_n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    if CLAMPED_SWIGLU:
        gate = tl.minimum(acc, swiglu_limit)
        up = tl.minimum(tl.maximum(acc_up, -swiglu_limit), swiglu_limit)
        acc = (up + 1.0) * (gate * tl.sigmoid(gate * swiglu_alpha))
    elif GATED:
        acc = acc * tl.sigmoid(acc) * acc_up  # silu(gate) * up, in fp32
    if MUL_WEIGHT:
        w = tl.load(weights_ptr + rows, mask=row_ok, other=0.0).to(tl.float32)
        acc = acc * w[:, None]
    c_ptrs = c_ptr + rows[:, None] * stride_cm + offs_n[None, :] * stride_cn
    tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=row_ok[:, None] & n_ok[None, :])


def _interpreted() -> bool:
    # triton.jit picks the interpreter at decoration time from TRITON_INTERPRET.
    return "Interpret" in type(_fused_moe_kernel).__name__


def moe_align_block_size(topk_ids: torch.Tensor, num_experts: int, block_m: int):
    """Flat rows grouped by expert, each group padded to a multiple of block_m (see the module doc).

    topk_ids: [T, K] -> (sorted_ids [num_tiles * block_m] int32, padding = T*K;
    expert_ids [num_tiles] int32; num_post_pad [1] int32). num_tiles is the worst case
    for T*K rows (at most min(T*K, E) experts get a partial tile), so no host sync.
    """
    flat = topk_ids.reshape(-1).to(torch.int64)
    num_rows = flat.numel()
    device = flat.device
    counts = torch.zeros(num_experts, dtype=torch.int64, device=device)
    counts.scatter_add_(0, flat, torch.ones_like(flat))  # bincount without its host read
    padded = (counts + block_m - 1) // block_m * block_m
    padded_end = padded.cumsum(0)  # [E]
    order = torch.argsort(flat, stable=True)  # flat rows, expert by expert
    sorted_experts = flat[order]
    rank_in_expert = torch.arange(num_rows, device=device) - (counts.cumsum(0) - counts)[sorted_experts]
    dest = (padded_end - padded)[sorted_experts] + rank_in_expert
    num_tiles = triton.cdiv(num_rows + min(num_rows, num_experts) * (block_m - 1), block_m)
    sorted_ids = torch.full((num_tiles * block_m,), num_rows, dtype=torch.int32, device=device)
    sorted_ids[dest] = order.to(torch.int32)
    tile_starts = torch.arange(num_tiles, device=device) * block_m
    # The expert whose padded range holds the tile; tiles past the end say E - 1, unread.
    expert_ids = torch.searchsorted(padded_end, tile_starts, right=True).clamp_(max=num_experts - 1)
    return sorted_ids, expert_ids.to(torch.int32), padded_end[-1:].to(torch.int32)


def choose_config(num_tokens: int, top_k: int, num_experts: int, dtype: torch.dtype) -> dict:
    """Tile sizes for Hopper (H100/H200) by the rows each expert gets on average.

    Decode (a few rows per expert): BLOCK_M 16, the smallest tl.dot tile, since most of
    a larger tile would be padding; the GEMM is then a weight stream, so wide BLOCK_K
    keeps loads long (128 bf16 = 256 B per row). Larger batches grow BLOCK_M to reuse
    each weight tile over more rows, and GROUP_M > 1 lets row tiles share it in L2.
    fp32 halves BLOCK_K (same bytes per stage). These follow the shape of vLLM's
    published H100 tables; they are not tuned here (no GPU measured them yet).
    """
    rows_per_expert = num_tokens * top_k / num_experts
    if rows_per_expert <= 16:
        config = dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=128, GROUP_M=1, num_warps=4, num_stages=4)
    elif rows_per_expert <= 64:
        config = dict(BLOCK_M=32, BLOCK_N=64, BLOCK_K=128, GROUP_M=8, num_warps=4, num_stages=3)
    elif rows_per_expert <= 512:
        config = dict(BLOCK_M=64, BLOCK_N=128, BLOCK_K=64, GROUP_M=8, num_warps=4, num_stages=3)
    else:
        config = dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, GROUP_M=16, num_warps=8, num_stages=3)
    if dtype == torch.float32:
        config["BLOCK_K"] //= 2
    return config


def _launch(a, b, c, weights, sorted_ids, expert_ids, num_post_pad, n, k_dim, a_row_div, gated,
            config, bias=None, activation: ClampedSwiGLU | None = None) -> None:
    meta = {k: v for k, v in config.items() if k not in ("num_warps", "num_stages")}
    num_tiles = expert_ids.shape[0]
    grid = (num_tiles * triton.cdiv(n, config["BLOCK_N"]),)
    clamped = gated and activation is not None
    _fused_moe_kernel[grid](
        a, b, c, weights, sorted_ids, expert_ids, num_post_pad, b if bias is None else bias,
        n, k_dim, c.shape[0],
        a.stride(0), a.stride(1), b.stride(0), b.stride(1), b.stride(2), c.stride(0), c.stride(1),
        0 if bias is None else bias.stride(0),
        activation.alpha if clamped else 0.0, activation.limit if clamped else 0.0,
        A_ROW_DIV=a_row_div, GATED=gated, CLAMPED_SWIGLU=clamped, HAS_BIAS=bias is not None,
        MUL_WEIGHT=not gated, IEEE_DOT=a.dtype == torch.float32,
        UPCAST=_interpreted() and a.dtype == torch.bfloat16,
        num_warps=config.get("num_warps", 4), num_stages=config.get("num_stages", 2), **meta)


def fused_moe(hidden_states: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
              topk_weights: torch.Tensor, topk_ids: torch.Tensor, config: dict | None = None,
              b13: torch.Tensor | None = None, b2: torch.Tensor | None = None,
              activation: ClampedSwiGLU | None = None) -> torch.Tensor:
    """Each token through its top_k experts, summed with the routing weights (Triton).

    hidden_states: [T, H]; w13: [E, 2 * I, H] (gate rows, then up rows); w2: [E, H, I]
    topk_weights: [T, K]; topk_ids: [T, K]. config: tile sizes (default: choose_config).
    b13 [E, 2 * I], b2 [E, H]: per-expert biases or None; activation: None for SiLU-and-mul.
    Returns [T, H] in hidden_states' dtype.
    """
    check_fused_moe(hidden_states, w13, w2, topk_weights, topk_ids, b13, b2)
    if hidden_states.device.type != "cuda" and not _interpreted():
        raise ValueError(f"Triton fused_moe needs CUDA tensors, got device {hidden_states.device} "
                         "(set TRITON_INTERPRET=1 before importing triton to run it on CPU, or use "
                         "kernels.torch_fused_moe.fused_moe_torch)")
    num_tokens, top_k = topk_ids.shape
    num_experts, two_inter, hidden = w13.shape
    inter = two_inter // 2
    if num_tokens == 0:
        return torch.empty_like(hidden_states)
    config = config or choose_config(num_tokens, top_k, num_experts, hidden_states.dtype)
    sorted_ids, expert_ids, num_post_pad = moe_align_block_size(topk_ids, num_experts, config["BLOCK_M"])
    weights = topk_weights.reshape(-1).to(torch.float32)
    act = hidden_states.new_empty(num_tokens * top_k, inter)  # [T*K, I]
    y = hidden_states.new_empty(num_tokens * top_k, hidden)  # [T*K, H], weighted
    _launch(hidden_states, w13, act, weights, sorted_ids, expert_ids, num_post_pad, inter, hidden,
            top_k, True, config, b13, activation)
    _launch(act, w2, y, weights, sorted_ids, expert_ids, num_post_pad, hidden, inter, 1, False, config, b2)
    return y.view(num_tokens, top_k, hidden).sum(dim=1)


def fused_moe_ref(hidden_states: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                  topk_weights: torch.Tensor, topk_ids: torch.Tensor, b13: torch.Tensor | None = None,
                  b2: torch.Tensor | None = None, activation: ClampedSwiGLU | None = None) -> torch.Tensor:
    """Dense oracle (tests only): every expert on every token in float64, then the routing
    weights as a [T, E] matrix that is zero outside each token's top_k."""
    x = hidden_states.double()
    gate_up = torch.einsum("th,eih->eti", x, w13.double())  # [E, T, 2I]
    if b13 is not None:
        gate_up = gate_up + b13.double()[:, None, :]
    if activation is None:
        gate, up = gate_up.chunk(2, dim=-1)  # [E, T, I] each
        act = torch.nn.functional.silu(gate) * up
    else:
        act = activation(gate_up)
    expert_out = torch.einsum("eti,ehi->eth", act, w2.double())  # [E, T, H]
    if b2 is not None:
        expert_out = expert_out + b2.double()[:, None, :]
    dense = torch.zeros(x.shape[0], w13.shape[0], dtype=torch.float64, device=x.device)
    dense.scatter_(1, topk_ids.long(), topk_weights.double())  # [T, E]
    return torch.einsum("te,eth->th", dense, expert_out).to(hidden_states.dtype)
