"""INT8 weights (engine/layers/quantization/int8.py): online W8A16 end to end against HF on the
dequantized weights, the compressed-tensors methods on one fused layer against torch, the memory
they keep, and TP=2 against TP=1."""
from __future__ import annotations

import shutil

import pytest
import torch
import torch.multiprocessing as mp
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

from engine import LLM, SamplingParams
from engine.config import ModelConfig
from engine.executor.network_utils import free_port
from engine.layers.attention import Attention
from engine.layers.linear import LinearBase, QKVParallelLinear, RowParallelLinear
from engine.layers.quantization import quantize_linear_layers, quantized_build
from engine.layers.quantization import get_quantization_config, int8
from engine.layers.quantization.int8 import (Int8Config, Int8W8A8LinearMethod, Int8WeightOnlyLinearMethod,
                                             quantize_per_channel)
from engine.loader.weights import load_weights
from engine.models import get_model_class
from engine.tools.tiny_model import make_tiny_model
from engine.tools.w8a8_checkpoint import write_w8a8_checkpoint
from kernels import cpu_int8
from tests import hf_reference
from tests.hf_reference import assert_matches, hf_greedy
from tests.test_llm import _prompts

MAX_TOKENS = 12
BF16_NEAR_TIE = 0.05
LINEAR_WEIGHTS = ("_proj.weight",)  # q/k/v/o, gate/up/down: what the engine builds as LinearBase


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """(the tiny llama in fp32, the same with every linear weight replaced by int8 * scale as the
    online method quantizes it: HF's oracle)."""
    path = make_tiny_model(tmp_path_factory.mktemp("tiny-llama"), arch="llama", seed=0)
    deq = shutil.copytree(path, tmp_path_factory.mktemp("tiny-llama-int8-dequantized"), dirs_exist_ok=True)
    tensors = load_file(f"{path}/model.safetensors")
    for name, t in tensors.items():
        if name.endswith(LINEAR_WEIGHTS):
            q, scale = quantize_per_channel(t, round_scale_to=torch.bfloat16)
            tensors[name] = q.float() * scale[:, None]
    save_file(tensors, deq / "model.safetensors")
    return str(path), str(deq)


@pytest.mark.parametrize("regime", [{}, {"max_num_batched_tokens": 48}])
def test_online_int8_equals_hf_on_the_dequantized_weights(checkpoints, regime, monkeypatch):
    """Decode batches of 4 run `_weight_int8pack_mm`, the 130- and 333-token prefills the widened
    weight (both chunked too). W8A16 computes with bf16 activations and outputs where HF runs fp32:
    logits move by ~1e-2 here, so a step whose top-2 gap is under BF16_NEAR_TIE may flip."""
    monkeypatch.setattr(hf_reference, "NEAR_TIE", BF16_NEAR_TIE)
    path, dequantized = checkpoints
    llm = LLM(path, quantization="int8", dtype="float32", device="cpu", **regime)
    prompts = _prompts(llm.llm_engine.model_config.vocab_size, (1, 3, 130, 333))
    greedy = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], greedy, use_tqdm=False)
    for p, out in zip(prompts, outs):
        assert_matches(out.outputs[0].token_ids, hf_greedy(dequantized, p, MAX_TOKENS), f"prompt of {len(p)} tokens")


def load_int8_model(path: str, quant_config=None) -> torch.nn.Module:
    """As the model runner builds it with quantization="int8", or with the checkpoint's own
    `quant_config` (fp32, CPU)."""
    config = ModelConfig.from_pretrained(path)
    with quantized_build():
        model = get_model_class(config.architecture)(config)
    quantize_linear_layers(model, quant_config or Int8Config.from_config({}))
    for m in model.modules():
        if isinstance(m, Attention):
            m.set_backend("torch")
    load_weights(model, path)
    return model.eval()


def test_resident_weights_are_int8(checkpoints):
    """Every linear keeps its int8 weight and scales only: resident bytes within 10% of one byte
    per weight, the fp32 copy freed."""
    model = load_int8_model(checkpoints[0])
    linears = [m for m in model.modules() if isinstance(m, LinearBase)]
    assert len(linears) == 2 * 4  # qkv, o, gate_up, down per layer
    packed = sum(m.output_size * m.input_size for m in linears)
    resident = sum(t.numel() * t.element_size() for m in linears for t in [*m.parameters(), *m.buffers()])
    assert all(m.weight.dtype == torch.int8 for m in linears)
    assert packed <= resident <= 1.1 * packed, (resident, packed)


def test_refuses_what_it_cannot_run():
    with pytest.raises(ValueError, match="bits"):
        Int8Config.from_config({"bits": 4})
    with pytest.raises(ValueError, match="'group'"):
        Int8WeightOnlyLinearMethod("group")
    with pytest.raises(ValueError, match="'block'"):
        Int8W8A8LinearMethod("block", static_input_scale=False)


# -- the compressed-tensors methods on one fused layer --------------------------------------------
HIDDEN, HEADS, KV_HEADS, HEAD_DIM = 96, 4, 2, 16
PARTS = {"q": HEADS * HEAD_DIM, "k": KV_HEADS * HEAD_DIM, "v": KV_HEADS * HEAD_DIM}


def _checkpoint_parts(strategy: str, gen: torch.Generator) -> dict:
    """q, k and v as compressed-tensors stores them: int8 [out, in] with weight_scale [out, 1]
    (channel) or [1] (tensor), and an input_scale [1] each; plus the dequantized fp32 weight."""
    parts = {}
    for shard_id, rows in PARTS.items():
        w = torch.randn(rows, HIDDEN, generator=gen) * HIDDEN ** -0.5
        if strategy == "channel":
            q, scale = quantize_per_channel(w)
            scale = scale[:, None]
        else:
            scale = (w.abs().amax() / 127).reshape(1)
            q = torch.round(w / scale).clamp(-127, 127).to(torch.int8)
        input_scale = torch.rand(1, generator=gen) * 0.01 + 0.02
        parts[shard_id] = dict(weight=q, weight_scale=scale, input_scale=input_scale, dense=q.float() * scale)
    return parts


def _qkv_layer(method, parts: dict) -> QKVParallelLinear:
    with quantized_build():
        layer = QKVParallelLinear(HIDDEN, HEAD_DIM, HEADS, KV_HEADS, bias=True)
    layer.set_quant_method(method)
    for shard_id, tensors in parts.items():
        for name, param in layer.named_parameters():
            if name != "bias":
                param.weight_loader(param, tensors[name], shard_id)
        layer.bias.weight_loader(layer.bias, tensors["bias"], shard_id)
    layer.process_weights_after_loading()
    return layer


@pytest.mark.parametrize("strategy", ["channel", "tensor"])
@pytest.mark.parametrize("rows", [1, 40])  # W8A16: both CPU kernels (_weight_int8pack_mm, widened weight)
def test_weight_only_method_against_torch(strategy, rows):
    gen = torch.Generator().manual_seed(1)
    parts = _checkpoint_parts(strategy, gen)
    for t in parts.values():
        t["bias"] = torch.randn(t["weight"].shape[0], generator=gen)
    layer = _qkv_layer(Int8WeightOnlyLinearMethod(strategy), parts)
    weight = torch.cat([t["dense"] for t in parts.values()])
    bias = torch.cat([t["bias"] for t in parts.values()])
    x = torch.randn(rows, HIDDEN, generator=gen)
    y = layer(x)
    # Activations, scales and the matmul's output are bf16 on CPU (the "16" of W8A16): 8 bits of
    # mantissa, so ~2^-8 of the output's size.
    torch.testing.assert_close(y, F.linear(x, weight, bias), atol=1e-2 * F.linear(x, weight).abs().max().item(),
                               rtol=0)
    assert layer.weight.dtype == torch.int8 and layer.weight_scale.shape == (weight.shape[0],)


def _use_vnni(monkeypatch, vnni: bool) -> None:
    """vnni: the C kernel (skipped where it does not run); False: the torch path, as without VNNI."""
    if vnni and not cpu_int8.available():
        pytest.skip("no AVX-512 VNNI here, or no C compiler")
    if not vnni:
        monkeypatch.setattr(cpu_int8, "available", lambda: False)


@pytest.mark.parametrize("strategy", ["channel", "tensor"])
@pytest.mark.parametrize("static", [False, True])
@pytest.mark.parametrize("rows", [1, 40])
@pytest.mark.parametrize("vnni", [True, False])
def test_w8a8_method_against_torch(strategy, static, rows, vnni, monkeypatch):
    _use_vnni(monkeypatch, vnni)
    gen = torch.Generator().manual_seed(2)
    parts = _checkpoint_parts(strategy, gen)
    for t in parts.values():
        t["bias"] = torch.zeros(t["weight"].shape[0])
    layer = _qkv_layer(Int8W8A8LinearMethod(strategy, static_input_scale=static), parts)
    assert layer.quant_method.matmul is (int8.w8a8_linear_vnni if vnni else int8.w8a8_linear_torch)
    weight = torch.cat([t["dense"] for t in parts.values()]).double()
    x = torch.randn(rows, HIDDEN, generator=gen)
    if static:  # the fused layer quantizes its input once, by the largest part's scale
        x_scale = torch.cat([t["input_scale"] for t in parts.values()]).max().double()
    else:
        x_scale = x.abs().amax(1, keepdim=True).double() / 127
    qx = torch.round(x.double() / x_scale).clamp(-127, 127)
    y = layer(x)
    # Against the same int8 activations in float64: int32 accumulation is exact, so only the fp32
    # scaling differs (~1e-7 relative).
    torch.testing.assert_close(y.double(), F.linear(qx * x_scale, weight), rtol=1e-5, atol=1e-5)
    # Against the unquantized activations: int8 rounding of x (half a step, 1/254 of the row's or
    # the static range) and clipping by a static scale; 5% of the output's size bounds both here.
    ref = F.linear(x.double(), weight)
    torch.testing.assert_close(y.double(), ref, atol=0.05 * ref.abs().max().item(), rtol=0)


def test_row_parallel_tensor_scale_unfused():
    """An unfused layer's per-tensor scale: one entry, no shard id."""
    gen = torch.Generator().manual_seed(3)
    w = torch.randn(32, 48, generator=gen)
    scale = (w.abs().amax() / 127).reshape(1)
    q = torch.round(w / scale).clamp(-127, 127).to(torch.int8)
    with quantized_build():
        layer = RowParallelLinear(48, 32)
    layer.set_quant_method(Int8W8A8LinearMethod("tensor", static_input_scale=False))
    layer.weight.weight_loader(layer.weight, q)
    layer.weight_scale.weight_loader(layer.weight_scale, scale)
    layer.process_weights_after_loading()
    x = torch.randn(5, 48, generator=gen)
    ref = F.linear(x, q.float() * scale)
    torch.testing.assert_close(layer(x), ref, atol=0.05 * ref.abs().max().item(), rtol=0)


# -- a compressed-tensors W8A8 checkpoint through the engine -------------------------------------
@pytest.fixture(scope="module")
def w8a8_checkpoints(checkpoints, tmp_path_factory):
    """(the tiny llama as llm-compressor's INT8 W8A8: per channel, dynamic per token; the same
    weights dequantized, plain: HF's oracle)."""
    path = write_w8a8_checkpoint(checkpoints[0], tmp_path_factory.mktemp("tiny-llama-w8a8"))
    deq = shutil.copytree(checkpoints[0], tmp_path_factory.mktemp("tiny-llama-w8a8-dequantized"), dirs_exist_ok=True)
    tensors = load_file(f"{path}/model.safetensors")
    plain = {name: t for name, t in tensors.items() if not name.endswith("weight_scale")}
    for name, t in tensors.items():
        if name.endswith("weight_scale"):
            weight = name[: -len("_scale")]
            plain[weight] = tensors[weight].float() * t
    save_file(plain, deq / "model.safetensors")
    return str(path), str(deq)


def _w8a8_run(path: str):
    """Prefill of two prompts, then one decode step each: (logits of every row, the prompts, the model)."""
    from tests.test_models import attach_kv_cache, prompts, run_step

    quant_config = get_quantization_config("compressed-tensors",
                                           ModelConfig.from_pretrained(path).hf_config["quantization_config"])
    model = load_int8_model(path, quant_config)
    seqs = prompts(model.config.vocab_size, lengths=(7, 20))
    attach_kv_cache(model, len(seqs))
    prefill = run_step(model, [(s, t, 0) for s, t in enumerate(seqs)])
    decode = run_step(model, [(s, [3], len(t)) for s, t in enumerate(seqs)])
    return torch.cat([prefill, decode]), seqs, model


def test_w8a8_checkpoint_vnni_equals_the_torch_path(w8a8_checkpoints, monkeypatch):
    """Every linear through the VNNI kernel, its weight repacked (one byte per weight still, and 8
    per output: the fp32 scale, the int32 correction), gives the torch path's logits exactly: the
    same int32 sums, scaled by the same fp32 operations."""
    _use_vnni(monkeypatch, True)
    logits, _, model = _w8a8_run(w8a8_checkpoints[0])
    linears = [m for m in model.modules() if isinstance(m, LinearBase)]
    assert all(m.quant_method.matmul is int8.w8a8_linear_vnni and not hasattr(m, "weight") for m in linears)
    packed = sum(m.output_size * m.input_size for m in linears)
    per_output = 8 * sum(m.output_size for m in linears)
    resident = sum(t.numel() * t.element_size() for m in linears for t in [*m.parameters(), *m.buffers()])
    assert packed + per_output <= resident <= 1.1 * packed + per_output, (resident, packed, per_output)
    _use_vnni(monkeypatch, False)
    torch_logits, _, torch_model = _w8a8_run(w8a8_checkpoints[0])
    assert torch_model.model.layers[0].mlp.down_proj.quant_method.matmul is int8.w8a8_linear_torch
    torch.testing.assert_close(logits, torch_logits, atol=0, rtol=0)


def test_w8a8_checkpoint_within_tolerance_of_hf(w8a8_checkpoints):
    """Activations quantized per token (half a step of 1/127 of each row's absmax) move the prefill
    logits from HF's on the dequantized weights: within 5% of their range, and above 1e-3 of it,
    which shows the activations were quantized (weight-only int8 here would be ~1e-6)."""
    logits, seqs, _ = _w8a8_run(w8a8_checkpoints[0])
    hf = hf_reference.load_hf(w8a8_checkpoints[1])
    with torch.inference_mode():
        ref = torch.cat([hf(torch.tensor([s])).logits[0].float() for s in seqs])
    ours = logits[: ref.shape[0]]
    spread = (ref.max() - ref.min()).item()
    err = (ours - ref).abs().max().item()
    assert 1e-3 * spread < err < 0.05 * spread, (err, spread)
    assert (ours.argmax(-1) == ref.argmax(-1)).float().mean() > 0.75


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_w8a8_engine_greedy_vnni_equals_the_torch_path(w8a8_checkpoints, dtype, monkeypatch):
    """The engine on the checkpoint (decode batches and 130- / 333-token prefills; bf16: the
    kernel takes and returns bf16): the same greedy tokens with and without the kernel."""
    greedy = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    runs = []
    for vnni in (True, False):
        _use_vnni(monkeypatch, vnni)
        llm = LLM(w8a8_checkpoints[0], dtype=dtype, device="cpu")
        qkv = llm.llm_engine.executor.runner.model.model.layers[0].self_attn.qkv_proj
        assert qkv.quant_method.matmul is (int8.w8a8_linear_vnni if vnni else int8.w8a8_linear_torch)
        prompts = _prompts(llm.llm_engine.model_config.vocab_size, (1, 3, 130, 333))
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], greedy, use_tqdm=False)
        runs.append([o.outputs[0].token_ids for o in outs])
    assert runs[0] == runs[1]


# -- tensor parallelism ---------------------------------------------------------------------------
ROW_PARALLEL = ("self_attn.o_proj", "mlp.down_proj")


def _run_int8(path: str) -> tuple[torch.Tensor, dict]:
    """Prefill of two prompts, then one decode step: (logits of every row, layer 0's row-parallel
    int8 weights and scales)."""
    from tests.test_models import attach_kv_cache, prompts, run_step

    model = load_int8_model(path)
    seqs = prompts(model.config.vocab_size, lengths=(7, 20))
    attach_kv_cache(model, len(seqs))
    prefill = run_step(model, [(s, t, 0) for s, t in enumerate(seqs)])
    decode = run_step(model, [(s, [3], len(t)) for s, t in enumerate(seqs)])
    layer = model.model.layers[0]
    quantized = {name: (layer.get_submodule(name).weight, layer.get_submodule(name).weight_scale)
                 for name in ROW_PARALLEL}
    return torch.cat([prefill, decode]), quantized


def _tp_worker(rank: int, port: int, path: str, out_dir) -> None:
    from engine.executor.parallel_state import destroy_tp_group, init_tp_group
    from tests.test_tensor_parallel import TP_SIZE

    torch.set_num_threads(1)  # two ranks share the CPU cores
    init_tp_group(rank, TP_SIZE, f"tcp://127.0.0.1:{port}", backend="gloo")
    try:
        torch.save(_run_int8(path), out_dir / f"rank{rank}.pt")
    finally:
        destroy_tp_group()


def test_tp2_equals_tp1(checkpoints, tmp_path):
    """Column-parallel ranks quantize their own rows; row-parallel ones (o, down) half of each row,
    by the whole row's absmax (all-reduced), so both runs hold the same int8 weights and scales."""
    from tests.test_tensor_parallel import TP_SIZE

    mp.spawn(_tp_worker, args=(free_port(), checkpoints[0], tmp_path), nprocs=TP_SIZE, join=True)
    logits, quantized = _run_int8(checkpoints[0])
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(TP_SIZE)]
    for name, (weight, scale) in quantized.items():
        assert torch.equal(torch.cat([r[1][name][0] for r in ranks], dim=1), weight), name
        assert all(torch.equal(r[1][name][1], scale) for r in ranks), name
    # The same weights, summed in another order, each rank's partial output rounded to bf16 before
    # the all-reduce: measured 0.07 here (0.14 with each rank scaling by its own half-row).
    torch.testing.assert_close(ranks[0][0], logits, atol=0.02 * logits.abs().max().item(), rtol=0)
