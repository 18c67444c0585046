"""Checkpoint location and weight loading (safetensors only, memory-mapped).

The loader maps HF tensor names onto our parameters and hands each tensor to the
parameter's own `weight_loader`, which cuts out this TP rank's slice; the loader
itself knows nothing about sharding. Pickle-based `.bin` checkpoints are refused:
loading them runs arbitrary code.
"""
from __future__ import annotations

import json
import re
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

from engine.layers.linear import copy_weight

_INDEX_FILE = "model.safetensors.index.json"
# Checkpoint tensors we recompute rather than load, or that only an fp8 KV cache reads
# (engine/loader/kv_scales.py).
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq", "self_attn.k_scale", "self_attn.v_scale", "self_attn.kv_scale")
# One expert's projection in a MoE layer: `...mlp.experts.3.gate_proj.weight`.
_EXPERT_TENSOR = re.compile(r"\.experts\.(?P<expert>\d+)\.(?P<proj>\w+)\.weight$")


def default_weight_loader(param: nn.Parameter, loaded_weight: torch.Tensor, shard_id=None) -> None:
    """For parameters every rank holds whole (norm weights)."""
    copy_weight(param.data, loaded_weight)


def safetensors_files(path: Path) -> list[Path]:
    """The checkpoint's .safetensors files, from the shard index when there is one."""
    index = path / _INDEX_FILE
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        files = [path / name for name in sorted(set(weight_map.values()))]
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise ValueError(f"{index} lists shard files that do not exist: {missing}")
        return files
    files = sorted(path.glob("*.safetensors"))
    if files:
        return files
    if any(path.glob("*.bin")) or any(path.glob("*.pt")) or any(path.glob("*.pth")):
        raise ValueError(f"{path} has only PyTorch pickle weights (.bin/.pt); only safetensors are supported "
                         "(convert with transformers: model.save_pretrained(dir, safe_serialization=True))")
    raise ValueError(f"no *.safetensors weights in {path}")


def _target(model: nn.Module, name: str) -> tuple[str, object]:
    """HF tensor name -> (our parameter name, shard id or None).

    A MoE model's `expert_params_mapping` (checkpoint projection -> (our stacked parameter,
    part)) sends `X.experts.{e}.{proj}.weight` to `X.experts.{param}` with shard id (e, part).
    A `packed_modules_mapping` entry with shard id None only renames the module."""
    shard = None
    expert = _EXPERT_TENSOR.search(name)
    if expert and expert["proj"] in getattr(model, "expert_params_mapping", {}):
        param, part = model.expert_params_mapping[expert["proj"]]
        name, shard = f"{name[:expert.start()]}.experts.{param}", (int(expert["expert"]), part)
    for ckpt_module, (our_module, shard_id) in getattr(model, "packed_modules_mapping", {}).items():
        if f".{ckpt_module}." in name:
            return name.replace(f".{ckpt_module}.", f".{our_module}."), shard if shard_id is None else shard_id
    return name, shard


def _expected_checkpoint_names(model: nn.Module, params: dict[str, nn.Parameter]) -> set[str]:
    """Every HF tensor name the model needs: fused parameters expand to their parts, stacked
    experts to one tensor per expert."""
    expected = set(params)
    for proj, (our_param, _) in getattr(model, "expert_params_mapping", {}).items():
        for name, param in params.items():
            if name.endswith(f".experts.{our_param}"):
                expected.discard(name)
                prefix = name[: -len(our_param)]
                expected.update(f"{prefix}{e}.{proj}.weight" for e in range(param.shape[0]))
    ours = sorted(expected)
    for ckpt_module, (our_module, _) in getattr(model, "packed_modules_mapping", {}).items():
        for name in ours:
            if f".{our_module}." in name:
                expected.discard(name)
                expected.add(name.replace(f".{our_module}.", f".{ckpt_module}."))
    return expected


def load_weights(model: nn.Module, path: str | Path) -> None:
    """Load every tensor of the checkpoint at `path` into `model`'s parameters (cast to their dtype).
    Raises ValueError naming missing or unexpected tensors."""
    path = Path(path)
    tied = bool(getattr(getattr(model, "config", None), "tie_word_embeddings", False))

    def tensors():
        for file in safetensors_files(path):
            with safe_open(file, framework="pt", device="cpu") as f:  # memory-mapped
                for name in f.keys():
                    if not (name.endswith(_IGNORED_SUFFIXES) or (tied and name == "lm_head.weight")):
                        yield name, name, lambda f=f, name=name: f.get_tensor(name)

    # A model may rewrite the stream first (gpt-oss: MXFP4 pairs dequantized, its expert layout, renames).
    remap = getattr(model, "checkpoint_tensors", None)
    load_named_tensors(model, tensors() if remap is None else remap(tensors()), f"checkpoint {path}", "weights")


def load_named_tensors(model: nn.Module, tensors, source: str, kind: str) -> None:
    """Each (name in the file, HF name or None, tensor thunk) into the parameter the HF name maps to,
    through that parameter's weight_loader; the thunk runs only for a tensor that is loaded.
    Raises ValueError naming missing weights and the file's unexpected `kind` (file names)."""
    params = dict(model.named_parameters())  # tied weights appear once, under the embedding's name
    seen, unexpected, whole = set(), [], set()  # whole: parameters loaded from one tensor (shard id None)
    for file_name, name, tensor in tensors:
        param_name, shard_id = _target(model, name) if name else (None, None)
        param = params.get(param_name)
        if param is None:
            unexpected.append(file_name)
            continue
        try:
            weight_loader = getattr(param, "weight_loader", default_weight_loader)
            weight_loader(param, tensor(), shard_id)
        except ValueError as e:
            label = file_name if file_name == name else f"{file_name} ({name})"
            raise ValueError(f"cannot load {label!r} from {source}: {e}") from e
        seen.add(name)
        if shard_id is None:
            whole.add(param_name)
    # A part is not missing when its parameter came whole (e.g. transformers 5's fused experts).
    missing = sorted(n for n in _expected_checkpoint_names(model, params) - seen if _target(model, n)[0] not in whole)
    if missing or unexpected:
        raise ValueError(f"{source} does not match the model: missing weights {missing[:20]}"
                         f"{' ...' if len(missing) > 20 else ''}; unexpected {kind} {sorted(unexpected)[:20]}"
                         f"{' ...' if len(unexpected) > 20 else ''}")
    for module in model.modules():  # what a layer derives from its weights once all are in (packed experts)
        if hasattr(module, "process_weights_after_loading"):
            module.process_weights_after_loading()
