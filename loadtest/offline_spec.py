"""Speculative decoding, offline: the engine with drafts against the same engine without, one run.

    python -m loadtest.offline --speculative ngram [--concurrency 1,4,16] [--num-requests 16] [--rounds 3] [--quick]
        [--device cpu|cuda] [--dtype float32] [--async-scheduling auto|on|off]

Two workloads (loadtest.workload): `copy` (prompts that repeat a span, decoded greedily: text
that repeats itself; a random-weight model copies nothing it reads, so its drafts come from the
n-grams its own greedy text repeats) and `random` (random prompts sampled at temperature 1: text
that never repeats, so drafts are rejected and the acceptance guard must keep the cost small). At
each concurrency c the requests are fed to the engine keeping c in flight (a new one as each
finishes); both engines run the same requests, interleaved (`--rounds` times, each engine going
first in turn: its fastest round counts), each after its own warm-up. Reported per (workload, c): output tokens/s of
each, the speed-up, the acceptance rate (accepted / draft tokens), the mean acceptance length
(1 + accepted / drafts: tokens per verification) and, for the greedy workload, how many requests'
tokens differ (must be 0). `--model` runs a real checkpoint instead of the random bench model.
"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch

from loadtest.measure import run_metadata
from loadtest.ours import shutdown
from loadtest.report import Stopwatch, format_table, write_json
from loadtest.workload import BenchRequest, make_copy_workload, make_offline_workload

WORKLOADS = {"copy": (make_copy_workload, 0.0), "random": (make_offline_workload, 1.0)}  # (make, temperature)


def progress(message: str) -> None:
    print(f"[loadtest.offline_spec] {message}", file=sys.stderr, flush=True)


def run_at_concurrency(llm, requests: list[BenchRequest], temperature: float, concurrency: int,
                       seed: int) -> tuple[float, list[list[int]]]:
    """Feed `requests` keeping `concurrency` in flight; (wall seconds, each request's token ids)."""
    from engine import RequestOutputKind, SamplingParams

    engine = llm.llm_engine
    pending = list(enumerate(requests))[::-1]  # popped from the end: input order
    results: dict[int, list[int]] = {}
    in_flight = 0
    with Stopwatch() as watch:
        while pending or in_flight:
            while pending and in_flight < concurrency:
                i, r = pending.pop()
                params = SamplingParams(temperature=temperature, seed=seed + i, max_tokens=r.max_tokens,
                                        ignore_eos=True, output_kind=RequestOutputKind.FINAL_ONLY)
                engine.add_request(f"spec-bench-{i}", {"prompt_token_ids": r.prompt_token_ids}, params)
                in_flight += 1
            for out in engine.step():
                if out.finished:
                    results[int(out.request_id.rsplit("-", 1)[1])] = list(out.outputs[0].token_ids)
                    in_flight -= 1
    token_ids = [results[i] for i in range(len(requests))]
    if any(len(t) != r.max_tokens for t, r in zip(token_ids, requests)):
        raise RuntimeError("a request returned the wrong number of tokens")  # never count tokens not made
    return watch.wall_s, token_ids


def spec_counters(llm) -> dict[str, float]:
    stats = llm.llm_engine.get_stats()
    return {k: stats.get(f"spec_decode_num_{k}", 0) for k in ("drafts", "draft_tokens", "accepted_tokens")}


def measure(engines: dict, args) -> list[dict]:
    """Every (workload, concurrency) on both engines, interleaved."""
    rows = []
    for workload in args.workloads:
        make, temperature = WORKLOADS[workload]
        for c in args.concurrency:
            requests = make(args.num_requests, args.seed + c, args.vocab_limit, args.prompt_len, args.output_len)
            useful = sum(r.max_tokens for r in requests)
            row = {"workload": workload, "concurrency": c, "temperature": temperature,
                   "num_requests": len(requests), "num_output_tokens": useful}
            before = spec_counters(engines["spec"])
            for i in range(args.rounds):  # interleaved, each going first in turn; its fastest round counts
                for name, llm in (list(engines.items()) if i % 2 == 0 else list(engines.items())[::-1]):
                    wall_s, token_ids = run_at_concurrency(llm, requests, temperature, c, args.seed)
                    progress(f"{workload} c={c} {name}: {useful / wall_s:.1f} tok/s")
                    if name not in row or wall_s < row[name]["elapsed_s"]:
                        row[name] = {"elapsed_s": wall_s, "tokens_per_s": useful / wall_s, "token_ids": token_ids}
            after = spec_counters(engines["spec"])
            row.update(_acceptance({k: (after[k] - before[k]) / args.rounds for k in after}))
            row["speedup"] = row["spec"]["tokens_per_s"] / row["baseline"]["tokens_per_s"]
            if temperature == 0:
                row["greedy_mismatches"] = sum(a != b for a, b in zip(row["spec"]["token_ids"],
                                                                       row["baseline"]["token_ids"]))
            for name in engines:
                del row[name]["token_ids"]
            rows.append(row)
    return rows


def _acceptance(delta: dict[str, float]) -> dict:
    drafts, draft_tokens, accepted = delta["drafts"], delta["draft_tokens"], delta["accepted_tokens"]
    return {"num_drafts": drafts, "num_draft_tokens": draft_tokens, "num_accepted_tokens": accepted,
            "acceptance_rate": accepted / draft_tokens if draft_tokens else 0.0,
            "mean_acceptance_length": 1 + accepted / drafts if drafts else 1.0}


def build_engines(model_path: Path, args) -> dict:
    from engine import LLM

    engines = {name: LLM(**engine_kwargs(model_path, args, spec)) for name, spec in (("baseline", False), ("spec", True))}
    warmup = make_copy_workload(2, args.seed + 999, args.vocab_limit, (16, 32), (8, 8))
    for llm in engines.values():
        run_at_concurrency(llm, warmup, 0.0, 2, args.seed)
    return engines


def engine_kwargs(model_path: Path, args: argparse.Namespace, spec: bool) -> dict:
    """LLM's arguments for the baseline or the speculating engine: the same but speculative_config."""
    kwargs = dict(model=str(model_path), dtype=args.dtype, device=args.device, max_num_seqs=max(args.concurrency),
                  seed=args.seed, async_scheduling={"auto": None, "on": True, "off": False}[args.async_scheduling])
    if spec:
        kwargs["speculative_config"] = speculative_config(args)
    return kwargs


def speculative_config(args: argparse.Namespace) -> dict:
    """The engine's `speculative_config` from the flags `add_speculation_args` adds."""
    if args.speculative == "draft":
        return {"method": "draft_model", "num_speculative_tokens": args.num_speculative_tokens,
                "model": str(args.draft_model)}
    return {"method": "ngram", "num_speculative_tokens": args.num_speculative_tokens,
            "prompt_lookup_min": args.prompt_lookup_min, "prompt_lookup_max": args.prompt_lookup_max}


def add_speculation_args(ap: argparse.ArgumentParser) -> None:
    """The flags both speculation benchmarks take (offline here, served in loadtest/online_spec.py)."""
    ap.add_argument("--num-speculative-tokens", type=int, default=4)
    ap.add_argument("--prompt-lookup-min", type=int, default=2)
    ap.add_argument("--prompt-lookup-max", type=int, default=4)
    ap.add_argument("--draft-model", type=Path, default=None, help="--speculative draft: the draft checkpoint")
    ap.add_argument("--workloads", default="copy,random", help=f"comma-separated, of {sorted(WORKLOADS)}")
    ap.add_argument("--num-requests", type=int, default=16, help="per workload and concurrency")
    ap.add_argument("--seed", type=int, default=0)


def summary_table(rows: list[dict]) -> str:
    table = [[r["workload"], r["concurrency"], r["baseline"]["tokens_per_s"], r["spec"]["tokens_per_s"],
              f"x{r['speedup']:.2f}", r["acceptance_rate"], r["mean_acceptance_length"],
              r.get("greedy_mismatches", "-")] for r in rows]
    return format_table(["workload", "concurrency", "baseline tok/s", "spec tok/s", "speed-up",
                         "acceptance rate", "mean acceptance length", "greedy mismatches"], table)


def parse_args(argv: list[str]) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m loadtest.offline --speculative",
                                 description=__doc__.splitlines()[0])
    ap.add_argument("--speculative", choices=("ngram", "draft"), required=True)
    add_speculation_args(ap)
    ap.add_argument("--concurrency", default="1,4,16", help="requests in flight, comma-separated")
    ap.add_argument("--rounds", type=int, default=1, help="timed runs of each engine per level, interleaved")
    ap.add_argument("--quick", action="store_true", help="a small workload for a smoke test")
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    ap.add_argument("--dtype", default="float32", help="both engines' dtype (auto: the engine's default)")
    ap.add_argument("--async-scheduling", choices=("auto", "on", "off"), default="auto",
                    help="both engines' overlapped scheduling (auto: the engine's default, on for CUDA)")
    ap.add_argument("--model", default=None, help="a checkpoint instead of the bench model")
    ap.add_argument("--model-dir", type=Path, default=Path("bench_out/model-bench"))
    ap.add_argument("--out", type=Path, default=Path("bench_out/offline_spec.json"))
    args = ap.parse_args(argv)
    args.concurrency = [int(c) for c in args.concurrency.split(",")]
    args.workloads = args.workloads.split(",")
    if any(w not in WORKLOADS for w in args.workloads) or min(args.concurrency) < 1 or min(args.num_requests,
                                                                                          args.rounds) < 1:
        ap.error("--workloads must name known workloads; --concurrency, --num-requests, --rounds must be >= 1")
    if args.speculative == "draft" and args.draft_model is None:
        ap.error("--speculative draft needs --draft-model")
    args.prompt_len, args.output_len = ((32, 64), (16, 32)) if args.quick else ((64, 256), (64, 128))
    if args.quick:
        args.num_requests = min(args.num_requests, 4)
    return args


def main(argv: list[str]) -> dict:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    if args.model:
        from engine.loader.model_path import resolve_model_path

        model_path = resolve_model_path(args.model)
    else:
        from loadtest.offline import ensure_bench_model

        model_path = ensure_bench_model(args.model_dir)
    from loadtest.workload import prompt_id_limit

    args.vocab_limit = prompt_id_limit(model_path)
    engines = build_engines(model_path, args)
    try:
        rows = measure(engines, args)
    finally:
        for llm in engines.values():
            shutdown(llm)
    report = run_metadata(["python", "-m", "loadtest.offline", *argv])
    report.update({"benchmark": f"offline_spec_{args.device}", "speculative": args.speculative,
                   "dtype": args.dtype, "async_scheduling": args.async_scheduling,
                   "num_speculative_tokens": args.num_speculative_tokens, "model": str(model_path),
                   "prompt_len_range": list(args.prompt_len), "output_len_range": list(args.output_len),
                   "results": rows})
    write_json(args.out, report)
    print(f"wrote {args.out}")
    print(summary_table(rows))
    return report
