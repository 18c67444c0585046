"""Write small random-weight checkpoints in real Hugging Face format.

The engine is tested token-for-token against HF transformers on these
checkpoints, and no hub access is available, so everything (weights and a
byte-level BPE tokenizer) is built locally and deterministically: the same
arguments give byte-identical files.

    make_tiny_model(out_dir, arch=None, preset="tiny", seed=0,
                    max_shard_size=None, chat_template=None, added_tokens=(),
                    **config_overrides) -> Path

arch: llama | mistral | qwen2 | qwen3 | phi3 (None: llama, or the preset's own arch).
phi3: LongRoPE (original context max_position_embeddings / 8) and partial_rotary_factor 0.75.
moe archs: mixtral | qwen2_moe | qwen3_moe, 8 experts, top-2 (expert MLPs half as wide as
intermediate_size; qwen2_moe's shared expert as wide, its layer 1 dense); gpt_oss: 8 experts
top-2, sinks, layers alternating sliding (window 16) and full, yarn RoPE.
gemma archs: gemma2 | gemma3 (text), 4 layers, windows of 16 (gemma2: every other layer, soft caps
5 / 15; gemma3: 2 local layers to 1 global, global RoPE 100x the base and linearly scaled).
preset: tiny (tests) | bench (CPU benchmark, ~22M params) | qwen3-0.6b |
llama-8b (bf16, real shapes, random weights, for GPU benchmarks).
chat_template: a Jinja chat template replacing the arch's plain one (e.g. a
tools-aware one); added_tokens: strings made single tokens (e.g. "<tool_call>",
"<think>"), added as Qwen's tokenizer adds them: not special, so decoding
keeps them in the text, where tool-call and reasoning parsers look for them.

CLI: python -m engine.tools.tiny_model --out DIR [--arch A] [--preset P] [--seed S]
     [--chat-template FILE] [--added-token TOKEN ...]
"""

from __future__ import annotations

import argparse
import json
import math
import zlib
from pathlib import Path

import torch
from safetensors.torch import save_file
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors, trainers

from engine.math_utils import cdiv
from engine.tools._tiny_corpus import corpus_lines

ARCHS = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM",
         "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM", "phi3": "Phi3ForCausalLM"}
# Mixture-of-experts: with 8 experts and top-2, a batch's tokens reach every expert.
MOE_ARCHS = {"mixtral": "MixtralForCausalLM", "qwen2_moe": "Qwen2MoeForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM",
             "gpt_oss": "GptOssForCausalLM"}
ARCHS.update(MOE_ARCHS)
GEMMA_ARCHS = {"gemma2": "Gemma2ForCausalLM", "gemma3": "Gemma3ForCausalLM"}  # norms store (1 + w) - 1
ARCHS.update(GEMMA_ARCHS)

# Per-arch config that holds for every preset.
ARCH_CONFIG = {
    "llama": dict(tie_word_embeddings=False),
    "mistral": dict(tie_word_embeddings=False, sliding_window=None),
    "qwen2": dict(tie_word_embeddings=True, use_sliding_window=False),
    "qwen3": dict(tie_word_embeddings=True, use_sliding_window=False),
    "mixtral": dict(tie_word_embeddings=False, sliding_window=None, num_local_experts=8, num_experts_per_tok=2),
    "qwen2_moe": dict(tie_word_embeddings=False, use_sliding_window=False, num_experts=8, num_experts_per_tok=2,
                      norm_topk_prob=False, mlp_only_layers=[1]),
    "qwen3_moe": dict(tie_word_embeddings=False, use_sliding_window=False, num_experts=8, num_experts_per_tok=2,
                      norm_topk_prob=True),
    "phi3": dict(tie_word_embeddings=False, sliding_window=None, partial_rotary_factor=0.75),
    # gpt-oss: sliding and full layers alternating, yarn as the real config has it (factor 32 over
    # an original context of max_position_embeddings / 32), experts intermediate_size wide.
    "gpt_oss": dict(tie_word_embeddings=False, num_local_experts=8, num_experts_per_tok=2, sliding_window=16,
                    rope_scaling=dict(rope_type="yarn", factor=32.0, beta_fast=32.0, beta_slow=1.0, truncate=False)),
    # Soft caps small enough to bend the tiny model's scores and logits; windows of one block.
    "gemma2": dict(tie_word_embeddings=True, hidden_act="gelu_pytorch_tanh", hidden_activation="gelu_pytorch_tanh",
                   head_dim=16, query_pre_attn_scalar=4, sliding_window=16, attn_logit_softcapping=5.0,
                   final_logit_softcapping=15.0),
    "gemma3": dict(tie_word_embeddings=True, hidden_act="gelu_pytorch_tanh", hidden_activation="gelu_pytorch_tanh",
                   head_dim=16, query_pre_attn_scalar=24, sliding_window=16, sliding_window_pattern=3),
}

_COMMON = dict(hidden_act="silu", rms_norm_eps=1e-6, rope_theta=10000.0)

# arch=None means "any arch" (default llama). tok_vocab is the BPE training
# target; n_generated adds synthetic corpus lines so ~4k merges exist.
PRESETS = {
    "tiny": dict(arch=None, dtype="float32", tok_vocab=1000, n_generated=0, config=dict(
        _COMMON, num_hidden_layers=2, hidden_size=64, num_attention_heads=4,
        num_key_value_heads=2, intermediate_size=128, max_position_embeddings=2048)),
    "bench": dict(arch=None, dtype="float32", tok_vocab=4000, n_generated=1000, config=dict(
        _COMMON, num_hidden_layers=6, hidden_size=512, num_attention_heads=8,
        num_key_value_heads=4, intermediate_size=1408, max_position_embeddings=2048)),
    # Shape-only presets for GPU benchmarks; real hyper-parameters except that
    # Llama-3.1's "llama3" rope scaling is left out (same shapes, plain RoPE).
    "qwen3-0.6b": dict(arch="qwen3", dtype="bfloat16", tok_vocab=4000, n_generated=1000, config=dict(
        hidden_act="silu", rms_norm_eps=1e-6, rope_theta=1000000.0, num_hidden_layers=28,
        hidden_size=1024, num_attention_heads=16, num_key_value_heads=8, head_dim=128,
        intermediate_size=3072, vocab_size=151936, max_position_embeddings=40960)),
    "llama-8b": dict(arch="llama", dtype="bfloat16", tok_vocab=4000, n_generated=1000, config=dict(
        hidden_act="silu", rms_norm_eps=1e-5, rope_theta=500000.0, num_hidden_layers=32,
        hidden_size=4096, num_attention_heads=32, num_key_value_heads=8,
        intermediate_size=14336, vocab_size=128256, max_position_embeddings=8192)),
}

# Tiny-only tweaks that make each arch exercise its distinctive code path.
TINY_ARCH_TWEAKS = {"qwen2": dict(num_key_value_heads=1),   # MQA
                    "qwen3": dict(head_dim=32),             # != 64 // 4
                    "gemma2": dict(num_hidden_layers=4),    # sliding, full, sliding, full
                    "gemma3": dict(num_hidden_layers=4),    # sliding, sliding, full, sliding
                    "gpt_oss": dict(head_dim=32, swiglu_limit=1.5)}  # q wider than hidden; a clamp tiny activations reach

# Special tokens, in id order (0, 1, 2), and their roles.
LLAMA_SPECIALS = dict(tokens=["<unk>", "<s>", "</s>"], unk="<unk>", bos="<s>",
                      eos="</s>", pad="<unk>")
QWEN_SPECIALS = dict(tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"], unk=None,
                     bos=None, eos="<|im_end|>", pad="<|endoftext|>")

QWEN_CHAT_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + "
    "message['content'] + '<|im_end|>\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")
# bos comes from the template: apply_chat_template encodes without specials.
LLAMA_CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}{{ '[' + message['role'] + ']\\n' + "
    "message['content'] + eos_token + '\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '[assistant]\\n' }}{% endif %}")

# Init (see _init_tensor). HF's std-0.02 init gives near-uniform logits, so
# greedy engine-vs-HF comparisons would hinge on 1e-6 differences. These
# scales give logits with std ~LOGIT_STD while every residual branch stays
# O(1): on tiny llama, 0 of 256 greedy steps had a top-2 gap < 1e-3.
EMBED_STD = 1.0
TIED_EMBED_GAIN = 0.25
LOGIT_STD = 4.0
BIAS_STD = 0.1
NORM_JITTER = 0.1


def _specials(arch: str) -> dict:
    return QWEN_SPECIALS if arch.startswith("qwen") else LLAMA_SPECIALS


def _train_tokenizer(arch: str, vocab: int, n_generated: int, added_tokens=()) -> Tokenizer:
    sp = _specials(arch)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab, special_tokens=sp["tokens"], show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet())  # all 256 bytes
    tok.train_from_iterator(corpus_lines(n_generated), trainer)
    # After training, so the BPE merges (and every id below them) are those of a build without them.
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in added_tokens])
    if sp["bos"]:  # Llama-style: encode() prepends bos
        bos = (sp["bos"], tok.token_to_id(sp["bos"]))
        tok.post_processor = processors.TemplateProcessing(
            single=f"{bos[0]} $A", pair=f"{bos[0]} $A {bos[0]} $B:1", special_tokens=[bos])
    return tok


def _save_tokenizer(tok: Tokenizer, arch: str, out: Path, chat_template: str | None = None) -> None:
    from transformers import PreTrainedTokenizerFast

    sp = _specials(arch)
    template = chat_template or (QWEN_CHAT_TEMPLATE if arch.startswith("qwen") else LLAMA_CHAT_TEMPLATE)
    roles = {f"{r}_token": sp[r] for r in ("bos", "eos", "unk", "pad") if sp[r]}
    hf_tok = PreTrainedTokenizerFast(tokenizer_object=tok, chat_template=template,
                                     model_max_length=1 << 20, **roles)
    # save_jinja_files=False: keep the template inside tokenizer_config.json.
    hf_tok.save_pretrained(out, save_jinja_files=False)
    # Newer transformers stop writing this file; older loaders still read it.
    (out / "special_tokens_map.json").write_text(json.dumps(roles, indent=2) + "\n")


def _special_ids(tok: Tokenizer, arch: str) -> dict:
    sp = _specials(arch)
    return {f"{r}_token_id": tok.token_to_id(sp[r]) if sp[r] else None for r in ("bos", "eos", "pad")}


def _build_config(arch: str, preset: dict, tok_len: int, ids: dict, overrides: dict):
    from transformers import AutoConfig

    kw = dict(preset["config"], **ARCH_CONFIG[arch])
    if preset is PRESETS["tiny"]:
        kw.update(TINY_ARCH_TWEAKS.get(arch, {}))
    kw.setdefault("vocab_size", cdiv(tok_len, 64) * 64)  # pad to a multiple of 64
    kw.update(ids, **overrides)
    if arch in ("qwen2", "qwen3") and overrides.get("sliding_window") is not None:
        # A window asked of a Qwen checkpoint is turned on, for the upper half of the layers.
        kw["use_sliding_window"] = overrides.get("use_sliding_window", True)
        kw["max_window_layers"] = overrides.get("max_window_layers", kw["num_hidden_layers"] // 2)
    if kw["vocab_size"] < tok_len:
        raise ValueError(f"vocab_size {kw['vocab_size']} < tokenizer size {tok_len}")
    if arch in ("qwen2_moe", "qwen3_moe"):  # Mixtral's experts are intermediate_size wide
        kw.setdefault("moe_intermediate_size", kw["intermediate_size"] // 2)
    if arch == "qwen2_moe":
        kw.setdefault("shared_expert_intermediate_size", kw["intermediate_size"])
    theta = kw.pop("rope_theta")  # transformers>=5 spells it rope_parameters
    if arch == "gemma3":  # the global layers' RoPE (linear scaling, as Gemma 3 4B+), and the local layers'
        kw.setdefault("rope_parameters", dict(full_attention=dict(rope_type="linear", factor=2.0, rope_theta=100 * theta),
                                              sliding_attention=dict(rope_type="default", rope_theta=theta)))
    if arch == "gpt_oss":
        yarn = kw.pop("rope_scaling")
        kw.setdefault("rope_parameters", dict(yarn, rope_theta=150000.0,
                                              original_max_position_embeddings=kw["max_position_embeddings"] // 32))
    kw.setdefault("rope_parameters", _longrope(kw, theta) if arch == "phi3" else dict(rope_type="default", rope_theta=theta))
    model_type = {"gemma3": "gemma3_text"}.get(arch, arch)  # "gemma3" is the multimodal config
    return AutoConfig.for_model(model_type, architectures=[ARCHS[arch]], dtype=preset["dtype"], **kw)


def _longrope(kw: dict, theta: float) -> dict:
    """Phi-3's LongRoPE on an original context of max_position_embeddings / 8: per-frequency
    divisors rising from 1 (short) and to 8 (long), one per rotated pair of features."""
    head_dim = kw.get("head_dim") or kw["hidden_size"] // kw["num_attention_heads"]
    pairs = int(head_dim * kw.get("partial_rotary_factor", 1.0)) // 2
    kw.setdefault("original_max_position_embeddings", kw["max_position_embeddings"] // 8)
    return dict(rope_type="longrope", rope_theta=theta,
                short_factor=[1.0 + 0.5 * i / pairs for i in range(pairs)],
                long_factor=[1.0 + 7.0 * (i / (pairs - 1)) ** 2 for i in range(pairs)])


def _init_tensor(name, shape, config, n_tok: int, seed: int, dtype, device="cpu") -> torch.Tensor:
    """Deterministic random tensor for one HF parameter name.

    Each tensor gets its own seed (derived from its name), so the values do
    not depend on creation order and tensors can be built one at a time.
    """
    gen = torch.Generator(device).manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
    x = torch.randn(shape, generator=gen, dtype=torch.float32, device=device)
    tied = config.tie_word_embeddings
    if name.endswith("norm.weight"):  # jitter so a dropped norm weight shows
        x = 1.0 + NORM_JITTER * x
        if tied and name == "model.norm.weight":
            x = x * (LOGIT_STD / TIED_EMBED_GAIN)  # tied: final norm sets the logit scale
        if config.model_type.startswith("gemma"):
            x = x - 1.0  # Gemma's norms multiply by (1 + weight)
    elif name.endswith((".bias", "_bias")):  # gpt-oss's experts: gate_up_proj_bias, down_proj_bias
        x = BIAS_STD * x
    elif name.endswith(".sinks"):  # gpt-oss: a logit per head, O(1) to matter
        pass
    elif name.endswith((".experts.gate_up_proj", ".experts.down_proj")) and config.model_type == "gpt_oss":
        x = x / math.sqrt(shape[-2])  # [E, in, out]: x @ W
    elif "embed_tokens" in name:
        # Tied: a large embedding would dominate the residual, and h . e_x then
        # makes every token predict itself (greedy repeats one token forever).
        x = x * (TIED_EMBED_GAIN / math.sqrt(config.hidden_size) if tied else EMBED_STD)
    elif name == "lm_head.weight":
        x = x * (LOGIT_STD / math.sqrt(config.hidden_size))
    else:  # Linear [out, in]: 1/sqrt(fan_in) keeps activations O(1)
        x = x / math.sqrt(shape[-1])
    if name in ("model.embed_tokens.weight", "lm_head.weight"):
        x[n_tok:] = 0  # padding ids get logit 0, far below the max: never greedy picks
    return x.to(dtype).cpu()


def _meta_model(config):
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config)


def _save_with_hf(config, out: Path, n_tok: int, seed: int, max_shard_size) -> None:
    """tiny/bench: fill a real fp32 HF model and let save_pretrained shard it."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():  # tied lm_head is not listed
            p.copy_(_init_tensor(name, p.shape, config, n_tok, seed, torch.float32))
    kw = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(out, **kw)


def _plan_shards(names_shapes, itemsize: int, limit: int) -> list[list]:
    """Greedy split into shards of at most `limit` bytes (one tensor may exceed)."""
    shards, cur, cur_bytes = [], [], 0
    for name, shape in names_shapes:
        nbytes = math.prod(shape) * itemsize
        if cur and cur_bytes + nbytes > limit:
            shards.append(cur)
            cur, cur_bytes = [], 0
        cur.append((name, shape))
        cur_bytes += nbytes
    return shards + [cur]


def _save_direct(config, out: Path, n_tok: int, seed: int, max_shard_size, dtype) -> None:
    """Big presets: tensors built one shard at a time, never a full fp32 model.

    Normal sampling dominates the build time (8B values), so it runs on the
    GPU when there is one: files are then deterministic per device type.
    """
    from transformers.utils.hub import convert_file_size_to_int

    device = "cuda" if torch.cuda.is_available() else "cpu"
    # HF parameter names from a weightless model; tied lm_head is not listed.
    names = [(n, p.shape) for n, p in _meta_model(config).named_parameters()]
    shards = _plan_shards(names, dtype.itemsize, convert_file_size_to_int(max_shard_size or "2GB"))
    weight_map, total = {}, 0
    for i, shard in enumerate(shards, 1):
        fname = (f"model-{i:05d}-of-{len(shards):05d}.safetensors" if len(shards) > 1
                 else "model.safetensors")
        tensors = {n: _init_tensor(n, s, config, n_tok, seed, dtype, device) for n, s in shard}
        total += sum(t.numel() * t.element_size() for t in tensors.values())
        save_file(tensors, out / fname, metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(tensors, fname))
        del tensors  # keep peak memory at one shard
    if len(shards) > 1:
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")


def _write_configs(config, out: Path) -> None:
    from transformers import GenerationConfig

    config.save_pretrained(out)
    GenerationConfig(bos_token_id=config.bos_token_id, eos_token_id=config.eos_token_id,
                     pad_token_id=config.pad_token_id).save_pretrained(out)
    # transformers>=5 writes rope_parameters only; hub checkpoints (and simple
    # loaders) use a top-level rope_theta. HF accepts both being present.
    cfg = json.loads((out / "config.json").read_text())
    rope = cfg["rope_parameters"]
    cfg["rope_theta"] = rope.get("full_attention", rope)["rope_theta"]  # Gemma 3's: per layer type
    (out / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")


def make_tiny_model(out_dir, arch=None, preset="tiny", seed=0, max_shard_size=None,
                    chat_template: str | None = None, added_tokens=(), **config_overrides) -> Path:
    """Build a random HF checkpoint + tokenizer in out_dir and return its path.

    arch defaults to "llama" (or the preset's own arch for shape presets).
    chat_template replaces the arch's template; added_tokens become single, non-special tokens.
    config_overrides are applied to the HF config (e.g. num_hidden_layers=1). sliding_window=N
    gives mistral a window on every layer; qwen2 / qwen3 one from layer num_hidden_layers // 2
    on (use_sliding_window and max_window_layers, unless given too).
    """
    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; choose from {sorted(PRESETS)}")
    p = PRESETS[preset]
    arch = arch or p["arch"] or "llama"
    if arch not in ARCHS or (p["arch"] and arch != p["arch"]):
        raise ValueError(f"arch {arch!r} not valid for preset {preset!r}")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tok = _train_tokenizer(arch, p["tok_vocab"], p["n_generated"], added_tokens)
    n_tok = tok.get_vocab_size()
    config = _build_config(arch, p, n_tok, _special_ids(tok, arch), config_overrides)
    for old in [*out.glob("model*.safetensors"), *out.glob("model.safetensors.index.json")]:
        old.unlink()  # a stale shard or index from an earlier build would be loaded
    if p["dtype"] == "float32":
        _save_with_hf(config, out, n_tok, seed, max_shard_size)
    else:
        _save_direct(config, out, n_tok, seed, max_shard_size, getattr(torch, p["dtype"]))
    _write_configs(config, out)
    _save_tokenizer(tok, arch, out, chat_template)
    return out


def _summary(out: Path) -> str:
    from safetensors import safe_open

    cfg = json.loads((out / "config.json").read_text())
    tok = Tokenizer.from_file(str(out / "tokenizer.json"))
    n_params = 0
    for f in sorted(out.glob("*.safetensors")):  # headers only: cheap even for 8B
        with safe_open(f, "pt") as st:
            n_params += sum(math.prod(st.get_slice(k).get_shape()) for k in st.keys())
    return (f"{cfg['architectures'][0]}: {n_params / 1e6:.2f}M params, "
            f"{cfg['num_hidden_layers']} layers, hidden {cfg['hidden_size']}, "
            f"vocab {cfg['vocab_size']} (tokenizer {tok.get_vocab_size()}), {cfg.get('dtype')}")


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--arch", choices=sorted(ARCHS), default=None)
    ap.add_argument("--preset", choices=sorted(PRESETS), default="tiny")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--max-shard-size", default=None, help='e.g. "200KB", "2GB"')
    ap.add_argument("--chat-template", default=None, help="a Jinja chat template file replacing the arch's own")
    ap.add_argument("--added-token", action="append", default=[], help="a string made one (non-special) token")
    args = ap.parse_args(argv)
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # keep CLI output to the two lines below
    template = Path(args.chat_template).read_text() if args.chat_template else None
    out = make_tiny_model(args.out, arch=args.arch, preset=args.preset, seed=args.seed,
                          max_shard_size=args.max_shard_size, chat_template=template,
                          added_tokens=args.added_token)
    print(out)
    print(_summary(out))


if __name__ == "__main__":
    main()
