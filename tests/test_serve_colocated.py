"""colocate_ingress: the app as one deployment, each replica an Ingress that runs its own engine.

The same app on a real local Ray Serve as tests/test_serve.py, with `colocate_ingress=true`:
the end-to-end checks of generation, streaming, JSON guardrails and cancellation that do not
name a deployment run again here (imported below, against this module's `base_url`), then
what is particular to this shape.
"""
import os

import pytest
from ray import serve

from loadtest.proc_cpu import cmdline, parent_pid, pids, role_of
from serve_app.local import call_deployment, deployed_app, engine_deployment
from tests.test_serve import (API_KEY, DEFAULT_BATCHING, ENGINE, MAX_BODY, MODEL, PROMPTS, _app_metrics, _metric,
                              _wait_metric, client, http, reference)  # noqa: F401 - the fixtures are tests/test_serve.py's
from tests.test_serve import (test_batch_of_prompts_and_token_id_prompts,  # noqa: F401 - collected here too
                              test_chat_and_chat_streaming, test_concurrent_requests_match_sequential,
                              test_disconnected_stream_frees_the_engine, test_greedy_completions_equal_offline_engine,
                              test_invalid_requests_are_400_naming_the_field,
                              test_json_response_format_goes_through_guardrails, test_n_choices_with_seed,
                              test_stop_string, test_streaming_equals_non_streaming)

pytestmark = pytest.mark.timeout(900)


@pytest.fixture(scope="module")
def app_name():
    return "test_serve_colocated"


@pytest.fixture(scope="module")
def base_url(ray_cluster, app_name, tiny_llama, reference):
    args = dict(model=tiny_llama, served_model_name=MODEL, api_key=API_KEY, max_request_body_bytes=MAX_BODY,
                colocate_ingress=True, **ENGINE, **{k: v for k, v in DEFAULT_BATCHING.items() if v is not None})
    with deployed_app(ray_cluster, args, app_name) as url:
        yield url


def test_one_deployment_runs_the_engine_on_every_core(base_url, app_name):
    deployments = serve.status().applications[app_name].deployments
    assert set(deployments) == {"Ingress"}  # no EngineDeployment, no Guardrails: no hop between them
    assert engine_deployment(app_name) == "Ingress"  # where loadtest asks for the engine's stats
    stats = call_deployment(app_name, "Ingress", "get_stats")
    assert stats["cpu_threads"] == len(os.sched_getaffinity(0))  # not Ray's OMP_NUM_THREADS=1
    # This app's processes (another cluster may run beside this one): the step loop runs in a
    # child of the Ingress, and no engine replica exists.
    replicas = {pid: cmdline(pid) for pid in pids() if f"ServeReplica:{app_name}:" in cmdline(pid)}
    assert replicas and all(role_of(c) == "ingress" for c in replicas.values()), replicas
    assert any(parent_pid(pid) in replicas and role_of(cmdline(pid)) is None for pid in pids())


def test_user_config_reaches_both_the_batching_and_the_engine(base_url, app_name):
    reconfigure = lambda config: call_deployment(app_name, "Ingress", "reconfigure", config)  # noqa: E731
    try:
        reconfigure({**DEFAULT_BATCHING, "stream_interval_ms": 0.0, "max_stream_messages_per_s": 0.0})
        assert call_deployment(app_name, "Ingress", "get_stats")["streaming"] == {
            "stream_interval_ms": 0.0, "max_stream_messages_per_s": 0.0}
        with pytest.raises(Exception, match="stream_interval_ms"):
            reconfigure({**DEFAULT_BATCHING, "stream_interval_ms": -1})
        with pytest.raises(Exception, match="max_batch_size"):
            reconfigure({**DEFAULT_BATCHING, "max_batch_size": 0})
    finally:
        reconfigure(DEFAULT_BATCHING)


def test_health_and_the_engines_metrics_from_the_ingress(client, http):
    assert http.get("/health").status_code == 200
    client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=4)
    _wait_metric(http, "ray_rayllm_generation_tokens_total", lambda v: v > 0)
    text = "\n".join(_app_metrics(http))  # this app's series: the shared cluster ran others
    assert 'deployment="Ingress"' in text and 'deployment="EngineDeployment"' not in text
    assert _metric(http, "ray_rayllm_requests_total", status="200") > 0
