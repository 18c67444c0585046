"""A PEFT LoRA adapter on disk, read and checked against the base model. No torch.

Runs when a request arrives (`LLMEngine.make_request`), off the step loop: everything the
engine does not run fails there, naming it, so loading into a slot later cannot fail on content.
It reads `adapter_config.json` and the safetensors header (names, shapes), not the tensors.

PEFT stores, per adapted module, `lora_A` [r, in] and `lora_B` [out, r] under the module's
name in the HF model (`base_model.model.model.layers.3.self_attn.q_proj.lora_A.weight`); the
update is W + scaling * B @ A, with scaling = lora_alpha / r (rsLoRA: lora_alpha / sqrt(r)).
"""
from __future__ import annotations

import json
import math
import re
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from engine.lora.request import LoRARequest

if TYPE_CHECKING:
    from engine.config.model import ModelConfig

CONFIG_NAME, WEIGHTS_NAME = "adapter_config.json", "adapter_model.safetensors"
# PEFT's module name -> (our layer in the same block, its part: a QKVParallelLinear /
# MergedColumnParallelLinear shard_id, None for an unfused layer). engine/models/llama.py's names.
TARGET_MODULES = {
    "q_proj": ("self_attn.qkv_proj", "q"), "k_proj": ("self_attn.qkv_proj", "k"),
    "v_proj": ("self_attn.qkv_proj", "v"), "o_proj": ("self_attn.o_proj", None),
    "gate_proj": ("mlp.gate_up_proj", 0), "up_proj": ("mlp.gate_up_proj", 1), "down_proj": ("mlp.down_proj", None),
}
_KEY = re.compile(r"base_model\.model\.model\.layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])\.weight")


@dataclass(frozen=True)
class LoRATarget:
    """One adapted checkpoint module and where it lands in ours."""

    layer: str                # our module, e.g. "model.layers.3.self_attn.qkv_proj"
    shard_id: str | int | None
    a_key: str                # tensor names in adapter_model.safetensors
    b_key: str


@dataclass(frozen=True)
class PEFTAdapter:
    lora_request: LoRARequest
    rank: int
    scaling: float            # multiplies B @ A
    weights_path: Path
    targets: tuple[LoRATarget, ...]


def read_peft_adapter(lora_request: LoRARequest, max_lora_rank: int, model_config: ModelConfig) -> PEFTAdapter:
    """The adapter of `lora_request`, checked; ValueError naming the adapter and what it cannot run."""
    path = Path(lora_request.lora_path).expanduser()
    what = f"LoRA adapter {lora_request.lora_name!r} ({path})"
    if not (path / CONFIG_NAME).is_file() or not (path / WEIGHTS_NAME).is_file():
        raise ValueError(f"{what}: expected {CONFIG_NAME} and {WEIGHTS_NAME} in that directory")
    try:
        config = read_adapter_config(path)
        shapes = safetensors_shapes(path / WEIGHTS_NAME)
    except ValueError as e:
        raise ValueError(f"{what}: {e}") from None
    rank = _check_config(config, max_lora_rank, what)
    targets = _targets(shapes, rank, model_config, what)
    alpha = config.get("lora_alpha", rank)
    scaling = alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank
    return PEFTAdapter(lora_request, rank, scaling, path / WEIGHTS_NAME, targets)


def _check_config(config: dict, max_lora_rank: int, what: str) -> int:
    """The adapter's rank, once every setting it uses is one the engine runs."""
    if config.get("peft_type", "LORA") != "LORA":
        raise ValueError(f"{what}: peft_type={config['peft_type']!r} is not supported (only LORA)")
    rank = config.get("r")
    if not isinstance(rank, int) or rank < 1:
        raise ValueError(f"{what}: r={rank!r} is invalid")
    if rank > max_lora_rank:
        raise ValueError(f"{what}: r={rank} exceeds max_lora_rank={max_lora_rank}")
    refused = {"bias": config.get("bias", "none") != "none", "use_dora": bool(config.get("use_dora")),
               "modules_to_save": bool(config.get("modules_to_save")),
               "rank_pattern": bool(config.get("rank_pattern")), "alpha_pattern": bool(config.get("alpha_pattern"))}
    for name, is_set in refused.items():
        if is_set:
            raise ValueError(f"{what}: {name}={config[name]!r} is not supported")
    targets = config.get("target_modules") or []
    if isinstance(targets, list):  # a string is a regex (or "all-linear"): the tensors tell
        other = [t for t in targets if t not in TARGET_MODULES]
        if other:
            raise ValueError(f"{what}: target_modules {other} are not supported (only {list(TARGET_MODULES)})")
    return rank


def read_adapter_config(path: Path) -> dict:
    """The adapter directory's adapter_config.json; ValueError naming the file when it cannot be
    read or is not a JSON object."""
    config_path = path / CONFIG_NAME
    try:
        config = json.loads(config_path.read_text())
    except OSError as e:
        raise ValueError(f"{config_path} cannot be read: {e.strerror or e}") from None
    except json.JSONDecodeError as e:
        raise ValueError(f"{config_path} is not valid JSON: {e.msg} (line {e.lineno})") from None
    if not isinstance(config, dict):
        raise ValueError(f"{config_path} is not a JSON object")
    return config


def safetensors_shapes(path: Path) -> dict[str, list[int]]:
    """Tensor name -> shape, from the file's header alone (8-byte length, then JSON); ValueError
    naming the file when it cannot be read or its header does not parse."""
    try:
        with open(path, "rb") as f:
            (size,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(size))
    except OSError as e:
        raise ValueError(f"{path} cannot be read: {e.strerror or e}") from None
    except (struct.error, ValueError):  # too short, or a header that is not JSON
        raise ValueError(f"{path} is not a safetensors file") from None
    header.pop("__metadata__", None)
    return {name: entry["shape"] for name, entry in header.items()}


def _targets(shapes: dict[str, list[int]], rank: int, model_config: ModelConfig, what: str) -> tuple[LoRATarget, ...]:
    pairs: dict[tuple[int, str], dict[str, str]] = {}
    for key in shapes:
        m = _KEY.fullmatch(key)
        if m is None or m.group(2) not in TARGET_MODULES:
            raise ValueError(f"{what}: tensor {key!r} adapts a module the engine does not support "
                             f"(only {list(TARGET_MODULES)} of the decoder layers)")
        layer, module, ab = int(m.group(1)), m.group(2), m.group(3)
        if layer >= model_config.num_hidden_layers:
            raise ValueError(f"{what}: tensor {key!r} names layer {layer}, but the model has "
                             f"{model_config.num_hidden_layers}")
        pairs.setdefault((layer, module), {})[ab] = key
    targets = []
    for (layer, module), keys in sorted(pairs.items()):
        if set(keys) != {"A", "B"}:
            raise ValueError(f"{what}: layer {layer} {module} has lora_{''.join(keys)} but not both lora_A and lora_B")
        in_size, out_size = _module_shape(module, model_config)
        for key, expected in ((keys["A"], [rank, in_size]), (keys["B"], [out_size, rank])):
            if list(shapes[key]) != expected:
                raise ValueError(f"{what}: tensor {key!r} has shape {shapes[key]}, expected {expected} "
                                 f"(an adapter of another base model?)")
        ours, shard_id = TARGET_MODULES[module]
        targets.append(LoRATarget(f"model.layers.{layer}.{ours}", shard_id, keys["A"], keys["B"]))
    if not targets:
        raise ValueError(f"{what}: {WEIGHTS_NAME} holds no lora_A / lora_B tensors")
    return tuple(targets)


def _module_shape(module: str, c: ModelConfig) -> tuple[int, int]:
    """(in_features, out_features) of one HF projection of the base model."""
    q, kv = c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim
    return {"q_proj": (c.hidden_size, q), "k_proj": (c.hidden_size, kv), "v_proj": (c.hidden_size, kv),
            "o_proj": (q, c.hidden_size), "gate_proj": (c.hidden_size, c.intermediate_size),
            "up_proj": (c.hidden_size, c.intermediate_size),
            "down_proj": (c.intermediate_size, c.hidden_size)}[module]
