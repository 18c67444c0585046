"""Activations on fused projections: [n, 2 * d] laid out as [gate | up] -> act(gate) * up."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kernels import cpu_ops


class SiluAndMul(nn.Module):
    """[n, 2 * d] laid out as [gate | up] -> silu(gate) * up, [n, d]."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        fused = cpu_ops.silu_and_mul(x)  # CPU fp32/bf16/fp16: one pass, no temporary
        if fused is not None:
            return fused
        gate, up = x.chunk(2, dim=-1)
        return F.silu(gate).mul_(up)


class GeluAndMul(nn.Module):
    """[n, 2 * d] laid out as [gate | up] -> gelu(gate) * up, [n, d]. approximate="tanh" is HF's
    gelu_pytorch_tanh (Gemma's hidden_activation), "none" the exact erf GELU."""

    def __init__(self, approximate: str = "none"):
        super().__init__()
        if approximate not in ("none", "tanh"):
            raise ValueError(f"approximate={approximate!r} is invalid: choose 'none' or 'tanh'")
        self.approximate = approximate

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = x.chunk(2, dim=-1)
        return F.gelu(gate, approximate=self.approximate).mul_(up)
