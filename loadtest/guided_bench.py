"""Grammar-constrained decoding against plain decoding of the same lengths, in one run.

    python -m loadtest.guided_bench [--form json|regex|choice|tools] [--num-requests 64]
                                    [--async-scheduling] [--device cpu|cuda] [--model DIR]

Forms: json (a nested schema of many small fields, strings bounded both ways), regex (the same
records as lines of a bounded pattern), choice (one of 16 long sentences), tools (the schema the
HTTP tier builds for tool_choice="required": a list of calls, each one of three tools' name and
parameters).

Each round runs the requests twice through one `LLM`: first with the form's constraint
(grammar-constrained, seeded sampling at temperature 1; each request stops when its document is
complete), then without one, each request given exactly the number of tokens its constrained
twin produced (ignore_eos). Prefix caching is off, so that neither twin reuses the other's
(identical) prompts. The figure is output tokens per second of wall time; the ratio
constrained / plain is what grammar-constrained decoding costs, and beside it plain /
constrained CPU seconds of this process, which a neighbour's load moves less. Rates are the
best of `--rounds` per side; each ratio is the median of the rounds' own ratios (a round's two
runs are back to back, so a noisy neighbour moves both; an even count takes the mean of the
middle two). Model loading and one warm-up round excluded. Default model: the CPU bench model
(loadtest.offline); on a GPU pass the Qwen3-0.6B shape from engine.tools.tiny_model.
"""
from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path

from loadtest.measure import run_metadata
from loadtest.report import format_table, write_json

# Long documents of many small fields: the grammar is consulted at every token.
SCHEMA = {
    "type": "object",
    "properties": {
        "items": {"type": "array", "minItems": 6, "maxItems": 12, "items": {
            "type": "object",
            "properties": {"name": {"type": "string", "minLength": 2, "maxLength": 10},
                           "qty": {"type": "integer", "minimum": 0, "maximum": 999},
                           "ok": {"type": "boolean"}},
            "required": ["name", "qty", "ok"], "additionalProperties": False}},
    },
    "required": ["items"],
    "additionalProperties": False,
}
# The same records, one a line: "item <name> qty <n> ok <yes|no>".
REGEX = r"(item [a-z]{1,10} qty [0-9]{1,3} ok (yes|no)\n){6,12}"
CHOICES = [f"option {i}: the {w} report is ready for review by the {w} team before the end of the week"
           for i, w in enumerate(["sales", "support", "finance", "legal", "design", "ops", "growth", "data",
                                  "security", "platform", "mobile", "web", "research", "infra", "hr", "it"])]
# Tool parameters bounded as SCHEMA's fields are, so that every call completes within --max-tokens.
TOOLS = {
    "get_weather": {"type": "object", "properties": {
        "city": {"type": "string", "maxLength": 20}, "unit": {"enum": ["celsius", "fahrenheit"]}},
        "required": ["city", "unit"]},
    "search": {"type": "object", "properties": {
        "query": {"type": "string", "maxLength": 30}, "max_results": {"type": "integer", "minimum": 1, "maximum": 10}},
        "required": ["query"]},
    "book_meeting": {"type": "object", "properties": {
        "title": {"type": "string", "maxLength": 20},
        "attendees": {"type": "array", "maxItems": 3, "items": {"type": "string", "maxLength": 12}},
        "minutes": {"type": "integer", "minimum": 15, "maximum": 120}},
        "required": ["title", "attendees"]},
}


def tools_schema(tools: dict[str, dict]) -> dict:
    """tool_choice="required": one or more calls, each naming a tool and giving its parameters."""
    calls = [{"type": "object", "properties": {"name": {"const": name}, "parameters": params},
              "required": ["name", "parameters"]} for name, params in tools.items()]
    return {"type": "array", "minItems": 1, "items": {"anyOf": calls}}


def structured_outputs(form: str):
    from engine import StructuredOutputsParams

    return {"json": lambda: StructuredOutputsParams(json=SCHEMA),
            "regex": lambda: StructuredOutputsParams(regex=REGEX),
            "choice": lambda: StructuredOutputsParams(choice=CHOICES),
            "tools": lambda: StructuredOutputsParams(json=tools_schema(TOOLS))}[form]()


def _params(args, lengths: list[int] | None):
    from engine import SamplingParams

    if lengths is None:
        constraint = structured_outputs(args.form)
        return [SamplingParams(temperature=1.0, seed=i, max_tokens=args.max_tokens, structured_outputs=constraint)
                for i in range(args.num_requests)]
    return [SamplingParams(temperature=1.0, seed=i, max_tokens=n, ignore_eos=True) for i, n in enumerate(lengths)]


def _timed(llm, prompts, params) -> tuple[float, float, list[int]]:
    """(wall seconds, CPU seconds of this process, output lengths)."""
    start, cpu_start = time.perf_counter(), time.process_time()
    outs = llm.generate(prompts, params, use_tqdm=False)
    return (time.perf_counter() - start, time.process_time() - cpu_start,
            [len(o.outputs[0].token_ids) for o in outs])


def run(args) -> dict:
    from engine import LLM
    from loadtest.offline import ensure_bench_model

    model = args.model or str(ensure_bench_model(Path(args.cache_dir)))
    llm = LLM(model=model, device=args.device, dtype=args.dtype, max_num_seqs=max(256, args.num_requests),
              enable_prefix_caching=False, async_scheduling=args.async_scheduling or None, seed=0)
    rng = random.Random(0)
    vocab = llm.llm_engine.model_config.vocab_size
    prompts = [{"prompt_token_ids": [rng.randrange(vocab) for _ in range(rng.randint(16, 128))]}
               for _ in range(args.num_requests)]
    best = {"guided": float("inf"), "plain": float("inf")}
    ratios: list[float] = []
    cpu_ratios: list[float] = []  # plain / guided CPU seconds: less moved by a neighbour's load
    lengths: list[int] = []
    for round_ in range(args.rounds + 1):  # round 0 is the warm-up
        waits_before = llm.llm_engine.num_host_waits
        t_guided, cpu_guided, lengths = _timed(llm, prompts, _params(args, None))
        waits = llm.llm_engine.num_host_waits - waits_before
        t_plain, cpu_plain, plain_lengths = _timed(llm, prompts, _params(args, lengths))
        assert plain_lengths == lengths, "the plain twin must produce the same number of tokens"
        print(f"[guided_bench] round {round_}: guided {t_guided:.2f}s ({cpu_guided:.2f}s CPU) "
              f"plain {t_plain:.2f}s ({cpu_plain:.2f}s CPU)", file=sys.stderr)
        if round_:
            best["guided"], best["plain"] = min(best["guided"], t_guided), min(best["plain"], t_plain)
            ratios.append(t_plain / t_guided)
            cpu_ratios.append(cpu_plain / cpu_guided)
    tokens = sum(lengths)
    result = {
        "form": args.form, "num_requests": args.num_requests, "output_tokens": tokens,
        "guided_tok_s": tokens / best["guided"], "plain_tok_s": tokens / best["plain"],
        "async_scheduling": llm.llm_engine.async_scheduling, "host_waits_per_guided_run": waits,
    }
    result["round_ratios"], result["round_cpu_ratios"] = ratios, cpu_ratios
    result["ratio"], result["cpu_ratio"] = _median(ratios), _median(cpu_ratios)
    return result


def _median(values: list[float]) -> float:
    ordered = sorted(values)
    mid = len(ordered) // 2
    return ordered[mid] if len(ordered) % 2 else (ordered[mid - 1] + ordered[mid]) / 2


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--form", choices=["json", "regex", "choice", "tools"], default="json",
                   help="the constraint timed against plain decoding (default: json)")
    p.add_argument("--num-requests", type=int, default=64)
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--async-scheduling", action="store_true",
                   help="overlapped scheduling (default: the engine's choice, off on CPU)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--model", default=None)
    p.add_argument("--cache-dir", default="bench_out/model-bench")
    p.add_argument("--out", default="bench_out/guided_bench.json")
    args = p.parse_args(argv)
    if args.num_requests < 1 or args.rounds < 1 or args.max_tokens < 1:
        p.error("--num-requests, --rounds and --max-tokens must be >= 1")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    result = run(args)
    print(format_table(["form", "requests", "tokens", "guided tok/s", "plain tok/s", "guided / plain",
                        "CPU: plain / guided"],
                       [[result["form"], result["num_requests"], result["output_tokens"], result["guided_tok_s"],
                         result["plain_tok_s"], result["ratio"], result["cpu_ratio"]]]))
    write_json(args.out, {"meta": run_metadata(sys.argv), "result": result})
    return 0


if __name__ == "__main__":
    sys.exit(main())
