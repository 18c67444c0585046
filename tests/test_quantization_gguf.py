"""GGUF linear weights kept in their blocks (engine/layers/quantization/gguf.py): tiny GGUF files
of each packed type give HF transformers' greedy tokens (transformers reading the same file),
hold their linear weights at the file's size, shard for TP=2, and mix types within one layer."""
import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q

import tests.gguf_writer as gguf_writer
from engine import LLM, SamplingParams
from engine.layers.linear import LinearBase, QKVParallelLinear
from engine.layers.quantization import quantized_build
from engine.layers.quantization.gguf import GGUFBlocks, GGUFConfig, GGUFLinearMethod
from engine.loader.model_path import resolve_model_path
from engine.tools.tiny_model import make_tiny_model
from tests.hf_reference import assert_matches, hf_greedy
from tests.test_kernels_gguf import gguf_blocks

MAX_TOKENS = 8
PROMPTS = [[5], [17, 4, 250, 9, 33, 71, 2, 8, 400]]
_LINEAR = {"attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down"}


def _pack_scales(sc: np.ndarray, mn: np.ndarray) -> np.ndarray:
    """8 six-bit scales and mins per block [n, 8] -> the 12 bytes Q4_K / Q5_K store (get_scale_min's inverse)."""
    out = np.zeros((sc.shape[0], 12), np.uint8)
    out[:, 0:4] = sc[:, :4] | ((sc[:, 4:] >> 4) << 6)
    out[:, 4:8] = mn[:, :4] | ((mn[:, 4:] >> 4) << 6)
    out[:, 8:12] = (sc[:, 4:] & 15) | ((mn[:, 4:] & 15) << 4)
    return out


def quantize_k(w: np.ndarray, qtype) -> np.ndarray:
    """A simple K-quant quantizer (gguf has none): w [rows, cols % 256 == 0] -> uint8 blocks.
    Not llama.cpp's search for the best scales, just a fair one; the tests compare with the
    file's own values (gguf.quants.dequantize), so its error only has to be small."""
    rows = w.shape[0]
    x = w.reshape(-1, 8 if qtype != Q.Q6_K else 16, 32 if qtype != Q.Q6_K else 16).astype(np.float32)
    f16 = lambda v: v.astype(np.float16).reshape(-1, 1).view(np.uint8)  # noqa: E731
    if qtype == Q.Q6_K:  # 16 sub-blocks of 16: int8 scale, q in [0, 63] around 32
        sub = np.abs(x).max(-1) / 31 + 1e-12
        d = sub.max(-1) / 127
        sc = np.clip(np.round(sub / d[:, None]), 1, 127).astype(np.int8)
        q = np.clip(np.round(x / (d[:, None, None] * sc[..., None])) + 32, 0, 63).astype(np.uint8).reshape(-1, 256)
        ql, qh = np.zeros((len(q), 128), np.uint8), np.zeros((len(q), 64), np.uint8)
        for k in range(256):
            h, t, l = k // 128, k % 128 // 32, k % 32
            ql[:, 64 * h + 32 * (t % 2) + l] |= (q[:, k] & 15) << (4 * (t // 2))
            qh[:, 32 * h + l] |= (q[:, k] >> 4) << (2 * t)
        return np.concatenate([ql, qh, sc.view(np.uint8), f16(d)], 1).reshape(rows, -1)
    top = 15 if qtype == Q.Q4_K else 31  # q in [0, top]; w = d * sc * q - dmin * m
    lo = np.minimum(x.min(-1), 0)
    sub, mins = (x.max(-1) - lo) / top + 1e-12, -lo
    d, dmin = sub.max(-1) / 63, mins.max(-1) / 63 + 1e-12
    sc = np.clip(np.round(sub / d[:, None]), 1, 63).astype(np.uint8)
    mn = np.clip(np.round(mins / dmin[:, None]), 0, 63).astype(np.uint8)
    q = np.clip(np.round((x + (dmin[:, None] * mn)[..., None]) / (d[:, None] * sc)[..., None]), 0, top).astype(np.uint8)
    qs = (q[:, 0::2] | (q[:, 1::2] << 4)).reshape(-1, 128)  # sub-blocks 2j, 2j+1 share 32 bytes
    parts = [f16(d), f16(dmin), _pack_scales(sc, mn)]
    if qtype == Q.Q5_K:
        parts.append(np.bitwise_or.reduce((q >> 4) << np.arange(8, dtype=np.uint8)[None, :, None], axis=1))
        qs = ((q[:, 0::2] & 15) | ((q[:, 1::2] & 15) << 4)).reshape(-1, 128)
    return np.concatenate([*parts, qs], 1).reshape(rows, -1)


def quantize_q2_k(w: np.ndarray) -> np.ndarray:
    """Q2_K, a type no kernel of ours takes (gguf has no quantizer for it either): 84-byte blocks
    of scales[16] (scale | min << 4) | qs[64] | d | dmin, 16 sub-blocks of 16, q in [0, 3],
    w = d * sc * q - dmin * m; element 128n + 32j + l is bits 2j of qs[32n + l]."""
    rows = w.shape[0]
    x = w.reshape(-1, 16, 16).astype(np.float32)
    lo = np.minimum(x.min(-1), 0)
    sub, mins = (x.max(-1) - lo) / 3 + 1e-12, -lo
    d, dmin = sub.max(-1) / 15, mins.max(-1) / 15 + 1e-12
    sc = np.clip(np.round(sub / d[:, None]), 1, 15).astype(np.uint8)
    mn = np.clip(np.round(mins / dmin[:, None]), 0, 15).astype(np.uint8)
    q = np.clip(np.round((x + (dmin[:, None] * mn)[..., None]) / (d[:, None] * sc)[..., None]), 0, 3).astype(np.uint8)
    qs = np.bitwise_or.reduce(q.reshape(-1, 2, 4, 32) << (2 * np.arange(4, dtype=np.uint8))[None, None, :, None], 2)
    f16 = lambda v: v.astype(np.float16).reshape(-1, 1).view(np.uint8)  # noqa: E731
    return np.concatenate([sc | (mn << 4), qs.reshape(-1, 64), f16(d), f16(dmin)], 1).reshape(rows, -1)


def _roundtrip(array: np.ndarray, qtype):
    if qtype == Q.Q2_K:
        data = quantize_q2_k(array)
    else:
        data = quantize_k(array, qtype) if qtype in (Q.Q4_K, Q.Q5_K, Q.Q6_K) else gguf.quants.quantize(array, qtype)
    return data, gguf.quants.dequantize(data, qtype).astype(np.float32)


@pytest.mark.parametrize("qtype", [Q.Q2_K, Q.Q4_K, Q.Q5_K, Q.Q6_K], ids=lambda q: q.name)
def test_k_quantizer_is_close(qtype):
    w = np.random.default_rng(0).standard_normal((4, 512)).astype(np.float32)
    error = np.abs(_roundtrip(w, qtype)[1] - w).max()
    assert error < {Q.Q2_K: 1.2, Q.Q4_K: 0.6, Q.Q5_K: 0.3, Q.Q6_K: 0.12}[qtype], error


@pytest.fixture(scope="module")
def tiny_k(tmp_path_factory):
    """A llama (llama.cpp permutes its Q/K rows) whose every linear input is a multiple of 256."""
    return str(make_tiny_model(tmp_path_factory.mktemp("tiny-gguf-k"), arch="llama", preset="tiny", seed=0,
                               hidden_size=256, intermediate_size=512))


def _write(hf_dir, path, qtype, monkeypatch):
    monkeypatch.setattr(gguf_writer, "quantize_roundtrip", _roundtrip)  # K-quants too
    gguf_writer.write_gguf(hf_dir, path, qtype)
    return path


def _greedy(llm):
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS],
                        SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True), use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


def _linear_bytes(model) -> tuple[int, set]:
    """Bytes the linear layers hold (bias aside), and the dtypes they hold them in."""
    params = [p for m in model.modules() if isinstance(m, LinearBase)
              for n, p in m.named_parameters(recurse=False) if n != "bias"]
    return sum(p.numel() * p.element_size() for p in params), {p.dtype for p in params if p.numel()}


@pytest.mark.parametrize("qtype", [Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q4_K, Q.Q5_K, Q.Q6_K],
                         ids=lambda q: q.name)
def test_packed_gguf_equals_hf_and_stays_packed(qtype, tiny_k, tmp_path, monkeypatch):
    path = _write(tiny_k, tmp_path / "m.gguf", qtype, monkeypatch)
    llm = LLM(str(path), dtype="float32", device="cpu")
    assert llm.llm_engine.config.quantization == "gguf"
    view = str(resolve_model_path(str(path)))
    for prompt, ours in zip(PROMPTS, _greedy(llm)):
        assert_matches(ours, hf_greedy(view, prompt, MAX_TOKENS), f"{qtype.name}, prompt of {len(prompt)}")
    resident, dtypes = _linear_bytes(llm.llm_engine.executor.runner.model)
    linear = [t for t in gguf.GGUFReader(path).tensors if t.name.startswith("blk.") and t.name.split(".")[2] in _LINEAR]
    packed, fp32 = sum(int(t.n_bytes) for t in linear), sum(4 * int(t.n_elements) for t in linear)
    assert dtypes == {torch.uint8}
    assert abs(resident - packed) <= 0.1 * packed, (resident, packed)
    assert resident < 0.3 * fp32  # Q8_0: 34 bytes for 32 features, against 128 dequantized


def test_type_outside_the_packed_set_loads_dequantized(tiny_k, tmp_path, monkeypatch):
    """Q2_K (no block kernel): dequantized to the engine dtype at load, as before, and still right."""
    path = _write(tiny_k, tmp_path / "m.gguf", Q.Q2_K, monkeypatch)
    llm = LLM(str(path), dtype="float32", device="cpu")
    view = str(resolve_model_path(str(path)))
    for prompt, ours in zip(PROMPTS, _greedy(llm)):
        assert_matches(ours, hf_greedy(view, prompt, MAX_TOKENS), f"Q2_K, prompt of {len(prompt)}")
    model = llm.llm_engine.executor.runner.model
    assert torch.uint8 not in _linear_bytes(model)[1]  # fp32 (or oneDNN-packed from it, emptied)
    methods = [m.quant_method for m in model.modules() if isinstance(m, LinearBase)]
    assert methods and all(set(q.part_types.values()) == {None} for q in methods)


def test_tensor_parallel_equals_single_rank(tiny_k, tmp_path, monkeypatch):
    """TP=2 (gloo): column shards cut rows, row shards cut whole Q8_0 blocks (o_proj: 128 of 256 features)."""
    path = _write(tiny_k, tmp_path / "m.gguf", Q.Q8_0, monkeypatch)
    single = _greedy(LLM(str(path), dtype="float32", device="cpu"))
    llm = LLM(str(path), dtype="float32", device="cpu", tensor_parallel_size=2)
    try:
        view = str(resolve_model_path(str(path)))
        for prompt, ours, theirs in zip(PROMPTS, _greedy(llm), single):
            assert_matches(ours, hf_greedy(view, prompt, MAX_TOKENS), f"tp=2, prompt of {len(prompt)}")
            assert_matches(theirs, hf_greedy(view, prompt, MAX_TOKENS), f"tp=1, prompt of {len(prompt)}")
    finally:
        llm.llm_engine.shutdown()


def test_row_shard_off_the_k_quant_blocks_is_refused(tiny_k, tmp_path, monkeypatch):
    """o_proj's 256 input features over 2 ranks: 128 each, half a Q4_K block."""
    path = _write(tiny_k, tmp_path / "m.gguf", Q.Q4_K, monkeypatch)
    with pytest.raises(Exception, match="does not fall on whole Q4_K blocks of 256 features"):
        LLM(str(path), dtype="float32", device="cpu", tensor_parallel_size=2)


def _qkv_layer():
    with quantized_build():
        layer = QKVParallelLinear(hidden_size=256, head_dim=32, total_num_heads=2, total_num_kv_heads=1)
    layer.set_quant_method(GGUFConfig.from_config({}).get_linear_method(layer, "self_attn.qkv_proj"))
    return layer


def test_mixed_types_in_one_fused_layer():
    """q and k Q4_K (one matmul), v Q6_K (another), as Q4_K_M files mix them; bias added once."""
    layer = _qkv_layer()
    parts = {"q": (Q.Q4_K, 64), "k": (Q.Q4_K, 32), "v": (Q.Q6_K, 32)}
    dense = []
    for i, (shard, (qtype, rows)) in enumerate(parts.items()):
        blocks = gguf_blocks(qtype, rows, 256, seed=i)
        layer.weight_loader(layer.weight, GGUFBlocks(torch.from_numpy(blocks), int(qtype)), shard)
        dense.append(torch.from_numpy(gguf.quants.dequantize(blocks, qtype).astype(np.float32)))
    layer.process_weights_after_loading()
    assert [n for n, _ in layer.named_parameters()] == ["weight", "weight_0", "weight_2"]
    assert len(layer.quant_method.matmuls) == 2
    x = torch.randn(3, 256)
    expected = x @ torch.cat(dense).T
    torch.testing.assert_close(layer(x), expected, atol=1e-4 * expected.abs().max().item(), rtol=0)


def test_fused_checkpoint_tensor_is_split_into_parts():
    """Phi-3's attn_qkv: one tensor of q, k and v rows (shard_id None), here dense F32 for v's type."""
    layer = _qkv_layer()
    blocks = gguf_blocks(Q.Q8_0, 128, 256)
    layer.weight_loader(layer.weight, GGUFBlocks(torch.from_numpy(blocks), int(Q.Q8_0)))
    layer.process_weights_after_loading()
    assert len(layer.quant_method.matmuls) == 1 and layer.weight_0.shape == (128, 8 * 34)
    x = torch.randn(2, 256)
    expected = x @ torch.from_numpy(gguf.quants.dequantize(blocks, Q.Q8_0).astype(np.float32)).T
    torch.testing.assert_close(layer(x), expected, atol=1e-4 * expected.abs().max().item(), rtol=0)
    with pytest.raises(ValueError, match="fused tensor has 96 rows, expected 64 \\+ 32 \\+ 32"):
        _qkv_layer().weight_loader(None, GGUFBlocks(torch.from_numpy(blocks[:96]), int(Q.Q8_0)))


def test_config_takes_no_quantization_config():
    assert isinstance(GGUFConfig.from_config({}).get_linear_method(None, "x"), GGUFLinearMethod)
    with pytest.raises(ValueError, match="takes no quantization_config, got keys \\['bits'\\]"):
        GGUFConfig.from_config({"bits": 4})
