"""RMSNorm with an optional fused residual add (vLLM's calling convention), and Gemma's
(1 + weight) form of it."""
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

    def _fused_multiplier(self, x: torch.Tensor) -> torch.Tensor | None:
        """What the fused C op (kernels.cpu_ops) multiplies x's normalised rows by, [hidden], where it
        computes what _norm does (one rounding from float32: F.rms_norm, x and weight of one dtype);
        None where _norm differs (HF's cast before the weight multiply)."""
        return self.weight if self.weight.dtype == x.dtype else None

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
        CPU (fp32, bf16, fp16) one fused C pass (kernels.cpu_ops) does the add and the norm."""
        multiplier = self._fused_multiplier(x)
        fused = None if multiplier is None else cpu_ops.add_rms_norm(x, residual, multiplier, self.eps)
        if fused is not None:
            return fused if residual is None else (fused, residual)
        if residual is None:
            return self._norm(x)
        x = x.add_(residual)
        return self._norm(x), x


class GemmaRMSNorm(RMSNorm):
    """Gemma's RMSNorm: the checkpoint's weight w is an offset, and HF computes
    norm(x.float()) * (1 + w.float()), cast back to x's dtype only at the end (RMSNorm casts
    before it multiplies). 1 + w is kept in float32 (`scale`, set once the weights are in), so the
    fused forms (F.rms_norm in float32, the C add-and-norm in any dtype) compute exactly that."""

    def __init__(self, hidden_size: int, eps: float = 1e-6):
        super().__init__(hidden_size, eps)
        self.weight.data.zero_()  # no offset: the identity scale, as HF initialises it
        # Not a parameter (the loader fills `weight`) and not persistent (not in the checkpoint).
        self.register_buffer("scale", torch.ones(hidden_size, dtype=torch.float32), persistent=False)

    def process_weights_after_loading(self) -> None:
        """Called by the loader once every weight is in."""
        self.scale = 1.0 + self.weight.float()  # float32 whatever was done to the module's dtype before

    def _fused_multiplier(self, x: torch.Tensor) -> torch.Tensor:
        return self.scale  # float32 whatever x's dtype: one rounding at the end, as _norm

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32:
            return F.rms_norm(x, self.scale.shape, self.scale, self.eps)
        x32 = x.float()
        return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps) * self.scale).to(x.dtype)
