"""The C kernels' element types: torch dtype -> the DT_* code of kernels/cpu_simd.h, the one table
the ctypes wrappers pass (kernels/cpu_attention.py, cpu_ops.py, cpu_int8.py)."""
from __future__ import annotations

import torch

DT_CODES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
