"""LoRA adapters as the app names them: `name=path` entries, the adapter directory's files, the
allowed directory of runtime loads. No torch, no Ray: the args, the Ingress and the batch CLI use it.

    lora_modules      {"sql": "/adapters/sql"}, from any of the forms vLLM's --lora-modules takes
    check_adapter_dir the files a PEFT adapter needs, each named when it is missing or unreadable
    resolve_under     a path with symlinks and `..` resolved, refused outside the allowed directory

What the engine checks on top (ranks, target modules, shapes against the base model) is
engine/lora/peft_adapter.py's, run where a ModelConfig is at hand (`check_adapter`).
"""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

from engine.lora.peft_adapter import WEIGHTS_NAME, read_adapter_config, safetensors_shapes

if TYPE_CHECKING:
    from engine.config.model import ModelConfig
    from engine.lora.request import LoRARequest


def parse_lora_modules(value: Any, what: str = "lora_modules") -> dict[str, str]:
    """Adapter name -> path, in the order given, from any of:

        {"sql": "/a/sql", "chat": "/a/chat"}                   a mapping (a Serve config's args)
        ["sql=/a/sql", "chat=/a/chat"]                         vLLM's `--lora-modules sql=/a/sql ...`
        [{"name": "sql", "path": "/a/sql"}]                    vLLM's JSON form, one object per adapter
        "sql=/a/sql chat=/a/chat" or a JSON text of the above  `serve run ... lora_modules=...`

    A malformed entry is a ValueError naming it (and `what`: the arg or flag it came from)."""
    if value is None:
        return {}
    if isinstance(value, str):
        text = value.strip()
        if text.startswith(("{", "[")):
            try:
                value = json.loads(text)
            except json.JSONDecodeError as e:
                raise ValueError(f"{what}={value!r} is not valid JSON: {e.msg}") from None
        else:
            value = text.split()
    if isinstance(value, dict):
        entries = [_entry(value, what)] if _is_module_object(value) else list(value.items())
    elif isinstance(value, (list, tuple)):
        entries = [_entry(item, what) for item in value]
    else:
        raise ValueError(f"{what}={value!r} is invalid: give name=path entries or a name -> path mapping")
    modules: dict[str, str] = {}
    for name, path in entries:
        if not isinstance(name, str) or not name or "=" in name:
            raise ValueError(f"{what}: adapter name {name!r} is invalid: a non-empty string without '='")
        if not isinstance(path, str) or not path:
            raise ValueError(f"{what}: adapter {name!r} has no path (got {path!r})")
        if name in modules:
            raise ValueError(f"{what}: adapter {name!r} is given twice")
        modules[name] = path
    return modules


def _entry(item: Any, what: str) -> tuple[Any, Any]:
    """One list entry: `name=path`, a JSON object text, or an object with name and path."""
    if isinstance(item, str) and item.lstrip().startswith("{"):
        try:
            item = json.loads(item)
        except json.JSONDecodeError as e:
            raise ValueError(f"{what} entry {item!r} is not valid JSON: {e.msg}") from None
    if isinstance(item, str):
        name, sep, path = item.partition("=")
        if not sep:
            raise ValueError(f"{what} entry {item!r} is invalid: expected name=path")
        return name.strip(), path.strip()
    if isinstance(item, dict):
        if not _is_module_object(item):
            raise ValueError(f"{what} entry {item!r} is invalid: expected {{\"name\": ..., \"path\": ...}}")
        return item["name"], item["path"]
    raise ValueError(f"{what} entry {item!r} is invalid: expected name=path")


def _is_module_object(d: dict) -> bool:
    """vLLM's JSON form of one adapter: {"name": ..., "path": ...} (base_model_name is ignored: one base)."""
    return "name" in d and "path" in d and set(d) <= {"name", "path", "base_model_name"}


def check_adapter_dir(path: str) -> None:
    """ValueError naming the file, unless `path` is a directory with a readable adapter_config.json
    (a JSON object) and an adapter_model.safetensors whose header reads."""
    directory = Path(path)
    if not directory.is_dir():
        raise ValueError(f"{path} is not a directory")
    read_adapter_config(directory)
    safetensors_shapes(directory / WEIGHTS_NAME)


def check_adapter(lora: LoRARequest, max_lora_rank: int, model_config: ModelConfig) -> None:
    """The directory's files, then everything the engine checks when a request names the adapter."""
    from engine.lora.peft_adapter import read_peft_adapter

    check_adapter_dir(lora.lora_path)
    read_peft_adapter(lora, max_lora_rank, model_config)


def check_lora_modules(modules: dict[str, str], max_lora_rank: int, model_config: ModelConfig,
                       what: str = "lora_modules") -> None:
    """check_adapter for each adapter of `modules` (ids 1..N, as LoRARegistry gives them); a failure names
    the adapter and `what` (the arg or flag)."""
    from engine.lora.request import LoRARequest

    for i, (name, path) in enumerate(modules.items(), 1):
        try:
            check_adapter(LoRARequest(name, i, path), max_lora_rank, model_config)
        except ValueError as e:
            raise ValueError(f"{what}: adapter {name!r}: {e}") from None


def resolve_under(path: str, allowed_dir: str) -> str:
    """`path` (relative ones: to `allowed_dir`) with symlinks and `..` resolved; ValueError if that
    lies outside `allowed_dir` (itself resolved the same way)."""
    root = os.path.realpath(allowed_dir)
    real = os.path.realpath(os.path.join(root, os.path.expanduser(path)))
    if os.path.commonpath([root, real]) != root:
        raise ValueError(f"lora_path {path!r} is outside the directory adapters may be loaded from "
                         f"(app arg lora_adapter_dir)")
    return real
