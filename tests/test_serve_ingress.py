"""The Ingress replica driven over raw ASGI, as Serve runs it, with a fake engine handle (no Ray).

What a client going away does to the replica: its admission slot comes back, its engine
streams are cancelled, and the next request is answered, however early the client left.
"""
import asyncio
import gc
import json
from types import SimpleNamespace

import pytest
from ray import serve
from starlette.requests import ClientDisconnect

from engine import LoRARequest
from serve_app.args import AppArgs, StreamingConfig
from serve_app.http.ingress import Ingress
from serve_app.http.ingress import app as ingress_app
from serve_app.http.messages import Delta, StreamItem
from serve_app.http.preprocess import PrepJob
from serve_app.metrics import IngressMetrics
from serve_app.replica.client import LocalEngine
from tests.fake_metrics import Recorder

# Serve's ingress wrapper has an async __del__: collecting one outside a replica warns about it.
pytestmark = pytest.mark.filterwarnings("ignore:coroutine '.*__del__' was never awaited:RuntimeWarning")

MODEL = "tiny"
DONE = {"type": "http.response.body", "body": b"", "more_body": False}


class FakeStream:
    """One engine request's stream: its items, then (still generating) nothing until cancelled."""

    def __init__(self, items):
        self._items = list(items)
        self.cancelled = False

    def __aiter__(self):
        return self

    async def __anext__(self):
        if self._items:
            return self._items.pop(0)
        await asyncio.Event().wait()  # the engine is still generating

    def cancel(self):
        self.cancelled = True


class FakeEngine:
    """The slice of the EngineDeployment handle the Ingress calls."""

    def __init__(self):
        self.streams: list[FakeStream] = []
        self.requests = []  # the EngineRequests sent, in order
        self.finish = False  # whether a stream ends after its first token, or goes on
        self.generate = self  # handle.generate.options(stream=True).remote(request)
        self.model_info = SimpleNamespace(remote=self._model_info)

    def options(self, **_):
        return self

    def remote(self, request):
        self.requests.append(request)
        items = [StreamItem(deltas=[Delta(0, "Hi", [5], finish_reason="length" if self.finish else None)],
                            num_prompt_tokens=3, finished=self.finish)]
        self.streams.append(FakeStream(items))
        return self.streams[-1]

    async def _model_info(self):
        return {"max_model_len": 2048, "vocab_size": 10**6}


@pytest.fixture
def start_ingress(monkeypatch, tiny_llama):
    """An Ingress as a Serve replica makes it: the wrapped class's async __init__; its routes find it
    through the replica context."""
    async def start(engine: FakeEngine | None, local_engine=None, **args):
        cls = Ingress.func_or_class
        ingress = cls.__new__(cls)
        await ingress.__init__(engine, None, AppArgs(model=tiny_llama, served_model_name=MODEL, max_batch_size=1,
                                                     **args), local_engine)
        ingress.recorder = Recorder()  # in place of Ray's metrics (no Ray here)
        ingress.metrics = IngressMetrics("rayllm", MODEL, factory=ingress.recorder)
        ingress_app.state.metrics = ingress.metrics
        monkeypatch.setattr(serve, "get_replica_context", lambda: SimpleNamespace(servable_object=ingress))
        return ingress
    yield start
    monkeypatch.undo()
    gc.collect()  # here, under this module's warning filter, not in some later test


def _scope(body: bytes, spec_version: str, headers: tuple = ()) -> dict:
    return {"type": "http", "asgi": {"version": "3.0", "spec_version": spec_version}, "http_version": "1.1",
            "method": "POST", "scheme": "http", "path": "/v1/completions", "raw_path": b"/v1/completions",
            "query_string": b"", "root_path": "", "server": ("127.0.0.1", 8000), "client": ("127.0.0.1", 5000),
            "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                        *headers]}


async def _post(ingress, payload: dict, client_gone: str | None = None, headers: tuple = ()) -> list[dict]:
    """POST /v1/completions; the ASGI messages sent back. client_gone: when the client disconnects."""
    body = json.dumps({"model": MODEL, "prompt": "Hello", "max_tokens": 4, **payload}).encode()
    sent: list[dict] = []
    first_chunk = asyncio.Event()
    requests = [{"type": "http.request", "body": body, "more_body": False}]

    async def receive():
        if requests:
            return requests.pop()
        if client_gone == "mid_stream":
            await first_chunk.wait()
        elif client_gone != "before_start":
            await asyncio.Event().wait()  # connected until the response is done
        return {"type": "http.disconnect"}

    async def send(message):
        if message["type"] == "http.response.start" and client_gone == "send_fails":
            raise OSError("Broken pipe")
        if message["type"] == "http.response.start" and client_gone == "before_start":
            await asyncio.Event().wait()  # the client stopped reading; its disconnect comes first
        sent.append(message)
        if message["type"] == "http.response.body" and message["body"]:
            first_chunk.set()

    # ASGI spec 2.4 servers report a gone client by failing the send; older ones by http.disconnect.
    spec = "2.4" if client_gone == "send_fails" else "2.0"
    try:
        await asyncio.wait_for(ingress(_scope(body, spec, headers), receive, send), timeout=30)
    except ClientDisconnect:  # how Starlette reports the failed send
        assert client_gone == "send_fails"
    return sent


def _count(ingress, status: int) -> float:
    return ingress.recorder.value("rayllm_requests", status=str(status))


@pytest.mark.parametrize("client_gone", ["send_fails", "before_start", "mid_stream"])
def test_client_gone_frees_its_slot_and_stops_the_engine(start_ingress, client_gone):
    async def run():
        engine = FakeEngine()
        ingress = await start_ingress(engine, max_pending_requests=1)
        await _post(ingress, {"stream": True}, client_gone=client_gone)
        engine.finish = True
        after = await _post(ingress, {"stream": False})  # the replica's one slot is free again
        return ingress, engine, after

    ingress, engine, after = asyncio.run(run())
    assert after[0]["status"] == 200, after
    assert json.loads(after[1]["body"])["choices"][0]["text"] == "Hi"
    assert engine.streams[0].cancelled  # the engine stopped generating for the gone client
    assert ingress._num_pending == 0
    assert _count(ingress, 499) == 1  # the gone client is counted, once


def test_stream_read_to_the_end_releases_its_slot_once(start_ingress):
    async def run():
        engine = FakeEngine()
        engine.finish = True
        ingress = await start_ingress(engine, max_pending_requests=1)
        streamed = await _post(ingress, {"stream": True})
        return ingress, engine, streamed

    ingress, engine, streamed = asyncio.run(run())
    assert streamed[0]["status"] == 200 and streamed[-1] == DONE
    assert streamed[-2]["body"].endswith(b"data: [DONE]\n\n")
    assert not engine.streams[0].cancelled  # it finished on its own
    assert ingress._num_pending == 0  # not -1: released exactly once
    assert (_count(ingress, 200), _count(ingress, 499)) == (1, 0)


def test_the_session_reaches_the_engine_request_header_first(start_ingress):
    """What the prefix router keys a session by: X-Session-ID, else prompt_cache_key, else user."""
    async def run():
        engine = FakeEngine()
        engine.finish = True
        ingress = await start_ingress(engine)
        keyed = {"user": "u1", "prompt_cache_key": "k1"}
        for payload, headers in ((keyed, ((b"x-session-id", b"s1"),)), (keyed, ()), ({"user": "u1"}, ()), ({}, ())):
            assert (await _post(ingress, payload, headers=headers))[0]["status"] == 200
        return [r.session for r in engine.requests]

    assert asyncio.run(run()) == ["s1", "k1", "u1", None]


def test_a_separate_ingress_refuses_the_engines_streaming_knobs(start_ingress):
    """Its user_config holds its own knobs only: the engine replicas have their own (with
    colocate_ingress it takes both: tests/test_serve_colocated.py)."""
    async def run():
        ingress = await start_ingress(FakeEngine())
        with pytest.raises(ValueError, match="stream_interval_ms"):
            ingress.reconfigure({"max_batch_size": 4, "stream_interval_ms": 5})
        with pytest.raises(ValueError, match="colocate_ingress"):
            await ingress.get_stats()
        ingress.reconfigure({"max_batch_size": 4})
        return ingress

    assert asyncio.run(run()).batching.max_batch_size == 4


class FakeReplica:
    """The slice of an engine replica (EngineReplica) that a LocalEngine calls, in this process."""

    def __init__(self):
        self.streaming = StreamingConfig()
        self.healthy = True

    async def generate(self, request):
        yield StreamItem(deltas=[Delta(0, "Hi", [5], finish_reason="length")], num_prompt_tokens=3, finished=True)

    async def model_info(self):
        return {"max_model_len": 2048, "vocab_size": 10**6}

    def reconfigure(self, config):
        self.streaming = StreamingConfig.model_validate(config)

    async def get_stats(self):
        return {"streaming": self.streaming.model_dump()}

    async def check_health(self):
        if not self.healthy:
            raise RuntimeError("the step loop died")


def test_a_colocated_ingress_runs_the_engine_it_is_handed(start_ingress):
    """With colocate_ingress, build_app hands the Ingress a factory (LocalEngineFactory), called once
    here; the engine client it returns takes its own knobs out of the Ingress's user_config."""
    replica = FakeReplica()

    def local_engine():  # what LocalEngineFactory returns, around a fake replica
        engine = LocalEngine(replica)
        return engine, engine

    async def run():
        ingress = await start_ingress(None, local_engine=local_engine)
        answer = await _post(ingress, {"stream": False})
        ingress.reconfigure({"max_batch_size": 4, "stream_interval_ms": 5})
        stats = await ingress.get_stats()
        with pytest.raises(ValueError, match="stream_interval_ms"):
            ingress.reconfigure({"max_batch_size": 4, "stream_interval_ms": -1})
        with pytest.raises(ValueError, match="max_batch_size"):
            ingress.reconfigure({"max_batch_size": 0})
        with pytest.raises(ValueError, match="unknown arg 'nope'"):
            ingress.reconfigure({"nope": 1})
        replica.healthy = False
        with pytest.raises(RuntimeError, match="step loop"):  # Serve replaces the replica
            await ingress.check_health()
        return ingress, answer, stats

    ingress, answer, stats = asyncio.run(run())
    assert answer[0]["status"] == 200 and json.loads(answer[1]["body"])["choices"][0]["text"] == "Hi"
    assert stats["streaming"]["stream_interval_ms"] == 5.0
    assert ingress.batching.max_batch_size == 4  # the refused configs changed nothing of the Ingress's


class RoutingEngine(FakeEngine):
    """A FakeEngine that also keeps the handle options each request was sent with."""

    def __init__(self):
        super().__init__()
        self.finish = True
        self.routing: list[dict] = []

    def options(self, **kwargs):
        if "stream" not in kwargs:
            self.routing.append(kwargs)
        return self


def test_a_request_naming_an_adapter_runs_with_it_and_is_routed_by_it(start_ingress):
    """The adapter's LoRARequest goes with the engine request, and its multiplexed id with the handle
    call; an unknown model is vLLM's 404. A micro-batch's requests share one engine replica (one batch
    id), but a replica holding one adapter may not hold another: one decision per adapter (and base)."""
    adapters = ["sql@1", "chat@2", "sql@1", None, None]

    async def run():
        engine = RoutingEngine()
        ingress = await start_ingress(engine, lora_modules={"chat": "/a/chat", "sql": "/a/sql"})
        answers = [await _post(ingress, {"model": model}) for model in ("sql", MODEL, "nope")]
        batch = await ingress._prepare_now([PrepJob(max_tokens=4, prompts=["Hello"], adapter=a) for a in adapters])
        return engine, answers, batch

    engine, (sql, base, nope), batch = asyncio.run(run())
    assert sql[0]["status"] == 200 and json.loads(sql[1]["body"])["model"] == "sql"
    assert [r.lora_request for r in engine.requests] == [LoRARequest("sql", 2, "/a/sql"), None]
    assert engine.routing == [{"multiplexed_model_id": "sql@2"}]  # the base model's request: no adapter
    assert base[0]["status"] == 200
    assert nope[0]["status"] == 404 and json.loads(nope[1]["body"])["error"] == {
        "message": "The model `nope` does not exist.", "type": "NotFoundError", "param": "model", "code": 404}
    ids = [p.batch_id for p in batch]
    assert None not in ids and ids[0] == ids[2] and ids[3] == ids[4] and len(set(ids)) == 3

def test_request_priority_reaches_the_engine_request(start_ingress):
    """vLLM's `priority` travels in the EngineRequest (the engine refuses it under fcfs); a priority
    that is not an integer is a 400 naming it."""
    async def run():
        engine = FakeEngine()
        engine.finish = True
        ingress = await start_ingress(engine)
        answers = [await _post(ingress, {"stream": False, **payload})
                   for payload in ({}, {"priority": -2}, {"priority": 7}, {"priority": "high"})]
        return engine, answers

    engine, answers = asyncio.run(run())
    assert [a[0]["status"] for a in answers] == [200, 200, 200, 400]
    assert [r.priority for r in engine.requests] == [0, -2, 7]
    assert json.loads(answers[3][1]["body"])["error"]["param"] == "priority"
