"""Batch job throughput: `python -m serve_app.batch`'s pipeline against `engine.LLM.generate`.

    python -m loadtest.batch_bench [--num-rows 1024] [--input-words 32] [--max-tokens 64] [--quick]
                                   [--device cpu|cuda] [--model DIR] [--rounds 3]

The same prompts (random words, greedy, a fixed max_tokens) two ways, on the ~22M bench model
(or --model):
    peer    engine.LLM.generate on all prompts in this process (model loading excluded, one warm-up)
    batch   run_job: JSONL in -> checks -> Ray Data preprocess -> one engine actor -> shards out,
            end to end (reading, the up-front row checks, actor start and model load included;
            ray.init excluded), in a local Ray cluster started by this process
Figures: rows/s and generated tokens/s; the ratio batch / peer (the issue's target: >= 0.85 with
one actor). --rounds N runs the pair N times, the first of each pair alternating, and prints the
medians of the rounds' ratios (the CPU box's speed drifts by tens of percent over minutes: a
ratio of two runs far apart carries it whole). The outputs are compared row by row (greedy:
they must be equal). On CUDA the batch job runs first, so that its actor's process has the GPU
to itself and gives it back before the peer loads; there the count of equal rows is reported,
not required: bf16 matrix products differ with the batch's size, and the two paths batch the
rows differently.
"""
from __future__ import annotations

import argparse
import gc
import json
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

from loadtest.report import base_metadata, format_table, write_json
from loadtest.workload import make_word_prompts


def progress(message: str) -> None:
    print(f"[loadtest.batch_bench] {message}", file=sys.stderr, flush=True)


def run_peer(model: str, prompts: list[str], max_tokens: int, device: str) -> tuple[float, list[str], int]:
    from engine import LLM, SamplingParams
    llm = LLM(model, device=device)
    params = SamplingParams(max_tokens=max_tokens, temperature=0)
    llm.generate(prompts[:8], params, use_tqdm=False)  # warm-up
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    wall = time.perf_counter() - start
    texts = [o.outputs[0].text for o in outs]
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    llm.llm_engine.shutdown()
    return wall, texts, tokens


def run_batch(model: str, src: str, out: str, max_tokens: int, batch_size: int, device: str):
    import ray

    from serve_app.batch import BatchConfig, run_job, shards
    from serve_app.batch.cluster import init_ray
    init_ray("local")  # as the CLI starts its cluster
    try:
        config = BatchConfig(model=model, device=device, max_tokens=max_tokens, batch_size=batch_size)
        summary = run_job(config, src, out, progress=False)
    finally:
        ray.shutdown()
    rows = {r["id"]: r["text"] for r in shards.read_rows(out)}
    return summary, [rows[i] for i in range(len(rows))]


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", help="checkpoint directory (default: the bench preset, built here)")
    p.add_argument("--num-rows", type=int, default=1024)
    p.add_argument("--input-words", type=int, default=32)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--batch-size", type=int, default=256)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--rounds", type=int, default=1,
                   help="run the pair this many times, alternating which goes first; medians of the rounds' ratios")
    p.add_argument("--quick", action="store_true", help="64 rows, 16 tokens: a smoke run")
    p.add_argument("--out", default="bench_out/batch_bench.json")
    args = p.parse_args(argv)
    for name in ("num_rows", "input_words", "max_tokens", "batch_size", "rounds"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')}={getattr(args, name)} must be >= 1")
    if args.quick:
        args.num_rows, args.max_tokens = 64, 16
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    work = Path(tempfile.mkdtemp(prefix="batch-bench-"))
    try:
        return run(args, work)
    finally:
        shutil.rmtree(work, ignore_errors=True)  # the bench model and the job's shards


def run(args: argparse.Namespace, work: Path) -> int:
    model = args.model
    if model is None:
        from engine.tools.tiny_model import make_tiny_model
        model = str(make_tiny_model(work / "model", preset="bench", seed=0))
    prompts = make_word_prompts(args.num_rows, args.input_words, args.seed)
    src = work / "in.jsonl"
    src.write_text("".join(json.dumps({"prompt": t}) + "\n" for t in prompts))

    def peer():
        progress(f"peer: LLM.generate on {len(prompts)} prompts")
        result = run_peer(model, prompts, args.max_tokens, args.device)
        gc.collect()
        return result

    def batch(k: int):
        progress("batch job: one engine actor")
        result = run_batch(model, str(src), str(work / f"out{k}"), args.max_tokens, args.batch_size, args.device)
        progress(f"batch job: {result[0]}")
        return result

    rounds = []
    for k in range(args.rounds):
        # Alternate which path goes first: the box's speed drifts over minutes, and a pair's
        # ratio compares two runs next to each other. On CUDA the batch job always runs first,
        # so that its actor's process has the GPU to itself and gives it back before the peer loads.
        if args.device == "cuda" or k % 2 == 1:
            summary, batch_texts = batch(k)
            peer_wall, peer_texts, peer_tokens = peer()
        else:
            peer_wall, peer_texts, peer_tokens = peer()
            summary, batch_texts = batch(k)
        same = sum(a == b for a, b in zip(peer_texts, batch_texts))
        rounds.append(round_figures(len(prompts), peer_wall, peer_tokens, summary, same))
        progress(f"round {k + 1}: batch / peer {rounds[-1]['ratio']:.3f}, equal rows {same}/{len(prompts)}")
    combined = combine_rounds(rounds)
    payload = base_metadata(sys.argv) | {
        "workload": {"num_rows": args.num_rows, "input_words": args.input_words, "max_tokens": args.max_tokens,
                     "batch_size": args.batch_size, "model": model, "device": args.device},
        "rounds": rounds, **combined}
    write_json(args.out, payload)
    print(summary_table(rounds, combined))
    equal = min(r["rows_equal"] for r in rounds)
    print(f"outputs equal row for row: {equal}/{len(prompts)} (the fewest of any round); full numbers in {args.out}")
    return 0 if equal == len(prompts) or args.device == "cuda" else 1


def round_figures(num_prompts: int, peer_wall: float, peer_tokens: int, summary, rows_equal: int) -> dict:
    """One round's two runs: rows/s and generated tokens/s of each, and the batch job's ratios to the
    peer end to end, after its input checks, and from its first shard on (start-up excluded)."""
    batch_wall = summary.wall_s
    out = {"peer": {"wall_s": peer_wall, "generated_tokens": peer_tokens, "rows_s": num_prompts / peer_wall,
                    "tokens_s": peer_tokens / peer_wall},
           "batch": {"wall_s": batch_wall, "check_s": summary.check_s, "first_shard_s": summary.first_shard_s,
                     "first_shard_rows": summary.first_shard_rows, "generated_tokens": summary.num_generated_tokens,
                     "prompt_tokens": summary.num_prompt_tokens, "shards": summary.num_shards,
                     "rows_s": summary.num_rows / batch_wall, "tokens_s": summary.num_generated_tokens / batch_wall},
           "ratio": peer_wall / batch_wall, "ratio_after_checks": peer_wall / (batch_wall - summary.check_s),
           "rows_equal": rows_equal}
    steady_s = batch_wall - summary.first_shard_s
    if summary.num_shards > 1 and steady_s > 0:
        steady_rows = summary.num_rows - summary.first_shard_rows
        out["ratio_after_first_shard"] = steady_rows / steady_s / (num_prompts / peer_wall)
    return out


RATIOS = ("ratio", "ratio_after_checks", "ratio_after_first_shard")


def combine_rounds(rounds: list[dict]) -> dict:
    """The medians over rounds of each ratio (a ratio some round lacks is left out)."""
    return {key: statistics.median(r[key] for r in rounds) for key in RATIOS if all(key in r for r in rounds)}


def summary_table(rounds: list[dict], combined: dict) -> str:
    labels = {"ratio": "batch job, 1 actor, end to end", "ratio_after_checks": "batch job, after the input checks",
              "ratio_after_first_shard": "batch job, after the first shard"}
    rows = [["LLM.generate (peer)", statistics.median(r["peer"]["rows_s"] for r in rounds),
             statistics.median(r["peer"]["tokens_s"] for r in rounds), 1.0, "-"]]
    rows += [[labels[key], "-" if key != "ratio" else statistics.median(r["batch"]["rows_s"] for r in rounds),
              "-" if key != "ratio" else statistics.median(r["batch"]["tokens_s"] for r in rounds),
              value, " ".join(f"{r[key]:.2f}" for r in rounds) if len(rounds) > 1 else "-"]
             for key, value in combined.items()]
    return format_table(["path", "rows/s", "gen tok/s", "/ peer (median)", "per round"], rows)


if __name__ == "__main__":
    sys.exit(main())
