"""The multi-LoRA delta on CPU (kernels/cpu_lora.c), called through ctypes.

`lora_delta` returns None when the C kernel does not apply (the library is disabled or
unbuildable, a tensor is not fp32 on CPU, a layout it does not take, a rank too wide), and the
caller then runs its torch loop (engine/layers/lora.py): the same arithmetic, slower, since it
issues a gather, two matmuls and a scatter-add per adapter, each a parallel region of its own.
"""
from __future__ import annotations

import ctypes
import functools

import torch

from kernels.cpu_build import bind_signatures, load_kernel_library

_LIB_NAME = "cpu_lora"
_P, _I = ctypes.c_void_p, ctypes.c_int64
_SIGNATURES = {  # name: (argtypes, restype), as declared in cpu_lora.c
    "rayllm_lora_delta_f32": ([_P, _I, _P, _I, _P, _P, _P, _I, _I, _I, _I, _I, _I, _P], ctypes.c_int),
}


@functools.lru_cache(maxsize=None)
def _lib():
    """The loaded library with its signatures set, or None (disabled or unbuildable)."""
    return bind_signatures(load_kernel_library(_LIB_NAME), _SIGNATURES)


def _applies(x, y, lora_a, lora_b, token_slots, part_offsets) -> bool:
    """fp32 CPU tensors in the layouts the kernel reads: rows of x and y with unit inner stride,
    lora_a contiguous, lora_b a transposed view of a contiguous [max_loras, P*R, out]."""
    for t in (x, y, lora_a, lora_b):
        if t.dtype != torch.float32 or t.device.type != "cpu":
            return False
    if token_slots.device.type != "cpu" or part_offsets.device.type != "cpu":
        return False
    if x.dim() != 2 or y.dim() != 2 or lora_a.dim() != 3 or lora_b.dim() != 3 or part_offsets.dim() != 1:
        return False
    max_loras, pr, in_size = lora_a.shape
    num_parts = part_offsets.shape[0] - 1
    return (x.stride(1) == 1 and y.stride(1) == 1 and x.shape == (y.shape[0], in_size)
            and lora_b.shape == (max_loras, y.shape[1], pr) and num_parts >= 1 and pr % num_parts == 0
            and tuple(token_slots.shape) == (x.shape[0],) and token_slots.dtype == torch.int32
            and token_slots.is_contiguous() and part_offsets.dtype == torch.int64 and part_offsets.is_contiguous()
            and lora_a.is_contiguous() and lora_b.transpose(1, 2).is_contiguous())


def lora_delta(y: torch.Tensor, x: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor,
               token_slots: torch.Tensor, part_offsets: torch.Tensor) -> bool | None:
    """y [n, out] += (x[t] @ lora_a[s].T) @ lora_b[s].T for each row t of slot s = token_slots[t] >= 0,
    part by part (part p's outputs part_offsets[p] .. part_offsets[p + 1] times its diagonal block).

    x: [n, in]; lora_a: [max_loras, P*R, in]; lora_b: [max_loras, out, P*R] (stored transposed);
    token_slots: [n] int32, -1 for the base model; part_offsets: [P + 1] int64.
    True when done; None when the caller must run its torch path instead."""
    lib = _lib()
    if lib is None or not _applies(x, y, lora_a, lora_b, token_slots, part_offsets):
        return None
    max_loras, pr, in_size = lora_a.shape
    num_parts = part_offsets.shape[0] - 1
    status = lib.rayllm_lora_delta_f32(
        x.data_ptr(), x.stride(0), y.data_ptr(), y.stride(0), lora_a.data_ptr(), lora_b.data_ptr(),
        token_slots.data_ptr(), x.shape[0], max_loras, in_size, y.shape[1], num_parts, pr // num_parts,
        part_offsets.data_ptr())
    return True if status == 0 else None
