"""Tensor parallelism across processes: rank 0 runs in the engine's process, ranks 1..N-1 in workers.

    engine process (rank 0)                     worker process (rank r, engine/executor/tp_worker.py)
    prepare_inputs(sched_out) -> ModelInput ──pipe──> run_model(ModelInput)
    run_model(ModelInput)     <── collectives inside the layers (all_reduce / all_gather) ──>
    sample(logits)                              (logits discarded)

Only rank 0 samples, so sampler state (seeded generators) lives in one place.
The rendezvous address comes from the config or a free port picked at run time.

Failures: one thread per worker reads its stderr (forwarded to ours, last lines kept) and
sees its exit. At start-up, a worker that exits or has not joined by `worker_start_timeout_s`
fails the constructor with `WorkerDiedError` / `TimeoutError` naming the rank, its exit code
and its last stderr lines. Once running, a worker's exit is reported within a moment to the
failure callback (AsyncLLM fails every waiter with it), the other workers are stopped, and
the next step raises the same error instead of waiting in a collective.
"""
from __future__ import annotations

import collections
import dataclasses
import logging
import multiprocessing as mp
import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Callable

from engine.executor import tp_worker
from engine.config import EngineConfig, ModelConfig
from engine.executor.parallel_state import destroy_tp_group, init_group
from engine.errors import WorkerDiedError
from engine.executor.network_utils import free_port
from engine.core.messages import ModelRunnerOutput, SchedulerOutput

logger = logging.getLogger(__name__)
_STDERR_TAIL_LINES = 20
_REPO_ROOT = str(Path(__file__).resolve().parents[2])  # so `-m engine.executor.tp_worker` imports this tree


class _Worker:
    """One worker process: its pipe, and a thread that forwards its stderr and notices its exit."""

    def __init__(self, rank: int, on_exit: Callable[["_Worker"], None]):
        self.rank = rank
        parent, child = mp.Pipe()
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (_REPO_ROOT, os.environ.get("PYTHONPATH")) if p)}
        self.proc = subprocess.Popen([sys.executable, "-m", "engine.executor.tp_worker", str(child.fileno())],
                                     pass_fds=[child.fileno()], stdin=subprocess.DEVNULL,
                                     stderr=subprocess.PIPE, env=env)
        child.close()
        self.conn = parent
        self.stderr_tail: collections.deque[str] = collections.deque(maxlen=_STDERR_TAIL_LINES)
        self._thread = threading.Thread(target=self._pump, args=(on_exit,), name=f"tp-worker-{rank}-stderr",
                                        daemon=True)
        self._thread.start()

    def _pump(self, on_exit) -> None:
        for raw in iter(self.proc.stderr.readline, b""):
            line = raw.decode(errors="replace")
            self.stderr_tail.append(line.rstrip("\n"))
            try:
                sys.stderr.write(f"(tp rank {self.rank}) {line}")
            except (OSError, ValueError):
                pass  # our stderr is closed: keeping the tail is enough
        self.proc.stderr.close()
        self.proc.wait()
        on_exit(self)

    def describe(self) -> str:
        if self._thread is not threading.current_thread():
            self._thread.join(timeout=2)  # the tail is complete once the pump has seen EOF
        code = self.proc.poll()
        state = f"exited with code {code}" if code is not None else "is still running"
        tail = "\n".join(f"    {line}" for line in self.stderr_tail) or "    (nothing)"
        return f"TP worker rank {self.rank} (pid {self.proc.pid}) {state}; last lines of its stderr:\n{tail}"

    def wait_for(self, expected: str, deadline: float, timeout_s: float):
        """The next message, which must be `expected`; WorkerDiedError / TimeoutError otherwise."""
        while not self.conn.poll(0.1):
            if self.proc.poll() is not None:
                raise WorkerDiedError(f"{self.describe()}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"TP worker rank {self.rank} did not report {expected!r} within "
                                   f"worker_start_timeout_s={timeout_s}s. {self.describe()}")
        try:
            op, arg = self.conn.recv()
        except (EOFError, OSError):
            self.proc.wait(timeout=5)
            raise WorkerDiedError(self.describe()) from None
        if op != expected:
            raise WorkerDiedError(f"TP worker rank {self.rank} sent {op!r}, expected {expected!r}")
        return arg

    def stop(self, timeout: float) -> None:
        try:
            self.conn.send((tp_worker.SHUTDOWN, None))
        except (BrokenPipeError, OSError):
            pass
        try:
            self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.conn.close()
        if self._thread is not threading.current_thread():
            self._thread.join(timeout=timeout)


class MultiprocExecutor:
    def __init__(self, config: EngineConfig, model_config: ModelConfig, model_path: Path,
                 eos_token_ids: list[int]):
        if config.distributed_init_method is None:
            config = dataclasses.replace(config, distributed_init_method=f"tcp://127.0.0.1:{free_port()}")
        self._closing = False
        self._error: WorkerDiedError | None = None
        self._on_failure: Callable[[BaseException], None] | None = None
        self._lock = threading.Lock()
        timeout_s = config.worker_start_timeout_s
        deadline = time.monotonic() + timeout_s
        self.workers: list[_Worker] = []
        try:
            for rank in range(1, config.tensor_parallel_size):
                self.workers.append(_Worker(rank, self._on_worker_exit))
                self.workers[-1].conn.send((rank, config, model_config, model_path, eos_token_ids))
            # Join the group only once every worker is about to: a worker that dies while
            # importing would otherwise leave rank 0 waiting in the rendezvous.
            for w in self.workers:
                w.wait_for(tp_worker.JOINING, deadline, timeout_s)
            init_group(0, config)
            from engine.worker.model_runner import ModelRunner
            self.runner = ModelRunner(config, model_config, model_path, eos_token_ids)
            for w in self.workers:
                w.wait_for(tp_worker.READY, deadline, timeout_s)
        except BaseException as e:
            dead = next((w for w in self.workers if w.proc.poll() is not None), None)
            self.shutdown(timeout=2)  # a worker stuck in its start-up will not answer
            if dead is not None and not isinstance(e, (WorkerDiedError, TimeoutError)):
                raise WorkerDiedError(f"tensor-parallel start-up failed: {dead.describe()}") from e
            raise
        self.num_kv_blocks = self.runner.num_kv_blocks
        self.num_host_kv_blocks = self.runner.num_host_kv_blocks  # every rank holds as many (a min over ranks)

    @property
    def worker_pids(self) -> list[int]:
        return [w.proc.pid for w in self.workers]

    def set_failure_callback(self, callback: Callable[[BaseException], None] | None) -> None:
        """`callback(error)` runs (on a watcher thread) when a worker dies while the engine runs."""
        self._on_failure = callback

    def _on_worker_exit(self, worker: _Worker) -> None:
        with self._lock:
            if self._closing or self._error is not None:
                return
            self._error = WorkerDiedError(f"the engine lost a tensor-parallel worker: {worker.describe()}")
            logger.error("%s", self._error)
        for w in self.workers:  # the others cannot make progress without it
            if w is not worker and w.proc.poll() is None:
                w.proc.kill()
        callback = self._on_failure
        if callback is not None:
            callback(self._error)

    def forward(self, scheduler_output: SchedulerOutput):
        # Workers replay the host-side ModelInput, so the engine never overlaps TP steps
        # (a decode input still on rank 0's device would not reach them).
        if self._error is not None:
            raise self._error
        model_input = self.runner.prepare_inputs(scheduler_output)
        try:
            for w in self.workers:
                w.conn.send((tp_worker.EXECUTE, model_input))
            logits = self.runner.run_model(model_input)
        except BaseException as e:
            dead = self._dead_worker(timeout_s=2.0)
            if dead is not None or self._error is not None:
                # A pipe or collective error is the symptom; the worker's exit the cause.
                raise self._error or WorkerDiedError(dead.describe()) from e
            raise
        from engine.worker.model_runner import StepHandle
        return StepHandle(scheduler_output, logits)

    def _dead_worker(self, timeout_s: float):
        """A worker that has exited, waiting up to timeout_s: a peer's reset connection can reach
        rank 0 before the exit is visible here (the watcher thread may be reaping it right then)."""
        deadline = time.monotonic() + timeout_s
        while True:
            dead = next((w for w in self.workers if w.proc.poll() is not None), None)
            if dead is not None or self._error is not None or time.monotonic() > deadline:
                return dead
            time.sleep(0.02)

    def sample(self, handle, allowed_token_bitmask=None):
        return self.runner.sample(handle, allowed_token_bitmask)

    def collect(self, handle) -> ModelRunnerOutput:
        return self.runner.collect(handle)

    def free_seq(self, seq_id: int) -> None:
        self.runner.free_seq(seq_id)

    def shutdown(self, timeout: float = 10.0) -> None:
        """Stop every worker (killed after `timeout`), then leave the process group. Idempotent."""
        with self._lock:
            self._closing = True
        for w in self.workers:
            w.stop(timeout)
        self.workers = []
        destroy_tp_group()
