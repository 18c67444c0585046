"""GGUF weights into the engine's parameters: memory-mapped, dequantized, un-permuted, sharded.

The GGUF file is read with the `gguf` package (llama.cpp's own Python reader, memory-mapped).
Each tensor is renamed to its HF name, dequantized to float32 with `gguf.quants.dequantize`
(llama.cpp's reference dequantization in numpy), has llama.cpp's Q/K row permutation undone,
and then goes the way a safetensors tensor goes: to the parameter's own `weight_loader`, which
casts it to the engine dtype and cuts this TP rank's slice. One tensor is dequantized at a
time, so the float32 copy of the whole model never exists.

`rope_freqs.weight` (Llama 3.1+ files: llama.cpp's converter writes the llama3 RoPE scaling as one
divisor per frequency, and no scaling in the metadata) is used as llama.cpp uses it: the model's
rotary table is rebuilt with inv_freq / rope_freqs.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from gguf import GGUFReader
from gguf.quants import dequantize
from torch import nn

from engine.layers.rotary import RotaryEmbedding
from engine.loader.gguf_config import check_gguf
# The safetensors loader's own name mapping, so both formats fill parameters the same way.
from engine.loader.weights import load_named_tensors

# llama.cpp tensor names -> HF names (`blk.{i}.` stands for `model.layers.{i}.`).
_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_BLOCK_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
# Architectures whose Q/K rows llama.cpp's converter permutes for its interleaved
# (GPT-J style) RoPE; Qwen2/Qwen3 use NeoX RoPE in llama.cpp and are stored as in HF.
# Per architecture: llama.cpp names whose HF module differs (phi3 keeps HF's fused tensors).
_ARCH_BLOCK_NAMES = {"phi3": {"attn_qkv": "self_attn.qkv_proj", "ffn_up": "mlp.gate_up_proj"}}
_PERMUTED_ARCHS = ("llama",)
_ROPE_FREQS = "rope_freqs.weight"
# Read into the config by the HF view (engine.loader.gguf_config), not into parameters.
_CONFIG_TENSORS = ("rope_factors_long.weight", "rope_factors_short.weight")


def hf_name(gguf_name: str, arch: str = "llama") -> str | None:
    """`blk.3.attn_q.weight` -> `model.layers.3.self_attn.q_proj.weight`; None for a name we do not know."""
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    block_names = {**_BLOCK_NAMES, **_ARCH_BLOCK_NAMES.get(arch, {})}
    parts = gguf_name.split(".")
    if len(parts) == 4 and parts[0] == "blk" and parts[1].isdigit() and parts[2] in block_names:
        return f"model.layers.{parts[1]}.{block_names[parts[2]]}.{parts[3]}"
    return None


def dequantize_tensor(tensor) -> np.ndarray:
    """A gguf ReaderTensor -> float32 array in HF layout ([out_features, in_features] for a matrix).
    GGUF lists dimensions innermost first; the reader's numpy view (and so this) is outermost first."""
    array = dequantize(tensor.data, tensor.tensor_type)
    if not array.flags.writeable:  # F32 comes back as a view of the read-only memory map
        array = array.copy()
    return array.astype(np.float32, copy=False)


def unpermute_rows(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo llama.cpp's Q/K permutation. Per head, HF keeps RoPE's rotated pairs half a head
    apart (rows [x0..x_{d/2-1}, y0..y_{d/2-1}]); llama.cpp interleaves them ([x0, y0, x1, y1, ...]):

        gguf rows of a head: (d/2, 2) -> swap to (2, d/2) -> HF rows
    """
    rows = weight.shape[0]
    head_dim = rows // num_heads
    w = weight.reshape(num_heads, head_dim // 2, 2, *weight.shape[1:])
    return np.ascontiguousarray(w.swapaxes(1, 2)).reshape(weight.shape)


def _hf_tensor(tensor, name: str, arch: str, config) -> torch.Tensor:
    array = dequantize_tensor(tensor)
    if arch in _PERMUTED_ARCHS and ".self_attn.q_proj." in name:
        array = unpermute_rows(array, config.num_attention_heads)
    elif arch in _PERMUTED_ARCHS and ".self_attn.k_proj." in name:
        array = unpermute_rows(array, config.num_key_value_heads)
    return torch.from_numpy(array)


def load_gguf_weights(model: nn.Module, path: str | Path) -> None:
    """Load every tensor of the GGUF file at `path` into `model`'s parameters (cast to their dtype).
    Raises ValueError naming an unsupported architecture or tensor type, or missing/unexpected tensors."""
    path = Path(path)
    reader = GGUFReader(path)  # memory-mapped
    arch = check_gguf(reader, path.name)
    config = model.config
    tied = config.tie_word_embeddings

    def tensors():
        for tensor in reader.tensors:
            name = hf_name(tensor.name, arch)
            if not (tied and name == "lm_head.weight") and tensor.name not in (_ROPE_FREQS, *_CONFIG_TENSORS):
                yield tensor.name, name, lambda tensor=tensor, name=name: _hf_tensor(tensor, name, arch, config)

    load_named_tensors(model, tensors(), f"GGUF {path.name}", "tensors")
    for tensor in (t for t in reader.tensors if t.name == _ROPE_FREQS):
        divisors = torch.from_numpy(dequantize_tensor(tensor))
        for rotary in {id(m): m for m in model.modules() if isinstance(m, RotaryEmbedding)}.values():
            try:
                rotary.divide_frequencies(divisors)
            except ValueError as e:
                raise ValueError(f"GGUF {path.name}: {e}") from e
