"""Decode throughput of quantized weights and KV caches against the model dtype (issue 34), same requests.

    python -m loadtest.quant_bench --device cuda --model /tmp/llama-8b [--num-seqs 64]
        [--prompt-len 512] [--output-len 256] [--quantizations none,fp8] [--kv-cache-dtypes auto,fp8]

One engine (`LLM`, defaults otherwise) per (quantization, kv_cache_dtype) pair, in order: a warm-up
request, then `--num-seqs` random-id prompts of `--prompt-len` tokens decoding `--output-len`
tokens each (ignore_eos) in one `generate`. `none` is the checkpoint as it is; `fp8` / `int8` on an
unquantized checkpoint quantize it at load; a quantized checkpoint runs its own method (`none`).
Reported per pair: resident weight GB, KV blocks the budget bought, wall time, output tokens/s,
decode tokens/s (output tokens after each request's first, over the span from the last first
token to the last token) and, on CUDA, the share of the memory roofline for the bytes a decode
step moves: the weights once plus every sequence's KV cache at its mean length, at the measured
copy bandwidth. JSON to --out.
"""
from __future__ import annotations

import argparse
import gc
import itertools
import random
import sys
import time

import torch

from loadtest.measure import copy_bandwidth, run_metadata
from loadtest.offline import weight_bytes
from loadtest.report import format_table, write_json

WARMUP_TOKENS = 8  # one request before the timed ones: kernels compiled, caches warm


def run_one(args, quantization: str, kv_cache_dtype: str) -> dict:
    from engine import LLM, SamplingParams

    rng = random.Random(args.seed)
    prompts = [{"prompt_token_ids": [rng.randrange(10, 1000) for _ in range(args.prompt_len)]}
               for _ in range(args.num_seqs)]
    params = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
    with LLM(args.model, device=args.device, dtype=args.dtype, kv_cache_dtype=kv_cache_dtype,
             quantization=None if quantization == "none" else quantization,
             max_model_len=args.prompt_len + max(args.output_len, WARMUP_TOKENS), max_num_seqs=args.num_seqs) as llm:
        llm.generate(prompts[:1], SamplingParams(max_tokens=WARMUP_TOKENS, ignore_eos=True), use_tqdm=False)
        start = time.monotonic()  # the clock of RequestMetrics
        outs = llm.generate(prompts, params, use_tqdm=False)
        wall = time.monotonic() - start
        runner = llm.llm_engine.executor.runner
        num_blocks, kv_bytes_per_token = runner.num_kv_blocks, runner.kv_cache_bytes / runner.num_kv_blocks / runner.block_size
        weights = weight_bytes(llm)
    num_out = sum(len(o.outputs[0].token_ids) for o in outs)
    # Decode span: from the last request's first token to the last token. Approximate: early
    # requests also decode while later ones prefill, and those tokens count here too.
    last_first = max(o.metrics.first_token_time for o in outs)
    last_token = max(o.metrics.last_token_time or o.metrics.finished_time for o in outs)
    decode_tok_s = (num_out - len(outs)) / (last_token - last_first) if last_token > last_first else None
    gc.collect()
    if args.device == "cuda":
        torch.cuda.empty_cache()
    step_bytes = weights + args.num_seqs * (args.prompt_len + args.output_len / 2) * kv_bytes_per_token
    return dict(quantization=quantization, kv_cache_dtype=kv_cache_dtype, weight_gb=weights / 1e9,
                num_kv_blocks=num_blocks, wall_s=wall, output_tokens=num_out, output_tok_s=num_out / wall,
                decode_tok_s=decode_tok_s, decode_step_gb=step_bytes / 1e9,
                roofline=(decode_tok_s / args.num_seqs * step_bytes / args.bandwidth
                          if decode_tok_s and args.bandwidth else None))


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True)
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--num-seqs", type=int, default=256)
    p.add_argument("--prompt-len", type=int, default=512)
    p.add_argument("--output-len", type=int, default=256)
    p.add_argument("--quantizations", default="none", help="comma-separated: none, fp8, int8 (run in this order)")
    p.add_argument("--kv-cache-dtypes", default="auto", help="comma-separated: auto, fp8 (run in this order)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="bench_out/quant_bench.json")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    args.bandwidth = copy_bandwidth(device="cuda") if args.device == "cuda" else None
    pairs = itertools.product(args.quantizations.split(","), args.kv_cache_dtypes.split(","))
    rows = [run_one(args, q, kv) for q, kv in pairs]
    header = ["quantization", "kv_cache_dtype", "weight_gb", "num_kv_blocks", "wall_s", "output_tok_s",
              "decode_tok_s", "roofline"]
    print(format_table(header, [[r[h] if r[h] is not None else "-" for h in header] for r in rows]))
    payload = dict(meta=run_metadata(sys.argv if argv is None else argv), config=vars(args), rows=rows)
    write_json(args.out, payload)
    return payload


if __name__ == "__main__":
    main()
