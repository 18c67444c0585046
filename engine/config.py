"""Engine configuration: plain values, validated once, resolved once.

`EngineConfig` never touches disk; `ModelConfig.from_pretrained` is the one place
that reads a checkpoint's config.json, so a scheduler can be built in a test
from numbers alone. `EngineConfig.resolve` is the one place where "auto" and the
None defaults become concrete values; every stage after it reads only those.
"""
from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from engine.errors import check_int as _positive
from engine.models import SUPPORTED_ARCHITECTURES, check_architecture  # names only: no torch

# The valid concrete values; each EngineConfig field also takes "auto".
DTYPES = ("float32", "bfloat16", "float16")  # torch dtype names: getattr(torch, name)
DEVICES = ("cpu", "cuda")
ATTENTION_BACKENDS = ("triton", "torch")     # engine/layers/attention.py loads their kernels
# The MLP activation (HF's name) of the architectures that use another than SiLU.
HIDDEN_ACTS = {"Gemma2ForCausalLM": "gelu_pytorch_tanh", "Gemma3ForCausalLM": "gelu_pytorch_tanh"}
# Default KV-cache budget on CPU (vLLM's VLLM_CPU_KVCACHE_SPACE default is 4 GiB).
# Pages are only touched when used, so an unused budget costs address space, not RAM.
DEFAULT_CPU_KV_CACHE_GB = 4.0


@dataclass
class ModelConfig:
    """What the engine needs from a HF config.json, for the supported families."""

    architecture: str
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    # None (plain RoPE) or {"rope_type": "yarn", ...}: every key the rotary reads, resolved (_rope_scaling)
    rope_scaling: dict | None = None
    # The sliding-attention layers' RoPE where it differs (Gemma 3: `rope_local_base_freq`, or
    # rope_parameters["sliding_attention"]): a complete {"rope_type", "rope_theta", ...};
    # None: every layer uses rope_theta and rope_scaling.
    rope_local: dict | None = None
    partial_rotary_factor: float = 1.0  # RoPE turns the first int(head_dim * this) features of each head
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # q/k/v projections have a bias (Qwen2)
    qk_norm: bool = False          # RMSNorm on q and k per head (Qwen3)
    hidden_act: str = "silu"
    torch_dtype: str = "float32"
    bos_token_id: int | None = None
    eos_token_ids: list[int] = field(default_factory=list)
    # Per layer, "full_attention" or "sliding_attention" (a query at p attends keys
    # p - sliding_window + 1 .. p only); both None: every layer full (_layer_types reads them).
    sliding_window: int | None = None
    layer_types: list[str] | None = None
    # The checkpoint's config.json as read: the keys only one architecture uses (expert counts,
    # soft-caps, ...) are read by that model's class from here, not copied into a field each.
    hf_config: dict[str, Any] = field(default_factory=dict, repr=False, compare=False)

    def __post_init__(self) -> None:
        check_architecture(self.architecture)
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(f"num_attention_heads={self.num_attention_heads} is not a multiple of "
                             f"num_key_value_heads={self.num_key_value_heads}")
        supported_act = HIDDEN_ACTS.get(self.architecture, "silu")
        if self.hidden_act != supported_act:
            raise ValueError(f"hidden_act={self.hidden_act!r} is not supported for {self.architecture} "
                             f"(only {supported_act!r})")
        _check_rope(self)
        self.sliding_window, self.layer_types = _checked_sliding_window(self)

    def layer_sliding_window(self, layer_idx: int) -> int | None:
        """The window of layer `layer_idx`: sliding_window if it is a sliding layer, else None."""
        if self.layer_types is None or self.layer_types[layer_idx] != "sliding_attention":
            return None
        return self.sliding_window

    @classmethod
    def from_pretrained(cls, model_path: str | os.PathLike) -> "ModelConfig":
        path = Path(model_path) / "config.json"
        if not path.is_file():
            raise ValueError(f"no config.json in {model_path!s}")
        return cls.from_hf_dict(json.loads(path.read_text()))

    @classmethod
    def from_hf_dict(cls, hf: dict[str, Any]) -> "ModelConfig":
        archs = hf.get("architectures") or []
        arch = next((a for a in archs if a in SUPPORTED_ARCHITECTURES), archs[0] if archs else "<missing>")
        _refuse_unsupported_features(hf, arch)
        heads = hf["num_attention_heads"]
        eos = hf.get("eos_token_id")
        layer_types = _layer_types(hf, arch, hf["num_hidden_layers"])
        return cls(
            architecture=arch,
            vocab_size=hf["vocab_size"],
            hidden_size=hf["hidden_size"],
            num_hidden_layers=hf["num_hidden_layers"],
            num_attention_heads=heads,
            num_key_value_heads=hf.get("num_key_value_heads") or heads,
            head_dim=hf.get("head_dim") or hf["hidden_size"] // heads,
            intermediate_size=hf["intermediate_size"],
            rms_norm_eps=hf.get("rms_norm_eps", 1e-6),
            **_rope_scaling(hf),  # rope_theta, rope_scaling, rope_local, partial_rotary_factor, max positions
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            attention_bias=bool(hf.get("attention_bias", arch == "Qwen2ForCausalLM")),
            qk_norm=arch == "Qwen3ForCausalLM",
            # Gemma's HF model reads hidden_activation (its configs may carry both)
            hidden_act=((hf.get("hidden_activation") or hf.get("hidden_act", "silu")) if arch in HIDDEN_ACTS
                        else hf.get("hidden_act", "silu")),
            torch_dtype=str(hf.get("torch_dtype") or hf.get("dtype") or "float32").replace("torch.", ""),
            bos_token_id=hf.get("bos_token_id"),
            eos_token_ids=[] if eos is None else ([eos] if isinstance(eos, int) else list(eos)),
            sliding_window=hf["sliding_window"] if layer_types else None,
            layer_types=layer_types,
            hf_config=hf,
        )


# RoPE types the rotary implements (engine/layers/rotary.py) and the keys each needs once resolved.
ROPE_TYPES = ("default", "linear", "dynamic", "yarn", "longrope", "llama3")
_ROPE_KEYS = {
    "linear": ("factor",),
    "dynamic": ("factor", "original_max_position_embeddings"),
    "yarn": ("factor", "original_max_position_embeddings"),
    "longrope": ("short_factor", "long_factor", "factor", "original_max_position_embeddings"),
    "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
}


def _rope_scaling(hf: dict[str, Any]) -> dict[str, Any]:
    """ModelConfig's RoPE fields from config.json in either form seen on the hub:
    transformers 4's `rope_theta` + `rope_scaling` ({"type": ...} or {"rope_type": ...}, Gemma 3's
    `rope_local_base_freq`) or transformers 5's `rope_parameters` (theta inside; Gemma 3's nested
    per layer type, {"full_attention": {...}, "sliding_attention": {...}}); `partial_rotary_factor`
    at the top or inside. As transformers does, `rope_scaling` wins over `rope_parameters` and keys
    inside the dict over those at the top. max_position_embeddings grows to what yarn
    (original * factor) and dynamic (max * factor) are for, as vLLM derives it."""
    params = hf.get("rope_scaling") or hf.get("rope_parameters") or {}
    nested = any(isinstance(params.get(k), dict) for k in ("full_attention", "sliding_attention"))
    full = (params.get("full_attention") or {}) if nested else params
    max_pos = hf.get("max_position_embeddings", 2048)
    theta = float(full.get("rope_theta") or hf.get("rope_theta") or 10000.0)
    scaling = _resolve_rope(full, hf, max_pos)
    local = params.get("sliding_attention") if nested else None
    if local is not None or "rope_local_base_freq" in hf:
        local = dict(_resolve_rope(local or {}, hf, max_pos) or {"rope_type": "default"},
                     rope_theta=float((local or {}).get("rope_theta") or hf.get("rope_local_base_freq") or theta))
        if local == dict(scaling or {"rope_type": "default"}, rope_theta=theta):
            local = None  # the same RoPE on every layer
    partial = full.get("partial_rotary_factor") or hf.get("partial_rotary_factor") or 1.0
    factor = (scaling or {}).get("factor") or 1.0
    grown = {"yarn": (scaling or {}).get("original_max_position_embeddings", 0) * factor,
             "dynamic": max_pos * factor}.get((scaling or {}).get("rope_type"), 0)
    return dict(rope_theta=theta, rope_scaling=scaling, rope_local=local, partial_rotary_factor=float(partial),
                max_position_embeddings=max(max_pos, int(grown)))


def _resolve_rope(rope: dict[str, Any], hf: dict[str, Any], max_pos: int) -> dict[str, Any] | None:
    """One RoPE dict with its "rope_type" and the lengths it reads filled in as HF fills them; None: plain."""
    rope_type = rope.get("rope_type") or rope.get("type") or "default"
    if rope_type == "default":
        return None
    rope = {k: v for k, v in rope.items() if k not in ("type", "rope_theta", "partial_rotary_factor")}
    rope["rope_type"] = "longrope" if rope_type == "su" else rope_type  # "su": early Phi-3 configs
    if rope["rope_type"] == "dynamic":  # HF's NTK grows past max_position_embeddings itself
        rope["original_max_position_embeddings"] = max_pos
    elif rope["rope_type"] in ("llama3", "yarn", "longrope"):
        # Phi-3 keeps it at the top, which HF prefers to the dict's
        rope["original_max_position_embeddings"] = (hf.get("original_max_position_embeddings")
                                                    or rope.get("original_max_position_embeddings") or max_pos)
        if rope["rope_type"] != "llama3" and rope.get("factor") is None:
            rope["factor"] = max_pos / rope["original_max_position_embeddings"]
    return rope


def _check_rope(config: ModelConfig) -> None:
    """Unknown types and missing keys fail at start, naming them (torch-free: ROPE_TYPES mirrors the rotary)."""
    if not 0.0 < config.partial_rotary_factor <= 1.0:
        raise ValueError(f"partial_rotary_factor={config.partial_rotary_factor} is invalid: must be in (0, 1]")
    rotary_dim = int(config.head_dim * config.partial_rotary_factor)
    if rotary_dim % 2:
        raise ValueError(f"partial_rotary_factor={config.partial_rotary_factor} of head_dim={config.head_dim} "
                         f"gives an odd rotary dimension {rotary_dim}")
    for name, rope in (("rope_scaling", config.rope_scaling), ("rope_local", config.rope_local)):
        rope_type = (rope or {}).get("rope_type", "default")
        if rope_type not in ROPE_TYPES:
            raise ValueError(f"{name} type {rope_type!r} is not supported (supported: {', '.join(ROPE_TYPES)})")
        missing = [k for k in _ROPE_KEYS.get(rope_type, ()) if rope.get(k) is None]
        if missing:
            raise ValueError(f"{name} of type {rope_type!r} lacks {missing}")
        for key in ("short_factor", "long_factor") if rope_type == "longrope" else ():
            if len(rope[key]) != rotary_dim // 2:
                raise ValueError(f"{name}[{key!r}] has {len(rope[key])} factors, expected rotary_dim / 2 = "
                                 f"{rotary_dim // 2}")


def _refuse_unsupported_features(hf: dict[str, Any], arch: str) -> None:
    """Refuse what we would otherwise silently mis-run."""
    if arch == "Gemma3ForConditionalGeneration":
        raise ValueError("architecture 'Gemma3ForConditionalGeneration' (Gemma 3 with its vision tower) is "
                         "not supported; the text-only Gemma3ForCausalLM is")
    check_architecture(arch)
    if hf.get("use_bidirectional_attention"):
        raise ValueError("use_bidirectional_attention=True is not supported (causal attention only)")
    if hf.get("quantization_config"):
        _check_quantization(hf["quantization_config"], arch)
    if hf.get("mlp_bias"):
        raise ValueError("mlp_bias=True is not supported")


# The one checkpoint quantization loaded, dequantized at load (engine/loader/mxfp4.py): gpt-oss's
# MXFP4 experts. Any other quant_method, or MXFP4 on another architecture, is refused by name.
_QUANTIZATIONS = {"GptOssForCausalLM": "mxfp4"}
_QUANTIZATION_KEYS = ("quant_method", "modules_to_not_convert")  # what the hub's MXFP4 configs hold


def _check_quantization(quant: dict[str, Any], arch: str) -> None:
    method = quant.get("quant_method")
    if _QUANTIZATIONS.get(arch) != method:
        raise ValueError(f"quantization_config quant_method={method!r} is not supported for {arch} "
                         f"(quantized checkpoints load only as {_QUANTIZATIONS})")
    extra = sorted(set(quant) - set(_QUANTIZATION_KEYS))
    if extra:
        raise ValueError(f"quantization_config keys {extra} are not supported for quant_method={method!r}")


LAYER_TYPES = ("full_attention", "sliding_attention")
# The architectures whose model passes each layer's window to its attention (the Llama graph,
# engine/models/llama.py, and Gemma's); any other with a sliding layer is refused by name.
SLIDING_WINDOW_ARCHITECTURES = ("MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM", "Phi3ForCausalLM",
                               "Gemma2ForCausalLM", "Gemma3ForCausalLM", "GptOssForCausalLM")
# Those that slide only with use_sliding_window (default off), and those whose HF model gives
# every layer the window whatever layer_types says.
_QWEN_WINDOW_ARCHS = ("Qwen2ForCausalLM", "Qwen3ForCausalLM", "Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM")
_EVERY_LAYER_SLIDES = ("MistralForCausalLM", "MixtralForCausalLM", "Phi3ForCausalLM", "Qwen3MoeForCausalLM")


def _layer_types(hf: dict[str, Any], arch: str, num_layers: int) -> list[str] | None:
    """Each layer's "full_attention" / "sliding_attention" as HF's model builds them; None when
    no layer slides. transformers 5 writes `layer_types`; older configs only the keys each
    family reads: Mistral's `sliding_window` (every layer; null: none), Qwen2's
    `use_sliding_window` with `max_window_layers` (layers from that index on slide), Gemma 2's
    alternation (even layers slide), Gemma 3's `sliding_window_pattern` (every Nth layer full)."""
    if hf.get("sliding_window") is None:
        return None
    if arch in _QWEN_WINDOW_ARCHS and not hf.get("use_sliding_window", False):
        return None
    first_full = hf.get("max_window_layers", 28)
    if arch in _EVERY_LAYER_SLIDES:
        slides = [True] * num_layers
    elif hf.get("layer_types") is not None:
        return list(hf["layer_types"]) if "sliding_attention" in hf["layer_types"] else None
    elif arch in ("Qwen2ForCausalLM", "Qwen3ForCausalLM"):
        slides = [i >= first_full for i in range(num_layers)]
    elif arch == "Qwen2MoeForCausalLM":
        slides = [i % 2 == 0 and i < first_full for i in range(num_layers)]
    elif arch in ("Gemma2ForCausalLM", "GptOssForCausalLM"):
        slides = [i % 2 == 0 for i in range(num_layers)]
    elif arch.startswith("Gemma3"):
        slides = [(i + 1) % hf.get("sliding_window_pattern", 6) != 0 for i in range(num_layers)]
    else:  # Llama and the rest: HF's model has no window
        return None
    return [LAYER_TYPES[s] for s in slides] if any(slides) else None


def _checked_sliding_window(config: ModelConfig) -> tuple[int | None, list[str] | None]:
    """(sliding_window, layer_types), validated; (None, None) when no layer slides over less than
    the whole context (max_position_embeddings): such a window never masks a key."""
    window, types = config.sliding_window, config.layer_types
    if types is None:
        if window is not None:
            raise ValueError(f"sliding_window={window} needs layer_types (which layers slide)")
        return None, None
    if len(types) != config.num_hidden_layers:
        raise ValueError(f"layer_types has {len(types)} entries; expected num_hidden_layers="
                         f"{config.num_hidden_layers}")
    unknown = sorted(set(types) - set(LAYER_TYPES))
    if unknown:
        raise ValueError(f"layer_types {unknown} are not supported (supported: {', '.join(LAYER_TYPES)})")
    if "sliding_attention" not in types:
        return None, None
    if isinstance(window, bool) or not isinstance(window, int) or window < 1:
        raise ValueError(f"sliding_window={window!r} is invalid: sliding_attention layers need an int >= 1")
    if window >= config.max_position_embeddings:
        return None, None
    if config.architecture not in SLIDING_WINDOW_ARCHITECTURES:
        raise ValueError(f"sliding_window={window} is not supported for {config.architecture} "
                         f"(sliding-window attention runs on {', '.join(SLIDING_WINDOW_ARCHITECTURES)})")
    return window, list(types)


@dataclass
class EngineConfig:
    """Engine knobs, as vLLM names them. `model` is a local directory (or a hub id resolved by the loader).

    Each field is also an arg of the Serve app under its name (serve_app/args.py reads them), so a
    new knob needs a type pydantic can parse from a string and its check in __post_init__.
    """

    model: str
    tokenizer: str | None = None
    dtype: str = "auto"
    device: str = "auto"
    tensor_parallel_size: int = 1
    max_num_seqs: int = 256
    max_num_batched_tokens: int | None = None  # None: 8192 on CUDA, 2048 on CPU
    max_model_len: int | None = None            # None: the model's max_position_embeddings
    block_size: int = 16
    num_kv_blocks: int | None = None            # None: from gpu_memory_utilization / cpu_kv_cache_gb
    gpu_memory_utilization: float = 0.9
    cpu_kv_cache_gb: float = DEFAULT_CPU_KV_CACHE_GB
    enable_prefix_caching: bool = True
    enforce_eager: bool = False
    attention_backend: str = "auto"
    seed: int = 0
    # Overlapped scheduling: plan and launch step N+1 before step N's tokens are read back.
    # None: on for CUDA with tensor_parallel_size 1 (on CPU the forward is synchronous, so there
    # is nothing to overlap). True with tensor_parallel_size > 1 is refused.
    async_scheduling: bool | None = None
    # A reasoning model's parser (vLLM's --reasoning-parser: "qwen3", "deepseek_r1"; engine/reasoning):
    # a request's structured output then constrains only the answer, from the token after the thinking ends.
    reasoning_parser: str | None = None
    distributed_init_method: str | None = None  # "tcp://host:port" for TP workers; None picks a free local port
    worker_start_timeout_s: float = 120.0       # a TP worker not up by then fails start-up, naming its rank

    def __post_init__(self) -> None:
        _choice("dtype", self.dtype, ("auto",) + DTYPES)
        _choice("device", self.device, ("auto",) + DEVICES)
        _choice("attention_backend", self.attention_backend, ("auto",) + ATTENTION_BACKENDS)
        _positive("tensor_parallel_size", self.tensor_parallel_size)
        _positive("max_num_seqs", self.max_num_seqs)
        _positive("block_size", self.block_size)
        if self.block_size % 8 or self.block_size > 256:
            raise ValueError(f"block_size={self.block_size} is invalid: must be a multiple of 8 and <= 256")
        for name in ("max_num_batched_tokens", "max_model_len", "num_kv_blocks"):
            if getattr(self, name) is not None:
                _positive(name, getattr(self, name))
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(f"gpu_memory_utilization={self.gpu_memory_utilization} is invalid: must be in (0, 1]")
        if not self.worker_start_timeout_s > 0:
            raise ValueError(f"worker_start_timeout_s={self.worker_start_timeout_s} is invalid: must be > 0")
        if self.cpu_kv_cache_gb <= 0:
            raise ValueError(f"cpu_kv_cache_gb={self.cpu_kv_cache_gb} is invalid: must be > 0")
        if self.async_scheduling not in (None, True, False):
            raise ValueError(f"async_scheduling={self.async_scheduling!r} is invalid: choose True, False or None")
        if self.reasoning_parser is not None:
            _check_reasoning_parser(self.reasoning_parser)
        if self.async_scheduling and self.tensor_parallel_size > 1:
            raise ValueError(f"async_scheduling=True is not supported with tensor_parallel_size="
                             f"{self.tensor_parallel_size} (TP workers replay host-side inputs)")

    def resolve(self, model_config: ModelConfig) -> EngineConfig:
        """A copy with every "auto" and None default decided for this machine and model.

        The one place they are decided: LLMEngine calls it once, and the executors, TP workers,
        model runner and attention layers read only its result (device "cpu" / "cuda", a name
        in DTYPES, a name in ATTENTION_BACKENDS), so no two stages can decide differently.
        Raises ValueError for device="cuda" without CUDA and for max_model_len over the model's.
        """
        device = _resolve_device(self.device)
        on_cuda = device == "cuda"
        max_model_len = self.max_model_len or model_config.max_position_embeddings
        if max_model_len > model_config.max_position_embeddings:
            raise ValueError(f"max_model_len={max_model_len} exceeds the model's max_position_embeddings="
                             f"{model_config.max_position_embeddings}")
        async_scheduling = self.async_scheduling
        if async_scheduling is None:
            async_scheduling = on_cuda and self.tensor_parallel_size == 1
        return dataclasses.replace(
            self, device=device, dtype=_resolve_dtype(self.dtype, on_cuda, model_config.torch_dtype),
            attention_backend=_resolve_attention_backend(self.attention_backend, on_cuda),
            max_model_len=max_model_len,
            max_num_batched_tokens=self.max_num_batched_tokens or (8192 if on_cuda else 2048),
            async_scheduling=async_scheduling)

    @property
    def is_resolved(self) -> bool:
        """Whether every value `resolve` decides is concrete (stages check it before reading them)."""
        return ("auto" not in (self.device, self.dtype, self.attention_backend)
                and None not in (self.max_model_len, self.max_num_batched_tokens, self.async_scheduling))


def _resolve_device(device: str) -> str:
    import torch  # here, not at the top: the HTTP tier imports this module without torch

    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda" and not torch.cuda.is_available():
        raise ValueError("device='cuda' was requested but CUDA is not available on this machine")
    return device


def _resolve_dtype(dtype: str, on_cuda: bool, checkpoint_dtype: str) -> str:
    if dtype != "auto":
        return dtype
    if not on_cuda:
        return "float32"  # CPU bf16 matmuls are slower than fp32 on most hosts
    # On GPU: the checkpoint's half type if it has one, else bf16.
    return checkpoint_dtype if checkpoint_dtype in ("bfloat16", "float16") else "bfloat16"


def _resolve_attention_backend(backend: str, on_cuda: bool) -> str:
    if backend != "auto":
        return backend  # "triton" on CPU runs under TRITON_INTERPRET=1 (tests only)
    return "triton" if on_cuda else "torch"  # "torch": the CPU path (kernels/cpu_attention.py)


def _check_reasoning_parser(name: Any) -> None:
    from engine.reasoning import get_reasoning_parser  # torch-free, like this module

    try:
        get_reasoning_parser(name)
    except (ValueError, TypeError) as e:
        raise ValueError(f"reasoning_parser={name!r} is invalid: {e}") from None


def _choice(name: str, value: Any, choices: tuple) -> None:
    if value not in choices:
        raise ValueError(f"{name}={value!r} is invalid: choose one of {choices}")
