"""GPTQ checkpoints (AutoGPTQ / GPTQModel's v1 "gptq" format), 4-bit.

Per linear layer, for a logical weight W [N out, K in] and G groups of inputs:

    qweight [K / 8, N] int32   eight consecutive input rows' codes per word, lowest nibble first
    qzeros  [G, N / 8] int32   zero points packed along the outputs, stored minus one (v1's
                               off-by-one: the true zero is the stored nibble + 1)
    scales  [G, N]     fp16
    g_idx   [K]        int32   the group of each input row: k // group_size, or with desc_act
                               (act-order) a permutation's, so a group's rows are scattered over K

    W[n, k] = (q[k, n] - z[g_idx[k], n]) * s[g_idx[k], n]

qweight is already the shared kernel layout (int4_common); the zeros are unpacked at load and
the kernel reads g_idx per row, so act-order needs no reordering of rows or activations. Under
row-parallel TP with desc_act a rank's rows reach groups anywhere in K, so (as vLLM does) every
rank holds all groups' scales and zeros and only g_idx is sharded. A fused layer's parts (q, k,
v; gate, up) read the same inputs, so GPTQ gives them the same act-order: each part's g_idx is kept
until load ends and checked equal, since one matmul cannot follow two orders.
"""
from __future__ import annotations

from typing import Any

import torch
from torch import nn

from engine.layers.linear import MergedColumnParallelLinear, QKVParallelLinear
from engine.layers.quantization.base import LinearMethodBase, QuantizationConfig, new_param
from engine.layers.quantization.int4_common import (Int4LinearMethod, check_choice, check_layer_dims, replace_params,
                                                    unpack_cols)

GROUP_SIZES = (32, 64, 128, -1)  # -1: one group per output (per channel)


class GPTQConfig(QuantizationConfig):
    name = "gptq"

    def __init__(self, group_size: int, desc_act: bool, ignored: list[str] | None = None):
        super().__init__(ignored)
        self.group_size, self.desc_act = group_size, desc_act

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> "GPTQConfig":
        # Other keys (damp_percent, true_sequential, dataset, ...) record the calibration run.
        check_choice("gptq", config, "bits", (4,))
        group_size = check_choice("gptq", config, "group_size", GROUP_SIZES)
        desc_act = check_choice("gptq", config, "desc_act", (False, True), False)
        check_choice("gptq", config, "sym", (False, True), True)
        check_choice("gptq", config, "checkpoint_format", ("gptq",), config.get("format", "gptq"))
        for key in ("dynamic", "lm_head", "modules_in_block_to_quantize"):  # per-module overrides we do not read
            if config.get(key):
                raise ValueError(f"quant_method='gptq': {key}={config[key]!r} is not supported")
        return cls(group_size, desc_act, config.get("modules_to_not_convert"))

    def get_linear_method(self, layer: nn.Module, prefix: str) -> LinearMethodBase:
        method = GPTQLinearMethod(self.group_size, self.desc_act, layer)
        check_layer_dims("gptq", layer, prefix, None if method.replicate_groups else method.group_size)
        return method


class GPTQLinearMethod(Int4LinearMethod):
    def __init__(self, group_size: int, desc_act: bool, layer: nn.Module):
        self.desc_act = desc_act
        row_parallel = layer.tp_dim == 1 and layer.tp_size > 1
        total_in = layer.input_size * (layer.tp_size if layer.tp_dim == 1 else 1)
        self.group_size = total_in if group_size == -1 else group_size
        # Every rank holds all groups: per channel (one group), or act-order rows split across ranks.
        self.replicate_groups = group_size == -1 or (desc_act and row_parallel)
        self.num_groups = (total_in if self.replicate_groups else layer.input_size) // self.group_size
        # The input feature this rank's first row is in the full layer.
        self.row_offset = layer.tp_rank * layer.input_size if layer.tp_dim == 1 else 0
        self.num_parts = (3 if isinstance(layer, QKVParallelLinear) else
                          len(layer.shard_sizes) if isinstance(layer, MergedColumnParallelLinear) else 1)

    def create_weights(self, layer: nn.Module) -> None:
        k, n, g = layer.input_size, layer.output_size, self.num_groups
        groups = dict(output_dim=1, input_dim=None if self.replicate_groups else 0, input_block=(self.group_size, 1))
        layer.register_parameter("qweight", new_param((k // 8, n), torch.int32, output_dim=1, input_dim=0,
                                                      input_block=(8, 1)))
        layer.register_parameter("qzeros", new_param((g, n // 8), torch.int32, output_block=(8, 1), **groups))
        layer.register_parameter("scales", new_param((g, n), torch.float16, **groups))
        if self.num_parts > 1:  # fused parts are column-parallel: their inputs are never split
            layer.register_parameter("g_idx", new_param((self.num_parts, k), torch.int32, per_shard=True))
        else:
            layer.register_parameter("g_idx", new_param((k,), torch.int32, input_dim=0))

    def to_shared_layout(self, layer: nn.Module) -> None:
        zeros = (unpack_cols(layer.qzeros.data) + 1).to(torch.uint8)  # [G, N], v1's stored zero + 1
        replace_params(layer, ("qweight", "qzeros", "scales", "g_idx"), qweight=layer.qweight.data,
                       scales=layer.scales.data, zeros=zeros, g_idx=self._local_g_idx(layer.g_idx.data))

    def _local_g_idx(self, g_idx: torch.Tensor) -> torch.Tensor:
        """The checkpoint's g_idx (this rank's rows), indexing the groups this rank holds."""
        if g_idx.dim() == 2:  # one per fused part
            if not (g_idx == g_idx[:1]).all():
                raise ValueError("quant_method='gptq': the fused parts of a layer have different g_idx "
                                 "(act-order); they cannot share one matmul")
            g_idx = g_idx[0]
        in_order = (torch.arange(g_idx.shape[0], device=g_idx.device) + self.row_offset) // self.group_size
        if not self.desc_act and not torch.equal(g_idx.long(), in_order):
            raise ValueError("quant_method='gptq': g_idx is not in input order although desc_act=false")
        if not self.replicate_groups:  # this rank's groups start at its first row's
            g_idx = g_idx - self.row_offset // self.group_size
        if g_idx.numel() and (int(g_idx.min()) < 0 or int(g_idx.max()) >= self.num_groups):
            raise ValueError(f"quant_method='gptq': g_idx values [{int(g_idx.min())}, {int(g_idx.max())}] fall "
                             f"outside this layer's {self.num_groups} groups")
        return g_idx.to(torch.int32)
