"""Write an INT8 W8A8 checkpoint in llm-compressor's compressed-tensors format from a
full-precision Hugging Face one: every attention and MLP projection (`*_proj.weight` under
`.layers.`) int8 per output channel (symmetric, +-127: engine/layers/quantization/int8.py's
quantize_per_channel), activations quantized per token at run time; the embedding, the LM head
and the norms as they are.

    write_w8a8_checkpoint(src, dst) -> Path
    python -m engine.tools.w8a8_checkpoint SRC DST

The result is what llm-compressor's `W8A8` preset writes with SmoothQuant off (`weight` int8
[out, in], `weight_scale` float32 [out, 1], `quantization_config` naming the scheme), so the
engine loads it as any compressed-tensors checkpoint: `LLM(model=DST)`. config.json is written
last: a directory that has one is complete. Mixture-of-experts checkpoints are refused (the
engine runs no int8 experts).
"""
from __future__ import annotations

import argparse
import json
import re
import shutil
from pathlib import Path

from safetensors.torch import load_file, save_file

from engine.layers.quantization.int8 import quantize_per_channel

QUANTIZATION_CONFIG = {
    "quant_method": "compressed-tensors", "format": "int-quantized", "ignore": ["lm_head"],
    "config_groups": {"group_0": {
        "targets": ["Linear"],
        "weights": {"num_bits": 8, "type": "int", "strategy": "channel", "dynamic": False, "symmetric": True},
        "input_activations": {"num_bits": 8, "type": "int", "strategy": "token", "dynamic": True,
                              "symmetric": True}}}}
_LINEAR = re.compile(r"\.layers\.\d+\..*_proj\.weight$")
_INDEX = "model.safetensors.index.json"


def _quantize_file(path: Path, out: Path) -> dict[str, str]:
    """One safetensors file, its projections quantized; returns the scales' names -> the file."""
    tensors, added = {}, {}
    for name, t in load_file(str(path)).items():
        if ".experts." in name:
            raise ValueError(f"{name}: mixture-of-experts checkpoints are not supported (no int8 experts)")
        if not (_LINEAR.search(name) and t.dim() == 2):
            tensors[name] = t
            continue
        q, scale = quantize_per_channel(t)
        scale_name = name[: -len("weight")] + "weight_scale"
        tensors[name], tensors[scale_name] = q, scale[:, None].contiguous()
        added[scale_name] = out.name
    save_file(tensors, str(out), metadata={"format": "pt"})
    return added


def write_w8a8_checkpoint(src: str | Path, dst: str | Path) -> Path:
    """DST: SRC's files with its projections quantized (module docstring); returns DST."""
    src, dst = Path(src), Path(dst)
    files = sorted(src.glob("*.safetensors"))
    if not (src / "config.json").is_file() or not files:
        raise ValueError(f"src={str(src)!r} is not a Hugging Face checkpoint directory with safetensors files")
    dst.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        if f.is_file() and f.suffix != ".safetensors" and f.name not in ("config.json", _INDEX):
            shutil.copy2(f, dst / f.name)
    added = {}
    for f in files:
        added.update(_quantize_file(f, dst / f.name))
    if not added:
        raise ValueError(f"src={str(src)!r} has no `*_proj.weight` tensors under `.layers.` to quantize")
    if (src / _INDEX).is_file():
        index = json.loads((src / _INDEX).read_text())
        index["weight_map"].update(added)
        (dst / _INDEX).write_text(json.dumps(index, indent=2))
    config = json.loads((src / "config.json").read_text())
    config["quantization_config"] = QUANTIZATION_CONFIG
    (dst / "config.json").write_text(json.dumps(config, indent=2))
    return dst


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m engine.tools.w8a8_checkpoint", description=__doc__.splitlines()[0])
    ap.add_argument("src", help="a full-precision Hugging Face checkpoint directory")
    ap.add_argument("dst", help="where to write the W8A8 checkpoint")
    args = ap.parse_args(argv)
    print(write_w8a8_checkpoint(args.src, args.dst))


if __name__ == "__main__":
    main()
