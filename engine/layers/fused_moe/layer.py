"""FusedMoE: one MoE layer's experts, stacked, with their own weight_loader.

Parameters, named as transformers 5 names them (its fused checkpoints load as they are):

    gate_up_proj [E, 2 * I / tp, H]   expert e: [ gate rows of rank r | up rows of rank r ]
    down_proj    [E, H, I / tp]       expert e: the columns of rank r
    gate_up_proj_bias [E, 2 * I / tp], down_proj_bias [E, H]   with has_bias (gpt-oss)

Tensor parallelism shards every expert's intermediate dim I exactly as
MergedColumnParallelLinear / RowParallelLinear shard a dense MLP's, so each rank
computes a partial sum of the layer's output, all-reduced at the end of `forward`
(where a dense MLP's down_proj reduces).

Checkpoints name experts one by one (`...experts.{e}.gate_proj.weight`, Mixtral's
`w1`/`w3`/`w2`); the loader maps each to its stacked parameter with shard id
(e, 0 | 1) for gate / up and (e, None) for down, and a fused tensor (all experts at
once, transformers 5's layout) comes with shard id None. A fused gate_up whose gate and up
rows alternate (gpt-oss: g0 u0 g1 u1 ...; `gate_up_interleaved`) is split into the stacked
[gate | up] form as it loads, so the kernels see one layout.

The down bias is added on TP rank 0 only (the all-reduce would sum it tp_size times), as
RowParallelLinear adds its bias.
"""
from __future__ import annotations

import torch
from torch import nn

from engine.executor.parallel_state import get_tp_rank, get_tp_size, tensor_model_parallel_all_reduce
from engine.layers.cpu_gemm import can_pack, pack, packed_linear
from engine.layers.fused_moe.routing import select_experts
from engine.layers.linear import copy_weight, divide
from kernels.torch_fused_moe import ClampedSwiGLU, fused_moe_torch


def _check_shape(loaded: torch.Tensor, expected: list[int]) -> None:
    """Before narrowing out this rank's slice: a wrong-sized tensor is named, not a narrow() error."""
    if list(loaded.shape) != expected:
        raise ValueError(f"checkpoint tensor has shape {tuple(loaded.shape)}, expected {tuple(expected)}")


class FusedMoE(nn.Module):
    """[T, H] hidden states and [T, E] router logits -> [T, H]: each token through its top_k
    experts (gated SiLU MLPs), summed with the routing weights, then over the TP ranks."""

    def __init__(self, num_experts: int, top_k: int, hidden_size: int, intermediate_size: int,
                 renormalize: bool, softmax_first: bool = True, has_bias: bool = False,
                 activation: ClampedSwiGLU | None = None, gate_up_interleaved: bool = False):
        """activation: None for SiLU-and-mul; has_bias: each expert's projections have a bias."""
        super().__init__()
        if not 1 <= top_k <= num_experts:
            raise ValueError(f"num_experts_per_tok={top_k} is invalid for num_experts={num_experts}")
        self.num_experts, self.top_k = num_experts, top_k
        self.renormalize, self.softmax_first = renormalize, softmax_first
        self.tp_rank, self.tp_size = get_tp_rank(), get_tp_size()
        self.intermediate_size_per_partition = divide(intermediate_size, self.tp_size, "moe intermediate_size")
        inter = self.intermediate_size_per_partition
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * inter, hidden_size), requires_grad=False)
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden_size, inter), requires_grad=False)
        self.gate_up_proj.weight_loader = self.weight_loader
        self.down_proj.weight_loader = self.weight_loader
        self.activation, self.gate_up_interleaved = activation, gate_up_interleaved
        if has_bias:
            self.gate_up_proj_bias = nn.Parameter(torch.empty(num_experts, 2 * inter), requires_grad=False)
            self.down_proj_bias = nn.Parameter(torch.empty(num_experts, hidden_size), requires_grad=False)
            self.gate_up_proj_bias.weight_loader = self.bias_loader
            self.down_proj_bias.weight_loader = self.bias_loader
        else:
            self.register_parameter("gate_up_proj_bias", None)
            self.register_parameter("down_proj_bias", None)
        # CPU fp32: each expert's two weights packed for oneDNN once loaded (engine.layers.cpu_gemm:
        # F.linear would repack them on every call, most of the time at decode-sized slices).
        # The dense stacks stay, for state_dict and a later move to CUDA: twice the experts' memory.
        self.packed_experts: list[tuple[torch.Tensor, torch.Tensor]] | None = None

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id=None) -> None:
        """shard_id: (expert, 0 | 1) for one expert's gate / up [I, H], (expert, None) for its
        down [H, I]; None for every expert at once ([E, 2 * I, H] or [E, H, I])."""
        inter, rank = self.intermediate_size_per_partition, self.tp_rank
        is_down = param is self.down_proj
        if shard_id is None:  # every expert: the full tensor is param's shape with I unsharded
            full = list(param.shape)
            full[2 if is_down else 1] *= self.tp_size
            _check_shape(loaded_weight, full)
            if is_down:
                copy_weight(param.data, loaded_weight.narrow(2, rank * inter, inter))
                return
            self._load_gate_up(param, loaded_weight)
            return
        expert, part = shard_id
        if not 0 <= expert < self.num_experts:
            raise ValueError(f"expert {expert} is out of range: the layer has {self.num_experts} experts")
        hidden = param.shape[1] if is_down else param.shape[2]
        if is_down:
            _check_shape(loaded_weight, [hidden, inter * self.tp_size])
            copy_weight(param.data[expert], loaded_weight.narrow(1, rank * inter, inter))
        elif part in (0, 1):
            _check_shape(loaded_weight, [inter * self.tp_size, hidden])
            copy_weight(param.data[expert].narrow(0, part * inter, inter), loaded_weight.narrow(0, rank * inter, inter))
        else:
            raise ValueError(f"shard_id={shard_id!r} is invalid for gate_up_proj: expected (expert, 0 or 1)")

    def _load_gate_up(self, param: nn.Parameter, full: torch.Tensor) -> None:
        """Every expert's [E, 2 * I, ...] gate and up (stacked, or interleaved) -> this rank's
        [gate | up] rows: strided views, no copy of the full tensor."""
        inter = self.intermediate_size_per_partition
        for part in (0, 1):
            if self.gate_up_interleaved:
                rows = full[:, part::2]  # [E, I, ...]
            else:
                rows = full.narrow(1, part * inter * self.tp_size, inter * self.tp_size)
            copy_weight(param.data.narrow(1, part * inter, inter), rows.narrow(1, self.tp_rank * inter, inter))

    def bias_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id=None) -> None:
        """Every expert's bias at once: [E, 2 * I] for gate_up (sharded as its rows), [E, H] for down."""
        if shard_id is not None:
            raise ValueError(f"per-expert bias shards are not supported (shard_id={shard_id!r})")
        if param is self.down_proj_bias:
            copy_weight(param.data, loaded_weight)
            return
        _check_shape(loaded_weight, [self.num_experts, param.shape[1] * self.tp_size])
        self._load_gate_up(param, loaded_weight)

    def process_weights_after_loading(self) -> None:
        """Called by the loader once every weight is in."""
        if can_pack(self.gate_up_proj[0]) and can_pack(self.down_proj[0]):
            self.packed_experts = [(pack(self.gate_up_proj[e]), pack(self.down_proj[e]))
                                   for e in range(self.num_experts)]
            # The packed copies are the weights now: the dense ones are freed, as cpu_gemm frees a
            # linear's, keeping only their shape (one element, zero strides) for the kernels' checks.
            for param in (self.gate_up_proj, self.down_proj):
                param.data = torch.zeros((), dtype=param.dtype).expand(param.shape)

    def _packed_linear(self, x: torch.Tensor, expert: int, proj: int) -> torch.Tensor:
        return packed_linear(x, self.packed_experts[expert][proj], None)

    def forward(self, hidden_states: torch.Tensor, router_logits: torch.Tensor) -> torch.Tensor:
        topk_weights, topk_ids = select_experts(router_logits, self.top_k, self.renormalize, self.softmax_first)
        args = (hidden_states, self.gate_up_proj, self.down_proj, topk_weights, topk_ids)
        extra = {}
        if self.gate_up_proj_bias is not None:
            extra.update(b13=self.gate_up_proj_bias, b2=self.down_proj_bias if self.tp_rank == 0 else None)
        if self.activation is not None:
            extra["activation"] = self.activation
        if hidden_states.is_cuda:  # the Triton grouped GEMMs
            from kernels.triton_fused_moe import fused_moe  # triton only where it runs natively

            out = fused_moe(*args, **extra)
        else:  # the sorted per-expert torch path, through the packed weights when loading packed them
            out = fused_moe_torch(*args, expert_linear=self._packed_linear if self.packed_experts else None, **extra)
        return tensor_model_parallel_all_reduce(out)

    def extra_repr(self) -> str:
        return (f"num_experts={self.num_experts}, top_k={self.top_k}, "
                f"intermediate_size_per_partition={self.intermediate_size_per_partition}")
