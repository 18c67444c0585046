"""Attention and KV-cache kernels: Triton (GPU) and pure-torch (CPU) paths.

    from kernels import paged_attention, store_kv          # Triton
    from kernels.cpu_attention import paged_attention_cpu  # the CPU path: no triton

The names below are resolved lazily (PEP 562): importing a submodule, e.g. the CPU
path's `kernels.cpu_ops`, does not import triton. Asking for a Triton kernel does; to
run them on CPU tensors, TRITON_INTERPRET=1 must be set before that (tests only).
"""
import importlib

# name -> the submodule that defines it
_EXPORTS = {
    "paged_attention": "kernels.triton_attention",
    "paged_attention_ref": "kernels.reference",
    "paged_attention_torch": "kernels.torch_attention",
    "store_kv": "kernels.triton_store_kv",
    "store_kv_ref": "kernels.reference",
    "store_kv_torch": "kernels.torch_attention",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    # Not cached in globals(): tests reload the Triton modules once TRITON_INTERPRET is set
    # (tests/triton_device.py), and each lookup must then see the reloaded kernel.
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'kernels' has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | set(_EXPORTS))
