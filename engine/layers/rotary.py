"""Rotary position embedding, neox style (HF Llama's `rotate_half`), with the scalings HF ships.

The first `rotary_dim` features of each head vector, x = [x1 | x2] (halves), at position p become
    [x1 * cos - x2 * sin | x2 * cos + x1 * sin],   angle[i] = p * inv_freq[i],
and the rest pass through (rotary_dim < head_dim: `partial_rotary_factor`, Phi-4-mini, GLM).
cos/sin are precomputed for every position once, one table per model (scaled by the attention
factor where the type has one); a forward only gathers rows by `positions`.

`rope_type` (each equal to transformers' ROPE_INIT_FUNCTIONS, inv_freq and attention factor):
    default   1 / base^(2i / rotary_dim)
    linear    inv_freq / factor
    llama3    long wavelengths / factor, short ones kept, a smooth blend between (Llama 3.1)
    yarn      NTK-by-parts: a ramp between interpolated and original frequencies; cos/sin times
              the attention factor (mscale); `truncate` as gpt-oss sets it
    longrope  inv_freq / short_factor or / long_factor (per frequency); cos/sin times the attention factor
    dynamic   NTK: the base grows with the sequence length past original_max_position_embeddings

Per position, not per forward. HF chooses longrope's factors and dynamic's base per forward pass,
from the largest position in it (`dynamic_rope_update`). A paged engine shares a key's cached
rotation across steps, chunks and sequences (prefix cache, preemption), so here a row depends on
its position alone: row p is what HF uses when p is the newest token (for p below
original_max_position_embeddings the short factors / the original base; from there the long
factors / the base for a sequence of p + 1 tokens). That is HF exactly for every sequence whose
prompt fits in original_max_position_embeddings, however far it generates (HF's decode switches
at the same position). A longer prompt HF rotates wholly with the long factors (or one base for
its length); here its first positions keep the short ones. vLLM instead picks one factor set for
all positions from max_model_len (docs/architecture.md, "RoPE scaling").
"""
from __future__ import annotations

import math

import torch
from torch import nn

from engine.config import ROPE_TYPES  # the names ModelConfig accepts (torch-free there)
from kernels import cpu_ops


def _inv_freq(base, dim: int) -> torch.Tensor:
    # [dim / 2] float32, as HF computes it; `base` a float, or a float32 [rows, 1] tensor
    return 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))


def _linear(rope: dict, base: float, dim: int) -> tuple[torch.Tensor, float]:
    return _inv_freq(base, dim) / rope["factor"], 1.0


def _llama3(rope: dict, base: float, dim: int) -> tuple[torch.Tensor, float]:
    """Llama 3.1: wavelengths over old_len / low_freq_factor slowed by `factor`, those under
    old_len / high_freq_factor kept, a smooth blend in between."""
    inv_freq = _inv_freq(base, dim)
    factor, low, high = rope["factor"], rope["low_freq_factor"], rope["high_freq_factor"]
    old_len = rope["original_max_position_embeddings"]
    low_freq_wavelen, high_freq_wavelen = old_len / low, old_len / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled), 1.0


def _yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def _yarn(rope: dict, base: float, dim: int) -> tuple[torch.Tensor, float]:
    """YaRN: frequencies that turn more than beta_fast times over the original context are kept,
    those under beta_slow times divided by `factor`, a linear ramp over the dimensions between."""
    factor, old_len = rope["factor"], rope["original_max_position_embeddings"]
    attention_factor = rope.get("attention_factor")
    if attention_factor is None:
        mscale, mscale_all_dim = rope.get("mscale"), rope.get("mscale_all_dim")
        attention_factor = (_yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all_dim)
                            if mscale and mscale_all_dim else _yarn_mscale(factor))

    def dim_turning(num_rotations: float) -> float:  # the (fractional) dim index turning that often
        return dim * math.log(old_len / (num_rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = dim_turning(rope.get("beta_fast") or 32), dim_turning(rope.get("beta_slow") or 1)
    if rope.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # no zero-width ramp
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    keep = 1 - ramp  # weight of the original frequency; (1 - keep) spelled as HF does, for equal bits
    pos_freqs = base ** (torch.arange(0, dim, 2).float() / dim)
    inv_freq = 1.0 / (factor * pos_freqs) * (1 - keep) + 1.0 / pos_freqs * keep
    return inv_freq, float(attention_factor)


def _longrope_attention_factor(rope: dict) -> float:
    if rope.get("attention_factor") is not None:
        return float(rope["attention_factor"])
    factor = rope["factor"]
    return 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(rope["original_max_position_embeddings"]))


def _longrope_inv_freq(factors: list[float], base: float, dim: int) -> torch.Tensor:
    exponents = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim
    return 1.0 / (torch.tensor(factors, dtype=torch.float32) * base ** exponents)


_STATIC = {"linear": _linear, "llama3": _llama3, "yarn": _yarn}  # one inv_freq for every position


def rope_angles(rope: dict | None, base: float, dim: int, max_position: int) -> tuple[torch.Tensor, float]:
    """([max_position, dim / 2] float32 angles, attention factor) for positions 0 .. max_position - 1.
    `rope`: ModelConfig's scaling dict (its "rope_type" and keys, resolved by engine.config), or None."""
    rope_type = (rope or {}).get("rope_type", "default")
    positions = torch.arange(max_position, dtype=torch.float32)[:, None]  # [max_position, 1]
    if rope_type == "default":
        return positions * _inv_freq(base, dim), 1.0
    if rope_type in _STATIC:
        inv_freq, attention_factor = _STATIC[rope_type](rope, base, dim)
        return positions * inv_freq, attention_factor
    split = min(rope["original_max_position_embeddings"], max_position)  # first row of the long range
    if rope_type == "longrope":
        short = positions[:split] * _longrope_inv_freq(rope["short_factor"], base, dim)
        long = positions[split:] * _longrope_inv_freq(rope["long_factor"], base, dim)
        return torch.cat([short, long]), _longrope_attention_factor(rope)
    if rope_type == "dynamic":
        return _dynamic_angles(rope, base, dim, positions, split), 1.0
    raise ValueError(f"rope_scaling type {rope_type!r} is not supported (supported: {', '.join(ROPE_TYPES)})")


def _dynamic_angles(rope: dict, base: float, dim: int, positions: torch.Tensor, split: int) -> torch.Tensor:
    """NTK: base * (factor * seq_len / old_len - (factor - 1))^(dim / (dim - 2)) for a sequence of
    seq_len tokens, seq_len at least old_len: one base below old_len, row p's own (seq_len = p + 1)
    from there, in float32 as HF computes the grown base."""
    factor, old_len = rope["factor"], rope["original_max_position_embeddings"]
    exponent = dim / (dim - 2)
    first = positions[:split] * _inv_freq(base * ((factor * old_len / old_len) - (factor - 1)) ** exponent, dim)
    seq_len = torch.arange(split + 1, positions.shape[0] + 1, dtype=torch.int64)[:, None]  # [rows, 1]
    grown = base * ((factor * seq_len / old_len) - (factor - 1)) ** exponent
    return torch.cat([first, positions[split:] * _inv_freq(grown, dim)])


class RotaryEmbedding(nn.Module):
    def __init__(self, head_dim: int, max_position: int, base: float, rope_scaling: dict | None = None,
                 rotary_dim: int | None = None):
        super().__init__()
        rotary_dim = head_dim if rotary_dim is None else rotary_dim
        if rotary_dim % 2 or not 0 < rotary_dim <= head_dim:
            raise ValueError(f"rotary_dim={rotary_dim} must be even and in (0, head_dim={head_dim}]")
        self.head_dim, self.rotary_dim = head_dim, rotary_dim
        self.base, self.rope_scaling, self.max_position = base, rope_scaling, max_position
        self.register_buffer("cos_sin_cache", _cos_sin(*rope_angles(rope_scaling, base, rotary_dim, max_position)),
                             persistent=False)

    def divide_frequencies(self, divisors: torch.Tensor) -> None:
        """inv_freq[i] / divisors[i], the table rebuilt in place: llama.cpp's `rope_freqs` tensor,
        which its converter writes into Llama 3.1+ GGUF files instead of the llama3 scaling (their
        metadata names none), on plain RoPE."""
        if self.rope_scaling is not None or divisors.shape != (self.rotary_dim // 2,):
            raise ValueError(f"rope_freqs of shape {tuple(divisors.shape)} on RoPE {self.rope_scaling or 'default'} "
                             f"is not supported (only {self.rotary_dim // 2} divisors on plain RoPE)")
        positions = torch.arange(self.max_position, dtype=torch.float32)[:, None]
        inv_freq = _inv_freq(self.base, self.rotary_dim) / divisors.to(torch.float32).cpu()
        self.cos_sin_cache.copy_(_cos_sin(positions * inv_freq, 1.0))

    def forward(self, positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor | None = None):
        """positions [n]; query [n, num_heads, head_dim], key [n, num_kv_heads, head_dim] or None.
        Rotates in place (both may be strided views into the fused qkv output) and returns them.
        Passing q and k heads as one [n, num_heads + num_kv_heads, head_dim] view as `query`
        rotates both in one pass."""
        tensors = [query] if key is None else [query, key]
        if all(cpu_ops.rotary_applies(t, positions, self.cos_sin_cache) for t in tensors):
            for t in tensors:  # CPU, whole heads rotated: one fused C pass per tensor
                cpu_ops.rotary_neox_(t, positions, self.cos_sin_cache)
            return query, key
        cos, sin = self.cos_sin_cache[positions].to(query.dtype).unsqueeze(1).chunk(2, dim=-1)  # [n, 1, r/2]
        for t in tensors:
            _rotate_neox_(t[..., : self.rotary_dim], cos, sin)  # a view: the pass-through tail untouched
        return query, key


def _cos_sin(angles: torch.Tensor, attention_factor: float) -> torch.Tensor:
    """[max_position, rotary_dim]: cos of each angle in the first half, sin in the second."""
    cos, sin = angles.cos(), angles.sin()
    if attention_factor != 1.0:  # yarn / longrope: HF scales cos and sin, so q.k by its square
        cos, sin = cos * attention_factor, sin * attention_factor
    return torch.cat((cos, sin), dim=-1)


def get_rope(config, rope: dict | None = None) -> RotaryEmbedding:
    """The model's one cos/sin table from its ModelConfig (head_dim, partial_rotary_factor, the
    positions, rope_theta and rope_scaling). `rope`: another complete RoPE of the same model
    instead ({"rope_type", "rope_theta", ...}: ModelConfig.rope_local, Gemma 3's sliding layers)."""
    base, scaling = config.rope_theta, config.rope_scaling
    if rope is not None:
        base, scaling = rope["rope_theta"], (None if rope.get("rope_type", "default") == "default" else rope)
    rotary_dim = int(config.head_dim * config.partial_rotary_factor)
    return RotaryEmbedding(config.head_dim, config.max_position_embeddings, base, scaling, rotary_dim)


def _rotate_neox_(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
    # [x1 | x2] <- [x1 * cos - x2 * sin | x2 * cos + x1 * sin]: two temporaries, four
    # passes, and the same float ops as HF's rotate_half form (so bit-identical results).
    x1, x2 = x.chunk(2, dim=-1)  # views of the two halves
    x1_sin = x1 * sin
    x2_sin = x2 * sin
    x1.mul_(cos).sub_(x2_sin)
    x2.mul_(cos).add_(x1_sin)
