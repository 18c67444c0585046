"""Batch job throughput: `python -m serve_app.batch`'s pipeline against `engine.LLM.generate`.

    python -m loadtest.batch_bench [--num-rows 1024] [--input-words 32] [--max-tokens 64] [--quick]
                                   [--device cpu|cuda] [--model DIR] [--rounds 3] [--engine-actor]

The same prompts (random words, greedy, a fixed max_tokens) two ways, on the ~22M bench model
(or --model):
    peer    engine.LLM.generate on all prompts in this process (model loading excluded, one warm-up)
    batch   run_job: JSONL in -> checks -> Ray Data preprocess -> one engine actor -> shards out,
            end to end (reading, the up-front row checks, actor start and model load included;
            ray.init excluded), in a local Ray cluster started by this process
    actor   (--engine-actor) the job's engine stage alone: one EngineStage actor in a local Ray
            cluster, no Ray Data, fed the rows in batches of --batch-size, as many at once as the
            job's processor sends (its start-up and a warm-up batch excluded, as the peer's model
            load is): what running the engine in a Ray actor costs, apart from Ray Data and start-up
Figures: rows/s and generated tokens/s; the ratio batch / peer (the issue's target: >= 0.85 with
one actor). --rounds N runs the pair N times, the first of each pair alternating, and prints the
medians of the rounds' ratios (a shared machine's speed drifts over minutes: a ratio of two
runs far apart carries it whole; docs/benchmarks.md, "How we measure"). The outputs are
compared row by row (greedy: they must be equal). On CUDA the batch job runs first, so that its actor's process has the GPU
to itself and gives it back before the peer loads; there the count of equal rows is reported,
not required: bf16 matrix products differ with the batch's size, and the two paths batch the
rows differently.

The batch job's CPU is also split by process (engine actor, Ray Data's workers, Ray's daemons,
the driver), read from /proc while it runs: on a small node what the other processes spend is
taken from the engine.
"""
from __future__ import annotations

import argparse
import gc
import json
import os
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
    """The job end to end; also its CPU seconds by role (job_cpu)."""
    import ray

    from loadtest.proc_cpu import ProcessSampler
    from serve_app.batch import BatchConfig, run_job, shards
    from serve_app.batch.cluster import init_ray
    init_ray("local")  # as the CLI starts its cluster
    try:
        config = BatchConfig(model=model, device=device, max_tokens=max_tokens, batch_size=batch_size)
        with ProcessSampler() as sampler:
            summary = run_job(config, src, out, progress=False)
    finally:
        ray.shutdown()
    rows = {r["id"]: r["text"] for r in shards.read_rows(out)}
    return summary, [rows[i] for i in range(len(rows))], job_cpu(sampler.used, os.getpid())


def run_actor(model: str, prompts: list[str], max_tokens: int, batch_size: int, device: str
              ) -> tuple[float, list[str], int]:
    """The engine stage alone (see the module docstring): wall seconds, texts in prompt order,
    generated tokens."""
    import ray

    from serve_app.batch import BatchConfig
    from serve_app.batch.cluster import init_ray
    from serve_app.batch.processor import Processor
    init_ray("local")
    processor = None
    try:
        config = BatchConfig(model=model, device=device, max_tokens=max_tokens, batch_size=batch_size)
        processor = Processor(config)  # the job's engine actor: the same resources and engine config
        processor.start_engines()
        return feed_engine(processor.engines[0], prompts, batch_size, config.concurrent_batches())
    finally:
        if processor is not None:
            processor.shutdown()
        ray.shutdown()


def feed_engine(engine, prompts: list[str], batch_size: int, in_flight: int) -> tuple[float, list[str], int]:
    """Send `prompts` to an EngineStage actor in batches of batch_size, in_flight at a time (the
    next one when one returns), after a warm-up batch as the peer's: wall seconds (warm-up
    excluded), texts in prompt order, generated tokens."""
    import pyarrow as pa
    import ray

    def table(first: int) -> pa.Table:
        ids = range(first, min(first + batch_size, len(prompts)))
        return pa.table({"id": list(ids), "prompt": [prompts[i] for i in ids]})
    ray.get(engine.generate_batch.remote(table(0).slice(0, 8)))
    start = time.perf_counter()
    pending, outputs = [], []
    for first in range(0, len(prompts), batch_size):
        if len(pending) == in_flight:
            done, pending = ray.wait(pending, num_returns=1)
            outputs += ray.get(done)
        pending.append(engine.generate_batch.remote(table(first)))
    outputs += ray.get(pending)
    wall = time.perf_counter() - start
    rows = {row["id"]: row for out in outputs for row in out.to_pylist()}
    return wall, [rows[i]["text"] for i in range(len(prompts))], sum(r["num_generated_tokens"] for r in rows.values())


# Who spent the batch job's CPU, from each process's command line (first match wins). Ray names
# a worker by what it runs: one that ran Ray Data tasks and waits for more is "ray::IDLE".
JOB_ROLES = (
    ("engine actor", ("EngineStage",)),
    ("retry counter actor", ("RetryCounter",)),
    ("Ray daemons", ("raylet", "gcs_server", "DashboardAgent", "RuntimeEnvAgent", "log_monitor.py",
                     "dashboard.py", "monitor.py")),
    ("Ray Data workers", ("ray::",)),
)


def job_cpu(used: dict[int, tuple[float, str]], driver_pid: int) -> dict[str, float]:
    """CPU seconds by role over the job (ProcessSampler.used); processes not Ray's are left out.
    "driver" is this process: Ray Data's executor and the job's checks run there."""
    totals = {"driver": 0.0, **{role: 0.0 for role, _ in JOB_ROLES}}
    for pid, (cpu, cmdline) in used.items():
        role = "driver" if pid == driver_pid else next(
            (role for role, needles in JOB_ROLES if any(n in cmdline for n in needles)), None)
        if role is not None:
            totals[role] += max(cpu, 0.0)
    return totals


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
    p.add_argument("--engine-actor", action="store_true",
                   help="also run the engine stage alone in a Ray actor, without Ray Data (a third path)")
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

    def actor():
        progress(f"engine actor alone: {len(prompts)} prompts in batches of {args.batch_size}")
        return run_actor(model, prompts, args.max_tokens, args.batch_size, args.device)

    rounds = []
    for k in range(args.rounds):
        paths = {"peer": peer, "actor": actor, "batch": lambda: batch(k)}
        results = {name: paths[name]() for name in round_order(k, args.device, args.engine_actor)}
        peer_wall, peer_texts, peer_tokens = results["peer"]
        summary, batch_texts, cpu = results["batch"]
        same = sum(a == b for a, b in zip(peer_texts, batch_texts))
        actor_figures = None
        if "actor" in results:
            actor_wall, actor_texts, actor_tokens = results["actor"]
            actor_figures = (actor_wall, actor_tokens, sum(a == b for a, b in zip(peer_texts, actor_texts)))
        rounds.append(round_figures(len(prompts), peer_wall, peer_tokens, summary, same, actor=actor_figures, cpu=cpu))
        progress(f"round {k + 1}: batch / peer {rounds[-1]['ratio']:.3f}, equal rows {same}/{len(prompts)}"
                 + (f"; engine actor / peer {rounds[-1]['ratio_actor']:.3f}" if actor_figures else ""))
    combined = combine_rounds(rounds)
    payload = base_metadata(sys.argv) | {
        "workload": {"num_rows": args.num_rows, "input_words": args.input_words, "max_tokens": args.max_tokens,
                     "batch_size": args.batch_size, "model": model, "device": args.device},
        "rounds": rounds, **combined}
    write_json(args.out, payload)
    print(summary_table(rounds, combined))
    print(cpu_table(rounds))
    equal = min(min(r["rows_equal"], r.get("actor", {}).get("rows_equal", len(prompts))) for r in rounds)
    print(f"outputs equal row for row: {equal}/{len(prompts)} (the fewest of any round); full numbers in {args.out}")
    return 0 if equal == len(prompts) or args.device == "cuda" else 1


def round_order(k: int, device: str, engine_actor: bool) -> list[str]:
    """The paths of round k, in the order they run. The box's speed drifts over minutes, and a
    round's ratios compare runs next to each other: the order rotates from round to round. On
    CUDA the batch job runs first, so that its actor's process has the GPU to itself and gives
    it back before the others load their engines."""
    names = ["peer", "actor", "batch"] if engine_actor else ["peer", "batch"]
    if device == "cuda":
        return names[::-1]
    shift = k % len(names)
    return names[shift:] + names[:shift]


def round_figures(num_prompts: int, peer_wall: float, peer_tokens: int, summary, rows_equal: int,
                  actor: tuple[float, int, int] | None = None, cpu: dict[str, float] | None = None) -> dict:
    """One round's runs: rows/s and generated tokens/s of each, and the batch job's ratios to the
    peer end to end, after its input checks, and from its first shard on (start-up excluded);
    `actor` (wall, generated tokens, rows equal to the peer's) adds the engine actor's ratio;
    `cpu` is the batch job's CPU seconds by role."""
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
    if actor is not None:
        actor_wall, actor_tokens, actor_equal = actor
        out["actor"] = {"wall_s": actor_wall, "generated_tokens": actor_tokens, "rows_s": num_prompts / actor_wall,
                        "tokens_s": actor_tokens / actor_wall, "rows_equal": actor_equal}
        out["ratio_actor"] = peer_wall / actor_wall
    if cpu is not None:
        out["batch"]["cpu_s"] = cpu
    return out


RATIOS = ("ratio", "ratio_after_checks", "ratio_after_first_shard", "ratio_actor")


def combine_rounds(rounds: list[dict]) -> dict:
    """The medians over rounds of each ratio (a ratio some round lacks is left out)."""
    return {key: statistics.median(r[key] for r in rounds) for key in RATIOS if all(key in r for r in rounds)}


def summary_table(rounds: list[dict], combined: dict) -> str:
    labels = {"ratio": "batch job, 1 actor, end to end", "ratio_after_checks": "batch job, after the input checks",
              "ratio_after_first_shard": "batch job, after the first shard",
              "ratio_actor": "engine actor alone (no Ray Data, start-up excluded)"}
    rows = [["LLM.generate (peer)", statistics.median(r["peer"]["rows_s"] for r in rounds),
             statistics.median(r["peer"]["tokens_s"] for r in rounds), 1.0, "-"]]
    rows += [[labels[key], "-" if key != "ratio" else statistics.median(r["batch"]["rows_s"] for r in rounds),
              "-" if key != "ratio" else statistics.median(r["batch"]["tokens_s"] for r in rounds),
              value, " ".join(f"{r[key]:.2f}" for r in rounds) if len(rounds) > 1 else "-"]
             for key, value in combined.items()]
    return format_table(["path", "rows/s", "gen tok/s", "/ peer (median)", "per round"], rows)


def cpu_table(rounds: list[dict]) -> str:
    """The batch job's CPU seconds by role (median over rounds), and as cores over its wall time."""
    rounds = [r for r in rounds if "cpu_s" in r["batch"]]
    if not rounds:
        return ""
    wall = statistics.median(r["batch"]["wall_s"] for r in rounds)
    rows = []
    for role in rounds[0]["batch"]["cpu_s"]:
        seconds = statistics.median(r["batch"]["cpu_s"][role] for r in rounds)
        rows.append([role, seconds, seconds / wall])
    total = sum(row[1] for row in rows)
    rows.append(["all of the above", total, total / wall])
    return format_table(["batch job CPU by process (median)", "CPU s", "cores"], rows)


if __name__ == "__main__":
    sys.exit(main())
