"""`rayllm` (serve_app/cli): flags derived from the app's args, the one-line failures before Ray
starts, and `rayllm serve` on the tiny model: it answers the openai client, serves in the fast shape
with Serve's environment, and stops on SIGTERM leaving no process behind."""
import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import yaml

from engine.executor.network_utils import free_port
from serve_app.args import AppArgs
from serve_app.cli.app_flags import app_args_from
from serve_app.cli.main import build_parser
from serve_app.serve_env import LOCAL_SERVE_ENV

ROOT = Path(__file__).resolve().parents[1]
# Generous: start-up on a loaded 2-core machine, not a measure of speed.
START_DEADLINE_S = 600
FAIL_DEADLINE_S = 60


def rayllm(*args: str) -> list[str]:
    return [sys.executable, "-m", "serve_app.cli", *args]


def run_fast_failure(*args: str) -> subprocess.CompletedProcess:
    started = time.monotonic()
    done = subprocess.run(rayllm(*args), capture_output=True, text=True, timeout=FAIL_DEADLINE_S, cwd=ROOT)
    done.elapsed = time.monotonic() - started
    return done


def assert_one_line_error(done: subprocess.CompletedProcess, *words: str) -> None:
    assert done.returncode == 2, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("rayllm serve: error: "), done.stderr
    assert "Traceback" not in done.stderr
    for word in words:
        assert word in lines[0], lines[0]


# -- flags ------------------------------------------------------------------------------------
def test_every_app_arg_is_a_serve_flag_with_its_default():
    help_text = " ".join(build_parser()._subparsers._group_actions[0].choices["serve"].format_help().split())
    for name in AppArgs.model_fields:
        if name != "model":
            assert f"--{name.replace('_', '-')}" in help_text, name
    assert "--max-num-seqs INT [default: 256]" in help_text
    assert "--config FILE" in help_text and "--python-proxy" in help_text


def test_flags_become_app_args_as_serve_would_validate_them():
    ns = build_parser().parse_args([
        "serve", "m", "--max-num-seqs", "4", "--guardrails", '{"max_depth": 3}', "--colocate-ingress",
        "--max-pending-requests", "none", "--engine-process", "false"])
    args = app_args_from(ns, AppArgs)
    assert args == {"max_num_seqs": "4", "guardrails": {"max_depth": 3}, "colocate_ingress": "true",
                    "max_pending_requests": None, "engine_process": "false"}
    parsed = AppArgs.model_validate({**args, "model": "m"})
    assert (parsed.max_num_seqs, parsed.colocate_ingress, parsed.engine_process) == (4, True, False)


def test_lora_modules_flag_takes_vllms_words():
    ns = build_parser().parse_args(["serve", "m", "--lora-modules", "sql=/a/sql", '{"name": "chat", "path": "/a/c"}',
                                    "--max-loras", "2"])
    args = app_args_from(ns, AppArgs)
    parsed = AppArgs.model_validate({**args, "model": "m"})
    assert parsed.lora_modules == {"sql": "/a/sql", "chat": "/a/c"} and parsed.enable_lora and parsed.max_loras == 2


def test_bad_json_names_the_flag():
    ns = build_parser().parse_args(["serve", "m", "--guardrails", "{oops"])
    with pytest.raises(ValueError, match="--guardrails: expected JSON"):
        app_args_from(ns, AppArgs)


@pytest.mark.parametrize("gpu, given, device, colocated", [
    (False, {}, "cpu", True),                                   # a CPU box: one colocated deployment
    (True, {}, "cuda", False),                                  # a GPU host: three deployments
    (True, {"colocate_ingress": "true"}, "cuda", "true"),       # the user decides
    (True, {"device": "cpu"}, "cpu", True),
    (False, {"ingress_replicas": "2"}, "cpu", False),           # several Ingress replicas: not colocated
    (False, {"request_router": "prefix_affinity"}, "cpu", False),  # a router between Ingress and engines
])
def test_shape_follows_the_hardware_unless_told(monkeypatch, gpu, given, device, colocated):
    from serve_app.cli import serve

    monkeypatch.setattr(serve, "has_gpu", lambda: gpu)
    monkeypatch.setattr(serve, "check_device", lambda d: None)
    args = serve.choose_shape({"model": "m", **given})
    assert (args["device"], args["colocate_ingress"]) == (device, colocated)


# -- failing before Ray starts ------------------------------------------------------------------
def test_missing_model_path_fails_in_one_line(tmp_path):
    missing = str(tmp_path / "no-such-model")
    done = run_fast_failure("serve", missing, "--port", str(free_port()))
    assert_one_line_error(done, missing)


def test_unsupported_architecture_fails_in_one_line(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"], "vocab_size": 10}))
    done = run_fast_failure("serve", str(tmp_path), "--port", str(free_port()))
    assert_one_line_error(done, "GPT2LMHeadModel", "not supported")


def test_busy_port_fails_in_one_line(tiny_llama):
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        port = listener.getsockname()[1]
        done = run_fast_failure("serve", tiny_llama, "--port", str(port))
    assert_one_line_error(done, f"port {port}", "in use")


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="checks a machine without a GPU")
def test_cuda_without_a_gpu_fails_in_one_line(tiny_llama):
    done = run_fast_failure("serve", tiny_llama, "--device", "cuda", "--port", str(free_port()))
    assert_one_line_error(done, "device=cuda", "no CUDA GPU")


def test_config_file_is_checked_before_ray_starts(tmp_path, tiny_llama):
    config = yaml.safe_load((ROOT / "deploy" / "config.yaml").read_text())
    config["applications"][0]["args"]["model"] = str(tmp_path / "missing")
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(config))
    assert_one_line_error(run_fast_failure("serve", "--config", str(path), "--port", str(free_port())), "missing")
    config["applications"][0]["args"]["model"] = tiny_llama
    path.write_text(yaml.safe_dump(config))
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        port = listener.getsockname()[1]
        assert_one_line_error(run_fast_failure("serve", "--config", str(path), "--port", str(port)), f"port {port}")
    path.write_text("applications: 3\n")
    assert_one_line_error(run_fast_failure("serve", "--config", str(path)), "not a Serve config file")


def test_config_port_is_overridden_by_the_flag():
    from serve_app.cli.serve_config import load_config

    config = load_config(str(ROOT / "deploy" / "config.yaml"), None, 8123)
    assert (config.http_options.host, config.http_options.port) == ("127.0.0.1", 8123)


# -- serving ------------------------------------------------------------------------------------
def _descendants(pid: int) -> dict[int, str]:
    """pid -> command line of every live process below `pid`."""
    found, todo = {}, [pid]
    while todo:
        parent = todo.pop()
        for task in Path(f"/proc/{parent}/task").glob("*"):
            try:
                children = [int(c) for c in (task / "children").read_text().split()]
            except OSError:
                continue
            for child in children:
                if child not in found:
                    found[child] = _cmdline(child)
                    todo.append(child)
    return found


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return ""


def _alive(pid: int, cmdline: str) -> bool:
    """The same process still there, and not a zombie."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0]
    except OSError:
        return False
    return state != "Z" and _cmdline(pid) == cmdline


def _environ(pid: int) -> dict[str, str]:
    raw = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    return dict(item.decode(errors="replace").partition("=")[::2] for item in raw if b"=" in item)


def _wait_for_line(log: Path, text: str, proc: subprocess.Popen, deadline_s: float) -> str:
    deadline = time.monotonic() + deadline_s
    while time.monotonic() < deadline:
        out = log.read_text(errors="replace")
        if text in out:
            return out
        assert proc.poll() is None, f"rayllm serve exited with {proc.returncode}:\n{out[-3000:]}"
        time.sleep(0.5)
    raise AssertionError(f"no {text!r} within {deadline_s} s:\n{log.read_text(errors='replace')[-3000:]}")


@pytest.fixture(scope="module")
def served(tiny_llama, tmp_path_factory, own_ray_cluster):
    """`rayllm serve` on the tiny model in a process (and session) of its own; yields (proc, url, log).
    A test that stops it leaves the rest to skip the stop."""
    log = tmp_path_factory.mktemp("rayllm") / "serve.log"
    port = free_port()
    env = {k: v for k, v in os.environ.items() if k not in LOCAL_SERVE_ENV}  # what rayllm sets, it sets
    with open(log, "w") as out:
        # A short drain: a stream still running at SIGTERM is ended (error event + [DONE]) after 3 s.
        proc = subprocess.Popen(rayllm("serve", tiny_llama, "--port", str(port), "--graceful-shutdown-timeout-s", "3"),
                                stdout=out, stderr=subprocess.STDOUT, cwd=ROOT, env=env, start_new_session=True)
    try:
        _wait_for_line(log, "rayllm: serving", proc, START_DEADLINE_S)
        yield proc, f"http://127.0.0.1:{port}", log
    finally:
        if proc.poll() is None:  # a failed test: kill what this server started (not `ray stop`, which kills every cluster)
            for pid in [proc.pid, *_descendants(proc.pid)]:
                with contextlib.suppress(OSError):
                    os.kill(pid, signal.SIGKILL)
            proc.wait()


def _read_stream(url: str, model: str, lines: list[str], started: threading.Event) -> None:
    import httpx

    body = {"model": model, "prompt": "Hello", "max_tokens": 1500, "ignore_eos": True, "stream": True}
    try:
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=120) as response:
            for line in response.iter_lines():
                if line:
                    lines.append(line)
                    started.set()
    except httpx.HTTPError as e:
        lines.append(f"cut: {e!r}")
    started.set()


def test_serve_answers_in_the_fast_shape_then_stops_on_sigterm(served, tiny_llama):
    import openai

    proc, url, log = served
    out = log.read_text()
    assert "rayllm: loading model" in out
    name = Path(tiny_llama).name
    assert f"serving {name!r} at {url}/v1 (device cpu, colocated: one deployment, HAProxy)" in out
    assert "curl " + url + "/v1/chat/completions" in out

    client = openai.OpenAI(base_url=url + "/v1", api_key="none")
    assert [m.id for m in client.models.list()] == [name]
    completion = client.completions.create(model=name, prompt="Hello", max_tokens=4, temperature=0)
    assert completion.usage.completion_tokens == 4
    chunks = list(client.chat.completions.create(model=name, messages=[{"role": "user", "content": "hi"}],
                                                 max_tokens=4, stream=True))
    assert chunks and chunks[-1].choices[0].finish_reason == "length"

    # The shape and the environment, as the processes themselves have them.
    processes = _descendants(proc.pid)
    replicas = [pid for pid, cmd in processes.items() if cmd.startswith("ray::ServeReplica:llm:")]
    assert {processes[p] for p in replicas} == {"ray::ServeReplica:llm:Ingress"}, processes
    assert any("haproxy" in cmd.split(" ")[0] for cmd in processes.values()), "HAProxy serves the port"
    replica_env = _environ(replicas[0])
    assert {k: replica_env.get(k) for k in LOCAL_SERVE_ENV} == LOCAL_SERVE_ENV

    # Another server on the port is refused: HAProxy's SO_REUSEPORT would let it share the port.
    second = run_fast_failure("serve", tiny_llama, "--port", url.rpartition(":")[2])
    assert_one_line_error(second, "in use")
    models = subprocess.run(rayllm("models", "--url", url), capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert models.stdout.split() == [name]
    complete = subprocess.run(rayllm("complete", "Hello", "--url", url, "--max-tokens", "3", "--temperature", "0"),
                              capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert complete.returncode == 0 and complete.stdout.strip(), complete.stderr
    chat = subprocess.run(rayllm("chat", "--url", url, "--max-tokens", "3"), input="hi\n/reset\nagain\n",
                          capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert chat.returncode == 0 and chat.stdout.strip() and not chat.stderr, (chat.stdout, chat.stderr)

    # SIGTERM while a stream runs: it finishes or ends with an error event, then [DONE], either way.
    lines, started = [], threading.Event()
    reader = threading.Thread(target=_read_stream, args=(url, name, lines, started))
    reader.start()
    assert started.wait(120), lines
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=120) == 0, log.read_text()[-3000:]
    reader.join(60)
    assert lines[-1] == "data: [DONE]", lines[-3:]
    last = json.loads(lines[-2].removeprefix("data: "))
    assert "error" in last or last["choices"][0]["finish_reason"] == "length", last
    assert "rayllm: stopped" in log.read_text()
    deadline = time.monotonic() + 30  # processes the raylet killed may take a moment to be reaped
    while (left := {p: c for p, c in processes.items() if _alive(p, c)}) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not left, f"left behind: {left}"
