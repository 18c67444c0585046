"""Autoscaling, shown: a request-rate ramp makes Serve add a second engine replica, then remove it.

    python -m loadtest.autoscale [--model DIR] [--rates 1,8,1] [--num-prompts 5,160,5] \\
        [--output-len 64] [--out bench_out/autoscale]

Starts the app in a local Ray cluster (serve_app.local) with EngineDeployment autoscaling
between 1 and 2 replicas on ongoing requests (target = max_num_seqs, aggressive delays so the
run is short), then runs `python -m loadtest --request-rate` levels in order (a ramp up and
down). Every second a sampler records Serve's status (replicas per state, the autoscaler's
target) and the tokens each engine replica generated (from GET /metrics); after the load it
waits for the scale-down. Writes DIR/autoscale.json (the ramp's results, the samples and the
`serve status` text before, at the peak and after) and DIR/autoscale.png (replicas, tokens/s
and latency over time). Results: docs/benchmarks.md, "Autoscaling, shown".
"""
from __future__ import annotations

import argparse
import asyncio
import re
import sys
import threading
import time
from pathlib import Path

import httpx

from loadtest.online import OnlineConfig, run_sweep
from loadtest.report import base_metadata, write_json

ENGINE = "EngineDeployment"
DEMO_ARGS = {  # app args of the demo: small batches so that a CPU box reaches the target
    "device": "cpu", "dtype": "float32", "max_model_len": 512, "num_kv_blocks": 256, "max_num_seqs": 4,
    "min_replicas": 1, "max_replicas": 2, "engine_cpu_threads": 1, "upscale_delay_s": 2.0,
    "downscale_delay_s": 8.0, "look_back_period_s": 2.0, "metrics_interval_s": 0.5,
    "graceful_shutdown_timeout_s": 2.0, "served_model_name": "tiny",
}
_TOKENS_LINE = re.compile(r'^ray_rayllm_generation_tokens_total\{([^}]*)\}\s+(\S+)$')
_LABEL = re.compile(r'(\w+)="([^"]*)"')


def engine_status(app_name: str) -> dict:
    """Serve's view of the app's engine deployment (what `serve status` prints for it)."""
    from ray import serve

    app = serve.status().applications.get(app_name)
    dep = app.deployments.get(ENGINE) if app else None
    if dep is None:
        return {"status": "MISSING", "replica_states": {}}
    states = {str(_plain(k)): v for k, v in dep.replica_states.items()}
    return {"status": str(_plain(dep.status)), "replica_states": states, "message": dep.message}


def serve_status_text() -> str:
    """What `serve status` prints (YAML of the same ServeStatus; the CLI needs Ray's dashboard,
    which the local test cluster does not start)."""
    import yaml
    from ray import serve

    return yaml.safe_dump(_plain(serve.status()), sort_keys=False)


def _plain(obj):
    if hasattr(obj, "__dataclass_fields__"):
        return {k: _plain(getattr(obj, k)) for k in obj.__dataclass_fields__}
    if isinstance(obj, dict):
        return {str(getattr(k, "value", k)): _plain(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_plain(v) for v in obj]
    value = getattr(obj, "value", obj)  # enums
    return value if isinstance(value, (str, int, float, bool, type(None))) else str(value)


def tokens_by_replica(metrics_text: str, app_name: str | None = None) -> dict[str, float]:
    """Generated tokens per engine replica so far, from a /metrics scrape: of `app_name`'s replicas
    only when given (a cluster's export holds every app's, and stopped replicas' series linger)."""
    out: dict[str, float] = {}
    for line in metrics_text.splitlines():
        m = _TOKENS_LINE.match(line)
        if not m:
            continue
        labels = dict(_LABEL.findall(m.group(1)))
        if "replica" in labels and (app_name is None or labels.get("application") == app_name):
            out[labels["replica"]] = out.get(labels["replica"], 0.0) + float(m.group(2))
    return out


class Sampler:
    """Every `period_s`, on a thread: engine replicas by state and tokens per replica."""

    def __init__(self, url: str, app_name: str, period_s: float = 1.0):
        self.url, self.app_name, self.period_s = url, app_name, period_s
        self.samples: list[dict] = []
        self.t0 = time.monotonic()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> "Sampler":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()

    def sample(self) -> dict:
        status = engine_status(self.app_name)
        try:
            tokens = tokens_by_replica(httpx.get(self.url + "/metrics", timeout=10, trust_env=False).text,
                                       self.app_name)
        except httpx.HTTPError:
            tokens = {}
        s = {"t_s": round(time.monotonic() - self.t0, 2), "running": status["replica_states"].get("RUNNING", 0),
             "replica_states": status["replica_states"], "tokens_by_replica": tokens}
        self.samples.append(s)
        return s

    def _run(self) -> None:
        while not self._stop.wait(self.period_s):
            self.sample()

    def wait_for(self, predicate, timeout_s: float) -> bool:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.samples and predicate(self.samples[-1]):
                return True
            time.sleep(self.period_s)
        return False


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(prog="python -m loadtest.autoscale", description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="a model directory (default: build the tiny test model)")
    ap.add_argument("--rates", default="1,8,1", help="requests/s per level, in order")
    ap.add_argument("--num-prompts", default="5,160,5", help="requests per level")
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--input-len", type=int, default=32)
    ap.add_argument("--out", type=Path, default=Path("bench_out/autoscale"))
    a = ap.parse_args(argv)
    rates = [float(x) for x in a.rates.split(",")]
    counts = [int(x) for x in a.num_prompts.split(",")]
    if len(rates) != len(counts):
        ap.error(f"--rates has {len(rates)} levels, --num-prompts {len(counts)}")
    model = a.model or _tiny_model()
    from serve_app.local import APP_NAME, local_server

    argv = sys.argv[1:] if argv is None else argv
    results = base_metadata(["python", "-m", "loadtest.autoscale", *argv]) | {"app_args": DEMO_ARGS}
    with local_server({"model": model, **DEMO_ARGS}, num_cpus=2) as url, Sampler(url, APP_NAME) as sampler:
        levels = []
        for rate, n in zip(rates, counts):  # one sweep per level: each its own num_prompts
            cfg = OnlineConfig(base_url=url, model="tiny", concurrency=[1], num_prompts=n, input_len=a.input_len,
                               output_len=a.output_len, out_dir=a.out, request_rates=[rate], num_warmup=0,
                               token_ids=True, seed=len(levels))
            levels.append(cfg)
        results.update(_run_levels(url, levels, sampler))
        results["samples"] = sampler.samples
    a.out.mkdir(parents=True, exist_ok=True)
    from loadtest.autoscale_plot import plot_autoscale

    results["plot"] = plot_autoscale(results, a.out / "autoscale.png").name
    write_json(a.out / "autoscale.json", results)
    print(f"max engine replicas: {max(s['running'] for s in results['samples'])}; scaled down after: "
          f"{results['scaled_down']}; wrote {a.out / 'autoscale.json'} and {results['plot']}")
    return results


def _run_levels(url: str, levels: list[OnlineConfig], sampler: Sampler) -> dict:
    """The load, level after level, then the wait for the scale-down; `serve status` before, at
    the first moment two engine replicas run, and after."""
    out = {"serve_status": {"before": serve_status_text()}, "levels": []}
    peak: dict = {}
    threading.Thread(target=lambda: sampler.wait_for(lambda s: s["running"] >= 2, 600)
                     and peak.setdefault("text", serve_status_text()), daemon=True).start()
    load_start = time.monotonic() - sampler.t0
    for cfg in levels:
        t = time.monotonic() - sampler.t0
        (level,) = asyncio.run(run_sweep(cfg))["levels"]
        for r in level["timeline"]:
            r["sent_s"] = round(r["sent_s"] + t, 3)  # on the sampler's clock
        out["levels"].append(level)
    out["load_window_s"] = [round(load_start, 2), round(time.monotonic() - sampler.t0, 2)]
    out["scaled_down"] = sampler.wait_for(lambda s: s["running"] <= 1 and sum(s["replica_states"].values()) <= 1,
                                          timeout_s=90)
    out["serve_status"]["peak"] = peak.get("text", "(never reached 2 replicas)")
    out["serve_status"]["after"] = serve_status_text()
    return out


def _tiny_model() -> str:
    from engine.tools.tiny_model import make_tiny_model

    path = Path("bench_out/tiny-llama")
    if not (path / "config.json").exists():
        make_tiny_model(path, arch="llama", preset="tiny", seed=0)
    return str(path.resolve())


if __name__ == "__main__":
    main()
