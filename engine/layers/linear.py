"""Linear layers, sharded for tensor parallelism.

Weights follow torch's `[output_size, input_size]` layout. A column-parallel
layer splits the output dim (each rank computes a slice of the features, no
communication); a row-parallel layer splits the input dim (each rank computes a
partial sum, summed by all_reduce in `forward`). Every parameter carries a
`weight_loader(param, loaded_weight, shard_id=None)` that cuts this rank's slice
out of the full checkpoint tensor, so the loader knows nothing about TP. The fused layers
also take a checkpoint that stores their parts fused already (Phi-3's qkv_proj, gate_up_proj):
shard_id None means "every part, in order", which they split and load part by part.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine.executor.parallel_state import get_tp_rank, get_tp_size, tensor_model_parallel_all_reduce
from engine.layers.cpu_gemm import packed_linear


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
    """Holds this rank's `[output_size, input_size]` weight (and bias); `tp_dim` is the sharded dim."""

    def __init__(self, input_size: int, output_size: int, bias: bool, tp_dim: int | None):
        super().__init__()
        self.tp_rank, self.tp_size, self.tp_dim = get_tp_rank(), get_tp_size(), tp_dim
        self.input_size, self.output_size = input_size, output_size
        self.weight = nn.Parameter(torch.empty(output_size, input_size), requires_grad=False)
        self.weight.weight_loader = self.weight_loader
        if bias:
            self.bias = nn.Parameter(torch.empty(output_size), requires_grad=False)
            self.bias.weight_loader = self.weight_loader
        else:
            self.register_parameter("bias", None)
        # CPU fp32 after loading: the weight packed for oneDNN (engine.layers.cpu_gemm), and
        # `weight` emptied; None means F.linear on `weight`.
        self.packed_weight: torch.Tensor | None = None

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id=None) -> None:
        raise NotImplementedError

    def _matmul(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if self.packed_weight is not None:
            return packed_linear(x, self.packed_weight, bias)
        return F.linear(x, self.weight, bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._matmul(x, self.bias)


class ColumnParallelLinear(LinearBase):
    """Output features split across ranks: [n, input] -> [n, output / tp_size], no communication."""

    def __init__(self, input_size: int, output_size: int, bias: bool = False):
        super().__init__(input_size, divide(output_size, get_tp_size(), "output_size"), bias, 0)

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id=None) -> None:
        size = param.data.size(0)
        copy_weight(param.data, loaded_weight.narrow(0, self.tp_rank * size, size))


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
            _load_fused(self.weight_loader, param, loaded_weight,
                        {i: size * self.tp_size for i, size in enumerate(self.shard_sizes)})
            return
        if shard_id not in range(len(self.shard_sizes)):
            raise ValueError(f"shard_id={shard_id!r} is invalid for {len(self.shard_sizes)} merged outputs")
        size = self.shard_sizes[shard_id]
        dst = param.data.narrow(0, sum(self.shard_sizes[:shard_id]), size)
        copy_weight(dst, loaded_weight.narrow(0, self.tp_rank * size, size))


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
            _load_fused(self.weight_loader, param, loaded_weight, {"q": q, "k": kv, "v": kv})
            return
        if shard_id == "q":
            offset, size, rank = 0, self.q_size, self.tp_rank
        elif shard_id in ("k", "v"):
            offset = self.q_size if shard_id == "k" else self.q_size + self.kv_size
            size, rank = self.kv_size, self.tp_rank // self.kv_replicas
        else:
            raise ValueError(f"shard_id={shard_id!r} is invalid: expected 'q', 'k' or 'v'")
        copy_weight(param.data.narrow(0, offset, size), loaded_weight.narrow(0, rank * size, size))


def _load_fused(weight_loader, param: nn.Parameter, loaded_weight: torch.Tensor, sizes: dict) -> None:
    """A checkpoint tensor holding every part's full rows in order ({shard_id: rows}), loaded part by part."""
    if loaded_weight.shape[0] != sum(sizes.values()):
        raise ValueError(f"fused checkpoint tensor has {loaded_weight.shape[0]} rows, expected "
                         f"{' + '.join(map(str, sizes.values()))} ({', '.join(map(str, sizes))})")
    offset = 0
    for shard_id, size in sizes.items():
        weight_loader(param, loaded_weight.narrow(0, offset, size), shard_id)
        offset += size


class RowParallelLinear(LinearBase):
    """Input features split across ranks: [n, input / tp_size] -> partial [n, output], summed over ranks."""

    def __init__(self, input_size: int, output_size: int, bias: bool = False):
        super().__init__(divide(input_size, get_tp_size(), "input_size"), output_size, bias, 1)

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id=None) -> None:
        if param.dim() == 1:  # the bias is not sharded
            copy_weight(param.data, loaded_weight)
            return
        size = param.data.size(1)
        copy_weight(param.data, loaded_weight.narrow(1, self.tp_rank * size, size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Only rank 0 adds the bias: the all_reduce sums it otherwise tp_size times.
        y = self._matmul(x, self.bias if self.tp_rank == 0 else None)
        return tensor_model_parallel_all_reduce(y)
