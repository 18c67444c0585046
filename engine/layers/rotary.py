"""Rotary position embedding, neox style (HF Llama's `rotate_half`).

Each head vector x = [x1 | x2] (halves of head_dim) at position p becomes
    [x1 * cos - x2 * sin | x2 * cos + x1 * sin],   angle[i] = p * inv_freq[i].
cos/sin are precomputed for every position once; a forward only gathers rows by `positions`.
"""
from __future__ import annotations

import math

import torch
from torch import nn

from kernels import cpu_ops


def _default_inv_freq(head_dim: int, base: float) -> torch.Tensor:
    # [head_dim / 2], float32 as HF computes it
    return 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))


def _llama3_inv_freq(inv_freq: torch.Tensor, scaling: dict) -> torch.Tensor:
    """Llama 3.1 frequency scaling: long wavelengths slowed by `factor`, short ones kept,
    a smooth blend in between (HF `_compute_llama3_parameters`)."""
    missing = [k for k in ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
               if k not in scaling]
    if missing:
        raise ValueError(f"rope_scaling of type 'llama3' lacks {missing}")
    factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
    old_len = scaling["original_max_position_embeddings"]
    low_freq_wavelen, high_freq_wavelen = old_len / low, old_len / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


class RotaryEmbedding(nn.Module):
    def __init__(self, head_dim: int, max_position: int, base: float, rope_scaling: dict | None = None):
        super().__init__()
        if head_dim % 2:
            raise ValueError(f"head_dim={head_dim} must be even for rotary embedding")
        self.head_dim = head_dim
        inv_freq = _default_inv_freq(head_dim, base)
        rope_type = (rope_scaling or {}).get("rope_type", "default")
        if rope_type == "llama3":
            inv_freq = _llama3_inv_freq(inv_freq, rope_scaling)
        elif rope_type != "default":
            raise ValueError(f"rope_scaling type {rope_type!r} is not supported")
        freqs = torch.outer(torch.arange(max_position, dtype=torch.float32), inv_freq)
        # [max_position, head_dim]: cos of each angle in the first half, sin in the second
        cos_sin = torch.cat((freqs.cos(), freqs.sin()), dim=-1)
        self.register_buffer("cos_sin_cache", cos_sin, persistent=False)

    def forward(self, positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor | None = None):
        """positions [n]; query [n, num_heads, head_dim], key [n, num_kv_heads, head_dim] or None.
        Rotates in place (both may be strided views into the fused qkv output) and returns them.
        Passing q and k heads as one [n, num_heads + num_kv_heads, head_dim] view as `query`
        rotates both in one pass."""
        tensors = [query] if key is None else [query, key]
        if all(cpu_ops.rotary_applies(t, positions, self.cos_sin_cache) for t in tensors):
            for t in tensors:  # CPU fp32: one fused C pass per tensor
                cpu_ops.rotary_neox_(t, positions, self.cos_sin_cache)
            return query, key
        cos, sin = self.cos_sin_cache[positions].to(query.dtype).unsqueeze(1).chunk(2, dim=-1)  # [n, 1, d/2]
        _rotate_neox_(query, cos, sin)
        if key is not None:
            _rotate_neox_(key, cos, sin)
        return query, key


def _rotate_neox_(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
    # [x1 | x2] <- [x1 * cos - x2 * sin | x2 * cos + x1 * sin]: two temporaries, four
    # passes, and the same float ops as HF's rotate_half form (so bit-identical results).
    x1, x2 = x.chunk(2, dim=-1)  # views of the two halves
    x1_sin = x1 * sin
    x2_sin = x2 * sin
    x1.mul_(cos).sub_(x2_sin)
    x2.mul_(cos).add_(x1_sin)
