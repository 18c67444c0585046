"""KV-cache memory that costs nothing until it is used.

`torch.zeros` on CPU writes every byte, so a 4 GiB `cpu_kv_cache_gb` budget became 4 GiB of
resident memory at start-up, however few requests ever ran. An anonymous `mmap` is
zero-filled by the kernel page by page on first write: the cache keeps the all-zero contents
the attention kernels rely on (0 * NaN garbage in a masked slot would still poison a row),
and only the blocks the engine writes become resident. The mapping is released with the
tensor. CUDA memory is reserved up front anyway, so it keeps `torch.zeros`.
"""
from __future__ import annotations

import math
import mmap

import torch


def allocate_kv_tensor(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A zero-filled tensor of `shape`; on CPU, its pages are touched only when written."""
    if device.type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    nbytes = math.prod(shape) * dtype.itemsize
    if nbytes == 0:
        return torch.zeros(shape, dtype=dtype)
    buf = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    return torch.frombuffer(buf, dtype=dtype).view(shape)  # the tensor keeps `buf` alive
