"""GGUF files (llama.cpp): linear weights kept in their quantized blocks and computed with.

A GGUF names no quantization_config: the method is resolved as "gguf" whenever the model is a
GGUF (engine.config.quantization), and the type is known only per tensor, when it is read. So
a GGUF layer has no packed parameter before loading: its `weight` is an empty placeholder the
loader addresses, and each checkpoint part that arrives (q, k, v of a QKV layer, gate and up of
a merged one, or the whole of an unfused one) becomes a parameter of its own, in its own type:

    Q8_0, Q4_0, Q4_1, Q5_0, Q5_1,  uint8 [rows, in / block_elems * block_bytes]: the file's rows,
    Q4_K, Q5_K, Q6_K               this rank's share, multiplied by kernels/cpu_gguf.py (CPU) or
                                   kernels/triton_gguf_gemm.py (CUDA) without dequantizing W
    anything else (F32, F16, BF16, Q2_K, Q3_K, ...)   dequantized by the loader to the
                                   engine dtype, as before (engine.loader.gguf_loader)

After loading, neighbouring parts of one type are concatenated (their rows are independent), so
a layer whose parts share a type is one matmul; mixed parts (Q4_K_M's Q6_K v_proj) are one
matmul each, their outputs concatenated. Embeddings, the LM head and MoE experts are not linear
layers here and load dequantized (engine.loader.gguf_loader).

Tensor parallelism: a column shard cuts whole rows (any split); a row shard cuts each row's
bytes and must fall on whole blocks (256 features for the K-quants, 32 for the others).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from engine.layers.quantization.base import LinearMethodBase, QuantizationConfig, new_param
from kernels.torch_gguf import BLOCK_LAYOUTS, TYPE_NAMES

# ggml type ids computed from their blocks (the rest load dequantized).
PACKED_TYPES = frozenset(BLOCK_LAYOUTS)


@dataclass
class GGUFBlocks:
    """A GGUF tensor as stored, handed by the loader to a GGUF layer's weight loader."""

    data: torch.Tensor  # uint8 [out_features, in_features / block_elems * block_bytes], HF row order
    qtype: int          # ggml type id, one of PACKED_TYPES

    def narrow(self, dim: int, start: int, length: int) -> "GGUFBlocks":
        """Rows (dim 0) or features (dim 1, whole blocks only) of this tensor."""
        if dim == 0:
            return GGUFBlocks(self.data.narrow(0, start, length), self.qtype)
        elems, nbytes = BLOCK_LAYOUTS[self.qtype]
        if start % elems or length % elems:
            raise ValueError(f"a row-parallel shard of {length} features at offset {start} does not fall on whole "
                             f"{TYPE_NAMES[self.qtype]} blocks of {elems} features (tensor_parallel_size)")
        return GGUFBlocks(self.data.narrow(1, start // elems * nbytes, length // elems * nbytes), self.qtype)


class GGUFConfig(QuantizationConfig):
    name = "gguf"
    # The experts of a GGUF MoE are dequantized at load (engine.loader.gguf_loader), as before.
    handles_experts = True

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> "GGUFConfig":
        if config:  # a GGUF's HF view has no quantization_config: anything else is a mix-up
            raise ValueError(f"quantization='gguf' takes no quantization_config, got keys {sorted(config)}")
        return cls()

    def get_linear_method(self, layer: nn.Module, prefix: str) -> LinearMethodBase:
        return GGUFLinearMethod()


def _part_ids(layer: nn.Module) -> list:
    """The layer's checkpoint parts, in row order: q/k/v, merged outputs, or the one whole weight."""
    from engine.layers.linear import MergedColumnParallelLinear, QKVParallelLinear

    if isinstance(layer, QKVParallelLinear):
        return ["q", "k", "v"]
    if isinstance(layer, MergedColumnParallelLinear):
        return list(range(len(layer.shard_sizes)))
    return [None]


def _full_sizes(layer: nn.Module) -> list[int]:
    """Each part's output features in the whole model (a fused checkpoint tensor's row split)."""
    if len(_part_ids(layer)) == 1:
        return [layer.output_size * (layer.tp_size if layer.tp_dim == 0 else 1)]
    if hasattr(layer, "shard_sizes"):
        return [size * layer.tp_size for size in layer.shard_sizes]
    kv = layer.total_num_kv_heads * layer.head_dim
    return [layer.total_num_heads * layer.head_dim, kv, kv]


class GGUFLinearMethod(LinearMethodBase):
    """One layer's GGUF parts (see the module docstring); one instance per layer."""

    def create_weights(self, layer: nn.Module) -> None:
        self.part_ids = _part_ids(layer)
        self.part_types: dict[int, int | None] = {}  # part index -> ggml type id, None: dense
        self.matmuls: list = []  # set after loading (process_weights_after_loading)
        # An empty placeholder the loader addresses: it records the engine dtype and device.
        layer.register_parameter("weight", new_param((0,), torch.get_default_dtype()))
        # The layer's loader for `weight`, shadowing LinearBase.weight_loader on this instance (the
        # bias keeps the class's): a part's parameter can only be made once its type is read.
        layer.weight_loader = lambda param, loaded, shard_id=None: self.load_part(layer, loaded, shard_id)

    def load_part(self, layer: nn.Module, loaded, shard_id) -> None:
        """A checkpoint tensor (GGUFBlocks, or a dense tensor) for part `shard_id` (None: the
        unfused weight, or a fused layer's parts stored as one tensor) into this rank's parameter."""
        if shard_id is None and len(self.part_ids) > 1:
            sizes = _full_sizes(layer)
            if _rows(loaded) != sum(sizes):
                raise ValueError(f"fused tensor has {_rows(loaded)} rows, expected {' + '.join(map(str, sizes))}")
            offset = 0
            for part, size in zip(self.part_ids, sizes):
                self.load_part(layer, loaded.narrow(0, offset, size), part)
                offset += size
            return
        index = self.part_ids.index(shard_id) if shard_id in self.part_ids else None
        if index is None:
            raise ValueError(f"shard_id={shard_id!r} is invalid for parts {self.part_ids}")
        _, size, theirs = (layer._output_shard(shard_id) if layer.tp_dim == 0 or shard_id is not None
                           else (0, layer.output_size, 0))
        loaded = loaded.narrow(0, theirs, size)
        if layer.tp_dim == 1:
            _, in_size, in_offset = layer._input_shard()
            loaded = loaded.narrow(1, in_offset, in_size)
        self._store(layer, index, loaded, size)

    def _store(self, layer: nn.Module, index: int, loaded, rows: int) -> None:
        placeholder = layer.weight
        if isinstance(loaded, GGUFBlocks):
            elems, nbytes = BLOCK_LAYOUTS[loaded.qtype]
            shape, qtype = (rows, layer.input_size // elems * nbytes), loaded.qtype
            if layer.input_size % elems:
                raise ValueError(f"input_size={layer.input_size} is not a multiple of "
                                 f"{TYPE_NAMES[qtype]}'s block of {elems} features")
            data = loaded.data
        else:
            shape, qtype, data = (rows, layer.input_size), None, loaded
        if tuple(data.shape) != shape:
            raise ValueError(f"checkpoint tensor has shape {tuple(data.shape)}, expected {shape}")
        dtype = torch.uint8 if qtype is not None else placeholder.dtype
        # A copy of our own: never a view into the memory-mapped file or another rank's rows.
        tensor = torch.empty(shape, dtype=dtype, device=placeholder.device)
        tensor.copy_(data)
        layer.register_parameter(f"weight_{index}", nn.Parameter(tensor, requires_grad=False))
        self.part_types[index] = qtype

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        missing = [self.part_ids[i] for i in range(len(self.part_ids)) if i not in self.part_types]
        if missing:
            raise ValueError(f"GGUF layer has no tensor for part(s) {missing}")
        self.matmuls = []  # one per group of neighbouring parts of one type: x [n, in] -> [n, rows]
        i = 0
        while i < len(self.part_ids):
            j = i + 1
            while j < len(self.part_ids) and self.part_types[j] == self.part_types[i]:
                j += 1
            names = [f"weight_{k}" for k in range(i, j)]
            merged = torch.cat([getattr(layer, n).data for n in names]) if j - i > 1 else getattr(layer, names[0]).data
            for n in names:
                delattr(layer, n)
            layer.register_parameter(f"weight_{i}", nn.Parameter(merged, requires_grad=False))
            self.matmuls.append(_matmul(layer, f"weight_{i}", self.part_types[i]))
            i = j

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        x2 = x.reshape(-1, x.shape[-1])
        outs = [matmul(x2) for matmul in self.matmuls]
        y = outs[0] if len(outs) == 1 else torch.cat(outs, dim=-1)
        if bias is not None:
            y = y + bias
        return y.reshape(*x.shape[:-1], y.shape[-1])


def _matmul(layer: nn.Module, name: str, qtype: int | None):
    """x -> x @ W.T for the parameter `name`, with the kernel for its type and device, chosen once."""
    weight = getattr(layer, name)
    if qtype is not None and weight.device.type == "cpu":
        from kernels.cpu_gguf import gguf_linear_cpu

        return lambda x: gguf_linear_cpu(x, weight, qtype)
    if qtype is not None:
        from kernels.triton_gguf_gemm import gguf_gemm

        return lambda x: gguf_gemm(x, weight, qtype)
    from engine.layers.cpu_gemm import can_pack, pack, packed_linear

    if can_pack(weight):  # CPU fp32 dense part: packed for oneDNN as UnquantizedLinearMethod's weights
        packed = pack(weight)
        weight.data = torch.empty(0, dtype=weight.dtype)
        return lambda x: packed_linear(x, packed, None)
    return lambda x: F.linear(x, weight)


def _rows(loaded) -> int:
    return (loaded.data if isinstance(loaded, GGUFBlocks) else loaded).shape[0]
