"""FP8 weights that stay FP8: tiny llama checkpoints quantized here (HF fp8 per-tensor static and dynamic,
block-wise, compressed-tensors channel + dynamic per token) against HF on the same weights dequantized;
the W8A8 arithmetic (activations quantized too) against HF within a tolerance; online fp8; TP=2 equal
to TP=1 block-wise; the configs refused by name."""
import json
import shutil

import pytest
import torch
import torch.multiprocessing as mp
from safetensors.torch import load_file, save_file

from engine import LLM, SamplingParams
from engine.config import EngineConfig, ModelConfig
from engine.executor.network_utils import free_port
from engine.layers.attention import Attention
from engine.layers.linear import LinearBase
from engine.layers.quantization import fp8, get_quantization_config, quantize_linear_layers, quantized_build
from engine.layers.quantization.compressed_tensors import scheme_method
from engine.loader.weights import load_weights
from engine.models import get_model_class
from tests.hf_reference import assert_matches, hf_greedy, load_hf
from tests.test_models import attach_kv_cache, run_step

PROJ = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
MAX_TOKENS = 10
BLOCK = [16, 32]  # divides the tiny dims (q 64, k/v 32, hidden 64, intermediate 128), and their TP=2 halves
FP8 = torch.float8_e4m3fn
CT_CHANNEL = {"quant_method": "compressed-tensors", "format": "float-quantized", "ignore": ["lm_head"],
              "config_groups": {"group_0": {"targets": ["Linear"], "input_activations": {
                  "num_bits": 8, "type": "float", "strategy": "token", "dynamic": True, "symmetric": True},
                  "weights": {"num_bits": 8, "type": "float", "strategy": "channel", "dynamic": False,
                              "symmetric": True}}}}
FORMATS = {  # name -> (quantization_config, how the test quantizes each weight)
    "fp8-static": ({"quant_method": "fp8", "activation_scheme": "static"}, "tensor"),
    "fp8-dynamic": ({"quant_method": "fp8", "activation_scheme": "dynamic"}, "tensor"),
    "fp8-block": ({"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": BLOCK}, "block"),
    "ct-channel": (CT_CHANNEL, "channel"),
}


def _quantize(w: torch.Tensor, how: str, block=BLOCK):
    """The test's own quantizer: (fp8 weight, scale, the weight dequantized in fp32)."""
    if how == "tensor":
        scale = w.abs().max() / 448
        full = scale
    elif how == "channel":
        scale = w.abs().amax(1, keepdim=True) / 448  # [out, 1]
        full = scale
    else:
        bn, bk = block
        blocks = w.unflatten(0, (-1, bn)).unflatten(2, (-1, bk))  # [out / bn, bn, in / bk, bk]
        scale = blocks.abs().amax((1, 3)) / 448                  # [out / bn, in / bk]
        full = scale.repeat_interleave(bn, 0).repeat_interleave(bk, 1)
    q = (w / full).to(FP8)
    return q, scale.float(), q.float() * full


def _write(src, dst, state, quantization_config=None):
    shutil.copytree(src, dst, dirs_exist_ok=True)
    save_file(state, f"{dst}/model.safetensors")
    if quantization_config is not None:
        cfg = json.loads((dst / "config.json").read_text())
        (dst / "config.json").write_text(json.dumps({**cfg, "quantization_config": quantization_config}))
    return str(dst)


def make_checkpoints(src, out, name, block=BLOCK):
    """(the quantized checkpoint, HF's oracle: the same weights dequantized)."""
    config, how = FORMATS[name]
    config = {**config, "weight_block_size": block} if how == "block" else config
    quantized, dequantized = {}, {}
    for key, t in load_file(f"{src}/model.safetensors").items():
        module = key.rpartition(".")[0]
        if not (key.endswith(".weight") and module.rpartition(".")[2] in PROJ):
            quantized[key] = dequantized[key] = t
            continue
        q, scale, dequantized[key] = _quantize(t, how, block)
        quantized[key] = q
        quantized[f"{module}.weight_scale_inv" if how == "block" else f"{module}.weight_scale"] = scale
        if name == "fp8-static":  # a calibrated-looking input scale, different per part
            quantized[f"{module}.input_scale"] = torch.tensor(0.04 + 0.001 * len(quantized))
    return (_write(src, out / f"{name}-q", quantized, config), _write(src, out / f"{name}-deq", dequantized))


@pytest.fixture(scope="module")
def checkpoints(tiny_llama, tmp_path_factory):
    out = tmp_path_factory.mktemp("fp8")
    return {name: make_checkpoints(tiny_llama, out, name) for name in FORMATS}


def _linear_bytes(model) -> int:
    return sum(p.numel() * p.element_size() for m in model.modules() if isinstance(m, LinearBase)
               for p in m.parameters(recurse=False))


def _checkpoint_linear_bytes(path) -> int:
    return sum(t.numel() * t.element_size() for k, t in load_file(f"{path}/model.safetensors").items()
               if k.rpartition(".")[0].rpartition(".")[2] in PROJ)


@pytest.mark.parametrize("name", list(FORMATS))
def test_greedy_equals_hf_on_the_dequantized_weights(checkpoints, name):
    """On CPU the weights stay FP8 and are dequantized per tile inside the matmul, the activations as
    they are: the product is HF's on the dequantized weights, so the tokens are equal."""
    quantized, dequantized = checkpoints[name]
    llm = LLM(quantized, dtype="float32", device="cpu")
    model = llm.llm_engine.executor.runner.model
    qkv = model.model.layers[0].self_attn.qkv_proj
    assert qkv.weight.dtype == FP8 and isinstance(qkv.quant_method.compute, fp8.WeightOnlyTiles)
    resident, packed = _linear_bytes(model), _checkpoint_linear_bytes(quantized)
    assert abs(resident - packed) <= 0.1 * packed, (resident, packed)  # no dense copy anywhere
    vocab = llm.llm_engine.model_config.vocab_size
    prompts = [torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in (9, 40)]
    greedy = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    for p, out in zip(prompts, llm.generate([{"prompt_token_ids": p} for p in prompts], greedy, use_tqdm=False)):
        assert_matches(out.outputs[0].token_ids, hf_greedy(dequantized, p, MAX_TOKENS), f"{name}, {len(p)} tokens")


def load_quantized(path, quantization=None):
    """Our model as the model runner builds it (quantized layers, then the checkpoint), fp32 on CPU."""
    config = ModelConfig.from_pretrained(path)
    method = quantization or config.quantization
    quant_config = get_quantization_config(method, config.hf_config.get("quantization_config"))
    with quantized_build():
        model = get_model_class(config.architecture)(config)
    quantize_linear_layers(model, quant_config)
    for m in model.modules():
        if isinstance(m, Attention):
            m.set_backend("torch")
    load_weights(model, path)
    return model.eval()


def _prefill_logits(model, prompt) -> torch.Tensor:
    attach_kv_cache(model, 1)
    return run_step(model, [(0, prompt, 0)])


@pytest.mark.parametrize("name, compute", [("fp8-static", fp8.ScaledMM), ("ct-channel", fp8.ScaledMM),
                                           ("fp8-block", None)])
def test_w8a8_logits_within_tolerance_of_hf(checkpoints, monkeypatch, name, compute):
    """The CUDA arithmetic run on CPU: activations quantized to FP8 too (static per tensor, dynamic per
    token, per token per 32-column group for blocks; the Triton GEMM under the interpreter), so the
    logits move from HF's on the dequantized weights by e4m3's 3 mantissa bits (relative steps of
    1/16) on every activation: within 5% of the logits' range (measured 2.3-3.0%), and far above
    the weight-only path's error, which proves the activations were quantized; a near tie may flip
    a row's argmax (measured 1 or 2 of 19)."""
    quantized, dequantized = checkpoints[name]
    prompt = list(range(3, 40, 2))
    ref = load_hf(dequantized)(torch.tensor([prompt])).logits[0].float()
    weight_only = _prefill_logits(load_quantized(quantized), prompt)
    if compute is None:
        pytest.importorskip("triton")
        from tests.triton_device import DEVICE  # noqa: F401  (the interpreter on CPU)
        compute = lambda: fp8.TritonBlock(tuple(BLOCK))  # noqa: E731
    monkeypatch.setattr(fp8, "choose_compute", lambda *a: compute())
    w8a8 = _prefill_logits(load_quantized(quantized), prompt)
    spread = ref.max() - ref.min()
    assert (weight_only - ref).abs().max() < 1e-4 * spread
    err = (w8a8 - ref).abs().max()
    assert 1e-3 * spread < err < 0.05 * spread, (err, spread)
    assert (w8a8.argmax(-1) == ref.argmax(-1)).float().mean() > 0.75


def test_fused_part_scales_requantized_to_their_max():
    """vLLM's rule for one _scaled_mm per fused layer: every part on the largest scale, each weight
    within half an FP8 step of its value; a part already on the max scale is untouched."""
    w = torch.randn(48, 32)
    parts = [w[:16], w[16:32], w[32:]]
    qs, scales = zip(*(_quantize(p * (i + 1), "tensor")[:2] for i, p in enumerate(parts)))
    q, s = torch.cat(qs), torch.stack(scales)
    before = torch.cat([qi.float() * si for qi, si in zip(qs, scales)])
    fused = fp8.requantize_parts_to_max(q, s, [16, 16, 16])
    assert fused.item() == s.max().item() and torch.equal(q[32:], qs[2])
    # e4m3's step at each value on the new grid: 3 mantissa bits, exponents down to -6 (then subnormal)
    step = fused * 2.0 ** (torch.log2((before / fused).abs()).floor().clamp(min=-6) - 3)
    assert ((q.float() * fused - before).abs() <= step / 2 * 1.0001).all()


def test_fp8_scaled_mm_matches_dequantized_product():
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(5, 32, generator=g), torch.randn(48, 32, generator=g)
    wq, ws, w_deq = _quantize(w, "channel")
    xq, xs = fp8.quantize_per_token(x)
    ref = (xq.float() * xs) @ w_deq.T
    torch.testing.assert_close(fp8.fp8_scaled_mm(xq, xs, wq, ws, torch.float32), ref, atol=1e-4, rtol=1e-5)
    wq, ws, w_deq = _quantize(w, "tensor")
    torch.testing.assert_close(fp8.fp8_scaled_mm(xq, xs.max().reshape(1), wq, ws.reshape(1), torch.float32),
                               (xq.float() * xs.max()) @ w_deq.T, atol=1e-4, rtol=1e-5)


def test_online_fp8_quantizes_an_unquantized_checkpoint(tiny_llama, tmp_path):
    """quantization="fp8": every linear weight FP8 after load with one per-tensor scale (a fused layer's
    over all its parts), the full-precision copy gone; equal to HF on those weights dequantized."""
    tensors = load_file(f"{tiny_llama}/model.safetensors")
    dequantized = dict(tensors)
    for fused in (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"), ("o_proj",), ("down_proj",)):
        for layer in {k.rsplit(".", 2)[0] for k in tensors if k.endswith(f"{fused[0]}.weight")}:
            names = [f"{layer}.{p}.weight" for p in fused]
            scale = max(tensors[n].abs().max() for n in names) / 448
            for n in names:
                dequantized[n] = (tensors[n] / scale).to(FP8).float() * scale
    oracle = _write(tiny_llama, tmp_path / "online-deq", dequantized)
    llm = LLM(tiny_llama, dtype="float32", device="cpu", quantization="fp8")
    model = llm.llm_engine.executor.runner.model
    linears = [m for m in model.modules() if isinstance(m, LinearBase)]
    assert linears and all(m.weight.dtype == FP8 and m.weight_scale.shape == (1,) for m in linears)
    assert _linear_bytes(model) < 0.3 * sum(tensors[n].numel() * 4 for n in tensors
                                            if n.rpartition(".")[0].rpartition(".")[2] in PROJ)
    prompt = list(range(5, 30))
    out = llm.generate([{"prompt_token_ids": prompt}], SamplingParams(temperature=0, max_tokens=MAX_TOKENS,
                                                                     ignore_eos=True), use_tqdm=False)
    assert_matches(out[0].outputs[0].token_ids, hf_greedy(oracle, prompt, MAX_TOKENS), "online fp8")


def _tp_worker(rank: int, port: int, path, out_dir) -> None:
    from engine.executor.parallel_state import destroy_tp_group, init_tp_group

    torch.set_num_threads(1)
    init_tp_group(rank, 2, f"tcp://127.0.0.1:{port}", backend="gloo")
    try:
        logits = _prefill_logits(load_quantized(path), list(range(3, 30)))
        if rank == 0:
            torch.save(logits, out_dir / "logits.pt")
    finally:
        destroy_tp_group()


def test_tp2_block_wise_equals_tp1(checkpoints, tmp_path):
    """Block scales split with their weight rows (q/k/v and gate/up parts, down_proj's and o_proj's
    input columns) in whole 16 x 32 blocks."""
    quantized = checkpoints["fp8-block"][0]
    mp.spawn(_tp_worker, args=(free_port(), quantized, tmp_path), nprocs=2, join=True)
    expected = _prefill_logits(load_quantized(quantized), list(range(3, 30)))
    torch.testing.assert_close(torch.load(tmp_path / "logits.pt"), expected, atol=1e-4, rtol=0)


def test_blocks_that_split_a_fused_part_are_refused(tiny_llama, tmp_path):
    """k and v are 32 rows: 48-row blocks straddle q/k/v, which cannot be cut apart."""
    quantized, _ = make_checkpoints(tiny_llama, tmp_path, "fp8-block", block=[16, 32])
    tensors = load_file(f"{quantized}/model.safetensors")
    cfg = json.loads(open(f"{quantized}/config.json").read())
    cfg["quantization_config"]["weight_block_size"] = [48, 32]
    for k in [k for k in tensors if k.endswith("weight_scale_inv")]:  # re-blocked scales, right shapes
        out, inp = tensors[k.replace("weight_scale_inv", "weight")].shape
        tensors[k] = torch.ones(-(-out // 48), -(-inp // 32))
    save_file(tensors, f"{quantized}/model.safetensors")
    open(f"{quantized}/config.json", "w").write(json.dumps(cfg))
    with pytest.raises(ValueError, match="whole quantization blocks of 48"):
        load_quantized(quantized)


def _ct(weights=None, acts="keep", **top):
    group = json.loads(json.dumps(CT_CHANNEL["config_groups"]["group_0"]))
    group["weights"].update(weights or {})
    if acts != "keep":
        group["input_activations"] = acts
    return {**CT_CHANNEL, "config_groups": {"group_0": group}, **top}


@pytest.mark.parametrize("quantization_config, named", [
    ({"quant_method": "fp8", "activation_scheme": "weird"}, "activation_scheme='weird'"),
    ({"quant_method": "fp8", "fmt": "e5m2"}, "fmt='e5m2'"),
    ({"quant_method": "fp8", "weight_block_size": [128]}, r"weight_block_size=\[128\]"),
    ({"quant_method": "fp8", "activation_scheme": "static", "weight_block_size": [16, 32]}, "static activation"),
    ({"quant_method": "fp8", "kv_cache_scheme": "fp8"}, "kv_cache_scheme"),
    (_ct(format="pack-quantized"), "format='pack-quantized'"),
    (_ct({"num_bits": 4, "type": "int", "strategy": "group", "group_size": 128}, acts=None), "int4 group"),
    (_ct({"symmetric": False}), "asymmetric"),
    (_ct({"type": "int", "strategy": "group", "group_size": 64}), "int8 group group_size=64"),
    (_ct(acts=None), "float8 channel static.*none"),
    (_ct(acts={"num_bits": 8, "type": "float", "strategy": "token", "dynamic": False}), "static activations"),
    ({**CT_CHANNEL, "config_groups": {"g": {**CT_CHANNEL["config_groups"]["group_0"], "targets": ["re:.*q_proj"]}}},
     "targets"),
])
def test_unsupported_configs_are_refused_by_name(tiny_llama, tmp_path, quantization_config, named):
    path = shutil.copytree(tiny_llama, tmp_path / "ckpt")
    cfg = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**cfg, "quantization_config": quantization_config}))
    with pytest.raises(ValueError, match=named):
        EngineConfig(model=str(path), device="cpu").resolve(ModelConfig.from_pretrained(path))


def test_compressed_tensors_dispatch():
    """FP8 goes to our method; INT8 to int8.py's classes (another module), named with their arguments."""
    weights = CT_CHANNEL["config_groups"]["group_0"]["weights"]
    dynamic = CT_CHANNEL["config_groups"]["group_0"]["input_activations"]
    static = {**dynamic, "strategy": "tensor", "dynamic": False}
    path, kwargs = scheme_method({**weights, "strategy": "tensor"}, static)
    assert path == "engine.layers.quantization.fp8:Fp8LinearMethod"
    assert kwargs == {"scheme": fp8.Fp8Scheme("tensor", static_input=True)}
    block = scheme_method({**weights, "strategy": "block", "block_structure": [128, 128]},
                          {**dynamic, "strategy": "group", "group_size": 128})
    assert block[1] == {"scheme": fp8.Fp8Scheme("block", block=(128, 128))}
    int8 = {**weights, "type": "int"}
    int8_acts = {**dynamic, "type": "int"}
    assert scheme_method(int8, int8_acts) == ("engine.layers.quantization.int8:Int8W8A8LinearMethod",
                                              {"strategy": "channel", "static_input_scale": False})
    assert scheme_method({**int8, "strategy": "tensor"}, {**int8_acts, "strategy": "tensor", "dynamic": False}) \
        == ("engine.layers.quantization.int8:Int8W8A8LinearMethod", {"strategy": "tensor", "static_input_scale": True})
    assert scheme_method(int8, None) == ("engine.layers.quantization.int8:Int8WeightOnlyLinearMethod",
                                         {"strategy": "channel"})
    config = get_quantization_config("compressed-tensors", CT_CHANNEL)
    assert config.is_ignored(["lm_head"]) and not config.is_ignored(["model.layers.0.mlp.down_proj"])
