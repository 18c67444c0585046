"""The CPU fused decoder layer (engine/layers/cpu_fused_layer.py, kernels/cpu_decoder_layer.c): every
step it takes gives the modules' logits to the bit (fp32 and bf16; a first layer, decodes, chunks
with a cached prefix, a sliding window, static activation scales); steps and layers it cannot take
run the modules; bad metadata is named."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from engine import LLM, SamplingParams
from engine.layers import cpu_fused_layer
from engine.models.llama import LlamaDecoderLayer
from engine.tools.tiny_model import make_tiny_model
from engine.tools.w8a8_checkpoint import write_w8a8_checkpoint
from engine.worker.forward_context import set_forward_context
from kernels import cpu_decoder_layer
from tests.test_models import attach_kv_cache, make_step, prompts, run_step

pytestmark = pytest.mark.skipif(not cpu_decoder_layer.available(), reason="no AVX-512 VNNI here, or no C compiler")


def _w8a8(tmp_path_factory, arch: str, edit=None) -> str:
    src = make_tiny_model(tmp_path_factory.mktemp(arch), arch=arch, seed=0)
    path = write_w8a8_checkpoint(src, tmp_path_factory.mktemp(f"{arch}-w8a8"))
    if edit is not None:
        edit(Path(path))
    return str(path)


def _sliding_window(path: Path) -> None:
    """Mistral attending 16 keys back: the decode and chunk steps below reach past it."""
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, "sliding_window": 16}))


def _static_scales(path: Path) -> None:
    """llm-compressor's static per-tensor activation scales: one `input_scale` per projection."""
    config = json.loads((path / "config.json").read_text())
    group = config["quantization_config"]["config_groups"]["group_0"]
    group["input_activations"].update(dynamic=False, strategy="tensor")
    (path / "config.json").write_text(json.dumps(config))
    tensors = load_file(path / "model.safetensors")
    for name in [n for n in tensors if n.endswith("_proj.weight_scale")]:
        tensors[name.replace("weight_scale", "input_scale")] = torch.tensor([0.02], dtype=torch.float32)
    save_file(tensors, path / "model.safetensors")


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    return {"llama": _w8a8(tmp_path_factory, "llama"),
            "mistral-window": _w8a8(tmp_path_factory, "mistral", _sliding_window),
            "llama-static": _w8a8(tmp_path_factory, "llama", _static_scales),
            "qwen3": _w8a8(tmp_path_factory, "qwen3")}


def _model(path: str, dtype: str):
    llm = LLM(path, dtype=dtype, device="cpu", enable_prefix_caching=False)
    model = llm.llm_engine.executor.runner.model
    return llm, model, [m for m in model.modules() if isinstance(m, LlamaDecoderLayer)]


def _set_fused(layers, fused) -> None:
    for layer, f in zip(layers, fused):
        layer.fused = f


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("name", ["llama", "mistral-window", "llama-static"])
def test_fused_steps_equal_the_modules_to_the_bit(checkpoints, name, dtype, monkeypatch):
    _, model, layers = _model(checkpoints[name], dtype)
    fused = [layer.fused for layer in layers]
    assert all(f is not None for f in fused)
    assert layers[0].self_attn.qkv_proj.quant_method.static_input_scale == (name == "llama-static")
    calls = []
    run = cpu_decoder_layer.run_decoder_layer
    monkeypatch.setattr(cpu_decoder_layer, "run_decoder_layer", lambda a: (calls.append(a.n), run(a))[1])
    seqs = prompts(model.config.vocab_size, lengths=(7, 20, 40, 30))
    attach_kv_cache(model, len(seqs), getattr(torch, dtype))
    steps = [
        [(s, t[:-3], 0) for s, t in enumerate(seqs[:3])],                   # first chunks: the first layer's own norm buffer
        [(s, t[-3:], len(t) - 3) for s, t in enumerate(seqs[:3])],          # chunks after a cached prefix
        [(s, [5], len(t)) for s, t in enumerate(seqs[:3])] + [(3, seqs[3][:9], 0)],  # decodes beside a fresh chunk
        [(s, [9], len(t) + 1) for s, t in enumerate(seqs[:3])],             # decodes past the window of 16
    ]
    for i, chunks in enumerate(steps):
        calls.clear()
        with torch.inference_mode():
            got = run_step(model, chunks)
            assert calls == [sum(len(c[1]) for c in chunks)] * len(layers), (i, calls)
            _set_fused(layers, [None] * len(layers))
            want = run_step(model, chunks)  # the same slots written again, then read
            _set_fused(layers, fused)
        torch.testing.assert_close(got, want, atol=0, rtol=0, msg=f"step {i}")
    # A chunk longer than the attention kernel takes (kernel_max_q_len: SDPA's) runs the modules;
    # the limit is lowered here so the test's small caches hold such a chunk.
    calls.clear()
    for f in fused:
        f.max_q_len = 8
    with torch.inference_mode():
        run_step(model, [(3, list(range(3, 12)), 9)])
    assert calls == []


def test_the_engine_decodes_the_same_tokens_and_logprobs_fused(checkpoints):
    llm, _, layers = _model(checkpoints["llama"], "bfloat16")
    fused = [layer.fused for layer in layers]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=2)
    ps = [{"prompt_token_ids": p} for p in prompts(llm.llm_engine.model_config.vocab_size, (1, 5, 70, 130))]
    runs = []
    for f in (fused, [None] * len(layers)):
        _set_fused(layers, f)
        outs = llm.generate(ps, params, use_tqdm=False)
        runs.append([(o.outputs[0].token_ids, [{t: lp.logprob for t, lp in d.items()} for d in o.outputs[0].logprobs])
                     for o in outs])
    assert runs[0] == runs[1]


def test_layers_it_cannot_take_keep_their_modules(checkpoints, tmp_path):
    _, _, layers = _model(checkpoints["qwen3"], "bfloat16")
    assert all(layer.fused is None for layer in layers)
    assert "q/k norms" in cpu_fused_layer.why_not_fused(layers[0], torch.bfloat16)
    plain = make_tiny_model(tmp_path / "plain", arch="llama", seed=0)
    _, _, layers = _model(str(plain), "bfloat16")
    assert all(layer.fused is None for layer in layers)
    assert "not INT8 W8A8" in cpu_fused_layer.why_not_fused(layers[0], torch.bfloat16)
    _, _, layers = _model(checkpoints["llama"], "float32")
    assert "activations are torch.float16" in cpu_fused_layer.why_not_fused(layers[0], torch.float16)
    llm = LLM(checkpoints["llama"], dtype="bfloat16", device="cpu", enable_lora=True, max_lora_rank=8)
    runner = llm.llm_engine.executor.runner
    assert all(m.fused is None for m in runner.model.modules() if isinstance(m, LlamaDecoderLayer))


def test_a_slot_past_the_cache_is_named(checkpoints):
    _, model, layers = _model(checkpoints["llama"], "float32")
    attach_kv_cache(model, 1)
    x = torch.randn(2, model.config.hidden_size)
    input_ids, positions, md = make_step([(0, [1, 2], 0)])
    md.slot_mapping[1] = layers[0].self_attn.attn.k_cache.shape[0] * layers[0].self_attn.attn.k_cache.shape[1]
    with torch.inference_mode(), set_forward_context(md), pytest.raises(ValueError, match="slot_mapping"):
        layers[0].fused(positions, x, None)


def test_the_library_is_rebuilt_when_a_file_it_includes_changes(tmp_path):
    """cpu_decoder_layer.c includes three kernel sources whole: their bytes are part of its build key."""
    from kernels import cpu_build

    (tmp_path / "part.c").write_text("int f(void) { return 1; }\n")
    source = tmp_path / "whole.c"
    source.write_text('#include "part.c"\nint g(void) { return f(); }\n')
    assert cpu_build._included_sources(source) == [b"int f(void) { return 1; }\n"]
    layer = Path(cpu_decoder_layer.__file__).with_name("cpu_decoder_layer.c")
    assert len(cpu_build._included_sources(layer)) == 3
