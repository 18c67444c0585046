"""GGUF checkpoints (llama.cpp's one-file format) seen as a Hugging Face directory.

`LLM(model="x.gguf")` and the Serve app's `model:` accept a .gguf file, or a directory
holding exactly one, as vLLM does. Every consumer of a model path (the engine's config
and tokenizer, the Ingress's tokenizer, the app's `check_model`) reads HF-format files,
so rather than teach each of them GGUF, `resolve_model_path` hands them a small HF *view*
of the file, built once from its metadata:

    <cache>/<stem>-<key>/config.json               from the GGUF metadata (transformers)
                         tokenizer.json, ...       from the GGUF metadata (transformers)
                         model.gguf -> the file    the weights stay in the GGUF: the engine
                                                   reads them from there (engine.loader.gguf_loader)

Why a cached view and not the metadata read in place by each consumer: transformers needs
seconds to turn a GGUF vocabulary into a tokenizer, and every engine replica, TP worker
and Ingress would pay it at each start. The view is a few MB, costs that once per file
(the key covers the file's path, size and mtime, so a replaced file gets a fresh view),
and copies no weights. `RAYLLM_GGUF_CACHE` moves it (default ~/.cache/rayllm/gguf).

Torch-free at import: the HTTP tier resolves model paths through this module.
"""
from __future__ import annotations

import hashlib
import os
import shutil
import tempfile
from pathlib import Path

GGUF_LINK = "model.gguf"
# GGUF `general.architecture` -> the HF architecture our engine runs it as.
# (llama.cpp writes Mistral checkpoints as "llama" too, and Mixtral as "llama" with experts.)
GGUF_ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
                      "phi3": "Phi3ForCausalLM", "qwen2moe": "Qwen2MoeForCausalLM", "qwen3moe": "Qwen3MoeForCausalLM",
                      "gemma2": "Gemma2ForCausalLM", "gemma3": "Gemma3ForCausalLM"}
# Whether llama.cpp renormalizes the top-k routing weights when the file does not say
# (`{arch}.expert_weights_norm`): its qwen2moe graph does not, qwen3moe's and Mixtral's do.
_MOE_NORM_TOPK = {"qwen2moe": False, "qwen3moe": True}
# What llama.cpp hard-codes for Gemma rather than reading it from the file: every Nth layer is a
# global one (the rest slide), and the layer count (the 27B models) at which the attention scale
# is hidden_size / heads instead of head_dim (its f_attention_scale).
_GEMMA_SLIDING_PATTERN = {"gemma2": 2, "gemma3": 6}
_GEMMA_27B_LAYERS = {"gemma2": 46, "gemma3": 62}
_GEMMA3_LOCAL_ROPE_BASE = 10000.0  # llama.cpp's rope_freq_base_train_swa for gemma3
# Tensor types we dequantize (with gguf.quants.dequantize, llama.cpp's reference in numpy).
SUPPORTED_TENSOR_TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1",
                          "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K")


def find_gguf(path: Path) -> Path | None:
    """The GGUF file `path` names: a .gguf file, or the only .gguf in a directory without config.json."""
    if path.is_file():
        return path if path.suffix == ".gguf" else None
    if not path.is_dir() or (path / "config.json").is_file():
        return None
    files = sorted(path.glob("*.gguf"))
    if len(files) > 1:
        raise ValueError(f"{path} holds several GGUF files ({', '.join(f.name for f in files)}); "
                         "pass the one to load as the model path")
    return files[0] if files else None


def gguf_source(model_dir: Path) -> Path | None:
    """The GGUF file behind an HF view made by `hf_view`, or None for an ordinary checkpoint."""
    link = Path(model_dir) / GGUF_LINK
    return link.resolve() if link.exists() else None


def check_gguf(reader, name: str) -> str:
    """Refuse what the engine cannot run, naming it; returns the GGUF architecture.
    `reader` is a gguf.GGUFReader or a gguf_index.GGUFIndex (typed loosely: this module must not
    import gguf at import)."""
    field = reader.fields.get("general.architecture")
    arch = field.contents() if field is not None else "<missing>"
    if arch not in GGUF_ARCHITECTURES:
        raise ValueError(f"{name}: GGUF architecture {arch!r} is not supported "
                         f"(supported: {', '.join(GGUF_ARCHITECTURES)})")
    types = {t.tensor_type.name for t in reader.tensors}
    unsupported = sorted(types - set(SUPPORTED_TENSOR_TYPES))
    if unsupported:
        raise ValueError(f"{name}: GGUF tensor type(s) {', '.join(unsupported)} are not supported "
                         f"(supported: {', '.join(SUPPORTED_TENSOR_TYPES)})")
    return arch


def hf_view(gguf_path: Path, cache_dir: Path | None = None) -> Path:
    """The HF-format view of `gguf_path` (see the module docstring), built on first use.
    Raises ValueError naming an unsupported architecture or tensor type."""
    gguf_path = Path(gguf_path).resolve()
    stat = gguf_path.stat()
    key = hashlib.sha1(f"{gguf_path}\0{stat.st_size}\0{stat.st_mtime_ns}".encode()).hexdigest()[:16]
    view = (cache_dir or _cache_root()) / f"{gguf_path.stem}-{key}"
    if (view / "config.json").is_file():
        return view
    view.parent.mkdir(parents=True, exist_ok=True)
    # Built aside and renamed into place: the Ingress and the engine replicas may start at the
    # same moment, and a half-written view must never be visible.
    tmp = Path(tempfile.mkdtemp(prefix=".partial-", dir=view.parent))
    os.chmod(tmp, 0o755)  # mkdtemp makes it private; the view is as shareable as its cache
    try:
        _write_view(gguf_path, tmp)
        try:
            os.rename(tmp, view)
        except OSError:
            if not (view / "config.json").is_file():  # not a lost race: a real failure
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return view


def _write_view(gguf_path: Path, out: Path) -> None:
    from gguf import GGUFReader
    # transformers imports torch when it is installed; only here, never at import.
    from transformers import AutoConfig, AutoTokenizer

    reader = GGUFReader(gguf_path)  # memory-mapped: reads the header and tensor index only
    arch = check_gguf(reader, gguf_path.name)
    kw = {"gguf_file": gguf_path.name, "local_files_only": True}
    config = AutoConfig.from_pretrained(gguf_path.parent, **kw)
    # transformers leaves `architectures` unset for GGUF, and tied embeddings show as a
    # missing output.weight (llama.cpp then uses token_embd for the head).
    config.architectures = [GGUF_ARCHITECTURES[arch]]
    config.tie_word_embeddings = not any(t.name == "output.weight" for t in reader.tensors)
    # transformers ignores attention.key_length, so a head_dim other than the family's default
    # (Qwen3's 128) would come out wrong.
    key_length = reader.fields.get(f"{arch}.attention.key_length")
    if key_length is not None:
        config.head_dim = int(key_length.contents())
    if arch == "phi3":
        _phi3_rope(reader, config)
    elif arch in _MOE_NORM_TOPK:
        _qwen_moe(reader, arch, config)
    elif arch in _GEMMA_SLIDING_PATTERN:
        _gemma(reader, arch, config)
    elif arch == "llama" and _field(reader, "llama.expert_count"):
        config = _mixtral(reader, config)
    config.save_pretrained(out)
    AutoTokenizer.from_pretrained(gguf_path.parent, **kw).save_pretrained(out)
    os.symlink(gguf_path, out / GGUF_LINK)


def _phi3_rope(reader, config) -> None:
    """What transformers' GGUF config leaves out for `phi3`: the rotated share of each head
    (rope.dimension_count), the original context, the sliding window (0: none) and LongRoPE,
    whose factor lists llama.cpp keeps as the rope_factors_short / _long tensors."""
    def field(key, default=None):
        value = reader.fields.get(f"phi3.{key}")
        return default if value is None else value.contents()

    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    partial = field("rope.dimension_count", head_dim) / head_dim
    old_len = int(field("rope.scaling.original_context_length", config.max_position_embeddings))
    config.partial_rotary_factor, config.original_max_position_embeddings = partial, old_len
    config.sliding_window = field("attention.sliding_window") or None
    factors = {t.name: t.data.tolist() for t in reader.tensors if t.name.startswith("rope_factors_")}
    rope = {"rope_type": "default", "rope_theta": float(field("rope.freq_base", 10000.0)), "partial_rotary_factor": partial}
    if factors:
        rope.update(rope_type="longrope", original_max_position_embeddings=old_len,
                    short_factor=factors["rope_factors_short.weight"], long_factor=factors["rope_factors_long.weight"])
        if field("rope.scaling.attn_factor") is not None:
            rope["attention_factor"] = float(field("rope.scaling.attn_factor"))
    config.rope_parameters = rope


def _field(reader, key: str, default=None):
    value = reader.fields.get(key)
    return default if value is None else value.contents()


def _qwen_moe(reader, arch: str, config) -> None:
    """What transformers' GGUF config leaves out for `qwen2moe` / `qwen3moe`: the experts' width
    (expert_feed_forward_length), the shared expert's (expert_shared_feed_forward_length), whether
    q/k/v have a bias, and whether the top-k weights are renormalised, as llama.cpp's graph does
    it. Every layer is sparse: llama.cpp has no dense MLP tensors for these arches."""
    config.moe_intermediate_size = int(_field(reader, f"{arch}.expert_feed_forward_length"))
    if arch == "qwen2moe":
        config.shared_expert_intermediate_size = int(_field(reader, f"{arch}.expert_shared_feed_forward_length"))
        config.qkv_bias = any(t.name == "blk.0.attn_q.bias" for t in reader.tensors)
    config.decoder_sparse_step = 1
    config.mlp_only_layers = []
    config.norm_topk_prob = bool(_field(reader, f"{arch}.expert_weights_norm", _MOE_NORM_TOPK[arch]))


def _gemma(reader, arch: str, config) -> None:
    """What transformers' GGUF config leaves out or gets wrong for `gemma2` / `gemma3`, as llama.cpp's
    graph reads the file: the attention scale (query_pre_attn_scalar: attention.key_length, or
    hidden_size / heads for the 27B models), the soft caps (gemma2: 50 and 30 unless the file says;
    gemma3: a final cap only when the file has one), which layers slide (llama.cpp's fixed pattern;
    none without a window), and Gemma 3's two RoPEs: rope.freq_base with its linear scaling for the
    global layers, a base of 10000 for the local ones (not in the file: llama.cpp hard-codes it)."""
    layers, heads = config.num_hidden_layers, config.num_attention_heads
    config.query_pre_attn_scalar = (config.hidden_size // heads if layers == _GEMMA_27B_LAYERS[arch]
                                    else int(_field(reader, f"{arch}.attention.key_length")))
    config.hidden_activation = "gelu_pytorch_tanh"
    window = _field(reader, f"{arch}.attention.sliding_window") or None
    pattern = _GEMMA_SLIDING_PATTERN[arch]
    config.sliding_window = int(window) if window else None
    config.layer_types = ["sliding_attention" if window and (i + 1) % pattern else "full_attention"
                          for i in range(layers)]
    final_cap = _field(reader, f"{arch}.final_logit_softcapping")
    if arch == "gemma2":
        config.attn_logit_softcapping = float(_field(reader, "gemma2.attn_logit_softcapping", 50.0))
        config.final_logit_softcapping = float(30.0 if final_cap is None else final_cap)
        return
    config.attn_logit_softcapping = None
    config.final_logit_softcapping = float(final_cap) if final_cap else None
    full = {"rope_type": "default", "rope_theta": float(_field(reader, "gemma3.rope.freq_base", 10000.0))}
    if _field(reader, "gemma3.rope.scaling.type") == "linear":
        full.update(rope_type="linear", factor=float(_field(reader, "gemma3.rope.scaling.factor")))
    config.rope_parameters = {"full_attention": full,
                              "sliding_attention": {"rope_type": "default", "rope_theta": _GEMMA3_LOCAL_ROPE_BASE}}


def _mixtral(reader, config):
    """llama.cpp writes Mixtral as `llama` with expert_count / expert_used_count, which
    transformers reads as a LlamaConfig without experts: rebuilt as the MixtralConfig it is."""
    from transformers import MixtralConfig

    keys = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
            "num_key_value_heads", "head_dim", "max_position_embeddings", "rms_norm_eps", "rope_parameters",
            "tie_word_embeddings", "bos_token_id", "eos_token_id", "pad_token_id")
    mixtral = MixtralConfig(**{k: getattr(config, k) for k in keys if getattr(config, k, None) is not None},
                            num_local_experts=int(_field(reader, "llama.expert_count")),
                            num_experts_per_tok=int(_field(reader, "llama.expert_used_count")))
    mixtral.architectures = ["MixtralForCausalLM"]
    return mixtral


def _cache_root() -> Path:
    if os.environ.get("RAYLLM_GGUF_CACHE"):
        return Path(os.environ["RAYLLM_GGUF_CACHE"]).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "rayllm" / "gguf"
