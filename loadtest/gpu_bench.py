"""GPU offline throughput: docs/benchmarks.md workloads A and B against HF static and continuous batching.

    python -m loadtest.gpu_bench [--workload A|B|both] [--num-requests 256] [--quick]
                                 [--peers ours,hf_static,hf_cb] [--hf-batch-sizes 128,64]

Builds the random-weight bf16 checkpoint on the device (cached under
--cache-dir), measures copy bandwidth and the bf16 matmul rate, then runs every
peer in a child process of its own (see loadtest.gpu_peers) on the same
requests. The limit is loadtest.roofline.gpu_limit_seconds. One workload with
all peers takes minutes; on a device with a 10-minute command cap, run A and B
as separate commands. Without CUDA it prints "needs CUDA" and exits 0.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from loadtest.report import base_metadata, format_table, write_json
from loadtest.roofline import ModelShape, gpu_limit_seconds
from loadtest.workload import BenchRequest, make_offline_workload, num_useful_tokens


@dataclass(frozen=True)
class Workload:
    name: str
    preset: str                    # engine.tools.tiny_model preset of the random-weight checkpoint
    prompt_len: tuple[int, int]    # closed range, uniform
    output_len: tuple[int, int]
    note: str = ""


WORKLOADS = {
    "A": Workload("A", "qwen3-0.6b", (100, 1024), (100, 1024),
                  note="nano-vllm reports 1434 tok/s and vLLM 1362 tok/s on a laptop RTX 4070"),
    "B": Workload("B", "llama-8b", (100, 1024), (100, 1024)),
}
QUICK_LEN = (32, 128)
PEER_NAMES = ["ours", "ours_sync", "hf_static", "hf_cb"]  # loadtest.gpu_peers.PEERS, named here without importing torch
QUICK_NUM_REQUESTS = 32


def workload_requests(workload: Workload, num_requests: int, seed: int, vocab_size: int,
                      quick: bool) -> tuple[list[BenchRequest], list[BenchRequest]]:
    """The timed requests and a small warm-up set drawn with another seed."""
    prompt_len, output_len = (QUICK_LEN, QUICK_LEN) if quick else (workload.prompt_len, workload.output_len)
    requests = make_offline_workload(num_requests, seed, vocab_size, prompt_len, output_len)
    warmup = make_offline_workload(4, seed + 1, vocab_size, (16, 64), (8, 8))
    return requests, warmup


def ensure_checkpoint(cache_dir: Path, preset: str) -> Path:
    path = cache_dir / f"model-{preset}"
    if not (path / "config.json").is_file():
        from engine.tools.tiny_model import make_tiny_model

        make_tiny_model(path, preset=preset, seed=0)
    return path


def spawn_child(child: str, args, workload: str | None = None, batch_size: int | None = None) -> dict:
    """Run `--child CHILD` in a fresh interpreter; its JSON result, or an `error` entry."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "result.json"
        cmd = [sys.executable, "-m", "loadtest.gpu_bench", "--child", child, "--child-out", str(out),
               "--num-requests", str(args.num_requests), "--seed", str(args.seed),
               "--cache-dir", str(args.cache_dir), "--peer-timeout", str(args.peer_timeout)]
        cmd += ["--workload", workload] if workload else []
        cmd += ["--batch-size", str(batch_size)] if batch_size else []
        cmd += ["--quick"] if args.quick else []
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=args.peer_timeout)
        except subprocess.TimeoutExpired:
            return {"name": child, "error": f"timed out after {args.peer_timeout} s"}
        if proc.returncode != 0 or not out.is_file():
            tail = (proc.stderr or proc.stdout)[-1500:]
            return {"name": child, "error": f"exit code {proc.returncode}: {tail}"}
        return json.loads(out.read_text())


def run_workload(workload: Workload, args, rates: dict) -> dict:
    model_path = ensure_checkpoint(args.cache_dir, workload.preset)
    config = json.loads((model_path / "config.json").read_text())
    shape = ModelShape.from_hf_config(config, bytes_per_param=2)
    requests, _ = workload_requests(workload, args.num_requests, args.seed, config["vocab_size"], args.quick)
    lengths = [(len(r.prompt_token_ids), r.max_tokens) for r in requests]
    limit = gpu_limit_seconds(shape, lengths, rates["copy_bandwidth"], rates["bf16_flop_rate"])
    peers = {}
    for peer in args.peers:
        for batch_size in (args.hf_batch_sizes if peer == "hf_static" else [None]):
            key = f"{peer}_bs{batch_size}" if batch_size else peer
            peers[key] = spawn_child(peer, args, workload.name, batch_size) | {"name": key}
    for result in peers.values():
        if "error" not in result:
            result["fraction_of_limit"] = limit["total_s"] / result["elapsed_s"]
    return {"workload": workload.__dict__ | {"num_requests": len(requests), "seed": args.seed,
                                             "quick": args.quick, "num_useful_tokens": num_useful_tokens(requests),
                                             "num_prompt_tokens": sum(p for p, _ in lengths)},
            "model": shape.__dict__, "limit": limit | {"tokens_per_s": num_useful_tokens(requests) / limit["total_s"]},
            "peers": peers, "comparison": compare(peers)}


def compare(peers: dict) -> dict:
    """Ours over the best static batch size, over continuous batching, and over the best peer."""
    ok = {name: p for name, p in peers.items() if "error" not in p}
    ours = ok.get("ours")
    static = [p for name, p in ok.items() if name.startswith("hf_static")]
    best_static = max(static, key=lambda p: p["tokens_per_s"], default=None)
    best_peer = max((p for name, p in ok.items() if name != "ours"), key=lambda p: p["tokens_per_s"], default=None)

    def ratio(peer):
        return ours["tokens_per_s"] / peer["tokens_per_s"] if ours and peer else None

    return {"best_hf_static": best_static and best_static["name"], "vs_best_hf_static": ratio(best_static),
            "vs_hf_cb": ratio(ok.get("hf_cb")), "best_peer": best_peer and best_peer["name"],
            "vs_best_peer": ratio(best_peer)}


def summary_table(report: dict) -> str:
    rows = []
    for name, wl in report["workloads"].items():
        ours = wl["peers"].get("ours", {})
        for peer_name, peer in wl["peers"].items():
            if "error" in peer:
                last_line = (peer["error"].strip().splitlines() or ["failed"])[-1]
                rows.append([name, peer_name, "-", "-", "-", last_line[:60]])
                continue
            vs = ours["tokens_per_s"] / peer["tokens_per_s"] if "tokens_per_s" in ours else "-"
            rows.append([name, peer_name, peer["tokens_per_s"], vs, peer["fraction_of_limit"], ""])
        rows.append([name, "limit", wl["limit"]["tokens_per_s"], "-", 1.0, ""])
    table = format_table(["workload", "peer", "tok/s", "ours / peer", "fraction of limit", "note"], rows)
    m, r = report["machine"], report["rates"]
    return (f"{table}\n{m.get('gpu', '?')}: copy {r['copy_bandwidth'] / 1e9:,.0f} GB/s, "
            f"bf16 matmul {r['bf16_flop_rate'] / 1e12:,.0f} TFLOP/s; torch {m.get('torch')}, "
            f"transformers {m.get('transformers')}")


def _int_list(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def parse_args(argv: list[str]) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m loadtest.gpu_bench", description=__doc__.splitlines()[0])
    ap.add_argument("--workload", choices=["A", "B", "both"], default="both")
    ap.add_argument("--num-requests", type=int, default=256)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--quick", action="store_true", help=f"{QUICK_NUM_REQUESTS} short requests: a smoke test")
    ap.add_argument("--peers", type=lambda t: t.split(","), default=["ours", "hf_static", "hf_cb"])
    ap.add_argument("--hf-batch-sizes", type=_int_list, default=[128, 64],
                    help="static batch sizes to try; the fastest counts (out-of-memory ones are skipped)")
    ap.add_argument("--peer-timeout", type=float, default=900.0, help="seconds per peer, loading included")
    ap.add_argument("--cache-dir", type=Path, default=Path("bench_out"))
    ap.add_argument("--out", type=Path, default=Path("bench_out/gpu.json"))
    ap.add_argument("--child", choices=["measure", *PEER_NAMES], help=argparse.SUPPRESS)
    ap.add_argument("--child-out", type=Path, help=argparse.SUPPRESS)
    ap.add_argument("--batch-size", type=int, default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    unknown = set(args.peers) - set(PEER_NAMES)
    if unknown:
        ap.error(f"--peers has unknown names {sorted(unknown)}; choose from {PEER_NAMES}")
    if args.num_requests < 1 or any(b < 1 for b in args.hf_batch_sizes):
        ap.error("--num-requests and --hf-batch-sizes must be >= 1")
    if args.quick:
        args.num_requests = min(args.num_requests, QUICK_NUM_REQUESTS)
        args.hf_batch_sizes = args.hf_batch_sizes[:1]
    return args


def run_child(args, argv: list[str]) -> None:
    """Inside the child: one measurement or one peer, its result to --child-out."""
    from loadtest import gpu_peers

    if args.child == "measure":
        result = gpu_peers.measure_machine(argv)
    else:
        workload = WORKLOADS[args.workload]
        model_path = ensure_checkpoint(args.cache_dir, workload.preset)
        vocab = json.loads((model_path / "config.json").read_text())["vocab_size"]
        requests, warmup = workload_requests(workload, args.num_requests, args.seed, vocab, args.quick)
        result = gpu_peers.run_peer(args.child, str(model_path), requests, warmup, args.batch_size,
                                    args.peer_timeout)
    write_json(args.child_out, result)


def main(argv: list[str] | None = None) -> dict | None:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    import torch

    if not torch.cuda.is_available():  # does not create a CUDA context in this process
        print("needs CUDA: no GPU visible, nothing run")
        return None
    if args.child:
        run_child(args, argv)
        return None
    rates = spawn_child("measure", args)
    if "error" in rates:
        sys.exit(f"gpu_bench: measuring the machine failed: {rates['error']}")
    report = base_metadata(["python", "-m", "loadtest.gpu_bench", *argv])
    report["machine"].update(rates.pop("machine"))
    report["rates"] = rates
    names = ["A", "B"] if args.workload == "both" else [args.workload]
    report["workloads"] = {}
    for name in names:
        report["workloads"][name] = run_workload(WORKLOADS[name], args, rates)
        write_json(args.out, report)  # after each workload: a later crash keeps what was measured
    print(f"wrote {args.out}")
    print(summary_table(report))
    return report


if __name__ == "__main__":
    main()
