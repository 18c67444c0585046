"""The Guardrails deployment: JSON requests end as valid documents or as clear errors, never a 200 with bad JSON.

First the guard's engine loop against a scripted fake engine (no Ray); then the whole application on
a real local Ray Serve with the tiny random-weight model (one app for the module, on the suite's
shared cluster; only the grammar makes such a model write JSON), driven through the official
`openai` client and raw httpx.
Policy tests change the Guardrails policy live (its `reconfigure`) and put it back.
"""
import asyncio
import contextlib
import json
import time

import httpx
import jsonschema
import openai
import pytest

from engine import LLM, SamplingParams
from engine.sampling_params import StructuredOutputsParams
from serve_app.replica.client import RemoteEngine
from serve_app.guard.policy import GuardrailPolicy
from serve_app.guard.session import attempt_seed
from serve_app.guard.guardrails import JsonGuard
from serve_app.local import METRICS_REPORT_INTERVAL_MS, call_deployment, deployed_app
from serve_app.http.messages import Delta, EngineRequest, StreamItem

pytestmark = pytest.mark.timeout(900)

APP = "test_serve_guardrails"  # the module's app on the suite's shared Ray cluster, and its route prefix
MODEL = "tiny-llama"
ENGINE = dict(device="cpu", dtype="float32", max_model_len=2048, num_kv_blocks=512, max_num_seqs=64, seed=0)
POLICY = {"max_output_bytes": 4096, "max_depth": 8, "max_retries": 2, "redact_patterns": []}
EMAIL = r"[\w.+-]+@[\w-]+\.[\w.]+"  # deploy/config.yaml's example
MESSAGES = [{"role": "user", "content": "Give me JSON"}]
PROMPTS = ["Hello there", "The quick brown fox", "Once upon a time, in a land"]
SEEDS = [0, 1, 2, 3]

NESTED = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 8},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "score": {"type": ["number", "null"], "minimum": -1, "maximum": 1},
        "color": {"enum": ["red", "green", "blue"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 5}, "maxItems": 3},
        "address": {"type": "object", "properties": {
            "zip": {"type": "integer", "minimum": 10000, "maximum": 99999},
            "city": {"type": ["string", "null"], "maxLength": 6}},
            "required": ["zip", "city"], "additionalProperties": False},
        "items": {"type": "array", "maxItems": 2, "items": {"type": "object", "properties": {
            "qty": {"type": "integer", "minimum": 1, "maximum": 9},
            "price": {"type": "number", "minimum": 0, "exclusiveMaximum": 100}},
            "required": ["qty", "price"], "additionalProperties": False}},
    },
    "required": ["name", "age", "score", "color", "tags", "address", "items"],
    "additionalProperties": False,
}
# The grammar drops uniqueItems (engine/core/structured_output.py): [false,false] comes out, the guardrail retries it.
UNIQUE = {"type": "array", "items": {"type": "boolean"}, "minItems": 2, "maxItems": 2, "uniqueItems": True}
LONG_TEXT = {"type": "object", "properties": {"text": {"type": "string", "minLength": 60}}, "required": ["text"],
             "additionalProperties": False}
DEEP = {"type": "object", "properties": {"a": {"type": "object", "properties": {"b": {"type": "array", "minItems": 1,
        "maxItems": 1, "items": {"type": "array", "minItems": 1, "maxItems": 1, "items": {"type": "integer"}}}},
        "required": ["b"], "additionalProperties": False}}, "required": ["a"], "additionalProperties": False}  # depth 4
# The grammar writes a short address; only once redacted does the value take the second branch.
CONTACT = {"type": "object", "properties": {"contact": {"type": "string",
           "pattern": r"^([A-Za-z]{1,8}@example\.com|\[REDACTED\])$"}}, "required": ["contact"],
           "additionalProperties": False}


def _schema_format(schema: dict) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "t", "schema": schema}}


# -- the guard's engine loop, on a scripted engine (no Ray) -----------------------------------------
class _FakeStream:
    def __init__(self, items):
        self.items, self.cancelled = items, False

    def __aiter__(self):
        return self._iterate()

    async def _iterate(self):
        for item in self.items:
            await asyncio.sleep(0)
            yield item

    def cancel(self):
        self.cancelled = True


class _FakeEngine:
    """Stands in for the EngineDeployment handle: one scripted list of items per engine call."""

    def __init__(self, *attempts):
        self.attempts, self.requests, self.streams = list(attempts), [], []

    def options(self, **_):
        return self

    @property
    def generate(self):
        return self

    def remote(self, request):
        self.requests.append(request)
        self.streams.append(_FakeStream(self.attempts.pop(0)))
        return self.streams[-1]


def _run_guard(policy: GuardrailPolicy, engine: _FakeEngine, request: EngineRequest) -> list[StreamItem]:
    async def run():
        return [item async for item in JsonGuard(policy).run(request, RemoteEngine(engine))]
    return asyncio.run(run())


def _engine_request(n=1, seed=5, schema=UNIQUE):
    params = SamplingParams(n=n, seed=seed, structured_outputs=StructuredOutputsParams(json=schema))
    return EngineRequest("r", [1, 2], params, json_mode=True, batch_id="b")


def _finished(*deltas):
    return StreamItem(deltas=list(deltas), num_prompt_tokens=2, finished=True)


def test_guard_retries_the_failing_choice_on_the_engine():
    engine = _FakeEngine([_finished(Delta(0, "[true,false]", [1], finish_reason="stop"),
                                    Delta(1, "[true,true]", [1], finish_reason="stop"))],
                         [_finished(Delta(0, "[false,true]", [2], finish_reason="stop"))])
    items = _run_guard(GuardrailPolicy(max_retries=1), engine, _engine_request(n=2))
    assert [(r.request_id, r.sampling_params.n, r.sampling_params.seed) for r in engine.requests] == [
        ("r", 2, 5), ("r-retry1", 1, attempt_seed(5, 1))]
    assert all(r.batch_id == "b" for r in engine.requests)  # the same engine replica: a prefix-cache hit
    assert [[(d.index, d.text) for d in i.deltas] for i in items] == [[(0, "[true,false]")], [(1, "[false,true]")]]
    assert items[-1].finished
    assert items[-1].guardrail_outcomes == [("passed", "none"), ("retried", "schema"), ("passed", "none")]


def test_guard_rejection_cancels_the_engine_request():
    running = [StreamItem(deltas=[Delta(0, "[true,true]", [1], finish_reason="stop"), Delta(1, "[", [1])]),
               StreamItem(deltas=[Delta(1, "true", [1])]), _finished(Delta(1, "]", [1], finish_reason="stop"))]
    engine = _FakeEngine(running)
    (item,) = _run_guard(GuardrailPolicy(max_retries=0), engine, _engine_request(n=2))
    assert item.finished and item.error.code == "schema" and engine.streams[0].cancelled


def test_guard_checks_a_large_document_off_the_event_loop():
    big = '{"text":"' + "x" * 100_000 + '"}'
    engine = _FakeEngine([_finished(Delta(0, big, [1], finish_reason="stop"))])
    schema = {"type": "object", "properties": {"text": {"type": "string", "maxLength": 10}}}
    (item,) = _run_guard(GuardrailPolicy(max_retries=0), engine, _engine_request(schema=schema))
    assert item.error.code == "schema" and "is too long ('maxLength')" in item.error.message


def test_guard_passes_non_json_requests_through():
    plain = EngineRequest("r", [1], SamplingParams())
    engine = _FakeEngine([_finished(Delta(0, "not json", [1], finish_reason="length"))])
    (item,) = _run_guard(GuardrailPolicy(), engine, plain)
    assert item.deltas[0].text == "not json" and item.guardrail_outcomes is None


# -- the application on Ray Serve -----------------------------------------------------------------
@pytest.fixture(scope="module")
def reference(tiny_llama):
    """Greedy plain completions of the offline engine: what the server must answer next to JSON traffic."""
    llm = LLM(model=tiny_llama, **ENGINE)
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=12), use_tqdm=False)
    llm.llm_engine.shutdown()
    return [o.outputs[0].text for o in outs]


@pytest.fixture(scope="module")
def base_url(ray_cluster, tiny_llama, reference):
    # The step loop in the engine replica's thread (engine_process=False): what is tested here is the
    # Guardrails deployment, and the replica starts without a second process importing torch.
    args = dict(model=tiny_llama, served_model_name=MODEL, guardrails=POLICY, engine_process=False, **ENGINE)
    with deployed_app(ray_cluster, args, APP) as url:
        yield url


@pytest.fixture(scope="module")
def client(base_url):
    return openai.OpenAI(base_url=base_url + "/v1", api_key="none", max_retries=0, timeout=300)


@pytest.fixture(scope="module")
def http(base_url):
    with httpx.Client(base_url=base_url, timeout=300) as c:
        yield c


@contextlib.contextmanager
def policy(**changes):
    """Run with these policy changes on the live Guardrails replica, then the module's policy again."""
    call_deployment(APP, "Guardrails", "reconfigure", {**POLICY, **changes})
    try:
        yield
    finally:
        call_deployment(APP, "Guardrails", "reconfigure", POLICY)


def _outcomes(http, after: dict | None = None, num_requests: int = 0) -> dict[tuple[str, str], float]:
    """Guardrail outcome counts (and, under "requests", HTTP requests) once /metrics has caught up.
    It is Ray's metrics export: a count shows up to about two METRICS_REPORT_INTERVAL_MS late (the
    replica's report, then the agent's). With `after` (an earlier result) and `num_requests` (the
    HTTP requests sent since), first until those requests are counted: the Ingress counts a request
    after Guardrails counted its outcome. Then until two reads further apart than that lag agree."""
    wanted = (after or {}).get(("requests", ""), 0.0) + num_requests
    deadline = time.monotonic() + 30
    counts = _read_outcomes(http)
    while counts.get(("requests", ""), 0.0) < wanted:
        assert time.monotonic() < deadline, f"{num_requests} request(s) not in /metrics after 30 s: {counts}"
        time.sleep(0.25)
        counts = _read_outcomes(http)
    while True:
        time.sleep(2 * METRICS_REPORT_INTERVAL_MS / 1000 + 0.1)
        counts, previous = _read_outcomes(http), counts
        if counts == previous:
            return counts


def _read_outcomes(http) -> dict[tuple[str, str], float]:
    counts = {}
    for line in http.get("/metrics").text.splitlines():  # this app's series: the shared cluster ran others
        if line.startswith(("ray_rayllm_guardrail_outcomes_total{", "ray_rayllm_requests_total{")) and \
                f'application="{APP}"' in line:
            series, _, value = line.rpartition(" ")
            labels = dict(part.split("=", 1) for part in series[series.index("{") + 1:-1].split(","))
            key = ("requests", "") if "outcome" not in labels else \
                (labels["outcome"].strip('"'), labels["reason"].strip('"'))
            counts[key] = counts.get(key, 0.0) + float(value)
    return counts


def _delta(before: dict, after: dict) -> dict:
    return {k: after[k] - before.get(k, 0.0) for k in after if after[k] != before.get(k, 0.0) and k[0] != "requests"}


async def _chat(base_url: str, bodies: list[dict]) -> list:
    """Each body through the async openai client, concurrently: a ChatCompletion, the streamed
    text with its finish reasons, or the APIError it raised."""
    async with openai.AsyncOpenAI(base_url=base_url + "/v1", api_key="none", max_retries=0, timeout=300) as c:
        async def one(body):
            try:
                if not body.get("stream"):
                    return await c.chat.completions.create(model=MODEL, messages=MESSAGES, **body)
                chunks = [chunk async for chunk in await c.chat.completions.create(model=MODEL, messages=MESSAGES,
                                                                                   **body)]
                return ("".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices),
                        [ch.choices[0].finish_reason for ch in chunks if ch.choices and ch.choices[0].finish_reason])
            except openai.APIError as e:
                return e
        return await asyncio.gather(*(one(b) for b in bodies))


def _valid_or_422(result, schema, code=None) -> object | None:
    """The contract: a 200 whose content validates, or a 422 guardrail_violation. The document, or None."""
    if isinstance(result, openai.APIError):
        body = result.body if isinstance(result.body, dict) else {}
        assert body.get("type") == "guardrail_violation", result
        assert code is None or body.get("code") == code, body
        return None
    text = result[0] if isinstance(result, tuple) else result.choices[0].message.content
    document = json.loads(text)
    jsonschema.Draft202012Validator(schema).validate(document)
    return document


@pytest.mark.parametrize("stream", [False, True])
def test_nested_schema_at_temperature_one_validates(base_url, stream):
    bodies = [dict(response_format=_schema_format(NESTED), temperature=1.0, seed=s, max_tokens=400, stream=stream)
              for s in SEEDS]
    for result in asyncio.run(_chat(base_url, bodies)):
        assert not isinstance(result, Exception), result
        document = _valid_or_422(result, NESTED)
        assert set(document) == set(NESTED["required"])
        finish = result[1] if stream else [result.choices[0].finish_reason]
        assert finish == ["stop"]


def test_n_choices_each_pass_retrying_only_the_failing_ones(base_url, http):
    before = _outcomes(http)
    (result,) = asyncio.run(_chat(base_url, [dict(response_format=_schema_format(UNIQUE), temperature=1.0, seed=3,
                                                  n=4, max_tokens=20)]))
    counted = _delta(before, _outcomes(http, before, 1))
    if isinstance(result, openai.UnprocessableEntityError):  # a choice failed 3 times: the contract still holds
        assert counted[("rejected", "schema")] == 1 and result.body["message"].startswith(
            "The output violated the response_format after 3 attempt(s): choice ")
        return
    assert sorted(c.index for c in result.choices) == [0, 1, 2, 3]
    for choice in result.choices:
        jsonschema.validate(json.loads(choice.message.content), UNIQUE)
    assert counted.pop(("passed", "none")) == 4 and set(counted) <= {("retried", "schema")}  # one pass each


def test_keyword_the_grammar_ignores_is_retried(base_url, http):
    before = _outcomes(http)
    bodies = [dict(response_format=_schema_format(UNIQUE), temperature=1.0, seed=s, max_tokens=20,
                   stream=s % 2 == 1) for s in range(8)]
    documents = [_valid_or_422(r, UNIQUE, code="schema") for r in asyncio.run(_chat(base_url, bodies))]
    counted = _delta(before, _outcomes(http, before, len(bodies)))
    assert counted[("retried", "schema")] >= 1  # [false,false]: valid JSON, but not unique
    assert sum(d is not None for d in documents) == counted.get(("passed", "none"), 0) >= 1


def test_greedy_violation_is_not_retried(client, http):
    before = _outcomes(http)
    with pytest.raises(openai.UnprocessableEntityError) as info:
        client.chat.completions.create(model=MODEL, messages=MESSAGES, response_format=_schema_format(UNIQUE),
                                       temperature=0, max_tokens=20)
    err = info.value.body
    assert err["code"] == "schema" and "after 1 attempt(s)" in err["message"] and "greedy" in err["message"]
    assert _delta(before, _outcomes(http, before, 1)) == {("rejected", "schema"): 1}


def test_json_object_is_an_object_or_a_422(base_url):
    bodies = [dict(response_format={"type": "json_object"}, temperature=1.0, seed=1, max_tokens=128),  # finishes
              dict(response_format={"type": "json_object"}, temperature=0, max_tokens=16),  # cut off: it closes at 33
              dict(response_format={"type": "json_object"}, temperature=1.0, seed=1, max_tokens=128, stream=True)]
    finished, greedy, streamed = asyncio.run(_chat(base_url, bodies))
    assert isinstance(json.loads(finished.choices[0].message.content), dict)
    assert isinstance(json.loads(streamed[0]), dict) and streamed[0] == finished.choices[0].message.content
    assert isinstance(greedy, openai.UnprocessableEntityError) and greedy.body["code"] == "invalid_json"


def test_completions_endpoint_takes_response_format_too(client):
    r = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=400, temperature=1.0, seed=1,
                                  extra_body={"response_format": _schema_format(NESTED)})
    jsonschema.validate(json.loads(r.choices[0].text), NESTED)


BAD_SCHEMAS = [
    ({"type": "foo"}, "invalid JSON Schema"),
    ({"type": "object", "properties": {"a": {"type": "integer", "minimum": "x"}}}, "invalid JSON Schema"),
    ({"type": "array", "contains": {"type": "integer"}}, "'contains'"),
    ({"allOf": [{"type": "integer"}, {"minimum": 3}]}, "'allOf'"),
    ({"type": "integer", "minimum": 5, "maximum": 1}, "not supported by grammar-constrained decoding"),
]


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("schema, named", BAD_SCHEMAS, ids=[n for _, n in BAD_SCHEMAS])
def test_invalid_and_unsupported_schemas_are_400(http, schema, named, stream):
    r = http.post("/v1/chat/completions", json={"model": MODEL, "messages": MESSAGES, "stream": stream,
                                                "response_format": _schema_format(schema)})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and err["param"] == "response_format" and named in err["message"]


def test_max_tokens_too_small_is_a_422_after_the_retries(client, http):
    before = _outcomes(http)
    with pytest.raises(openai.UnprocessableEntityError) as info:
        client.chat.completions.create(model=MODEL, messages=MESSAGES, response_format=_schema_format(NESTED),
                                       temperature=1.0, seed=4, max_tokens=6)
    err = info.value.body
    assert (err["type"], err["code"], err["param"]) == ("guardrail_violation", "invalid_json", "response_format")
    assert err["message"].startswith("The output violated the response_format after 3 attempt(s): the output is "
                                     "not valid JSON (max_tokens cut it off")
    assert _delta(before, _outcomes(http, before, 1)) == {("retried", "invalid_json"): 2,
                                                           ("rejected", "invalid_json"): 1}


def test_the_422_body_is_openai_shaped(http):
    r = http.post("/v1/chat/completions", json={"model": MODEL, "messages": MESSAGES, "max_tokens": 3,
                                                "response_format": {"type": "json_object"}})
    assert r.status_code == 422 and r.headers["content-type"] == "application/json"
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert (err["type"], err["param"], err["code"]) == ("guardrail_violation", "response_format", "invalid_json")


def _sse_events(http, body: dict) -> tuple[int, list]:
    with http.stream("POST", "/v1/chat/completions", json={"model": MODEL, "messages": MESSAGES, **body}) as r:
        if r.status_code != 200:
            r.read()
            return r.status_code, [r.json()]
        return 200, [line[6:] if line == "data: [DONE]" else json.loads(line[6:]) for line in r.iter_lines() if line]


def test_stream_violation_after_bytes_were_sent_is_an_error_event_then_done(http):
    longer = {**LONG_TEXT, "properties": {"text": {"type": "string", "minLength": 1000}}}  # never in 64 tokens
    status, events = _sse_events(http, {"stream": True, "response_format": _schema_format(longer),
                                        "temperature": 1.0, "seed": 0, "max_tokens": 64})
    assert status == 200, events
    assert events[-1] == "[DONE]"
    content = "".join(e["choices"][0]["delta"].get("content") or "" for e in events[:-2])
    assert content.startswith('{"text": "') and len(content) > 10  # streamed as it came
    err = events[-2]["error"]
    assert (err["type"], err["code"]) == ("guardrail_violation", "invalid_json")
    assert "after 1 attempt(s)" in err["message"] and "already been streamed" in err["message"]


def test_stream_ends_with_a_valid_document_or_an_error_event(base_url):
    bodies = [dict(response_format=_schema_format(NESTED), temperature=1.0, seed=s, max_tokens=m, stream=True)
              for s in SEEDS[:2] for m in (6, 400)]
    for result in asyncio.run(_chat(base_url, bodies)):
        _valid_or_422(result, NESTED)  # APIError from the error event, or a plain 422 if nothing was sent yet


def test_output_size_limit(client, http):
    with policy(max_output_bytes=64):
        with pytest.raises(openai.UnprocessableEntityError) as info:
            client.chat.completions.create(model=MODEL, messages=MESSAGES, response_format=_schema_format(LONG_TEXT),
                                           temperature=1.0, seed=0, max_tokens=300)
    err = info.value.body
    assert err["code"] == "max_output_bytes" and "more than max_output_bytes=64" in err["message"]
    assert "after 3 attempt(s)" in err["message"]


def test_depth_limit(client):
    with policy(max_depth=3, max_retries=0):
        with pytest.raises(openai.UnprocessableEntityError) as info:
            client.chat.completions.create(model=MODEL, messages=MESSAGES, response_format=_schema_format(DEEP),
                                           temperature=1.0, seed=0, max_tokens=100)
        ok = client.chat.completions.create(model=MODEL, messages=MESSAGES, temperature=1.0, seed=0, max_tokens=100,
                                            response_format=_schema_format(DEEP["properties"]["a"]))
    err = info.value.body
    assert err["code"] == "max_depth" and "4 levels deep, more than max_depth=3" in err["message"]
    assert "after 1 attempt(s)" in err["message"]
    jsonschema.validate(json.loads(ok.choices[0].message.content), DEEP["properties"]["a"])  # depth 3 passes


@pytest.mark.parametrize("stream", [False, True])
def test_redaction_pattern(base_url, http, stream):
    before = _outcomes(http)
    with policy(redact_patterns=[EMAIL]):
        bodies = [dict(response_format=_schema_format(CONTACT), temperature=1.0, seed=s, max_tokens=60, stream=stream)
                  for s in SEEDS]
        results = asyncio.run(_chat(base_url, bodies))
    for result in results:
        assert _valid_or_422(result, CONTACT) == {"contact": "[REDACTED]"}
    assert _delta(before, _outcomes(http, before, len(bodies))).get(("passed", "redacted"), 0) >= 1


def test_redaction_holds_a_stream_back_until_validated(http):
    with policy(redact_patterns=[EMAIL]):
        status, events = _sse_events(http, {"stream": True, "response_format": _schema_format(CONTACT),
                                            "temperature": 1.0, "seed": 0, "max_tokens": 60})
    assert status == 200 and events[-1] == "[DONE]"
    contents = [e["choices"][0]["delta"]["content"] for e in events[:-1] if e["choices"][0]["delta"].get("content")]
    assert contents == ['{"contact":"[REDACTED]"}']  # one piece, once validated: no unredacted byte went out


def test_plain_requests_next_to_json_ones_are_unchanged(base_url, reference):
    async def run():
        async with openai.AsyncOpenAI(base_url=base_url + "/v1", api_key="none", max_retries=0, timeout=300) as c:
            plain = [c.completions.create(model=MODEL, prompt=p, max_tokens=12, temperature=0) for p in PROMPTS]
            json_ones = [c.chat.completions.create(model=MODEL, messages=MESSAGES, temperature=1.0, seed=s,
                                                   max_tokens=400, response_format=_schema_format(NESTED))
                         for s in SEEDS]
            return await asyncio.gather(*plain, *json_ones)
    results = asyncio.run(run())
    assert [r.choices[0].text for r in results[:len(PROMPTS)]] == reference
    for r in results[len(PROMPTS):]:
        jsonschema.validate(json.loads(r.choices[0].message.content), NESTED)


def test_outcomes_are_in_the_metrics(client, http):
    before = _outcomes(http)
    client.chat.completions.create(model=MODEL, messages=MESSAGES, response_format=_schema_format(DEEP), seed=0,
                                   temperature=1.0, max_tokens=100)
    with pytest.raises(openai.UnprocessableEntityError):
        client.chat.completions.create(model=MODEL, messages=MESSAGES, response_format=_schema_format(UNIQUE),
                                       temperature=0, max_tokens=20)
    counts = _outcomes(http, before, 2)
    assert counts[("passed", "none")] >= 1 and counts[("rejected", "schema")] >= 1
    text = "\n".join(line for line in http.get("/metrics").text.splitlines() if f'application="{APP}"' in line)
    assert 'model_name="tiny-llama"' in text and 'outcome="passed"' in text
    assert 'status="422"' in text
