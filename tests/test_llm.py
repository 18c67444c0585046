"""The engine against HF transformers, token for token, under every scheduling regime."""
import random

import pytest
import torch

from engine import LLM, RequestOutputKind, SamplingParams
from engine.errors import InvalidRequestError, PromptTooLongError
from tests.hf_reference import assert_matches, hf_greedy, hf_prompt_logprobs

PROMPT_LENS = [1, 5, 16, 17, 40, 128, 333, 700]
MAX_TOKENS = 20


def _prompts(vocab_size: int, lens=PROMPT_LENS, seed=0):
    rng = random.Random(seed)
    return [[rng.randrange(vocab_size) for _ in range(n)] for n in lens]


def _run(llm, prompts, params):
    """Token-id lists go in as {"prompt_token_ids": ...}; strings as text."""
    prompts = [p if isinstance(p, str) else {"prompt_token_ids": p} for p in prompts]
    outs = llm.generate(prompts, params, use_tqdm=False)
    llm.llm_engine.block_manager.check_no_leak()
    return outs


def _check_against_hf(path, llm, prompts, max_tokens=MAX_TOKENS):
    outs = _run(llm, prompts, SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True))
    for p, out in zip(prompts, outs):
        assert out.prompt_token_ids == p
        assert out.outputs[0].finish_reason == "length"
        assert_matches(out.outputs[0].token_ids, hf_greedy(path, p, max_tokens), f"prompt of {len(p)} tokens")
    return outs


REGIMES = {
    "default": {},
    "chunked_prefill": {"max_num_batched_tokens": 48},
    "preemption": {"num_kv_blocks": 60, "max_num_batched_tokens": 256},
    "no_prefix_cache": {"enable_prefix_caching": False},
    # Overlapped scheduling (on by default on CUDA) runs the same path on CPU, synchronously.
    "overlapped": {"async_scheduling": True, "max_num_batched_tokens": 48},
    "overlapped_preemption": {"async_scheduling": True, "num_kv_blocks": 60, "max_num_batched_tokens": 256},
}


@pytest.mark.parametrize("regime", REGIMES)
@pytest.mark.parametrize("arch", ["tiny_llama", "tiny_qwen2", "tiny_qwen3"])
def test_greedy_equals_hf(arch, regime, request):
    path = request.getfixturevalue(arch)
    llm = LLM(path, dtype="float32", device="cpu", **REGIMES[regime])
    prompts = _prompts(llm.llm_engine.model_config.vocab_size)
    _check_against_hf(path, llm, prompts)
    if regime.endswith("preemption"):
        assert llm.llm_engine.scheduler.num_preemptions > 0, "the tiny cache should have forced preemption"


def test_prefix_caching_family(tiny_llama):
    llm = LLM(tiny_llama, dtype="float32", device="cpu", enable_prefix_caching=True)
    rng = random.Random(1)
    vocab = llm.llm_engine.model_config.vocab_size
    prefix = [rng.randrange(vocab) for _ in range(200)]
    family = [prefix + [rng.randrange(vocab) for _ in range(n)] for n in (1, 7, 16, 33)]
    _check_against_hf(tiny_llama, llm, family[:1])  # warms the cache with the shared prefix
    outs = _check_against_hf(tiny_llama, llm, family)
    assert all(o.num_cached_tokens >= 192 for o in outs), [o.num_cached_tokens for o in outs]


def test_seed_reproducible_across_batches(tiny_llama):
    llm = LLM(tiny_llama, dtype="float32", device="cpu")
    prompts = _prompts(llm.llm_engine.model_config.vocab_size, lens=[30, 7, 90])
    seeded = SamplingParams(temperature=1.0, top_p=0.9, seed=1234, max_tokens=16, ignore_eos=True)
    other = SamplingParams(temperature=1.0, max_tokens=24, ignore_eos=True)
    alone = _run(llm, prompts[:1], seeded)[0].outputs[0].token_ids
    mixed = _run(llm, [prompts[1], prompts[0], prompts[2]], [other, seeded, other])[1].outputs[0].token_ids
    assert alone == mixed
    different = _run(llm, prompts[:1], SamplingParams(temperature=1.0, top_p=0.9, seed=99, max_tokens=16,
                                                      ignore_eos=True))[0].outputs[0].token_ids
    assert different != alone


def test_stop_strings(tiny_llama):
    llm = LLM(tiny_llama, dtype="float32", device="cpu")
    prompt = "The quick brown fox"
    full = _run(llm, [prompt], SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))[0].outputs[0]
    assert len(full.text) > 6, full.text
    stop = full.text[3:6]
    first = full.text.find(stop)
    out = _run(llm, [prompt], SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, stop=[stop]))[0]
    c = out.outputs[0]
    assert (c.text, c.finish_reason, c.stop_reason) == (full.text[:first], "stop", stop)
    kept = _run(llm, [prompt], SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, stop=stop,
                                              include_stop_str_in_output=True))[0].outputs[0]
    assert kept.text == full.text[:first + len(stop)]


def test_stop_token_ids_and_min_tokens(tiny_llama):
    llm = LLM(tiny_llama, dtype="float32", device="cpu")
    full = _run(llm, ["hello"], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))[0].outputs[0]
    stop_tok = full.token_ids[4]
    first = full.token_ids.index(stop_tok)
    out = _run(llm, ["hello"], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True,
                                              stop_token_ids=[stop_tok]))[0].outputs[0]
    assert out.token_ids == full.token_ids[:first + 1]
    assert (out.finish_reason, out.stop_reason) == ("stop", stop_tok)


def test_n_greater_than_one(tiny_llama):
    llm = LLM(tiny_llama, dtype="float32", device="cpu")
    prompt = _prompts(llm.llm_engine.model_config.vocab_size, lens=[70])[0]
    greedy = _run(llm, [prompt], SamplingParams(n=3, temperature=0, max_tokens=10, ignore_eos=True))[0]
    ref = hf_greedy(tiny_llama, prompt, 10)
    assert [c.index for c in greedy.outputs] == [0, 1, 2]
    for c in greedy.outputs:
        assert_matches(c.token_ids, ref, "n=3 greedy")
    sampled = _run(llm, [prompt], SamplingParams(n=4, temperature=1.0, seed=7, max_tokens=10, ignore_eos=True))[0]
    assert len({tuple(c.token_ids) for c in sampled.outputs}) > 1
    again = _run(llm, [prompt], SamplingParams(n=4, temperature=1.0, seed=7, max_tokens=10, ignore_eos=True))[0]
    assert [c.token_ids for c in again.outputs] == [c.token_ids for c in sampled.outputs]


def test_logprobs_equal_hf_log_softmax(tiny_qwen2):
    llm = LLM(tiny_qwen2, dtype="float32", device="cpu")
    prompt = _prompts(llm.llm_engine.model_config.vocab_size, lens=[25])[0]
    out = _run(llm, [prompt], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=5))[0]
    ref = hf_greedy(tiny_qwen2, prompt, 8)
    c = out.outputs[0]
    assert len(c.logprobs) == len(c.token_ids) == 8
    for tok, lp, ref_lp in zip(c.token_ids, c.logprobs, ref.logprobs):
        assert lp[tok].logprob == pytest.approx(ref_lp[tok].item(), abs=1e-4)
        top = ref_lp.topk(5)
        for tid, val in zip(top.indices.tolist(), top.values.tolist()):
            assert lp[tid].logprob == pytest.approx(val, abs=1e-4)


def _assert_prompt_logprobs_equal_hf(path, prompt, prompt_logprobs, k):
    ref = hf_prompt_logprobs(path, prompt)  # row i - 1 scores prompt token i
    assert len(prompt_logprobs) == len(prompt) and prompt_logprobs[0] is None
    for i in range(1, len(prompt)):
        entry, ref_lp = prompt_logprobs[i], ref[i - 1]
        assert next(iter(entry)) == prompt[i]  # the prompt token first, as vLLM
        assert entry[prompt[i]].logprob == pytest.approx(ref_lp[prompt[i]].item(), abs=1e-4)
        top = ref_lp.topk(k)
        for rank, (tid, val) in enumerate(zip(top.indices.tolist(), top.values.tolist()), start=1):
            assert entry[tid].logprob == pytest.approx(val, abs=1e-4)
            assert entry[tid].rank == rank
        assert len(entry) <= k + 1


@pytest.mark.parametrize("regime", [{}, {"max_num_batched_tokens": 16}], ids=["one_chunk", "chunked_prefill"])
def test_prompt_logprobs_equal_hf_log_softmax(tiny_llama, regime):
    llm = LLM(tiny_llama, dtype="float32", device="cpu", **regime)
    prompt = _prompts(llm.llm_engine.model_config.vocab_size, lens=[40])[0]
    out = _run(llm, [prompt], SamplingParams(n=2, temperature=0, max_tokens=4, ignore_eos=True,
                                             prompt_logprobs=3))[0]
    _assert_prompt_logprobs_equal_hf(tiny_llama, prompt, out.prompt_logprobs, 3)
    assert out.outputs[0].logprobs is None  # prompt logprobs alone don't turn on sample logprobs
    plain = _run(llm, [prompt], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))[0]
    assert plain.prompt_logprobs is None


def test_prompt_logprobs_come_once_in_a_delta_stream(tiny_llama):
    engine = LLM(tiny_llama, dtype="float32", device="cpu", max_num_batched_tokens=16).llm_engine
    prompt = _prompts(engine.model_config.vocab_size, lens=[40])[0]
    engine.add_request("r", {"prompt_token_ids": prompt}, SamplingParams(
        temperature=0, max_tokens=4, ignore_eos=True, prompt_logprobs=0, output_kind=RequestOutputKind.DELTA))
    outs = []
    while engine.has_unfinished_requests():
        outs += engine.step()
    assert len(outs) == 4 and [o.prompt_logprobs is not None for o in outs] == [True, False, False, False]
    _assert_prompt_logprobs_equal_hf(tiny_llama, prompt, outs[0].prompt_logprobs, 0)
    engine.block_manager.check_no_leak()


def test_prompt_logprobs_survive_preemption(tiny_llama):
    """A 6-block cache: the prompt-logprob request is preempted mid-prompt, again and again;
    the entries it already made are neither redone nor lost."""
    engine = LLM(tiny_llama, dtype="float32", device="cpu", max_num_batched_tokens=16, num_kv_blocks=6).llm_engine
    other, prompt = _prompts(engine.model_config.vocab_size, lens=[20, 80])
    engine.add_request("other", {"prompt_token_ids": other},
                       SamplingParams(temperature=0, max_tokens=60, ignore_eos=True))
    engine.add_request("r", {"prompt_token_ids": prompt},
                       SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, prompt_logprobs=2))
    seq = engine.requests["r"].seqs[0]
    entries_at_preemption, final = [], None
    while engine.has_unfinished_requests():
        num_preemptions = seq.num_preemptions
        for out in engine.step():
            final = out if out.request_id == "r" else final
        if seq.num_preemptions > num_preemptions:
            entries_at_preemption.append(len(seq.prompt_logprobs))
    assert any(0 < n < len(prompt) - 1 for n in entries_at_preemption), entries_at_preemption
    _assert_prompt_logprobs_equal_hf(tiny_llama, prompt, final.prompt_logprobs, 2)
    engine.block_manager.check_no_leak()


def test_reset_prefix_cache_makes_the_next_prompt_compute_again(tiny_llama):
    """vLLM's LLM.reset_prefix_cache: refused while a request is unfinished, then the same prompt
    finds nothing cached and gives the same tokens."""
    llm = LLM(tiny_llama, dtype="float32", device="cpu", enable_prefix_caching=True)
    prompt = _prompts(llm.llm_engine.model_config.vocab_size, lens=[50])[0]
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    first = _run(llm, [prompt], params)[0]
    assert _run(llm, [prompt], params)[0].num_cached_tokens == 48
    llm.llm_engine.add_request("busy", {"prompt_token_ids": prompt}, params)
    assert not llm.reset_prefix_cache()  # a request is unfinished: nothing forgotten
    while llm.llm_engine.has_unfinished_requests():
        llm.llm_engine.step()
    assert llm.reset_prefix_cache()
    again = _run(llm, [prompt], params)[0]
    assert again.num_cached_tokens == 0 and again.outputs[0].token_ids == first.outputs[0].token_ids
    llm.llm_engine.block_manager.check_no_leak()


def test_prompt_logprobs_bypass_prefix_cache(tiny_llama):
    llm = LLM(tiny_llama, dtype="float32", device="cpu", enable_prefix_caching=True)
    prompt = _prompts(llm.llm_engine.model_config.vocab_size, lens=[50])[0]
    params = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
    _run(llm, [prompt], params)
    assert _run(llm, [prompt], params)[0].num_cached_tokens == 48  # the prompt is cached...
    out = _run(llm, [prompt], SamplingParams(temperature=0, max_tokens=2, ignore_eos=True, prompt_logprobs=1))[0]
    assert out.num_cached_tokens == 0  # ... but positions taken from the cache would have no logits
    _assert_prompt_logprobs_equal_hf(tiny_llama, prompt, out.prompt_logprobs, 1)


@pytest.mark.parametrize("bad", [-1, 21, 1.5, True, "2"])
def test_prompt_logprobs_validation(bad):
    with pytest.raises(ValueError, match="prompt_logprobs"):
        SamplingParams(prompt_logprobs=bad)


def test_refuses_requests_that_cannot_fit(tiny_llama):
    llm = LLM(tiny_llama, dtype="float32", device="cpu", max_model_len=256, num_kv_blocks=8)
    with pytest.raises(PromptTooLongError, match="256"):
        llm.generate([{"prompt_token_ids": [1] * 250}], SamplingParams(max_tokens=10), use_tqdm=False)
    with pytest.raises(PromptTooLongError, match="block"):
        llm.generate([{"prompt_token_ids": [1] * 200}], SamplingParams(max_tokens=10), use_tqdm=False)
    with pytest.raises(InvalidRequestError, match="vocab") as info:
        llm.generate([{"prompt_token_ids": [10**6]}], use_tqdm=False)
    assert info.value.param == "prompt"
    with pytest.raises(ValueError, match="empty"):
        llm.generate([{"prompt_token_ids": []}], use_tqdm=False)
    llm.llm_engine.block_manager.check_no_leak()
    assert not llm.llm_engine.has_unfinished_requests()


def test_text_prompt_and_detokenized_output(tiny_llama):
    llm = LLM(tiny_llama, dtype="float32", device="cpu")
    out = _run(llm, ["café 日本語"], SamplingParams(temperature=0, max_tokens=16, ignore_eos=True))[0]
    tok = llm.get_tokenizer()
    assert out.prompt_token_ids == tok.encode("café 日本語")
    assert out.outputs[0].text == tok.decode(out.outputs[0].token_ids, skip_special_tokens=True)


ON_CUDA = torch.cuda.is_available()


@pytest.mark.parametrize("arch", ["tiny_llama", "tiny_qwen2", "tiny_qwen3"])
def test_triton_backend_equals_hf(arch, request):
    """The Triton kernels inside the whole engine: interpreted on CPU (CI), native on a GPU."""
    path = request.getfixturevalue(arch)
    llm = LLM(path, dtype="float32", device="cuda" if ON_CUDA else "cpu", attention_backend="triton",
              max_num_batched_tokens=32, enforce_eager=True)
    prompts = _prompts(llm.llm_engine.model_config.vocab_size, lens=[1, 17, 40, 70])
    _check_against_hf(path, llm, prompts, max_tokens=8)


@pytest.mark.gpu
@pytest.mark.skipif(not ON_CUDA, reason="needs CUDA")
@pytest.mark.parametrize("regime", REGIMES)
@pytest.mark.parametrize("arch", ["tiny_llama", "tiny_qwen2", "tiny_qwen3"])
def test_cuda_greedy_equals_hf(arch, regime, request):
    """The CPU regimes again on CUDA: native Triton kernels, CUDA graphs for decode, fp32 so the
    comparison with HF's fp32 greedy stays exact."""
    path = request.getfixturevalue(arch)
    llm = LLM(path, dtype="float32", device="cuda", **REGIMES[regime])
    assert llm.llm_engine.executor.runner.graph_runner is not None
    prompts = _prompts(llm.llm_engine.model_config.vocab_size)
    _check_against_hf(path, llm, prompts)
    if regime.endswith("preemption"):
        assert llm.llm_engine.scheduler.num_preemptions > 0, "the tiny cache should have forced preemption"


@pytest.mark.gpu
@pytest.mark.skipif(not ON_CUDA, reason="needs CUDA")
def test_cuda_graphs_equal_eager_and_hf(tiny_llama):
    prompts = _prompts(1000, lens=PROMPT_LENS + [3] * 12)  # 20 requests: decode batches of many sizes
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    eager = LLM(tiny_llama, dtype="float32", device="cuda", enforce_eager=True)
    graphs = LLM(tiny_llama, dtype="float32", device="cuda", max_num_seqs=24)
    assert graphs.llm_engine.executor.runner.graph_runner is not None
    ours = [o.outputs[0].token_ids for o in _run(graphs, prompts, params)]
    assert ours == [o.outputs[0].token_ids for o in _run(eager, prompts, params)]
    for p, toks in zip(prompts, ours):
        assert_matches(toks, hf_greedy(tiny_llama, p, MAX_TOKENS), f"cuda graphs, {len(p)} tokens")


@pytest.mark.gpu
@pytest.mark.skipif(not ON_CUDA, reason="needs CUDA")
def test_cuda_defaults_to_bf16_and_sizes_cache_from_memory(tiny_qwen3):
    llm = LLM(tiny_qwen3, device="cuda", gpu_memory_utilization=0.5)
    runner = llm.llm_engine.executor.runner
    assert runner.dtype == torch.bfloat16 and runner.attention_backend == "triton"
    assert runner.num_kv_blocks > 1000
    out = _run(llm, ["hello"], SamplingParams(temperature=0, max_tokens=16, ignore_eos=True))[0]
    assert len(out.outputs[0].token_ids) == 16


CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello there"}]


def test_chat_renders_the_template_and_generates(tiny_qwen2):
    llm = LLM(tiny_qwen2, dtype="float32", device="cpu")
    tok = llm.get_tokenizer()
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    [out] = llm.chat(CHAT, params, use_tqdm=False)
    text = tok.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=True)
    assert text.endswith("<|im_start|>assistant\n") and out.prompt == text
    assert out.prompt_token_ids == tok.encode(text, add_special_tokens=False)
    [same] = llm.generate([{"prompt_token_ids": out.prompt_token_ids}], params, use_tqdm=False)
    assert out.outputs[0].token_ids == same.outputs[0].token_ids
    # a list of conversations: one output each, in order; the flag reaches the template
    other = [{"role": "user", "content": "Another one"}]
    outs = llm.chat([other, CHAT], params, use_tqdm=False, add_generation_prompt=False)
    assert [o.prompt for o in outs] == [tok.apply_chat_template(c, tokenize=False) for c in (other, CHAT)]


def test_chat_template_brings_its_own_bos(tiny_llama):
    llm = LLM(tiny_llama, dtype="float32", device="cpu")
    bos = llm.get_tokenizer().bos_token_id
    [out] = llm.chat(CHAT, SamplingParams(max_tokens=2), use_tqdm=False)
    assert out.prompt_token_ids[0] == bos and out.prompt_token_ids[1] != bos  # not doubled


def test_chat_refuses_empty_conversations_and_missing_templates(tiny_qwen2):
    llm = LLM(tiny_qwen2, dtype="float32", device="cpu")
    with pytest.raises(ValueError, match="non-empty conversation"):
        llm.chat([], use_tqdm=False)
    with pytest.raises(ValueError, match="non-empty conversation"):
        llm.chat([CHAT, []], use_tqdm=False)
    llm.get_tokenizer().chat_template = None
    with pytest.raises(ValueError, match="no chat template"):
        llm.chat(CHAT, use_tqdm=False)


def test_chat_template_override_and_its_refusals(tiny_qwen2):
    llm = LLM(tiny_qwen2, dtype="float32", device="cpu")
    picky = ("{% if messages[0]['content'] == 'bad' %}{{ raise_exception('no bad words') }}{% endif %}"
             "{% for m in messages %}{{ m['content'] }}{% endfor %}")
    [out] = llm.chat(CHAT, SamplingParams(max_tokens=2), use_tqdm=False, chat_template=picky)
    assert out.prompt == "Be brief.Hello there"
    # a conversation the template refuses: a ValueError naming it, and nothing generated
    with pytest.raises(ValueError, match=r"messages\[1\]: the chat template cannot render it: no bad words"):
        llm.chat([CHAT, [{"role": "user", "content": "bad"}]], use_tqdm=False, chat_template=picky)
    assert not llm.llm_engine.has_unfinished_requests()


TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                           "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                          "required": ["city"]}}}]


def test_chat_passes_tools_and_template_kwargs_to_the_template(tiny_qwen3_tools):
    llm = LLM(tiny_qwen3_tools, dtype="float32", device="cpu")
    tok = llm.get_tokenizer()
    params = SamplingParams(temperature=0, max_tokens=2)
    [out] = llm.chat(CHAT, params, use_tqdm=False, tools=TOOLS, chat_template_kwargs={"enable_thinking": False})
    expected = tok.apply_chat_template(CHAT, tools=TOOLS, tokenize=False, add_generation_prompt=True,
                                       enable_thinking=False)
    assert out.prompt == expected and '"get_weather"' in expected and expected.endswith("</think>\n\n")
    [plain] = llm.chat(CHAT, params, use_tqdm=False)
    assert "get_weather" not in plain.prompt and not plain.prompt.endswith("</think>\n\n")
    with pytest.raises(ValueError, match="chat_template_kwargs") as info:  # a kwarg the renderer sets itself
        llm.chat(CHAT, params, use_tqdm=False, chat_template_kwargs={"tools": []})
    assert info.value.param == "chat_template_kwargs"
