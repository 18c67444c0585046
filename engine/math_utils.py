"""Integer arithmetic shared by the scheduler, block manager and model runner (vLLM's `cdiv`).

No torch here: the scheduler and block manager import it. kernels/ keeps its own copy
(it imports nothing of ours).
"""
from __future__ import annotations


def cdiv(a: int, b: int) -> int:
    """ceil(a / b) for integers, without going through floats (exact for any size)."""
    return -(-a // b)
