"""How busy the device is during steady decode: torch.profiler over a window of engine steps.

    python -m loadtest.step_profile --device cuda --model /tmp/qwen3-0.6b [--num-seqs 256]
        [--prompt-len 512] [--steps 60] [--async-scheduling on|off|both]

Adds `--num-seqs` requests, steps the engine until every one is decoding, warms up,
then profiles `--steps` steps. Reported per configuration: wall time per step, the
share of it in which at least one kernel runs (the union of kernel intervals over
the window's wall time: 1.0 means the host never left the GPU idle), and the kernels
with the largest share of GPU time (the paged-attention share is the issue-9 figure).
On CPU only the wall time per step is meaningful. JSON to --out.
"""
from __future__ import annotations

import argparse
import random
import sys
import time

import torch

from loadtest.measure import run_metadata
from loadtest.report import format_table, write_json


def union_length(intervals: list[tuple[float, float]]) -> float:
    """Total length covered by possibly overlapping [start, end) intervals."""
    total, cur_start, cur_end = 0.0, None, None
    for start, end in sorted(intervals):
        if cur_end is None or start > cur_end:
            if cur_end is not None:
                total += cur_end - cur_start
            cur_start, cur_end = start, end
        else:
            cur_end = max(cur_end, end)
    if cur_end is not None:
        total += cur_end - cur_start
    return total


def kernel_intervals(prof) -> list[tuple[str, float, float]]:
    """(name, start_us, end_us) of every device kernel the profiler saw."""
    out = []
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            out.append((e.name, e.time_range.start, e.time_range.end))
    return out


def _fill_to_decode(engine, args) -> None:
    from engine import SamplingParams

    rng = random.Random(0)
    vocab = engine.model_config.vocab_size
    total = args.warmup_steps + args.steps + 8
    for i in range(args.num_seqs):
        ids = [rng.randrange(vocab) for _ in range(args.prompt_len)]
        engine.add_request(f"p{i}", {"prompt_token_ids": ids},
                           SamplingParams(temperature=0, max_tokens=total + args.prompt_len, ignore_eos=True))
    while engine.scheduler.num_waiting or any(s.num_output_tokens == 0 for s in engine.scheduler.running):
        engine.step()
    for _ in range(args.warmup_steps):
        engine.step()


def profile_one(args, async_scheduling: bool) -> dict:
    from engine import LLM

    llm = LLM(model=args.model, device=args.device, dtype=args.dtype, max_num_seqs=max(256, args.num_seqs),
              max_model_len=args.prompt_len + args.steps + args.warmup_steps + 64,
              async_scheduling=async_scheduling, seed=0)
    engine = llm.llm_engine
    _fill_to_decode(engine, args)
    on_cuda = args.device == "cuda"
    activities = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if on_cuda else [])
    with torch.profiler.profile(activities=activities) as prof:
        if on_cuda:
            torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(args.steps):
            engine.step()
        if on_cuda:
            torch.cuda.synchronize()
        wall_s = time.perf_counter() - start
    result = {"async_scheduling": async_scheduling, "step_ms": 1e3 * wall_s / args.steps}
    kernels = kernel_intervals(prof) if on_cuda else []
    if kernels:
        first = min(s for _, s, _ in kernels)
        last = max(e for _, _, e in kernels)
        busy_us = union_length([(s, e) for _, s, e in kernels])
        by_name: dict[str, float] = {}
        for name, s, e in kernels:
            by_name[name] = by_name.get(name, 0.0) + (e - s)
        gpu_total = sum(by_name.values())
        result.update(gpu_busy_share=busy_us / (wall_s * 1e6), gpu_busy_share_of_kernel_span=busy_us / (last - first),
                      top_kernels={n: t / gpu_total for n, t in sorted(by_name.items(), key=lambda kv: -kv[1])[:8]})
    engine.shutdown()
    del llm, engine
    if on_cuda:
        torch.cuda.empty_cache()
    return result


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True)
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--num-seqs", type=int, default=256)
    p.add_argument("--prompt-len", type=int, default=512)
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--warmup-steps", type=int, default=5)
    p.add_argument("--async-scheduling", choices=["on", "off", "both"], default="both")
    p.add_argument("--out", default="bench_out/step_profile.json")
    args = p.parse_args(argv)
    for name in ("num_seqs", "prompt_len", "steps"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    modes = {"on": [True], "off": [False], "both": [False, True]}[args.async_scheduling]
    results = [profile_one(args, m) for m in modes]
    print(format_table(["async_scheduling", "ms / step", "GPU busy share"],
                       [[r["async_scheduling"], r["step_ms"], r.get("gpu_busy_share", "n/a")] for r in results]))
    for r in results:
        for name, share in (r.get("top_kernels") or {}).items():
            print(f"  async={r['async_scheduling']}  {share:6.1%}  {name[:100]}")
    write_json(args.out, {"meta": run_metadata(sys.argv), "results": results})
    return 0


if __name__ == "__main__":
    sys.exit(main())
