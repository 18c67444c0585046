"""HF transformers continuous batching (paged attention) as a peer.

Uses the manager behind `model.generate_batch` so each request gets its own
`max_new_tokens`, as ours does; `generate_batch` itself takes one length for
all, which would make HF generate up to ~2x the tokens we do. If the installed
transformers lacks the manager calls, it falls back to `generate_batch` with
the longest length and says so in `settings`.
"""
from __future__ import annotations

import inspect
import time

import torch
import transformers

from loadtest.hf_peer import PeerResult, load_hf_model
from loadtest.workload import BenchRequest

RESULT_POLL_S = 1.0


def load_cb_model(path: str, device: str = "cuda"):
    """transformers 4.x needs a paged attention implementation chosen at load time;
    5.x switches to one (flash when installed) by itself when the manager starts."""
    if int(transformers.__version__.split(".")[0]) < 5:
        return load_hf_model(path, torch.bfloat16, device, attn_implementation="sdpa_paged")
    return load_hf_model(path, torch.bfloat16, device)


def _generation_config(max_new_tokens: int):
    from transformers import GenerationConfig

    # eos_token_id=None: the manager disables EOS (ignore_eos); greedy like every peer.
    return GenerationConfig(max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=None,
                            pad_token_id=0, use_cache=True)


def _collect(manager, request_ids: list[str], deadline: float) -> dict:
    """Finished results by id; bounded by `deadline` (time.perf_counter) and the manager's health."""
    results = {}
    wanted = set(request_ids)
    while wanted - results.keys():
        if time.perf_counter() > deadline:
            raise TimeoutError(f"{len(wanted - results.keys())} requests unfinished at the deadline")
        result = manager.get_result(timeout=RESULT_POLL_S)
        if result is not None and result.is_finished():
            if getattr(result, "error", None) is not None:
                raise RuntimeError(f"request {result.request_id} failed: {result.error}")
            results[result.request_id] = result
        elif result is None and not manager.is_running():
            raise RuntimeError("the continuous batching thread stopped")
    return results


class _NoPerRequestLengths(Exception):
    """The installed manager's add_request takes no max_new_tokens."""


def _run_manager(model, requests: list[BenchRequest], warmup: list[BenchRequest],
                 timeout_s: float) -> tuple[float, list[list[int]]]:
    if not hasattr(model, "init_continuous_batching"):
        raise _NoPerRequestLengths
    manager = model.init_continuous_batching(
        generation_config=_generation_config(max(r.max_tokens for r in requests)))
    if "max_new_tokens" not in inspect.signature(manager.add_request).parameters:
        raise _NoPerRequestLengths
    if hasattr(manager, "warmup"):  # captures CUDA graphs where the version does that
        manager.warmup()
    manager.start()
    try:
        ids = [manager.add_request(r.prompt_token_ids, max_new_tokens=r.max_tokens) for r in warmup]
        _collect(manager, ids, time.perf_counter() + timeout_s)
        start = time.perf_counter()
        ids = [manager.add_request(r.prompt_token_ids, max_new_tokens=r.max_tokens) for r in requests]
        results = _collect(manager, ids, start + timeout_s)
        elapsed = time.perf_counter() - start
    finally:
        manager.stop(block=True, timeout=30)
    return elapsed, [list(results[i].generated_tokens) for i in ids]


def _run_generate_batch(model, requests: list[BenchRequest],
                        warmup: list[BenchRequest]) -> tuple[float, list[list[int]]]:
    longest = max(r.max_tokens for r in requests)
    model.generate_batch([r.prompt_token_ids for r in warmup], generation_config=_generation_config(4))
    start = time.perf_counter()
    out = model.generate_batch([r.prompt_token_ids for r in requests],
                               generation_config=_generation_config(longest))
    elapsed = time.perf_counter() - start
    # Every row ran to `longest` >= its own length, so the pairing with requests (input order
    # on recent versions, maybe finish order on old ones) cannot change the useful count.
    return elapsed, [list(o.generated_tokens) for o in out.values()]


def hf_continuous(model, requests: list[BenchRequest], warmup: list[BenchRequest],
                  timeout_s: float) -> PeerResult:
    """Every request submitted at once; timed from submission to the last one finished.

    Useful tokens are each request's own length, and never more than it generated
    (a request that stopped early counts only what it produced).
    """
    try:
        elapsed, token_ids = _run_manager(model, requests, warmup, timeout_s)
        per_request = True
    except _NoPerRequestLengths:
        elapsed, token_ids = _run_generate_batch(model, requests, warmup)
        per_request = False
    useful = sum(min(len(t), r.max_tokens) for t, r in zip(token_ids, requests))
    short = sum(len(t) < r.max_tokens for t, r in zip(token_ids, requests))
    return PeerResult(name="hf_cb", elapsed_s=elapsed, num_useful_tokens=useful,
                      settings={"api": "manager.add_request" if per_request else "generate_batch",
                                "per_request_max_new_tokens": per_request,
                                "num_short_requests": short,
                                "attn_implementation": getattr(model.config, "_attn_implementation", None)})
