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


def _finished(url: str) -> dict[str, float]:
    """Engine requests finished so far, by finished_reason, over the engine replicas (GET /metrics)."""
    out: dict[str, float] = {}
    for line in httpx.get(url + "/metrics").text.splitlines():
        if line.startswith("ray_rayllm_request_success_total{"):
            reason = line.split('finished_reason="')[1].split('"')[0]
            out[reason] = out.get(reason, 0.0) + float(line.rpartition(" ")[2])
    return out


def test_disconnected_non_streaming_request_is_aborted_at_once(tiny_llama):
    with local_server(dict(model=tiny_llama, served_model_name="m", **ENGINE), num_cpus=2,
                      high_throughput=False) as url:
        r = httpx.post(url + "/v1/completions", json={**LONG, "max_tokens": 4})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(url + "/v1/completions", json=LONG, timeout=1.5)
        start = time.monotonic()
        # Aborted (finished_reason "abort"), not run out to its 1900 tokens ("length"); /metrics is
        # Ray's export, published every second, so allow it a few seconds to show.
        while _finished(url).get("abort", 0.0) < 1:
            assert time.monotonic() - start < 10.0, f"the abandoned request was not aborted: {_finished(url)}"
            time.sleep(0.2)
        assert _finished(url).get("length") == 1  # only the 4-token request ran to its end
        assert 'status="499"' in httpx.get(url + "/metrics").text
