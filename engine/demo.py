"""Offline demo: generate from a checkpoint with a progress bar; print the outputs and the throughput.

    python -m engine.demo --model models/tiny-llama
"""
from __future__ import annotations

import argparse
import time

from engine import LLM, SamplingParams

PROMPTS = [
    "Hello, my name is",
    "The capital of France is",
    "def fibonacci(n):",
    "In a distant galaxy,",
    '{"name": "Ada", "languages": [',
    "Le café est",
    "日本語のテキスト",
    "Once upon a time",
]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="models/tiny-llama")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--temperature", type=float, default=0.8)
    ap.add_argument("--repeat", type=int, default=8, help="how many times to submit the prompt list")
    args = ap.parse_args()

    llm = LLM(args.model, device=args.device, dtype=args.dtype)
    params = SamplingParams(temperature=args.temperature, top_p=0.95, max_tokens=args.max_tokens, seed=0)
    prompts = PROMPTS * args.repeat
    start = time.perf_counter()
    outputs = llm.generate(prompts, params)
    elapsed = time.perf_counter() - start
    for out in outputs[: len(PROMPTS)]:
        print(f"{out.prompt!r} -> {out.outputs[0].text!r}")
    num_tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    print(f"\n{len(outputs)} requests, {num_tokens} generated tokens in {elapsed:.2f} s: "
          f"{num_tokens / elapsed:.1f} tokens/s")


if __name__ == "__main__":
    main()
