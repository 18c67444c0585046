"""Application args, deployment options and deploy/config.yaml (no Ray cluster)."""
from pathlib import Path

import os
import pytest
import yaml
from pydantic import ValidationError
from ray.serve.schema import ServeDeploySchema

from serve_app.app import (BATCH_AFFINITY_ROUTER, PREFIX_AFFINITY_ROUTER, build_app, colocated_options,
                           deployment_names, engine_options, ingress_options, router_options)
from serve_app.args import parse_app_args
from serve_app.guard.policy import GuardrailPolicy
from serve_app.replica import placement
from serve_app.replica.placement import engine_placement

CONFIG = Path(__file__).resolve().parents[1] / "deploy" / "config.yaml"


@pytest.mark.parametrize("args,named", [
    ({"model": "m", "max_batch_size": 0}, "max_batch_size"),
    ({"model": "m", "batch_wait_timeout_s": -1}, "batch_wait_timeout_s"),
    ({"model": "m", "device": "tpu"}, "device"),
    ({"model": "m", "dtype": "int3"}, "dtype"),
    ({"model": "m", "tensor_parallel_size": 0}, "tensor_parallel_size"),
    ({"model": "m", "min_replicas": 3, "max_replicas": 2}, "min_replicas"),
    ({"model": "m", "block_size": 12}, "block_size"),
    ({"model": "m", "kv_cache_dtype": "fp8_e5m2"}, "kv_cache_dtype='fp8_e5m2'"),
    ({"model": "m", "metrics_prefix": "bad-name"}, "metrics_prefix"),
    ({"model": "m", "max_num_seqs": "many"}, "max_num_seqs"),
    ({"model": "m", "no_such_arg": 1}, "no_such_arg"),
    ({"model": "m", "guardrails": {"redact_patterns": ["(x"]}}, r"guardrails: redact_patterns\[0\]='\(x' is not"),
    ({"model": "m", "guardrails": {"max_retries": -1}}, "guardrails: max_retries=-1"),
    ({"model": "m", "guardrails": {"max_retry": 1}}, "guardrails: unknown guardrail setting"),
    ({}, "model"),
    ({"model": "m", "lora_modules": ["sql"]}, "lora_modules entry 'sql' is invalid: expected name=path"),
    ({"model": "m", "lora_modules": {"m": "/a/m"}}, "lora_modules: adapter 'm' has the base model's name"),
    ({"model": "m", "lora_modules": "sql=/a", "enable_lora": "false"}, "enable_lora=False contradicts"),
    ({"model": "m", "allow_runtime_lora_updating": True}, "needs lora_adapter_dir"),
    ({"model": "m", "allow_runtime_lora_updating": True, "lora_adapter_dir": "/a", "ingress_replicas": 2},
     "single Ingress replica"),
    ({"model": "m", "allow_runtime_lora_updating": True, "lora_adapter_dir": "/a", "colocate_ingress": True,
      "max_replicas": 2}, "single Ingress replica"),
])
def test_bad_args_fail_naming_them(args, named):
    with pytest.raises(ValueError, match=named):
        parse_app_args(args)


def test_cli_strings_are_coerced():  # `serve run serve_app.app:build_app max_batch_size=4 ...`
    a = parse_app_args({"model": "m", "max_batch_size": "4", "batch_wait_timeout_s": "0.01",
                        "enable_prefix_caching": "false", "api_key": "k"})
    assert (a.max_batch_size, a.batch_wait_timeout_s, a.enable_prefix_caching, a.api_key) == (4, 0.01, False, "k")
    assert a.model_name == "m"


def test_lora_modules_imply_enable_lora_and_keep_their_order():  # `serve run ... lora_modules="a=/x b=/y"`
    a = parse_app_args({"model": "m", "lora_modules": "sql=/a/sql chat=/a/chat", "max_loras": "2"})
    assert list(a.lora_modules.items()) == [("sql", "/a/sql"), ("chat", "/a/chat")]
    cfg = a.engine_config("cpu")
    assert (cfg.enable_lora, cfg.max_loras) == (True, 2)
    assert not parse_app_args({"model": "m"}).engine_config("cpu").enable_lora


def test_lora_modules_are_checked_at_build_naming_the_adapter(tiny_llama, tmp_path, monkeypatch):
    from serve_app.args import resolve_app_args
    from tests.test_serve_lora_adapters import write_adapter_files

    write_adapter_files(tmp_path / "no-config", None)
    write_adapter_files(tmp_path / "rank-64", {"r": 64, "target_modules": ["q_proj"]})
    for path, message in (("missing", "is not a directory"), ("no-config", "adapter_config.json cannot be read"),
                          ("rank-64", "r=64 exceeds max_lora_rank=16")):
        with pytest.raises(ValueError) as info:
            resolve_app_args({"model": tiny_llama, "lora_modules": [f"sql={tmp_path / path}"]})
        assert "lora_modules: adapter 'sql'" in str(info.value) and message in str(info.value), path
    with pytest.raises(ValueError, match="lora_adapter_dir='/nope' is not a directory"):
        resolve_app_args({"model": tiny_llama, "allow_runtime_lora_updating": True, "lora_adapter_dir": "/nope"})
    monkeypatch.chdir(tmp_path)  # a relative adapter path is the builder's, as the model's is
    write_adapter_files(tmp_path / "ok", {"r": 8, "target_modules": ["q_proj"]})
    with pytest.raises(ValueError, match="holds no lora_A / lora_B tensors"):  # checked by the engine's rules
        resolve_app_args({"model": tiny_llama, "lora_modules": "sql=ok"})
    a = resolve_app_args({"model": tiny_llama, "lora_modules": "sql=ok", "check_model_at_build": False})
    assert a.lora_modules == {"sql": str(tmp_path / "ok")}


@pytest.mark.parametrize("value", ["auto", "fp8", "fp8_e4m3"])
def test_kv_cache_dtype_reaches_the_engine_config(value):  # `serve run ... kv_cache_dtype=fp8`
    assert parse_app_args({"model": "m", "kv_cache_dtype": value}).engine_config("cpu").kv_cache_dtype == value


def _gpu_nodes(monkeypatch, gpus_per_node: list[float], started_here: bool = True) -> None:
    """A connected Ray cluster of these nodes, started by this process or not."""
    import ray

    monkeypatch.setattr(ray, "is_initialized", lambda: True)
    monkeypatch.setattr(ray, "nodes", lambda: [{"Alive": True, "Resources": {"CPU": 8.0, "GPU": g} if g else
                                                {"CPU": 8.0}} for g in gpus_per_node])
    monkeypatch.setattr(placement, "_started_ray_here", lambda: started_here)


def test_cuda_on_a_machine_without_gpus_fails_at_build(monkeypatch, tiny_llama):
    import ray
    import torch

    monkeypatch.setattr(ray, "is_initialized", lambda: False)  # `serve run`: Ray starts after build_app, here
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    with pytest.raises(ValueError, match=r"^device='cuda' needs 1 GPU\(s\) on one node \(tensor_parallel_size=1\), "
                                         r"but this machine has no GPU: serve with device='cpu'"):
        build_app({"model": tiny_llama, "device": "cuda"})
    monkeypatch.setenv("RAY_ADDRESS", "ray://elsewhere:10001")  # a cluster elsewhere: not ours to judge
    placement.check_gpus("cuda", 1)


def test_cuda_needs_the_tp_gpus_on_one_node_of_a_cluster_started_here(monkeypatch, tiny_llama):
    _gpu_nodes(monkeypatch, [0.0])
    with pytest.raises(ValueError, match=r"needs 1 GPU\(s\) .*, but the Ray cluster has no GPU"):
        build_app({"model": tiny_llama, "device": "cuda"})
    _gpu_nodes(monkeypatch, [1.0, 1.0])  # two GPUs, but never two on one node: TP=2 would wait forever
    placement.check_gpus("cuda", 1)
    with pytest.raises(ValueError, match=r"tensor_parallel_size=2\), but no node of the Ray cluster has more than 1:"):
        build_app({"model": tiny_llama, "device": "cuda", "tensor_parallel_size": 2})
    placement.check_gpus("cpu", 4)  # CPU replicas ask for no GPU


def test_a_cluster_of_other_machines_may_still_get_a_gpu_node(monkeypatch, caplog):
    """KubeRay: the GPU pods may still be scheduled, or an autoscaler start them: a warning, no error."""
    _gpu_nodes(monkeypatch, [0.0], started_here=False)
    with caplog.at_level("WARNING", logger=placement.logger.name):
        placement.check_gpus("cuda", 2)
    assert "wait until such a node joins" in caplog.text


def test_engine_placement_cuda_tp():
    p = engine_placement("cuda", 4, 1.0)
    assert p["placement_group_strategy"] == "STRICT_PACK"
    assert len(p["placement_group_bundles"]) == 4
    assert all(b["GPU"] == 1.0 for b in p["placement_group_bundles"])
    assert p["ray_actor_options"]["num_gpus"] == 1.0  # the replica itself lives in bundle 0
    cpu = engine_placement("cpu", 1, 2.0)
    assert cpu["placement_group_bundles"] == [{"CPU": 2.0}] and "num_gpus" not in cpu["ray_actor_options"]


def test_deployment_options():
    a = parse_app_args({"model": "m", "min_replicas": 1, "max_replicas": 3, "target_ongoing_requests": 8,
                        "max_batch_size": 600})
    eng = engine_options(a, "cpu")
    assert eng["autoscaling_config"] == {"min_replicas": 1, "max_replicas": 3, "target_ongoing_requests": 8.0}
    ing = ingress_options(a)
    assert ing["max_ongoing_requests"] >= 600  # the batch can actually fill
    assert ing["user_config"]["max_batch_size"] == 600


def test_every_deployment_stops_as_the_args_say():
    a = parse_app_args({"model": "m", "graceful_shutdown_timeout_s": 7, "graceful_shutdown_wait_loop_s": 0.25})
    want = {"graceful_shutdown_timeout_s": 7.0, "graceful_shutdown_wait_loop_s": 0.25}
    for opts in (engine_options(a, "cpu"), ingress_options(a), colocated_options(a, "cpu")):
        assert {k: opts[k] for k in want} == want
    app = build_app({"model": "m", "device": "cpu", "check_model_at_build": False, "graceful_shutdown_wait_loop_s": 0.25})
    guardrails = app._bound_deployment.init_args[1]  # Ingress.bind(engine, guardrails, args)
    assert guardrails._bound_deployment._deployment_config.graceful_shutdown_wait_loop_s == 0.25
    with pytest.raises(ValueError, match="graceful_shutdown_wait_loop_s"):
        parse_app_args({"model": "m", "graceful_shutdown_wait_loop_s": 0})


def test_colocated_ingress_takes_the_engines_options_and_both_live_configs():
    a = parse_app_args({"model": "m", "colocate_ingress": True, "max_replicas": 3, "max_num_seqs": 600,
                        "max_batch_size": 4, "stream_interval_ms": 5})
    opts = colocated_options(a, "cpu")
    assert opts["autoscaling_config"] == engine_options(a, "cpu")["autoscaling_config"]  # scales as the engine did
    assert opts["placement_group_bundles"] == [{"CPU": 1.0}]  # and holds its resources
    assert opts["max_ongoing_requests"] >= 1200 and "request_router_config" not in opts  # no engine handle to route
    assert opts["user_config"] == {**a.batching().model_dump(), **a.streaming().model_dump()}
    assert opts["user_config"]["stream_interval_ms"] == 5.0 and opts["user_config"]["max_batch_size"] == 4
    with pytest.raises(ValueError, match="ingress_replicas=2 cannot be set with colocate_ingress"):
        parse_app_args({"model": "m", "colocate_ingress": True, "ingress_replicas": 2})


def test_autoscaling_target_follows_max_num_seqs_unless_set():
    derived = engine_options(parse_app_args({"model": "m", "max_num_seqs": 24, "max_replicas": 2}), "cpu")
    assert derived["autoscaling_config"] == {"min_replicas": 1, "max_replicas": 2, "target_ongoing_requests": 24.0}
    timed = parse_app_args({"model": "m", "max_replicas": 2, "upscale_delay_s": "1", "downscale_delay_s": 5,
                            "look_back_period_s": 2, "metrics_interval_s": 0.5})
    assert timed.autoscaling_config() == {"min_replicas": 1, "max_replicas": 2, "target_ongoing_requests": 256.0,
                                             "upscale_delay_s": 1.0, "downscale_delay_s": 5.0,
                                             "look_back_period_s": 2.0, "metrics_interval_s": 0.5}
    with pytest.raises(ValueError, match="upscale_delay_s"):
        parse_app_args({"model": "m", "upscale_delay_s": -1})


def test_build_app_binds_the_graph(tiny_llama):
    app = build_app({"model": tiny_llama, "device": "cpu"})
    assert type(app).__name__ == "Application"
    assert type(build_app({"model": "m", "device": "cpu", "check_model_at_build": False})).__name__ == "Application"
    one = build_app({"model": tiny_llama, "device": "cpu", "colocate_ingress": True})
    assert one._bound_deployment.name == "Ingress" and one._bound_deployment.init_args[:2] == (None, None)


def _bound_names(app) -> set[str]:
    """The deployments an Application binds, its own and those of the handles it is given."""
    dep = app._bound_deployment
    return {dep.name}.union(*(_bound_names(a) for a in dep.init_args if type(a) is type(app)))


def test_deployment_names_are_what_build_app_binds(tiny_llama):
    """What a Serve config may name (tests/deploy_checks.py holds deploy/ to it): one deployment
    with colocate_ingress, three without."""
    for colocate, names in ((False, {"Ingress", "Guardrails", "EngineDeployment"}), (True, {"Ingress"})):
        args = {"model": tiny_llama, "device": "cpu", "colocate_ingress": colocate}
        assert _bound_names(build_app(args)) == deployment_names(parse_app_args(args)) == names


def test_missing_model_fails_at_build_naming_it(tmp_path):
    with pytest.raises(ValueError, match="model="):
        build_app({"model": str(tmp_path / "nope"), "device": "cpu"})


def test_deploy_config_is_a_valid_serve_config():
    config = yaml.safe_load(CONFIG.read_text())
    schema = ServeDeploySchema.model_validate(config)
    (app,) = schema.applications
    assert app.import_path == "serve_app.app:build_app" and app.route_prefix == "/"
    assert schema.http_options.host == "127.0.0.1" and schema.http_options.port == 8000
    from engine.tools.demo_model import MODEL_NAME
    # the demo model where `make serve` fetches it (engine.tools.demo_model), under its own name
    assert app.args["model"] == f"models/{MODEL_NAME}" and app.args["served_model_name"] == MODEL_NAME
    parse_app_args(app.args)  # the args themselves are valid
    assert GuardrailPolicy.from_args(app.args["guardrails"]) == GuardrailPolicy()  # the defaults, spelled out
    # The CPU demo: the Ingress runs the engine, so its entry is the only one, and its user_config
    # holds both the batching and the streaming knobs (what Ingress.reconfigure splits).
    assert app.args["colocate_ingress"] is True
    assert {d.name for d in app.deployments} == deployment_names(parse_app_args(app.args)) == {"Ingress"}
    (ingress,) = app.deployments
    from serve_app.args import BatchingConfig, StreamingConfig
    streaming = {k: v for k, v in ingress.user_config.items() if k in StreamingConfig.model_fields}
    BatchingConfig.model_validate({k: v for k, v in ingress.user_config.items() if k not in streaming})
    assert StreamingConfig.model_validate(streaming) == parse_app_args(app.args).streaming()  # args and live agree
    assert ingress.health_check_period_s == 10 and ingress.graceful_shutdown_timeout_s == 20  # the engine's
    assert ingress.graceful_shutdown_wait_loop_s == parse_app_args(app.args).graceful_shutdown_wait_loop_s


def test_cpu_threads_split_over_tp_ranks(monkeypatch):
    import torch

    from serve_app.replica.placement import use_cpu_threads

    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # what Ray exports into a 1-CPU actor
    before = torch.get_num_threads()
    try:
        assert use_cpu_threads(4, tensor_parallel_size=2) == 2
        assert torch.get_num_threads() == 2 and os.environ["OMP_NUM_THREADS"] == "2"  # spawned ranks read it
        assert use_cpu_threads(None, tensor_parallel_size=1) == len(os.sched_getaffinity(0))
        assert use_cpu_threads(1, tensor_parallel_size=4) == 1
    finally:
        torch.set_num_threads(before)


# One non-default, valid value per EngineConfig field: each must reach the engine from the app's args.
ENGINE_VALUES = {
    "model": "some/model", "tokenizer": "some/tokenizer", "dtype": "float32", "device": "cpu",
    "tensor_parallel_size": 2, "max_num_seqs": 8, "max_num_batched_tokens": 512, "max_model_len": 1024,
    "block_size": 32, "num_kv_blocks": 64, "gpu_memory_utilization": 0.5, "cpu_kv_cache_gb": 1.5,
    "enable_prefix_caching": False, "enforce_eager": True, "attention_backend": "torch", "seed": 7,
    "async_scheduling": False, "distributed_init_method": "tcp://127.0.0.1:29555", "worker_start_timeout_s": 30.0,
    "reasoning_parser": "qwen3", "quantization": "int8", "kv_cache_dtype": "fp8",
    "enable_lora": True, "max_loras": 4, "max_lora_rank": 32, "max_cpu_loras": 8,
    "speculative_config": {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4,
                           "prompt_lookup_min": 2},
    "scheduling_policy": "priority",
    "kv_offload_gb": 0.0,  # off (the default None picks by device); > 0 needs prefix caching, off here
}


def test_every_engine_field_is_an_app_arg_given_as_a_string():
    """The engine's knobs are declared once (EngineConfig); the app takes each by name, from strings."""
    import dataclasses

    from engine.config import EngineConfig

    import json

    from engine.config import SpeculativeConfig

    fields = dataclasses.fields(EngineConfig)
    assert {f.name for f in fields} == set(ENGINE_VALUES), "give the new EngineConfig field a value here"
    # As `serve run k=v` sends them: text, a dict as JSON.
    a = parse_app_args({name: json.dumps(value) if isinstance(value, dict) else str(value)
                        for name, value in ENGINE_VALUES.items()})
    config = a.engine_config(a.device)
    for f in fields:
        expected = ENGINE_VALUES[f.name]
        if f.name == "speculative_config":  # the engine keeps the dict as its dataclass
            expected = SpeculativeConfig(**expected)
        assert getattr(config, f.name) == expected, f.name
        assert getattr(config, f.name) != f.default, f"{f.name}: pick a non-default value"


@pytest.mark.parametrize("name,value", [
    ("block_size", "12"), ("gpu_memory_utilization", "1.5"), ("cpu_kv_cache_gb", "0"), ("max_model_len", "0"),
    ("max_num_batched_tokens", "-1"), ("num_kv_blocks", "0"), ("attention_backend", "cudnn"),
    ("worker_start_timeout_s", "0"), ("enforce_eager", "sometimes"), ("seed", "1.5"),
    ("quantization", "int3"), ("speculative_config", '{"method": "medusa", "num_speculative_tokens": 2}'),
    ("speculative_config", "{not json"),
])
def test_bad_engine_value_fails_naming_the_field(name, value):
    with pytest.raises(ValueError, match=f"^invalid application args: {name}[=.]"):
        parse_app_args({"model": "m", name: value})


def test_engine_relations_are_the_engines_checks():
    with pytest.raises(ValueError, match="invalid application args: async_scheduling=True is not supported"):
        parse_app_args({"model": "m", "tensor_parallel_size": "2", "async_scheduling": "true"})


def test_live_knobs_start_from_the_args():
    """max_batch_size & co. are BatchingConfig's fields, stream_interval_ms StreamingConfig's: same bounds."""
    from serve_app.args import BatchingConfig, StreamingConfig

    a = parse_app_args({"model": "m", "max_batch_size": "3", "batch_wait_timeout_s": "0.5",
                        "max_pending_requests": "9", "stream_interval_ms": "5"})
    assert a.batching() == BatchingConfig(max_batch_size=3, batch_wait_timeout_s=0.5, max_pending_requests=9)
    assert a.streaming() == StreamingConfig(stream_interval_ms=5.0)
    assert parse_app_args({"model": "m"}).batching() == BatchingConfig()
    assert parse_app_args({"model": "m"}).streaming() == StreamingConfig()
    for name, value in [("batch_wait_timeout_s", 11), ("max_pending_requests", -1), ("stream_interval_ms", 1001)]:
        with pytest.raises(ValueError, match=f"{name}="):
            parse_app_args({"model": "m", name: value})


def test_relative_model_path_is_made_absolute_where_the_app_is_built(tiny_llama, monkeypatch):
    from serve_app.args import resolve_app_args

    parent, name = os.path.split(tiny_llama)
    monkeypatch.chdir(parent)  # as `serve run` started beside the model directory
    a = resolve_app_args({"model": name})
    assert a.model == tiny_llama and a.model_name == name  # a replica's cwd no longer matters
    with pytest.raises(ValueError, match="model='nope'"):
        resolve_app_args({"model": "nope"})
    assert resolve_app_args({"model": "nope", "check_model_at_build": False}).model == "nope"


def test_stream_interval_grows_with_the_streams_beyond_the_message_budget():
    from serve_app.args import DEFAULT_STREAM_MESSAGES_PER_S, MAX_STREAM_INTERVAL_MS, StreamingConfig

    cfg = StreamingConfig(stream_interval_ms=20, max_stream_messages_per_s=200)
    assert cfg.interval_s(1, "cpu") == 0.02              # light load: the floor, per step
    assert cfg.interval_s(4, "cpu") == 0.02              # 4 streams / 200 per s = 20 ms: still the floor
    assert cfg.interval_s(64, "cpu") == pytest.approx(0.32)  # 64 streams share 200 items a second
    assert cfg.interval_s(10_000, "cpu") == MAX_STREAM_INTERVAL_MS / 1000  # capped: a stream never stalls
    assert StreamingConfig(stream_interval_ms=20, max_stream_messages_per_s=0).interval_s(64, "cpu") == 0.02
    default = StreamingConfig(stream_interval_ms=0)  # the budget by device when not set
    for device, budget in DEFAULT_STREAM_MESSAGES_PER_S.items():
        assert default.interval_s(100, device) == pytest.approx(100 / budget)
    with pytest.raises(ValidationError):
        StreamingConfig(max_stream_messages_per_s=-1)


def test_the_app_puts_the_prefix_router_in_front_of_the_engine_only():
    with pytest.raises(ValueError, match="prefix_match_threshold"):
        parse_app_args({"model": "m", "prefix_match_threshold": 2})
    with pytest.raises(ValueError, match="needs enable_prefix_caching"):
        parse_app_args({"model": "m", "request_router": "prefix_affinity", "enable_prefix_caching": False})
    with pytest.raises(ValueError, match="cannot be set with colocate_ingress"):
        parse_app_args({"model": "m", "request_router": "prefix_affinity", "colocate_ingress": True})
    a = parse_app_args({"model": "m", "request_router": "prefix_affinity", "block_size": 32, "num_kv_blocks": 900,
                        "prefix_match_threshold": 0.3, "prefix_imbalance_bound": 8})
    engine = router_options(a)["request_router_config"]
    assert engine["request_router_class"] == PREFIX_AFFINITY_ROUTER
    assert engine["request_router_kwargs"] == {"block_size": 32, "prefix_match_threshold": 0.3,
                                               "prefix_imbalance_bound": 8, "max_tracked_blocks": 900,
                                               "metrics_prefix": "rayllm", "model_name": "m"}
    assert router_options(a, engine=False)["request_router_config"]["request_router_class"] == BATCH_AFFINITY_ROUTER
    assert router_options(parse_app_args({"model": "m", "request_router": "power_of_two"})) == {}
