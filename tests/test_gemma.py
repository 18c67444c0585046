"""Gemma 2 and Gemma 3's text model (engine/models/gemma2.py, gemma3.py) against HF transformers:
tiny checkpoints that transformers' own classes save (4 layers, windows of 16: Gemma 2 slides
on every other layer and soft-caps scores at 5 and logits at 15; Gemma 3 has two local layers to
one global, q/k norms and a second RoPE), greedy tokens equal under the scheduling regimes of
tests/test_sliding_window.py with prompts up to 7 windows long, prefix-cache hits, the Triton
backend (interpreted on CPU), every logit of a mixed step, TP=2 against TP=1, and Gemma's
RMSNorm against HF's."""
import json
import os

import pytest
import torch

# The Triton kernels run under the interpreter on CPU; set before anything imports triton.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch.multiprocessing as mp  # noqa: E402

from engine import LLM, SamplingParams  # noqa: E402
from engine.core.block_manager import NULL_BLOCK_ID  # noqa: E402
from engine.core.kv_cache_groups import sliding_blocks_per_seq  # noqa: E402
from engine.config import ModelConfig  # noqa: E402
from engine.executor.network_utils import free_port  # noqa: E402
from engine.executor.parallel_state import destroy_tp_group, init_tp_group  # noqa: E402
from engine.layers.layernorm import GemmaRMSNorm  # noqa: E402
from engine.tools.tiny_model import make_tiny_model  # noqa: E402
from tests.hf_reference import assert_matches, hf_greedy, load_hf  # noqa: E402
from tests.test_llm import _check_against_hf, _prompts  # noqa: E402
from tests.test_models import attach_kv_cache, hf_logits, load_our_model, run_step  # noqa: E402
from tests.test_sliding_window import MAX_TOKENS, PROMPT_LENS, REGIMES, _with_config  # noqa: E402

CHECKPOINTS = ["tiny_gemma2", "tiny_gemma3"]


@pytest.fixture(scope="module")
def tiny_gemma2(tmp_path_factory):
    return str(make_tiny_model(tmp_path_factory.mktemp("tiny-gemma2"), arch="gemma2"))


@pytest.fixture(scope="module")
def tiny_gemma3(tmp_path_factory):
    return str(make_tiny_model(tmp_path_factory.mktemp("tiny-gemma3"), arch="gemma3"))


def test_checkpoints_read_as_hf_builds_them(tiny_gemma2, tiny_gemma3):
    g2, g3 = ModelConfig.from_pretrained(tiny_gemma2), ModelConfig.from_pretrained(tiny_gemma3)
    for ours, path in ((g2, tiny_gemma2), (g3, tiny_gemma3)):
        hf = load_hf(path).config
        assert (ours.layer_types, ours.sliding_window) == (hf.layer_types, hf.sliding_window)
        assert ours.hidden_act == hf.hidden_activation == "gelu_pytorch_tanh"
    assert g2.layer_types == ["sliding_attention", "full_attention"] * 2
    assert g3.layer_types == ["sliding_attention", "sliding_attention", "full_attention", "sliding_attention"]
    assert (g3.rope_theta, g3.rope_scaling, g3.rope_local) == (
        1e6, {"rope_type": "linear", "factor": 2.0}, {"rope_type": "default", "rope_theta": 1e4})


def test_window_and_soft_cap_change_the_tokens(tmp_path_factory, tiny_gemma2):
    """The same weights without the window, or without the score cap, generate other tokens in
    HF: the tests below have teeth. (The final cap leaves the argmax: the logits test checks it.)"""
    prompts = _prompts(1000, lens=PROMPT_LENS[1:])
    for changes in (dict(sliding_window=4096), dict(attn_logit_softcapping=None)):
        other = _with_config(tmp_path_factory, tiny_gemma2, **changes)
        assert any(hf_greedy(tiny_gemma2, p, MAX_TOKENS).token_ids != hf_greedy(other, p, MAX_TOKENS).token_ids
                   for p in prompts), changes


@pytest.mark.parametrize("regime", REGIMES)
@pytest.mark.parametrize("checkpoint", CHECKPOINTS)
def test_greedy_equals_hf(checkpoint, regime, request):
    path = request.getfixturevalue(checkpoint)
    llm = LLM(path, dtype="float32", device="cpu", **REGIMES[regime])
    _check_against_hf(path, llm, _prompts(llm.llm_engine.model_config.vocab_size, lens=PROMPT_LENS),
                      max_tokens=MAX_TOKENS)
    if regime == "preemption":
        assert llm.llm_engine.scheduler.num_preemptions > 0, "the tiny cache should have forced preemption"


def test_prefix_cache_hits_equal_hf(tiny_gemma3):
    """Prompts sharing a 48-token prefix (3 windows): the later ones start from cached blocks."""
    llm = LLM(tiny_gemma3, dtype="float32", device="cpu", enable_prefix_caching=True)
    vocab = llm.llm_engine.model_config.vocab_size
    prefix = _prompts(vocab, lens=[48], seed=3)[0]
    family = [prefix + tail for tail in _prompts(vocab, lens=[1, 20], seed=4)]
    _check_against_hf(tiny_gemma3, llm, family[:1], max_tokens=MAX_TOKENS)  # warms the cache
    outs = _check_against_hf(tiny_gemma3, llm, family[1:], max_tokens=MAX_TOKENS)
    assert all(o.num_cached_tokens >= 48 for o in outs), [o.num_cached_tokens for o in outs]


def test_triton_backend_equals_hf(tiny_gemma2):
    """The Triton kernel with the window and the score cap (interpreted on CPU: one short case)."""
    llm = LLM(tiny_gemma2, dtype="float32", device="cuda" if torch.cuda.is_available() else "cpu",
              attention_backend="triton", max_num_batched_tokens=32, enforce_eager=True)
    assert llm.llm_engine.executor.runner.attention_backend == "triton"
    _check_against_hf(tiny_gemma2, llm, _prompts(llm.llm_engine.model_config.vocab_size, lens=[50]),
                      max_tokens=6)


@pytest.mark.parametrize("checkpoint", CHECKPOINTS)
def test_logits_of_a_mixed_step_equal_hf(checkpoint, request):
    """Every row's logits (final soft cap included) in one flat batch: two whole prefills, then a
    chunk after a cached prefix beside a decode step."""
    path = request.getfixturevalue(checkpoint)
    model = load_our_model(path)
    seqs = _prompts(model.config.vocab_size, lens=[40, 50], seed=5)
    attach_kv_cache(model, 2)
    first = run_step(model, [(0, seqs[0][:30], 0), (1, seqs[1], 0)])
    second = run_step(model, [(0, seqs[0][30:], 30), (1, [7], 50)])
    hf = load_hf(path)
    expected_first = torch.cat([hf_logits(hf, seqs[0][:30]), hf_logits(hf, seqs[1])])
    expected_second = torch.cat([hf_logits(hf, seqs[0])[30:], hf_logits(hf, seqs[1] + [7])[-1:]])
    torch.testing.assert_close(first, expected_first, atol=1e-4, rtol=0)
    torch.testing.assert_close(second, expected_second, atol=1e-4, rtol=0)


def _tp_worker(rank: int, port: int, path: str, out_dir) -> None:
    torch.set_num_threads(1)  # two ranks share the CPU cores
    init_tp_group(rank, 2, f"tcp://127.0.0.1:{port}", backend="gloo")
    try:
        logits = _prefill_and_decode(path)
        if rank == 0:
            torch.save(logits, out_dir / "logits.pt")
    finally:
        destroy_tp_group()


def _prefill_and_decode(path: str) -> torch.Tensor:
    model = load_our_model(path)
    seqs = _prompts(model.config.vocab_size, lens=[7, 40], seed=6)
    attach_kv_cache(model, len(seqs))
    prefill = run_step(model, [(s, t, 0) for s, t in enumerate(seqs)])
    return torch.cat([prefill, run_step(model, [(s, [3], len(t)) for s, t in enumerate(seqs)])])


def test_tp2_logits_equal_tp1(tiny_gemma3, tmp_path):
    """Gemma 3 on 2 gloo ranks (one of the 2 KV heads each, q/k norms, both RoPEs)."""
    mp.spawn(_tp_worker, args=(free_port(), tiny_gemma3, tmp_path), nprocs=2, join=True)
    torch.testing.assert_close(torch.load(tmp_path / "logits.pt"), _prefill_and_decode(tiny_gemma3),
                               atol=1e-4, rtol=0)


def _held(table: list[int]) -> int:
    return sum(b != NULL_BLOCK_ID for b in table)


@pytest.mark.parametrize("max_num_batched_tokens", [32, 256])
def test_local_layers_hold_a_window_of_blocks_in_a_long_generation(tiny_gemma3, max_num_batched_tokens):
    """A 100-token prompt then 150 tokens (~15 windows): the global layers keep every block, the
    local layers' pool never holds more than a chunk and a window, and W / bs + 2 blocks while
    decoding; tokens equal HF's and nothing leaks."""
    llm = LLM(tiny_gemma3, dtype="float32", device="cpu", max_num_batched_tokens=max_num_batched_tokens)
    engine = llm.llm_engine
    full, sliding = engine.block_manager.pools
    window, bs = sliding.sliding_window, sliding.block_size
    prompt = _prompts(engine.model_config.vocab_size, lens=[100], seed=8)[0]
    max_tokens = 150
    engine.add_request("long", {"prompt_token_ids": prompt},
                       SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True))
    num_decode_checks, out = 0, None
    while engine.has_unfinished_requests():
        for o in engine.step():
            out = o
        for seq in engine.scheduler.running:
            assert _held(seq.block_tables[1]) <= sliding_blocks_per_seq(window, max_num_batched_tokens, bs)
            assert len(seq.block_table) == len(set(seq.block_table))  # the full group frees nothing
            assert NULL_BLOCK_ID not in seq.block_tables[1][-(window // bs):]
            if seq.num_computed_tokens > seq.num_prompt_tokens + 1:
                assert _held(seq.block_tables[1]) <= window // bs + 2, seq.block_tables[1]
                num_decode_checks += 1
    assert num_decode_checks > 100
    assert_matches(out.outputs[0].token_ids, hf_greedy(tiny_gemma3, prompt, max_tokens), "250 tokens")
    engine.block_manager.check_no_leak()


def test_long_prefix_hits_equal_hf(tiny_gemma3):
    """A 160-token prefix (10 windows) shared by later prompts: the hit is the longest the global
    layers' blocks and the local layers' last window both allow."""
    llm = LLM(tiny_gemma3, dtype="float32", device="cpu", enable_prefix_caching=True, max_num_batched_tokens=64)
    vocab = llm.llm_engine.model_config.vocab_size
    prefix = _prompts(vocab, lens=[160], seed=5)[0]
    family = [prefix + tail for tail in _prompts(vocab, lens=[3, 40], seed=6)]
    _check_against_hf(tiny_gemma3, llm, family[:1], max_tokens=MAX_TOKENS)
    outs = _check_against_hf(tiny_gemma3, llm, family[1:], max_tokens=MAX_TOKENS)
    assert all(o.num_cached_tokens >= 160 for o in outs), [o.num_cached_tokens for o in outs]
    llm.llm_engine.block_manager.check_no_leak()


def test_tp2_engine_greedy_equals_hf(tiny_gemma3):
    """The engine on 2 gloo ranks: the TP worker replays both groups' slots and block tables."""
    llm = LLM(tiny_gemma3, device="cpu", dtype="float32", tensor_parallel_size=2, max_num_batched_tokens=40)
    try:
        prompts = _prompts(llm.llm_engine.model_config.vocab_size, lens=PROMPT_LENS, seed=9)
        _check_against_hf(tiny_gemma3, llm, prompts, max_tokens=MAX_TOKENS)
        llm.llm_engine.block_manager.check_no_leak()
    finally:
        llm.llm_engine.shutdown()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gemma_rms_norm_equals_hf(dtype):
    """HF multiplies by (1 + w) in float32 and casts after. The torch form equals it bit for bit;
    on CPU in float32 the forward is the C add-and-norm, whose sum of squares runs in SIMD lanes
    (as for RMSNorm: within float32 rounding); the residual sum is exact either way."""
    from transformers.models.gemma2.modeling_gemma2 import Gemma2RMSNorm

    g = torch.Generator().manual_seed(0)
    x, residual = (torch.randn(5, 64, generator=g).to(dtype) for _ in range(2))
    hf = Gemma2RMSNorm(64, eps=1e-6).to(dtype)
    prev = torch.get_default_dtype()
    torch.set_default_dtype(dtype)  # as the model runner builds a model
    try:
        ours = GemmaRMSNorm(64, eps=1e-6)
    finally:
        torch.set_default_dtype(prev)
    with torch.no_grad():
        hf.weight.copy_(torch.randn(64, generator=g))
        ours.weight.copy_(hf.weight)
    ours.process_weights_after_loading()
    assert ours.scale.dtype == torch.float32
    expected = hf(residual + x)
    assert torch.equal(ours._norm(residual + x), expected)
    normed, summed = ours(x.clone(), residual.clone())
    assert torch.equal(summed, residual + x)
    torch.testing.assert_close(normed, expected, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(ours(x.clone()), hf(x), atol=1e-6, rtol=1e-6)
    if dtype == torch.bfloat16:  # the C path rounds where torch does: exact on this input
        assert torch.equal(normed, expected)


@pytest.mark.parametrize("changes, message", [
    (dict(architectures=["Gemma3ForConditionalGeneration"]), "'Gemma3ForConditionalGeneration' .*vision"),
    (dict(hidden_activation="gelu"), "hidden_act='gelu' is not supported for Gemma3ForCausalLM"),
    (dict(use_bidirectional_attention=True), "use_bidirectional_attention"),
])
def test_what_we_do_not_run_is_refused_by_name(tiny_gemma3, changes, message):
    config = json.loads(open(os.path.join(tiny_gemma3, "config.json")).read())
    with pytest.raises(ValueError, match=message):
        ModelConfig.from_hf_dict(dict(config, **changes))
