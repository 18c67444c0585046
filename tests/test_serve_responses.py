"""Engine deltas -> OpenAI bodies and chunks (no Ray): choice numbering, logprobs formats, usage, echo;
chat replies with reasoning_content and tool_calls, streamed as chunks the openai client assembles."""
import json

from openai.lib.streaming.chat import ChatCompletionStreamState
from openai.types.chat import ChatCompletionChunk

from serve_app.http.messages import Delta, OutputSpec, StreamItem, ToolCall, ToolsSpec
from serve_app.http.responses import ChatBuilder, CompletionBuilder

# (token_id, logprob, rank, text): the sampled token first, then the top-k
LP_A = [(5, -0.1, 1, "a"), (6, -2.0, 2, "b")]
LP_B = [(7, -3.0, 3, "c"), (5, -0.5, 1, "a"), (6, -1.0, 2, "b")]


def _item(*deltas, prompt=4, finished=False):
    return StreamItem(deltas=list(deltas), num_prompt_tokens=prompt, finished=finished)


def test_completion_body_numbers_choices_per_prompt_and_counts_usage():
    b = CompletionBuilder("cmpl-1", "m", n=2, num_prompts=2, logprobs=None)
    b.add(0, _item(Delta(0, "he", [1]), Delta(1, "x", [2]), prompt=3))
    b.add(1, _item(Delta(1, "yz", [3, 4], finish_reason="length"), prompt=5))
    b.add(0, _item(Delta(0, "llo", [5], finish_reason="stop", stop_reason="!"), prompt=3, finished=True))
    body = b.final()
    assert body["object"] == "text_completion" and body["id"] == "cmpl-1"
    texts = {c["index"]: c["text"] for c in body["choices"]}
    assert texts == {0: "hello", 1: "x", 2: "", 3: "yz"}
    assert body["choices"][0]["finish_reason"] == "stop" and body["choices"][0]["stop_reason"] == "!"
    assert body["usage"] == {"prompt_tokens": 8, "completion_tokens": 5, "total_tokens": 13}


def test_completion_legacy_logprobs_with_offsets():
    b = CompletionBuilder("c", "m", n=1, num_prompts=1, logprobs=2)
    b.add(0, _item(Delta(0, "a", [5], logprobs=[LP_A])))
    b.add(0, _item(Delta(0, "c", [7], logprobs=[LP_B], finish_reason="length")))
    lp = b.final()["choices"][0]["logprobs"]
    assert lp["tokens"] == ["a", "c"]
    assert lp["token_logprobs"] == [-0.1, -3.0]
    assert lp["top_logprobs"][1] == {"c": -3.0, "a": -0.5, "b": -1.0}  # top-k plus the sampled one
    assert lp["text_offset"] == [0, 1]


def test_completion_echo_prefixes_prompt_and_offsets():
    b = CompletionBuilder("c", "m", n=1, num_prompts=1, logprobs=None, echo_texts=["Say: "])
    b.add(0, _item(Delta(0, "hi", [1], finish_reason="length")))
    assert b.final()["choices"][0]["text"] == "Say: hi"
    s = CompletionBuilder("c", "m", n=1, num_prompts=1, logprobs=1, echo_texts=["Say: "])
    chunks = s.add(0, _item(Delta(0, "a", [5], logprobs=[LP_A])), stream=True)
    assert chunks[0]["choices"][0]["text"] == "Say: a"
    assert chunks[0]["choices"][0]["logprobs"]["text_offset"] == [5]


def test_completion_echo_with_logprobs_starts_with_the_prompt():
    # Prompt "<s>Say: " as tokens ["<s>", "Say", ": "]; the echoed text has no "<s>".
    prompt_lps = [[(3, -4.0, 9, "Say"), (5, -0.1, 1, "a")], [(4, -0.5, 1, ": ")]]
    for stream in (False, True):
        b = CompletionBuilder("c", "m", n=1, num_prompts=1, logprobs=1, echo_texts=["Say: "],
                              echo_first_tokens=["<s>"])
        item = _item(Delta(0, "a", [5], logprobs=[LP_A], finish_reason="length"), prompt=3, finished=True)
        item.prompt_logprobs = prompt_lps
        chunks = b.add(0, item, stream=stream)
        choice = (chunks[0] if stream else b.final())["choices"][0]
        assert choice["text"] == "Say: a"
        assert choice["logprobs"] == {
            "tokens": ["<s>", "Say", ": ", "a"], "token_logprobs": [None, -4.0, -0.5, -0.1],
            "top_logprobs": [None, {"Say": -4.0, "a": -0.1}, {": ": -0.5}, {"a": -0.1, "b": -2.0}],
            "text_offset": [0, 0, 3, 5]}  # "<s>" is not in the text: offsets count back from its end


def test_completion_stream_chunks_skip_empty_and_carry_finish():
    b = CompletionBuilder("c", "m", n=1, num_prompts=1, logprobs=None)
    assert b.add(0, _item(Delta(0, "", [9])), stream=True) == []  # incomplete UTF-8: nothing to say yet
    (chunk,) = b.add(0, _item(Delta(0, "é", [10], finish_reason="stop")), stream=True)
    assert chunk["choices"][0] == {"index": 0, "text": "é", "logprobs": None, "finish_reason": "stop",
                                   "stop_reason": None}
    assert "usage" not in chunk


def test_chat_stream_role_first_then_content_then_finish_and_usage_chunk():
    b = ChatBuilder("chatcmpl-1", "m", n=1, num_prompts=1, logprobs=None, include_usage=True)
    chunks = b.add(0, _item(Delta(0, "Hi", [1])), stream=True)
    chunks += b.add(0, _item(Delta(0, "", [2], finish_reason="stop"), finished=True), stream=True)
    deltas = [c["choices"][0]["delta"] for c in chunks]
    assert deltas == [{"role": "assistant", "content": ""}, {"content": "Hi"}, {}]
    assert [c["choices"][0]["finish_reason"] for c in chunks] == [None, None, "stop"]
    assert all(c["object"] == "chat.completion.chunk" and c["usage"] is None for c in chunks)
    usage = b.usage_chunk()
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == 2


def test_chat_logprobs_top_k_by_rank():
    b = ChatBuilder("x", "m", n=1, num_prompts=1, logprobs=2)
    b.add(0, _item(Delta(0, "c", [7], logprobs=[LP_B], finish_reason="length")))
    (tok,) = b.final()["choices"][0]["logprobs"]["content"]
    assert tok["token"] == "c" and tok["logprob"] == -3.0 and tok["bytes"] == [99]
    assert [t["token"] for t in tok["top_logprobs"]] == ["a", "b"]  # the sampled one (rank 3) is not in the top 2


def test_chat_body():
    b = ChatBuilder("x", "m", n=2, num_prompts=1, logprobs=None)
    b.add(0, _item(Delta(0, "A", [1], finish_reason="stop"), Delta(1, "B", [2, 3], finish_reason="length")))
    body = b.final()
    assert body["object"] == "chat.completion"
    assert [c["message"] for c in body["choices"]] == [{"role": "assistant", "content": "A"},
                                                       {"role": "assistant", "content": "B"}]
    assert body["usage"]["completion_tokens"] == 3 and body["usage"]["prompt_tokens"] == 4


def test_logprob_minus_infinity_is_json_safe():
    b = CompletionBuilder("c", "m", n=1, num_prompts=1, logprobs=0)
    b.add(0, _item(Delta(0, "a", [5], logprobs=[[(5, float("-inf"), 900, "a")]])))
    assert b.final()["choices"][0]["logprobs"]["token_logprobs"] == [-9999.0]


# -- chat with a reasoning parser and tool calls -------------------------------------------------
REASONING = OutputSpec(reasoning_parser="qwen3")
CALLS = [ToolCall("call_a", "get_weather", '{"city": "Paris"}'), ToolCall("call_b", "get_time", "{}")]
THINKING = ["<th", "ink>Let me", " see</th", "ink>\n\nIt is", " sunny."]  # split inside the tags


def _stream_to_completion(chunks: list[dict]):
    """The chunks as the official openai client assembles a stream (its ChatCompletionStreamState)."""
    state = ChatCompletionStreamState()
    for chunk in chunks:
        state.handle_chunk(ChatCompletionChunk.model_validate(chunk))
    return state.get_final_completion()


def test_reasoning_is_read_apart_from_the_content_when_the_guardrail_did_not():
    for stream in (False, True):
        b = ChatBuilder("x", "m", n=1, num_prompts=1, logprobs=None, output=REASONING)
        chunks = []
        for i, piece in enumerate(THINKING):
            last = i == len(THINKING) - 1
            chunks += b.add(0, _item(Delta(0, piece, [i], finish_reason="stop" if last else None)), stream=stream)
        message = b.final()["choices"][0]["message"]
        assert message == {"role": "assistant", "content": "\n\nIt is sunny.", "reasoning_content": "Let me see"}
        if stream:
            streamed = _stream_to_completion(chunks).choices[0].message
            assert (streamed.content, streamed.reasoning_content) == ("\n\nIt is sunny.", "Let me see")
            assert all("<think>" not in json.dumps(c) for c in chunks)


def test_include_reasoning_false_leaves_it_out():
    b = ChatBuilder("x", "m", n=1, num_prompts=1, logprobs=None, output=REASONING, include_reasoning=False)
    b.add(0, _item(Delta(0, "<think>hm</think>ok", [1], finish_reason="stop")))
    assert b.final()["choices"][0]["message"] == {"role": "assistant", "content": "ok"}


def test_read_deltas_are_reported_as_read():
    """What the guardrail passes on (parsed): its content, reasoning and calls, never read again."""
    b = ChatBuilder("x", "m", n=1, num_prompts=1, logprobs=None, output=REASONING)
    b.add(0, _item(Delta(0, "<think>is content here</think>", [1], reasoning="r", parsed=True)))
    b.add(0, _item(Delta(0, "", [2], finish_reason="stop", tool_calls=CALLS, parsed=True)))
    choice = b.final()["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    assert choice["message"] == {
        "role": "assistant", "content": "<think>is content here</think>", "reasoning_content": "r",
        "tool_calls": [{"id": "call_a", "type": "function", "function": {"name": "get_weather",
                                                                          "arguments": '{"city": "Paris"}'}},
                       {"id": "call_b", "type": "function", "function": {"name": "get_time", "arguments": "{}"}}]}


def test_tool_calls_alone_have_null_content_and_stream_as_openais_deltas():
    spec = OutputSpec(tools=ToolsSpec("required", {"get_weather": {}, "get_time": {}}))
    whole = ChatBuilder("x", "m", n=2, num_prompts=1, logprobs=None, output=spec)
    streamed = ChatBuilder("x", "m", n=2, num_prompts=1, logprobs=None, output=spec)
    items = [_item(Delta(1, "no call", [1], finish_reason="stop", parsed=True)),  # choice 1 first: n > 1
             _item(Delta(0, "", [2, 3], finish_reason="stop", tool_calls=CALLS, parsed=True), finished=True)]
    chunks = [c for item in items for c in streamed.add(0, item, stream=True)]
    for item in items:
        whole.add(0, item)
    body = whole.final()
    assert body["choices"][0]["message"]["content"] is None and body["choices"][0]["finish_reason"] == "tool_calls"
    assert body["choices"][1]["message"] == {"role": "assistant", "content": "no call"}
    assert body["choices"][1]["finish_reason"] == "stop"
    calls = [c["choices"][0]["delta"]["tool_calls"][0] for c in chunks if "tool_calls" in c["choices"][0]["delta"]]
    assert calls == [  # the header (index, id, type, name) first, then the arguments, per call
        {"index": 0, "id": "call_a", "type": "function", "function": {"name": "get_weather", "arguments": ""}},
        {"index": 0, "function": {"arguments": '{"city": "Paris"}'}},
        {"index": 1, "id": "call_b", "type": "function", "function": {"name": "get_time", "arguments": ""}},
        {"index": 1, "function": {"arguments": "{}"}}]
    assembled = _stream_to_completion(chunks)
    assert [c.finish_reason for c in assembled.choices] == ["tool_calls", "stop"]
    assert assembled.choices[1].message.content == "no call"
    assert [(c.id, c.function.name, c.function.arguments) for c in assembled.choices[0].message.tool_calls] == \
        [(c["id"], c["function"]["name"], c["function"]["arguments"])
         for c in body["choices"][0]["message"]["tool_calls"]]
