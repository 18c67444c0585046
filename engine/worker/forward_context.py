"""The one place per-step attention metadata lives during a forward, and how a step's host lists reach the device.

Model code sees only `(input_ids, positions)`; each `Attention` layer reads the
metadata from here. It is set around the forward and restored in `finally`, so
a failed step never leaves stale metadata for the next.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import numpy as np
import torch


@dataclass
class AttentionMetadata:
    """Flat-batch layout: tokens of sequence s are rows cu_seqlens_q[s]:cu_seqlens_q[s+1].

    Example, block_size 4, a 6-token prefill chunk of seq 0 with 2 tokens cached, and a decode of seq 1:
        query rows      [ s0 s0 s0 s0 s0 s0 | s1 ]     cu_seqlens_q = [0, 6, 7]
        seq_lens        [ 8, 21 ]   (cached + new; row i of seq s sits at position seq_len - q_len + i)
        slot_mapping    one cache slot per row = block_table[pos // 4] * 4 + pos % 4
    """

    slot_mapping: torch.Tensor    # [num_tokens] int64, where each new token's K/V go (< 0: padding, skipped)
    block_tables: torch.Tensor    # [num_seqs, max_blocks_per_seq] int32, padded with 0
    seq_lens: torch.Tensor        # [num_seqs] int32, context length incl. the new tokens
    cu_seqlens_q: torch.Tensor    # [num_seqs + 1] int32, query row offsets
    max_seqlen_q: int             # longest query chunk in this step
    max_seqlen_k: int             # longest context in this step
    # Host copies, so the torch backend can slice without a device sync.
    seq_lens_cpu: list[int] | None = None
    query_lens_cpu: list[int] | None = None
    # KV cache groups after the first (engine.core.kv_cache_groups), same layouts as
    # slot_mapping / block_tables: a layer of group g > 0 reads entry g - 1.
    group_slot_mappings: list[torch.Tensor] = field(default_factory=list)
    group_block_tables: list[torch.Tensor] = field(default_factory=list)

    def kv_group(self, group: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(slot_mapping, block_tables) of KV cache group `group`."""
        if group == 0:
            return self.slot_mapping, self.block_tables
        return self.group_slot_mappings[group - 1], self.group_block_tables[group - 1]

    @property
    def num_seqs(self) -> int:
        return self.seq_lens.shape[0]


@dataclass
class LoRAMapping:
    """Which rows of the step's flat batch run which LoRA slot (engine/layers/lora.py): the rows of
    `slots[i]` are `row_indices[i]` ([num_rows] int64), or every row when that is None. Base-model
    rows are in no entry. At most max_loras entries, so a layer loops over adapters, never tokens.
    `token_slots` is the same per row, as the CPU kernel reads it (kernels/cpu_lora.c)."""

    slots: list[int]
    row_indices: list[torch.Tensor | None]
    token_slots: torch.Tensor | None = None  # [num_tokens] int32, -1 for the base model


@dataclass
class LoRAKernelMapping:
    """The same on CUDA, as the Triton kernels read it (kernels/lora_mapping.py): the rows grouped by
    slot, base rows last, and where each slot's group starts. In a captured graph these are views of
    static buffers that each replay refills."""

    sorted_token_ids: torch.Tensor  # [num_tokens] int32
    slot_starts: torch.Tensor       # [max_loras + 1] int32: slot s's rows are sorted_token_ids[starts[s]:starts[s+1]]


@dataclass
class ForwardContext:
    attn_metadata: AttentionMetadata | None
    # None: no adapter in this step (or LoRA is off); LoRAKernelMapping on CUDA, LoRAMapping elsewhere.
    lora_mapping: LoRAMapping | LoRAKernelMapping | None = None


_forward_context: ForwardContext | None = None


def get_forward_context() -> ForwardContext:
    if _forward_context is None:
        raise RuntimeError("no forward context: the model must run inside set_forward_context()")
    return _forward_context


@contextlib.contextmanager
def set_forward_context(attn_metadata: AttentionMetadata | None,
                        lora_mapping: LoRAMapping | LoRAKernelMapping | None = None):
    global _forward_context
    prev = _forward_context
    _forward_context = ForwardContext(attn_metadata, lora_mapping)
    try:
        yield _forward_context
    finally:
        _forward_context = prev


_NUMPY = {torch.int32: np.int32, torch.int64: np.int64}


def to_device(data: list, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Host list -> device tensor: the one way a step's inputs (the runner's, the sampler's) reach the device.
    On CUDA, via pinned memory and non_blocking: the copy overlaps, nothing syncs."""
    # Nested lists (block tables) through numpy: torch.tensor walks them element by element.
    host = torch.from_numpy(np.array(data, dtype=_NUMPY[dtype])) \
        if data and isinstance(data[0], list) and dtype in _NUMPY else torch.tensor(data, dtype=dtype)
    if device.type == "cuda":
        return host.pin_memory().to(device, non_blocking=True)
    return host.to(device)
