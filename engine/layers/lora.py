"""LoRA slots of one linear layer, and the delta they add to its output in a step.

Each LoRA-capable linear (engine/lora/worker_manager.py picks them) holds, for this TP rank,
R = max_lora_rank and P = its parts (3 for qkv_proj, 2 for gate_up_proj, 1 otherwise):

    lora_a [max_loras, P * R, in_local]    part p's A in rows p*R : p*R + r, the rest zero
    lora_b [max_loras, out_local, P * R]   part p's scaling * B in its output rows and columns
                                           p*R : p*R + r: block-diagonal over the parts; stored
                                           transposed ([max_loras, P * R, out_local] contiguous),
                                           so every delta path reads B^T along the outputs

        lora_b[slot] of qkv_proj:   cols  [ q's R | k's R | v's R ]
                           q rows   [  B_q  |   0   |   0   ]
                           k rows   [   0   |  B_k  |   0   ]
                           v rows   [   0   |   0   |  B_v  ]

Why this layout: every part has its own A (q, k and v adapt independently), and stacking them
along the rank makes a fused layer's delta, all parts at once, one shrink and one expand matmul
per adapter, as for an unfused layer; the zeros cost P x the expand's FLOPs, small next to the
base matmul at ranks <= 64. The scaling is folded into B when an adapter is loaded.

Tensor parallelism follows the base layer's own sharding (its `_output_shard` / `_input_shard`):
a column-parallel layer keeps A whole and holds its rows of B; a row-parallel layer holds its
columns of A and B whole, so its delta is a partial sum that the layer's all_reduce adds up
with the base output's.

Two ways to add the delta, picked once per engine by device (engine/lora/worker_manager.py):
`LoRASlots` (CPU) runs every adapter row of the step in one call of the C kernel
(kernels/cpu_lora.c; fp32), else loops over the step's adapters with torch matmuls;
`TritonLoRASlots` (CUDA) runs them in one shrink and one expand launch (kernels/triton_lora.py)
and captures into CUDA graphs. The kernels read only the diagonal blocks of B.
"""
from __future__ import annotations

import torch

from engine.layers.linear import QKVParallelLinear
from engine.worker.forward_context import get_forward_context
from kernels.cpu_lora import lora_delta


class LoRASlots:
    def __init__(self, layer, num_parts: int, max_loras: int, max_rank: int, dtype: torch.dtype,
                 device: torch.device):
        self.layer, self.num_parts, self.max_rank = layer, num_parts, max_rank
        in_local = layer.input_size
        out_local = layer.output_size
        self.lora_a = torch.zeros(max_loras, num_parts * max_rank, in_local, dtype=dtype, device=device)
        b_t = torch.zeros(max_loras, num_parts * max_rank, out_local, dtype=dtype, device=device)
        self.lora_b = b_t.transpose(1, 2)  # [max_loras, out_local, P * R], B^T contiguous underneath
        # [P + 1]: part p's rows of this rank's output are part_offsets[p] .. part_offsets[p + 1]
        self.part_offsets = torch.tensor(part_offsets(layer, num_parts), dtype=torch.int64)

    def set_slot(self, slot: int, parts: list[tuple[object, torch.Tensor, torch.Tensor]], scaling: float) -> None:
        """Slot `slot` := an adapter's parts [(shard_id, A [r, in_full], B [out_part_full, r])];
        parts the adapter does not adapt stay zero (no delta)."""
        self.lora_a[slot].zero_()
        self.lora_b[slot].zero_()
        _, in_size, in_offset = self.layer._input_shard()
        for shard_id, a, b in parts:
            p = self.layer._shard_index(shard_id)
            r = a.shape[0]
            cols = slice(p * self.max_rank, p * self.max_rank + r)
            self.lora_a[slot, cols].copy_(a.narrow(1, in_offset, in_size))
            ours, size, theirs = self.layer._output_shard(shard_id)
            self.lora_b[slot, ours:ours + size, cols].copy_(b.narrow(0, theirs, size) * scaling)

    def clear_slot(self, slot: int) -> None:
        self.lora_a[slot].zero_()
        self.lora_b[slot].zero_()

    def add_delta(self, x: torch.Tensor, y: torch.Tensor) -> None:
        """y [n, out_local] += scaling * (x [n, in_local] @ A.T) @ B.T for the rows of each adapter
        in this step (forward context's `lora_mapping`); base-model rows are left alone."""
        mapping = get_forward_context().lora_mapping
        if mapping is None:
            return
        if mapping.token_slots is not None and lora_delta(y, x, self.lora_a, self.lora_b, mapping.token_slots,
                                                          self.part_offsets):
            return
        for slot, rows in zip(mapping.slots, mapping.row_indices):
            if rows is None:  # every row of the step runs this adapter: no gather, no scatter
                y += (x @ self.lora_a[slot].T) @ self.lora_b[slot].T
            else:
                y.index_add_(0, rows, (x.index_select(0, rows) @ self.lora_a[slot].T) @ self.lora_b[slot].T)


class TritonLoRASlots(LoRASlots):
    """The same slots; the delta from the Triton kernels, every adapter of the step at once,
    the forward context's mapping being a LoRAKernelMapping."""

    def __init__(self, layer, num_parts: int, max_loras: int, max_rank: int, dtype: torch.dtype,
                 device: torch.device):
        super().__init__(layer, num_parts, max_loras, max_rank, dtype, device)
        from kernels.triton_lora import add_lora  # triton only where the kernels run

        self._add_lora = add_lora
        self.part_offsets = self.part_offsets.to(device, torch.int32)

    def add_delta(self, x: torch.Tensor, y: torch.Tensor) -> None:
        mapping = get_forward_context().lora_mapping
        if mapping is None:
            return
        self._add_lora(y, x, self.lora_a, self.lora_b, mapping.sorted_token_ids, mapping.slot_starts,
                       self.part_offsets)


def part_offsets(layer, num_parts: int) -> list[int]:
    """Where each fused part's rows start in this rank's output, then the output's size: [P + 1]."""
    if num_parts == 1:
        return [0, layer.output_size]
    shard_ids = ("q", "k", "v") if isinstance(layer, QKVParallelLinear) else range(num_parts)
    return [layer._output_shard(shard_id)[0] for shard_id in shard_ids] + [layer.output_size]
