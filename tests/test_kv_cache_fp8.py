"""kv_cache_dtype="fp8" in the engine: the knob, the scales from a checkpoint, the block budget,
and a tiny model's outputs against the full-precision cache (CPU: the torch backend; the Triton
backend under the interpreter)."""
import json
import shutil

import pytest
import torch
from safetensors.torch import save_file

from engine import LLM, SamplingParams
from engine.config import EngineConfig, ModelConfig
from engine.loader.kv_scales import layer_kv_scales, read_kv_scales

PROMPT = {"prompt_token_ids": [(7 * i + 3) % 200 + 5 for i in range(40)]}  # 3 blocks of 16


def _llm(path, **kw):
    return LLM(path, device="cpu", dtype=kw.pop("dtype", "float32"), num_kv_blocks=kw.pop("num_kv_blocks", 16),
               enable_prefix_caching=False, **kw)


def _prompt_logprobs(llm) -> torch.Tensor:
    """Teacher-forced log-probabilities of the prompt's tokens 1..n-1 (each row reads the cache)."""
    out = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0), use_tqdm=False)[0]
    ids = PROMPT["prompt_token_ids"]
    return torch.tensor([entry[ids[i]].logprob for i, entry in enumerate(out.prompt_logprobs) if entry is not None])


def test_knob_is_validated_naming_it():
    with pytest.raises(ValueError, match="kv_cache_dtype='fp8_e5m2' is invalid"):
        EngineConfig(model="m", kv_cache_dtype="fp8_e5m2")


def test_fp8_needs_sm89_on_cuda(monkeypatch, tiny_llama):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (8, 0))
    with pytest.raises(ValueError, match=r"kv_cache_dtype='fp8' needs a GPU of compute capability >= 8.9 .* 8.0"):
        EngineConfig(model=tiny_llama, device="cuda", kv_cache_dtype="fp8").resolve(
            ModelConfig.from_pretrained(tiny_llama))


def test_blocks_for_the_same_budget(tiny_llama):
    """1 byte per cached element: twice bf16's blocks, four times fp32's, for the same cpu_kv_cache_gb."""
    blocks = {}
    for dtype, kv in (("float32", "auto"), ("bfloat16", "auto"), ("float32", "fp8"), ("bfloat16", "fp8")):
        with _llm(tiny_llama, dtype=dtype, kv_cache_dtype=kv, num_kv_blocks=None, cpu_kv_cache_gb=0.01,
                  max_num_seqs=4096) as llm:
            runner = llm.llm_engine.executor.runner
            blocks[dtype, kv] = runner.num_kv_blocks
            if kv == "fp8":
                assert runner.attn_layers[0].k_cache.dtype == torch.float8_e4m3fn
                assert runner.kv_cache_bytes == 2 * runner.num_kv_blocks * runner.attn_layers[0].k_cache[0].numel() \
                    * len(runner.attn_layers)
    assert blocks["float32", "fp8"] == blocks["bfloat16", "fp8"]  # the model's dtype no longer matters
    fp8, bf16, fp32 = blocks["float32", "fp8"], blocks["bfloat16", "auto"], blocks["float32", "auto"]
    # Budget // bytes per block: exact ratios up to the floor division.
    assert 2 * bf16 <= fp8 < 2 * (bf16 + 1), blocks
    assert 4 * fp32 <= fp8 < 4 * (fp32 + 1), blocks


def test_logits_close_to_full_precision_cache(tiny_llama):
    """Prompt log-probs (40 tokens, chunks of 16 reading the earlier ones from the cache) with an fp8
    cache against the fp32 cache.

    e4m3 keeps 3 mantissa bits, so each cached value is off by up to 6.25% (K/V here are ~0.8 on
    average, 4.4 at most: well inside e4m3's range at scale 1.0, so this is rounding, not range;
    scales calibrated to amax / 448 measured no better). Through the two layers of this random
    tiny model that moved log-probs by 0.068 nats on average, 0.18 at most (seed 0), against a
    spread of 4.8 nats (std) between positions. Bounds: twice the measurement (0.15 mean, 0.4 max);
    the floor catches an fp8 cache that was never used.
    """
    with _llm(tiny_llama, max_num_batched_tokens=16) as llm:
        full = _prompt_logprobs(llm)
    with _llm(tiny_llama, kv_cache_dtype="fp8", max_num_batched_tokens=16) as llm:
        fp8 = _prompt_logprobs(llm)
        assert llm.llm_engine.executor.runner.attn_layers[0].k_cache.dtype == torch.float8_e4m3fn
    err = (fp8 - full).abs()
    assert err.mean() < 0.15 and err.max() < 0.4, err
    assert err.max() > 1e-4  # quantized: not the full-precision numbers
    assert full.std() > 10 * err.max()  # the log-probs span far more than the error


def _with_kv_scales(tmp_path, path, scales: dict) -> str:
    """A copy of the checkpoint at `path` with extra scale tensors in a file of their own."""
    out = tmp_path / "with_scales"
    shutil.copytree(path, out)
    save_file({name: torch.tensor(v) for name, v in scales.items()}, str(out / "kv_scales.safetensors"))
    index = out / "model.safetensors.index.json"
    if index.is_file():
        data = json.loads(index.read_text())
        data["weight_map"].update({name: "kv_scales.safetensors" for name in scales})
        index.write_text(json.dumps(data))
    return str(out)


def test_checkpoint_scales_are_loaded_by_vllm_rules(tmp_path, tiny_llama):
    scales = {"model.layers.0.self_attn.k_scale": 0.5, "model.layers.0.self_attn.v_scale": 0.25,
              "model.layers.1.self_attn.kv_scale": 2.0}
    path = _with_kv_scales(tmp_path, tiny_llama, scales)
    with _llm(path, kv_cache_dtype="fp8") as llm:
        layers = llm.llm_engine.executor.runner.attn_layers
        got = [(layer.k_scale.item(), layer.v_scale.item()) for layer in layers]
        out = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=3, ignore_eos=True), use_tqdm=False)
        assert len(out[0].outputs[0].token_ids) == 3
    assert got[:2] == [(0.5, 0.25), (2.0, 2.0)]
    with _llm(path) as llm:  # the scale tensors are no unexpected weights for a model-dtype cache
        assert llm.llm_engine.executor.runner.attn_layers[0].k_scale is None


def test_scale_rules_and_bad_scales(tmp_path):
    scales = {"a.self_attn.k_scale": 0.5, "b.self_attn.v_scale": 3.0, "c.self_attn.kv_scale": 2.0}
    assert layer_kv_scales(scales, "a.self_attn") == (0.5, 0.5)  # one given: the larger for both
    assert layer_kv_scales(scales, "b.self_attn") == (3.0, 3.0)
    assert layer_kv_scales(scales, "c.self_attn") == (2.0, 2.0)  # the older single name
    assert layer_kv_scales(scales, "d.self_attn") == (1.0, 1.0)  # none
    save_file({"model.layers.0.self_attn.k_scale": torch.ones(4)}, str(tmp_path / "m.safetensors"))
    with pytest.raises(ValueError, match=r"model.layers.0.self_attn.k_scale has shape \(4,\): .*per-tensor"):
        read_kv_scales(tmp_path)
    save_file({"model.layers.0.self_attn.k_scale": torch.tensor(-1.0)}, str(tmp_path / "m.safetensors"))
    with pytest.raises(ValueError, match=r"k_scale = -1.0 is invalid"):
        read_kv_scales(tmp_path)


def test_triton_backend_matches_torch_backend_with_fp8(tiny_llama):
    """The Triton kernels (interpreter) and the torch path store and read the same e4m3 bytes: the
    engine hands both the layers' scales. fp32 model, so only summation order differs."""
    from tests.triton_device import DEVICE  # sets the interpreter up

    assert DEVICE == "cpu" or pytest.skip("the CUDA run of this is tests/test_llm.py's territory")
    with _llm(tiny_llama, kv_cache_dtype="fp8", max_num_batched_tokens=16) as llm:
        torch_lp = _prompt_logprobs(llm)
    with _llm(tiny_llama, kv_cache_dtype="fp8", max_num_batched_tokens=16, attention_backend="triton") as llm:
        triton_lp = _prompt_logprobs(llm)
        layer = llm.llm_engine.executor.runner.attn_layers[0]
        assert layer.backend == "triton" and layer.k_cache.dtype == torch.float8_e4m3fn
    torch.testing.assert_close(triton_lp, torch_lp, atol=2e-3, rtol=0)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_fp8_cache_with_graphs_close_to_bf16(tiny_llama):
    """On a GPU (sm_89+): the Triton kernels natively, CUDA graphs on, against the bf16 cache. bf16
    itself moves these log-probs by ~0.02 nats, so the CPU test's bounds hold with room."""
    if torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("fp8 KV cache needs compute capability >= 8.9")
    lps = {}
    for kv in ("auto", "fp8"):
        with LLM(tiny_llama, device="cuda", dtype="bfloat16", kv_cache_dtype=kv, num_kv_blocks=64,
                 enable_prefix_caching=False, max_num_batched_tokens=16) as llm:
            lps[kv] = _prompt_logprobs(llm)
            assert llm.llm_engine.executor.runner.graph_runner is not None
            out = llm.generate([PROMPT] * 4, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True),
                               use_tqdm=False)  # decodes run in the captured graphs
            assert len({tuple(o.outputs[0].token_ids) for o in out}) == 1  # same prompt, same tokens
    err = (lps["fp8"] - lps["auto"]).abs()
    assert err.mean() < 0.15 and err.max() < 0.4, err
