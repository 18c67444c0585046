"""GGUF checkpoints: written here from tiny HF checkpoints (tests/gguf_writer.py), loaded by the engine,
and run token for token against HF transformers on the weights the file really holds."""
import json
import random
import shutil

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from safetensors.numpy import load_file
from transformers import AutoTokenizer

from engine import LLM, SamplingParams
from engine.config import ModelConfig
from engine.layers.rotary import get_rope
from engine.loader.gguf_config import SUPPORTED_TENSOR_TYPES, find_gguf, hf_view
from engine.loader.gguf_loader import dequantize_tensor, hf_name, load_gguf_weights, unpermute_rows
from engine.loader.model_path import resolve_model_path
from engine.tools.tiny_model import make_tiny_model
from tests.gguf_writer import llama_cpp_permute, save_as_hf, write_gguf
from tests.hf_reference import assert_matches, hf_greedy

MAX_TOKENS = 16


def _prompts(vocab_size: int, lens=(1, 7, 40, 130), seed=0):
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab_size) for _ in range(n)] for n in lens]


def _check_greedy(gguf_path, hf_path, lens=(1, 7, 40, 130)):
    llm = LLM(str(gguf_path), dtype="float32", device="cpu")
    prompts = _prompts(llm.llm_engine.model_config.vocab_size, lens)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True), use_tqdm=False)
    for p, out in zip(prompts, outs):
        assert_matches(out.outputs[0].token_ids, hf_greedy(str(hf_path), p, MAX_TOKENS), f"prompt of {len(p)}")


@pytest.mark.parametrize("arch", ["tiny_llama", "tiny_qwen2", "tiny_qwen3"])
def test_f32_gguf_equals_hf_checkpoint(arch, request, tmp_path):
    hf_path = request.getfixturevalue(arch)
    write_gguf(hf_path, tmp_path / "model.gguf", Q.F32)
    _check_greedy(tmp_path / "model.gguf", hf_path)


@pytest.mark.parametrize("qtype", [Q.Q8_0, Q.Q4_0], ids=lambda q: q.name)
@pytest.mark.parametrize("arch", ["tiny_llama", "tiny_qwen3"])
def test_quantized_gguf_equals_hf_on_dequantized_weights(arch, qtype, request, tmp_path):
    hf_path = request.getfixturevalue(arch)
    stored = write_gguf(hf_path, tmp_path / "model.gguf", qtype)
    reference = save_as_hf(hf_path, stored, tmp_path / "hf-dequantized")
    _check_greedy(tmp_path / "model.gguf", reference)
    if qtype == Q.Q4_0:  # the quantization must really have changed the model
        original = LLM(hf_path, dtype="float32", device="cpu")
        ids = {"prompt_token_ids": _prompts(original.llm_engine.model_config.vocab_size)[2]}
        params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
        ours = LLM(str(tmp_path / "model.gguf"), dtype="float32", device="cpu")
        assert (original.generate([ids], params, use_tqdm=False)[0].outputs[0].token_ids
                != ours.generate([ids], params, use_tqdm=False)[0].outputs[0].token_ids)


def test_directory_with_one_gguf_and_its_tokenizer(tiny_qwen2, tmp_path):
    write_gguf(tiny_qwen2, tmp_path / "m.gguf", Q.Q8_0)
    assert find_gguf(tmp_path) == tmp_path / "m.gguf"
    view = resolve_model_path(str(tmp_path))
    assert view == resolve_model_path(str(tmp_path / "m.gguf"))  # one cached view for both spellings
    ours, theirs = AutoTokenizer.from_pretrained(view), AutoTokenizer.from_pretrained(tiny_qwen2)
    text = "Hello world, the cat sat on the mat. 12345"
    assert ours.encode(text) == theirs.encode(text)
    chat = [{"role": "user", "content": "hi"}]
    assert (ours.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
            == theirs.apply_chat_template(chat, tokenize=False, add_generation_prompt=True))
    assert ours.eos_token_id == theirs.eos_token_id
    llm = LLM(str(tmp_path), device="cpu")
    assert llm.generate("Hello", SamplingParams(max_tokens=4, temperature=0), use_tqdm=False)[0].outputs[0].text


def test_several_ggufs_in_a_directory_are_refused(tiny_qwen2, tmp_path):
    write_gguf(tiny_qwen2, tmp_path / "a.gguf")
    shutil.copy(tmp_path / "a.gguf", tmp_path / "b.gguf")
    with pytest.raises(ValueError, match="several GGUF files.*a.gguf, b.gguf"):
        resolve_model_path(str(tmp_path))


def test_view_is_built_once(tiny_qwen2, tmp_path):
    write_gguf(tiny_qwen2, tmp_path / "m.gguf")
    view = hf_view(tmp_path / "m.gguf", cache_dir=tmp_path / "cache")
    (view / "marker").write_text("kept")
    assert hf_view(tmp_path / "m.gguf", cache_dir=tmp_path / "cache") == view
    assert (view / "marker").is_file()
    assert sorted(p.name for p in (tmp_path / "cache").iterdir()) == [view.name]  # no partial dirs left


def _write_one_tensor(path, arch: str, name: str, data: np.ndarray, qtype) -> None:
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_tensor(name, data, raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def _raw_bytes(qtype, rows: int, cols: int) -> tuple[np.ndarray, bool]:
    """Bytes for a [rows, cols] tensor, and whether they came from real values: gguf quantizes
    the legacy types; for the K-quants (no numpy quantizer) random blocks stand in."""
    rng = np.random.default_rng(0)
    try:
        return gguf.quants.quantize(rng.standard_normal((rows, cols)).astype(np.float32), qtype), True
    except NotImplementedError:
        block_size, type_size = gguf.GGML_QUANT_SIZES[qtype]
        return rng.integers(0, 256, (rows, cols // block_size * type_size), dtype=np.uint8), False


@pytest.mark.parametrize("qtype", SUPPORTED_TENSOR_TYPES)
def test_dequantize_every_supported_type(qtype, tmp_path):
    qtype = Q[qtype]
    rows, cols = 4, 512
    data, from_values = _raw_bytes(qtype, rows, cols)
    _write_one_tensor(tmp_path / "t.gguf", "llama", "blk.0.ffn_up.weight", data, qtype)
    tensor = gguf.GGUFReader(tmp_path / "t.gguf").tensors[0]
    with np.errstate(invalid="ignore", over="ignore"):  # random K-quant scales may be inf or NaN
        ours = dequantize_tensor(tensor)
        theirs = gguf.quants.dequantize(data, qtype).astype(np.float32)
    assert ours.shape == (rows, cols) and ours.dtype == np.float32  # HF layout: [out, in]
    # (NaN == NaN here: random K-quant scales may spell one; the point is the same numbers)
    np.testing.assert_array_equal(ours, theirs)
    assert not from_values or np.isfinite(ours).all()
    if qtype == Q.Q8_0:  # by hand: each block is an fp16 scale d and 32 int8 q; value = d * q
        block = data.reshape(-1, 34)[0]
        d = block[:2].view(np.float16).astype(np.float32)[0]
        np.testing.assert_array_equal(ours[0, :32], d * block[2:].view(np.int8).astype(np.float32))


def test_unpermute_inverts_llama_cpp_permutation():
    w = np.arange(6 * 16 * 3, dtype=np.float32).reshape(6 * 16, 3)  # 6 heads of 16 rows
    np.testing.assert_array_equal(unpermute_rows(llama_cpp_permute(w, 6), 6), w)


def test_tensor_names():
    assert hf_name("blk.12.attn_q.weight") == "model.layers.12.self_attn.q_proj.weight"
    assert hf_name("blk.0.attn_k.bias") == "model.layers.0.self_attn.k_proj.bias"
    assert hf_name("token_embd.weight") == "model.embed_tokens.weight"
    assert hf_name("blk.0.ffn_gate_exps.weight") is None  # stacked experts: named per model (loader)
    assert hf_name("blk.2.ffn_gate_inp.weight") == "model.layers.2.mlp.gate.weight"  # the router
    assert hf_name("blk.2.ffn_gate_inp_shexp.weight") == "model.layers.2.mlp.shared_expert_gate.weight"
    assert hf_name("blk.2.ffn_down_shexp.weight") == "model.layers.2.mlp.shared_expert.down_proj.weight"
    assert hf_name("blk.1.attn_qkv.weight", "phi3") == "model.layers.1.self_attn.qkv_proj.weight"
    assert hf_name("blk.1.ffn_up.weight", "phi3") == "model.layers.1.mlp.gate_up_proj.weight"  # [gate | up]
    assert hf_name("blk.1.ffn_norm.weight", "gemma2") == "model.layers.1.pre_feedforward_layernorm.weight"
    assert hf_name("blk.1.post_attention_norm.weight", "gemma3") == "model.layers.1.post_attention_layernorm.weight"
    assert hf_name("blk.1.post_ffw_norm.weight", "gemma3") == "model.layers.1.post_feedforward_layernorm.weight"


def test_unsupported_architecture_is_named(tmp_path):
    _write_one_tensor(tmp_path / "g.gguf", "mamba", "token_embd.weight", np.zeros((4, 32), np.float32), None)
    with pytest.raises(ValueError, match="GGUF architecture 'mamba' is not supported"):
        resolve_model_path(str(tmp_path / "g.gguf"))


def test_unsupported_tensor_type_is_named(tmp_path):
    data = np.zeros((4, 18 * 256 // 32), np.uint8)  # IQ4_NL: 18-byte blocks of 32
    _write_one_tensor(tmp_path / "iq.gguf", "llama", "blk.0.ffn_up.weight", data, Q.IQ4_NL)
    with pytest.raises(ValueError, match="tensor type.*IQ4_NL are not supported"):
        LLM(str(tmp_path / "iq.gguf"), device="cpu")


def test_unexpected_tensor_is_named(tiny_llama, tmp_path):
    """A GGUF whose tensors do not match the config fails naming them (here: an extra layer's)."""
    write_gguf(tiny_llama, tmp_path / "extra.gguf", extra={"blk.9.attn_norm.weight": np.ones(64, np.float32)})
    with pytest.raises(ValueError, match=r"unexpected tensors \['blk.9.attn_norm.weight'\]"):
        LLM(str(tmp_path / "extra.gguf"), device="cpu")


def test_weights_load_in_the_engine_dtype(tiny_qwen2, tmp_path):
    write_gguf(tiny_qwen2, tmp_path / "m.gguf", Q.Q8_0)
    llm = LLM(str(tmp_path / "m.gguf"), dtype="bfloat16", device="cpu")
    model = llm.llm_engine.executor.runner.model
    # uint8: the Q8_0 linear weights, kept as their blocks (engine/layers/quantization/gguf.py)
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16, torch.uint8}


def test_tensor_parallel_shards_gguf_weights(tiny_llama, tmp_path):
    """tp=2 splits the un-permuted Q/K (2 KV heads: one per rank) through the same weight_loaders."""
    stored = write_gguf(tiny_llama, tmp_path / "model.gguf", Q.Q8_0)
    reference = save_as_hf(tiny_llama, stored, tmp_path / "hf-dequantized")
    llm = LLM(str(tmp_path / "model.gguf"), device="cpu", dtype="float32", tensor_parallel_size=2)
    try:
        prompts = _prompts(llm.llm_engine.model_config.vocab_size, lens=(3, 40))
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                            SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True), use_tqdm=False)
        for p, out in zip(prompts, outs):
            assert_matches(out.outputs[0].token_ids, hf_greedy(str(reference), p, MAX_TOKENS), f"tp=2, {len(p)}")
    finally:
        llm.llm_engine.shutdown()


def test_llama31_rope_freqs_are_used(tiny_llama, tmp_path):
    """A Llama 3.1-style GGUF: llama.cpp's converter writes the llama3 RoPE scaling as the
    rope_freqs tensor (one divisor per frequency; no scaling in the metadata). The engine divides
    its frequencies by it: its table is the llama3 one, and greedy tokens equal HF's on the llama3
    checkpoint with the dequantized weights."""
    hf_path = tmp_path / "llama31"
    shutil.copytree(tiny_llama, hf_path)
    config = json.loads((hf_path / "config.json").read_text())
    config["rope_parameters"] = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                 "original_max_position_embeddings": 256, "rope_theta": config["rope_theta"]}
    (hf_path / "config.json").write_text(json.dumps(config))
    stored = write_gguf(hf_path, tmp_path / "model.gguf", Q.Q8_0)
    assert "rope_freqs.weight" in {t.name for t in gguf.GGUFReader(tmp_path / "model.gguf").tensors}
    reference = save_as_hf(hf_path, stored, tmp_path / "hf-dequantized")
    _check_greedy(tmp_path / "model.gguf", reference)
    llm = LLM(str(tmp_path / "model.gguf"), dtype="float32", device="cpu")
    ours = llm.llm_engine.executor.runner.model.model.layers[0].self_attn.rotary_emb.cos_sin_cache
    assert llm.llm_engine.model_config.rope_scaling is None  # the file's metadata: plain RoPE
    llama3 = get_rope(ModelConfig.from_pretrained(reference)).cos_sin_cache
    torch.testing.assert_close(ours, llama3, rtol=0, atol=2e-5)  # divisors as llama.cpp rounds them
    plain = get_rope(ModelConfig.from_pretrained(tiny_llama)).cos_sin_cache
    assert (ours - plain).abs().max() > 0.5  # the scaling really changed the table


def test_phi3_gguf_equals_hf_on_dequantized_weights(tmp_path):
    """llama.cpp's `phi3`: fused attn_qkv and ffn_up (gate and up) tensors, rope.dimension_count for
    the partial rotary, and LongRoPE's factor lists as the rope_factors_short / _long tensors, which
    the HF view turns back into the config; a 250-token prompt generates into the long factors."""
    hf_path = make_tiny_model(tmp_path / "phi3", arch="phi3")
    stored = write_gguf(hf_path, tmp_path / "model.gguf", Q.Q8_0)
    reference = save_as_hf(hf_path, stored, tmp_path / "hf-dequantized")
    _check_greedy(tmp_path / "model.gguf", reference, lens=(7, 250))
    view = ModelConfig.from_pretrained(resolve_model_path(str(tmp_path / "model.gguf")))
    ours = ModelConfig.from_pretrained(hf_path)
    assert (view.partial_rotary_factor, view.rope_scaling["original_max_position_embeddings"]) == (0.75, 256)
    torch.testing.assert_close(get_rope(view).cos_sin_cache, get_rope(ours).cos_sin_cache, rtol=0, atol=1e-6)


# Mixture-of-experts checkpoints as llama.cpp's converter takes them: every Qwen2-MoE layer sparse
# (llama.cpp's qwen2moe has no dense MLP tensors), as in the released Qwen1.5-MoE / Qwen2-57B.
_MOE_OVERRIDES = {"mixtral": {}, "qwen2_moe": {"mlp_only_layers": []}, "qwen3_moe": {}}
# HF config keys each MoE view must carry as the checkpoint has them.
_MOE_KEYS = {"mixtral": ("num_local_experts", "num_experts_per_tok", "intermediate_size"),
             "qwen2_moe": ("num_experts", "num_experts_per_tok", "moe_intermediate_size", "norm_topk_prob",
                           "shared_expert_intermediate_size", "qkv_bias", "mlp_only_layers", "decoder_sparse_step"),
             "qwen3_moe": ("num_experts", "num_experts_per_tok", "moe_intermediate_size", "norm_topk_prob",
                           "head_dim", "mlp_only_layers", "decoder_sparse_step")}


def _checkpoints_on_first_use(tmp_path_factory, overrides: dict):
    """arch -> its tiny checkpoint with overrides[arch], built on first use."""
    built = {}

    def get(arch: str):
        if arch not in built:
            out = tmp_path_factory.mktemp(f"gguf-{arch}")
            built[arch] = make_tiny_model(out, arch=arch, seed=0, **overrides[arch])
        return built[arch]
    return get


@pytest.fixture(scope="module")
def tiny_moe_checkpoint(tmp_path_factory):
    """arch -> its tiny checkpoint (8 experts, top-2), built on first use."""
    return _checkpoints_on_first_use(tmp_path_factory, _MOE_OVERRIDES)


@pytest.mark.parametrize("qtype", [Q.F32, Q.Q8_0], ids=lambda q: q.name)
@pytest.mark.parametrize("arch", list(_MOE_OVERRIDES))
def test_moe_gguf_equals_hf_on_dequantized_weights(arch, qtype, tiny_moe_checkpoint, tmp_path):
    """llama.cpp's MoE files (Mixtral as `llama` with expert_count, `qwen2moe` with its shared
    expert, `qwen3moe` with q/k norms): each layer's experts stacked in ffn_{gate,up,down}_exps
    [E, ...], the router ffn_gate_inp kept F32. Greedy tokens equal HF's on the weights the file
    holds, and the HF view's config carries the MoE keys transformers' GGUF reading leaves out."""
    hf_path = tiny_moe_checkpoint(arch)
    stored = write_gguf(hf_path, tmp_path / "model.gguf", qtype)
    tensors = {t.name: t for t in gguf.GGUFReader(tmp_path / "model.gguf").tensors}
    assert tensors["blk.1.ffn_gate_exps.weight"].data.shape[0] == 8  # stacked: [E, I, H(bytes)]
    assert tensors["blk.1.ffn_gate_inp.weight"].tensor_type == Q.F32
    assert tensors["blk.1.ffn_down_exps.weight"].tensor_type == qtype
    reference = hf_path if qtype == Q.F32 else save_as_hf(hf_path, stored, tmp_path / "hf-dequantized")
    _check_greedy(tmp_path / "model.gguf", reference, lens=(7, 130))
    view = json.loads((resolve_model_path(str(tmp_path / "model.gguf")) / "config.json").read_text())
    theirs = json.loads((hf_path / "config.json").read_text())
    theirs.setdefault("head_dim", theirs["hidden_size"] // theirs["num_attention_heads"])
    assert view["architectures"] == theirs["architectures"]
    assert {k: view.get(k) for k in _MOE_KEYS[arch]} == {k: theirs.get(k) for k in _MOE_KEYS[arch]}


def test_stacked_experts_need_a_moe_model(tmp_path):
    """A stacked expert tensor in a file whose model has no experts is named, not dropped."""
    data = np.zeros((8, 4, 32), np.float32)
    _write_one_tensor(tmp_path / "e.gguf", "llama", "blk.0.ffn_up_exps.weight", data, None)
    model = torch.nn.Module()
    model.config = type("Config", (), {"tie_word_embeddings": False})()
    with pytest.raises(ValueError, match=r"unexpected tensors \['blk.0.ffn_up_exps.weight'\]"):
        load_gguf_weights(model, tmp_path / "e.gguf")


# Gemma checkpoints as a GGUF can hold them: llama.cpp scales attention by head_dim ** -0.5 (the
# file's key_length) and gives Gemma 3 five local layers to one global whatever the checkpoint
# said, so the tiny models use those (the writer refuses others).
_GEMMA_OVERRIDES = {"gemma2": dict(query_pre_attn_scalar=16),
                    "gemma3": dict(query_pre_attn_scalar=16, num_hidden_layers=6, sliding_window_pattern=6)}
_GEMMA_KEYS = ("architectures", "head_dim", "query_pre_attn_scalar", "sliding_window", "layer_types",
               "attn_logit_softcapping", "final_logit_softcapping", "hidden_activation", "tie_word_embeddings")


@pytest.fixture(scope="module")
def tiny_gemma_checkpoint(tmp_path_factory):
    """arch -> its tiny checkpoint (windows of 16; gemma2's soft caps 5 / 15), built on first use."""
    return _checkpoints_on_first_use(tmp_path_factory, _GEMMA_OVERRIDES)


@pytest.mark.parametrize("qtype", [Q.F32, Q.Q8_0], ids=lambda q: q.name)
@pytest.mark.parametrize("arch", list(_GEMMA_OVERRIDES))
def test_gemma_gguf_equals_hf_on_dequantized_weights(arch, qtype, tiny_gemma_checkpoint, tmp_path):
    """llama.cpp's `gemma2` / `gemma3`: the four norms a layer (and Gemma 3's q/k norms) stored as
    1 + w, the soft caps and the window in the metadata, Gemma 3's global RoPE as rope.freq_base
    with its linear scaling and the local one not in the file at all. Greedy tokens equal HF's on
    the weights the file holds for a prompt of eight windows, and the HF view's config (the layers
    that slide, the scale, the caps, both RoPEs) equals the checkpoint's."""
    hf_path = tiny_gemma_checkpoint(arch)
    stored = write_gguf(hf_path, tmp_path / "model.gguf", qtype)
    tensors = {t.name: t for t in gguf.GGUFReader(tmp_path / "model.gguf").tensors}
    assert "output.weight" not in tensors  # tied
    hf_norm = load_file(hf_path / "model.safetensors")["model.layers.0.post_feedforward_layernorm.weight"]
    np.testing.assert_allclose(tensors["blk.0.post_ffw_norm.weight"].data, hf_norm + 1, rtol=0, atol=1e-6)
    reference = save_as_hf(hf_path, stored, tmp_path / "hf-dequantized")
    _check_greedy(tmp_path / "model.gguf", reference, lens=(7, 130))
    view_dir = resolve_model_path(str(tmp_path / "model.gguf"))
    view = json.loads((view_dir / "config.json").read_text())
    theirs = json.loads((hf_path / "config.json").read_text())
    assert {k: view.get(k) for k in _GEMMA_KEYS} == {k: theirs.get(k) for k in _GEMMA_KEYS}
    ours, hf = ModelConfig.from_pretrained(view_dir), ModelConfig.from_pretrained(hf_path)
    assert (ours.rope_theta, ours.rope_scaling, ours.rope_local) == (hf.rope_theta, hf.rope_scaling, hf.rope_local)
