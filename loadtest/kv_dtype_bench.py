"""Decode throughput with the model-dtype KV cache against the fp8 one (issue 34), same requests.

    python -m loadtest.kv_dtype_bench --device cuda --model /tmp/qwen3-0.6b [--num-seqs 256]
        [--prompt-len 512] [--output-len 256] [--kv-cache-dtypes auto,fp8]

Per kv_cache_dtype: one engine (`LLM`, eager off, defaults otherwise), a warm-up request, then
`--num-seqs` random-id prompts of `--prompt-len` tokens decoding `--output-len` tokens each
(ignore_eos) in one `generate`. Reported: KV blocks the budget bought, wall time, output
tokens/s, and decode tokens/s (output tokens after each request's first, over the span from the
last first token to the last token, from the requests' metrics). fp8 reads half the cache bytes per decode step and holds
twice the blocks, so the gain shows where decode attention is bandwidth-bound: long contexts,
many sequences. JSON to --out.
"""
from __future__ import annotations

import argparse
import gc
import random
import sys
import time

import torch

from loadtest.measure import run_metadata
from loadtest.report import format_table, write_json


def run_one(args, kv_cache_dtype: str) -> dict:
    from engine import LLM, SamplingParams

    rng = random.Random(args.seed)
    prompts = [{"prompt_token_ids": [rng.randrange(10, 1000) for _ in range(args.prompt_len)]}
               for _ in range(args.num_seqs)]
    params = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
    with LLM(args.model, device=args.device, dtype=args.dtype, kv_cache_dtype=kv_cache_dtype,
             max_model_len=args.prompt_len + args.output_len, max_num_seqs=args.num_seqs) as llm:
        llm.generate(prompts[:1], SamplingParams(max_tokens=8, ignore_eos=True), use_tqdm=False)  # warm-up
        start = time.monotonic()  # the clock of RequestMetrics
        outs = llm.generate(prompts, params, use_tqdm=False)
        wall = time.monotonic() - start
        num_blocks = llm.llm_engine.executor.runner.num_kv_blocks
    num_out = sum(len(o.outputs[0].token_ids) for o in outs)
    # Decode span: from the last request's first token to the last token. Approximate: early
    # requests also decode while later ones prefill, and those tokens count here too.
    last_first = max(o.metrics.first_token_time for o in outs)
    last_token = max(o.metrics.last_token_time or o.metrics.finished_time for o in outs)
    gc.collect()
    if args.device == "cuda":
        torch.cuda.empty_cache()
    return dict(kv_cache_dtype=kv_cache_dtype, num_kv_blocks=num_blocks, wall_s=wall, output_tokens=num_out,
                output_tok_s=num_out / wall,
                decode_tok_s=(num_out - len(outs)) / (last_token - last_first) if last_token > last_first else None)


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True)
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--num-seqs", type=int, default=256)
    p.add_argument("--prompt-len", type=int, default=512)
    p.add_argument("--output-len", type=int, default=256)
    p.add_argument("--kv-cache-dtypes", default="auto,fp8", help="comma-separated, run in this order")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="bench_out/kv_dtype_bench.json")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    rows = [run_one(args, kv) for kv in args.kv_cache_dtypes.split(",")]
    header = ["kv_cache_dtype", "num_kv_blocks", "wall_s", "output_tok_s", "decode_tok_s"]
    print(format_table(header, [[r[h] if r[h] is not None else "-" for h in header] for r in rows]))
    payload = dict(meta=run_metadata(sys.argv if argv is None else argv), config=vars(args), rows=rows)
    write_json(args.out, payload)
    return payload


if __name__ == "__main__":
    main()
