"""ModelConfig: what the engine needs from a HF config.json, validated once at start.

Keys only one architecture reads stay in `hf_config` for that model's class; RoPE and sliding
windows are read by engine.config.rope and engine.config.sliding_window.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from engine.config.quantization import checkpoint_quantization
from engine.config.rope import check_rope, read_rope
from engine.config.sliding_window import checked_sliding_window, read_layer_types
from engine.models import SUPPORTED_ARCHITECTURES, check_architecture  # names only: no torch

# The MLP activation (HF's name) of the architectures that use another than SiLU.
HIDDEN_ACTS = {"Gemma2ForCausalLM": "gelu_pytorch_tanh", "Gemma3ForCausalLM": "gelu_pytorch_tanh"}


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
    # None (plain RoPE) or {"rope_type": "yarn", ...}: every key the rotary reads, resolved (read_rope)
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
    # p - sliding_window + 1 .. p only); both None: every layer full (read_layer_types reads them).
    sliding_window: int | None = None
    layer_types: list[str] | None = None
    # The checkpoint's config.json as read: the keys only one architecture uses (expert counts,
    # soft-caps, ...) are read by that model's class from here, not copied into a field each.
    hf_config: dict[str, Any] = field(default_factory=dict, repr=False, compare=False)
    # The checkpoint's quantization_config.quant_method (engine.config.quantization); None: unquantized.
    quantization: str | None = None

    def __post_init__(self) -> None:
        check_architecture(self.architecture)
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(f"num_attention_heads={self.num_attention_heads} is not a multiple of "
                             f"num_key_value_heads={self.num_key_value_heads}")
        supported_act = HIDDEN_ACTS.get(self.architecture, "silu")
        if self.hidden_act != supported_act:
            raise ValueError(f"hidden_act={self.hidden_act!r} is not supported for {self.architecture} "
                             f"(only {supported_act!r})")
        check_rope(self)
        self.sliding_window, self.layer_types = checked_sliding_window(self)

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
        layer_types = read_layer_types(hf, arch, hf["num_hidden_layers"])
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
            **read_rope(hf),  # rope_theta, rope_scaling, rope_local, partial_rotary_factor, max positions
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
            quantization=checkpoint_quantization(hf),
        )


def _refuse_unsupported_features(hf: dict[str, Any], arch: str) -> None:
    """Refuse what we would otherwise silently mis-run."""
    if arch == "Gemma3ForConditionalGeneration":
        raise ValueError("architecture 'Gemma3ForConditionalGeneration' (Gemma 3 with its vision tower) is "
                         "not supported; the text-only Gemma3ForCausalLM is")
    check_architecture(arch)
    if hf.get("use_bidirectional_attention"):
        raise ValueError("use_bidirectional_attention=True is not supported (causal attention only)")
    method = checkpoint_quantization(hf)  # ValueError naming an unknown quant_method
    if (method == "mxfp4") != (arch == "GptOssForCausalLM" and method is not None):
        raise ValueError(f"quantization_config quant_method={method!r} is not supported for {arch} "
                         f"(MXFP4 is read for GptOssForCausalLM's experts only, and only MXFP4 for it)")
    if hf.get("mlp_bias"):
        raise ValueError("mlp_bias=True is not supported")
