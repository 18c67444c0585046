"""Batched chat templating + tokenization (no Ray): same token ids as one-by-one, and per-job 400s."""
import copy

import pytest
from transformers import AutoTokenizer

from serve_app.http.errors import OpenAIError
from serve_app.http.preprocess import ModelLimits, Prepared, PrepJob, prepare_batch

LIMITS = ModelLimits(max_model_len=64, vocab_size=1000)


@pytest.fixture(scope="module")
def tokenizer(tiny_llama):
    return AutoTokenizer.from_pretrained(tiny_llama)


def test_batch_equals_one_by_one(tokenizer):
    chat = [{"role": "user", "content": "hi there"}]
    jobs = [PrepJob(max_tokens=4, prompts=["Hello world", "abc"]), PrepJob(max_tokens=4, messages=chat),
            PrepJob(max_tokens=4, prompts=[[5, 6, 7]])]
    out = prepare_batch(tokenizer, jobs, LIMITS)
    assert all(isinstance(r, Prepared) for r in out)
    assert out[0].prompt_token_ids == [tokenizer.encode("Hello world"), tokenizer.encode("abc")]
    expected_chat = tokenizer.apply_chat_template(chat, tokenize=True, add_generation_prompt=True)
    expected_chat = expected_chat["input_ids"] if isinstance(expected_chat, dict) or hasattr(expected_chat, "keys") \
        else expected_chat
    assert out[1].prompt_token_ids == [list(expected_chat)]
    assert out[2].prompt_token_ids == [[5, 6, 7]] and out[2].prompt_texts == [None]


def test_errors_are_per_job(tokenizer):
    jobs = [PrepJob(max_tokens=4, prompts=[""]),            # empty prompt
            PrepJob(max_tokens=4, prompts=[[1, 5000]]),      # out of vocabulary
            PrepJob(max_tokens=60, prompts=["Hello world"]),  # too long with the completion
            PrepJob(max_tokens=4, prompts=["fine"])]
    out = prepare_batch(tokenizer, jobs, LIMITS)
    assert [type(r) for r in out] == [OpenAIError, OpenAIError, OpenAIError, Prepared]
    assert out[0].param == "prompt" and "empty" in out[0].message
    assert out[1].param == "prompt" and "5000" in out[1].message and "1000" in out[1].message
    assert out[2].code == "context_length_exceeded" and "64" in out[2].message and out[2].param == "max_tokens"


def test_prompt_alone_too_long(tokenizer):
    (err,) = prepare_batch(tokenizer, [PrepJob(max_tokens=None, prompts=[list(range(64))])], LIMITS)
    assert isinstance(err, OpenAIError) and err.param == "prompt"


def test_a_chat_the_template_refuses_is_that_requests_400(tokenizer):
    picky = copy.deepcopy(tokenizer)
    picky.chat_template = ("{% if messages[0]['content'] == 'bad' %}{{ raise_exception('no bad words') }}{% endif %}"
                           "{{ messages[0]['content'] }}")
    jobs = [PrepJob(max_tokens=4, messages=[{"role": "user", "content": c}]) for c in ("fine", "bad")]
    fine, bad = prepare_batch(picky, jobs, LIMITS)
    assert fine.prompt_token_ids == [picky.encode("fine", add_special_tokens=False)]  # the template wrote no BOS
    assert isinstance(bad, OpenAIError) and (bad.status_code, bad.param) == (400, "messages")
    assert bad.message == "The chat template cannot render these messages: no bad words"
    picky.chat_template = None
    (none,) = prepare_batch(picky, jobs[:1], LIMITS)
    assert none.message.endswith("the model has no chat template; use /v1/completions")
