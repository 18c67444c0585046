"""Where a model's files are: a local directory, or a hub id in the local Hugging Face cache.

Torch-free on purpose: the HTTP tier (Ingress) resolves the tokenizer's directory with
this and must not need torch; the weight loader (engine.loader) is the torch side.
"""
from __future__ import annotations

from pathlib import Path

from huggingface_hub import snapshot_download
from huggingface_hub.errors import HFValidationError, LocalEntryNotFoundError


def resolve_model_path(model: str) -> Path:
    """A local directory as is; otherwise a hub id looked up in the local HF cache only."""
    path = Path(model).expanduser()
    if path.is_dir():
        return path
    try:
        return Path(snapshot_download(str(model), local_files_only=True))
    except (LocalEntryNotFoundError, HFValidationError, OSError) as e:
        raise ValueError(f"model {model!r} is not a local directory and not in the Hugging Face cache "
                         f"(this machine cannot download; copy the checkpoint here or pre-fill the cache): "
                         f"{type(e).__name__}") from e
