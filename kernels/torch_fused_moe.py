"""Mixture-of-experts feed-forward in plain torch: the CPU path (any device runs it).

Each token goes through its `top_k` experts (a gated SiLU MLP each) and the results are
summed with the routing weights. The tokens are sorted by expert once; each expert that
got any token then runs two matmuls on its contiguous slice of rows, so the Python loop is
over active experts (at most num_experts per layer), never over tokens:

    topk_ids [T, K] --flatten--> [T*K] --argsort (stable)--> order: flat rows grouped by expert
    x = hidden[order // K]                              [T*K, H], expert 0's rows first
    for each expert e with n_e > 0 rows:  y[rows_e] = silu(x W_gate^T) * (x W_up^T) @ W_down^T
    y *= topk_weights[order];  out = y[argsort(order)].view(T, K, H).sum(1)

Un-permuting with a gather and summing each token's K rows is deterministic and, on CPU,
hundreds of times faster than an index_add_ of the sorted rows (21 ms against 0.07 ms
for 1200 rows of 64 on the 2-core box). With K = 2 the sum equals HF transformers' to the bit
(it adds the experts to zeros one at a time: 0 + a + b = b + a).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kernels import cpu_ops


@dataclass(frozen=True)
class ClampedSwiGLU:
    """gpt-oss's expert activation on [gate | up]: the gate clamped above at `limit`, up to
    [-limit, limit], then (up + 1) * gate * sigmoid(alpha * gate)."""

    alpha: float = 1.702
    limit: float = 7.0

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """[n, 2 * d] laid out [gate | up] -> [n, d], in x's dtype."""
        gate, up = x.chunk(2, dim=-1)
        gate = gate.clamp(max=self.limit)
        up = up.clamp(min=-self.limit, max=self.limit)
        return (up + 1) * (gate * torch.sigmoid(gate * self.alpha))


def check_fused_moe(hidden_states, w13, w2, topk_weights, topk_ids, b13=None, b2=None) -> None:
    """ValueError naming the argument whose shape or dtype does not fit the others."""
    if hidden_states.dim() != 2:
        raise ValueError(f"hidden_states must be [num_tokens, hidden], got shape {tuple(hidden_states.shape)}")
    if w13.dim() != 3 or w2.dim() != 3:
        raise ValueError(f"w13 and w2 must be 3-D, got {tuple(w13.shape)} and {tuple(w2.shape)}")
    num_experts, two_inter, hidden = w13.shape
    if hidden != hidden_states.shape[1] or two_inter % 2:
        raise ValueError(f"w13 {tuple(w13.shape)} is not [num_experts, 2 * intermediate, hidden="
                         f"{hidden_states.shape[1]}]")
    if tuple(w2.shape) != (num_experts, hidden, two_inter // 2):
        raise ValueError(f"w2 {tuple(w2.shape)} is not [num_experts={num_experts}, hidden={hidden}, "
                         f"intermediate={two_inter // 2}]")
    if w13.dtype != hidden_states.dtype or w2.dtype != hidden_states.dtype:
        raise ValueError(f"weights ({w13.dtype}, {w2.dtype}) and hidden_states ({hidden_states.dtype}) "
                         "must share a dtype")
    if topk_ids.dim() != 2 or topk_ids.shape[0] != hidden_states.shape[0]:
        raise ValueError(f"topk_ids {tuple(topk_ids.shape)} is not [num_tokens={hidden_states.shape[0]}, top_k]")
    if topk_weights.shape != topk_ids.shape:
        raise ValueError(f"topk_weights {tuple(topk_weights.shape)} != topk_ids {tuple(topk_ids.shape)}")
    if topk_ids.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"topk_ids has dtype {topk_ids.dtype}; expected int32 or int64")
    for name, bias, shape in (("b13", b13, (num_experts, two_inter)), ("b2", b2, (num_experts, hidden))):
        if bias is not None and (tuple(bias.shape) != shape or bias.dtype != hidden_states.dtype):
            raise ValueError(f"{name} {tuple(bias.shape)} {bias.dtype} is not {shape} {hidden_states.dtype}")


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """[n, 2 * d] laid out [gate | up] -> silu(gate) * up [n, d]."""
    fused = cpu_ops.silu_and_mul(x)  # CPU fp32 / bf16 / fp16: one pass, no temporary
    if fused is not None:
        return fused
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate).mul_(up)


def fused_moe_torch(hidden_states: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                    topk_weights: torch.Tensor, topk_ids: torch.Tensor, expert_linear=None,
                    b13: torch.Tensor | None = None, b2: torch.Tensor | None = None,
                    activation: ClampedSwiGLU | None = None) -> torch.Tensor:
    """Each token through its top_k experts, summed with the routing weights.

    hidden_states: [T, H]; w13: [E, 2 * I, H] (gate rows, then up rows); w2: [E, H, I]
    topk_weights: [T, K] (any float dtype; applied in hidden_states' dtype); topk_ids: [T, K]
    expert_linear(x, expert, proj) -> x @ W^T of w13[expert] (proj 0) or w2[expert] (proj 1) by
    the caller's own means (weights packed for oneDNN); None: F.linear on the slices.
    b13: [E, 2 * I], b2: [E, H] per-expert biases or None; activation: None for SiLU-and-mul.
    Returns [T, H] in hidden_states' dtype.
    """
    check_fused_moe(hidden_states, w13, w2, topk_weights, topk_ids, b13, b2)
    act_fn = silu_and_mul if activation is None else activation
    num_tokens, top_k = topk_ids.shape
    flat_ids = topk_ids.reshape(-1)
    order = torch.argsort(flat_ids, stable=True)  # [T*K] flat (token * K + k) rows, grouped by expert
    counts = torch.bincount(flat_ids, minlength=w13.shape[0]).tolist()  # the one host read
    token_of_row = order // top_k
    x = hidden_states.index_select(0, token_of_row)  # [T*K, H]
    y = torch.empty_like(x)
    start = 0
    for expert, n in enumerate(counts):
        if n == 0:
            continue
        rows = slice(start, start + n)
        if expert_linear is None:
            act = act_fn(F.linear(x[rows], w13[expert], None if b13 is None else b13[expert]))  # [n, I]
            if b2 is None:
                torch.mm(act, w2[expert].t(), out=y[rows])
            else:
                torch.addmm(b2[expert], act, w2[expert].t(), out=y[rows])
        else:
            h = expert_linear(x[rows], expert, 0)
            if b13 is not None:
                h += b13[expert]
            y[rows] = expert_linear(act_fn(h), expert, 1)
            if b2 is not None:
                y[rows] += b2[expert]
        start += n
    y.mul_(topk_weights.reshape(-1).index_select(0, order).to(y.dtype).unsqueeze(1))
    unsort = torch.empty_like(order)
    unsort[order] = torch.arange(order.numel(), device=order.device)  # sorted position of each flat row
    return y.index_select(0, unsort).view(num_tokens, top_k, -1).sum(dim=1)
