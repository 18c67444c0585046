"""Where the Triton kernel tests run: natively on a GPU, under the Triton interpreter on CPU.

Import this before `kernels`: TRITON_INTERPRET must be set before the kernels are decorated.
conftest.py sets it first in a normal run; if another module imported `kernels` earlier
anyway, the kernel modules are re-decorated here, now that it is set.
"""
import importlib
import os

import torch

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
_TRITON_MODULES = ("kernels.triton_attention_kernel", "kernels.triton_attention_split",
                   "kernels.triton_attention",
                   "kernels.triton_store_kv", "kernels")

if DEVICE == "cpu":
    os.environ.setdefault("TRITON_INTERPRET", "1")
    if not (importlib.import_module("kernels.triton_attention")._interpreted()
            and importlib.import_module("kernels.triton_store_kv")._interpreted()):
        for _name in _TRITON_MODULES:
            importlib.reload(importlib.import_module(_name))
