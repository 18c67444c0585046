"""Stopping the app while requests run: they end with an OpenAI error, well before Serve's kill.

Both shapes on the suite's shared Ray cluster (tests/conftest.py), HAProxy in front as in
`make serve`. A generation that cannot end by itself (ignore_eos, tens of thousands of tokens)
is in flight, streaming and not, when the app is deleted: the stream must end with an SSE
error event (SHUTDOWN_MESSAGE) and `data: [DONE]`, the other request with a 503 OpenAI error,
both before graceful_shutdown_timeout_s has passed (when Serve kills the replica and a stream
would be cut without a word). serve_app/replica/draining.py's timing is tested here without Ray.
"""
import asyncio
import json
import threading
import time
from pathlib import Path

import httpx
import pytest

from serve_app.local import call_deployment, delete_app, delete_apps, deploy_apps, engine_deployment
from serve_app.replica.draining import SHUTDOWN_RESERVE_S, DrainPolicy, abort_when_stopping
from serve_app.replica.engine_deployment import SHUTDOWN_MESSAGE

pytestmark = pytest.mark.timeout(600)

GRACE_S = 8.0  # the deployments' graceful_shutdown_timeout_s: the aborts come after ~3 s of it
MAX_MODEL_LEN = 65536
MAX_TOKENS = 60000  # minutes of tokens on any CPU: the requests cannot finish during the stop
BODY = {"model": "tiny", "prompt": "Once upon a time", "max_tokens": MAX_TOKENS, "ignore_eos": True,
        "temperature": 0.0}


@pytest.fixture(scope="module")
def long_model(tmp_path_factory):
    from engine.tools.tiny_model import make_tiny_model

    return str(make_tiny_model(tmp_path_factory.mktemp("tiny-long"), arch="llama", preset="tiny", seed=0,
                               max_position_embeddings=MAX_MODEL_LEN))


def _args(model: str, colocate: bool) -> dict:
    return dict(model=model, served_model_name="tiny", device="cpu", dtype="float32", max_model_len=MAX_MODEL_LEN,
                num_kv_blocks=2 * MAX_MODEL_LEN // 16 + 64, max_num_seqs=4, graceful_shutdown_timeout_s=GRACE_S,
                colocate_ingress=colocate)


def _stream_until_first_token(client: httpx.Client, events: list, ready: threading.Event) -> None:
    with client.stream("POST", "/v1/completions", json={**BODY, "stream": True}) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: "):
                events.append(line[len("data: "):])
                ready.set()


def _wait_running(app: str, num_requests: int, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while call_deployment(app, engine_deployment(app), "get_stats").get("num_requests_running", 0) < num_requests:
        assert time.monotonic() < deadline, f"{num_requests} requests never ran"
        time.sleep(0.1)


def _app_name(colocate: bool) -> str:
    return "test_serve_shutdown_" + ("colocated" if colocate else "apart")


@pytest.fixture(scope="module")
def both_shapes(ray_cluster, long_model):
    """Both shapes' apps, deployed side by side (their replicas start at once); each test deletes its own."""
    names = {colocate: _app_name(colocate) for colocate in (False, True)}
    deploy_apps({name: (_args(long_model, colocate), f"/{name}") for colocate, name in names.items()})
    yield names
    import ray.serve

    delete_apps([name for name in names.values() if name in ray.serve.status().applications])


@pytest.mark.parametrize("colocate", [False, True], ids=["three_deployments", "colocated"])
def test_deleting_the_app_ends_running_requests_with_an_error(ray_cluster, both_shapes, colocate):
    name = both_shapes[colocate]
    deleted = threading.Event()
    try:
        with httpx.Client(base_url=f"{ray_cluster}/{name}", timeout=120) as client:
            events: list[str] = []
            streaming = threading.Event()
            reader = threading.Thread(target=_stream_until_first_token, args=(client, events, streaming))
            reader.start()
            plain: dict = {}
            blocking = threading.Thread(target=lambda: plain.update(r=client.post("/v1/completions", json=BODY)))
            blocking.start()
            assert streaming.wait(60), "the stream sent nothing"
            _wait_running(name, 2)  # the non-streaming request is in the engine too

            start = time.monotonic()
            deleter = threading.Thread(target=lambda: (delete_app(name), deleted.set()))
            deleter.start()
            reader.join(GRACE_S + 30)
            blocking.join(GRACE_S + 30)
            ended_s = time.monotonic() - start
            deleter.join(GRACE_S + 60)
    finally:
        if not deleted.is_set():
            delete_app(name)

    assert not reader.is_alive() and not blocking.is_alive()
    assert events[-1] == "[DONE]"
    error = json.loads(events[-2])["error"]
    assert error["message"] == SHUTDOWN_MESSAGE and error["code"] == "service_unavailable"
    assert all("error" not in json.loads(e) for e in events[:-2])  # tokens came before it
    r = plain["r"]
    assert r.status_code == 503 and r.json()["error"]["message"] == SHUTDOWN_MESSAGE
    # Ended by the replica's abort, not cut by Serve's kill at GRACE_S (which sends no error at all).
    assert ended_s < GRACE_S
    assert deleted.is_set()
    # The access log, in Serve's high-throughput mode, flushed before the replica went away.
    lines = _replica_log_lines(name, "Ingress", f" -- POST /{name}/v1/completions 503 prompt_tokens=")
    assert len(lines) == 2 and all("completion_tokens=" in line and "Once upon" not in line for line in lines)


def _replica_log_lines(app: str, deployment: str, needle: str) -> list[str]:
    from ray._private.worker import _global_node

    logs = Path(_global_node.get_session_dir_path()) / "logs" / "serve"
    return [line for path in logs.glob(f"replica_{app}_{deployment}_*.log")
            for line in path.read_text().splitlines() if needle in line]


# -- the timing, without Ray ----------------------------------------------------------------------

def test_policy_leaves_serve_a_wait_loop_and_the_reserve_before_its_kill():
    assert DrainPolicy(20.0, 2.0).abort_after_s == 20.0 - 2.0 - SHUTDOWN_RESERVE_S
    assert DrainPolicy(1.0, 2.0).abort_after_s == 0.0  # too little grace: abort at once


def test_requests_are_aborted_only_after_the_stop_and_the_grace():
    async def scenario():
        stopping = False
        aborted_at: list[float] = []

        async def abort_all():
            aborted_at.append(asyncio.get_running_loop().time())

        policy = DrainPolicy(graceful_shutdown_timeout_s=SHUTDOWN_RESERVE_S + 0.5 + 0.3,
                             graceful_shutdown_wait_loop_s=0.5)  # abort_after_s = 0.3
        task = asyncio.create_task(abort_when_stopping(lambda: stopping, policy, lambda: 1, abort_all))
        await asyncio.sleep(0.6)
        assert not aborted_at and not task.done()  # nothing happens while Serve is not stopping us
        stopping, stopped_at = True, asyncio.get_running_loop().time()
        await asyncio.wait_for(task, 10)
        assert aborted_at[0] - stopped_at >= policy.abort_after_s

    asyncio.run(scenario())
