"""CPU: a Llama-family decoder layer with INT8 W8A8 linears as one C call (kernels/cpu_decoder_layer.c).

The layer's modules call a C op each (norm, int8 matmul, rotary, store_kv, paged attention, SiLU),
with Python between them; at decode that Python cost as much as the int8 matmuls. The fused call runs
the same ops in the same order on the same bytes, so it is bit-identical to the modules; it is a
fast path in front of them, as CUDA graphs are on GPUs:

- `bind_fused_decoder_layers` (the model runner, once the KV cache exists) gives each layer it can
  take a `FusedDecoderLayer`: Llama's attention without q/k norms or biases, its SiLU MLP, plain
  RMSNorms, all four linears W8A8 on the VNNI kernel, one tensor-parallel rank, no LoRA, fp32 or
  bf16 activations with a cache of the same dtype, no soft cap or sinks. Other layers keep their
  modules (Qwen3's q/k norms, Qwen2's biases, mixture-of-experts blocks, Gemma's norms, ...).
- per step, a layer runs fused when the C attention kernels take every chunk: always where the
  AMX chunk kernel takes the long ones (bf16 on AMX-BF16, kernels/cpu_chunk_attention.c), else
  when no chunk is longer than `kernel_max_q_len` rows (longer ones need SDPA: the modules run).
"""
from __future__ import annotations

import logging
import sys

import torch

from engine.layers.activation import SiluAndMul
from engine.layers.layernorm import RMSNorm
from engine.layers.quantization.int8 import Int8W8A8LinearMethod, w8a8_linear_vnni
from engine.worker.forward_context import get_forward_context
from kernels import cpu_decoder_layer
from kernels.cpu_attention import chunk_kernel_applies, kernel_max_q_len
from kernels.cpu_dtypes import DT_CODES
from kernels.torch_attention import ScoreOptions

logger = logging.getLogger(__name__)
DTYPES = (torch.float32, torch.bfloat16)  # what the int8 kernel takes as activations


def bind_fused_decoder_layers(model: torch.nn.Module, dtype: torch.dtype) -> int:
    """Give every decoder layer of `model` that can run fused its FusedDecoderLayer; returns how many."""
    from engine.models.llama import LlamaDecoderLayer  # the models import the layers, not the reverse

    layers = [m for m in model.modules() if isinstance(m, LlamaDecoderLayer)]
    if not layers:
        return 0
    available = cpu_decoder_layer.available()
    bound = 0
    for i, layer in enumerate(layers):
        why = "the C kernel is not built here (no compiler, disabled, or no AVX-512 VNNI)" if not available \
            else why_not_fused(layer, dtype)
        if why is None:
            layer.fused = FusedDecoderLayer(layer, dtype)
            bound += 1
        elif i == 0:
            logger.debug("decoder layers run as modules: %s", why)
    if bound:
        logger.info("CPU: %d of %d decoder layers run as one C call each", bound, len(layers))
    return bound


def why_not_fused(layer, dtype: torch.dtype) -> str | None:
    """Why `layer` (a LlamaDecoderLayer) cannot run fused, or None when it can."""
    from engine.models.llama import LlamaAttention, LlamaMLP

    attn, mlp = layer.self_attn, layer.mlp
    if dtype not in DTYPES:
        return f"activations are {dtype}, the int8 kernel takes {DTYPES}"
    if type(attn) is not LlamaAttention or attn.qk_norm:
        return f"attention is {type(attn).__name__}{' with q/k norms' if type(attn) is LlamaAttention else ''}"
    if type(mlp) is not LlamaMLP or type(mlp.act_fn) is not SiluAndMul:
        return f"the feed-forward block is {type(mlp).__name__} ({type(getattr(mlp, 'act_fn', None)).__name__})"
    for norm in (layer.input_layernorm, layer.post_attention_layernorm):
        if type(norm) is not RMSNorm or norm.weight.dtype != dtype:
            return f"a norm is {type(norm).__name__} with {norm.weight.dtype} weights"
    if layer.input_layernorm.eps != layer.post_attention_layernorm.eps:
        return "the two norms have different eps"
    for name, linear in linears(layer).items():
        method = linear.quant_method
        if not isinstance(method, Int8W8A8LinearMethod) or getattr(method, "matmul", None) is not w8a8_linear_vnni:
            return f"{name} is {type(method).__name__}, not INT8 W8A8 on the VNNI kernel"
        if linear.bias is not None or linear.lora is not None or linear.tp_size != 1:
            return f"{name} has a bias, LoRA slots or tensor-parallel shards"
    rot, core = attn.rotary_emb, attn.attn
    if rot.rotary_dim != attn.head_dim or rot.cos_sin_cache.dtype != torch.float32:
        return f"rotary covers {rot.rotary_dim} of {attn.head_dim} features"
    if core.backend != "torch" or core.k_cache.dtype != dtype or core.k_scale is not None:
        return f"attention backend {core.backend!r} with a {core.k_cache.dtype} cache"
    if core.logits_soft_cap is not None or core.sinks is not None:
        return "attention has a soft cap or sinks"
    return None


def linears(layer) -> dict:
    attn, mlp = layer.self_attn, layer.mlp
    return {"qkv_proj": attn.qkv_proj, "o_proj": attn.o_proj, "gate_up_proj": mlp.gate_up_proj,
            "down_proj": mlp.down_proj}


def _int8_linear(linear) -> cpu_decoder_layer.Int8Linear:
    w = linear.vnni
    static = linear.quant_method.static_input_scale
    return cpu_decoder_layer.Int8Linear(w.packed.data_ptr(), w.comp.data_ptr(), w.scale.data_ptr(),
                                        linear.input_scale.data_ptr() if static else None,
                                        w.in_features, w.shape[0])


def _step_tensors_fit(n: int, positions, slot_mapping, block_tables, md) -> bool:
    """The step's index tensors in the dtypes, layouts and lengths the kernel reads (the runner
    builds them so; the module path converts anything else)."""
    num_seqs = block_tables.shape[0]
    return (positions.dtype == torch.int64 and positions.is_contiguous() and positions.shape[0] == n
            and slot_mapping.dtype == torch.int64 and slot_mapping.is_contiguous() and slot_mapping.shape[0] == n
            and block_tables.dtype == torch.int32 and block_tables.stride(-1) == 1
            and md.seq_lens.dtype == torch.int32 and md.seq_lens.is_contiguous()
            and md.seq_lens.shape[0] == num_seqs
            and md.cu_seqlens_q.dtype == torch.int32 and md.cu_seqlens_q.is_contiguous()
            and md.cu_seqlens_q.shape[0] == num_seqs + 1)


class FusedDecoderLayer:
    """Runs one LlamaDecoderLayer (checked by why_not_fused) as kernels/cpu_decoder_layer.c."""

    def __init__(self, layer, dtype: torch.dtype):
        attn, mlp = layer.self_attn, layer.mlp
        self.attn = attn.attn
        opts = ScoreOptions(sliding_window=self.attn.sliding_window)
        # Chunks up to row_max_q_len rows run in the row kernel, longer ones in the AMX chunk kernel
        # where it takes them (then every step runs fused), else the step runs the modules (SDPA).
        self.row_max_q_len = kernel_max_q_len(dtype, attn.head_dim, opts)
        self.chunk_attention = chunk_kernel_applies(dtype, attn.head_dim, opts)
        self.dtype, self.max_q_len = dtype, sys.maxsize if self.chunk_attention else self.row_max_q_len
        self.hidden = layer.input_layernorm.weight.shape[0]
        # The tensors whose addresses the arguments hold, kept alive with them.
        self._keep = (layer.input_layernorm.weight, layer.post_attention_layernorm.weight,
                      attn.rotary_emb.cos_sin_cache, *(lin.vnni for lin in linears(layer).values()))
        a = self.args = cpu_decoder_layer.LayerArgs()
        a.qkv, a.o_proj = _int8_linear(attn.qkv_proj), _int8_linear(attn.o_proj)
        a.gate_up, a.down = _int8_linear(mlp.gate_up_proj), _int8_linear(mlp.down_proj)
        a.input_norm = layer.input_layernorm.weight.data_ptr()
        a.post_norm = layer.post_attention_layernorm.weight.data_ptr()
        a.cos_sin = attn.rotary_emb.cos_sin_cache.data_ptr()
        a.hidden, a.num_heads, a.num_kv_heads, a.head_dim = self.hidden, attn.num_heads, attn.num_kv_heads, attn.head_dim
        a.intermediate = a.down.K
        a.eps, a.scale = layer.input_layernorm.eps, self.attn.scale
        a.sliding_window, a.dtype = self.attn.sliding_window or 0, DT_CODES[dtype]
        a.max_q_len, a.chunk_attention = self.row_max_q_len, int(self.chunk_attention)
        qkv_cols = (a.num_heads + 2 * a.num_kv_heads) * a.head_dim
        shapes = {"qkv_proj": ((a.qkv.N, a.qkv.K), (qkv_cols, self.hidden)),
                  "o_proj": ((a.o_proj.N, a.o_proj.K), (self.hidden, a.num_heads * a.head_dim)),
                  "gate_up_proj": ((a.gate_up.N, a.gate_up.K), (2 * a.intermediate, self.hidden)),
                  "down_proj": ((a.down.N, a.down.K), (self.hidden, a.intermediate))}
        for name, (got, want) in shapes.items():
            if got != want:
                raise ValueError(f"{name} is {got[0]} x {got[1]}; the layer's shape needs {want[0]} x {want[1]}")

    def __call__(self, positions: torch.Tensor, hidden_states: torch.Tensor,
                 residual: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(output, residual) as LlamaDecoderLayer.forward returns them, or None: the step is one
        the modules must run (a chunk longer than the attention kernel takes, or inputs in
        another layout)."""
        md = get_forward_context().attn_metadata
        if md is None or md.max_seqlen_q > self.max_q_len:
            return None
        x = hidden_states
        if (x.dtype != self.dtype or x.dim() != 2 or x.shape[1] != self.hidden or not x.is_contiguous()
                or (residual is not None and (not residual.is_contiguous() or residual.shape != x.shape))):
            return None
        step = _step_fields(md, self.attn.kv_group, positions, x.shape[0])
        if step is None:
            return None
        residual = x if residual is None else residual
        out = torch.empty_like(x)
        k_cache = self.attn.k_cache
        a = self.args
        a.k_cache, a.v_cache = k_cache.data_ptr(), self.attn.v_cache.data_ptr()
        a.num_blocks, a.block_size = k_cache.shape[0], k_cache.shape[1]
        a.x, a.residual, a.out = x.data_ptr(), residual.data_ptr(), out.data_ptr()
        (a.n, a.positions, a.slot_mapping, a.block_tables, a.seq_lens, a.cu_seqlens_q, a.num_seqs, a.bt_stride,
         a.max_blocks) = step
        cpu_decoder_layer.run_decoder_layer(a)
        return out, residual


# The last step's fields, shared by its layers (one forward context, one kv group): the checks and
# the pointer reads run once a step, not once a layer. One tuple, read and replaced whole, so two
# engines stepping in two threads never mix their steps.
_last_step: tuple | None = None  # (md, kv_group, positions, n, fields)


def _step_fields(md, kv_group: int, positions: torch.Tensor, n: int) -> tuple | None:
    """(n, positions, slot_mapping, block_tables, seq_lens, cu_seqlens_q, num_seqs, bt_stride,
    max_blocks) for LayerArgs, or None where the step's index tensors do not fit the kernel."""
    global _last_step
    last = _last_step
    if last is not None and last[0] is md and last[1] == kv_group and last[2] is positions and last[3] == n:
        return last[4]
    slot_mapping, block_tables = md.kv_group(kv_group)
    fields = None
    if _step_tensors_fit(n, positions, slot_mapping, block_tables, md):
        fields = (n, positions.data_ptr(), slot_mapping.data_ptr(), block_tables.data_ptr(), md.seq_lens.data_ptr(),
                  md.cu_seqlens_q.data_ptr(), block_tables.shape[0], block_tables.stride(0), block_tables.shape[1])
    _last_step = (md, kv_group, positions, n, fields)
    return fields
