"""Paged attention layer: stores this step's K/V in the cache, then attends over the cache.

Head counts are per TP rank. The model runner assigns `k_cache` / `v_cache`
([num_blocks, block_size, num_kv_heads, head_dim], contiguous, the model's
dtype) to every `Attention` module; until then they are empty tensors. It also
sets the backend (`set_backend`, from the resolved EngineConfig), so model
constructors never carry it.

Per layer, a sliding window (Mistral, Qwen2's upper layers, Gemma's local
layers), a logit soft cap (Gemma 2) and attention sinks (gpt-oss) go to the
kernels as they are; kernels/reference.py states what each means.

With kv_cache_dtype="fp8" the caches are float8_e4m3fn and the runner also sets
`k_scale` / `v_scale` ([1] fp32, kernels/fp8_kv.py): the kernels quantize on
store and dequantize on read.
"""
from __future__ import annotations

import torch
from torch import nn

from engine.config import ATTENTION_BACKENDS
from engine.executor.parallel_state import get_tp_rank, get_tp_size
from engine.worker.forward_context import get_forward_context


def _load_backend(backend: str, fp8_kv: bool = False):
    """(store_kv, paged_attention, is_cpu_path) for a backend name.

    The "torch" backend is the CPU path: the fused C kernel for fp32, bf16 and fp16 CPU
    tensors, pure torch otherwise (kernels.cpu_attention decides per call). It takes host
    copies of the lengths and this step's K/V rows, so fresh prefills skip the cache.
    With an fp8 cache it is pure torch always: the C kernel takes no fp8 cache.
    """
    if backend == "triton":
        from kernels import paged_attention, store_kv
        return store_kv, paged_attention, False
    if backend == "torch" and fp8_kv:
        from kernels.torch_attention import paged_attention_torch, store_kv_torch
        return store_kv_torch, paged_attention_torch, True
    if backend == "torch":
        from kernels.cpu_attention import paged_attention_cpu, store_kv_cpu
        return store_kv_cpu, paged_attention_cpu, True
    raise ValueError(f"attention backend {backend!r} is not supported; choose one of {ATTENTION_BACKENDS}")


class Attention(nn.Module):
    """num_heads, num_kv_heads: this TP rank's.

    sliding_window: a query at position p attends keys p - sliding_window + 1 .. p only
    logits_soft_cap: scaled scores become cap * tanh(scores / cap)
    sinks: own a `sinks` parameter [num_heads], a learned logit per head that joins the
        softmax's denominator with no value (loaded from the checkpoint's full [total heads])
    """

    def __init__(self, num_heads: int, head_dim: int, scale: float, num_kv_heads: int,
                 sliding_window: int | None = None, logits_soft_cap: float | None = None,
                 sinks: bool = False):
        super().__init__()
        if num_heads % num_kv_heads:
            raise ValueError(f"num_heads={num_heads} is not a multiple of num_kv_heads={num_kv_heads}")
        if sliding_window is not None and sliding_window < 1:
            raise ValueError(f"sliding_window={sliding_window} is invalid: must be >= 1 or None")
        if logits_soft_cap is not None and not logits_soft_cap > 0:
            raise ValueError(f"logits_soft_cap={logits_soft_cap} is invalid: must be > 0 or None")
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.scale = scale
        self.sliding_window, self.logits_soft_cap = sliding_window, logits_soft_cap
        if sinks:
            self.sinks = nn.Parameter(torch.empty(num_heads), requires_grad=False)
            self.sinks.weight_loader = self._load_sinks
        else:
            self.register_parameter("sinks", None)
        self.backend: str | None = None  # set_backend() names it before the first forward
        # Plain attributes, not buffers: the runner owns the cache memory and the
        # model's state_dict / .to() must not copy it.
        self.k_cache = torch.empty(0)
        self.v_cache = torch.empty(0)
        # An fp8 cache's per-tensor scales, [1] fp32 on the cache's device; None for any other cache.
        self.k_scale: torch.Tensor | None = None
        self.v_scale: torch.Tensor | None = None
        # Which KV cache group's slots and block tables this layer reads (engine.core.kv_cache_groups);
        # set by the runner with the cache.
        self.kv_group = 0

    def set_backend(self, backend: str, fp8_kv: bool = False) -> None:
        """Choose the kernels, once, for a model the runner has built (fp8_kv: its cache is fp8).

        Set on the module like the KV cache, not passed to every model constructor (the
        choice is the runner's, from the resolved config) and not read from the forward
        context (that carries per-step metadata only; the backend is fixed for the model).
        """
        self._store_kv, self._paged_attention, self._cpu_path = _load_backend(backend, fp8_kv)
        self.backend = backend

    def _load_sinks(self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id=None) -> None:
        """The checkpoint's [total heads] sinks -> this rank's heads (query heads are split
        across ranks in order, as QKVParallelLinear splits them)."""
        n = param.shape[0]
        if tuple(loaded_weight.shape) != (n * get_tp_size(),):
            raise ValueError(f"checkpoint sinks have shape {tuple(loaded_weight.shape)}, expected "
                             f"({n * get_tp_size()},): one per query head")
        param.data.copy_(loaded_weight.narrow(0, get_tp_rank() * n, n))

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q [n, num_heads * head_dim], k/v [n, num_kv_heads * head_dim] (views are fine)
        -> [n, num_heads * head_dim]."""
        md = get_forward_context().attn_metadata
        if md is None:
            raise RuntimeError("Attention needs attn_metadata in the forward context")
        if self.backend is None:
            raise RuntimeError("Attention has no backend: call set_backend() before the first forward "
                               "(the model runner does, from the resolved config)")
        if self.k_cache.numel() == 0:
            raise RuntimeError("Attention has no KV cache: assign k_cache/v_cache before the first forward "
                               "(a warm-up run can use a 1-block cache and slot_mapping -1)")
        n = q.shape[0]
        q = q.view(n, self.num_heads, self.head_dim)
        k = k.view(n, self.num_kv_heads, self.head_dim)
        v = v.view(n, self.num_kv_heads, self.head_dim)
        slot_mapping, block_tables = md.kv_group(self.kv_group)
        scales = {} if self.k_scale is None else dict(k_scale=self.k_scale, v_scale=self.v_scale)
        self._store_kv(k, v, self.k_cache, self.v_cache, slot_mapping, **scales)
        extra = dict(scales)
        if self._cpu_path:
            extra.update(seq_lens_cpu=md.seq_lens_cpu, query_lens_cpu=md.query_lens_cpu, key=k, value=v)
        if self.sliding_window is not None:
            extra["sliding_window"] = self.sliding_window
        if self.logits_soft_cap is not None:
            extra["logits_soft_cap"] = self.logits_soft_cap
        if self.sinks is not None:
            extra["sinks"] = self.sinks
        o = self._paged_attention(q, self.k_cache, self.v_cache, block_tables, md.seq_lens,
                                  md.cu_seqlens_q, md.max_seqlen_q, self.scale, **extra)
        return o.view(n, self.num_heads * self.head_dim)  # [n, num_heads, head_dim] flattened

