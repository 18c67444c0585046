"""Sliding-window attention end to end: tiny Mistral (every layer slides) and Qwen2 (layers from
max_window_layers on) against HF transformers, token for token, with prompts at least three
windows long, under the scheduling regimes of tests/test_llm.py and on both backends."""
import json
import shutil

import pytest
import torch

from engine import LLM
from engine.tools.tiny_model import make_tiny_model
from tests.hf_reference import hf_greedy
from tests.test_llm import _check_against_hf, _prompts

PROMPT_LENS = [17, 50, 120]  # the longest: 7 windows of 16, 17 of 7, 5 of 21
MAX_TOKENS = 12
REGIMES = {
    "whole_prefill": {},
    "chunked_prefill": {"max_num_batched_tokens": 40},  # chunks not aligned to blocks or windows
    # all three fit at admission (2 + 4 + 8 blocks); the longest outgrows its blocks while decoding
    "preemption": {"num_kv_blocks": 14, "max_num_batched_tokens": 256},
    "overlapped": {"async_scheduling": True, "max_num_batched_tokens": 40},
}


def _build(tmp_path_factory, arch: str, **config):
    name = "-".join(f"{k}{v}" for k, v in config.items())
    return str(make_tiny_model(tmp_path_factory.mktemp(f"tiny-{arch}-{name}"), arch=arch, seed=0, **config))


@pytest.fixture(scope="module")
def mistral_window16(tmp_path_factory):
    return _build(tmp_path_factory, "mistral", sliding_window=16)  # a window of one block


def _with_config(tmp_path_factory, path: str, **changes) -> str:
    """A copy of the checkpoint at `path` with `changes` to its config.json: the same weights."""
    out = tmp_path_factory.mktemp("changed")
    shutil.copytree(path, out, dirs_exist_ok=True)
    config = json.loads((out / "config.json").read_text())
    (out / "config.json").write_text(json.dumps(dict(config, **changes)))
    return str(out)


@pytest.fixture(scope="module")
def mistral_window7(tmp_path_factory, mistral_window16):
    return _with_config(tmp_path_factory, mistral_window16, sliding_window=7)  # shorter than a block


@pytest.fixture(scope="module")
def qwen2_window(tmp_path_factory):
    # 3 layers; make_tiny_model turns use_sliding_window on from layer 3 // 2 = 1 (max_window_layers):
    # layer 0 full, layers 1 and 2 slide over 21 positions.
    return _build(tmp_path_factory, "qwen2", sliding_window=21, num_hidden_layers=3)


CHECKPOINTS = ["mistral_window16", "mistral_window7", "qwen2_window"]


def test_checkpoints_slide_as_configured(mistral_window16, mistral_window7, qwen2_window):
    llm_config = {path: LLM(path, dtype="float32", device="cpu").llm_engine.model_config
                  for path in (mistral_window16, mistral_window7, qwen2_window)}
    assert [(c.sliding_window, c.layer_types) for c in llm_config.values()] == [
        (16, ["sliding_attention"] * 2), (7, ["sliding_attention"] * 2),
        (21, ["full_attention", "sliding_attention", "sliding_attention"])]


def test_the_window_changes_the_tokens(tmp_path_factory, mistral_window7):
    """The same weights without the window generate other tokens: the tests below have teeth."""
    plain = _with_config(tmp_path_factory, mistral_window7, sliding_window=None)
    prompts = _prompts(1000, lens=PROMPT_LENS[1:])
    assert any(hf_greedy(mistral_window7, p, MAX_TOKENS).token_ids != hf_greedy(plain, p, MAX_TOKENS).token_ids
               for p in prompts)


# Every layer slides: a sequence holds only its window's blocks once computed, so 14 blocks never
# run out; 7 with chunks of 40 (at most 5 blocks a sequence, check_fits) do.
SLIDING_ONLY_PREEMPTION = {"num_kv_blocks": 7, "max_num_batched_tokens": 40}


@pytest.mark.parametrize("regime", REGIMES)
@pytest.mark.parametrize("checkpoint", CHECKPOINTS)
def test_greedy_equals_hf(checkpoint, regime, request):
    path = request.getfixturevalue(checkpoint)
    sliding_only = checkpoint.startswith("mistral")
    config = SLIDING_ONLY_PREEMPTION if regime == "preemption" and sliding_only else REGIMES[regime]
    llm = LLM(path, dtype="float32", device="cpu", **config)
    _check_against_hf(path, llm, _prompts(llm.llm_engine.model_config.vocab_size, lens=PROMPT_LENS),
                      max_tokens=MAX_TOKENS)
    if regime == "preemption":
        assert llm.llm_engine.scheduler.num_preemptions > 0, "the tiny cache should have forced preemption"
    llm.llm_engine.block_manager.check_no_leak()


@pytest.mark.parametrize("checkpoint", ["mistral_window7", "qwen2_window"])
def test_prefix_cache_hits_equal_hf(checkpoint, request):
    """Prompts sharing a 64-token prefix: the later ones start from cached blocks, most of them
    wholly before every window of the new tokens."""
    path = request.getfixturevalue(checkpoint)
    llm = LLM(path, dtype="float32", device="cpu", enable_prefix_caching=True)
    vocab = llm.llm_engine.model_config.vocab_size
    prefix = _prompts(vocab, lens=[64], seed=3)[0]
    family = [prefix + tail for tail in _prompts(vocab, lens=[1, 9, 30], seed=4)]
    _check_against_hf(path, llm, family[:1], max_tokens=MAX_TOKENS)  # warms the cache
    outs = _check_against_hf(path, llm, family[1:], max_tokens=MAX_TOKENS)
    assert all(o.num_cached_tokens >= 64 for o in outs), [o.num_cached_tokens for o in outs]


def test_qwen3_window_equals_hf(tmp_path_factory, tiny_qwen3):
    """Qwen3 reads the window as Qwen2 does (an older config: no layer_types), on the same graph."""
    path = _with_config(tmp_path_factory, tiny_qwen3, use_sliding_window=True, sliding_window=10,
                        max_window_layers=1, layer_types=None)
    llm = LLM(path, dtype="float32", device="cpu", **REGIMES["chunked_prefill"])
    assert llm.llm_engine.model_config.layer_types == ["full_attention", "sliding_attention"]
    _check_against_hf(path, llm, _prompts(llm.llm_engine.model_config.vocab_size, lens=PROMPT_LENS),
                      max_tokens=MAX_TOKENS)


def test_triton_backend_equals_hf(mistral_window7):
    """The Triton kernel inside the engine (interpreted on CPU, so one regime): chunked prefill
    and decode behind a window shorter than a block."""
    path = mistral_window7
    llm = LLM(path, dtype="float32", device="cuda" if torch.cuda.is_available() else "cpu",
              attention_backend="triton", max_num_batched_tokens=32, enforce_eager=True)
    assert llm.llm_engine.executor.runner.attention_backend == "triton"
    prompts = _prompts(llm.llm_engine.model_config.vocab_size, lens=[23, 70])
    _check_against_hf(path, llm, prompts, max_tokens=6)


@pytest.mark.parametrize("checkpoint", ["mistral_window16", "mistral_window7"])
def test_every_layer_sliding_holds_a_window_of_blocks(checkpoint, request):
    """Mistral: the one pool is a sliding one, so a 200-token generation after a 90-token prompt
    holds W / bs + 2 blocks while decoding (block 0 is the placeholder of the freed ones)."""
    from engine import SamplingParams
    from engine.core.block_manager import NULL_BLOCK_ID
    from tests.hf_reference import assert_matches

    path = request.getfixturevalue(checkpoint)
    llm = LLM(path, dtype="float32", device="cpu", max_num_batched_tokens=40)
    engine = llm.llm_engine
    bm = engine.block_manager
    assert bm.sliding_window == engine.model_config.sliding_window
    prompt = _prompts(engine.model_config.vocab_size, lens=[90], seed=2)[0]
    engine.add_request("long", {"prompt_token_ids": prompt},
                       SamplingParams(temperature=0, max_tokens=200, ignore_eos=True))
    num_checks, out = 0, None
    while engine.has_unfinished_requests():
        for o in engine.step():
            out = o
        for seq in engine.scheduler.running:
            if seq.num_computed_tokens > seq.num_prompt_tokens + 1:
                held = sum(b != NULL_BLOCK_ID for b in seq.block_table)
                assert held <= bm.sliding_window // bm.block_size + 2, seq.block_table
                num_checks += 1
    assert num_checks > 150
    assert_matches(out.outputs[0].token_ids, hf_greedy(path, prompt, 200), "290 tokens")
    bm.check_no_leak()


@pytest.mark.parametrize("max_num_seqs", [4, 2])  # 2: a sibling waits while its source moves on
def test_n_siblings_share_or_recompute_the_window(mistral_window16, max_num_seqs):
    """n = 3 greedy completions of a 7-window prompt: a sibling shares its source's prompt blocks
    while the source still holds the sibling's first window, else computes alone; all equal HF."""
    from engine import SamplingParams
    from tests.hf_reference import assert_matches

    llm = LLM(mistral_window16, dtype="float32", device="cpu", max_num_seqs=max_num_seqs,
              max_num_batched_tokens=40)
    prompt = _prompts(llm.llm_engine.model_config.vocab_size, lens=[120], seed=7)[0]
    out = llm.generate({"prompt_token_ids": prompt},
                       SamplingParams(n=3, temperature=0, max_tokens=30, ignore_eos=True), use_tqdm=False)[0]
    ref = hf_greedy(mistral_window16, prompt, 30)
    for c in out.outputs:
        assert_matches(c.token_ids, ref, f"completion {c.index}")
    llm.llm_engine.block_manager.check_no_leak()
