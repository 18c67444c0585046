"""Linear layers, sharded for tensor parallelism.

Weights follow torch's `[output_size, input_size]` layout. A column-parallel
layer splits the output dim (each rank computes a slice of the features, no
communication); a row-parallel layer splits the input dim (each rank computes a
partial sum, summed by all_reduce in `forward`). Every parameter carries a
`weight_loader(param, loaded_weight, shard_id=None)` that cuts this rank's slice
out of the full checkpoint tensor, so the loader knows nothing about TP. The fused layers
also take a checkpoint that stores their parts fused already (Phi-3's qkv_proj, gate_up_proj):
shard_id None means "every part, in order", which they split and load part by part.

A layer's parameters come from its `quant_method` (engine.layers.quantization): a dense `weight`
by default, or a format's packed tensors and scales. The loaders below shard any of them by the
layout the method recorded on it (`set_layout`): which dims run along the output and input
features, and how many features one packed row holds.
"""
from __future__ import annotations

import torch
from torch import nn

from engine.executor.parallel_state import get_tp_rank, get_tp_size, tensor_model_parallel_all_reduce
from engine.layers.quantization import (LinearMethodBase, UnquantizedLinearMethod, is_building_quantized,
                                        set_layout)


def divide(numerator: int, denominator: int, what: str) -> int:
    if numerator % denominator:
        raise ValueError(f"{what}={numerator} is not divisible by tensor_parallel_size={denominator}")
    return numerator // denominator


def copy_weight(param: torch.Tensor, loaded: torch.Tensor) -> None:
    """Copy with an exact shape check: `copy_` would silently broadcast a wrong-sized tensor."""
    if param.shape != loaded.shape:
        raise ValueError(f"checkpoint tensor has shape {tuple(loaded.shape)}, expected {tuple(param.shape)}")
    param.copy_(loaded)  # also casts to the parameter's dtype and device


class LinearBase(nn.Module):
    """This rank's share of a `[output_size, input_size]` linear layer; `tp_dim` is the sharded dim
    (0: output features, 1: input features, None: replicated).

    Subclasses say where a checkpoint part lands (`_output_shard`, `_input_shard`); the loader
    applies that to every parameter the quant method created."""

    def __init__(self, input_size: int, output_size: int, bias: bool, tp_dim: int | None):
        super().__init__()
        self.tp_rank, self.tp_size, self.tp_dim = get_tp_rank(), get_tp_size(), tp_dim
        self.input_size, self.output_size = input_size, output_size
        # CPU fp32 after loading: the weight packed for oneDNN (engine.layers.cpu_gemm), and
        # `weight` emptied; None means F.linear on `weight`.
        self.packed_weight: torch.Tensor | None = None
        self.quant_method: LinearMethodBase | None = None
        # With enable_lora: this layer's adapter slots (engine.layers.lora), attached after loading.
        self.lora = None
        if bias:
            self.bias = set_layout(nn.Parameter(torch.empty(output_size), requires_grad=False), output_dim=0)
            self.bias.weight_loader = self.weight_loader
        else:
            self.register_parameter("bias", None)
        if not is_building_quantized():  # else quantize_linear_layers sets it, by module name
            self.set_quant_method(UnquantizedLinearMethod())

    def set_quant_method(self, method: LinearMethodBase) -> None:
        """Create this layer's parameters in `method`'s layout (before any weight is loaded)."""
        self.quant_method = method
        method.create_weights(self)
        for name, param in self.named_parameters(recurse=False):
            if name != "bias":
                param.weight_loader = self.weight_loader

    def process_weights_after_loading(self) -> None:
        self.quant_method.process_weights_after_loading(self)

    # -- where a checkpoint part lands, in logical features: (offset in ours, size, offset in the part)
    def _output_shard(self, shard_id) -> tuple[int, int, int]:
        return 0, self.output_size, 0

    def _input_shard(self) -> tuple[int, int, int]:
        return 0, self.input_size, 0

    def _shard_index(self, shard_id) -> int:
        """The part's index among a fused layer's parts (0 for an unfused layer)."""
        return 0

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id=None) -> None:
        if getattr(param, "per_shard", False):  # one entry per fused part: copied whole into its slot
            copy_weight(param.data[self._shard_index(shard_id)], loaded_weight.reshape(param.shape[1:]))
            return
        dst, src = param.data, loaded_weight
        out_dim, in_dim = getattr(param, "output_dim", None), getattr(param, "input_dim", None)
        if out_dim is not None and (self.tp_dim == 0 or shard_id is not None):
            dst, src = _narrow_pair(dst, src, out_dim, self._output_shard(shard_id), param.output_block,
                                    self.output_size)
        if in_dim is not None and self.tp_dim == 1:
            dst, src = _narrow_pair(dst, src, in_dim, self._input_shard(), param.input_block, self.input_size)
        copy_weight(dst, src)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._linear(x, self.bias)

    def _linear(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        y = self.quant_method.apply(self, x, bias)
        if self.lora is not None:  # this step's adapters' deltas: before a row-parallel all_reduce
            self.lora.add_delta(x, y)
        return y


def _narrow_pair(dst: torch.Tensor, src: torch.Tensor, dim: int, shard: tuple[int, int, int],
                 block: tuple[int, int], total: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Our slice (offset, size) of `dst` and the part's slice of `src` along `dim`, in whole blocks."""
    ours, size, theirs = shard
    if not (ours == 0 and size == total):
        dst = _narrow_blocks(dst, dim, ours, size, block)
    if not (theirs == 0 and src.shape[dim] == _rows(size, block)):
        src = _narrow_blocks(src, dim, theirs, size, block)
    return dst, src


def _rows(features: int, block: tuple[int, int]) -> int:
    elems, units = block
    return -(-features // elems) * units


def _narrow_blocks(t: torch.Tensor, dim: int, offset: int, size: int, block: tuple[int, int]) -> torch.Tensor:
    elems, units = block
    if offset % elems or size % elems:
        raise ValueError(f"a shard of {size} features at offset {offset} does not fall on whole quantization "
                         f"blocks of {elems} features (tensor_parallel_size or the fused parts' sizes)")
    return t.narrow(dim, offset // elems * units, size // elems * units)


class ColumnParallelLinear(LinearBase):
    """Output features split across ranks: [n, input] -> [n, output / tp_size], no communication."""

    def __init__(self, input_size: int, output_size: int, bias: bool = False):
        super().__init__(input_size, divide(output_size, get_tp_size(), "output_size"), bias, 0)

    def _output_shard(self, shard_id) -> tuple[int, int, int]:
        return 0, self.output_size, self.tp_rank * self.output_size


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel outputs in one matmul (gate and up). Rank r's weight rows:

        [ gate rows of rank r | up rows of rank r ]   shard_id 0, 1, ... index `output_sizes`,
                                                      None: [gate | up] of the full model fused
    """

    def __init__(self, input_size: int, output_sizes: list[int], bias: bool = False):
        tp_size = get_tp_size()
        self.shard_sizes = [divide(s, tp_size, "output_size") for s in output_sizes]
        super().__init__(input_size, sum(output_sizes), bias)

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id=None) -> None:
        if shard_id is None:
            _load_fused(super().weight_loader, param, loaded_weight,
                        {i: size * self.tp_size for i, size in enumerate(self.shard_sizes)})
            return
        super().weight_loader(param, loaded_weight, shard_id)

    def _shard_index(self, shard_id) -> int:
        if shard_id not in range(len(self.shard_sizes)):
            raise ValueError(f"shard_id={shard_id!r} is invalid for {len(self.shard_sizes)} merged outputs")
        return shard_id

    def _output_shard(self, shard_id) -> tuple[int, int, int]:
        i = self._shard_index(shard_id)
        size = self.shard_sizes[i]
        return sum(self.shard_sizes[:i]), size, self.tp_rank * size


class QKVParallelLinear(ColumnParallelLinear):
    """Fused q/k/v projection, split by heads. Rank r's weight rows:

        [ q heads of rank r | k heads of rank r | v heads of rank r ]

    With fewer KV heads than ranks, each KV head is replicated on tp_size / num_kv_heads
    consecutive ranks (rank r holds head r // replicas), so every rank has one.
    shard_id None: the full model's [q | k | v] rows fused, as Phi-3 stores them.
    """

    def __init__(self, hidden_size: int, head_dim: int, total_num_heads: int,
                 total_num_kv_heads: int, bias: bool = False):
        tp_size = get_tp_size()
        self.head_dim, self.total_num_heads, self.total_num_kv_heads = head_dim, total_num_heads, total_num_kv_heads
        self.num_heads = divide(total_num_heads, tp_size, "num_attention_heads")
        if total_num_kv_heads >= tp_size:
            self.num_kv_heads = divide(total_num_kv_heads, tp_size, "num_key_value_heads")
            self.kv_replicas = 1
        else:
            self.num_kv_heads = 1
            self.kv_replicas = divide(tp_size, total_num_kv_heads, "tensor_parallel_size vs num_key_value_heads")
        self.q_size = self.num_heads * head_dim
        self.kv_size = self.num_kv_heads * head_dim
        output_size = (self.num_heads + 2 * self.num_kv_heads) * head_dim * tp_size
        super().__init__(hidden_size, output_size, bias)

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id=None) -> None:
        if shard_id is None:
            q, kv = self.total_num_heads * self.head_dim, self.total_num_kv_heads * self.head_dim
            _load_fused(super().weight_loader, param, loaded_weight, {"q": q, "k": kv, "v": kv})
            return
        super().weight_loader(param, loaded_weight, shard_id)

    def _shard_index(self, shard_id) -> int:
        if shard_id not in ("q", "k", "v"):
            raise ValueError(f"shard_id={shard_id!r} is invalid: expected 'q', 'k' or 'v'")
        return "qkv".index(shard_id)

    def _output_shard(self, shard_id) -> tuple[int, int, int]:
        if self._shard_index(shard_id) == 0:
            return 0, self.q_size, self.tp_rank * self.q_size
        offset = self.q_size if shard_id == "k" else self.q_size + self.kv_size
        return offset, self.kv_size, self.tp_rank // self.kv_replicas * self.kv_size


def _load_fused(weight_loader, param: nn.Parameter, loaded_weight: torch.Tensor, sizes: dict) -> None:
    """A checkpoint tensor holding every part's full rows in order ({shard_id: features}), loaded
    part by part (along the param's output dim, in its packed rows)."""
    dim, block = getattr(param, "output_dim", None), getattr(param, "output_block", (1, 1))
    if dim is None or getattr(param, "per_shard", False):
        raise ValueError(f"a fused checkpoint tensor of shape {tuple(loaded_weight.shape)} cannot be split "
                         f"for a parameter that does not run along the output features")
    rows = {shard_id: _rows(size, block) for shard_id, size in sizes.items()}
    if loaded_weight.shape[dim] != sum(rows.values()):
        raise ValueError(f"fused checkpoint tensor has {loaded_weight.shape[dim]} rows, expected "
                         f"{' + '.join(map(str, rows.values()))} ({', '.join(map(str, sizes))})")
    offset = 0
    for shard_id, n in rows.items():
        weight_loader(param, loaded_weight.narrow(dim, offset, n), shard_id)
        offset += n


class RowParallelLinear(LinearBase):
    """Input features split across ranks: [n, input / tp_size] -> partial [n, output], summed over ranks."""

    def __init__(self, input_size: int, output_size: int, bias: bool = False):
        super().__init__(divide(input_size, get_tp_size(), "input_size"), output_size, bias, 1)

    def _input_shard(self) -> tuple[int, int, int]:
        return 0, self.input_size, self.tp_rank * self.input_size

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Only rank 0 adds the bias: the all_reduce sums it otherwise tp_size times.
        y = self._linear(x, self.bias if self.tp_rank == 0 else None)
        return tensor_model_parallel_all_reduce(y)
