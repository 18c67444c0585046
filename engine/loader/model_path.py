"""Where a model's files are: a local directory, a GGUF file, or a hub id (local HF cache, else downloaded).

Torch-free on purpose: the HTTP tier (Ingress) resolves the tokenizer's directory with
this and must not need torch; the weight loader (engine.loader.weights) is the torch side.

A hub id that is not in the local cache is downloaded with `huggingface_hub` (as vLLM does),
unless HF_HUB_OFFLINE (or TRANSFORMERS_OFFLINE) is set; a failure says which of the two
stopped it: offline mode, or a Hub that cannot be reached (or has no such model).
"""
from __future__ import annotations

import logging
import os
from pathlib import Path

from huggingface_hub import constants as hf_constants
from huggingface_hub import snapshot_download
from huggingface_hub.errors import (GatedRepoError, HfHubHTTPError, HFValidationError, LocalEntryNotFoundError,
                                   RepositoryNotFoundError)

from engine.loader.gguf_config import find_gguf, hf_view

logger = logging.getLogger(__name__)

# What a served checkpoint needs from a hub repository: config and tokenizer files, safetensors
# weights (the only format the loader reads), the chat template. Not the repos' duplicate copies
# of the weights for other tools (Mistral's consolidated.safetensors, Llama's original/).
HUB_ALLOW_PATTERNS = ["*.json", "*.safetensors", "*.model", "*.tiktoken", "*.txt", "*.jinja"]
HUB_IGNORE_PATTERNS = ["consolidated*.safetensors", "original/*"]


def resolve_model_path(model: str) -> Path:
    """A local HF checkpoint directory as is; a .gguf file (or a directory holding one .gguf)
    as its HF-format view (engine.loader.gguf_config); otherwise a hub id, from the local HF
    cache or downloaded into it. ValueError, naming `model`, when none of these works."""
    path = Path(model).expanduser()
    gguf_file = find_gguf(path)
    if gguf_file is not None:
        return hf_view(gguf_file)
    if path.is_dir():
        return path
    missing = f"model {model!r} is not a local directory and not in the Hugging Face cache, nor a .gguf file"
    try:
        return Path(snapshot_download(str(model), local_files_only=True))
    except HFValidationError:
        raise ValueError(f"{missing}; nor a Hub id (org/name), so this machine cannot download it either: "
                         f"check the path") from None
    except (LocalEntryNotFoundError, OSError):
        pass  # not cached: download it
    return _download(str(model), missing)


def hub_offline() -> bool:
    """HF_HUB_OFFLINE / TRANSFORMERS_OFFLINE, as set now (huggingface_hub reads them once, at import)."""
    return hf_constants.HF_HUB_OFFLINE or any(
        os.environ.get(name, "").upper() in ("1", "ON", "YES", "TRUE") for name in ("HF_HUB_OFFLINE",
                                                                                  "TRANSFORMERS_OFFLINE"))


def _download(repo_id: str, missing: str) -> Path:
    if hub_offline():
        raise ValueError(f"{missing}, and HF_HUB_OFFLINE is set, so this machine cannot download it: unset "
                         f"HF_HUB_OFFLINE, or copy the checkpoint here (or pre-fill the cache)")
    logger.info("downloading %s from the Hugging Face Hub", repo_id)
    try:
        return Path(snapshot_download(repo_id, allow_patterns=HUB_ALLOW_PATTERNS,
                                      ignore_patterns=HUB_IGNORE_PATTERNS))
    except (RepositoryNotFoundError, GatedRepoError) as e:
        raise ValueError(f"{missing}, and the Hugging Face Hub has no such model this machine may read, so it "
                         f"cannot download it ({type(e).__name__}): check the id, or log in (`hf auth login`, "
                         f"HF_TOKEN) for a gated or private model") from None
    except HfHubHTTPError as e:  # the Hub answered, with an error (5xx, rate limit)
        raise ValueError(f"{missing}, and the Hugging Face Hub refused the download, so this machine cannot "
                         f"download it now ({type(e).__name__}: {e}): retry later") from None
    except Exception as e:  # noqa: BLE001 - LocalEntryNotFoundError (no connection), timeouts, proxies
        raise ValueError(f"{missing}, and the Hugging Face Hub is not reachable from this machine, so it cannot "
                         f"download it ({type(e).__name__}): copy the checkpoint here (or pre-fill the cache), "
                         f"or set HF_ENDPOINT to a reachable mirror") from None
