"""GGUF weights into the engine's parameters: memory-mapped, dequantized, un-permuted, sharded.

The GGUF file's tensors are listed by engine.loader.gguf_index (memory-mapped; the metadata's
arrays, the tokenizer's, are stepped over). Each tensor is renamed to its HF name, dequantized to
float32 with `gguf.quants.dequantize` (llama.cpp's reference dequantization in numpy), has
llama.cpp's Q/K row permutation undone, and then goes the way a safetensors tensor goes: to the
parameter's own `weight_loader`, which casts it to the engine dtype and cuts this TP rank's slice.
One tensor is dequantized at a time, so the float32 copy of the whole model never exists.

Mixture-of-experts files stack each layer's experts in one tensor (`blk.N.ffn_gate_exps` [E, I, H],
`ffn_up_exps`, `ffn_down_exps` [E, H, I]); each expert's rows are dequantized on their own
(`tensor.data[e]` is its quantized blocks) and handed on as the checkpoint's per-expert tensor,
named as the model's `expert_params_mapping` names it (Mixtral's w1/w3/w2, Qwen's gate/up/down).

`rope_freqs.weight` (Llama 3.1+ files: llama.cpp's converter writes the llama3 RoPE scaling as one
divisor per frequency, and no scaling in the metadata) is used as llama.cpp uses it: the model's
rotary table is rebuilt with inv_freq / rope_freqs.

Linear layers built with the "gguf" method (engine.layers.quantization.gguf, the default for a
GGUF) get their tensors of the packed types (`PACKED_TYPES`: Q8_0, Q4_0, Q4_1, Q5_0, Q5_1,
Q4_K, Q5_K, Q6_K) as stored instead (`GGUFBlocks`: the raw rows, Q/K rows un-permuted as whole
rows), and keep them quantized; their other types, the embeddings, the LM head, norms and
experts are dequantized as above.
"""
from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import torch
from gguf.quants import dequantize
from torch import nn

from engine.layers.linear import LinearBase
from engine.layers.quantization import checkpoint_prefixes
from engine.layers.quantization.gguf import PACKED_TYPES, GGUFBlocks, GGUFLinearMethod
from engine.layers.rotary import RotaryEmbedding
from engine.loader.gguf_config import check_gguf
from engine.loader.gguf_index import GGUFIndex
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
    "ffn_gate_inp": "mlp.gate",  # the MoE router
    "ffn_gate_shexp": "mlp.shared_expert.gate_proj",  # Qwen2-MoE's shared expert and its gate
    "ffn_up_shexp": "mlp.shared_expert.up_proj",
    "ffn_down_shexp": "mlp.shared_expert.down_proj",
    "ffn_gate_inp_shexp": "mlp.shared_expert_gate",
}
# Stacked experts: `blk.N.ffn_{gate,up,down}_exps.weight` -> the FusedMoE parameter and part that
# a model's expert_params_mapping maps its per-expert checkpoint projection to.
_EXPERT_TENSOR = re.compile(r"blk\.(?P<layer>\d+)\.ffn_(?P<part>gate|up|down)_exps\.weight")
_EXPERT_PARTS = {"gate": ("gate_up_proj", 0), "up": ("gate_up_proj", 1), "down": ("down_proj", None)}
# Per architecture: llama.cpp names whose HF module differs (phi3 keeps HF's fused tensors).
# Gemma: four norms a layer, llama.cpp's ffn_norm being the pre-MLP one.
_GEMMA_NORMS = {"post_attention_norm": "post_attention_layernorm", "ffn_norm": "pre_feedforward_layernorm",
                "post_ffw_norm": "post_feedforward_layernorm"}
_ARCH_BLOCK_NAMES = {"phi3": {"attn_qkv": "self_attn.qkv_proj", "ffn_up": "mlp.gate_up_proj"},
                     "gemma2": _GEMMA_NORMS, "gemma3": _GEMMA_NORMS}
# llama.cpp's RMSNorm multiplies by w, so its converter stores Gemma's (1 + w) norms with the 1
# added; our GemmaRMSNorm keeps HF's w and adds the 1 itself.
_NORM_PLUS_ONE_ARCHS = ("gemma2", "gemma3")
# Architectures whose Q/K rows llama.cpp's converter permutes for its interleaved
# (GPT-J style) RoPE; Qwen2/Qwen3 and Gemma use NeoX RoPE in llama.cpp and are stored as in HF.
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


def dequantize_tensor(tensor, index: int | None = None) -> np.ndarray:
    """A gguf ReaderTensor (or its `index`-th slice along the outermost dim, e.g. one expert)
    -> float32 array in HF layout ([out_features, in_features] for a matrix). GGUF lists
    dimensions innermost first; the reader's numpy view (and so this) is outermost first."""
    array = dequantize(tensor.data if index is None else tensor.data[index], tensor.tensor_type)
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


def _unpermuted(array: np.ndarray, name: str, arch: str, config) -> np.ndarray:
    """llama.cpp's Q/K row permutation undone; it moves whole rows, so it applies to float
    rows and to rows of quantized blocks alike."""
    if arch in _PERMUTED_ARCHS and ".self_attn.q_proj." in name:
        return unpermute_rows(array, config.num_attention_heads)
    if arch in _PERMUTED_ARCHS and ".self_attn.k_proj." in name:
        return unpermute_rows(array, config.num_key_value_heads)
    return array


def _hf_blocks(tensor, name: str, arch: str, config) -> GGUFBlocks:
    """A quantized 2-D tensor as stored: uint8 [out, row_bytes] rows in HF order (not dequantized)."""
    rows = np.array(_unpermuted(tensor.data, name, arch, config))  # a copy, off the memory map
    return GGUFBlocks(torch.from_numpy(rows), int(tensor.tensor_type))


def _packed_names(model: nn.Module) -> set[str]:
    """HF names of the weights that GGUF-method layers take as blocks: each part's checkpoint
    name (q_proj, ...) and the layer's own (a fused tensor, as phi3's attn_qkv)."""
    names = set()
    for prefix, module in model.named_modules():
        if isinstance(module, LinearBase) and isinstance(module.quant_method, GGUFLinearMethod):
            names.update(f"{p}.weight" for p in [*checkpoint_prefixes(model, prefix), prefix])
    return names


def _hf_tensor(tensor, name: str, arch: str, config) -> torch.Tensor:
    array = _unpermuted(dequantize_tensor(tensor), name, arch, config)
    if arch in _NORM_PLUS_ONE_ARCHS and name.endswith("norm.weight"):
        array -= np.float32(1)
    elif name.endswith(".shared_expert_gate.weight") and array.ndim == 1:  # [H] as some files hold it: HF's [1, H]
        array = array[None]
    return torch.from_numpy(array)


def _checkpoint_name(model: nn.Module, name: str | None) -> str | None:
    """`name` with our module names spelled as the model's checkpoints spell them, where the
    model only renames a module (Mixtral's `mlp` is `block_sparse_moe` in its checkpoints)."""
    for ckpt_module, (our_module, shard_id) in getattr(model, "packed_modules_mapping", {}).items():
        if name and shard_id is None and f".{our_module}." in name:
            name = name.replace(f".{our_module}.", f".{ckpt_module}.")
    return name


def _expert_tensors(model: nn.Module, tensor, match: re.Match):
    """(file name, HF name, thunk) for each expert of a stacked `ffn_*_exps` tensor: expert e's
    slice under the per-expert checkpoint name the model maps (`...experts.{e}.w1.weight`)."""
    projs = {target: proj for proj, target in getattr(model, "expert_params_mapping", {}).items()}
    proj = projs.get(_EXPERT_PARTS[match["part"]])
    if proj is None:  # not a MoE model: reported as unexpected
        yield tensor.name, None, None
        return
    for e in range(tensor.data.shape[0]):
        yield (tensor.name, _checkpoint_name(model, f"model.layers.{match['layer']}.mlp.experts.{e}.{proj}.weight"),
               lambda e=e: torch.from_numpy(dequantize_tensor(tensor, e)))


def load_gguf_weights(model: nn.Module, path: str | Path) -> None:
    """Load every tensor of the GGUF file at `path` into `model`'s parameters (cast to their dtype).
    Raises ValueError naming an unsupported architecture or tensor type, or missing/unexpected tensors."""
    path = Path(path)
    reader = GGUFIndex(path)  # memory-mapped
    arch = check_gguf(reader, path.name)
    config = model.config
    tied = config.tie_word_embeddings
    packed = _packed_names(model)

    def tensors():
        for tensor in reader.tensors:
            if match := _EXPERT_TENSOR.fullmatch(tensor.name):
                yield from _expert_tensors(model, tensor, match)
                continue
            name = _checkpoint_name(model, hf_name(tensor.name, arch))
            if name in packed and tensor.tensor_type in PACKED_TYPES and len(tensor.data.shape) == 2:
                yield tensor.name, name, lambda tensor=tensor, name=name: _hf_blocks(tensor, name, arch, config)
            elif not (tied and name == "lm_head.weight") and tensor.name not in (_ROPE_FREQS, *_CONFIG_TENSORS):
                yield tensor.name, name, lambda tensor=tensor, name=name: _hf_tensor(tensor, name, arch, config)

    load_named_tensors(model, tensors(), f"GGUF {path.name}", "tensors")
    for tensor in (t for t in reader.tensors if t.name == _ROPE_FREQS):
        divisors = torch.from_numpy(dequantize_tensor(tensor))
        for rotary in {id(m): m for m in model.modules() if isinstance(m, RotaryEmbedding)}.values():
            try:
                rotary.divide_frequencies(divisors)
            except ValueError as e:
                raise ValueError(f"GGUF {path.name}: {e}") from e
