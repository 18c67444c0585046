"""Request validation (no Ray): every invalid field is a 400 naming it; valid ones map onto SamplingParams;
every field OpenAI or vLLM define is honoured or refused by name, any other refused too; every structured-output
form on both routes; tools, tool_choice and a tool-calling history."""
import json

import jsonschema
import pytest
import xgrammar
from pydantic import ValidationError

from engine.errors import InvalidRequestError
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
    ("logit_bias", {"a": 2.0}), ("logit_bias", {"-1": 2.0}), ("logit_bias", {"1": 100.5}), ("logit_bias", [1]),
    ("allowed_token_ids", []), ("allowed_token_ids", [-1]), ("bad_words", [" "]), ("suffix", "x"),
    ("guided_decoding_backend", "outlines"), ("guided_choice", "yes"),
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
                                          "tools": [{"type": "function"}]}).param == "tools.0.function"


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


# -- every field is honoured or refused by name ------------------------------------------------
CHAT = {"model": "m", "messages": [{"role": "user", "content": "x"}]}
COMPLETION = {"model": "m", "prompt": "x"}


@pytest.mark.parametrize("cls,body,param", [
    (CompletionRequest, {**COMPLETION, "foo": 1}, "foo"),
    (ChatCompletionRequest, {**CHAT, "messages": [{"role": "user", "content": "x", "foo": 1}]}, "messages.0.foo"),
    (ChatCompletionRequest, {**CHAT, "response_format": {"type": "text", "foo": 1}}, "response_format.foo"),
    (ChatCompletionRequest, {**CHAT, "tools": [{"type": "function", "function": {"name": "f", "foo": 1}}]},
     "tools.0.function.foo"),
    (CompletionRequest, {**COMPLETION, "structured_outputs": {"regex": "a", "foo": 1}}, "structured_outputs.foo"),
])
def test_fields_neither_api_defines_are_refused_by_name(cls, body, param):
    err = _error(cls, body)
    assert err.status_code == 400 and err.param == param
    assert err.message == f"Unrecognized request argument supplied: {param}"  # OpenAI's wording
    cls.model_validate_json(json.dumps(body), extra="ignore")  # the app arg unknown_request_fields: ignore


@pytest.mark.parametrize("cls,body,param", [
    (CompletionRequest, {**COMPLETION, "use_beam_search": True}, "use_beam_search"),
    (CompletionRequest, {**COMPLETION, "prompt_logprobs": 2}, "prompt_logprobs"),
    (CompletionRequest, {**COMPLETION, "store": True}, "store"),
    (ChatCompletionRequest, {**CHAT, "reasoning_effort": "low"}, "reasoning_effort"),
    (ChatCompletionRequest, {**CHAT, "functions": [{"name": "f"}]}, "functions"),
    (ChatCompletionRequest, {**CHAT, "modalities": ["text", "audio"]}, "modalities"),
    (ChatCompletionRequest, {**CHAT, "chat_template": "{{ x }}"}, "chat_template"),
    (ChatCompletionRequest, {**CHAT, "stream": True, "stream_options": {"include_obfuscation": True}},
     "stream_options.include_obfuscation"),
    (ChatCompletionRequest, {**CHAT, "messages": [{"role": "assistant", "content": "a", "audio": {"id": "x"}}]},
     "messages.0.audio"),
    (ChatCompletionRequest, {**CHAT, "structured_outputs": {"regex": "a", "whitespace_pattern": " "}},
     "structured_outputs.whitespace_pattern"),
])
def test_fields_an_api_defines_that_are_not_done_here_are_refused_by_name(cls, body, param):
    err = _error(cls, body)
    assert err.status_code == 400 and err.param == param
    assert err.message.startswith(f"'{param}' is not supported: ")
    with pytest.raises(ValidationError):  # ignoring unknown fields does not ignore these: the client asked
        cls.model_validate_json(json.dumps(body), extra="ignore")


@pytest.mark.parametrize("cls,body", [
    (CompletionRequest, {**COMPLETION, "use_beam_search": False, "store": False, "service_tier": "auto",
                         "user": "u", "safety_identifier": "s", "prompt_cache_key": "k", "metadata": {"a": "b"},
                         "length_penalty": 1, "priority": 0, "add_special_tokens": True}),
    (ChatCompletionRequest, {**CHAT, "modalities": ["text"], "echo": False, "reasoning_effort": None,
                             "add_special_tokens": False, "guided_decoding_backend": "xgrammar",
                             "messages": [{"role": "assistant", "content": "a", "refusal": None, "audio": None}]}),
])
def test_values_that_ask_for_nothing_are_accepted(cls, body):
    _parse(cls, body).to_sampling_params()


# -- structured output, every form, both routes -------------------------------------------------
@pytest.mark.parametrize("fields,form,value", [
    ({"structured_outputs": {"regex": "[ab]+"}}, "regex", "[ab]+"),
    ({"structured_outputs": {"choice": ["yes", "no"]}}, "choice", ["yes", "no"]),
    ({"structured_outputs": {"grammar": 'root ::= "a"'}}, "grammar", 'root ::= "a"'),
    ({"structured_outputs": {"json": {"type": "integer"}}}, "json", {"type": "integer"}),
    ({"structured_outputs": {"json_object": True}}, "json_object", True),
    ({"guided_regex": "[ab]+"}, "regex", "[ab]+"),
    ({"guided_choice": ["yes", "no"]}, "choice", ["yes", "no"]),
    ({"guided_grammar": 'root ::= "a"'}, "grammar", 'root ::= "a"'),
    ({"guided_json": '{"type": "integer"}'}, "json", {"type": "integer"}),  # JSON text, as vLLM takes it
    ({"response_format": {"type": "structural_tag", "structures": [
        {"begin": "<f>", "schema": {"type": "object"}, "end": "</f>"}], "triggers": ["<f>"]}},
     "structural_tag", {"type": "structural_tag", "structures": [
         {"begin": "<f>", "schema": {"type": "object"}, "end": "</f>"}], "triggers": ["<f>"]}),
])
@pytest.mark.parametrize("cls,base", [(CompletionRequest, COMPLETION), (ChatCompletionRequest, CHAT)])
def test_every_structured_form_reaches_the_engine(cls, base, fields, form, value):
    req = _parse(cls, {**base, **fields})
    spec = req.to_sampling_params().structured_outputs
    assert spec.form == form and getattr(spec, form) == value
    assert req.json_mode == (form in ("json", "json_object"))  # JSON forms go through the guardrail


@pytest.mark.parametrize("fields,param", [
    ({"guided_regex": "a", "guided_choice": ["a"]}, "guided_choice"),
    ({"response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a"}}, "structured_outputs"),
    ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs"),
])
def test_one_structured_form_per_request(fields, param):
    err = _error(CompletionRequest, {**COMPLETION, **fields})
    assert err.status_code == 400 and err.param == param


@pytest.mark.parametrize("fields,param", [
    ({"guided_choice": []}, "guided_choice"), ({"guided_regex": ""}, "guided_regex"),
    ({"structured_outputs": {"choice": ["a", "a"]}}, "structured_outputs.choice"),
    ({"guided_json": "{not json"}, "guided_json"),
])
def test_a_malformed_form_names_the_field_it_came_in(fields, param):
    with pytest.raises(InvalidRequestError) as e:
        _parse(CompletionRequest, {**COMPLETION, **fields}).to_sampling_params()
    assert e.value.param == param and param in str(e.value)


def test_token_controls():
    p = _parse(ChatCompletionRequest, {**CHAT, "logit_bias": {"5": 100, "7": -100.0}, "allowed_token_ids": [1, 2],
                                       "bad_words": ["bad"]}).to_sampling_params()
    assert (p.logit_bias, p.allowed_token_ids, p.bad_words) == ({5: 100.0, 7: -100.0}, [1, 2], ["bad"])
    assert _parse(CompletionRequest, {**COMPLETION, "logit_bias": {"9": 1}}).to_sampling_params().logit_bias == {9: 1.0}


# -- tools ------------------------------------------------------------------------------------------
WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}}, "required": ["city"]}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "description": "now"}}]  # no parameters
NAMED = {"type": "function", "function": {"name": "get_weather"}}


def test_a_named_tool_choice_is_the_tools_arguments_schema():
    req = _parse(ChatCompletionRequest, {**CHAT, "tools": TOOLS, "tool_choice": NAMED})
    assert req.tool_mode == "named" and req.json_mode
    assert req.to_sampling_params().structured_outputs.json == WEATHER
    spec = req.output_spec(reasoning_parser="qwen3", tool_call_parser=None)  # no parser needed: the call is forced
    assert (spec.tools.choice, spec.tools.named, spec.reasoning_parser) == ("named", "get_weather", "qwen3")
    assert spec.tools.schemas == {"get_weather": WEATHER, "get_time": {"type": "object", "properties": {}}}


@pytest.mark.parametrize("parallel", [True, False])
def test_required_is_a_list_of_calls_each_branch_its_tools_schema(parallel):
    defs_tool = {"type": "function", "function": {"name": "pick", "parameters": {
        "type": "object", "properties": {"c": {"$ref": "#/$defs/color"}}, "required": ["c"],
        "$defs": {"color": {"enum": ["red", "blue"]}}}}}
    req = _parse(ChatCompletionRequest, {**CHAT, "tools": [*TOOLS, defs_tool], "tool_choice": "required",
                                         "parallel_tool_calls": parallel})
    schema = req.to_sampling_params().structured_outputs.json
    assert ("maxItems" in schema) != parallel
    validator = jsonschema.Draft202012Validator(schema)
    validator.validate([{"name": "get_weather", "parameters": {"city": "Paris"}},
                        {"name": "pick", "parameters": {"c": "red"}}][:1 if not parallel else 2])
    for bad in ([], [{"name": "pick", "parameters": {"c": "green"}}], [{"name": "nope", "parameters": {}}],
                [{"name": "get_weather", "parameters": {}}]):
        assert not validator.is_valid(bad), bad
    xgrammar.Grammar.from_json_schema(json.dumps(schema), any_whitespace=False, strict_mode=True)  # $refs resolve


def test_auto_is_the_default_with_tools_and_needs_the_servers_parser():
    req = _parse(ChatCompletionRequest, {**CHAT, "tools": TOOLS})
    assert req.tool_mode == "auto" and req.to_sampling_params().structured_outputs is None
    assert req.output_spec(None, "hermes").tools.parser == "hermes"
    with pytest.raises(InvalidRequestError) as e:
        req.output_spec(None, None)
    assert e.value.param == "tool_choice" and "tool_call_parser" in str(e.value)
    none = _parse(ChatCompletionRequest, {**CHAT, "tools": TOOLS, "tool_choice": "none"})
    assert not none.json_mode and none.output_spec("qwen3", None).tools is None
    assert none.template_tools()[0] == {"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}}


@pytest.mark.parametrize("fields,param", [
    ({"tool_choice": "required"}, "tool_choice"),  # no tools
    ({"tool_choice": NAMED}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": {"type": "allowed_tools", "allowed_tools": {}}}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": NAMED, "response_format": {"type": "json_object"}}, "tool_choice"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "objekt"}}}]},
     "tools.0.function.parameters"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "string"}}}]},
     "tools.0.function.parameters"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object",
                                                                              "minProperties": -1}}}]},
     "tools.0.function.parameters"),
    ({"tools": [TOOLS[0], TOOLS[0]]}, "tools.1.function.name"),
    ({"tools": [{"type": "function", "function": {"name": "no spaces"}}]}, "tools.0.function.name"),
    ({"tools": [{"type": "custom", "custom": {"name": "f"}}]}, "tools.0.type"),
])
def test_bad_tools_input_names_the_field(fields, param):
    err = _error(ChatCompletionRequest, {**CHAT, **fields})
    assert err.status_code == 400 and err.param == param, err.message


def test_history_with_tool_calls_and_tool_results():
    history = [{"role": "user", "content": "weather?"},
               {"role": "assistant", "content": None, "reasoning_content": "think", "tool_calls": [
                   {"id": "call_1", "type": "function", "function": {"name": "get_weather",
                                                                     "arguments": '{"city": "Paris"}'}}]},
               {"role": "tool", "tool_call_id": "call_1", "content": [{"type": "text", "text": "sunny"}]}]
    req = _parse(ChatCompletionRequest, {**CHAT, "messages": history, "tools": TOOLS})
    assert req.template_messages() == [
        {"role": "user", "content": "weather?"},
        {"role": "assistant", "content": None, "reasoning_content": "think", "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "content": "sunny", "tool_call_id": "call_1"}]


@pytest.mark.parametrize("message,param", [
    ({"role": "tool", "content": "x"}, "messages.0.tool_call_id"),
    ({"role": "user", "content": "x", "tool_call_id": "c"}, "messages.0.tool_call_id"),
    ({"role": "user", "content": "x", "tool_calls": []}, "messages.0"),
    ({"role": "assistant", "tool_calls": [{"id": "c", "type": "function", "function": {
        "name": "f", "arguments": "{not json"}}]}, "messages.0.tool_calls.0.function.arguments"),
    ({"role": "assistant", "tool_calls": [{"id": "c", "type": "function", "function": {
        "name": "f", "arguments": "[1]"}}]}, "messages.0.tool_calls.0.function.arguments"),
])
def test_bad_history_names_the_field(message, param):
    assert _error(ChatCompletionRequest, {**CHAT, "messages": [message]}).param == param


def test_chat_template_kwargs_are_template_variables_only():
    req = _parse(ChatCompletionRequest, {**CHAT, "chat_template_kwargs": {"enable_thinking": False}})
    assert req.chat_template_kwargs == {"enable_thinking": False}
    err = _error(ChatCompletionRequest, {**CHAT, "chat_template_kwargs": {"tokenize": True}})
    assert err.param == "chat_template_kwargs" and "tokenize cannot be set" in err.message
