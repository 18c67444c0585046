"""The app behind Serve's Python ProxyActor (high_throughput=False), the mode without HAProxy.

What differs from tests/test_serve.py (HAProxy): a non-streaming request whose client goes
away is aborted in the engine at once, because the proxy cancels the Ingress handler.

A cluster of its own (not the suite's shared one): the proxy mode is environment that Ray's
processes read when the cluster starts (serve_app/local.py, HIGH_THROUGHPUT_ENV).
"""
import time

import httpx
import pytest

from serve_app.local import local_server
from tests.test_serve import seconds_per_token

pytestmark = pytest.mark.timeout(600)

ENGINE = dict(device="cpu", dtype="float32", max_model_len=2048, num_kv_blocks=512, max_num_seqs=16, seed=0)
LONG = {"model": "m", "prompt": "Hello there", "max_tokens": 1900, "ignore_eos": True, "temperature": 0}


def _finished(url: str) -> dict[str, float]:
    """Engine requests finished so far, by finished_reason, over the engine replicas (GET /metrics)."""
    out: dict[str, float] = {}
    for line in httpx.get(url + "/metrics").text.splitlines():
        if line.startswith("ray_rayllm_request_success_total{"):
            reason = line.split('finished_reason="')[1].split('"')[0]
            out[reason] = out.get(reason, 0.0) + float(line.rpartition(" ")[2])
    return out


def _wait_finished(url: str, done, within_s: float = 10.0) -> dict[str, float]:
    """/metrics is Ray's export, published every second: poll until `done(finished)`."""
    start = time.monotonic()
    while not done(finished := _finished(url)):
        assert time.monotonic() - start < within_s, f"finished requests {finished} after {within_s}s"
        time.sleep(0.2)
    return finished


def test_disconnected_non_streaming_request_is_aborted_at_once(own_ray_cluster, tiny_llama):
    with local_server(dict(model=tiny_llama, served_model_name="m", **ENGINE), num_cpus=2,
                      high_throughput=False) as url:
        r = httpx.post(url + "/v1/completions", json={**LONG, "max_tokens": 4})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4
        # The client leaves after twice a 1-token answer's latency (the request has reached the
        # engine by then), while the long answer needs at least 4 times that: both measured here.
        start = time.monotonic()
        httpx.post(url + "/v1/completions", json={**LONG, "max_tokens": 1}).raise_for_status()
        timeout_s = 2 * (time.monotonic() - start)
        assert LONG["max_tokens"] * seconds_per_token(url, LONG) > 4 * timeout_s, "too fast for LONG's budget"
        ran_out = _wait_finished(url, lambda f: f.get("length", 0.0) >= 5)["length"]  # the requests so far
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(url + "/v1/completions", json=LONG, timeout=timeout_s)
        # Aborted (finished_reason "abort"), not run out to its max_tokens ("length").
        _wait_finished(url, lambda f: f.get("abort", 0.0) >= 1)
        assert _finished(url).get("length") == ran_out
        assert 'status="499"' in httpx.get(url + "/metrics").text
