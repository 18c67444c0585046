"""Which quantization a checkpoint uses, read from its config.json; torch-free (the HTTP tier imports it).

`quantization_config.quant_method` names the format, as HF transformers and vLLM read it. The
layers that compute with each format live in engine/layers/quantization/ (one module each); this
module only names them so a checkpoint with another method fails at start, naming it, before
any weight is read. `EngineConfig.quantization` may also ask for a method the checkpoint lacks:
the online ones below quantize a full-precision checkpoint's linear weights while loading.
"""
from __future__ import annotations

from typing import Any

# quant_method values a checkpoint may carry (its `quantization_config`).
CHECKPOINT_METHODS = ("fp8", "compressed-tensors", "awq", "gptq", "mxfp4")
# Methods that quantize an unquantized checkpoint at load (vLLM's `quantization="fp8"`).
ONLINE_METHODS = ("fp8", "int8")
QUANTIZATION_METHODS = tuple(dict.fromkeys(CHECKPOINT_METHODS + ONLINE_METHODS + ("gguf",)))


def checkpoint_quantization(hf: dict[str, Any]) -> str | None:
    """The checkpoint's quant_method, or None; ValueError naming an unknown one."""
    quant = hf.get("quantization_config")
    if not quant:
        return None
    if not isinstance(quant, dict):
        raise ValueError(f"quantization_config={quant!r} is invalid: expected an object")
    method = quant.get("quant_method")
    if method not in CHECKPOINT_METHODS:
        raise ValueError(f"quantization_config quant_method={method!r} is not supported "
                         f"(supported: {', '.join(CHECKPOINT_METHODS)})")
    return method


def resolve_quantization(requested: str | None, checkpoint: str | None, is_gguf: bool) -> str | None:
    """The method the engine runs: the checkpoint's, or an online one asked for on an unquantized
    checkpoint. ValueError when the two disagree (a checkpoint is never re-quantized)."""
    found = "gguf" if is_gguf else checkpoint
    if requested is None or requested == found:
        return found
    if found is None and requested in ONLINE_METHODS:
        return requested
    if found is None:
        raise ValueError(f"quantization={requested!r} cannot be applied to an unquantized checkpoint "
                         f"(methods that quantize at load: {', '.join(ONLINE_METHODS)})")
    raise ValueError(f"quantization={requested!r} does not match the checkpoint, which is {found!r}")
