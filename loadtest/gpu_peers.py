"""The GPU peers and the machine measurement, each run alone in a child process.

A child owns the GPU while it runs and exits afterwards, so no peer starts
with another's cache, CUDA graphs or allocator pool still holding memory,
and one peer's crash or out-of-memory is recorded instead of ending the run.
"""
from __future__ import annotations

import torch

from loadtest.hf_cb import hf_continuous, load_cb_model
from loadtest.hf_peer import PeerResult, hf_static, load_hf_model
from loadtest.measure import copy_bandwidth, matmul_flop_rate, run_metadata
from loadtest.ours import shutdown, timed_engine_run
from loadtest.workload import BenchRequest, num_useful_tokens

MATMUL_N = 8192   # big enough to reach the bf16 tensor-core rate on an H100
COPY_BYTES = 1 << 30


def measure_machine(argv: list[str]) -> dict:
    """The two rates the limit needs, and the machine they were measured on."""
    return {"copy_bandwidth": copy_bandwidth(COPY_BYTES, "cuda", repeats=10),
            "bf16_flop_rate": matmul_flop_rate(MATMUL_N, torch.bfloat16, "cuda", repeats=10),
            "machine": run_metadata(argv)["machine"]}


def peer_ours(model_path: str, requests: list[BenchRequest], warmup: list[BenchRequest],
              batch_size: int | None, timeout_s: float, async_scheduling: bool = True) -> PeerResult:
    from engine import LLM

    llm = LLM(model=model_path, dtype="bfloat16", device="cuda", max_num_seqs=256,
              enable_prefix_caching=True, seed=0, async_scheduling=async_scheduling)
    try:
        watch, _ = timed_engine_run(llm, requests, warmup)
    finally:
        shutdown(llm)
    return PeerResult(name="ours" if async_scheduling else "ours_sync", elapsed_s=watch.wall_s,
                      cpu_s=watch.cpu_s, num_useful_tokens=num_useful_tokens(requests),
                      settings={"max_num_seqs": 256, "dtype": "bfloat16", "async_scheduling": async_scheduling})


def peer_ours_sync(model_path: str, requests: list[BenchRequest], warmup: list[BenchRequest],
                   batch_size: int | None, timeout_s: float) -> PeerResult:
    """Ours with one step at a time: what overlapped scheduling buys, in the same run."""
    return peer_ours(model_path, requests, warmup, batch_size, timeout_s, async_scheduling=False)


def peer_hf_static(model_path: str, requests: list[BenchRequest], warmup: list[BenchRequest],
                   batch_size: int | None, timeout_s: float) -> PeerResult:
    """Batches sorted by output length (the faster static setting: fewer wasted steps), left-padded."""
    if batch_size is None:
        raise ValueError("hf_static needs --batch-size")
    model = load_hf_model(model_path, torch.bfloat16, "cuda")
    hf_static(model, warmup, batch_size=len(warmup), sort_by_output=True, name="warmup")
    return hf_static(model, requests, batch_size, sort_by_output=True, name=f"hf_static_bs{batch_size}")


def peer_hf_cb(model_path: str, requests: list[BenchRequest], warmup: list[BenchRequest],
               batch_size: int | None, timeout_s: float) -> PeerResult:
    return hf_continuous(load_cb_model(model_path), requests, warmup, timeout_s)


PEERS = {"ours": peer_ours, "ours_sync": peer_ours_sync, "hf_static": peer_hf_static, "hf_cb": peer_hf_cb}


def run_peer(name: str, model_path: str, requests: list[BenchRequest], warmup: list[BenchRequest],
             batch_size: int | None, timeout_s: float) -> dict:
    """A peer's result as a dict; running out of GPU memory is a result too (that batch size
    does not fit), any other failure propagates and fails the child."""
    try:
        return PEERS[name](model_path, requests, warmup, batch_size, timeout_s).to_dict()
    except torch.cuda.OutOfMemoryError as exc:
        return {"name": name, "error": f"out of GPU memory: {str(exc)[:200]}"}
