"""The batch job's CLI: `python -m serve_app.batch --model DIR --input PATH --output DIR ...`.

Connects to the Ray cluster in --address / RAY_ADDRESS (a RayJob sets it), else starts a local one. Exit
status: 0 done, 2 bad input or arguments (the message names it), 143 on SIGTERM (shards written so
far are kept: run again with --resume to finish).
"""
from __future__ import annotations

import argparse
import os
import signal
import sys


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m serve_app.batch", description=__doc__.split("\n")[0])
    p.add_argument("--model", required=True, help="checkpoint directory or hub id")
    p.add_argument("--input", required=True, help="JSONL, CSV or Parquet file or directory; any pyarrow/fsspec URI")
    p.add_argument("--input-format", choices=["jsonl", "csv", "parquet"], help="default: from the extension")
    p.add_argument("--output", required=True, help="directory (or URI) the shards are written to")
    p.add_argument("--output-format", choices=["jsonl", "parquet"], default="jsonl")
    p.add_argument("--id-column", help="the rows' id column (default: each row's position in the input)")
    prompt = p.add_mutually_exclusive_group()
    prompt.add_argument("--prompt-column", help="the column holding the prompt (default: prompt)")
    prompt.add_argument("--template", help="a Jinja template file rendered with each row's columns")
    p.add_argument("--chat", action="store_true", help="apply the model's chat template (prompt = user message)")
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--seed", type=int, help="sampling seed; each row's seed is derived from it and the row's id")
    p.add_argument("--response-format",
                   help="a JSON file: a JSON Schema, an OpenAI response_format object, or "
                        '{"type": "regex"|"choice"|"grammar", "regex"|"choice"|"grammar": ...} or a '
                        '{"type": "structural_tag", ...} (docs/batch.md)')
    p.add_argument("--lora", action="append", default=[], metavar="NAME=PATH",
                   help="a LoRA adapter (PEFT directory) rows may name in --lora-column; repeatable")
    p.add_argument("--lora-column", help="the column naming each row's adapter; null or empty: the base model "
                                         "(default: lora, when --lora is given)")
    p.add_argument("--max-loras", type=int, help="engine knob: adapters in one engine step")
    p.add_argument("--max-lora-rank", type=int, help="engine knob: the largest adapter rank")
    p.add_argument("--num-replicas", type=int, default=1, help="engine actors")
    p.add_argument("--tensor-parallel-size", type=int, default=1, help="GPUs per engine actor")
    p.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--batch-size", type=int, default=256, help="rows per engine call and per shard")
    p.add_argument("--max-concurrent-batches", type=int,
                   help="batches in one engine actor at once (default: enough to keep --max-num-seqs full)")
    p.add_argument("--max-num-seqs", type=int, help="engine knob: sequences batched at once")
    p.add_argument("--cpu-threads", type=int, help="torch threads of a CPU engine actor")
    p.add_argument("--resume", action="store_true", help="skip the ids the output directory holds already")
    p.add_argument("--continue-on-error", action="store_true",
                   help="a row the engine refuses (a prompt longer than the model's context, ...) is written with "
                        "finish_reason 'error', no text and the reason in 'error', instead of failing the job")
    p.add_argument("--address", default=os.environ.get("RAY_ADDRESS") or "local",
                   help="Ray cluster to run on (default: RAY_ADDRESS, else a new local cluster; "
                        "never one found by chance on this machine)")
    p.add_argument("--no-progress", action="store_true")
    return p.parse_args(argv)


def _config(args: argparse.Namespace):
    from serve_app.batch.config import BatchConfig
    engine_kwargs = {name: getattr(args, name) for name in ("max_num_seqs", "max_loras", "max_lora_rank")
                     if getattr(args, name)}
    return BatchConfig.from_files(
        template_file=args.template, response_format_file=args.response_format, model=args.model,
        prompt_column=args.prompt_column, chat=args.chat, id_column=args.id_column, max_tokens=args.max_tokens,
        temperature=args.temperature, top_p=args.top_p, seed=args.seed, num_replicas=args.num_replicas,
        tensor_parallel_size=args.tensor_parallel_size, device=args.device, dtype=args.dtype,
        batch_size=args.batch_size, max_concurrent_batches=args.max_concurrent_batches, cpu_threads=args.cpu_threads,
        continue_on_error=args.continue_on_error, engine_kwargs=engine_kwargs, loras=args.lora,
        lora_column=args.lora_column)


def _raise_interrupt(signum, frame):
    raise KeyboardInterrupt(f"signal {signum}")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        config = _config(args)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    import ray

    from serve_app.batch.cluster import init_ray
    from serve_app.batch.job import run_job
    init_ray(args.address)
    # After ray.init, which installs its own handler: shut the cluster down cleanly, as Ctrl-C does.
    signal.signal(signal.SIGTERM, _raise_interrupt)
    try:
        summary = run_job(config, args.input, args.output, resume=args.resume, input_format=args.input_format,
                          output_format=args.output_format, progress=not args.no_progress)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted: the shards written so far are kept; run again with --resume to finish",
              file=sys.stderr)
        return 143
    finally:
        ray.shutdown()
    print(f"done: {summary}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
