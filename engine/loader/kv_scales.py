"""An fp8 KV cache's per-tensor scales, from the checkpoint when it has them (vLLM's names and rules).

Checkpoints calibrated for an fp8 KV cache (llm-compressor, ModelOpt) store one fp32 scalar per
attention layer: `model.layers.N.self_attn.k_scale` and `.v_scale`, or an older single
`.kv_scale` for both. The weight loader skips these names (engine/loader/weights.py) whatever
the cache dtype, as vLLM does; with kv_cache_dtype="fp8" the runner asks this module for them.
Rules, as vLLM's BaseKVCacheMethod: both given -> use them; one given -> the larger for both;
none -> 1.0 each, with a warning (values past 448 then saturate, values under 2^-9 vanish).
"""
from __future__ import annotations

import logging
import math
from pathlib import Path

from safetensors import safe_open

from engine.loader.weights import safetensors_files

logger = logging.getLogger(__name__)

SCALE_NAMES = ("k_scale", "v_scale", "kv_scale")


def read_kv_scales(path: str | Path) -> dict[str, float]:
    """{"<attention module prefix>.<k_scale|v_scale|kv_scale>": value} of every such tensor in the
    checkpoint at `path` (only those tensors are read). Raises ValueError for a scale that is not
    one positive finite number: a per-head or per-channel scale is not what these caches store."""
    scales = {}
    for file in safetensors_files(Path(path)):
        with safe_open(file, framework="pt", device="cpu") as f:
            for name in f.keys():
                if name.rsplit(".", 1)[-1] in SCALE_NAMES and ".self_attn." in name:
                    scales[name] = _scalar(name, f.get_tensor(name))
    return scales


def _scalar(name: str, t) -> float:
    if t.numel() != 1:
        raise ValueError(f"{name} has shape {tuple(t.shape)}: an fp8 KV cache takes per-tensor scales only")
    value = float(t.float().item())
    if not (value > 0 and math.isfinite(value)):
        raise ValueError(f"{name} = {value} is invalid: a KV cache scale must be positive and finite")
    return value


def layer_kv_scales(scales: dict[str, float], prefix: str) -> tuple[float, float]:
    """(k_scale, v_scale) of the attention whose checkpoint prefix is `prefix`
    (e.g. "model.layers.3.self_attn"), by the rules in the module docstring."""
    k = scales.get(f"{prefix}.k_scale")
    v = scales.get(f"{prefix}.v_scale")
    if k is None and v is None:
        k = v = scales.get(f"{prefix}.kv_scale")
    if k is None and v is None:
        return 1.0, 1.0
    if k is None or v is None:
        k = v = max(s for s in (k, v) if s is not None)
    return k, v
