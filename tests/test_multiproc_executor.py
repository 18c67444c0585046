"""Tensor parallelism end to end on CPU: 2 ranks (gloo) equal HF token for token; engines start,
stop and die cleanly (no process, thread, process group or shared memory left behind)."""
import gc
import os
import random
import signal
import threading
import time

import pytest
import torch
import torch.distributed as dist

from engine import LLM, EngineConfig, SamplingParams
from engine.executor.multiproc_executor import WorkerDiedError
from tests.hf_reference import assert_matches, hf_greedy

TP_CPU = dict(device="cpu", dtype="float32", num_kv_blocks=64, max_num_batched_tokens=64)
GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)


def child_pids() -> set[int]:
    """This process's live child processes (every thread's, from /proc)."""
    pids = set()
    for task in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{task}/children") as f:
                pids |= {int(p) for p in f.read().split()}
        except FileNotFoundError:  # a thread that just ended
            pass
    return pids


def resources() -> dict:
    """What an engine could leave behind: children, Python threads, a process group, /dev/shm files."""
    return {"children": child_pids(), "threads": {t.name for t in threading.enumerate() if t.is_alive()},
            "process_group": dist.is_initialized(), "shm": set(os.listdir("/dev/shm"))}


def wait_until_released(before: dict, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while resources() != before and time.monotonic() < deadline:
        time.sleep(0.1)
    assert resources() == before


@pytest.mark.parametrize("arch", ["tiny_llama", "tiny_qwen2"])  # qwen2's single KV head is replicated
def test_tp2_greedy_equals_hf(arch, request):
    path = request.getfixturevalue(arch)
    llm = LLM(path, device="cpu", dtype="float32", tensor_parallel_size=2, max_num_batched_tokens=64)
    try:
        rng = random.Random(3)
        vocab = llm.llm_engine.model_config.vocab_size
        prompts = [[rng.randrange(vocab) for _ in range(n)] for n in (3, 40, 150)]
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                            SamplingParams(temperature=0, max_tokens=12, ignore_eos=True), use_tqdm=False)
        for p, o in zip(prompts, outs):
            assert_matches(o.outputs[0].token_ids, hf_greedy(path, p, 12), f"tp=2, {len(p)} tokens")
        llm.llm_engine.block_manager.check_no_leak()
    finally:
        llm.llm_engine.shutdown()


@pytest.mark.parametrize("device, backend", [("cpu", "gloo"), ("cuda", "nccl")])
def test_tp_backend_follows_the_engine_device_not_the_machine(monkeypatch, device, backend):
    """device='cpu' on a GPU host once picked NCCL, which cannot reduce CPU tensors."""
    from engine.executor import parallel_state

    seen = {}
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # a GPU host, as far as we know
    monkeypatch.setattr(parallel_state, "init_tp_group",
                        lambda rank, size, method, backend=None, timeout=None: seen.update(backend=backend))
    config = EngineConfig(model="unused", device=device, tensor_parallel_size=2,
                          distributed_init_method="tcp://127.0.0.1:1")
    parallel_state.init_group(0, config)
    assert seen["backend"] == backend


@pytest.mark.parametrize("tp", [1, 2])
def test_engines_one_after_another_leave_nothing_behind(tiny_llama, tp):
    """A second TP engine in one process once failed: 'torch.distributed is already initialized'."""
    before = resources()
    outs = []
    for _ in range(2):  # shutdown by context manager
        with LLM(tiny_llama, tensor_parallel_size=tp, **TP_CPU) as llm:
            assert len(child_pids()) == len(before["children"]) + tp - 1
            outs.append(llm.generate({"prompt_token_ids": [1, 2, 3]}, GREEDY, use_tqdm=False)[0])
        wait_until_released(before)
        with pytest.raises(RuntimeError, match="shut down"):
            llm.generate("again", GREEDY, use_tqdm=False)
    llm = LLM(tiny_llama, tensor_parallel_size=tp, **TP_CPU)  # shutdown by garbage collection
    outs.append(llm.generate({"prompt_token_ids": [1, 2, 3]}, GREEDY, use_tqdm=False)[0])
    del llm
    gc.collect()
    wait_until_released(before)
    assert outs[0].outputs[0].token_ids == outs[1].outputs[0].token_ids == outs[2].outputs[0].token_ids


def test_a_second_live_tp_engine_is_refused_with_advice(tiny_llama):
    with LLM(tiny_llama, tensor_parallel_size=2, **TP_CPU):
        with pytest.raises(RuntimeError, match="already initialized.*llm.shutdown"):
            LLM(tiny_llama, tensor_parallel_size=2, **TP_CPU)


def _failing_bootstrap(tmp_path, monkeypatch, body: str) -> None:
    """Every new Python process (so the TP worker, not this one) runs `body` at start-up."""
    (tmp_path / "sitecustomize.py").write_text(body)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")]))


def test_worker_dying_at_start_fails_naming_rank_exit_code_and_stderr(tiny_llama, tmp_path, monkeypatch):
    before = resources()
    _failing_bootstrap(tmp_path, monkeypatch,
                       "import os, sys\nsys.stderr.write('simulated bootstrap failure\\n')\n"
                       "sys.stderr.flush()\nos._exit(3)\n")
    t0 = time.monotonic()
    with pytest.raises(WorkerDiedError) as info:
        LLM(tiny_llama, tensor_parallel_size=2, **TP_CPU)
    assert time.monotonic() - t0 < 30
    message = str(info.value)
    assert "rank 1" in message and "exited with code 3" in message and "simulated bootstrap failure" in message
    wait_until_released(before)


def test_worker_not_joining_within_the_deadline_fails(tiny_llama, tmp_path, monkeypatch):
    before = resources()
    _failing_bootstrap(tmp_path, monkeypatch, "import sys, time\nprint('stuck in bootstrap', file=sys.stderr, "
                                              "flush=True)\ntime.sleep(600)\n")
    t0 = time.monotonic()
    with pytest.raises(TimeoutError) as info:
        LLM(tiny_llama, tensor_parallel_size=2, worker_start_timeout_s=3, **TP_CPU)
    assert time.monotonic() - t0 < 20
    assert "rank 1" in str(info.value) and "worker_start_timeout_s=3" in str(info.value)
    assert "stuck in bootstrap" in str(info.value)
    wait_until_released(before)


def test_worker_killed_while_running_fails_the_next_step_and_leaves_nothing(tiny_llama):
    before = resources()
    llm = LLM(tiny_llama, tensor_parallel_size=2, **TP_CPU)
    os.kill(llm.llm_engine.executor.worker_pids[0], signal.SIGKILL)
    t0 = time.monotonic()
    with pytest.raises(WorkerDiedError, match=r"rank 1 .*exited with code -9"):
        llm.generate({"prompt_token_ids": [1, 2, 3]}, GREEDY, use_tqdm=False)
    assert time.monotonic() - t0 < 5
    llm.shutdown()
    wait_until_released(before)


def test_worker_start_timeout_is_validated():
    with pytest.raises(ValueError, match="worker_start_timeout_s=0"):
        EngineConfig(model="unused", worker_start_timeout_s=0)


def test_a_script_without_a_main_guard_runs_tp(tiny_llama, tmp_path):
    """Workers are fresh interpreters (python -m engine.executor.tp_worker), not multiprocessing spawn
    children re-importing the script: no `if __name__ == "__main__":` guard is needed."""
    import subprocess
    import sys
    script = tmp_path / "no_guard.py"
    script.write_text(
        "from engine import LLM, SamplingParams\n"
        f"llm = LLM({tiny_llama!r}, tensor_parallel_size=2, device='cpu', dtype='float32', num_kv_blocks=64)\n"
        "out = llm.generate({'prompt_token_ids': [1, 2, 3]}, SamplingParams(max_tokens=3, ignore_eos=True),\n"
        "                   use_tqdm=False)\n"
        "print('TOKENS', len(out[0].outputs[0].token_ids))\n")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([root, os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120, env=env)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "TOKENS 3" in done.stdout
