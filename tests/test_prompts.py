"""engine.entrypoints.prompts: chat templates, the special-token rule, prompt checks, tokenizer loading."""
import subprocess
import sys
from pathlib import Path

import pytest

from engine.entrypoints.prompts import (ModelLimits, add_special_tokens, check_chat_template_kwargs, check_not_empty,
                                        check_prompt, encode, has_chat_template, load_tokenizer, render_chats)
from engine.errors import InvalidRequestError, PromptTooLongError

ROOT = Path(__file__).resolve().parents[1]
CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello there"}]
OTHER = [{"role": "user", "content": "Another one"}]
# A template that refuses one conversation, as templates do (roles out of order, say).
PICKY_TEMPLATE = ("{% if messages[0]['content'] == 'bad' %}{{ raise_exception('no bad words') }}{% endif %}"
                  "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}")
LIMITS = ModelLimits(max_model_len=16, vocab_size=100)


@pytest.fixture(scope="module")
def llama_tok(tiny_llama):
    return load_tokenizer(tiny_llama)


@pytest.fixture(scope="module")
def qwen_tok(tiny_qwen2):
    return load_tokenizer(tiny_qwen2)


def test_render_chats_equals_the_template_one_by_one(qwen_tok):
    for gen in (True, False):
        out = render_chats(qwen_tok, [CHAT, OTHER], add_generation_prompt=gen)
        assert out == [qwen_tok.apply_chat_template(c, tokenize=False, add_generation_prompt=gen) for c in (CHAT, OTHER)]
    assert render_chats(qwen_tok, [CHAT])[0].endswith("<|im_start|>assistant\n")


def test_continue_final_message_leaves_the_last_message_open(qwen_tok):
    partial = [*OTHER, {"role": "assistant", "content": "Sure, here"}]
    (text,) = render_chats(qwen_tok, [partial], add_generation_prompt=False, continue_final_message=True)
    assert text.endswith("Sure, here")  # no <|im_end|>: the model goes on from there


def test_chat_template_given_replaces_the_models(qwen_tok):
    (text,) = render_chats(qwen_tok, [OTHER], chat_template=PICKY_TEMPLATE)
    assert text == "<user>Another one"


def test_a_refused_conversation_costs_the_others_nothing(qwen_tok):
    bad = [{"role": "user", "content": "bad"}]
    out = render_chats(qwen_tok, [OTHER, bad, CHAT], chat_template=PICKY_TEMPLATE)
    assert out[0] == "<user>Another one" and out[2].startswith("<system>Be brief.")
    assert isinstance(out[1], InvalidRequestError) and out[1].param == "messages"
    assert "no bad words" in str(out[1])


def test_no_chat_template_is_an_error_for_each_conversation(tiny_qwen2):
    tok = load_tokenizer(tiny_qwen2)  # a copy of its own: the test removes its template
    tok.chat_template = None
    assert not has_chat_template(tok) and has_chat_template(tok, PICKY_TEMPLATE)
    out = render_chats(tok, [CHAT, OTHER])
    assert [str(e) for e in out] == ["the model has no chat template"] * 2
    assert all(isinstance(e, InvalidRequestError) for e in out)


# -- tools and template variables (the tools-aware checkpoint, tests/fixtures/qwen_tools_chat_template.jinja) --
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather of a city",
                                            "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                           "required": ["city"]}}}
ASKED = [{"role": "user", "content": "Weather in Paris?"}]
# An agent's history: the assistant called a tool (arguments as JSON text, OpenAI's form), the tool answered.
HISTORY = [*ASKED, {"role": "assistant", "content": None, "tool_calls": [
    {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]


@pytest.fixture(scope="module")
def tools_tok(tiny_qwen3_tools):
    return load_tokenizer(tiny_qwen3_tools)


def test_tools_reach_the_template_as_transformers_passes_them(tools_tok):
    (text,) = render_chats(tools_tok, [ASKED], tools=[WEATHER])
    assert text == tools_tok.apply_chat_template(ASKED, tools=[WEATHER], add_generation_prompt=True, tokenize=False)
    assert '<tools>\n{"type": "function", "function": {"name": "get_weather"' in text
    assert text.endswith("<|im_start|>user\nWeather in Paris?<|im_end|>\n<|im_start|>assistant\n")
    assert "<tools>" not in render_chats(tools_tok, [ASKED])[0]  # no tools, no tool prompt


def test_tool_calls_and_tool_results_are_rendered(tools_tok):
    (text,) = render_chats(tools_tok, [HISTORY], tools=[WEATHER])
    # The template gets the arguments as an object (templates tojson them): the same text either way.
    as_object = [*ASKED, {**HISTORY[1], "tool_calls": [{**HISTORY[1]["tool_calls"][0], "function": {
        "name": "get_weather", "arguments": {"city": "Paris"}}}]}, HISTORY[2]]
    assert text == tools_tok.apply_chat_template(as_object, tools=[WEATHER], add_generation_prompt=True,
                                                 tokenize=False)
    assert text.endswith('<|im_start|>assistant\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}'
                         '\n</tool_call><|im_end|>\n<|im_start|>user\n<tool_response>\nsunny\n</tool_response>'
                         '<|im_end|>\n<|im_start|>assistant\n')
    bad = [*ASKED, {**HISTORY[1], "tool_calls": [{**HISTORY[1]["tool_calls"][0], "function": {
        "name": "get_weather", "arguments": "{not json"}}]}]
    out = render_chats(tools_tok, [bad, ASKED], tools=[WEATHER])
    assert isinstance(out[0], InvalidRequestError) and "arguments is not JSON" in str(out[0])
    assert isinstance(out[1], str)  # the other conversation is rendered all the same


def test_chat_template_kwargs_reach_the_template(tools_tok):
    (off,) = render_chats(tools_tok, [ASKED], chat_template_kwargs={"enable_thinking": False})
    assert off == tools_tok.apply_chat_template(ASKED, add_generation_prompt=True, tokenize=False,
                                                enable_thinking=False)
    assert off.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert not render_chats(tools_tok, [ASKED])[0].endswith("</think>\n\n")
    for key in ("tokenize", "tools", "chat_template"):
        with pytest.raises(InvalidRequestError, match=f"chat_template_kwargs.{key} cannot be set") as e:
            check_chat_template_kwargs({key: True})
        assert e.value.param == "chat_template_kwargs"
        (refused,) = render_chats(tools_tok, [ASKED], chat_template_kwargs={key: True})
        assert isinstance(refused, InvalidRequestError)


def test_the_tool_and_thinking_markers_are_single_tokens_kept_by_decoding(tools_tok):
    for marker in ("<tool_call>", "</tool_call>", "<think>", "</think>"):
        (token_id,) = tools_tok.encode(marker, add_special_tokens=False)
        assert tools_tok.decode([token_id], skip_special_tokens=True) == marker  # parsers see it in the text


def test_special_tokens_a_plain_prompt_gets_and_a_rendered_chat_does_not(llama_tok):
    bos = llama_tok.bos_token_id
    assert add_special_tokens(chat=False) and not add_special_tokens(chat=True)
    (plain,) = encode(llama_tok, ["Hello there"], chat=False)
    assert plain == llama_tok.encode("Hello there") and plain[0] == bos
    (text,) = render_chats(llama_tok, [CHAT])
    assert text.startswith(llama_tok.bos_token)  # this template writes the BOS itself ...
    (chat,) = encode(llama_tok, [text], chat=True)
    assert chat[0] == bos and chat[1] != bos  # ... so it is there once, not twice
    assert chat == llama_tok.encode(text, add_special_tokens=False)
    assert encode(llama_tok, [], chat=True) == []


def test_one_call_encodes_as_one_by_one(qwen_tok):
    texts = ["Hello there", "a", "日本語 🙂"]
    assert encode(qwen_tok, texts, chat=False) == [qwen_tok.encode(t) for t in texts]


def test_checks_name_the_field_at_fault():
    with pytest.raises(InvalidRequestError, match="empty") as e:
        check_not_empty([], param="messages")
    assert e.value.param == "messages"
    with pytest.raises(InvalidRequestError, match=r"Token id 100 is out of vocabulary \(vocab_size=100\)"):
        check_prompt([1, 100], 4, LIMITS)
    with pytest.raises(InvalidRequestError, match="Token id -1"):
        check_prompt([-1], 4, LIMITS)
    check_prompt([1] * 12, 4, LIMITS)  # exactly max_model_len: fits


@pytest.mark.parametrize("num_prompt, max_tokens, at_fault", [
    (12, 5, "max_tokens"),  # the prompt fits alone: ask for fewer tokens
    (16, 5, "prompt"),      # the prompt alone fills the model
    (16, None, "prompt"),   # no max_tokens: one completion token still has to fit
])
def test_too_long_is_openais_context_length_error(num_prompt, max_tokens, at_fault):
    with pytest.raises(PromptTooLongError) as e:
        check_prompt([1] * num_prompt, max_tokens, LIMITS)
    asked = num_prompt + (max_tokens or 1)
    assert str(e.value).startswith(f"This model's maximum context length is 16 tokens. However, you requested "
                                   f"{asked} tokens ({num_prompt} in the prompt")
    assert (e.value.param, e.value.code) == (at_fault, "context_length_exceeded")


def test_importing_it_loads_no_torch():
    code = ("import sys\nimport engine.entrypoints.prompts\n"
            "print(sorted(m for m in ('torch', 'triton', 'transformers') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.split() == ["[]"]
