"""CPU offline throughput: our engine against HF static batching on the ~20M bench model.

    python -m loadtest.offline [--num-requests 64] [--seed 0] [--skip-hf] [--quick]
    python -m loadtest.offline --model models/smollm2-135m-instruct    # a real checkpoint (HF dir or GGUF)
    python -m loadtest.offline --arch qwen3_moe      # the bench shape as another architecture (MoE: 8 experts, top-2)
    python -m loadtest.offline --skip-hf --dtype float32,bfloat16 --quantization none,int8,w8a8 --rounds 2
                                                     # our engine in each dtype x quantization, interleaved
                                                     # (w8a8: the model written once as a compressed-tensors
                                                     # INT8 W8A8 checkpoint beside it, and loaded from there)
    python -m loadtest.offline --lora 4 --rounds 3   # 4 LoRA adapters against the base model (loadtest/offline_lora.py)
    python -m loadtest.offline --speculative ngram   # speculative decoding vs none (loadtest.offline_spec)

docs/benchmarks.md "CPU, offline throughput": 64 requests, prompts of random ids with
length U[16, 256], outputs U[16, 128] (ignore_eos, greedy), all submitted at once.
The figure is useful output tokens per second of wall time, model loading
excluded, one warm-up before. The peer is HF `generate` at its best static
batching (FIFO batches of 64, and batches of 16 sorted by output length; the
faster counts). The limit is the workload's matmul FLOPs (loadtest.roofline)
at the fp32 rate of a 2048 x 2048 product measured in this run.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch

from loadtest import offline_lora
from loadtest.hf_peer import compare_tokens, hf_greedy_reference, hf_static, load_hf_model
from loadtest.measure import matmul_flop_rate, run_metadata
from loadtest.ours import shutdown, timed_engine_run
from loadtest.report import Stopwatch, format_table, write_json
from loadtest.roofline import ModelShape, workload_flops
from loadtest.workload import BenchRequest, make_offline_workload, num_useful_tokens

PROMPT_LEN, OUTPUT_LEN = (16, 256), (16, 128)
QUICK_PROMPT_LEN, QUICK_OUTPUT_LEN = (16, 64), (8, 32)
NUM_REFERENCE_REQUESTS = 4  # greedy cross-check against HF: a bare loop per request is slow


def progress(message: str) -> None:
    """A line on stderr as each phase ends: a full run takes minutes on a small CPU."""
    print(f"[loadtest.offline] {message}", file=sys.stderr, flush=True)


def ensure_bench_model(cache_dir: Path, arch: str = "llama") -> Path:
    """The bench checkpoint, built once into `cache_dir` (a config.json marks it complete)."""
    if not (cache_dir / "config.json").is_file():
        from engine.tools.tiny_model import make_tiny_model

        make_tiny_model(cache_dir, arch=arch, preset="bench", seed=0)
    return cache_dir


def ensure_w8a8_model(model_path: Path) -> Path:
    """The checkpoint as compressed-tensors INT8 W8A8 (engine.tools.w8a8_checkpoint: weights per
    channel, activations per token), written once beside it (a config.json marks it complete)."""
    out = model_path.parent / f"{model_path.name}-w8a8"
    if not (out / "config.json").is_file():
        from engine.tools.w8a8_checkpoint import write_w8a8_checkpoint

        write_w8a8_checkpoint(model_path, out)
    return out


def engine_source(model_path: Path, quant: str) -> tuple[Path, str | None]:
    """(the checkpoint to load, LLM's `quantization`) for one --quantization value: int8 quantizes
    at load; w8a8 is a checkpoint format, read from its quantization_config."""
    if quant == "w8a8":
        return ensure_w8a8_model(model_path), None
    return model_path, None if quant == "none" else quant


def variant_name(dtype: str, quantization: str) -> str:
    return dtype if quantization == "none" else f"{dtype}+{quantization}"


def weight_bytes(llm) -> int:
    """Bytes of the model's parameters and buffers, oneDNN-packed weights included (one process)."""
    model = llm.llm_engine.executor.runner.model
    tensors = [*model.parameters(), *model.buffers()]
    tensors += [m.packed_weight for m in model.modules() if getattr(m, "packed_weight", None) is not None]
    return sum(t.numel() * t.element_size() for t in tensors)


def run_ours(model_path: Path, requests: list[BenchRequest], warmup: list[BenchRequest],
             args) -> dict[str, dict]:
    """Each (dtype, quantization) variant's wall time over every request, after the warm-up
    requests. Every variant's engine is built first, then the rounds run them in turn, so a slow
    moment of a shared machine falls on all of them alike; each variant's fastest round counts."""
    from engine import LLM

    engines = {}
    try:
        for dtype in args.dtype:
            for quant in args.quantization:
                path, quantization = engine_source(model_path, quant)
                engines[variant_name(dtype, quant)] = LLM(
                    model=str(path), dtype=dtype, device="cpu", max_num_seqs=256, quantization=quantization,
                    max_num_batched_tokens=args.max_num_batched_tokens, enable_prefix_caching=True,
                    seed=args.seed, num_kv_blocks=args.num_kv_blocks, kv_offload_gb=args.kv_offload_gb)
        results = {name: {"weight_bytes": weight_bytes(llm)} for name, llm in engines.items()}
        for _ in range(args.rounds):
            for name, llm in engines.items():
                watch, token_ids = timed_engine_run(llm, requests, warmup)
                progress(f"ours {name}: {watch.wall_s:.1f} s")
                best = results[name].get("watch")
                if best is None or watch.wall_s < best.wall_s:
                    results[name].update(watch=watch, token_ids=token_ids)
        return results
    finally:
        for llm in engines.values():
            shutdown(llm)


def run_hf(model, requests: list[BenchRequest], warmup: list[BenchRequest], skip_timed: bool) -> dict:
    """Both static-batching settings, after the same warm-up requests as ours."""
    if skip_timed:
        return {}
    hf_static(model, warmup, batch_size=len(warmup), sort_by_output=False, name="warmup")
    results = {}
    for name, batch_size, sort in (("hf_fifo64", 64, False), ("hf_sorted16", 16, True)):
        results[name] = hf_static(model, requests, batch_size, sort, name).to_dict()
        progress(f"{name}: {results[name]['elapsed_s']:.1f} s")
    return results


def variants_report(variants: dict[str, dict], reference: list, useful: int) -> dict:
    """tokens/s, weight MB and greedy mismatches against HF fp32 per variant, and each one's
    speed relative to the first (the baseline)."""
    out, base = {}, None
    for name, v in variants.items():
        tps = useful / v["watch"].wall_s
        base = base or tps
        out[name] = {"elapsed_s": v["watch"].wall_s, "cpu_s": v["watch"].cpu_s, "tokens_per_s": tps,
                     "vs_first": tps / base, "weight_mb": v["weight_bytes"] / 2**20,
                     "greedy": compare_tokens(v["token_ids"][:len(reference)], reference)}
    return out


def build_report(args, requests, shape: ModelShape, flop_rate: float, ours: Stopwatch,
                 peers: dict, correctness: dict) -> dict:
    flops = workload_flops(shape, [(len(r.prompt_token_ids), r.max_tokens) for r in requests])
    limit_s = flops["total"] / flop_rate
    useful = num_useful_tokens(requests)
    best = max(peers.values(), key=lambda p: p["tokens_per_s"], default=None)
    for peer in peers.values():
        peer["fraction_of_limit"] = limit_s / peer["elapsed_s"]
    return {
        "benchmark": "offline_cpu",
        "workload": {"num_requests": len(requests), "seed": args.seed,
                     "prompt_len_range": list(args.prompt_len), "output_len_range": list(args.output_len),
                     "num_prompt_tokens": sum(len(r.prompt_token_ids) for r in requests),
                     "num_useful_output_tokens": useful},
        "model": {"path": args.model or str(args.model_dir), **shape.__dict__,
                  "non_embedding_params": shape.non_embedding_params},
        "matmul_fp32_flop_rate": flop_rate,
        "limit": {"flops": flops, "time_s": limit_s},
        "ours": {"elapsed_s": ours.wall_s, "tokens_per_s": useful / ours.wall_s, "cpu_s": ours.cpu_s,
                 "fraction_of_limit": limit_s / ours.wall_s, "max_num_batched_tokens": args.max_num_batched_tokens,
                 "num_kv_blocks": args.num_kv_blocks, "kv_offload_gb": args.kv_offload_gb},
        "peers": peers,
        "best_peer": best["name"] if best else None,
        "ratio_vs_best_peer": (useful / ours.wall_s) / best["tokens_per_s"] if best else None,
        # On a shared host the wall-time ratio mixes speed with luck; this one divides each
        # side's tokens by the CPU seconds it got (spin-waiting counts as used, so rough).
        "ratio_per_cpu_s": (best["cpu_s"] / ours.cpu_s) if best and best.get("cpu_s") else None,
        "correctness": correctness,
    }


def cpu_share(report: dict, peer: str | None) -> str:
    """The part of `torch_threads` cores the run got: near 1 on an idle machine."""
    run = report["ours"] if peer == "ours" else report["peers"].get(peer)
    if not run or run.get("cpu_s") is None:
        return "-"
    return f"{run['cpu_s'] / (run['elapsed_s'] * report['machine']['torch_threads']):.2f}"


def summary_table(report: dict) -> str:
    peers, ours, machine = report["peers"], report["ours"], report["machine"]
    na = "skipped"
    rows = [["ours tok/s", ours["tokens_per_s"]],
            ["HF fifo64 tok/s", peers.get("hf_fifo64", {}).get("tokens_per_s", na)],
            ["HF sorted16 tok/s", peers.get("hf_sorted16", {}).get("tokens_per_s", na)],
            ["ours / best HF", report["ratio_vs_best_peer"] or na],
            ["fraction of limit", ours["fraction_of_limit"]],
            ["matmul fp32 GFLOP/s", report["matmul_fp32_flop_rate"] / 1e9],
            ["greedy mismatches", "{num_mismatched}/{num_compared}".format(**report["correctness"])],
            ["CPU share ours / best HF", " / ".join(cpu_share(report, p) for p in ("ours", report["best_peer"]))],
            ["ours / best HF per CPU-s", report["ratio_per_cpu_s"] or na],
            *[[f"ours {name} tok/s (x first, weights MB, greedy mismatches)",
               f"{v['tokens_per_s']:.1f} (x{v['vs_first']:.2f}, {v['weight_mb']:.1f} MB, "
               f"{v['greedy']['num_mismatched']}/{v['greedy']['num_compared']})"]
              for name, v in report.get("variants", {}).items()],
            ["machine", f"{machine['platform']}, {machine['cpu_count']} CPUs, load {machine['load_average']}"],
            ["torch threads", machine["torch_threads"]]]
    return format_table(["metric", "value"], rows)


def parse_args(argv: list[str]) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--num-requests", type=int, default=64)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--max-num-batched-tokens", type=int, default=None, help="engine default if unset")
    ap.add_argument("--skip-hf", action="store_true", help="skip the timed HF peers (the greedy check still runs)")
    ap.add_argument("--quick", action="store_true", help="a small workload for a smoke test")
    ap.add_argument("--threads", type=int, default=os.cpu_count(), help="torch threads, same for every peer")
    ap.add_argument("--model", default=None,
                    help="a checkpoint to run instead of the bench model: HF directory, hub id in the cache, "
                         ".gguf file or a directory holding one (engine and HF both run it in float32)")
    ap.add_argument("--arch", default="llama",
                    help="architecture of the bench model (engine.tools.tiny_model's --arch, e.g. qwen3_moe)")
    ap.add_argument("--model-dir", type=Path, default=None,
                    help="where the bench model is built when --model is not given "
                         "(default bench_out/model-bench, or model-bench-ARCH for another --arch)")
    ap.add_argument("--dtype", default="float32",
                    help="our engine's dtypes, comma-separated (float32, bfloat16); the first is the headline")
    ap.add_argument("--quantization", default="none",
                    help="our engine's quantization per dtype, comma-separated (none, int8: W8A16 quantized "
                         "at load, w8a8: a compressed-tensors INT8 W8A8 checkpoint written beside the model)")
    ap.add_argument("--rounds", type=int, default=1, help="timed runs of each of our variants, interleaved")
    ap.add_argument("--num-kv-blocks", type=int, default=None,
                    help="our engine's KV pool in blocks (engine default: from cpu_kv_cache_gb)")
    ap.add_argument("--kv-offload-gb", type=float, default=None,
                    help="our engine's host KV tier in GiB (engine default: off on CPU); with a small "
                         "--num-kv-blocks, evicted prefix blocks come back from it")
    ap.add_argument("--out", type=Path, default=Path("bench_out/offline.json"))
    offline_lora.add_lora_args(ap)
    args = ap.parse_args(argv)
    offline_lora.check_lora_args(ap, args)
    args.dtype, args.quantization = args.dtype.split(","), args.quantization.split(",")
    for flag, values, allowed in (("--dtype", args.dtype, ("float32", "bfloat16")),
                                  ("--quantization", args.quantization, ("none", "int8", "w8a8"))):
        bad = [v for v in values if v not in allowed]
        if bad:
            ap.error(f"{flag} {','.join(bad)} is not supported (choose from {', '.join(allowed)})")
    if args.rounds < 1:
        ap.error(f"--rounds={args.rounds} must be >= 1")
    if args.num_requests < 1 or args.threads < 1:
        ap.error(f"--num-requests={args.num_requests} and --threads={args.threads} must be >= 1")
    if args.model_dir is None:
        args.model_dir = Path("bench_out/model-bench" + ("" if args.arch == "llama" else f"-{args.arch}"))
    if args.quick:
        args.num_requests = min(args.num_requests, 8)
    args.prompt_len = QUICK_PROMPT_LEN if args.quick else PROMPT_LEN
    args.output_len = QUICK_OUTPUT_LEN if args.quick else OUTPUT_LEN
    return args


def main(argv: list[str] | None = None) -> dict:
    argv = sys.argv[1:] if argv is None else argv
    if any(a == "--speculative" or a.startswith("--speculative=") for a in argv):
        from loadtest.offline_spec import main as speculative_main  # its own workloads and flags

        return speculative_main(argv)
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    if args.model:
        from engine.loader.model_path import resolve_model_path

        model_path = resolve_model_path(args.model)  # a GGUF: its HF view, which both sides load
    else:
        model_path = ensure_bench_model(args.model_dir, args.arch)
    config = json.loads((model_path / "config.json").read_text())
    shape = ModelShape.from_hf_config(config, bytes_per_param=4)
    requests = make_offline_workload(args.num_requests, args.seed, config["vocab_size"],
                                     args.prompt_len, args.output_len)
    if args.lora:
        return offline_lora.run(args, argv, model_path, config, requests, progress)
    warmup = make_offline_workload(2, args.seed + 1, config["vocab_size"], (16, 32), (4, 4))
    flop_rate = matmul_flop_rate(2048, torch.float32, "cpu", repeats=3 if args.quick else 5)
    variants = run_ours(model_path, requests, warmup, args)
    first = next(iter(variants.values()))
    ours, ours_ids = first["watch"], first["token_ids"]
    hf_model = load_hf_model(str(model_path), torch.float32, "cpu")
    checked = requests[:NUM_REFERENCE_REQUESTS]
    reference = [hf_greedy_reference(hf_model, r.prompt_token_ids, r.max_tokens) for r in checked]
    correctness = compare_tokens(ours_ids[:len(checked)], reference)
    peers = run_hf(hf_model, requests, warmup, args.skip_hf)
    # Measured again at the end, the faster counts: a shared machine slows some moments down,
    # and a limit must be what the hardware can do.
    flop_rate = max(flop_rate, matmul_flop_rate(2048, torch.float32, "cpu", repeats=3))
    report = run_metadata(["python", "-m", "loadtest.offline", *argv])
    report.update(build_report(args, requests, shape, flop_rate, ours, peers, correctness))
    if len(variants) > 1:
        report["variants"] = variants_report(variants, reference, num_useful_tokens(requests))
    write_json(args.out, report)
    print(f"wrote {args.out}")
    print(summary_table(report))
    return report


if __name__ == "__main__":
    main()
