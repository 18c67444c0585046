"""Request validation (no Ray): every invalid field is a 400 naming it; valid ones map onto SamplingParams."""
import json

import pytest
from pydantic import ValidationError

from engine.sampling_params import StructuredOutputsParams
from serve_app.http.errors import from_validation_error
from serve_app.http.protocol import ChatCompletionRequest, CompletionRequest


def _parse(cls, body: dict):
    return cls.model_validate_json(json.dumps(body))


def _error(cls, body: dict):
    with pytest.raises(ValidationError) as info:
        _parse(cls, body)
    return from_validation_error(info.value)


@pytest.mark.parametrize("field,value", [
    ("max_tokens", 0), ("max_tokens", "16"), ("max_tokens", 1.5), ("temperature", -0.1), ("temperature", 2.5),
    ("temperature", "hot"), ("top_p", 0.0), ("top_p", 1.1), ("n", 0), ("n", True), ("logprobs", 21),
    ("logprobs", -1), ("presence_penalty", 3), ("frequency_penalty", -2.5), ("top_k", -2), ("min_p", 1.5),
    ("repetition_penalty", 0), ("min_tokens", -1), ("stop", 5), ("stop", [""]), ("stop_token_ids", [-1]),
    ("stop_token_ids", "3"), ("echo", 1), ("stream", "yes"), ("seed", 1.5), ("ignore_eos", "no"),
    ("logit_bias", {"1": 2.0}), ("suffix", "x"),
])
def test_completion_field_errors_name_the_field(field, value):
    err = _error(CompletionRequest, {"model": "m", "prompt": "hi", field: value})
    assert err.status_code == 400
    assert err.param == field, err.message
    assert err.body()["error"]["type"] == "invalid_request_error"


@pytest.mark.parametrize("prompt", [None, 3, [], [1, "a"], [[1], "a"], [1.5], {"a": 1}, [True]])
def test_bad_prompt_shapes(prompt):
    err = _error(CompletionRequest, {"model": "m", "prompt": prompt})
    assert err.status_code == 400 and err.param == "prompt"


@pytest.mark.parametrize("prompt,expected", [
    ("hi", ["hi"]), (["a", "b"], ["a", "b"]), ([1, 2, 3], [[1, 2, 3]]), ([[1, 2], [3]], [[1, 2], [3]]),
])
def test_prompt_forms(prompt, expected):
    assert _parse(CompletionRequest, {"model": "m", "prompt": prompt}).prompts() == expected


def test_missing_fields():
    assert _error(CompletionRequest, {"prompt": "x"}).param == "model"
    assert _error(CompletionRequest, {"model": "m"}).param == "prompt"
    assert _error(ChatCompletionRequest, {"model": "m", "messages": []}).param == "messages"


def test_stream_options_needs_stream():
    err = _error(CompletionRequest, {"model": "m", "prompt": "x", "stream_options": {"include_usage": True}})
    assert err.param == "stream_options"
    ok = _parse(CompletionRequest, {"model": "m", "prompt": "x", "stream": True,
                                    "stream_options": {"include_usage": True}})
    assert ok.include_usage


def test_invalid_json_body():
    with pytest.raises(ValidationError) as info:
        CompletionRequest.model_validate_json(b"{not json")
    err = from_validation_error(info.value)
    assert err.status_code == 400 and err.code == "invalid_json"


def test_completion_sampling_params_defaults_and_extras():
    p = _parse(CompletionRequest, {"model": "m", "prompt": "x"}).to_sampling_params()
    assert (p.max_tokens, p.temperature, p.top_p, p.n, p.logprobs) == (16, 1.0, 1.0, 1, None)
    p = _parse(CompletionRequest, {
        "model": "m", "prompt": "x", "max_tokens": 5, "temperature": 0, "top_k": 3, "min_p": 0.1,
        "repetition_penalty": 1.2, "ignore_eos": True, "min_tokens": 2, "stop_token_ids": [7], "stop": "ab",
        "seed": 11, "logprobs": 2, "n": 2, "presence_penalty": 0.5}).to_sampling_params()
    assert (p.max_tokens, p.temperature, p.top_k, p.min_p, p.repetition_penalty) == (5, 0.0, 3, 0.1, 1.2)
    assert (p.ignore_eos, p.min_tokens, p.stop_token_ids, p.stop, p.seed, p.logprobs, p.n) == (
        True, 2, [7], ["ab"], 11, 2, 2)
    assert p.presence_penalty == 0.5
    assert p.prompt_logprobs is None


def test_completion_echo_with_logprobs_asks_for_prompt_logprobs():
    p = _parse(CompletionRequest, {"model": "m", "prompt": "x", "echo": True, "logprobs": 3}).to_sampling_params()
    assert (p.logprobs, p.prompt_logprobs) == (3, 3)
    assert _parse(CompletionRequest, {"model": "m", "prompt": "x", "echo": True}).to_sampling_params() \
        .prompt_logprobs is None


def test_chat_messages_and_content_parts():
    req = _parse(ChatCompletionRequest, {"model": "m", "messages": [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]})
    assert [m.text() for m in req.messages] == ["be brief", "ab"]
    assert req.to_sampling_params().max_tokens is None  # chat: up to the context
    err = _error(ChatCompletionRequest, {"model": "m", "messages": [
        {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]})
    assert err.param.startswith("messages.0.content")
    assert _error(ChatCompletionRequest, {"model": "m", "messages": [{"role": "wizard", "content": "x"}]}).param \
        == "messages.0.role"
    assert _error(ChatCompletionRequest, {"model": "m", "messages": ["hi"]}).param == "messages.0"
    assert _error(ChatCompletionRequest, {"model": "m", "messages": [{"role": "user", "content": None}]}).param \
        == "messages.0"
    assert _parse(ChatCompletionRequest, {"model": "m", "messages": [{"role": "user", "content": "x"},
                                                                      {"role": "assistant", "content": None}]})


def test_chat_logprobs_and_max_completion_tokens():
    req = _parse(ChatCompletionRequest, {"model": "m", "messages": [{"role": "user", "content": "x"}],
                                         "logprobs": True, "top_logprobs": 3, "max_completion_tokens": 7})
    p = req.to_sampling_params()
    assert (p.logprobs, p.max_tokens) == (3, 7)
    assert _error(ChatCompletionRequest, {"model": "m", "messages": [{"role": "user", "content": "x"}],
                                          "top_logprobs": 3}).param == "top_logprobs"
    assert _error(ChatCompletionRequest, {"model": "m", "messages": [{"role": "user", "content": "x"}],
                                          "tools": [{"type": "function"}]}).param == "tools"


def test_response_format():
    base = {"model": "m", "messages": [{"role": "user", "content": "x"}]}
    assert not _parse(ChatCompletionRequest, {**base, "response_format": {"type": "text"}}).json_mode
    req = _parse(ChatCompletionRequest, {**base, "response_format": {"type": "json_object"}})
    assert req.json_mode and req.to_sampling_params().structured_outputs == StructuredOutputsParams(json_object=True)
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    req = _parse(ChatCompletionRequest, {**base, "response_format": {
        "type": "json_schema", "json_schema": {"name": "x", "schema": schema}}})
    assert req.json_mode and req.to_sampling_params().structured_outputs.json == schema
    assert _error(ChatCompletionRequest, {**base, "response_format": {"type": "json_schema"}}).param \
        == "response_format"
    assert _error(ChatCompletionRequest, {**base, "response_format": {"type": "xml"}}).param == "response_format.type"


def test_completions_take_response_format_too():
    base = {"model": "m", "prompt": "x", "response_format": {"type": "json_object"}}
    req = _parse(CompletionRequest, base)
    assert req.json_mode and req.to_sampling_params().structured_outputs == StructuredOutputsParams(json_object=True)
    assert _error(CompletionRequest, {**base, "echo": True}).param == "echo"  # the text would not be JSON
