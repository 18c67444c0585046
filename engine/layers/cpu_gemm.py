"""fp32 and bf16 CPU matmuls on weights packed once for oneDNN (the engine's CPU path).

`F.linear` hands MKL an `[out, in]` weight on every call and MKL repacks it
into its panel layout each time; at decode-sized batches (a few to a few
hundred rows, weights streamed from memory) that repacking is a large part of
the time. oneDNN's inner-product primitive takes a weight reordered once, at
load, into its blocked layout, and works for any number of rows.
`python -m loadtest.cpu_kernel_bench` times both on the bench model's 24 linears
at decode and prefill row counts (docs/benchmarks.md, "CPU kernels").

torch exposes this as the ops its inductor uses for frozen CPU graphs,
`mkldnn._reorder_linear_weight` and `mkldnn._linear_pointwise`; where they are
missing (a build without oneDNN) layers keep `F.linear`. bf16 weights are packed too where
the CPU has native bf16 (AVX-512 BF16 / AMX), where oneDNN's packed bf16 beats bf16 `F.linear`
(`python -m loadtest.cpu_quant_bench`: bf16 oneDNN against fp32 oneDNN and `F.linear`).
"""
from __future__ import annotations

import torch

# Row count the blocked layout is chosen for (a decode-sized batch); the packed
# weight serves any count.
_BATCH_HINT = 64


def can_pack(weight: torch.Tensor) -> bool:
    """A 2-D fp32 (or bf16, on a CPU with native bf16) CPU weight, and a torch with the oneDNN ops."""
    dtype_ok = weight.dtype == torch.float32 or (weight.dtype == torch.bfloat16
                                                 and torch.ops.mkldnn._is_mkldnn_bf16_supported())
    return (weight.dim() == 2 and dtype_ok and weight.device.type == "cpu"
            and torch.backends.mkldnn.is_available()
            and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
            and hasattr(torch.ops.mkldnn, "_linear_pointwise"))


def pack(weight: torch.Tensor) -> torch.Tensor:
    """[out, in] dense -> the same shape as an opaque oneDNN (mkldnn-layout) tensor."""
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous(), _BATCH_HINT)


def packed_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x [n, in] @ W.T (+ bias) -> [n, out], W packed by `pack`."""
    return torch.ops.mkldnn._linear_pointwise(x.contiguous(), packed, bias, "none", [], "")


def pack_module_weight(module: torch.nn.Module) -> bool:
    """Replace `module.weight` by `module.packed_weight`, freeing the dense copy.

    The `weight` Parameter stays (with its loader) but holds an empty tensor: after
    this the module computes only through `packed_weight`. Returns False, and
    changes nothing, when the weight cannot be packed.
    """
    if not can_pack(module.weight):
        return False
    module.packed_weight = pack(module.weight)
    module.weight.data = torch.empty(0, dtype=module.weight.dtype)
    return True
