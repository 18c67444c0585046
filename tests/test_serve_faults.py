"""The service under faults, on a real local Ray Serve over loopback (CPU, tensor_parallel_size=2).

One app for the whole module, on the suite's shared cluster: first the cases that leave it
healthy (a burst past max_pending_requests, clients that drop before the first byte), then the
faults, one per case, each waiting for Serve's replacement replica before it starts. The engine
deployment is tests/fault_app.py's FaultyEngineDeployment, which can tell its pids and fail a step.
"""
import asyncio
import contextlib
import json
import math
import os
import signal
import socket
import time

import httpx
import pytest

from serve_app.local import call_deployment, deployed_app
from tests.fault_app import fault_app
from tests.test_serve import seconds_per_token

pytestmark = [pytest.mark.timeout(900), pytest.mark.slow]

APP = "test_serve_faults"
MODEL = "tiny-llama"
MAX_PENDING = 4
ARGS = dict(served_model_name=MODEL, device="cpu", dtype="float32", tensor_parallel_size=2, max_model_len=2048,
            num_kv_blocks=512, max_num_seqs=32, max_pending_requests=MAX_PENDING, health_check_period_s=1.0,
            health_check_timeout_s=5.0, graceful_shutdown_timeout_s=1.0)
LONG = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 1900, "ignore_eos": True, "temperature": 0}


@pytest.fixture(scope="module")
def base_url(ray_cluster, tiny_llama):
    with deployed_app(ray_cluster, fault_app({"model": tiny_llama, **ARGS}), APP) as url:
        yield url


def _engine_stats() -> dict:
    return call_deployment(APP, "EngineDeployment", "get_stats")


def _wait_at_rest(within_s: float = 30.0) -> None:
    """0 running, 0 waiting, 0 KV blocks used."""
    deadline = time.monotonic() + within_s
    while True:
        s = _engine_stats()
        if s["num_requests_running"] == s["num_requests_waiting"] == 0 and s["kv_cache_usage"] == 0:
            return
        assert time.monotonic() < deadline, f"engine not at rest after {within_s}s: {s}"
        time.sleep(0.2)


def _wait_serving(base_url: str, within_s: float = 90.0) -> float:
    """Seconds until a completion succeeds (a replacement replica may be starting)."""
    start = time.monotonic()
    while True:
        with contextlib.suppress(httpx.HTTPError):
            r = httpx.post(base_url + "/v1/completions", json={**LONG, "max_tokens": 2}, timeout=30)
            if r.status_code == 200:
                return time.monotonic() - start
        assert time.monotonic() - start < within_s, f"no successful request within {within_s}s"
        time.sleep(0.5)


async def _stream(c: httpx.AsyncClient, body: dict, started: asyncio.Event | None = None) -> tuple[int, list]:
    """(status, the SSE data payloads), setting `started` at the first one."""
    async with c.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
        if r.status_code != 200:
            await r.aread()
            return r.status_code, [r.json()]
        events = []
        async for line in r.aiter_lines():
            if line.startswith("data: "):
                events.append(line[6:])
                if started is not None:
                    started.set()
        return 200, events


# -- load ---------------------------------------------------------------------------------
def test_burst_past_max_pending_sheds_the_excess_and_completes_the_rest(base_url):
    # Answers of ~2 s at this box's measured speed: the burst arrives while the first ones still run.
    max_tokens = min(LONG["max_tokens"], max(16, math.ceil(2.0 / seconds_per_token(base_url, LONG))))

    async def run():
        async with httpx.AsyncClient(base_url=base_url, timeout=120) as c:
            body = {**LONG, "max_tokens": max_tokens, "stream_options": {"include_usage": True}}
            return await asyncio.gather(*[_stream(c, body) for _ in range(10 * MAX_PENDING)])
    results = asyncio.run(run())
    shed = [events for status, events in results if status == 503]
    accepted = [events for status, events in results if status == 200]
    assert len(shed) + len(accepted) == len(results), [s for s, _ in results]
    assert shed and len(accepted) >= MAX_PENDING
    assert all(e[0]["error"]["type"] == "service_unavailable" for e in shed)
    for events in accepted:
        assert events[-1] == "[DONE]"
        assert json.loads(events[-2])["usage"]["completion_tokens"] == max_tokens
        text_chunks = [json.loads(e) for e in events[:-2]]
        assert not any("error" in ch for ch in text_chunks)
    _wait_at_rest()


def test_burst_503_carries_retry_after(base_url):
    async def run():
        async with httpx.AsyncClient(base_url=base_url, timeout=120) as c:
            started = [asyncio.Event() for _ in range(MAX_PENDING)]
            streams = [asyncio.create_task(_stream(c, LONG, e)) for e in started]
            await asyncio.wait_for(asyncio.gather(*(e.wait() for e in started)), 60)  # all pending now
            r = await c.post("/v1/completions", json={**LONG, "max_tokens": 2})
            for t in streams:
                t.cancel()
            await asyncio.gather(*streams, return_exceptions=True)
            return r
    r = asyncio.run(run())
    assert r.status_code == 503 and r.headers["retry-after"] and r.json()["error"]["code"] == "service_unavailable"
    _wait_at_rest()


def test_clients_dropping_before_the_first_byte_leave_the_service_at_rest(base_url):
    url = httpx.URL(base_url)
    host, port = url.host, url.port
    payload = json.dumps({**LONG, "max_tokens": 8, "stream": True}).encode()
    request = (f"POST {url.path}/v1/completions HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
               f"Content-Length: {len(payload)}\r\n\r\n").encode() + payload
    for _ in range(50):
        with socket.create_connection((host, int(port))) as s:
            s.sendall(request)  # ... and gone before any byte of the answer
    _wait_at_rest()

    async def run():
        async with httpx.AsyncClient(base_url=base_url, timeout=120) as c:
            return await asyncio.gather(*[_stream(c, {**LONG, "max_tokens": 8}) for _ in range(MAX_PENDING)])
    assert [status for status, _ in asyncio.run(run())] == [200] * MAX_PENDING
    _wait_at_rest()


# -- faults -------------------------------------------------------------------------------
def _inject(fault: str, pids: dict) -> None:
    if fault == "kill_engine_replica":
        os.kill(pids["replica"], signal.SIGKILL)
    elif fault == "kill_engine_process":
        os.kill(pids["engine"], signal.SIGKILL)
    elif fault == "kill_tp_worker":
        os.kill(pids["tp_workers"][0], signal.SIGKILL)
    else:
        call_deployment(APP, "EngineDeployment", "fail_next_step")


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    with open(f"/proc/{pid}/stat") as f:  # a zombie is gone too (its parent has not reaped it yet)
        return f.read().rsplit(")", 1)[1].split()[0] == "Z"


@pytest.mark.parametrize("fault", ["kill_engine_replica", "kill_engine_process", "kill_tp_worker", "step_error"])
def test_fault_mid_stream_ends_every_request_and_serve_replaces_the_replica(base_url, fault):
    _wait_serving(base_url)
    pids = call_deployment(APP, "EngineDeployment", "pids")
    assert len(pids["tp_workers"]) == 1 and pids["engine"] != pids["replica"]  # the step loop's own process

    async def run():
        async with httpx.AsyncClient(base_url=base_url, timeout=120) as c:
            started = [asyncio.Event() for _ in range(2)]
            streams = [asyncio.create_task(_stream(c, LONG, e)) for e in started]
            plain = [asyncio.create_task(c.post("/v1/completions", json=LONG)) for _ in range(2)]
            await asyncio.wait_for(asyncio.gather(*(e.wait() for e in started)), 60)
            await asyncio.to_thread(_inject, fault, pids)
            t0 = time.monotonic()
            done = await asyncio.wait_for(asyncio.gather(*streams, *plain), 30)
            return done, time.monotonic() - t0
    (stream_a, stream_b, plain_a, plain_b), elapsed = asyncio.run(run())
    assert elapsed < 10, f"in-flight requests took {elapsed:.1f}s to end"
    for status, events in (stream_a, stream_b):
        assert status == 200 and events[-1] == "[DONE]"
        assert "error" in json.loads(events[-2]), events[-3:]
    for r in (plain_a, plain_b):
        assert r.status_code >= 500 and r.json()["error"]["message"], r.text
    assert _wait_serving(base_url) < 90
    new = call_deployment(APP, "EngineDeployment", "pids")
    assert new["replica"] != pids["replica"]
    deadline = time.monotonic() + 15
    while not all(_gone(p) for p in [pids["replica"], pids["engine"], *pids["tp_workers"]]):
        assert time.monotonic() < deadline, "the old replica, its engine process or its TP worker is still running"
        time.sleep(0.2)
    _wait_at_rest()
