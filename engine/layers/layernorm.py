"""RMSNorm with an optional fused residual add (vLLM's calling convention)."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kernels import cpu_ops


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size), requires_grad=False)

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == self.weight.dtype:
            # One fused kernel; it accumulates in float32 for half types, as HF does. In
            # float32 it is bit-identical to HF's formula below, and faster on CPU.
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        """x [..., hidden]. Without `residual`: returns norm(x). With it: the sum
        s = x + residual becomes the next residual and (norm(s), s) is returned.
        Both inputs are overwritten (x, residual: fresh activations the caller drops); on
        CPU fp32 one fused C pass (kernels.cpu_ops) does the add and the norm."""
        fused = cpu_ops.add_rms_norm(x, residual, self.weight, self.eps)
        if fused is not None:
            return fused if residual is None else (fused, residual)
        if residual is None:
            return self._norm(x)
        x = x.add_(residual)
        return self._norm(x), x
