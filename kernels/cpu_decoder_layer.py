"""A Llama-family decoder layer with INT8 W8A8 linears in one C call (kernels/cpu_decoder_layer.c).

`LayerArgs` mirrors the C struct; the caller (engine/layers/cpu_fused_layer.py) fills the layer's
fields once and the step's fields per call, after checking every tensor's dtype, shape and
layout: the C side trusts them. `run_decoder_layer` raises on the codes the kernel returns.
"""
from __future__ import annotations

import ctypes
import functools

from kernels.cpu_build import bind_signatures, load_kernel_library

_LIB_NAME = "cpu_decoder_layer"
_P, _I, _F = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float
# Codes the kernel returns: a base for the failing op (LAYER_ERR_* in the C file) plus that op's own.
_ERRORS = {
    1: (MemoryError, "scratch allocation failed"),
    102: (MemoryError, "int8 linear: out of memory"),
    103: (ValueError, "int8 linear: an activation dtype it does not take"),
    201: (ValueError, "store_kv: a slot_mapping entry is past the cache"),
    301: (ValueError, "paged attention: a sequence has q_len > seq_len, or seq_len beyond its block_tables row"),
    302: (ValueError, "paged attention: block_tables holds a block id outside the cache"),
    303: (MemoryError, "paged attention: out of memory"),
    304: (ValueError, "paged attention: cu_seqlens_q must start at 0, never decrease and end at num_tokens"),
    305: (ValueError, "paged attention: a dtype it does not take"),
    306: (ValueError, "paged attention: the AMX chunk kernel does not take this layer"),
}


class Int8Linear(ctypes.Structure):
    _fields_ = [("packed", _P), ("comp", _P), ("w_scale", _P), ("input_scale", _P), ("K", _I), ("N", _I)]


class LayerArgs(ctypes.Structure):
    """Mirror of `LayerArgs` in cpu_decoder_layer.c (field order and types must match)."""

    _fields_ = [(name, Int8Linear) for name in ("qkv", "o_proj", "gate_up", "down")] + \
               [(name, _P) for name in ("input_norm", "post_norm", "cos_sin", "k_cache", "v_cache")] + \
               [(name, _I) for name in ("hidden", "num_heads", "num_kv_heads", "head_dim", "intermediate",
                                        "block_size", "num_blocks")] + \
               [("eps", _F), ("scale", _F), ("sliding_window", _I), ("dtype", _I)] + \
               [(name, _P) for name in ("x", "residual", "out", "positions", "slot_mapping", "block_tables",
                                        "seq_lens", "cu_seqlens_q")] + \
               [(name, _I) for name in ("n", "num_seqs", "bt_stride", "max_blocks", "max_q_len", "chunk_attention")]


@functools.lru_cache(maxsize=None)
def _lib():
    """The loaded library with its signature set, or None (disabled or unbuildable)."""
    return bind_signatures(load_kernel_library(_LIB_NAME),
                           {"rayllm_decoder_layer": ([ctypes.POINTER(LayerArgs)], ctypes.c_int)})


def available() -> bool:
    """Whether the fused layer runs here: the library built, and its int8 matmul has AVX-512 VNNI."""
    from kernels import cpu_int8

    return _lib() is not None and cpu_int8.available()


def run_decoder_layer(args: LayerArgs) -> None:
    """One call; MemoryError or ValueError naming the op that failed (the ops after it did not run)."""
    err = _lib().rayllm_decoder_layer(ctypes.byref(args))
    if err:
        exc, what = _ERRORS.get(err, (RuntimeError, f"error {err}"))
        raise exc(f"cpu decoder layer: {what}")
