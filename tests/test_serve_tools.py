"""Tools, reasoning and every structured-output form through the real Serve app and the official `openai` client.

One app for the module (the three deployments, on the suite's shared Ray cluster) serving the
tools-aware tiny checkpoint (tests/fixtures/qwen_tools_chat_template.jinja) with the qwen3
reasoning parser and the hermes tool-call parser. Its weights are random: only the grammar makes
it call a tool, and only the guardrail makes every returned call valid, which is what is checked.
Requests go concurrently, n > 1 where a request can carry several seeds, to keep the module short.
"""
import concurrent.futures
import json
import re

import httpx
import jsonschema
import openai
import pytest

from engine.entrypoints.prompts import load_tokenizer
from engine.reasoning import Qwen3ReasoningParser
from serve_app.args import parse_app_args
from serve_app.local import deployed_app

pytestmark = pytest.mark.timeout(600)

APP = "test_serve_tools"  # the module's app on the suite's shared Ray cluster, and its route prefix
MODEL = "tiny-tools"
ENGINE = dict(device="cpu", dtype="float32", max_model_len=1024, num_kv_blocks=512, max_num_seqs=64, seed=0)
NUM_SEEDS = 20
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
NO_THINKING = {"chat_template_kwargs": {"enable_thinking": False}}  # the template closes <think> in the prompt
# Bounded strings and small enums, so that a random-weight model closes every call within max_tokens.
WEATHER = {"type": "object", "properties": {
    "city": {"type": "string", "minLength": 1, "maxLength": 10},
    "unit": {"enum": ["celsius", "fahrenheit"]},
    "days": {"type": "integer", "minimum": 1, "maximum": 7}},
    "required": ["city", "unit", "days"], "additionalProperties": False}
CLOCK = {"type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"],
         "additionalProperties": False}
SCHEMAS = {"get_weather": WEATHER, "get_time": CLOCK}
TOOLS = [{"type": "function", "function": {"name": name, "description": f"{name} of a place", "parameters": schema}}
         for name, schema in SCHEMAS.items()]
NAMED = {"type": "function", "function": {"name": "get_weather"}}


def test_the_app_args_name_a_bad_parser_or_policy(tiny_qwen3_tools):
    base = dict(model=tiny_qwen3_tools, device="cpu")
    assert parse_app_args({**base, "tool_call_parser": "hermes"}).unknown_request_fields == "reject"
    with pytest.raises(ValueError, match="tool_call_parser: unknown tool call parser 'hermez'"):
        parse_app_args({**base, "tool_call_parser": "hermez"})
    with pytest.raises(ValueError, match="unknown_request_fields"):
        parse_app_args({**base, "unknown_request_fields": "maybe"})


@pytest.fixture(scope="module")
def base_url(ray_cluster, tiny_qwen3_tools):
    # The step loop in the engine replica's thread (engine_process=False): what is tested here is the
    # HTTP tier's parsing, and the replica starts without a second process importing torch.
    args = dict(model=tiny_qwen3_tools, served_model_name=MODEL, reasoning_parser="qwen3",
                tool_call_parser="hermes", engine_process=False, **ENGINE)
    with deployed_app(ray_cluster, args, APP) as url:
        yield url


@pytest.fixture(scope="module")
def client(base_url):
    return openai.OpenAI(base_url=base_url + "/v1", api_key="none", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def tokenizer(tiny_qwen3_tools):
    return load_tokenizer(tiny_qwen3_tools)


def _chat(client, **kwargs):
    extra = {**NO_THINKING, **kwargs.pop("extra_body", {})}
    return client.chat.completions.create(model=MODEL, messages=kwargs.pop("messages", ASK), extra_body=extra,
                                          **kwargs)


def _calls(message) -> list[tuple[str, dict]]:
    return [(c.function.name, json.loads(c.function.arguments)) for c in message.tool_calls or ()]


def _check_calls(choice, expected_names) -> None:
    """Every call names a tool, its arguments validate against the tool's whole schema, and the
    reply is OpenAI's tool-call reply."""
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    calls = _calls(choice.message)
    assert calls and {name for name, _ in calls} <= expected_names
    for name, arguments in calls:
        jsonschema.validate(arguments, SCHEMAS[name])
    assert all(c.type == "function" and c.id.startswith("call_") for c in choice.message.tool_calls)


def test_forced_calls_parse_and_validate_for_every_seed(client):
    """A named tool and tool_choice "required", 20 seeds each at temperature 1, sent at once."""
    requests = {"named": dict(tool_choice=NAMED), "required": dict(tool_choice="required", parallel_tool_calls=False)}
    with concurrent.futures.ThreadPoolExecutor(len(requests)) as pool:
        replies = {kind: pool.submit(_chat, client, tools=TOOLS, n=NUM_SEEDS, temperature=1.0, seed=7,
                                     max_tokens=120, **kw) for kind, kw in requests.items()}
        replies = {kind: future.result() for kind, future in replies.items()}
    for choice in replies["named"].choices:
        _check_calls(choice, {"get_weather"})
        assert len(choice.message.tool_calls) == 1
    for choice in replies["required"].choices:
        _check_calls(choice, set(SCHEMAS))
        assert len(choice.message.tool_calls) == 1  # parallel_tool_calls false
    distinct = {json.dumps(_calls(c.message)) for c in replies["named"].choices}
    assert len(distinct) > NUM_SEEDS // 2  # 20 seeds, not one answer 20 times


@pytest.mark.parametrize("tool_choice", [NAMED, "required"])
def test_streamed_calls_assemble_to_the_non_streamed_ones(client, tool_choice):
    kwargs = dict(tools=TOOLS, tool_choice=tool_choice, temperature=1.0, seed=11, max_tokens=120)
    whole = _chat(client, **kwargs).choices[0]
    with client.chat.completions.stream(model=MODEL, messages=ASK, extra_body=NO_THINKING, **kwargs) as stream:
        chunks = [event.chunk for event in stream if event.type == "chunk"]
        streamed = stream.get_final_completion().choices[0]
    assert _calls(streamed.message) == _calls(whole.message) and streamed.finish_reason == "tool_calls"
    header = next(c.choices[0].delta.tool_calls[0] for c in chunks if c.choices and c.choices[0].delta.tool_calls)
    assert header.id and header.function.name and header.function.arguments == ""  # name first, then arguments


def test_tool_choice_none_returns_content_only(client):
    reply = _chat(client, tools=TOOLS, tool_choice="none", max_tokens=8, temperature=1.0, seed=1)
    message = reply.choices[0].message
    assert isinstance(message.content, str) and not message.tool_calls
    assert reply.choices[0].finish_reason in ("stop", "length")


def test_auto_without_a_call_is_content(client):
    reply = _chat(client, tools=TOOLS, max_tokens=8, temperature=1.0, seed=2)  # no tool_choice with tools: auto
    assert reply.choices[0].finish_reason in ("stop", "length") and not reply.choices[0].message.tool_calls


def test_a_conversation_with_tool_results_is_accepted(client):
    first = _chat(client, tools=TOOLS, tool_choice=NAMED, temperature=1.0, seed=3, max_tokens=120)
    call = first.choices[0].message.tool_calls[0]
    history = [*ASK, first.choices[0].message,  # the reply object itself, sent back as agents do
               {"role": "tool", "tool_call_id": call.id, "content": "sunny, 24 degrees"}]
    reply = _chat(client, messages=history, tools=TOOLS, tool_choice="required", parallel_tool_calls=False,
                  temperature=1.0, seed=4, max_tokens=120)
    _check_calls(reply.choices[0], set(SCHEMAS))
    assert reply.usage.prompt_tokens > first.usage.prompt_tokens  # the call and its result are in the prompt


@pytest.mark.parametrize("fields,param", [
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "objekt"}}}]},
     "tools.0.function.parameters"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "get_news"}}}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": NAMED, "response_format": {"type": "json_object"}}, "tool_choice"),
    ({"guided_regex": "(unclosed"}, "guided_regex"),
    ({"guided_grammar": "root ::= undefined_rule"}, "guided_grammar"),
    ({"structured_outputs": {"choice": []}}, "structured_outputs.choice"),
    ({"guided_regex": "a", "guided_choice": ["a"]}, "guided_choice"),
    ({"logit_bias": {"99999999": 5}}, "logit_bias"),
    ({"reasoning_effort": "high"}, "reasoning_effort"),
    ({"frobnicate": True}, "frobnicate"),
])
def test_bad_input_is_a_400_naming_the_field(base_url, fields, param):
    body = {"model": MODEL, "messages": ASK, "max_tokens": 4, **fields}
    response = httpx.post(base_url + "/v1/chat/completions", json=body, timeout=60)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert (error["type"], error["param"]) == ("invalid_request_error", param), error


def test_regex_and_choice_through_extra_body(client):
    pattern = r"[a-c]{2,4}-[0-9]{2}"
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        # A completions prompt is the client's own: on a server with a reasoning parser the grammar waits
        # for the thinking to end, so this prompt closes it, as the chat template does with enable_thinking off.
        regex = pool.submit(client.completions.create, model=MODEL, prompt="<think>\n\n</think>\n\nCode:", n=8,
                            temperature=1.0, seed=5, max_tokens=16, extra_body={"guided_regex": pattern})
        choice = pool.submit(_chat, client, n=8, temperature=1.0, seed=6, max_tokens=16,
                             extra_body={"structured_outputs": {"choice": ["sunny", "rainy", "windy"]}})
        regex, choice = regex.result(), choice.result()
    assert all(re.fullmatch(pattern, c.text) for c in regex.choices), [c.text for c in regex.choices]
    assert all(c.message.content in ("sunny", "rainy", "windy") for c in choice.choices)


def test_logit_bias_plus_100_forces_a_token(client, tokenizer):
    forced = tokenizer.encode(" weather", add_special_tokens=False)[0]
    reply = client.completions.create(model=MODEL, prompt="Hello", max_tokens=6, temperature=1.0, seed=8,
                                      logit_bias={str(forced): 100}, logprobs=0)
    assert reply.choices[0].finish_reason == "length" and reply.usage.completion_tokens == 6
    assert reply.choices[0].logprobs.tokens == [tokenizer.decode([forced])] * 6


def test_reasoning_is_separated_from_the_content(client, tokenizer):
    """A random-weight model made to think: the regex lets it write `<think>`, letters, `</think>`, letters
    (the template closed the thinking in the prompt, so the grammar holds from the first token), and
    logit_bias +100 forces `</think>` as soon as the grammar allows it (after one token of letters).
    reasoning_content and content come apart, with no tag left in either, streamed and not, as the qwen3
    parser splits the sampled tokens."""
    end = tokenizer.convert_tokens_to_ids("</think>")
    kwargs = dict(model=MODEL, messages=ASK, n=8, temperature=1.0, seed=9, max_tokens=16, logprobs=True,
                  top_logprobs=0, logit_bias={str(end): 100},
                  extra_body={**NO_THINKING, "guided_regex": "<think>[a-z]{1,6}</think>[a-z]{1,6}"})
    whole = client.chat.completions.create(**kwargs)
    split = [(c.message.reasoning_content, c.message.content) for c in whole.choices]
    for (reasoning, content), choice in zip(split, whole.choices):
        assert re.fullmatch("[a-z]{1,6}", reasoning) and re.fullmatch("[a-z]{1,6}", content)
        tokens = [t.token for t in choice.logprobs.content]
        thought = tokens.index("</think>")  # the one token logit_bias forced, not "<", "/", ... pieces
        assert tokens[thought - 1] == reasoning  # right after the first token the grammar let it end on
        sampled = "".join(tokens)
        assert sampled == f"<think>{reasoning}</think>{content}"
        assert Qwen3ReasoningParser().extract(sampled) == (reasoning, content)
    with client.chat.completions.stream(**kwargs) as stream:
        streamed = stream.get_final_completion()
    assert [(c.message.reasoning_content, c.message.content) for c in streamed.choices] == split
