"""Offline demo: generate from a checkpoint with a progress bar; print the outputs and the throughput.

A checkpoint with a chat template is asked questions through `LLM.chat`; one without
(the tiny random model) continues plain prompts through `LLM.generate`.

    python -m engine.tools.demo --model models/smollm2-135m-instruct    # what `make demo` runs
    python -m engine.tools.demo --model models/tiny-llama --temperature 0.8
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
QUESTIONS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "How many legs does a spider have?",
    "Give me three tips for staying focused.",
    "What is 12 times 12?",
    "Translate 'good morning' into Spanish.",
    "Name a famous physicist.",
    "Why is the sky blue? One sentence.",
]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="models/smollm2-135m-instruct")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--repeat", type=int, default=8, help="how many times to submit the prompt list")
    args = ap.parse_args()

    llm = LLM(args.model, device=args.device, dtype=args.dtype)
    params = SamplingParams(temperature=args.temperature, top_p=0.95, max_tokens=args.max_tokens, seed=0)
    start = time.perf_counter()
    if llm.get_tokenizer().chat_template:
        shown = QUESTIONS
        outputs = llm.chat([[{"role": "user", "content": q}] for q in QUESTIONS * args.repeat], params)
    else:
        shown = PROMPTS
        outputs = llm.generate(PROMPTS * args.repeat, params)
    elapsed = time.perf_counter() - start
    for prompt, out in zip(shown, outputs):
        print(f"{prompt!r} -> {out.outputs[0].text!r}")
    num_tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    print(f"\n{len(outputs)} requests, {num_tokens} generated tokens in {elapsed:.2f} s: "
          f"{num_tokens / elapsed:.1f} tokens/s")


if __name__ == "__main__":
    main()
