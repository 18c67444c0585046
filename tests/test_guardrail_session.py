"""serve_app.guard.session: what a JSON or tool-calling request generates, passes on, retries and fails with
(no Ray)."""
import json

import pytest

from engine.errors import InvalidRequestError
from engine.sampling_params import SamplingParams, StructuredOutputsParams
from serve_app.http.errors import stream_error
from serve_app.guard.policy import GuardrailPolicy
from serve_app.guard.session import GuardedRequest, attempt_seed
from serve_app.http.messages import Delta, EngineRequest, OutputSpec, StreamError, StreamItem, ToolsSpec

SCHEMA = {"type": "object", "properties": {"a": {"type": "integer", "maximum": 5}}, "required": ["a"],
          "additionalProperties": False}
EMAIL = r"[\w.+-]+@[\w-]+\.[\w.]+"


def _request(n=1, stream=False, temperature=1.0, seed=None, schema=SCHEMA, logprobs=None):
    spec = StructuredOutputsParams(json=schema) if schema is not None else StructuredOutputsParams(json_object=True)
    params = SamplingParams(n=n, temperature=temperature, seed=seed, logprobs=logprobs, structured_outputs=spec)
    return EngineRequest("req", [1, 2, 3], params, stream=stream, json_mode=True, batch_id="b")


def _item(*deltas, finished=False):
    return StreamItem(deltas=list(deltas), num_prompt_tokens=3, finished=finished)


def _done(j, text, finish="stop", tokens=(7,), logprobs=None):
    return Delta(j, text, list(tokens), logprobs, finish_reason=finish)


def test_attempt_seed_is_the_clients_then_derived_and_reproducible():
    assert attempt_seed(None, 0) is None and attempt_seed(None, 3) is None
    assert attempt_seed(7, 0) == 7
    derived = [attempt_seed(7, k) for k in (1, 2, 3)]
    assert derived == [attempt_seed(7, k) for k in (1, 2, 3)]  # a seeded request retries the same way
    assert len(set(derived)) == 3 and all(0 <= s < 2**63 for s in derived)
    assert not set(derived) & {8, 9, 10}  # never seed + j: the engine's seed of the request's choice j


def test_non_streaming_holds_each_choice_until_it_passes():
    g = GuardedRequest(_request(), GuardrailPolicy())
    attempt = g.next_attempt()
    assert attempt.request_id == "req" and attempt.sampling_params.n == 1 and attempt.batch_id == "b"
    assert g.feed(_item(Delta(0, '{"a":', [5]))) is None  # held back
    final = g.feed(_item(_done(0, "3}", tokens=[6]), finished=True))
    assert final.finished and final.error is None and g.done
    assert [(d.index, d.text, d.token_ids, d.finish_reason) for d in final.deltas] == [(0, '{"a":3}', [5, 6], "stop")]
    assert final.num_prompt_tokens == 3 and final.guardrail_outcomes == [("passed", "none")]
    assert g.next_attempt() is None


def test_only_the_failing_choice_is_retried_with_a_derived_seed():
    g = GuardedRequest(_request(n=3, seed=11), GuardrailPolicy(max_retries=2))
    g.next_attempt()
    out = g.feed(_item(_done(0, '{"a":1}'), _done(1, '{"a":9}'), _done(2, '{"a":', finish="length"), finished=True))
    assert [d.index for d in out.deltas] == [0] and not out.finished  # choice 0 passed: out now
    retry = g.next_attempt()
    assert retry.request_id == "req-retry1" and retry.sampling_params.n == 2
    assert retry.sampling_params.seed == attempt_seed(11, 1)
    final = g.feed(_item(_done(0, '{"a":2}'), _done(1, '{"a":4}'), finished=True))  # attempt's 0, 1 = choices 1, 2
    assert [(d.index, d.text) for d in final.deltas] == [(1, '{"a":2}'), (2, '{"a":4}')] and final.finished
    assert final.guardrail_outcomes == [("passed", "none"), ("retried", "schema"), ("retried", "invalid_json"),
                                        ("passed", "none"), ("passed", "none")]


def test_rejected_after_max_retries_with_the_422_body():
    g = GuardedRequest(_request(), GuardrailPolicy(max_retries=2))
    for attempt in range(3):
        assert g.next_attempt() is not None
        out = g.feed(_item(_done(0, '{"a":', finish="length"), finished=True))
    assert out.finished and g.done and g.next_attempt() is None
    err = out.error
    assert (err.kind, err.code, err.param) == ("guardrail_violation", "invalid_json", "response_format")
    assert err.message.startswith("The output violated the response_format after 3 attempt(s): the output is "
                                  "not valid JSON (max_tokens cut it off")
    assert out.guardrail_outcomes == [("retried", "invalid_json")] * 2 + [("rejected", "invalid_json")]


def test_greedy_is_not_retried():
    g = GuardedRequest(_request(temperature=0.0), GuardrailPolicy(max_retries=2))
    g.next_attempt()
    out = g.feed(_item(_done(0, '{"a":7}'), finished=True))
    assert out.error.code == "schema" and "after 1 attempt(s)" in out.error.message
    assert out.error.message.endswith("; not retried: greedy decoding (temperature 0) would write the same "
                                      "output again")
    assert out.guardrail_outcomes == [("rejected", "schema")]


def test_first_rejection_ends_the_request_at_once():
    g = GuardedRequest(_request(n=2), GuardrailPolicy(max_retries=0))
    g.next_attempt()
    out = g.feed(_item(_done(1, "[1]"), Delta(0, '{"a"', [1])))  # choice 0 still running
    assert out.finished and out.error.code == "schema" and g.done
    assert out.error.message.startswith("The output violated the response_format after 1 attempt(s): choice 1: ")


def test_streaming_passes_deltas_on_and_cannot_retry_what_was_sent():
    g = GuardedRequest(_request(n=2, stream=True), GuardrailPolicy(max_retries=2))
    g.next_attempt()
    out = g.feed(_item(Delta(0, '{"a":', [1]), Delta(1, '{"a":', [1])))
    assert [(d.index, d.text) for d in out.deltas] == [(0, '{"a":'), (1, '{"a":')]
    out = g.feed(_item(_done(0, "1}")))
    assert [(d.index, d.text, d.finish_reason) for d in out.deltas] == [(0, "1}", "stop")] and not out.finished
    out = g.feed(_item(_done(1, "12}"), finished=True))
    assert out.finished and out.error.code == "schema"
    assert out.error.message.endswith("; not retried: part of it had already been streamed to the client")
    assert out.guardrail_outcomes == [("passed", "none"), ("rejected", "schema")]


def test_streaming_retries_a_choice_none_of_which_was_sent():
    g = GuardedRequest(_request(stream=True), GuardrailPolicy(max_retries=1))
    g.next_attempt()
    assert g.feed(_item(_done(0, '{"a":9}'), finished=True)) is None  # whole in one item: nothing sent yet
    g.next_attempt()
    assert g.feed(_item(Delta(0, '{"a":', [1]))).deltas[0].text == '{"a":'
    final = g.feed(_item(_done(0, "2}"), finished=True))
    assert final.finished and final.error is None and final.deltas[0].text == "2}"
    assert final.guardrail_outcomes == [("retried", "schema"), ("passed", "none")]


def test_streaming_with_redaction_holds_back_and_withholds_logprobs():
    schema = {"type": "object", "properties": {"to": {"type": "string"}}}
    g = GuardedRequest(_request(stream=True, schema=schema, logprobs=0), GuardrailPolicy(redact_patterns=[EMAIL]))
    g.next_attempt()
    lp = [[(1, -0.1, 1, "x")]]
    assert g.feed(_item(Delta(0, '{"to":"ann@', [1], lp))) is None
    final = g.feed(_item(_done(0, 'example.com"}', tokens=[2], logprobs=lp), finished=True))
    (d,) = final.deltas
    assert d.text == '{"to":"[REDACTED]"}' and d.token_ids == [1, 2] and d.logprobs is None
    assert final.guardrail_outcomes == [("passed", "redacted")]


def test_logprobs_of_an_unredacted_choice_are_kept():
    g = GuardedRequest(_request(logprobs=0), GuardrailPolicy(redact_patterns=[EMAIL]))
    g.next_attempt()
    lp = [[(7, -0.5, 1, '{"a":1}')]]
    final = g.feed(_item(_done(0, '{"a":1}', logprobs=lp), finished=True))
    assert final.deltas[0].logprobs == lp


def test_engine_errors_pass_through_and_schema_refusals_name_response_format():
    g = GuardedRequest(_request(), GuardrailPolicy())
    g.next_attempt()
    # As the engine replica reports engine/core/structured_output.py's refusal (serve_app.http.errors.stream_error).
    refusal = stream_error(InvalidRequestError("'contains' (at #) is not supported by grammar-constrained decoding: x",
                                               param="structured_outputs"))
    out = g.feed(StreamItem(finished=True, error=refusal))
    assert out.finished and out.error.param == "response_format" and out.error.message == refusal.message
    g = GuardedRequest(_request(), GuardrailPolicy())
    g.next_attempt()
    out = g.feed(StreamItem(finished=True, error=StreamError("unavailable", "shutting down")))
    assert out.error == StreamError("unavailable", "shutting down") and g.next_attempt() is None


def test_a_schema_the_validator_cannot_evaluate_is_a_400():
    g = GuardedRequest(_request(schema={"$ref": "#/$defs/missing"}), GuardrailPolicy())
    g.next_attempt()
    out = g.feed(_item(_done(0, "{}"), finished=True))
    assert out.error.kind == "invalid_request" and out.error.param == "response_format"
    assert "cannot be evaluated" in out.error.message


def test_json_object_and_policy_limits():
    g = GuardedRequest(_request(schema=None), GuardrailPolicy(max_depth=2, max_retries=0))
    g.next_attempt()
    out = g.feed(_item(_done(0, '{"a":{"b":[1]}}'), finished=True))
    assert out.error.code == "max_depth"
    g = GuardedRequest(_request(schema=None), GuardrailPolicy(max_output_bytes=8, max_retries=0))
    g.next_attempt()
    assert g.feed(_item(_done(0, '{"a":"long"}'), finished=True)).error.code == "max_output_bytes"


def test_needs_a_json_request():
    params = SamplingParams()
    with pytest.raises(ValueError, match="needs a request with a contract"):
        GuardedRequest(EngineRequest("r", [1], params), GuardrailPolicy())


def test_finishes_large_flags_the_items_whose_check_may_take_a_while():
    g = GuardedRequest(_request(n=2), GuardrailPolicy())
    g.next_attempt()
    assert g.feed(_item(Delta(1, '{"a":' + " " * 50, [1]))) is None
    assert not g.finishes_large(_item(Delta(0, "x" * 100, [1])), 64)  # not finishing
    assert not g.finishes_large(_item(_done(0, "x" * 10)), 64)
    assert g.finishes_large(_item(_done(1, "x" * 10)), 64)  # 56 held + 10


# -- tool calls and reasoning: the answer is checked, calls are held until they pass -------------------
WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8}}, "required": ["city"],
           "additionalProperties": False}
SCHEMAS = {"get_weather": WEATHER, "get_time": {"type": "object", "properties": {}}}
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


def _tools_request(choice, n=1, stream=False, parallel=True, reasoning=None, structured=None, seed=None):
    tools = ToolsSpec(choice, SCHEMAS, "get_weather" if choice == "named" else None,
                      "hermes" if choice == "auto" else None, parallel)
    if choice == "named":
        structured = StructuredOutputsParams(json=WEATHER)
    elif choice == "required":
        structured = StructuredOutputsParams(json={"type": "array"})  # the grammar's; the guard checks each call
    params = SamplingParams(n=n, seed=seed, structured_outputs=structured)
    return EngineRequest("req", [1], params, json_mode=True, stream=stream,
                         output=OutputSpec(reasoning, tools, "response_format"))


def _calls(delta):
    return [(c.name, json.loads(c.arguments)) for c in delta.tool_calls or ()]


@pytest.mark.parametrize("stream", [False, True])
def test_a_named_call_is_held_checked_and_passed_on_as_the_call(stream):
    g = GuardedRequest(_tools_request("named", stream=stream), GuardrailPolicy())
    g.next_attempt()
    assert g.feed(_item(Delta(0, '{"city": ', [1]))) is None  # a forced call is held, streaming or not
    (d,) = g.feed(_item(_done(0, '"Paris"}', tokens=[2]), finished=True)).deltas
    assert d.parsed and d.text == "" and d.token_ids == [1, 2] and d.finish_reason == "stop"
    assert _calls(d) == [("get_weather", {"city": "Paris"})] and d.tool_calls[0].id.startswith("call_")


def test_a_call_whose_arguments_fail_the_whole_schema_is_regenerated_then_a_422_naming_tools():
    g = GuardedRequest(_tools_request("named", seed=3), GuardrailPolicy(max_retries=1))
    g.next_attempt()
    assert g.feed(_item(_done(0, '{"city": "Llanfairpwllgwyngyll"}'), finished=True)) is None  # maxLength: 8
    g.next_attempt()
    out = g.feed(_item(_done(0, '{"town": "Rome"}'), finished=True))
    assert (out.error.kind, out.error.code, out.error.param) == ("guardrail_violation", "schema", "tools")
    assert out.error.message.startswith("The output violated the tools after 2 attempt(s): tool call 0 "
                                        "(get_weather): the arguments do not match the schema")
    assert out.guardrail_outcomes == [("retried", "schema"), ("rejected", "schema")]


@pytest.mark.parametrize("text,code", [
    ('[{"name": "get_weather", "parameters": {"city": "Paris"}}, {"name": "get_time", "parameters": {}}]', None),
    ('[{"name": "get_date", "parameters": {}}]', "unknown_tool"),
    ('[{"name": "get_weather", "parameters": {"city": 5}}]', "schema"),
    ('[{"name": "get_weather", "parameters": {"city": "Paris"}', "invalid_json"),  # cut off
])
def test_required_calls_each_checked_against_its_tools_schema(text, code):
    g = GuardedRequest(_tools_request("required"), GuardrailPolicy(max_retries=0))
    g.next_attempt()
    out = g.feed(_item(_done(0, text), finished=True))
    if code is None:
        assert out.error is None and _calls(out.deltas[0]) == [("get_weather", {"city": "Paris"}), ("get_time", {})]
        assert len({c.id for c in out.deltas[0].tool_calls}) == 2
    else:
        assert (out.error.code, out.error.param) == (code, "tools")


def test_parallel_tool_calls_false_allows_one_call():
    g = GuardedRequest(_tools_request("auto", parallel=False), GuardrailPolicy(max_retries=0))
    g.next_attempt()
    assert g.feed(_item(_done(0, CALL + CALL), finished=True)).error.code == "parallel_tool_calls"


def test_auto_streams_the_content_and_holds_a_call_until_it_passes():
    g = GuardedRequest(_tools_request("auto", stream=True), GuardrailPolicy())
    g.next_attempt()
    (d,) = g.feed(_item(Delta(0, "Let me check. <tool", [1]))).deltas
    assert (d.text, d.tool_calls) == ("Let me check. ", None)  # "<tool" may open a call: held by the parser
    (d,) = g.feed(_item(Delta(0, CALL[5:], [2]))).deltas
    assert (d.text, d.tool_calls) == ("", None)  # the call is complete, not yet checked
    (d,) = g.feed(_item(_done(0, "", tokens=[3]), finished=True)).deltas
    assert d.finish_reason == "stop" and _calls(d) == [("get_weather", {"city": "Paris"})]


def test_auto_a_bad_call_after_streamed_content_cannot_be_retried():
    g = GuardedRequest(_tools_request("auto", stream=True), GuardrailPolicy(max_retries=2))
    g.next_attempt()
    g.feed(_item(Delta(0, "Sure. ", [1])))
    out = g.feed(_item(_done(0, CALL.replace("get_weather", "get_news")), finished=True))
    assert (out.error.code, out.error.param) == ("unknown_tool", "tools")
    assert out.error.message.endswith("not retried: part of it had already been streamed to the client")


def test_auto_without_calls_is_content_and_a_malformed_call_stays_content():
    g = GuardedRequest(_tools_request("auto"), GuardrailPolicy())
    g.next_attempt()
    (d,) = g.feed(_item(_done(0, "<tool_call>not json</tool_call>"), finished=True)).deltas
    assert (d.text, d.tool_calls, d.finish_reason) == ("<tool_call>not json</tool_call>", None, "stop")


def test_the_answer_after_the_reasoning_is_checked_never_the_reasoning():
    request = _request(stream=True)
    request.output = OutputSpec("qwen3", None, "guided_json")
    g = GuardedRequest(request, GuardrailPolicy())
    g.next_attempt()
    (d,) = g.feed(_item(Delta(0, "<think>{not json at all", [1]))).deltas
    assert (d.reasoning, d.text, d.parsed) == ("{not json at all", "", True)  # reasoning streams at once
    (d,) = g.feed(_item(_done(0, '</think>{"a": 2}'), finished=True)).deltas
    assert (d.reasoning, d.text, d.finish_reason) == ("", '{"a": 2}', "stop")
    g = GuardedRequest(request, GuardrailPolicy(max_retries=0))
    g.next_attempt()
    out = g.feed(_item(_done(0, '<think>ok</think>{"a": 9}'), finished=True))
    assert (out.error.code, out.error.param) == ("schema", "guided_json")  # the field the contract came in
