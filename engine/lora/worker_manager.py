"""The adapters of one rank: which adapter sits in which slot, a host cache of their tensors,
and the per-step mapping of rows to slots (vLLM's worker_manager + models, at our size).

    rank 0, prepare_inputs:  plan(lora_requests) -> each sequence's slot, and the loads it needs
    every rank, run_model:   prepare(ModelInput) -> loads applied to its own shards, LoRAMapping

Planning happens once (rank 0) and travels in the ModelInput, so every TP rank puts the same
adapter in the same slot. The scheduler admits at most max_loras adapters among the running
sequences, so a step never needs more slots than there are.
"""
from __future__ import annotations

import logging
from collections import OrderedDict

import torch
from safetensors.torch import load_file

from engine.config import EngineConfig, ModelConfig
from engine.core.messages import ModelInput
from engine.layers.linear import LinearBase, MergedColumnParallelLinear, QKVParallelLinear
from engine.layers.lora import LoRASlots, TritonLoRASlots
from engine.lora.peft_adapter import TARGET_MODULES, PEFTAdapter, read_peft_adapter
from engine.lora.request import LoRARequest
from engine.worker.forward_context import LoRAKernelMapping, LoRAMapping, to_device
from kernels.lora_mapping import sort_tokens_by_slot

logger = logging.getLogger(__name__)
BASE_SLOT = -1  # a sequence without an adapter


class LoRAModelManager:
    def __init__(self, model: torch.nn.Module, config: EngineConfig, model_config: ModelConfig):
        self.max_loras, self.max_lora_rank = config.max_loras, config.max_lora_rank
        self.model_config = model_config
        self.device = torch.device(config.device)
        dtype = getattr(torch, config.dtype)
        # CUDA: the Triton kernels and the sorted-index mapping they read; elsewhere a torch loop over
        # adapters with each one's row indices. Chosen here, once.
        self.use_kernels = use_lora_kernels(self.device)
        slots_cls = TritonLoRASlots if self.use_kernels else LoRASlots
        self._make_mapping = self._kernel_mapping if self.use_kernels else self._row_mapping
        self.layers = _attach_slots(model, model_config, slots_cls, self.max_loras, self.max_lora_rank, dtype,
                                    self.device)
        # Planning (rank 0): adapter id -> its slot, least recently used first.
        self._slot_of: OrderedDict[int, int] = OrderedDict()
        # Host cache (every rank): adapter id -> (adapter, its tensors on the CPU), LRU.
        self._host: OrderedDict[int, tuple[PEFTAdapter, dict[str, torch.Tensor]]] = OrderedDict()
        self.max_cpu_loras = config.max_cpu_loras or config.max_loras

    # -- rank 0 ---------------------------------------------------------------------
    def plan(self, lora_requests: list[LoRARequest | None]) -> tuple[list[int], list[tuple[int, LoRARequest]]]:
        """Each sequence's slot (BASE_SLOT without an adapter) and the (slot, adapter) loads
        this step needs first. A slot not used by this step is reused least recently used first."""
        needed = {r.lora_int_id: r for r in lora_requests if r is not None}
        if len(needed) > self.max_loras:  # the scheduler's max_loras rule keeps this from happening
            raise RuntimeError(f"a step with {len(needed)} adapters exceeds max_loras={self.max_loras}")
        loads = []
        for lora_id, request in needed.items():
            if lora_id in self._slot_of:
                self._slot_of.move_to_end(lora_id)
                continue
            slot = self._free_slot(needed)
            self._slot_of[lora_id] = slot
            loads.append((slot, request))
        return [BASE_SLOT if r is None else self._slot_of[r.lora_int_id] for r in lora_requests], loads

    def _free_slot(self, needed: dict[int, LoRARequest]) -> int:
        used = set(self._slot_of.values())
        free = next((s for s in range(self.max_loras) if s not in used), None)
        if free is not None:
            return free
        victim = next(i for i in self._slot_of if i not in needed)  # oldest first
        return self._slot_of.pop(victim)

    # -- every rank -----------------------------------------------------------------
    def prepare(self, mi: ModelInput) -> LoRAMapping | LoRAKernelMapping | None:
        """Apply the step's loads to this rank's slots; the step's mapping of rows to slots in the
        layers' kind (None: no row runs an adapter)."""
        self.apply_loads(mi)
        if all(slot == BASE_SLOT for slot in mi.lora_slots):
            return None
        return self._make_mapping(mi)

    def apply_loads(self, mi: ModelInput) -> None:
        for slot, request in mi.lora_loads:
            self._load(slot, request)

    def token_slots(self, mi: ModelInput) -> list[int]:
        """Each row's slot ([num_tokens]; BASE_SLOT for the base model)."""
        return [slot for slot, n in zip(mi.lora_slots, mi.query_lens) for _ in range(n)]

    def kernel_rows(self, mi: ModelInput) -> tuple[list[int], list[int]]:
        """The kernels' host lists: (sorted_token_ids [num_tokens], slot_starts [max_loras + 1])."""
        return sort_tokens_by_slot(self.token_slots(mi), self.max_loras)

    def _kernel_mapping(self, mi: ModelInput) -> LoRAKernelMapping:
        sorted_ids, starts = self.kernel_rows(mi)
        return LoRAKernelMapping(to_device(sorted_ids, torch.int32, self.device),
                                 to_device(starts, torch.int32, self.device))

    def _row_mapping(self, mi: ModelInput) -> LoRAMapping:
        rows: dict[int, list[int]] = {}
        start = 0
        for slot, n in zip(mi.lora_slots, mi.query_lens):
            if slot != BASE_SLOT:
                rows.setdefault(slot, []).extend(range(start, start + n))
            start += n
        return LoRAMapping(list(rows), [None if len(r) == start else to_device(r, torch.long, self.device)
                                        for r in rows.values()],
                           to_device(self.token_slots(mi), torch.int32, self.device))

    def _load(self, slot: int, request: LoRARequest) -> None:
        adapter, tensors = self._host_adapter(request)
        parts: dict[str, list] = {}
        for t in adapter.targets:
            parts.setdefault(t.layer, []).append((t.shard_id, tensors[t.a_key], tensors[t.b_key]))
        for name, slots in self.layers.items():
            if name in parts:
                slots.set_slot(slot, parts[name], adapter.scaling)
            else:
                slots.clear_slot(slot)
        logger.debug("LoRA adapter %s (id %d) loaded into slot %d", request.lora_name, request.lora_int_id, slot)

    def _host_adapter(self, request: LoRARequest) -> tuple[PEFTAdapter, dict[str, torch.Tensor]]:
        lora_id = request.lora_int_id
        if lora_id in self._host:
            self._host.move_to_end(lora_id)
            return self._host[lora_id]
        adapter = read_peft_adapter(request, self.max_lora_rank, self.model_config)  # checked on arrival too
        entry = adapter, load_file(adapter.weights_path, device="cpu")
        self._host[lora_id] = entry
        while len(self._host) > self.max_cpu_loras:
            self._host.popitem(last=False)
        return entry


def use_lora_kernels(device: torch.device) -> bool:
    """Whether the layers add their deltas with the Triton kernels: where they run natively."""
    return device.type == "cuda"


def _attach_slots(model: torch.nn.Module, model_config: ModelConfig, slots_cls: type[LoRASlots], max_loras: int,
                  max_rank: int, dtype: torch.dtype, device: torch.device) -> dict[str, LoRASlots]:
    """Slots on every decoder layer's projections that PEFT targets; a model without them all
    (a mixture of experts, Phi-3's fused checkpoint names) is refused by name."""
    names = sorted({ours for ours, _ in TARGET_MODULES.values()})
    out = {}
    for i in range(model_config.num_hidden_layers):
        for suffix in names:
            name = f"model.layers.{i}.{suffix}"
            try:
                layer = model.get_submodule(name)
            except AttributeError:
                layer = None
            if not isinstance(layer, LinearBase):
                raise ValueError(f"enable_lora: architecture {model_config.architecture!r} is not supported "
                                 f"({name} is not a linear layer of ours)")
            num_parts = 3 if isinstance(layer, QKVParallelLinear) else \
                len(layer.shard_sizes) if isinstance(layer, MergedColumnParallelLinear) else 1
            layer.lora = out[name] = slots_cls(layer, num_parts, max_loras, max_rank, dtype, device)
    return out
