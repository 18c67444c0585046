"""Online serving benchmark against any OpenAI-compatible endpoint (ours, vLLM, ...).

    python -m loadtest --base-url http://127.0.0.1:8000 --model NAME --concurrency 1,4,16,64 \\
        --num-prompts 64 --input-len 256 --output-len 128 --out bench_out/online
    python -m loadtest ... --request-rate 1,2,4,8          # open loop: Poisson arrivals, req/s per level
    python -m loadtest compare ours/results.json vllm/results.json --out bench_out/compare
    python -m loadtest --workload multiturn --model models/tiny-llama   # routers on chats: loadtest/multiturn.py
    python -m loadtest --workload spec --model models/smollm2-135m-instruct  # speculation: loadtest/online_spec.py

Per concurrency level: TTFT, ITL, TPOT and end-to-end latency (p50/p90/p99),
request and output-token throughput, errors. Writes DIR/results.json and two
PNG plots, and prints a table with the knee last (see loadtest.stats.find_knee:
the last concurrency before p50 latency grows faster than throughput).
"""
from __future__ import annotations

import argparse
import asyncio
import sys
from pathlib import Path

from loadtest.online import OnlineConfig, run_sweep
from loadtest.plots import write_plots
from loadtest.report import base_metadata, format_table, write_json


def _int_list(text: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None


def _float_list(text: str) -> list[float]:
    try:
        return [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers, got {text!r}") from None


def parse_args(argv: list[str]) -> OnlineConfig:
    ap = argparse.ArgumentParser(prog="python -m loadtest", description=__doc__.splitlines()[0])
    ap.add_argument("--base-url", required=True, help="e.g. http://127.0.0.1:8000 (with or without /v1)")
    ap.add_argument("--model", required=True)
    ap.add_argument("--concurrency", type=_int_list, default=None,
                    help="closed loop: clients per level (default 1,4,16,64)")
    ap.add_argument("--request-rate", type=_float_list, default=None,
                    help="open loop: Poisson arrivals, requests/s per level, in this order (1,4,8,4,1 is a ramp; "
                         "inf: all at once)")
    ap.add_argument("--max-concurrency", type=int, default=None, help="open loop: cap on requests in flight")
    ap.add_argument("--num-prompts", type=int, default=64, help="requests per concurrency level")
    ap.add_argument("--input-len", type=int, default=256, help="prompt length in words (~tokens) or token ids")
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--out", type=Path, default=Path("bench_out/online"))
    ap.add_argument("--api-key", default=None)
    ap.add_argument("--endpoint", choices=["completions", "chat"], default="completions")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--request-timeout", type=float, default=300.0, help="seconds per request")
    ap.add_argument("--token-ids", action="store_true", help="send prompts as token-id lists (completions)")
    ap.add_argument("--num-warmup", type=int, default=1, help="untimed requests before the first level")
    args = ap.parse_args(argv)
    if args.request_rate is not None and args.concurrency is not None:
        ap.error("--concurrency (closed loop) and --request-rate (open loop) are exclusive: give one")
    if args.max_concurrency is not None and args.request_rate is None:
        ap.error("--max-concurrency caps an open-loop run: it needs --request-rate")
    try:
        return OnlineConfig(base_url=args.base_url, model=args.model, concurrency=args.concurrency or [1, 4, 16, 64],
                            request_rates=args.request_rate, max_concurrency=args.max_concurrency,
                            num_prompts=args.num_prompts, input_len=args.input_len,
                            output_len=args.output_len, out_dir=args.out, endpoint=args.endpoint,
                            api_key=args.api_key, seed=args.seed, request_timeout=args.request_timeout,
                            token_ids=args.token_ids, num_warmup=args.num_warmup)
    except ValueError as exc:
        ap.error(str(exc))


def _ms(summary: dict, q: str) -> float | str:
    return "-" if summary[q] is None else summary[q] * 1e3


def summary_table(results: dict) -> str:
    kind = results["knee"]["load"]
    rows = [[lv[kind], f"{lv['num_completed']}/{lv['num_errors']}", lv["request_throughput"],
             lv["output_token_throughput"], _ms(lv["ttft_s"], "p50"), _ms(lv["ttft_s"], "p99"),
             _ms(lv["tpot_s"], "p50"), _ms(lv["itl_s"], "p50"), _ms(lv["e2e_s"], "p50"), _ms(lv["e2e_s"], "p99")]
            for lv in results["levels"]]
    header = ["conc" if kind == "concurrency" else "req/s in", "ok/err", "req/s", "out tok/s", "TTFT p50 ms",
              "TTFT p99 ms", "TPOT p50 ms", "ITL p50 ms", "E2E p50 ms", "E2E p99 ms"]
    knee = results["knee"]
    mark = "" if knee["reached"] else " (not reached: beyond the sweep)"
    return f"{format_table(header, rows)}\nknee: {kind} {knee[kind]:g}{mark} -- {knee['reason']}"


def redact(argv: list[str]) -> list[str]:
    """The command line as recorded in results.json, without the API key."""
    out, hide_next = [], False
    for arg in argv:
        out.append("***" if hide_next else ("--api-key=***" if arg.startswith("--api-key=") else arg))
        hide_next = arg == "--api-key"
    return out


def split_workload(argv: list[str]) -> tuple[str, list[str]]:
    """--workload random (the sweep below, the default), multiturn (loadtest/multiturn.py) or spec
    (loadtest/online_spec.py), and the rest."""
    pre = argparse.ArgumentParser(prog="python -m loadtest", add_help=False)
    pre.add_argument("--workload", choices=["random", "multiturn", "spec"], default="random")
    known, rest = pre.parse_known_args(argv)
    return known.workload, rest


def main(argv: list[str] | None = None) -> dict:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["compare"]:
        from loadtest.compare import main as compare

        return {"plots": [p.name for p in compare(argv[1:])]}
    workload, rest = split_workload(argv)
    if workload == "multiturn":
        from loadtest.multiturn import main as multiturn

        return multiturn(rest, ["python", "-m", "loadtest", *redact(argv)])
    if workload == "spec":
        from loadtest.online_spec import main as online_spec

        return online_spec(rest, ["python", "-m", "loadtest", *redact(argv)])
    cfg = parse_args(rest)
    results = base_metadata(["python", "-m", "loadtest", *redact(argv)])
    try:
        results.update(asyncio.run(run_sweep(cfg)))
    except RuntimeError as exc:  # the warm-up could not reach the server
        sys.exit(f"loadtest: {exc}")
    cfg.out_dir.mkdir(parents=True, exist_ok=True)
    results["plots"] = [p.name for p in write_plots(results, cfg.out_dir)]
    write_json(cfg.out_dir / "results.json", results)
    print(f"wrote {cfg.out_dir / 'results.json'} and {', '.join(results['plots'])}")
    print(summary_table(results))
    return results


if __name__ == "__main__":
    main()
