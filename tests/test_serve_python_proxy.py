"""The app behind Serve's Python ProxyActor (high_throughput=False), the mode without HAProxy.

What differs from tests/test_serve.py (HAProxy): a non-streaming request whose client goes
away is aborted in the engine at once, because the proxy cancels the Ingress handler.
"""
import time

import httpx
import pytest

from serve_app.local import local_server

pytestmark = pytest.mark.timeout(600)

ENGINE = dict(device="cpu", dtype="float32", max_model_len=2048, num_kv_blocks=512, max_num_seqs=16, seed=0)
LONG = {"model": "m", "prompt": "Hello there", "max_tokens": 1900, "ignore_eos": True, "temperature": 0}


def _engine_busy(url: str) -> float:
    text = httpx.get(url + "/metrics").text
    busy = 0.0
    for line in text.splitlines():
        if line.startswith(("rayllm_num_requests_running{", "rayllm_num_requests_waiting{",
                            "rayllm_kv_cache_usage_perc{")):
            busy += float(line.rpartition(" ")[2])
    return busy


def test_disconnected_non_streaming_request_is_aborted_at_once(tiny_llama):
    with local_server(dict(model=tiny_llama, served_model_name="m", **ENGINE), num_cpus=2,
                      high_throughput=False) as url:
        r = httpx.post(url + "/v1/completions", json={**LONG, "max_tokens": 4})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(url + "/v1/completions", json=LONG, timeout=1.5)
        start = time.monotonic()
        while _engine_busy(url) > 0:  # 1900 tokens would take far longer than this
            assert time.monotonic() - start < 3.0, "the engine still runs the abandoned request"
            time.sleep(0.1)
        assert 'status="499"' in httpx.get(url + "/metrics").text
