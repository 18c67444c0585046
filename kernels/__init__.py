"""Attention and KV-cache kernels: Triton (GPU) and pure-torch (CPU) paths.

Importing this package imports triton. To run the Triton kernels on CPU
tensors, TRITON_INTERPRET=1 must be set before that import (tests only).
"""

from kernels.triton_attention import paged_attention
from kernels.reference import paged_attention_ref, store_kv_ref
from kernels.triton_store_kv import store_kv
from kernels.torch_attention import paged_attention_torch, store_kv_torch

__all__ = [
    "paged_attention",
    "paged_attention_ref",
    "paged_attention_torch",
    "store_kv",
    "store_kv_ref",
    "store_kv_torch",
]
