"""RoPE as a config.json states it, in either form seen on the hub, resolved for the rotary
(engine/layers/rotary.py) and checked at start."""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from engine.config.model import ModelConfig

# RoPE types the rotary implements (engine/layers/rotary.py) and the keys each needs once resolved.
ROPE_TYPES = ("default", "linear", "dynamic", "yarn", "longrope", "llama3")
_ROPE_KEYS = {
    "linear": ("factor",),
    "dynamic": ("factor", "original_max_position_embeddings"),
    "yarn": ("factor", "original_max_position_embeddings"),
    "longrope": ("short_factor", "long_factor", "factor", "original_max_position_embeddings"),
    "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
}


def read_rope(hf: dict[str, Any]) -> dict[str, Any]:
    """ModelConfig's RoPE fields from config.json in either form seen on the hub:
    transformers 4's `rope_theta` + `rope_scaling` ({"type": ...} or {"rope_type": ...}, Gemma 3's
    `rope_local_base_freq`) or transformers 5's `rope_parameters` (theta inside; Gemma 3's nested
    per layer type, {"full_attention": {...}, "sliding_attention": {...}}); `partial_rotary_factor`
    at the top or inside. As transformers does, `rope_scaling` wins over `rope_parameters` and keys
    inside the dict over those at the top. max_position_embeddings grows to what yarn
    (original * factor) and dynamic (max * factor) are for, as vLLM derives it."""
    params = hf.get("rope_scaling") or hf.get("rope_parameters") or {}
    nested = any(isinstance(params.get(k), dict) for k in ("full_attention", "sliding_attention"))
    full = (params.get("full_attention") or {}) if nested else params
    max_pos = hf.get("max_position_embeddings", 2048)
    theta = float(full.get("rope_theta") or hf.get("rope_theta") or 10000.0)
    scaling = _resolve_rope(full, hf, max_pos)
    local = params.get("sliding_attention") if nested else None
    if local is not None or "rope_local_base_freq" in hf:
        local = dict(_resolve_rope(local or {}, hf, max_pos) or {"rope_type": "default"},
                     rope_theta=float((local or {}).get("rope_theta") or hf.get("rope_local_base_freq") or theta))
        if local == dict(scaling or {"rope_type": "default"}, rope_theta=theta):
            local = None  # the same RoPE on every layer
    partial = full.get("partial_rotary_factor") or hf.get("partial_rotary_factor") or 1.0
    factor = (scaling or {}).get("factor") or 1.0
    grown = {"yarn": (scaling or {}).get("original_max_position_embeddings", 0) * factor,
             "dynamic": max_pos * factor}.get((scaling or {}).get("rope_type"), 0)
    return dict(rope_theta=theta, rope_scaling=scaling, rope_local=local, partial_rotary_factor=float(partial),
                max_position_embeddings=max(max_pos, int(grown)))


def _resolve_rope(rope: dict[str, Any], hf: dict[str, Any], max_pos: int) -> dict[str, Any] | None:
    """One RoPE dict with its "rope_type" and the lengths it reads filled in as HF fills them; None: plain."""
    rope_type = rope.get("rope_type") or rope.get("type") or "default"
    if rope_type == "default":
        return None
    rope = {k: v for k, v in rope.items() if k not in ("type", "rope_theta", "partial_rotary_factor")}
    rope["rope_type"] = "longrope" if rope_type == "su" else rope_type  # "su": early Phi-3 configs
    if rope["rope_type"] == "dynamic":  # HF's NTK grows past max_position_embeddings itself
        rope["original_max_position_embeddings"] = max_pos
    elif rope["rope_type"] in ("llama3", "yarn", "longrope"):
        # Phi-3 keeps it at the top, which HF prefers to the dict's
        rope["original_max_position_embeddings"] = (hf.get("original_max_position_embeddings")
                                                    or rope.get("original_max_position_embeddings") or max_pos)
        if rope["rope_type"] != "llama3" and rope.get("factor") is None:
            rope["factor"] = max_pos / rope["original_max_position_embeddings"]
    return rope


def check_rope(config: ModelConfig) -> None:
    """Unknown types and missing keys fail at start, naming them (torch-free: ROPE_TYPES mirrors the rotary)."""
    if not 0.0 < config.partial_rotary_factor <= 1.0:
        raise ValueError(f"partial_rotary_factor={config.partial_rotary_factor} is invalid: must be in (0, 1]")
    rotary_dim = int(config.head_dim * config.partial_rotary_factor)
    if rotary_dim % 2:
        raise ValueError(f"partial_rotary_factor={config.partial_rotary_factor} of head_dim={config.head_dim} "
                         f"gives an odd rotary dimension {rotary_dim}")
    for name, rope in (("rope_scaling", config.rope_scaling), ("rope_local", config.rope_local)):
        rope_type = (rope or {}).get("rope_type", "default")
        if rope_type not in ROPE_TYPES:
            raise ValueError(f"{name} type {rope_type!r} is not supported (supported: {', '.join(ROPE_TYPES)})")
        missing = [k for k in _ROPE_KEYS.get(rope_type, ()) if rope.get(k) is None]
        if missing:
            raise ValueError(f"{name} of type {rope_type!r} lacks {missing}")
        for key in ("short_factor", "long_factor") if rope_type == "longrope" else ():
            if len(rope[key]) != rotary_dim // 2:
                raise ValueError(f"{name}[{key!r}] has {len(rope[key])} factors, expected rotary_dim / 2 = "
                                 f"{rotary_dim // 2}")
