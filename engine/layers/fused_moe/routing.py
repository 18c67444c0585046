"""The router: which experts each token goes to, and with what weight.

Routing math runs in float32 whatever the model dtype (HF transformers takes the
softmax in float32 too): near-tied router scores are where a bf16 softmax would pick a
different expert than the checkpoint's own code.
"""
from __future__ import annotations

import torch
from torch import nn

from engine.layers.linear import LinearBase


class ReplicatedLinear(LinearBase):
    """A linear layer every TP rank holds whole (the router, a shared expert's gate): [n, in] -> [n, out]."""

    def __init__(self, input_size: int, output_size: int, bias: bool = False):
        super().__init__(input_size, output_size, bias, None)


def select_experts(router_logits: torch.Tensor, top_k: int, renormalize: bool,
                   softmax_first: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """router_logits [T, E] -> (topk_weights [T, top_k] float32, topk_ids [T, top_k] int64).

    softmax_first: softmax over all E experts, then the top_k of those probabilities (Mixtral,
    Qwen2-MoE, Qwen3-MoE), renormalised to sum to 1 when `renormalize` (Mixtral always;
    Qwen's `norm_topk_prob`). Otherwise the top_k logits first, then a softmax over just
    those (the same weights as renormalising, in another rounding order).
    """
    logits = router_logits.float()
    if not softmax_first:
        top_logits, topk_ids = logits.topk(top_k, dim=-1)
        return top_logits.softmax(dim=-1), topk_ids
    topk_weights, topk_ids = logits.softmax(dim=-1).topk(top_k, dim=-1)
    if renormalize:
        topk_weights = topk_weights / topk_weights.sum(dim=-1, keepdim=True)
    return topk_weights, topk_ids
