"""What the machine can do, measured in the same run as the benchmark."""
from __future__ import annotations

import time

import torch

from loadtest.report import base_metadata


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def best_time(fn, device: str, repeats: int) -> float:
    """Fastest of `repeats` timed calls after one untimed call: the least-disturbed run is the
    closest to what the hardware can do, which is what a limit needs."""
    fn()
    _sync(device)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        _sync(device)
        best = min(best, time.perf_counter() - start)
    return best


def matmul_flop_rate(n: int = 2048, dtype: torch.dtype = torch.float32, device: str = "cpu",
                     repeats: int = 5) -> float:
    """FLOP/s of an n x n by n x n product (2 n^3 FLOPs), best of `repeats`."""
    gen = torch.Generator(device=device).manual_seed(0)
    a = torch.randn(n, n, generator=gen, device=device).to(dtype)
    b = torch.randn(n, n, generator=gen, device=device).to(dtype)
    seconds = best_time(lambda: torch.mm(a, b), device, repeats)
    return 2 * n**3 / seconds


def copy_bandwidth(num_bytes: int = 1 << 30, device: str = "cuda", repeats: int = 10) -> float:
    """Bytes/s of a device-to-device copy, counting the read and the write (2 x num_bytes)."""
    src = torch.empty(num_bytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    seconds = best_time(lambda: dst.copy_(src), device, repeats)
    return 2 * num_bytes / seconds


def run_metadata(argv: list[str]) -> dict:
    """base_metadata plus the torch side of the machine."""
    import transformers

    meta = base_metadata(argv)
    meta["machine"].update(torch=torch.__version__, transformers=transformers.__version__,
                           torch_threads=torch.get_num_threads())
    if torch.cuda.is_available():
        meta["machine"]["gpu"] = torch.cuda.get_device_name(0)
        meta["machine"]["gpu_memory_gib"] = round(torch.cuda.get_device_properties(0).total_memory / 2**30, 1)
    return meta
