"""Tool-call parsers (hermes, llama3_json, mistral) on fixed model texts.

Each text has its expected content and calls written out here. Streaming must give the same: the
text fed one character at a time, split in two at every boundary, and in random chunkings (fixed
seed), assembled as the `openai` client assembles deltas (name and id from a call's first delta,
arguments concatenated by index).
"""
import json
import random
import re
import subprocess
import sys

import pytest

from engine.entrypoints.tool_parsers import (
    TOOL_PARSERS,
    StreamDelta,
    ToolCall,
    get_tool_parser,
)

CALL = '{"name": "get_weather", "arguments": {"city": "Paris"}}'
WEATHER = ("get_weather", '{"city": "Paris"}')
NESTED_ARGS = {"code": 'if x: {"a": [1, 2]} # </tool_call> <tool_call> [TOOL_CALLS] ; {', "opts": {"deep": [{"k": "}"}]}}

HERMES_CASES = [
    # (model text, expected content, expected [(name, arguments)])
    ("The weather is fine.", "The weather is fine.", []),
    ("  \n", "  \n", []),
    ("", None, []),
    (f"<tool_call>\n{CALL}\n</tool_call>", None, [WEATHER]),
    ((f"<tool_call>\n{CALL}\n</tool_call>\n<tool_call>\n"
     '{"name": "get_time", "arguments": {"tz": "CET"}}\n</tool_call>\n'), None,
     [WEATHER, ("get_time", '{"tz": "CET"}')]),
    (f"Let me check.\n<tool_call>\n{CALL}\n</tool_call>\nDone.", "Let me check.\n\nDone.", [WEATHER]),
    ('<tool_call>{"name": "now"}</tool_call>', None, [("now", "{}")]),
    # Unicode in names and values; an escaped character comes out canonical (unescaped).
    ('<tool_call>{"name": "天气", "arguments": {"city": "東京 🌸", "e": "caf\\u00e9"}}</tool_call>', None,
     [("天气", '{"city": "東京 🌸", "e": "café"}')]),
    # Tags, brackets and quotes inside strings do not end the call.
    (f"<tool_call>\n{json.dumps({'name': 'run', 'arguments': NESTED_ARGS})}\n</tool_call>", None,
     [("run", json.dumps(NESTED_ARGS, ensure_ascii=False))]),
    # Unclosed at the end with the JSON complete: a call (documented choice, as vLLM).
    (f"<tool_call>\n{CALL}\n", None, [WEATHER]),
    # Malformed: all content, verbatim.
    ('<tool_call>\n{"name": "f", "arguments": {"x": 1,}}\n</tool_call>',
     '<tool_call>\n{"name": "f", "arguments": {"x": 1,}}\n</tool_call>', []),
    ('<tool_call>{"arguments": {}}</tool_call>', '<tool_call>{"arguments": {}}</tool_call>', []),
    ('<tool_call>{"name": "f", "arguments": "x=1"}</tool_call>',
     '<tool_call>{"name": "f", "arguments": "x=1"}</tool_call>', []),
    ('<tool_call>{"name": "f", "arguments": {}} and more</tool_call>',
     '<tool_call>{"name": "f", "arguments": {}} and more</tool_call>', []),
    ('Sure <tool_call>\n{"name": "f", "argu', 'Sure <tool_call>\n{"name": "f", "argu', []),
    ('<tool_call>{"name": "f", "arguments": {}}</tool_', '<tool_call>{"name": "f", "arguments": {}}</tool_', []),
    ("use <tool_call> tags, a < b <tool_c", "use <tool_call> tags, a < b <tool_c", []),
    ("Done.\n<tool_call>\n", "Done.\n<tool_call>\n", []),
    # A malformed call does not hide a valid one after it.
    (f"<tool_call>oops</tool_call>\n<tool_call>{CALL}</tool_call>", "<tool_call>oops</tool_call>\n", [WEATHER]),
]

LLAMA_CASES = [
    ("Hello there.", "Hello there.", []),
    ('{"name": "get_weather", "parameters": {"city": "Paris"}}', None, [WEATHER]),
    (f"\n {CALL} \n", None, [WEATHER]),
    ('<|python_tag|>{"name": "a", "parameters": {}}; {"name": "b", "arguments": {"x": [1, {"y": "}; {"}]}}',
     None, [("a", "{}"), ("b", '{"x": [1, {"y": "}; {"}]}')]),
    ('{"name": "翻訳", "parameters": {"text": "Grüße, 世界 \\ud83d\\ude00"}}', None,
     [("翻訳", '{"text": "Grüße, 世界 😀"}')]),
    (json.dumps({"name": "run", "parameters": NESTED_ARGS}), None, [("run", json.dumps(NESTED_ARGS, ensure_ascii=False))]),
    # Calls, then text that is not `; <call>`: content, the whitespace before it dropped.
    ('{"name": "a", "parameters": {}}\nThat is all.', "That is all.", [("a", "{}")]),
    ('{"name": "a", "parameters": {}}; {"name": 3}', '; {"name": 3}', [("a", "{}")]),
    ('{"name": "a", "parameters": {}};', ";", [("a", "{}")]),
    # Not a call at the start: the whole reply is content.
    ('{"answer": 42}', '{"answer": 42}', []),
    ('{"name": "a", "parameters": {"x": }}', '{"name": "a", "parameters": {"x": }}', []),
    ('Sure: {"name": "a", "parameters": {}}', 'Sure: {"name": "a", "parameters": {}}', []),
    ('<|python_tag|>brave_search.call(query="x")', '<|python_tag|>brave_search.call(query="x")', []),
    (' {"name": "a", "parameters": {"x": "unterminated', ' {"name": "a", "parameters": {"x": "unterminated', []),
    ("<|pyth", "<|pyth", []),
]

MISTRAL_CASES = [
    ("Bonjour.", "Bonjour.", []),
    (('[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}, '
     '{"name": "get_time", "arguments": {"tz": "CET"}, "id": "abc123def"}]'), None,
     [WEATHER, ("get_time", '{"tz": "CET"}')]),
    ('[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}[TOOL_CALLS]get_time[ARGS]{"tz": "CET"}', None,
     [WEATHER, ("get_time", '{"tz": "CET"}')]),
    ("Let me look. [TOOL_CALLS] [" + CALL + "]", "Let me look. ", [WEATHER]),
    ('[TOOL_CALLS]f[ARGS]{} Done', " Done", [("f", "{}")]),
    ('[TOOL_CALLS]search[ARGS]{"q": "[TOOL_CALLS] ] } 東京", "f": {"a": [{"b": "]"}]}}', None,
     [("search", '{"q": "[TOOL_CALLS] ] } 東京", "f": {"a": [{"b": "]"}]}}')]),
    # Malformed: all content, verbatim.
    ('[TOOL_CALLS][{"name": "f", "arguments": {}}, {"arguments": {}}]',
     '[TOOL_CALLS][{"name": "f", "arguments": {}}, {"arguments": {}}]', []),
    ("[TOOL_CALLS][]", "[TOOL_CALLS][]", []),
    ('[TOOL_CALLS]f[ARGS]"x"', '[TOOL_CALLS]f[ARGS]"x"', []),
    ('[TOOL_CALLS]f[ARGS]{"a": 1', '[TOOL_CALLS]f[ARGS]{"a": 1', []),
    ("[TOOL_CALLS]get weather[ARGS]{}", "[TOOL_CALLS]get weather[ARGS]{}", []),
    ("Hmm [TOOL_CALLS]", "Hmm [TOOL_CALLS]", []),
    ("[TOOL_CALLS]f[AR", "[TOOL_CALLS]f[AR", []),
]

CASES = [("hermes", *case) for case in HERMES_CASES] + [("llama3_json", *case) for case in LLAMA_CASES] + [
    ("mistral", *case) for case in MISTRAL_CASES]
CASE_IDS = [f"{name}-{i}" for name, cases in (("hermes", HERMES_CASES), ("llama3_json", LLAMA_CASES),
                                              ("mistral", MISTRAL_CASES)) for i in range(len(cases))]
ID_SHAPES = {"hermes": r"call_[A-Za-z0-9]{24}", "llama3_json": r"call_[A-Za-z0-9]{24}", "mistral": r"[A-Za-z0-9]{9}"}


def stream(parser_name: str, chunks: list[str]) -> tuple[str | None, list[ToolCall]]:
    """Feed the chunks and assemble the deltas as a client does, checking the delta protocol."""
    streamer = get_tool_parser(parser_name)().streamer()
    deltas: list[StreamDelta] = [streamer.feed(chunk) for chunk in chunks] + [streamer.finish()]
    calls: list[ToolCall] = []
    for part in (part for delta in deltas for part in delta.tool_calls):
        if part.index == len(calls):  # a call's first delta: id and name, nothing else
            assert part.id and part.name and not part.arguments
            calls.append(ToolCall(name=part.name, arguments="", id=part.id))
        else:
            assert part.index == len(calls) - 1 and part.id is None and part.name is None
            calls[part.index].arguments += part.arguments
    return "".join(delta.content for delta in deltas) or None, calls


def random_chunks(text: str, rng: random.Random) -> list[str]:
    cuts = sorted(rng.sample(range(1, len(text)), k=min(len(text) - 1, rng.randint(1, 12)))) if len(text) > 1 else []
    return [text[i:j] for i, j in zip([0, *cuts], [*cuts, len(text)])]


def as_pairs(calls: list[ToolCall]) -> list[tuple[str, str]]:
    return [(call.name, call.arguments) for call in calls]


@pytest.mark.parametrize(("parser_name", "text", "content", "calls"), CASES, ids=CASE_IDS)
def test_extract(parser_name, text, content, calls):
    extracted = get_tool_parser(parser_name)().extract(text)
    assert extracted.content == content
    assert as_pairs(extracted.tool_calls) == calls
    for call in extracted.tool_calls:
        assert re.fullmatch(ID_SHAPES[parser_name], call.id)
        assert isinstance(json.loads(call.arguments), dict)
    # Nothing the model wrote is lost: without calls, the content is the text itself.
    if not calls:
        assert content == (text or None)


@pytest.mark.parametrize(("parser_name", "text", "content", "calls"), CASES, ids=CASE_IDS)
def test_streaming_equals_extract_at_every_split(parser_name, text, content, calls):
    got_content, got_calls = stream(parser_name, list(text))  # one character at a time
    assert (got_content, as_pairs(got_calls)) == (content, calls)
    for i in range(len(text) + 1):
        got_content, got_calls = stream(parser_name, [text[:i], text[i:]])
        assert (got_content, as_pairs(got_calls)) == (content, calls), f"split at {i}: {text[:i]!r} | {text[i:]!r}"
    rng = random.Random(32)
    for _ in range(20):
        chunks = random_chunks(text, rng)
        got_content, got_calls = stream(parser_name, chunks)
        assert (got_content, as_pairs(got_calls)) == (content, calls), f"chunks {chunks!r}"


def test_call_is_held_until_complete_and_content_streams_at_once():
    streamer = get_tool_parser("hermes")().streamer()
    first = streamer.feed(f"Hello <tool_call>\n{CALL}\n</tool_cal")
    assert first.content == "Hello " and first.tool_calls == []  # the partial tag is held back
    second = streamer.feed("l>")
    assert second.content == "" and [(d.index, d.name, d.arguments) for d in second.tool_calls] == [
        (0, "get_weather", ""), (0, None, '{"city": "Paris"}')]
    assert streamer.finish() == StreamDelta()


def test_plain_text_streams_without_holding():
    for name in TOOL_PARSERS:
        streamer = get_tool_parser(name)().streamer()
        assert streamer.feed("Hi") == StreamDelta(content="Hi")
        assert streamer.feed(" there") == StreamDelta(content=" there")


def test_unknown_parser_names_the_choices():
    with pytest.raises(ValueError, match=r"'nope'.*hermes, llama3_json, mistral"):
        get_tool_parser("nope")


def test_imports_no_torch():
    code = "import sys, engine.entrypoints.tool_parsers, engine.reasoning; assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)
