"""Serving overhead: the same requests three ways in one command, and where the time goes.

    python -m loadtest.overhead [--concurrency 64] [--num-requests 128] [--input-len 128] \\
        [--output-len 64] [--device cpu] [--out bench_out/overhead.json] [--serve-arg key=value ...] \\
        [--stream-interval-ms 0,20,50] [--sweep max_stream_messages_per_s=100,200,400] [--rounds 3 | --paired 6]

1. offline: `LLM.generate` over every request at once, with `max_num_seqs` = the
   concurrency (the closed-loop equivalent: never more than C requests in flight);
2. async: `AsyncLLM` in this process, C streaming clients (DELTA outputs), no Ray;
3. serve: the Serve app (serve_app.app:build_app) in a local Ray cluster, C streaming
   HTTP clients on loopback (token-id prompts, `ignore_eos`, greedy), in Ray Serve's
   high-throughput mode (HAProxy, direct ingress: serve_app.local); serve_pyproxy: the same
   behind Serve's Python ProxyActor. With --sweep KEY=V1,V2 (a field of the engine replica's
   user_config; --stream-interval-ms A,B is --sweep stream_interval_ms=A,B), once per value
   (paths serve_KEY=V), reconfiguring the running app.

Each of 2 and 3 also runs at concurrency 1 for TTFT, on both timed to the first output
with text (what a client can show; the HTTP client cannot see tokens without text).
--rounds N runs the paths N times in turn; a ratio is taken against the offline run of its
own round (a shared machine drifts over minutes) and the medians over rounds are printed.
--paired N is the way to a figure on a noisy box: N rounds of the three paths on one app,
seconds apart, in rotating order, the app's processes stopped (SIGSTOP) while the in-process
paths run (loadtest/overhead_paired.py). Printed last: output tok/s per path
and the ratios to offline, TTFT p50 at concurrency 1, CPU seconds per streamed token in
each process of the serving path (from /proc: proxy, Ingress, Guardrails, engine
replica, its step thread, Ray's own daemons, the client) and streamed messages per
token on each hop (the Ingress's `stream_chunk_tokens` histogram). Full numbers: JSON.
"""
from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import time
from pathlib import Path

from loadtest.overhead_paths import run_async, run_offline, run_serve
from loadtest.report import base_metadata, format_table, write_json
from loadtest.workload import BenchRequest, prompt_id_limit

DEFAULT_MODEL_DIR = Path("bench_out/model-bench")
PATHS = ("offline", "async", "serve", "serve_pyproxy")


def progress(message: str) -> None:
    print(f"[loadtest.overhead] {message}", file=sys.stderr, flush=True)


def make_requests(num: int, input_len: int, output_len: int, vocab_size: int, seed: int) -> list[BenchRequest]:
    """Fixed lengths (the issue's shape), random ids clear of the special ids at the bottom."""
    import random

    rng = random.Random(seed)
    return [BenchRequest([rng.randrange(3, vocab_size) for _ in range(input_len)], output_len) for _ in range(num)]


def make_workload(args: argparse.Namespace, vocab_size: int):
    """run -> (requests, TTFT requests): one shape, fresh random ids per run. Runs on one app must
    not share prompts: its prefix cache would let the later run skip its prefill."""
    def workload(run: int) -> tuple[list[BenchRequest], list[BenchRequest]]:
        seed = args.seed + 1000 * run
        return (make_requests(args.num_requests, args.input_len, args.output_len, vocab_size, seed),
                make_requests(args.num_ttft_requests, args.input_len, args.output_len, vocab_size, seed + 1))
    return workload


def _key_value(text: str) -> tuple[str, str]:
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"expected key=value, got {text!r}")
    return key, value


def _intervals(text: str) -> tuple[str, list[float]]:
    try:
        values = [float(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated milliseconds, got {text!r}") from None
    if not values or any(v < 0 for v in values):
        raise argparse.ArgumentTypeError(f"expected milliseconds >= 0, got {text!r}")
    return "stream_interval_ms", values


def _sweep(text: str) -> tuple[str, list[str | None]]:
    """KEY=V1,V2,...: values of one field of the engine replica's user_config (checked by the
    replica's own StreamingConfig); "none" is null (the field's default)."""
    from serve_app.args import StreamingConfig

    key, values = _key_value(text)
    if key not in StreamingConfig.model_fields:
        raise argparse.ArgumentTypeError(f"--sweep {key!r}: choose one of {sorted(StreamingConfig.model_fields)}")
    parsed = [None if v.strip().lower() == "none" else v.strip() for v in values.split(",") if v.strip()]
    if not parsed:
        raise argparse.ArgumentTypeError(f"--sweep {text!r}: no values")
    return key, parsed


def parse_args(argv: list[str]) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m loadtest.overhead", description=__doc__.splitlines()[0])
    ap.add_argument("--model", type=Path, default=None, help="checkpoint dir (default: the bench model, built once)")
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    ap.add_argument("--dtype", default=None, help="default: float32 on CPU, bfloat16 on CUDA")
    ap.add_argument("--concurrency", type=int, default=64)
    ap.add_argument("--num-requests", type=int, default=128)
    ap.add_argument("--num-ttft-requests", type=int, default=8, help="sequential requests for TTFT at concurrency 1")
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--max-num-batched-tokens", type=int, default=None)
    ap.add_argument("--max-model-len", type=int, default=None, help="default: the model's")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--paths", default="offline,async,serve",
                    help="which paths to run, comma-separated: offline, async, serve (HAProxy, the default "
                         "mode), serve_pyproxy (behind Serve's Python ProxyActor)")
    ap.add_argument("--serve-arg", type=_key_value, action="append", default=[],
                    help="extra application arg for the serve path, e.g. stream_interval_ms=0")
    ap.add_argument("--stream-interval-ms", dest="sweep", type=_intervals, default=None,
                    help="comma-separated stream_interval_ms values: one serve path each, on one running app")
    ap.add_argument("--sweep", dest="sweep", type=_sweep, default=None,
                    help="KEY=V1,V2: values of an engine replica user_config field (e.g. "
                         "max_stream_messages_per_s=100,200), one serve path each, on one running app")
    ap.add_argument("--rounds", type=int, default=1, help="run the paths this many times in turn; medians")
    ap.add_argument("--paired", type=int, default=None, metavar="N",
                    help="N rounds of offline, async and serve in rotating order on one app, the app's processes "
                         "stopped while the others run (loadtest/overhead_paired.py); medians of the rounds' "
                         "ratios. Replaces --paths, --rounds and --sweep")
    ap.add_argument("--metrics-interval-ms", type=int, default=None,
                    help="how often the serve path's Ray agent publishes metrics (default: Ray's own 10 s, what "
                         "`serve run` clusters have). Each serve path waits 5 intervals for /metrics; a shorter "
                         "one saves that time where the agent's CPU does not matter (a GPU host's spare cores)")
    ap.add_argument("--out", type=Path, default=Path("bench_out/overhead.json"))
    args = ap.parse_args(argv)
    if args.metrics_interval_ms is not None and args.metrics_interval_ms < 100:
        ap.error(f"--metrics-interval-ms={args.metrics_interval_ms} must be >= 100")
    if args.paired is not None and (args.paired < 1 or args.sweep is not None):
        ap.error(f"--paired={args.paired} must be >= 1, without --sweep")
    for name in ("concurrency", "num_requests", "num_ttft_requests", "input_len", "output_len", "rounds"):
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')}={getattr(args, name)} must be >= 1")
    args.paths = [p.strip() for p in args.paths.split(",") if p.strip()]
    bad = [p for p in args.paths if p not in PATHS]
    if bad:
        ap.error(f"--paths: unknown {bad}; choose from {', '.join(PATHS)}")
    args.dtype = args.dtype or ("bfloat16" if args.device == "cuda" else "float32")
    return args


def engine_kwargs(args, model: Path) -> dict:
    """The same engine settings on every path."""
    return {"model": str(model), "device": args.device, "dtype": args.dtype, "max_num_seqs": args.concurrency,
            "max_num_batched_tokens": args.max_num_batched_tokens, "max_model_len": args.max_model_len,
            "enable_prefix_caching": True,
            "seed": args.seed}


def combine_rounds(rounds: list[dict[str, dict]]) -> dict[str, dict]:
    """Per path: the medians over rounds of its figures, and each round's ratio to the offline run
    of the same round (`ratio_to_offline`, in round order); the rest is the first round's."""
    combined = {}
    for name in rounds[0]:
        runs = [r[name] for r in rounds]
        out = dict(runs[0])
        for key in ("tokens_per_s", "ttft_c1_p50_ms", "cpu_s_per_token_total"):
            if key in out:
                out[key] = statistics.median(r[key] for r in runs)
        if "cpu_s_by_role" in out:
            roles = {role for r in runs for role in r["cpu_s_by_role"]}
            out["cpu_ms_per_token_by_role"] = {
                role: statistics.median(r["cpu_s_by_role"].get(role, 0.0) / r["num_tokens"] * 1e3 for r in runs)
                for role in roles}
            hops = {hop for r in runs for hop in r["messages_per_token"]}
            out["messages_per_token"] = {hop: statistics.median(r["messages_per_token"].get(hop, 0.0) for r in runs)
                                         for hop in hops}
        if "offline" in rounds[0]:
            out["ratio_to_offline"] = [r[name]["tokens_per_s"] / r["offline"]["tokens_per_s"] for r in rounds]
        if name.startswith("serve") and "async" in rounds[0] and "ttft_c1_p50_ms" in out:
            # Issue 8's TTFT target, taken round by round as the ratios are: a gap, not two medians.
            out["ttft_c1_gap_to_async_ms"] = [r[name]["ttft_c1_p50_ms"] - r["async"]["ttft_c1_p50_ms"]
                                              for r in rounds]
        combined[name] = out
    return combined


def summary_table(report: dict) -> str:
    paths = report["paths"]
    rows = []
    for name, r in paths.items():
        ratios = r.get("ratio_to_offline")
        ratio = statistics.median(ratios) if ratios else "-"
        spread = " ".join(f"{q:.2f}" for q in ratios) if ratios and len(ratios) > 1 else "-"
        ttft = r.get("ttft_c1_p50_ms", "-")
        rows.append([name, r["tokens_per_s"], ratio, spread, ttft, r.get("cpu_s_per_token_total", "-")])
    table = format_table(["path", "out tok/s", "/ offline", "per round", "TTFT p50 c=1 ms", "CPU ms/token"],
                         [[n, t, q, s, f, c * 1e3 if isinstance(c, float) else c] for n, t, q, s, f, c in rows])
    serves = {name: r for name, r in paths.items() if name.startswith("serve")}
    for name, r in serves.items():
        gaps = r.get("ttft_c1_gap_to_async_ms")
        if gaps:
            table += (f"\n{name}: TTFT p50 at c=1 minus AsyncLLM's, per round: {' '.join(f'{g:.1f}' for g in gaps)} ms"
                      f" (median {statistics.median(gaps):.1f})")
    if serves:
        roles = sorted({role for r in serves.values() for role in r.get("cpu_ms_per_token_by_role", {})})
        hops = sorted({hop for r in serves.values() for hop in r.get("messages_per_token", {})})
        rows = [[role] + [r.get("cpu_ms_per_token_by_role", {}).get(role, 0.0) for r in serves.values()]
                for role in roles]
        rows += [[f"messages/token {hop}"] + [r.get("messages_per_token", {}).get(hop, "-") for r in serves.values()]
                 for hop in hops]
        table += "\n\nserve path, per streamed token (CPU ms, or count)\n" + format_table(["where", *serves], rows)
    return table


def main(argv: list[str] | None = None) -> dict:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    model = args.model or _bench_model()
    workload = make_workload(args, prompt_id_limit(Path(model)))
    requests, ttft_requests = workload(0)
    report = base_metadata(["python", "-m", "loadtest.overhead", *argv])
    report["workload"] = {k: getattr(args, k) for k in ("concurrency", "num_requests", "num_ttft_requests",
                                                         "input_len", "output_len", "device", "dtype", "seed")}
    kwargs = engine_kwargs(args, Path(model))
    runners = {"offline": lambda: {"offline": run_offline(kwargs, requests)},
               "async": lambda: {"async": asyncio.run(run_async(kwargs, requests, ttft_requests, args.concurrency))},
               "serve": lambda: run_serve(kwargs, workload, args.concurrency, dict(args.serve_arg), args.sweep,
                                          metrics_interval_ms=args.metrics_interval_ms),
               "serve_pyproxy": lambda: run_serve(kwargs, workload, args.concurrency, dict(args.serve_arg),
                                                  args.sweep, high_throughput=False,
                                                  metrics_interval_ms=args.metrics_interval_ms)}
    report["rounds"] = []
    if args.paired is not None:
        from loadtest.overhead_paired import run_paired

        report["rounds"] = run_paired(kwargs, workload, args.concurrency, dict(args.serve_arg), args.paired,
                                      args.metrics_interval_ms, progress)
    for k in range(args.rounds if args.paired is None else 0):
        results = {}
        for path in args.paths:
            start = time.perf_counter()
            for name, result in runners[path]().items():
                results[name] = result
                progress(f"round {k + 1}: {name}: {result['tokens_per_s']:.0f} tok/s "
                         f"({time.perf_counter() - start:.0f} s)")
        report["rounds"].append(results)
    report["paths"] = combine_rounds(report["rounds"])
    report["machine"]["load_average_end"] = [round(x, 2) for x in os.getloadavg()]
    write_json(args.out, report)
    print(f"wrote {args.out}")
    print(summary_table(report))
    return report


def _bench_model() -> Path:
    from loadtest.offline import ensure_bench_model

    return ensure_bench_model(DEFAULT_MODEL_DIR)


if __name__ == "__main__":
    main()
