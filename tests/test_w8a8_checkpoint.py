"""engine/tools/w8a8_checkpoint.py: the projections int8 per channel with their scales, everything
else as it was, a sharded checkpoint's index kept whole, what it refuses (named)."""
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from engine.config import ModelConfig
from engine.tools.tiny_model import make_tiny_model
from engine.tools.w8a8_checkpoint import QUANTIZATION_CONFIG, main, write_w8a8_checkpoint

PROJ = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def test_projections_int8_the_rest_as_it_was(tiny_llama, tmp_path):
    dst = write_w8a8_checkpoint(tiny_llama, tmp_path / "w8a8")
    src, out = load_file(f"{tiny_llama}/model.safetensors"), load_file(f"{dst}/model.safetensors")
    projections = [n for n in src if n.endswith(".weight") and n.split(".")[-2] in PROJ]
    assert len(projections) == 7 * 2  # two layers
    for name, t in src.items():
        if name in projections:
            q, scale = out[name], out[name[: -len("weight")] + "weight_scale"]
            assert q.dtype == torch.int8 and scale.dtype == torch.float32 and scale.shape == (t.shape[0], 1)
            assert (q.float() * scale - t).abs().max() <= 0.5 * scale.max() * 1.001  # half a step
        else:
            assert torch.equal(out[name], t), name  # embedding, norms, LM head
    assert len(out) == len(src) + len(projections)
    assert ModelConfig.from_pretrained(str(dst)).hf_config["quantization_config"] == QUANTIZATION_CONFIG
    assert (dst / "tokenizer.json").read_bytes() == Path(tiny_llama, "tokenizer.json").read_bytes()


def test_a_sharded_checkpoint_keeps_its_index(tmp_path):
    src = make_tiny_model(tmp_path / "src", arch="llama", seed=0, max_shard_size="100KB")
    index = json.loads((src / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    main([str(src), str(tmp_path / "dst")])
    out = json.loads((tmp_path / "dst" / "model.safetensors.index.json").read_text())["weight_map"]
    for name, file in out.items():  # every tensor where the index says, scales beside their weights
        assert name in load_file(str(tmp_path / "dst" / file)), (name, file)
        if name.endswith("weight_scale"):
            assert out[name[: -len("_scale")]] == file


def _checkpoint(path, tensors):
    path.mkdir()
    (path / "config.json").write_text("{}")
    save_file(tensors, str(path / "model.safetensors"))
    return path


def test_refuses_what_it_cannot_write(tmp_path):
    with pytest.raises(ValueError, match=f"src='{tmp_path}' is not a Hugging Face checkpoint directory"):
        write_w8a8_checkpoint(tmp_path, tmp_path / "out")
    moe = _checkpoint(tmp_path / "moe", {"model.layers.0.mlp.experts.0.gate_proj.weight": torch.zeros(4, 4)})
    with pytest.raises(ValueError, match=r"model.layers.0.mlp.experts.0.gate_proj.weight: mixture-of-experts"):
        write_w8a8_checkpoint(moe, tmp_path / "out")
    plain = _checkpoint(tmp_path / "plain", {"model.embed_tokens.weight": torch.zeros(4, 4)})
    with pytest.raises(ValueError, match=r"has no `\*_proj.weight` tensors"):
        write_w8a8_checkpoint(plain, tmp_path / "out")
