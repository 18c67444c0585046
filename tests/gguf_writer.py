"""Write a GGUF file from an HF checkpoint directory, the way llama.cpp's convert_hf_to_gguf.py
does for the families we run, so the tests make GGUFs without llama.cpp.

Deliberately independent of engine.loader.gguf_loader: tensor names come from the gguf package's
own HF -> GGUF name map, and the Q/K permutation is llama.cpp's converter formula, so a
loader bug cannot cancel out against a writer bug.
"""
from __future__ import annotations

import json
import math
import re
from pathlib import Path

import gguf
import numpy as np
from gguf import GGMLQuantizationType
from safetensors.numpy import load_file, save_file

_ARCHS = {"LlamaForCausalLM": "llama", "Qwen2ForCausalLM": "qwen2", "Qwen3ForCausalLM": "qwen3",
          "Phi3ForCausalLM": "phi3", "MixtralForCausalLM": "llama", "Qwen2MoeForCausalLM": "qwen2moe",
          "Qwen3MoeForCausalLM": "qwen3moe", "Gemma2ForCausalLM": "gemma2", "Gemma3ForCausalLM": "gemma3"}
# One expert's projection in an HF checkpoint: `...experts.3.w1.weight`.
_EXPERT = re.compile(r"(?P<prefix>.*\.experts)\.(?P<expert>\d+)\.(?P<proj>\w+)\.weight")
# convert_hf_to_gguf.py keeps these in F32 whatever the file's type (the routers).
_F32_TENSORS = (".ffn_gate_inp.weight", ".ffn_gate_inp_shexp.weight")
_GEMMA_ARCHS = ("gemma2", "gemma3")


def llama_cpp_permute(weights: np.ndarray, n_head: int) -> np.ndarray:
    """convert_hf_to_gguf.py's LlamaModel.permute: HF's half-split RoPE rows -> interleaved."""
    return (weights.reshape(n_head, 2, weights.shape[0] // n_head // 2, *weights.shape[1:])
            .swapaxes(1, 2).reshape(weights.shape))


def quantize_roundtrip(array: np.ndarray, qtype: GGMLQuantizationType) -> tuple[np.ndarray, np.ndarray]:
    """(bytes as GGUF stores them, their dequantized float32 values)."""
    data = gguf.quants.quantize(array, qtype)
    return data, gguf.quants.dequantize(data, qtype).astype(np.float32)


def write_gguf(hf_dir: str | Path, out: str | Path, qtype=GGMLQuantizationType.F32,
               extra: dict[str, np.ndarray] | None = None) -> dict[str, np.ndarray]:
    """Write `out` from the checkpoint in `hf_dir`, matrices in `qtype` (norms stay F32, as llama.cpp
    keeps them), plus `extra` F32 tensors under GGUF names. Returns the weights the file holds,
    dequantized, under HF names and in HF layout."""
    hf_dir = Path(hf_dir)
    config = json.loads((hf_dir / "config.json").read_text())
    arch = _ARCHS[config["architectures"][0]]
    writer = gguf.GGUFWriter(str(out), arch)
    _add_hparams(writer, config)
    _add_tokenizer(writer, hf_dir, config)
    name_map = gguf.get_tensor_name_map(gguf.MODEL_ARCH[arch.upper()], config["num_hidden_layers"])
    stored = {}
    for name, array in sorted(_stack_experts(load_file(hf_dir / "model.safetensors")).items()):
        if name == "lm_head.weight" and config.get("tie_word_embeddings"):
            continue
        gguf_name = name_map.get_name(name, try_suffixes=(".weight", ".bias"))
        if gguf_name is None:  # e.g. a dense MLP in a qwen2moe (llama.cpp has no tensor for it)
            raise ValueError(f"llama.cpp's {arch} has no tensor for {name}")
        if arch in _GEMMA_ARCHS and name.endswith("norm.weight"):
            # Gemma2Model / Gemma3Model: llama.cpp's RMSNorm multiplies by w, so 1 is added here;
            # the weights the file holds are then (w + 1) - 1, computed in float32.
            data = array + np.float32(1)
            data, stored[name] = data, data - np.float32(1)
        else:
            data, stored[name] = ((array, array) if array.ndim == 1 or qtype == GGMLQuantizationType.F32
                                  or gguf_name.endswith(_F32_TENSORS) else quantize_roundtrip(array, qtype))
        if arch == "llama" and ".q_proj." in name:
            data = llama_cpp_permute(data, config["num_attention_heads"])
        elif arch == "llama" and ".k_proj." in name:
            data = llama_cpp_permute(data, config["num_key_value_heads"])
        writer.add_tensor(gguf_name, data, raw_dtype=None if data.dtype == np.float32 else qtype)
    rope_freqs = llama3_rope_freqs(config)
    if rope_freqs is not None:
        writer.add_tensor("rope_freqs.weight", rope_freqs)
    if arch == "phi3":
        _add_phi3_rope(writer, config)
    elif arch in _GEMMA_ARCHS:
        _add_gemma(writer, arch, config)
    for gguf_name, array in (extra or {}).items():
        writer.add_tensor(gguf_name, array)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return _unstack_experts(stored)


def _stack_experts(weights: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """convert_hf_to_gguf.py's MoE merge: each layer's `experts.{e}.{proj}.weight` stacked
    into one `experts.{proj}.weight` of [E, ...] (which the name map knows as ffn_*_exps)."""
    out, experts = {}, {}
    for name, array in weights.items():
        if m := _EXPERT.fullmatch(name):
            experts.setdefault(f"{m['prefix']}.{m['proj']}.weight", {})[int(m["expert"])] = array
        else:
            out[name] = array
    for name, by_index in experts.items():
        out[name] = np.stack([by_index[e] for e in range(len(by_index))])
    return out


def _unstack_experts(weights: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The inverse of _stack_experts, for the HF reference (HF checkpoints name experts one by one)."""
    out = {}
    for name, array in weights.items():
        prefix, _, proj = name.rpartition(".experts.")
        if prefix and array.ndim == 3:
            out.update({f"{prefix}.experts.{e}.{proj}": array[e] for e in range(array.shape[0])})
        else:
            out[name] = array
    return out


def llama3_rope_freqs(config: dict) -> np.ndarray | None:
    """convert_hf_to_gguf.py's LlamaModel on a llama3-scaled RoPE: one divisor per frequency
    (1 for short wavelengths, `factor` for long ones, the smooth blend's inverse between), written
    as the rope_freqs tensor; the metadata then names no scaling. None for other RoPEs."""
    rope = config.get("rope_scaling") or config.get("rope_parameters") or {}
    if (rope.get("rope_type") or rope.get("type")) != "llama3":
        return None
    dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    base = rope.get("rope_theta") or config["rope_theta"]
    factor, low, high = rope["factor"], rope["low_freq_factor"], rope["high_freq_factor"]
    old_len = rope["original_max_position_embeddings"]
    divisors = []
    for freq in 1.0 / (base ** (np.arange(0, dim, 2, dtype=np.float32) / dim)):
        wavelen = 2 * math.pi / freq
        if wavelen < old_len / high:
            divisors.append(1.0)
        elif wavelen > old_len / low:
            divisors.append(factor)
        else:
            smooth = (old_len / wavelen - low) / (high - low)
            divisors.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(divisors, dtype=np.float32)


def _add_phi3_rope(writer: gguf.GGUFWriter, config: dict) -> None:
    """convert_hf_to_gguf.py's Phi3MiniModel: the original context, the sliding window (0: none),
    and for LongRoPE its attention factor and the two factor lists as tensors."""
    max_pos, old_len = config["max_position_embeddings"], config["original_max_position_embeddings"]
    writer.add_rope_scaling_orig_ctx_len(old_len)
    writer.add_sliding_window(config.get("sliding_window") or 0)
    rope = config.get("rope_scaling") or config.get("rope_parameters") or {}
    if (rope.get("rope_type") or rope.get("type")) in ("longrope", "su"):
        scale = max_pos / old_len
        writer.add_rope_scaling_attn_factors(math.sqrt(1 + math.log(scale) / math.log(old_len)) if scale > 1 else 1.0)
        writer.add_tensor("rope_factors_long.weight", np.array(rope["long_factor"], dtype=np.float32))
        writer.add_tensor("rope_factors_short.weight", np.array(rope["short_factor"], dtype=np.float32))


def _add_gemma(writer: gguf.GGUFWriter, arch: str, config: dict) -> None:
    """Gemma2Model / Gemma3Model's metadata: the soft caps (Gemma 3: the final one only, when set)
    and the window; Gemma 3's global RoPE scaling. What llama.cpp hard-codes instead of reading
    (the attention scale, which layers slide, Gemma 3's local RoPE base) is checked here, since a
    checkpoint that differs would silently run as another model."""
    layers, heads, head_dim = config["num_hidden_layers"], config["num_attention_heads"], config["head_dim"]
    scale = config["hidden_size"] // heads if layers == {"gemma2": 46, "gemma3": 62}[arch] else head_dim
    if config.get("query_pre_attn_scalar", 256) != scale:
        raise ValueError(f"llama.cpp's {arch} scales attention by {scale} ** -0.5, not query_pre_attn_scalar "
                         f"{config.get('query_pre_attn_scalar')}")
    pattern = 2 if arch == "gemma2" else 6
    expected = ["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(layers)]
    if config.get("layer_types", expected) != expected:
        raise ValueError(f"llama.cpp's {arch} slides all but every {pattern}th layer, not {config['layer_types']}")
    writer.add_sliding_window(config["sliding_window"])
    if arch == "gemma2":
        writer.add_attn_logit_softcapping(config["attn_logit_softcapping"])
        writer.add_final_logit_softcapping(config["final_logit_softcapping"])
        return
    if config.get("final_logit_softcapping"):
        writer.add_final_logit_softcapping(config["final_logit_softcapping"])
    rope = config["rope_parameters"]
    if rope["sliding_attention"]["rope_theta"] != 10000.0:
        raise ValueError("llama.cpp's gemma3 rotates local layers with a base of 10000, not "
                         f"{rope['sliding_attention']['rope_theta']}")
    if rope["full_attention"].get("rope_type") == "linear":
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(rope["full_attention"]["factor"])


def save_as_hf(hf_dir: str | Path, weights: dict[str, np.ndarray], out: str | Path) -> Path:
    """A copy of the checkpoint in `hf_dir` with `weights` in place of its own (the HF reference
    for a quantized GGUF: HF run on the weights the GGUF really holds)."""
    hf_dir, out = Path(hf_dir), Path(out)
    out.mkdir(parents=True, exist_ok=True)
    for f in hf_dir.iterdir():
        if f.name != "model.safetensors":
            (out / f.name).write_bytes(f.read_bytes())
    save_file({k: np.ascontiguousarray(v) for k, v in weights.items()}, out / "model.safetensors",
              metadata={"format": "pt"})
    return out


def _add_hparams(writer: gguf.GGUFWriter, config: dict) -> None:
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(config["num_attention_heads"])
    writer.add_head_count_kv(config["num_key_value_heads"])
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    # Phi3MiniModel counts the rotated features from the hidden size: int(factor * hidden) // heads
    writer.add_rope_dimension_count(int(config["partial_rotary_factor"] * config["hidden_size"])
                                    // config["num_attention_heads"] if "partial_rotary_factor" in config else head_dim)
    if config["architectures"][0] != "Gemma2ForCausalLM":  # Gemma2Model writes none (10000 then)
        writer.add_rope_freq_base(config["rope_theta"])
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    writer.add_vocab_size(config["vocab_size"])
    # TextModel.set_gguf_parameters and Qwen2MoeModel's: the experts and their widths
    if num_experts := config.get("num_local_experts") or config.get("num_experts"):
        writer.add_expert_count(num_experts)
        writer.add_expert_used_count(config["num_experts_per_tok"])
    if "moe_intermediate_size" in config:
        writer.add_expert_feed_forward_length(config["moe_intermediate_size"])
    if "shared_expert_intermediate_size" in config:
        writer.add_expert_shared_feed_forward_length(config["shared_expert_intermediate_size"])


def _add_tokenizer(writer: gguf.GGUFWriter, hf_dir: Path, config: dict) -> None:
    """A byte-level BPE vocabulary ("gpt2" in llama.cpp's terms), padded to the model's vocab
    size with unused [PAD{i}] entries as llama.cpp's converter pads it."""
    tok = json.loads((hf_dir / "tokenizer.json").read_text())
    tok_config = json.loads((hf_dir / "tokenizer_config.json").read_text())
    id_to_token = {i: t for t, i in tok["model"]["vocab"].items()}
    specials = {t["id"] for t in tok["added_tokens"] if t["special"]}
    tokens, types = [], []
    for i in range(config["vocab_size"]):
        tokens.append(id_to_token.get(i, f"[PAD{i}]"))
        types.append(gguf.TokenType.UNUSED if i not in id_to_token
                     else gguf.TokenType.CONTROL if i in specials else gguf.TokenType.NORMAL)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in tok["model"]["merges"]])
    for role, add in (("bos", writer.add_bos_token_id), ("eos", writer.add_eos_token_id),
                      ("unk", writer.add_unk_token_id), ("pad", writer.add_pad_token_id)):
        if tok_config.get(f"{role}_token"):
            add(tok["model"]["vocab"][tok_config[f"{role}_token"]])
    writer.add_add_bos_token(bool(tok_config.get("bos_token")))
    writer.add_chat_template(tok_config["chat_template"])
