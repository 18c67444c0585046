"""Our engine as a benchmark peer: `LLM.generate` over the whole workload at once."""
from __future__ import annotations

import gc

from loadtest.report import Stopwatch
from loadtest.workload import BenchRequest


def engine_generate(llm, requests: list[BenchRequest]) -> list[list[int]]:
    """Greedy, ignore_eos, each request its own length; outputs in input order."""
    from engine import SamplingParams

    prompts = [{"prompt_token_ids": r.prompt_token_ids} for r in requests]
    params = [SamplingParams(temperature=0, max_tokens=r.max_tokens, ignore_eos=True) for r in requests]
    outs = llm.generate(prompts, params, use_tqdm=False)
    token_ids = [list(o.outputs[0].token_ids) for o in outs]
    wrong = [i for i, (t, r) in enumerate(zip(token_ids, requests)) if len(t) != r.max_tokens]
    if wrong:
        # Counting tokens that were never produced would inflate the figure.
        raise RuntimeError(f"requests {wrong[:5]} returned the wrong number of tokens")
    return token_ids


def timed_engine_run(llm, requests: list[BenchRequest],
                     warmup: list[BenchRequest]) -> tuple[Stopwatch, list[list[int]]]:
    """One `generate` over every request, timed, after an untimed warm-up `generate` and with the
    prefix cache emptied: a round after the first would otherwise find every prompt cached from
    the one before and time decoding alone."""
    engine_generate(llm, warmup)
    if not llm.reset_prefix_cache():
        raise RuntimeError("the engine still has requests: its prefix cache cannot be emptied")
    _sync_cuda()
    with Stopwatch() as watch:
        token_ids = engine_generate(llm, requests)
        _sync_cuda()
    return watch, token_ids


def shutdown(llm) -> None:
    """Release the engine's workers and memory before the next peer runs."""
    engine = getattr(llm, "llm_engine", None)
    if engine is not None and hasattr(engine, "shutdown"):
        engine.shutdown()
    gc.collect()


def _sync_cuda() -> None:
    # generate() returns host lists, so the GPU is already idle; this keeps the timing honest
    # should that ever change.
    import torch

    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()
