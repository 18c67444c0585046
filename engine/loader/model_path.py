"""Where a model's files are: a local directory, a GGUF file, or a hub id in the local Hugging Face cache.

Torch-free on purpose: the HTTP tier (Ingress) resolves the tokenizer's directory with
this and must not need torch; the weight loader (engine.loader.weights) is the torch side.
"""
from __future__ import annotations

from pathlib import Path

from huggingface_hub import snapshot_download
from huggingface_hub.errors import HFValidationError, LocalEntryNotFoundError

from engine.loader.gguf_config import find_gguf, hf_view


def resolve_model_path(model: str) -> Path:
    """A local HF checkpoint directory as is; a .gguf file (or a directory holding one .gguf)
    as its HF-format view (engine.loader.gguf_config); otherwise a hub id looked up in the local HF cache only."""
    path = Path(model).expanduser()
    gguf_file = find_gguf(path)
    if gguf_file is not None:
        return hf_view(gguf_file)
    if path.is_dir():
        return path
    try:
        return Path(snapshot_download(str(model), local_files_only=True))
    except (LocalEntryNotFoundError, HFValidationError, OSError) as e:
        raise ValueError(f"model {model!r} is not a local directory and not in the Hugging Face cache, nor a .gguf "
                         f"file (this machine cannot download; copy the checkpoint here or pre-fill the cache): "
                         f"{type(e).__name__}") from e
