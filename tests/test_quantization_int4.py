"""AWQ and GPTQ int4 checkpoints: a tiny llama quantized and packed here from each format's
documented layout, against HF transformers on the dequantized weights (greedy tokens, and our
logits on both checkpoints); the weights stay packed after loading; TP=2 equals TP=1; what the
layers cannot run is refused at start, naming it."""
import json
import shutil
import zlib

import pytest
import torch
import torch.multiprocessing as mp
from safetensors.torch import load_file, save_file

from engine import LLM, SamplingParams
from engine.config import EngineConfig, ModelConfig
from engine.executor.network_utils import free_port
from engine.executor.parallel_state import destroy_tp_group, init_tp_group
from engine.layers.attention import Attention
from engine.layers.linear import LinearBase
from engine.layers.quantization import get_quantization_config, quantize_linear_layers, quantized_build
from engine.layers.quantization.int4_common import Int4LinearMethod
from engine.loader.weights import load_weights
from engine.models import get_model_class
from tests.hf_reference import assert_matches, hf_greedy
from tests.test_llm import _prompts
from tests.test_models import attach_kv_cache, load_our_model, prompts, run_step

GROUP_SIZE = 32
MAX_TOKENS = 12
LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
AWQ_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]  # AutoAWQ: nibble i of a word holds output 8j + AWQ_ORDER[i]
FORMATS = {
    "awq": {"quant_method": "awq", "bits": 4, "group_size": GROUP_SIZE, "zero_point": True, "version": "gemm"},
    "gptq": {"quant_method": "gptq", "bits": 4, "group_size": GROUP_SIZE, "desc_act": False, "sym": False},
    "gptq-act-order": {"quant_method": "gptq", "bits": 4, "group_size": GROUP_SIZE, "desc_act": True, "sym": False},
}


def quantize(w: torch.Tensor, g_idx: torch.Tensor, num_groups: int):
    """W [N, K] -> codes [K, N], zeros [G, N] (1..15: GPTQ v1 stores zero - 1), fp16 scales [G, N],
    and the dequantized W [N, K]; asymmetric min/max over each group's input rows."""
    wt, g = w.T.float(), g_idx.long()
    lo = torch.stack([wt[g == i].amin(0) for i in range(num_groups)]).clamp(max=0)
    hi = torch.stack([wt[g == i].amax(0) for i in range(num_groups)]).clamp(min=0)
    scales = ((hi - lo) / 15).clamp(min=1e-4).half()
    zeros = (-lo / scales.float()).round().clamp(1, 15).int()
    codes = (wt / scales.float()[g]).round().int().add(zeros[g]).clamp(0, 15)
    return codes, zeros, scales, ((codes - zeros[g]).float() * scales.float()[g]).T


def pack_nibbles(codes: torch.Tensor, dim: int, order=range(8)) -> torch.Tensor:
    """Eight codes along `dim` per int32 word: nibble i holds the code at 8j + order[i]."""
    c = codes.movedim(dim, 0).to(torch.int32)
    words = torch.zeros(c.shape[0] // 8, *c.shape[1:], dtype=torch.int32)
    for i, src in enumerate(order):
        words |= c[src::8] << (4 * i)  # int32 wraps: nibble 7 sets the sign bit, as in the checkpoints
    return words.movedim(0, dim).contiguous()


def pack(fmt: str, w: torch.Tensor, seed: int) -> tuple[dict, torch.Tensor]:
    """One linear's checkpoint tensors in `fmt` (suffix -> tensor) and its dequantized weight."""
    k = w.shape[1]
    g_idx = torch.arange(k, dtype=torch.int32) // GROUP_SIZE
    if fmt == "gptq-act-order":  # groups of rows scattered over K, as act-order leaves them
        g_idx = g_idx[torch.randperm(k, generator=torch.Generator().manual_seed(seed))]
    codes, zeros, scales, dequantized = quantize(w, g_idx, k // GROUP_SIZE)
    if fmt == "awq":
        return {"qweight": pack_nibbles(codes, 1, AWQ_ORDER), "qzeros": pack_nibbles(zeros, 1, AWQ_ORDER),
                "scales": scales}, dequantized
    return {"qweight": pack_nibbles(codes, 0), "qzeros": pack_nibbles(zeros - 1, 1), "scales": scales,
            "g_idx": g_idx}, dequantized


@pytest.fixture(scope="module")
def int4_checkpoints(tiny_llama, tmp_path_factory):
    """{format: (packed checkpoint, checkpoint of the same weights dequantized: HF's oracle)}."""
    tensors = load_file(f"{tiny_llama}/model.safetensors")
    out = {}
    for fmt, quant_config in FORMATS.items():
        packed, dequantized = {}, {}
        for name, t in sorted(tensors.items()):
            module = name.removesuffix(".weight")
            if module.rpartition(".")[2] not in LINEARS:
                packed[name] = dequantized[name] = t
                continue
            # q/k/v and gate/up see the same inputs: GPTQ gives them one act-order (the layer's)
            parts, dequantized[name] = pack(fmt, t, seed=zlib.crc32(module.rpartition(".")[0].encode()))
            packed.update({f"{module}.{suffix}": p for suffix, p in parts.items()})
        paths = []
        for kind, state in ((fmt, packed), (f"{fmt}-dequantized", dequantized)):
            path = shutil.copytree(tiny_llama, tmp_path_factory.mktemp(kind), dirs_exist_ok=True)
            save_file(state, path / "model.safetensors")
            if state is packed:
                cfg = json.loads((path / "config.json").read_text())
                (path / "config.json").write_text(json.dumps({**cfg, "quantization_config": quant_config}))
            paths.append(str(path))
        out[fmt] = tuple(paths)
    return out


def load_quantized(path):
    """Our model on a quantized checkpoint, built as the model runner builds it."""
    config = ModelConfig.from_pretrained(path)
    with quantized_build():
        model = get_model_class(config.architecture)(config)
    quantize_linear_layers(model, get_quantization_config(config.quantization,
                                                          config.hf_config["quantization_config"]))
    for m in model.modules():  # as the model runner does
        if isinstance(m, Attention):
            m.set_backend("torch")
    load_weights(model, path)
    return model.eval()


def run_logits(model) -> torch.Tensor:
    """Prefill of two prompts, then one decode step: logits of every row."""
    seqs = prompts(model.config.vocab_size, lengths=(7, 20))
    attach_kv_cache(model, len(seqs))
    prefill = run_step(model, [(s, t, 0) for s, t in enumerate(seqs)])
    return torch.cat([prefill, run_step(model, [(s, [3], len(t)) for s, t in enumerate(seqs)])])


@pytest.mark.parametrize("fmt", FORMATS)
def test_greedy_equals_hf_on_the_dequantized_weights(int4_checkpoints, fmt):
    packed, dequantized = int4_checkpoints[fmt]
    llm = LLM(packed, dtype="float32", device="cpu")
    ps = _prompts(llm.llm_engine.model_config.vocab_size, (17, 41))
    greedy = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in ps], greedy, use_tqdm=False)
    for p, out in zip(ps, outs):
        assert_matches(out.outputs[0].token_ids, hf_greedy(dequantized, p, MAX_TOKENS), f"{fmt}, {len(p)} tokens")


@pytest.mark.parametrize("fmt", FORMATS)
def test_weights_stay_packed_and_compute_the_dequantized_model(int4_checkpoints, fmt):
    packed, dequantized = int4_checkpoints[fmt]
    model = load_quantized(packed)
    layers = [m for m in model.modules() if isinstance(m, LinearBase)]
    assert layers and all(isinstance(m.quant_method, Int4LinearMethod) for m in layers)
    resident = sum(p.numel() * p.element_size() for m in layers for p in m.parameters())
    on_disk = sum(t.numel() * t.element_size() for name, t in load_file(f"{packed}/model.safetensors").items()
                  if name.endswith((".qweight", ".qzeros", ".scales", ".g_idx")))
    assert on_disk * 0.9 <= resident <= on_disk * 1.1, (resident, on_disk)
    assert all(p.dtype != torch.float32 for m in layers for p in m.parameters())  # no dense copy kept
    torch.testing.assert_close(run_logits(model), run_logits(load_our_model(dequantized)), atol=1e-4, rtol=0)


def _tp_worker(rank: int, port: int, paths: list, out_dir) -> None:
    torch.set_num_threads(1)  # two ranks share the CPU cores
    init_tp_group(rank, 2, f"tcp://127.0.0.1:{port}", backend="gloo")
    try:
        for i, path in enumerate(paths):
            logits = run_logits(load_quantized(path))
            if rank == 0:
                torch.save(logits, out_dir / f"logits{i}.pt")
    finally:
        destroy_tp_group()


def test_tp2_logits_equal_tp1(int4_checkpoints, tmp_path):
    """Packed outputs split per rank and per q/k/v part, groups per rank along the inputs; act-order's
    row-parallel layers keep every group on both ranks and split only g_idx."""
    paths = [int4_checkpoints[fmt][0] for fmt in FORMATS]
    mp.spawn(_tp_worker, args=(free_port(), paths, tmp_path), nprocs=2, join=True)
    for i, path in enumerate(paths):
        torch.testing.assert_close(torch.load(tmp_path / f"logits{i}.pt"), run_logits(load_quantized(path)),
                                   atol=1e-4, rtol=0)


@pytest.mark.parametrize("quantization_config, named", [
    ({**FORMATS["awq"], "bits": 8}, "bits=8"),
    ({**FORMATS["awq"], "group_size": 16}, "group_size=16"),
    ({**FORMATS["awq"], "version": "gemv"}, "version='gemv'"),
    ({**FORMATS["awq"], "version": "marlin"}, "version='marlin'"),
    ({**FORMATS["awq"], "zero_point": False}, "zero_point=False"),
    ({**FORMATS["gptq"], "bits": 3}, "bits=3"),
    ({**FORMATS["gptq"], "group_size": 256}, "group_size=256"),
    ({**FORMATS["gptq"], "checkpoint_format": "gptq_v2"}, "checkpoint_format='gptq_v2'"),
    ({**FORMATS["gptq"], "checkpoint_format": "marlin"}, "checkpoint_format='marlin'"),
    ({**FORMATS["gptq"], "dynamic": {"-:.*down_proj": {}}}, "dynamic="),
])
def test_unsupported_settings_fail_at_start_naming_them(tiny_llama, tmp_path, quantization_config, named):
    path = shutil.copytree(tiny_llama, tmp_path / "ckpt")
    cfg = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**cfg, "quantization_config": quantization_config}))
    with pytest.raises(ValueError, match=named):
        EngineConfig(model=str(path), device="cpu").resolve(ModelConfig.from_pretrained(path))


def test_fused_parts_with_different_act_orders_are_refused():
    from engine.layers.linear import QKVParallelLinear

    with quantized_build():
        layer = QKVParallelLinear(64, 16, 4, 2)
    layer.set_quant_method(get_quantization_config("gptq", FORMATS["gptq-act-order"]).get_linear_method(layer, "qkv"))
    g_idx = torch.arange(64, dtype=torch.int32) // GROUP_SIZE
    for shard_id in "qkv":
        layer.weight_loader(layer.g_idx, g_idx if shard_id != "v" else g_idx.flip(0), shard_id)
    with pytest.raises(ValueError, match="fused parts of a layer have different g_idx"):
        layer.process_weights_after_loading()
