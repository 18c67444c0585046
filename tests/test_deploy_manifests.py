"""deploy/rayservice.yaml, checked offline (no cluster, no network).

Three layers (tests/deploy_checks.py), each able to fail (the negative tests below prove it):
1. the RayService against the KubeRay CRD's openAPIV3Schema (tests/fixtures/README.md), made
   strict as kubeconform's strict mode: an object that lists `properties` takes no other key;
2. `spec.serveConfigV2` against Ray Serve's ServeDeploySchema (of the Ray installed here), plus
   unknown keys, which Serve would silently drop, and the app's `args` through our own parser;
3. what no schema sees: the same application as deploy/config.yaml, GPUs per pod for
   tensor_parallel_size, the frontend pinned to the head, the model on a mounted volume, the
   image's Ray version.
"""
from __future__ import annotations

import copy
import re
import warnings

import pytest
import ray

from serve_app.app import EngineDeployment, Ingress
from tests.deploy_checks import (DOCKERFILE, RAYSERVICE, ROOT, SERVE_CONFIG, _app, _containers, _deployments,
                                 agreement_errors, consistency_errors, crd_errors, load_yaml, serve_config,
                                 serve_config_errors, with_serve_config)


@pytest.fixture(scope="module")
def manifest() -> dict:
    return load_yaml(RAYSERVICE.read_text())


# -- the manifest as it is --------------------------------------------------------------------
def test_rayservice_matches_the_kuberay_crd(manifest):
    assert manifest["apiVersion"] == "ray.io/v1" and manifest["kind"] == "RayService"
    assert crd_errors(manifest) == []


def test_serve_config_is_a_valid_serve_config_with_valid_args(manifest):
    assert serve_config_errors(manifest) == []


def test_same_application_as_deploy_config_yaml(manifest):
    local = _app(load_yaml(SERVE_CONFIG.read_text()))
    assert agreement_errors(_app(serve_config(manifest)), local) == []


def test_gpu_sizing_frontend_and_model_volume(manifest):
    assert consistency_errors(manifest) == []


def test_serve_port_and_service(manifest):
    config = serve_config(manifest)
    assert config["http_options"] == {**config["http_options"], "host": "0.0.0.0", "port": 8000}
    head = _containers(manifest)[0][2]
    assert {"name": "serve", "containerPort": 8000} in head["ports"]
    service = manifest["spec"]["serveService"]
    assert service["metadata"]["name"] == "rayllm-serve-svc"
    assert [(p["name"], p["port"]) for p in service["spec"]["ports"]] == [("serve", 8000)]


def test_image_and_ray_version_match_the_dockerfile(manifest):
    images = {c["image"] for _, _, c in _containers(manifest)}
    assert len(images) == 1, f"head and workers must run one image, got {images}"
    dockerfile = DOCKERFILE.read_text()
    ray_version = re.search(r"^ARG RAY_VERSION=(\S+)$", dockerfile, re.M).group(1)
    assert manifest["spec"]["rayClusterConfig"]["rayVersion"] == ray_version
    assert re.search(r"^FROM rayproject/ray:\$\{RAY_VERSION\}-py311-gpu$", dockerfile, re.M)
    # torch pinned (to the Makefile's version) and installed before our package.
    torch_version = re.search(r"^ARG TORCH_VERSION=(\S+)$", dockerfile, re.M).group(1)
    makefile_torch = re.search(r"^TORCH_VERSION \?= (\S+)$", (ROOT / "Makefile").read_text(), re.M).group(1)
    assert torch_version == makefile_torch
    assert dockerfile.index('pip install --no-cache-dir "torch==${TORCH_VERSION}"') < dockerfile.index('".[serve]"')
    if ray.__version__ != ray_version:  # layer 2 ran against this Ray's schema, not the image's
        warnings.warn(f"Ray {ray.__version__} installed here, {ray_version} in the image", stacklevel=1)


def test_serving_environment_is_the_same_everywhere(manifest):
    """The high-throughput mode and the controller's loop interval: local_server (tests,
    benchmarks), `make serve`, the image and the RayService's head all run Serve with them."""
    from serve_app.local import CONTROL_LOOP_ENV, HIGH_THROUGHPUT_ENV
    wanted = {**HIGH_THROUGHPUT_ENV, **CONTROL_LOOP_ENV}
    head_env = {e["name"]: e["value"] for e in _containers(manifest)[0][2]["env"]}
    assert {k: head_env.get(k) for k in wanted} == wanted
    settings = " ".join(f"{k}={v}" for k, v in wanted.items())
    assert re.search(rf"^ENV {re.escape(settings)}$", DOCKERFILE.read_text(), re.M)
    assert re.search(rf"^SERVE_ENV \?= {re.escape(settings)}$", (ROOT / "Makefile").read_text(), re.M)


# -- the checks can fail ----------------------------------------------------------------------
def _set(path: str, value):
    """Set (or delete) the node at a dotted path; list indices are numbers, `nvidia.com/gpu` is one key."""
    keys = re.findall(r"nvidia\.com/gpu|[^.]+", path)

    def change(m):
        *parents, last = keys
        node = m
        for key in parents:
            node = node[int(key)] if isinstance(node, list) else node[key]
        if value is _DELETE:
            del node[last]
        else:
            node[last] = value
    return change


_DELETE = object()
_WORKER = "spec.rayClusterConfig.workerGroupSpecs.0"
_WORKER_LIMITS = _WORKER + ".template.spec.containers.0.resources.limits"


@pytest.mark.parametrize("change,expected", [
    (_set("spec.serveConfigV3", "x"), r"'serveConfigV3' was unexpected"),  # misspelled under spec
    (_set(_WORKER + ".minReplica", 1), r"'minReplica' was unexpected"),
    (_set(_WORKER + ".template.spec.containers.0.volumeMount", []), r"'volumeMount' was unexpected"),
    (_set(_WORKER + ".replicas", "1"), r"workerGroupSpecs\.0\.replicas: '1' is not of type 'integer'"),
    (_set(_WORKER + ".replicas", 2**31), r"replicas: 2147483648 is not a 'int32'"),
    (_set("spec.rayClusterConfig.headGroupSpec.rayStartParams.num-cpus", 0), r"num-cpus: 0 is not of type 'string'"),
    (_set(_WORKER + ".groupName", _DELETE), r"'groupName' is a required property"),
    (_set(_WORKER_LIMITS + ".nvidia.com/gpu", [2]), r"nvidia\.com/gpu: \[2\] is not valid"),  # int-or-string
    (_set(_WORKER_LIMITS + ".nvidia.com/gpu", "two"), r"nvidia\.com/gpu: 'two' does not match"),
    (_set("metadata.name", "RayLLM"), r"not a DNS-1035 label"),
])
def test_crd_validation_catches(manifest, change, expected):
    bad = copy.deepcopy(manifest)
    change(bad)
    assert re.search(expected, "\n".join(crd_errors(bad))), crd_errors(bad)


def test_int_or_string_takes_both(manifest):
    for gpus in (2, "2"):
        ok = copy.deepcopy(manifest)
        _set(_WORKER_LIMITS + ".nvidia.com/gpu", gpus)(ok)
        assert crd_errors(ok) == []


def test_crd_validation_needs_a_served_version(manifest):
    with pytest.raises(ValueError, match="serves"):
        crd_errors({**manifest, "apiVersion": "ray.io/v2"})


def _app_args(**changes):
    return lambda c: _app(c)["args"].update(changes)


def _deployment(name, **changes):
    return lambda c: _deployments(_app(c))[name].update(changes)


@pytest.mark.parametrize("change,expected", [
    (_app_args(tensor_parralel_size=2), r"unknown arg 'tensor_parralel_size'"),  # our parser
    (_app_args(dtype="bf16"), r"dtype='bf16'"),
    (_app_args(min_replicas=5), r"min_replicas=5 must be <= max_replicas=4"),
    (_deployment("Ingress", max_ongoing_request=8), r"deployments\[0\]\.max_ongoing_request: unknown field"),
    (_deployment("EngineDeployment", max_ongoing_requests="lots"), r"max_ongoing_requests"),  # Serve's schema
    (lambda c: c.update(http_option={"port": 8000}), r"serveConfigV2\.http_option: unknown field"),
    (lambda c: _app(c).update(import_path="serve_app.app:build_ap"), r"import_path='serve_app.app:build_ap'"),
    (lambda c: _app(c).update(import_path="serve_ap.app:build_app"), r"No module named 'serve_ap'"),
    (lambda c: c.update(proxy_location="Head"), r"proxy_location"),
])
def test_serve_config_validation_catches(manifest, change, expected):
    errors = serve_config_errors(with_serve_config(manifest, change))
    assert re.search(expected, "\n".join(errors)), errors


def test_serve_config_duplicate_key_is_an_error(manifest):
    bad = copy.deepcopy(manifest)
    bad["spec"]["serveConfigV2"] += "proxy_location: HeadOnly\n"  # already set above
    assert re.search("duplicate key 'proxy_location'", "\n".join(serve_config_errors(bad)))


def test_agreement_catches_a_renamed_deployment(manifest):
    local = _app(load_yaml(SERVE_CONFIG.read_text()))
    bad = _app(serve_config(manifest))
    bad["deployments"][0]["name"] = "Ingres"
    assert any("Ingres" in e for e in agreement_errors(bad, local))
    assert any("import_path" in e for e in agreement_errors({**bad, "import_path": "x:y"}, local))


def test_agreement_holds_each_config_to_the_deployments_its_args_bind(manifest):
    """The CPU demo is one deployment (colocate_ingress), the RayService three: each must list its own."""
    rayservice, local = _app(serve_config(manifest)), _app(load_yaml(SERVE_CONFIG.read_text()))
    three = {**local, "args": {**local["args"], "colocate_ingress": False}}
    assert any("config.yaml deployments ['Ingress'] != build_app's ['EngineDeployment', 'Guardrails', 'Ingress']" in e
               for e in agreement_errors(rayservice, three))
    one = {**rayservice, "args": {**rayservice["args"], "colocate_ingress": True}}
    assert any(e.startswith("rayservice deployments") for e in agreement_errors(one, local))


@pytest.mark.parametrize("change,expected", [
    (_set(_WORKER_LIMITS + ".nvidia.com/gpu", 1), r"1 GPUs .* takes 2"),
    (_set(_WORKER + ".maxReplicas", 8), r"pods 1\.\.8 != engine replicas 1\.\.4"),
    (_set("spec.rayClusterConfig.headGroupSpec.rayStartParams.resources", '"{\\"other\\": 1}"'),
     r"Ingress asks for \{'rayllm_frontend': 1\}"),
    (_set("spec.rayClusterConfig.headGroupSpec.template.spec.containers.0.volumeMounts", []),
     r"head: '/models/Qwen3-32B' \(the model\) is on no mounted"),
    (_set("spec.rayClusterConfig.headGroupSpec.template.spec.containers.0.resources.limits.nvidia.com/gpu", 1),
     r"the head asks for GPUs"),
])
def test_consistency_catches(manifest, change, expected):
    bad = copy.deepcopy(manifest)
    change(bad)
    assert re.search(expected, "\n".join(consistency_errors(bad))), consistency_errors(bad)


def test_consistency_catches_cpu_args(manifest):
    bad = with_serve_config(manifest, _app_args(device="cpu", dtype="float32"))
    assert any("cuda/bfloat16" in e for e in consistency_errors(bad))


# -- deploy/rayjob.yaml: the batch job (serve_app.batch) --------------------------------------
@pytest.fixture(scope="module")
def rayjob() -> dict:
    from tests.deploy_checks import RAYJOB
    return load_yaml(RAYJOB.read_text())


def test_rayjob_matches_the_kuberay_crd_and_the_batch_cli(rayjob):
    from tests.deploy_checks import rayjob_errors
    assert (rayjob["apiVersion"], rayjob["kind"]) == ("ray.io/v1", "RayJob")
    assert crd_errors(rayjob) == []
    assert rayjob_errors(rayjob) == []


def test_rayjob_runs_the_rayservice_image_and_ray_version(rayjob, manifest):
    images = {c["image"] for _, _, c in _containers(rayjob)}
    assert images == {c["image"] for _, _, c in _containers(manifest)}
    assert rayjob["spec"]["rayClusterSpec"]["rayVersion"] == manifest["spec"]["rayClusterConfig"]["rayVersion"]


_JOB_WORKER = "spec.rayClusterSpec.workerGroupSpecs.0"


@pytest.mark.parametrize("change,expected", [
    (_set("spec.entrypointt", "x"), r"'entrypointt' was unexpected"),
    (_set("spec.backoffLimit", "2"), r"backoffLimit: '2' is not of type 'integer'"),
    (_set("spec.shutdownAfterJobFinishes", "yes"), r"shutdownAfterJobFinishes: 'yes' is not of type 'boolean'"),
    (_set(_JOB_WORKER + ".groupName", _DELETE), r"'groupName' is a required property"),
])
def test_rayjob_crd_validation_catches(rayjob, change, expected):
    bad = copy.deepcopy(rayjob)
    change(bad)
    assert re.search(expected, "\n".join(crd_errors(bad))), crd_errors(bad)


def _entrypoint(old, new):
    return lambda m: m["spec"].update(entrypoint=m["spec"]["entrypoint"].replace(old, new))


@pytest.mark.parametrize("change,expected", [
    (_entrypoint("--resume", ""), r"--resume missing"),
    (_entrypoint("--num-replicas 4", "--num-replicas 3"), r"--num-replicas 3 != 4 GPU pods"),
    (_entrypoint("--tensor-parallel-size 1", "--tensor-parallel-size 2"), r"1 GPUs per pod.* takes 2"),
    (_entrypoint("--max-tokens", "--max-tokenz"), r"the batch CLI refuses"),
    (_entrypoint("--output /data/extracted", "--output /models/out"), r"'/models/out' \(the output\) is on no writable"),
    (_entrypoint("--model /models/", "--model /weights/"), r"'/weights/Qwen3-8B' \(the model\) is on no mounted"),
    (_entrypoint("python -m serve_app.batch", "python -m serve_app.batsh"), r"not python -m serve_app.batch"),
])
def test_rayjob_consistency_catches(rayjob, change, expected):
    from tests.deploy_checks import rayjob_errors
    bad = copy.deepcopy(rayjob)
    change(bad)
    assert re.search(expected, "\n".join(rayjob_errors(bad))), rayjob_errors(bad)
