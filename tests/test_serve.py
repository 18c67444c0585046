"""The whole application on a real local Ray Serve, driven over loopback HTTP like a user would.

One app for the module, on the suite's shared Ray cluster (tests/conftest.py): the official
`openai` client and raw httpx against it; greedy outputs compared with the offline `engine.LLM`.
"""
import asyncio
import json
import math
import os
import time

import httpx
import openai
import pytest

from engine import LLM, SamplingParams
from serve_app.local import (METRICS_REPORT_INTERVAL_MS, call_deployment, deployed_app, engine_deployment,
                             reconfigure_ingress)

pytestmark = pytest.mark.timeout(900)

MODEL = "tiny-llama"
API_KEY = "sk-test"
MAX_BODY = 64 * 1024
ENGINE = dict(device="cpu", dtype="float32", max_model_len=2048, num_kv_blocks=512, max_num_seqs=64, seed=0)
PROMPTS = ["Hello there", "The quick brown fox", "Once upon a time, in a land", "1 2 3 4 5"]
MAX_TOKENS = 12
CHAT = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Say hi"}]
DEFAULT_BATCHING = {"max_batch_size": 8, "batch_wait_timeout_s": 0.0, "max_pending_requests": None}
AUTH = {"Authorization": f"Bearer {API_KEY}"}


@pytest.fixture(scope="module")
def reference(tiny_llama):
    """Greedy outputs of the offline engine: the oracle for every greedy request below."""
    llm = LLM(model=tiny_llama, **ENGINE)
    greedy = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
    outs = llm.generate(PROMPTS, greedy)
    chat_ids = llm.get_tokenizer().apply_chat_template(CHAT, tokenize=False, add_generation_prompt=True)
    chat_ids = llm.get_tokenizer()(chat_ids, add_special_tokens=False)["input_ids"]
    (chat,) = llm.generate([{"prompt_token_ids": chat_ids}], greedy)
    (scored,) = llm.generate(PROMPTS[:1], SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=2))
    ref = {"text": [o.outputs[0].text for o in outs], "ids": [o.prompt_token_ids for o in outs],
           "num_tokens": [len(o.outputs[0].token_ids) for o in outs], "chat": chat.outputs[0].text,
           "prompt_logprobs": scored.prompt_logprobs}
    llm.llm_engine.shutdown()
    return ref


@pytest.fixture(scope="module")
def app_name():
    """The module's app on the shared cluster (its route prefix too); tests that reconfigure it take it."""
    return "test_serve"


@pytest.fixture(scope="module")
def base_url(ray_cluster, app_name, tiny_llama, reference):
    args = dict(model=tiny_llama, served_model_name=MODEL, api_key=API_KEY, max_request_body_bytes=MAX_BODY,
                **ENGINE, **{k: v for k, v in DEFAULT_BATCHING.items() if v is not None})
    with deployed_app(ray_cluster, args, app_name) as url:
        yield url


@pytest.fixture(scope="module")
def client(base_url):
    return openai.OpenAI(base_url=base_url + "/v1", api_key=API_KEY, max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def http(base_url):
    with httpx.Client(base_url=base_url, headers={"Authorization": f"Bearer {API_KEY}"}, timeout=120) as c:
        yield c


def _metric(http, name: str, default: float | None = None, **labels: str) -> float:
    """/metrics: the sum of the series of `name` carrying all `labels`, over every replica of the
    app at `http`'s route prefix (the shared cluster's export holds other apps' series too).

    /metrics is Ray's export, published every METRICS_REPORT_INTERVAL_MS here: a value shows up to about twice that late."""
    return _value(_app_metrics(http), name, default, **labels)


def _value(lines: list[str], name: str, default: float | None = None, **labels: str) -> float:
    """`_metric` on lines read once (a scrape parses the cluster's whole export: polls read once a round)."""
    values = []
    for line in lines:
        series, _, value = line.rpartition(" ")
        if (series == name or series.startswith(name + "{")) and all(f'{k}="{v}"' in series
                                                                     for k, v in labels.items()):
            values.append(float(value))
    assert values or default is not None, f"{name} {labels} not in /metrics"
    return sum(values) if values else default


def _app_metrics(http) -> list[str]:
    """The lines of GET /metrics of the app at `http`'s route prefix (the shared cluster's export
    holds the series of every app it ran)."""
    label = f'application="{http.base_url.path.strip("/")}"'
    return [line for line in http.get("/metrics").text.splitlines() if label in line]


def _wait_metric(http, name: str, done, within_s: float = 15.0, **labels: str) -> float:
    """Poll `name` until `done(value)`; fails after `within_s`."""
    start = time.monotonic()
    while not done(value := _metric(http, name, default=0.0, **labels)):
        assert time.monotonic() - start < within_s, f"{name} {labels} = {value} after {within_s}s"
        time.sleep(0.25)  # a scrape costs the Ingress CPU; values change every 0.5 s
    return value


def _num_cancelled(http) -> float:
    return _metric(http, "ray_rayllm_requests_total", default=0.0, status="499")


def _num_finished(http, reason: str) -> float:
    """Engine requests finished so far with this finished_reason (stop|length|abort)."""
    return _metric(http, "ray_rayllm_request_success_total", default=0.0, finished_reason=reason)


def _wait_engine_idle(http, within_s: float) -> float:
    """Seconds until no request runs or waits and the KV cache is empty; fails after `within_s`."""
    start = time.monotonic()
    while True:
        lines = _app_metrics(http)
        running = _value(lines, "ray_rayllm_num_requests_running") + _value(lines, "ray_rayllm_num_requests_waiting")
        if running == 0 and _value(lines, "ray_rayllm_kv_cache_usage_perc") == 0:
            return time.monotonic() - start
        assert time.monotonic() - start < within_s, f"engine still busy after {within_s}s ({running} requests)"
        time.sleep(0.2)


# -- generation ----------------------------------------------------------------------
def test_greedy_completions_equal_offline_engine(client, reference):
    for i, prompt in enumerate(PROMPTS):
        r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0)
        assert r.choices[0].text == reference["text"][i]
        assert r.usage.prompt_tokens == len(reference["ids"][i])
        assert r.usage.completion_tokens == reference["num_tokens"][i]
        assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens


def test_batch_of_prompts_and_token_id_prompts(client, reference):
    r = client.completions.create(model=MODEL, prompt=PROMPTS, max_tokens=MAX_TOKENS, temperature=0)
    assert [c.index for c in r.choices] == list(range(len(PROMPTS)))
    assert [c.text for c in r.choices] == reference["text"]
    r = client.completions.create(model=MODEL, prompt=reference["ids"][1], max_tokens=MAX_TOKENS, temperature=0)
    assert r.choices[0].text == reference["text"][1]


def test_streaming_equals_non_streaming(client, reference):
    stream = client.completions.create(model=MODEL, prompt=PROMPTS[2], max_tokens=MAX_TOKENS, temperature=0,
                                       stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == reference["text"][2]
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == reference["num_tokens"][2]


def test_chat_and_chat_streaming(client, reference):
    r = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=MAX_TOKENS, temperature=0)
    assert r.choices[0].message.role == "assistant"
    assert r.choices[0].message.content == reference["chat"]
    chunks = list(client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=MAX_TOKENS, temperature=0,
                                                 stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == reference["chat"]
    assert chunks[-1].choices[0].finish_reason == "length"
    assert all(c.choices[0].finish_reason is None for c in chunks[:-1])


def test_raw_sse_framing(http):
    with http.stream("POST", "/v1/chat/completions", json={"model": MODEL, "messages": CHAT, "max_tokens": 3,
                                                            "stream": True}) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        events = [line for line in r.iter_lines() if line]
    assert all(e.startswith("data: ") for e in events) and events[-1] == "data: [DONE]"
    assert json.loads(events[0][6:])["choices"][0]["delta"] == {"role": "assistant", "content": ""}


def test_n_choices_with_seed(client):
    r = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=8, temperature=1.0, n=3, seed=7)
    assert sorted(c.index for c in r.choices) == [0, 1, 2]
    assert r.usage.completion_tokens == 24
    again = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=8, temperature=1.0, n=3, seed=7)
    assert [c.text for c in again.choices] == [c.text for c in r.choices]
    chat = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=4, n=2, temperature=1.0)
    assert sorted(c.index for c in chat.choices) == [0, 1]


def test_stop_string(client, reference):
    full = reference["text"][1]
    stop = full[4:7]
    r = client.completions.create(model=MODEL, prompt=PROMPTS[1], max_tokens=MAX_TOKENS, temperature=0, stop=[stop])
    assert r.choices[0].text == full[:full.index(stop)]
    assert r.choices[0].finish_reason == "stop"


def test_completion_logprobs(client, reference):
    r = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=MAX_TOKENS, temperature=0, logprobs=2)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == reference["num_tokens"][0]
    for token_lp, top in zip(lp.token_logprobs, lp.top_logprobs):
        assert 1 <= len(top) <= 3 and token_lp == pytest.approx(max(top.values()))  # greedy = the top-1
    assert lp.text_offset == sorted(lp.text_offset) and lp.text_offset[0] == 0


def test_chat_logprobs(client, reference):
    r = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=MAX_TOKENS, temperature=0,
                                       logprobs=True, top_logprobs=2)
    content = r.choices[0].logprobs.content
    assert len(content) == reference["num_tokens"][0] or len(content) == r.usage.completion_tokens
    assert all(len(t.top_logprobs) == 2 and t.logprob == pytest.approx(t.top_logprobs[0].logprob) for t in content)


def test_echo(client, reference):
    r = client.completions.create(model=MODEL, prompt=PROMPTS[3], max_tokens=MAX_TOKENS, temperature=0, echo=True)
    assert r.choices[0].text == PROMPTS[3] + reference["text"][3]


def test_echo_with_logprobs_scores_the_prompt(client, http, reference):
    r = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=MAX_TOKENS, temperature=0, echo=True,
                                  logprobs=2)
    text, lp = r.choices[0].text, r.choices[0].logprobs
    ids, ref = reference["ids"][0], reference["prompt_logprobs"]
    assert text == PROMPTS[0] + reference["text"][0]
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.text_offset) == len(ids) + reference["num_tokens"][0]
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    for i in range(1, len(ids)):
        assert lp.token_logprobs[i] == pytest.approx(ref[i][ids[i]].logprob, abs=1e-5)
        assert lp.top_logprobs[i] == pytest.approx({e.decoded_token: e.logprob for e in ref[i].values()}, abs=1e-5)
        assert text[lp.text_offset[i]:].startswith(lp.tokens[i])  # offsets index the echoed text
    assert lp.text_offset[len(ids)] == len(PROMPTS[0])  # the completion starts after the echoed prompt
    body = {"model": MODEL, "prompt": PROMPTS[0], "max_tokens": 2, "temperature": 0, "echo": True, "logprobs": 2,
            "stream": True}
    with http.stream("POST", "/v1/completions", json=body) as s:
        first = json.loads(next(line for line in s.iter_lines() if line.startswith("data: "))[6:])
    assert first["choices"][0]["logprobs"]["tokens"][:len(ids)] == lp.tokens[:len(ids)]  # the first chunk


def test_json_response_format_goes_through_guardrails(client):
    try:
        r = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=48, temperature=0,
                                           response_format={"type": "json_object"})
    except openai.UnprocessableEntityError as e:  # never a 200 with invalid JSON (tests/test_serve_guardrails.py)
        assert e.body["type"] == "guardrail_violation"
        return
    assert isinstance(json.loads(r.choices[0].message.content), dict)


def test_concurrent_requests_match_sequential(base_url, reference):
    async def one(c: httpx.AsyncClient, i: int):
        k = i % len(PROMPTS)
        body = {"model": MODEL, "prompt": PROMPTS[k], "max_tokens": MAX_TOKENS, "temperature": 0,
                "stream": i % 2 == 1}
        if not body["stream"]:
            r = await c.post("/v1/completions", json=body)
            assert r.status_code == 200, r.text
            return k, r.json()["choices"][0]["text"]
        text = []
        async with c.stream("POST", "/v1/completions", json=body) as r:
            assert r.status_code == 200
            async for line in r.aiter_lines():
                if line.startswith("data: {"):
                    text.append(json.loads(line[6:])["choices"][0]["text"])
        return k, "".join(text)

    async def run():
        async with httpx.AsyncClient(base_url=base_url, headers={"Authorization": f"Bearer {API_KEY}"},
                                     timeout=300, limits=httpx.Limits(max_connections=64)) as c:
            return await asyncio.gather(*(one(c, i) for i in range(32)))
    for k, text in asyncio.run(run()):
        assert text == reference["text"][k]


# -- cancellation --------------------------------------------------------------------
LONG = {"model": MODEL, "prompt": PROMPTS[0], "max_tokens": 1900, "ignore_eos": True, "temperature": 0}


def _disconnect_stream(http):
    with http.stream("POST", "/v1/completions", json={**LONG, "stream": True}) as r:
        for n, line in enumerate(r.iter_lines()):
            if n >= 3:
                break  # leaving the block closes the connection mid-stream
    return time.monotonic()


@pytest.mark.parametrize("batching", [True, False])
def test_disconnected_stream_frees_the_engine(http, app_name, batching):
    """Aborted, not run out: the engine finishes the request as "abort", never "length". Told apart
    by its finish reason, not by a deadline, so the test holds however fast or slow the box is."""
    reconfigure_ingress(app_name, DEFAULT_BATCHING if batching else {**DEFAULT_BATCHING, "max_batch_size": 1})
    try:
        cancelled = _num_cancelled(http)
        aborted, ran_out = _num_finished(http, "abort"), _num_finished(http, "length")
        _disconnect_stream(http)
        # cut short, not finished; then freed (both seen through the metrics' publishing delay)
        _wait_metric(http, "ray_rayllm_requests_total", lambda v: v >= cancelled + 1, status="499")
        _wait_metric(http, "ray_rayllm_request_success_total", lambda v: v >= aborted + 1, finished_reason="abort")
        assert _wait_engine_idle(http, within_s=60.0) < 60.0
        time.sleep(2 * METRICS_REPORT_INTERVAL_MS / 1000 + 0.5)  # a late count would have shown by now
        assert _num_cancelled(http) == cancelled + 1
        assert _num_finished(http, "length") == ran_out
    finally:
        reconfigure_ingress(app_name, DEFAULT_BATCHING)


def test_disconnected_non_streaming_request_runs_out_and_frees_the_engine(base_url, http):
    """Under HAProxy (the default) a client's FIN does not reach the Ingress while no byte of the answer
    has been written (HAProxy's abortonclose only drops queued requests), so a non-streaming request
    whose client left runs to max_tokens; then everything is freed. Behind the Python proxy it is
    aborted at once: tests/test_serve_python_proxy.py.

    The answer must outlast the client, however fast this box: its length and the deadlines come
    from the engine's time per token, measured first."""
    per_token_s = seconds_per_token(base_url, LONG, AUTH)
    max_tokens = min(LONG["max_tokens"], max(64, math.ceil(1.0 / per_token_s)))  # ~1 s of generation
    run_s = max_tokens * per_token_s
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(base_url + "/v1/completions", json={**LONG, "max_tokens": max_tokens}, headers=AUTH,
                   timeout=min(0.2, run_s / 4))
    within_s = 30.0 + 10 * run_s  # a box shared with other work can slow down many times over meanwhile
    assert _wait_engine_idle(http, within_s=within_s) < within_s


def seconds_per_token(base_url: str, body: dict, headers: dict | None = None) -> float:
    """The engine's time per generated token for one request alone, on this box now: a 1-token
    answer's latency taken from a 129-token one's (EOS ignored), so that fixed costs cancel."""
    def latency(max_tokens: int) -> float:
        start = time.monotonic()
        r = httpx.post(base_url + "/v1/completions", json={**body, "max_tokens": max_tokens, "ignore_eos": True},
                       headers=headers, timeout=300)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == max_tokens, r.text
        return time.monotonic() - start
    latency(1)  # warm
    return max((latency(129) - latency(1)) / 128, 1e-6)


def test_engine_replica_computes_on_every_core(app_name, base_url):
    assert engine_deployment(app_name) == "EngineDeployment"
    stats = call_deployment(app_name, "EngineDeployment", "get_stats")
    assert stats["cpu_threads"] == len(os.sched_getaffinity(0))  # not Ray's OMP_NUM_THREADS=1


# -- errors -----------------------------------------------------------------------------
BAD = [
    ("/v1/completions", {"prompt": "x", "max_tokens": -1}, "max_tokens"),
    ("/v1/completions", {"prompt": "x", "max_tokens": "many"}, "max_tokens"),
    ("/v1/completions", {"prompt": "x", "temperature": 9}, "temperature"),
    ("/v1/completions", {"prompt": "x", "top_p": 0}, "top_p"),
    ("/v1/completions", {"prompt": "x", "n": 0}, "n"),
    ("/v1/completions", {"prompt": "x", "logprobs": 50}, "logprobs"),
    ("/v1/completions", {"prompt": "x", "stop": 3}, "stop"),
    ("/v1/completions", {"prompt": "x", "min_tokens": 9, "max_tokens": 2}, "min_tokens"),
    ("/v1/completions", {"prompt": ""}, "prompt"),
    ("/v1/completions", {"prompt": []}, "prompt"),
    ("/v1/completions", {"prompt": [1, 99999]}, "prompt"),
    ("/v1/completions", {"prompt": "hello", "max_tokens": 4000}, "max_tokens"),
    ("/v1/completions", {"prompt": list(range(3, 2100))}, "prompt"),
    ("/v1/chat/completions", {"messages": []}, "messages"),
    ("/v1/chat/completions", {"messages": CHAT, "top_logprobs": 2}, "top_logprobs"),
    ("/v1/chat/completions", {"messages": [{"role": "user"}]}, "messages.0"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": 5}]}, "messages.0.content"),
    ("/v1/chat/completions", {"messages": CHAT, "response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "foo"}}}}, "response_format"),
]


@pytest.mark.parametrize("path,body,param", BAD, ids=[f"{p.split('/')[-1]}-{b_}" for p, _, b_ in BAD])
def test_invalid_requests_are_400_naming_the_field(http, path, body, param):
    r = http.post(path, json={"model": MODEL, **body})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["type"] == "invalid_request_error"
    assert err["param"] == param, err


GARBAGE = [
    b'{"model": "tiny-llama", "prompt": "x", "temperature": NaN}',
    b'{"model": "tiny-llama", "prompt": "x", "n": 1e309}',
    b'{"model": "tiny-llama", "prompt": "x", "max_tokens": 99999999999999999999999}',
    b'{"model": "tiny-llama", "prompt": [[[1]]]}', b'{"model": "tiny-llama", "prompt": null}', b'[]', b'"x"', b'',
    b'{"model": null, "prompt": "x"}', b'{"model": "tiny-llama", "prompt": "x", "stop": ["a", null]}',
    b'{"model": "tiny-llama", "prompt": "x", "stream_options": 5, "stream": true}',
    b'{"model": "tiny-llama", "prompt": "x", "seed": -99999999999999999999}', b'\xff\xfe',
    b'{"model": "tiny-llama", "prompt": "x", "logprobs": true}',
    b'{"model": "tiny-llama", "prompt": "x", "stop_token_ids": [99999999]}',
]
GARBAGE_CHAT = [
    b'{"model": "tiny-llama", "messages": [{"role": "user", "content": null}]}',
    b'{"model": "tiny-llama", "messages": [{"content": "x"}]}', b'{"model": "tiny-llama", "messages": {}}',
    b'{"model": "tiny-llama", "messages": [{"role": "user", "content": "x"}], '
    b'"response_format": {"type": "json_schema", "json_schema": {"schema": 5}}}',
    b'{"model": "tiny-llama", "messages": [{"role": "user", "content": "x"}], "top_logprobs": 99, "logprobs": true}',
]


def test_garbage_is_never_a_server_error(http):
    for path, bodies in (("/v1/completions", GARBAGE), ("/v1/chat/completions", GARBAGE_CHAT)):
        for body in bodies:
            r = http.post(path, content=body, headers={"content-type": "application/json"})
            assert 400 <= r.status_code < 500 and "error" in r.json(), (body, r.status_code, r.text)


def test_invalid_json_is_400(http):
    r = http.post("/v1/completions", content=b"{nope", headers={"content-type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_json"


def test_openai_client_sees_bad_request(client):
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=MODEL, prompt="x", max_tokens=4000)
    assert "maximum context length" in str(info.value)


@pytest.mark.parametrize("headers", [{}, {"Authorization": "Bearer wrong"}, {"Authorization": f"Basic {API_KEY}"}])
def test_missing_or_wrong_key_is_401(base_url, headers):
    for method, path in (("POST", "/v1/completions"), ("GET", "/v1/models")):
        r = httpx.request(method, base_url + path, json={"model": MODEL, "prompt": "x"}, headers=headers)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"


def test_unknown_model_and_route_are_404(http):
    r = http.post("/v1/completions", json={"model": "gpt-9", "prompt": "x"})
    assert r.status_code == 404 and r.json()["error"]["param"] == "model"
    r = http.post("/v1/nothing", json={})
    assert r.status_code == 404 and r.json()["error"]["code"] == "not_found"


def test_body_over_limit_is_413(http):
    r = http.post("/v1/completions", json={"model": MODEL, "prompt": "a" * (MAX_BODY + 1)})
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"


def test_load_shedding_is_503_with_retry_after(http, app_name):
    reconfigure_ingress(app_name, {**DEFAULT_BATCHING, "max_pending_requests": 0})
    try:
        r = http.post("/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 2})
        assert r.status_code == 503 and r.headers["retry-after"] == "1"
        assert r.json()["error"]["type"] == "service_unavailable"
    finally:
        reconfigure_ingress(app_name, DEFAULT_BATCHING)


# -- control surface ---------------------------------------------------------------------
def test_serve_controller_runs_with_the_serving_environment(base_url):
    """What local_cluster sets reaches Serve's controller, the process that reads it (its loop
    interval) -- through the raylet that starts it, not an environment of this test's own."""
    from serve_app.local import CONTROL_LOOP_ENV
    environs = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if b"ServeController" not in f.read():
                    continue
            with open(f"/proc/{pid}/environ", "rb") as f:
                environs.append(dict(e.split("=", 1) for e in f.read().decode().split("\0") if "=" in e))
        except OSError:  # a process that ended meanwhile
            continue
    assert environs, "no ServeController process found"
    assert all({k: env.get(k) for k in CONTROL_LOOP_ENV} == CONTROL_LOOP_ENV for env in environs)


def test_models_health_metrics(client, http):
    (m,) = client.models.list().data
    assert m.id == MODEL
    assert http.get("/health").status_code == 200
    client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=4)
    assert http.get("/v1/models", headers={"Authorization": "Bearer wrong"}).status_code == 401
    assert http.post("/v1/completions", json={"model": MODEL, "prompt": "x", "n": 0}).status_code == 400
    _wait_metric(http, "ray_rayllm_requests_total", lambda v: v > 0, status="401")  # errors are counted too
    _wait_metric(http, "ray_rayllm_time_to_first_token_seconds_count", lambda v: v > 0)
    text = "\n".join(_app_metrics(http))
    for name in ("ray_rayllm_num_requests_running", "ray_rayllm_num_requests_waiting",
                 "ray_rayllm_time_to_first_token_seconds_bucket", "ray_rayllm_e2e_request_latency_seconds_count",
                 "ray_rayllm_requests_total", "ray_rayllm_generation_tokens_total",
                 'ray_rayllm_request_success_total{', 'deployment="EngineDeployment"', 'deployment="Ingress"'):
        assert name in text
    assert _metric(http, "ray_rayllm_time_to_first_token_seconds_count") > 0
    assert _metric(http, "ray_rayllm_requests_total", status="200") > 0
    assert _metric(http, "ray_rayllm_requests_total", status="400") > 0


def test_reconfigure_batching_takes_effect(base_url, http, app_name):
    def batches_for(concurrency: int) -> tuple[float, float]:
        before = (_metric(http, "ray_rayllm_ingress_batches_total", 0.0),
                  _metric(http, "ray_rayllm_ingress_batched_requests_total", 0.0))

        async def run():
            async with httpx.AsyncClient(base_url=base_url, headers={"Authorization": f"Bearer {API_KEY}"},
                                         timeout=120) as c:
                rs = await asyncio.gather(*(c.post("/v1/completions", json={"model": MODEL, "prompt": "hi",
                                                                            "max_tokens": 2})
                                            for _ in range(concurrency)))
                assert all(r.status_code == 200 for r in rs)
        asyncio.run(run())
        _wait_metric(http, "ray_rayllm_ingress_batched_requests_total", lambda v: v >= before[1] + concurrency)
        return (_metric(http, "ray_rayllm_ingress_batches_total") - before[0],
                _metric(http, "ray_rayllm_ingress_batched_requests_total") - before[1])

    try:
        reconfigure_ingress(app_name, {**DEFAULT_BATCHING, "max_batch_size": 1})
        assert batches_for(8) == (8, 8)  # off: one batch per request
        reconfigure_ingress(app_name, {**DEFAULT_BATCHING, "max_batch_size": 16, "batch_wait_timeout_s": 1.0})
        num_batches, num_requests = batches_for(8)
        assert num_requests == 8 and num_batches < 8  # on: requests share batches
    finally:
        reconfigure_ingress(app_name, DEFAULT_BATCHING)


def test_dashboard_reads_only_series_the_app_exports(client, http):
    """Every series deploy/grafana's dashboard queries is in a real scrape of the app after a few requests."""
    from tests.test_deploy_grafana import GRAFANA, load_dashboard_module

    wanted = load_dashboard_module().queried_series(json.loads((GRAFANA / "rayllm-dashboard.json").read_text()))
    client.completions.create(model=MODEL, prompt=PROMPTS[1], max_tokens=4, stream=True)
    try:  # whether the tiny model's JSON passes or not, the guardrail's outcome is counted
        client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=8,
                                       response_format={"type": "json_object"})
    except openai.UnprocessableEntityError:
        pass
    start, missing = time.monotonic(), wanted
    while missing and time.monotonic() - start < 20:
        time.sleep(0.5)
        names = {line.split("{")[0].split(" ")[0] for line in http.get("/metrics").text.splitlines()
                 if line and not line.startswith("#")}
        missing = wanted - names
    assert not missing, f"the dashboard queries series the app does not export: {sorted(missing)}"
