"""serve_app/serve_env.py is the one declaration of Serve's environment: the Makefile, the image, the
RayService and serve_app.local carry what it declares, so they cannot drift apart."""
import re
from pathlib import Path

import yaml

from serve_app import serve_env
from serve_app.serve_env import CONTROL_LOOP_ENV, HIGH_THROUGHPUT_ENV, LOCAL_SERVE_ENV, SERVE_ENV

ROOT = Path(__file__).resolve().parents[1]


def _settings(env: dict[str, str]) -> str:
    return " ".join(f"{k}={v}" for k, v in env.items())


def test_serve_env_is_the_fast_mode_and_the_control_loop():
    assert SERVE_ENV == {**HIGH_THROUGHPUT_ENV, **CONTROL_LOOP_ENV}
    assert SERVE_ENV.items() <= LOCAL_SERVE_ENV.items()


def test_dockerfile_sets_serve_env_and_serves_with_rayllm():
    dockerfile = (ROOT / "deploy" / "Dockerfile").read_text()
    assert re.search(rf"^ENV {re.escape(_settings(SERVE_ENV))}$", dockerfile, re.M)
    assert re.search(r'^CMD \["rayllm", "serve"', dockerfile, re.M), "the image's default command is rayllm serve"


def test_every_ray_container_of_the_rayservice_sets_serve_env():
    manifest = yaml.safe_load((ROOT / "deploy" / "rayservice.yaml").read_text())
    cluster = manifest["spec"]["rayClusterConfig"]
    specs = [cluster["headGroupSpec"], *cluster["workerGroupSpecs"]]
    for spec in specs:
        for container in spec["template"]["spec"]["containers"]:
            env = {e["name"]: e.get("value") for e in container.get("env", [])}
            assert {k: env.get(k) for k in SERVE_ENV} == SERVE_ENV, container["name"]


def test_makefile_serves_through_rayllm_with_serve_env():
    makefile = (ROOT / "Makefile").read_text()
    assert re.search(rf"^SERVE_ENV \?= {re.escape(_settings(SERVE_ENV))}$", makefile, re.M)
    recipe = re.search(r"^serve:.*\n((?:\t.*\n)+)", makefile, re.M).group(1)
    assert "$(SERVE_ENV) $(BIN)/rayllm serve" in recipe
    # No Serve variable set by hand anywhere else in the Makefile, with another value.
    for name, value in re.findall(r"(RAY_SERVE_\w+)=(\S+)", makefile):
        assert LOCAL_SERVE_ENV.get(name) == value, f"Makefile sets {name}={value}"


def test_local_cluster_uses_the_same_declaration():
    from serve_app import local

    assert local.HIGH_THROUGHPUT_ENV == HIGH_THROUGHPUT_ENV
    assert local.CONTROL_LOOP_ENV == CONTROL_LOOP_ENV
    assert local.DRAINING_PERIOD_ENV == serve_env.DRAINING_PERIOD_ENV


def test_apply_keeps_what_the_environment_sets():
    environ = {"RAY_SERVE_ENABLE_HA_PROXY": "0"}
    shown = serve_env.apply(environ)
    assert shown == {**LOCAL_SERVE_ENV, "RAY_SERVE_ENABLE_HA_PROXY": "0"} == environ
    assert serve_env.apply({}, high_throughput=False)["RAY_SERVE_THROUGHPUT_OPTIMIZED"] == "0"


def test_haproxy_files_are_private_and_short(tmp_path):
    env = serve_env.haproxy_private_env(str(tmp_path))
    assert all(v.startswith(str(tmp_path)) for k, v in env.items() if not k.endswith("PORT"))
    assert env["RAY_SERVE_HAPROXY_STATS_PORT"] != env["RAY_SERVE_HAPROXY_METRICS_PORT"]
