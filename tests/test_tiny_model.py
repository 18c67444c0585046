"""engine.tools.tiny_model: random checkpoints that HF transformers loads, built deterministically.

Uses the session fixtures tiny_llama / tiny_qwen2 / tiny_qwen3 from conftest
(shared with the engine tests) and builds mistral and the odd variants here.
"""
import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from transformers import AutoModelForCausalLM, AutoTokenizer

from engine.tools.tiny_model import main, make_tiny_model

ARCHS = ["llama", "mistral", "qwen2", "qwen3"]
CLASSES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM",
           "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}
TEXT = 'Hello wörld! café, naïve, 日本語, emoji 🙂\n    def f(x): return {"a": [1, 2]}'
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi 🙂"}]


@pytest.fixture(scope="module")
def tiny_mistral(tmp_path_factory):
    return str(make_tiny_model(tmp_path_factory.mktemp("tiny-mistral"), arch="mistral"))


@pytest.fixture
def built(request):
    """Path of the tiny checkpoint for the test's `arch` parameter."""
    return Path(request.getfixturevalue(f"tiny_{request.node.callspec.params['arch']}"))


def _json(path: Path, name: str) -> dict:
    return json.loads((path / name).read_text())


def _tensor_names(path: Path) -> set[str]:
    names = set()
    for f in path.glob("*.safetensors"):
        with safe_open(f, "pt") as st:
            names.update(st.keys())
    return names


@pytest.mark.parametrize("arch", ARCHS)
def test_loads_with_hf_and_ids_agree(built, arch):
    cfg, gen = _json(built, "config.json"), _json(built, "generation_config.json")
    model = AutoModelForCausalLM.from_pretrained(built)
    tok = AutoTokenizer.from_pretrained(built)
    assert type(model).__name__ == cfg["architectures"][0] == CLASSES[arch]
    assert len(tok) <= cfg["vocab_size"] and cfg["vocab_size"] % 64 == 0
    # One source of truth for special ids across the three files.
    for role in ("bos", "eos", "pad"):
        tok_id = getattr(tok, f"{role}_token_id")
        assert cfg[f"{role}_token_id"] == gen.get(f"{role}_token_id") == tok_id
    assert cfg["eos_token_id"] is not None and cfg["pad_token_id"] is not None
    ids = torch.tensor([tok.encode(TEXT)])
    logits = model(ids).logits
    assert logits.shape == (1, ids.shape[1], cfg["vocab_size"]) and logits.isfinite().all()


@pytest.mark.parametrize("arch", ARCHS)
def test_tokenizer_round_trips_multibyte_text(built, arch):
    tok = AutoTokenizer.from_pretrained(built)
    ids = tok.encode(TEXT)
    assert tok.decode(ids, skip_special_tokens=True) == TEXT
    # Llama prepends bos on encode; Qwen adds nothing.
    assert (ids[0] == tok.bos_token_id) == (arch in ("llama", "mistral"))
    assert ids.count(tok.bos_token_id) <= 1
    # The vocab is small, so some multi-byte character spans several tokens.
    pieces = [tok.decode([i]) for i in tok.encode("日本語 🙂", add_special_tokens=False)]
    assert any("\ufffd" in p for p in pieces)


@pytest.mark.parametrize("arch", ARCHS)
def test_chat_template_renders(built, arch):
    tok = AutoTokenizer.from_pretrained(built)
    assert _json(built, "tokenizer_config.json")["chat_template"] == tok.chat_template
    text = tok.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=False)
    bare = tok.apply_chat_template(MESSAGES, add_generation_prompt=False, tokenize=False)
    assert "Be brief." in text and "Hi 🙂" in text and text.startswith(bare) and text != bare
    ids = tok(text, add_special_tokens=False)["input_ids"]
    if arch.startswith("qwen"):
        assert text.endswith("<|im_start|>assistant\n")
        assert ids.count(tok.convert_tokens_to_ids("<|im_start|>")) == 3  # special, not split
    else:
        assert ids[0] == tok.bos_token_id and ids.count(tok.bos_token_id) == 1
    assert ids.count(tok.eos_token_id) == 2


def test_arch_specific_shapes(tiny_llama, tiny_mistral, tiny_qwen2, tiny_qwen3):
    q3 = _json(Path(tiny_qwen3), "config.json")
    assert q3["head_dim"] == 32 != q3["hidden_size"] // q3["num_attention_heads"]
    assert "model.layers.0.self_attn.q_norm.weight" in _tensor_names(Path(tiny_qwen3))
    q2 = _json(Path(tiny_qwen2), "config.json")
    assert q2["num_key_value_heads"] == 1
    assert "model.layers.0.self_attn.k_proj.bias" in _tensor_names(Path(tiny_qwen2))
    assert _json(Path(tiny_mistral), "config.json")["sliding_window"] is None
    for path, tied in [(tiny_llama, False), (tiny_mistral, False), (tiny_qwen2, True), (tiny_qwen3, True)]:
        cfg = _json(Path(path), "config.json")
        assert cfg["tie_word_embeddings"] is tied
        assert ("lm_head.weight" in _tensor_names(Path(path))) is not tied
        assert cfg["rope_theta"] == 10000.0 and cfg["rms_norm_eps"] == 1e-6


def test_sharded_checkpoint_matches_single_file(tiny_llama, tmp_path):
    path = make_tiny_model(tmp_path, arch="llama", max_shard_size="200KB")
    index = _json(path, "model.safetensors.index.json")
    shards = sorted(p.name for p in path.glob("model-*-of-*.safetensors"))
    assert len(shards) > 1 and sorted(set(index["weight_map"].values())) == shards
    assert not (path / "model.safetensors").exists()
    ids = torch.tensor([[1, 5, 9, 200, 7]])
    sharded = AutoModelForCausalLM.from_pretrained(path)(ids).logits
    single = AutoModelForCausalLM.from_pretrained(tiny_llama)(ids).logits
    torch.testing.assert_close(sharded, single, rtol=0, atol=0)  # same seed, same weights


def test_build_is_deterministic(tiny_qwen2, tmp_path):
    again = make_tiny_model(tmp_path / "again", arch="qwen2")
    names = sorted(p.name for p in Path(tiny_qwen2).iterdir())
    assert names == sorted(p.name for p in again.iterdir())
    for name in names:
        assert (again / name).read_bytes() == (Path(tiny_qwen2) / name).read_bytes(), name
    other = make_tiny_model(tmp_path / "seed1", arch="qwen2", seed=1)
    assert (other / "model.safetensors").read_bytes() != (again / "model.safetensors").read_bytes()
    assert (other / "tokenizer.json").read_bytes() == (again / "tokenizer.json").read_bytes()


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_greedy_decoding_is_diverse_and_unambiguous(built, arch):
    """Engine-vs-HF token comparisons need clear argmaxes and non-trivial output."""
    model = AutoModelForCausalLM.from_pretrained(built).eval()
    vocab = len(AutoTokenizer.from_pretrained(built))
    ids = torch.randint(3, vocab, (4, 16), generator=torch.Generator().manual_seed(0))
    gaps = []
    with torch.no_grad():
        for _ in range(16):
            logits = model(ids).logits[:, -1]
            top2 = logits.topk(2).values
            gaps.append(top2[:, 0] - top2[:, 1])
            ids = torch.cat([ids, logits.argmax(-1, keepdim=True)], dim=1)
    generated = ids[:, 16:]
    assert (torch.cat(gaps) < 1e-3).float().mean() <= 0.05
    assert len(set(generated.flatten().tolist())) >= 16


def test_shape_preset_writes_bf16_shards_directly(tmp_path):
    # Full qwen3-0.6b is too big for a unit test; shrink it but keep its code path.
    small = dict(num_hidden_layers=2, hidden_size=64, intermediate_size=128, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=32, vocab_size=4096)
    path = make_tiny_model(tmp_path, preset="qwen3-0.6b", max_shard_size="200KB", **small)
    assert len(_json(path, "model.safetensors.index.json")["weight_map"]) == len(_tensor_names(path))
    model = AutoModelForCausalLM.from_pretrained(path)
    assert type(model).__name__ == "Qwen3ForCausalLM" and model.dtype == torch.bfloat16
    assert "lm_head.weight" not in _tensor_names(path)  # tied, as in the real model
    assert len(AutoTokenizer.from_pretrained(path)) < 4096  # padded model vocab
    assert model(torch.tensor([[3, 4, 5]])).logits.isfinite().all()


def test_rejects_unknown_preset_and_mismatched_arch(tmp_path):
    with pytest.raises(ValueError):
        make_tiny_model(tmp_path, preset="huge")
    with pytest.raises(ValueError):
        make_tiny_model(tmp_path, arch="llama", preset="qwen3-0.6b")
    with pytest.raises(ValueError):
        make_tiny_model(tmp_path, vocab_size=64)  # smaller than the tokenizer


def test_cli_prints_path_and_summary(tmp_path, capsys):
    main(["--out", str(tmp_path / "m"), "--arch", "qwen3", "--max-shard-size", "300KB"])
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines[0] == str(tmp_path / "m")
    assert "Qwen3ForCausalLM" in lines[1] and "params" in lines[1] and "vocab 1024" in lines[1]
    assert (tmp_path / "m" / "model.safetensors.index.json").exists()
