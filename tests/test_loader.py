"""Checkpoint resolution and weight loading: sharded files, and clear errors for bad checkpoints."""
import json
import shutil

import huggingface_hub.constants
import pytest
import torch
from safetensors.torch import load_file, save_file

from engine.config import ModelConfig
from engine.loader.weights import load_weights
from engine.loader.model_path import resolve_model_path
from engine.models import get_model_class
from test_models import build_hf_checkpoint, load_our_model


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("llama")
    build_hf_checkpoint("llama", path)
    return path


def _copy_with_tensors(src, dst, edit) -> None:
    """Copy a single-file checkpoint to `dst`, passing its tensors through `edit(dict)`."""
    shutil.copytree(src, dst)
    tensors = load_file(dst / "model.safetensors")
    edit(tensors)
    save_file(tensors, dst / "model.safetensors", metadata={"format": "pt"})


def test_sharded_checkpoint_loads_every_tensor(tmp_path):
    hf = build_hf_checkpoint("qwen2", tmp_path, max_shard_size="40KB")
    assert (tmp_path / "model.safetensors.index.json").is_file()
    assert len(list(tmp_path.glob("*.safetensors"))) > 2
    ours = dict(load_our_model(tmp_path).named_parameters())
    ref = hf.state_dict()
    attn, mlp = "model.layers.1.self_attn.", "model.layers.1.mlp."
    qkv_bias = torch.cat([ref[attn + f"{p}_proj.bias"] for p in "qkv"])
    torch.testing.assert_close(ours[attn + "qkv_proj.bias"], qkv_bias, atol=0, rtol=0)
    gate_up = torch.cat([ref[mlp + "gate_proj.weight"], ref[mlp + "up_proj.weight"]])
    torch.testing.assert_close(ours[mlp + "gate_up_proj.weight"], gate_up, atol=0, rtol=0)
    torch.testing.assert_close(ours["model.norm.weight"], ref["model.norm.weight"], atol=0, rtol=0)
    assert "lm_head.weight" not in ours  # tied: the embedding serves as the head


def test_missing_tensor_is_named(llama_dir, tmp_path):
    name = "model.layers.1.self_attn.k_proj.weight"
    _copy_with_tensors(llama_dir, tmp_path / "ckpt", lambda t: t.pop(name))
    with pytest.raises(ValueError, match=f"missing weights.*{name}"):
        load_our_model(tmp_path / "ckpt")


def test_unexpected_tensor_is_named(llama_dir, tmp_path):
    name = "model.layers.0.mlp.extra_proj.weight"
    _copy_with_tensors(llama_dir, tmp_path / "ckpt", lambda t: t.update({name: torch.zeros(2, 2)}))
    with pytest.raises(ValueError, match=f"unexpected weights.*{name}"):
        load_our_model(tmp_path / "ckpt")


def test_wrong_shape_is_refused(llama_dir, tmp_path):
    name = "model.layers.0.post_attention_layernorm.weight"
    _copy_with_tensors(llama_dir, tmp_path / "ckpt", lambda t: t.update({name: torch.ones(1)}))
    with pytest.raises(ValueError, match=f"{name}.*shape"):
        load_our_model(tmp_path / "ckpt")


def test_bin_only_checkpoint_is_refused(llama_dir, tmp_path):
    shutil.copy(llama_dir / "config.json", tmp_path / "config.json")
    (tmp_path / "pytorch_model.bin").write_bytes(b"not loaded")
    model = get_model_class("LlamaForCausalLM")(ModelConfig.from_pretrained(tmp_path))
    with pytest.raises(ValueError, match="only safetensors"):
        load_weights(model, tmp_path)


def test_local_directory_resolves_to_itself(llama_dir):
    assert resolve_model_path(str(llama_dir)) == llama_dir


def test_hub_id_resolves_from_local_cache_only(llama_dir, tmp_path, monkeypatch):
    # The HF cache layout: models--org--name/{refs/main, snapshots/<commit>/...}
    repo = tmp_path / "models--tiny-org--tiny-llama"
    shutil.copytree(llama_dir, repo / "snapshots" / ("a" * 40))
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("a" * 40)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path))
    path = resolve_model_path("tiny-org/tiny-llama")
    assert json.loads((path / "config.json").read_text())["architectures"] == ["LlamaForCausalLM"]


@pytest.mark.parametrize("model", ["no-such-org/no-such-model", "/no/such/dir"])
def test_unknown_model_gives_clear_error(model, tmp_path, monkeypatch):
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path))
    with pytest.raises(ValueError, match="not a local directory and not in the Hugging Face cache.*cannot download"):
        resolve_model_path(model)


def test_unsupported_architecture():
    with pytest.raises(ValueError, match="'GPT2LMHeadModel' is not supported"):
        get_model_class("GPT2LMHeadModel")
    with pytest.raises(ValueError, match="not supported"):
        ModelConfig.from_hf_dict({"architectures": ["GPT2LMHeadModel"], "num_attention_heads": 4})
