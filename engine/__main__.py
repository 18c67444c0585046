"""`python -m engine`: what this install is and what it can run (what `vllm --version` and
`collect_env` answer): the version, the device the engine would pick (`device: auto`), and the
supported architectures (engine/models/__init__.py's registry)."""
from __future__ import annotations

import os
import platform
from importlib import metadata

from engine.models import SUPPORTED_ARCHITECTURES

DISTRIBUTION = "rayllm-serve"  # pyproject.toml [project] name


def version() -> str:
    try:
        return metadata.version(DISTRIBUTION)
    except metadata.PackageNotFoundError:
        return "unknown (not installed: pip install .)"


def device_line() -> str:
    """The device `device: auto` resolves to here, and what it has."""
    import torch

    if torch.cuda.is_available():
        names = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
        return f"cuda: {len(names)} GPU(s): {', '.join(names)} (CUDA {torch.version.cuda})"
    return f"cpu: {len(os.sched_getaffinity(0))} cores usable (no CUDA GPU found)"


def main() -> None:
    import torch

    print(f"rayllm-serve {version()} (Python {platform.python_version()}, torch {torch.__version__})")
    print(f"device: {device_line()}")
    print(f"architectures: {', '.join(SUPPORTED_ARCHITECTURES)} (HF checkpoints, or GGUF files of these families)")


if __name__ == "__main__":
    main()
