"""Tensor parallelism across processes: rank 0 runs in the engine's process, ranks 1..N-1 in workers.

    engine process (rank 0)                     worker process (rank r)
    prepare_inputs(sched_out) -> ModelInput ──pipe──> run_model(ModelInput)
    run_model(ModelInput)     <── collectives inside the layers (all_reduce / all_gather) ──>
    sample(logits)                              (logits discarded)

Only rank 0 samples, so sampler state (seeded generators) lives in one place.
The rendezvous address comes from the config or a free port picked at run time.
"""
from __future__ import annotations

import logging
import multiprocessing as mp
import socket
from pathlib import Path

from engine.config import EngineConfig, ModelConfig
from engine.distributed import destroy_tp_group, init_tp_group
from engine.outputs import ModelRunnerOutput, SchedulerOutput

logger = logging.getLogger(__name__)
_READY, _EXECUTE, _SHUTDOWN = "ready", "execute", "shutdown"


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _init_group(rank: int, config: EngineConfig) -> None:
    # The engine's device picks the backend, not the machine: device="cpu" on a host with
    # GPUs still needs gloo (NCCL cannot reduce CPU tensors).
    from engine.model_runner import resolve_device
    backend = "nccl" if resolve_device(config.device).type == "cuda" else "gloo"
    init_tp_group(rank, config.tensor_parallel_size, config.distributed_init_method, backend=backend)


def _worker_main(rank: int, config: EngineConfig, model_config: ModelConfig, model_path: Path,
                 eos_token_ids: list[int], conn) -> None:
    from engine.model_runner import ModelRunner
    try:
        _init_group(rank, config)
        runner = ModelRunner(config, model_config, model_path, eos_token_ids)
        conn.send((_READY, runner.num_kv_blocks))
        while True:
            op, arg = conn.recv()
            if op == _SHUTDOWN:
                break
            runner.run_model(arg)
    except (EOFError, KeyboardInterrupt):
        pass  # the engine went away: nothing left to serve
    finally:
        destroy_tp_group()


class MultiprocExecutor:
    def __init__(self, config: EngineConfig, model_config: ModelConfig, model_path: Path,
                 eos_token_ids: list[int]):
        import dataclasses
        if config.distributed_init_method is None:
            config = dataclasses.replace(config, distributed_init_method=f"tcp://127.0.0.1:{_free_port()}")
        ctx = mp.get_context("spawn")  # fork after torch/threads are up is unsafe
        self.workers, self.conns = [], []
        for rank in range(1, config.tensor_parallel_size):
            parent, child = ctx.Pipe()
            p = ctx.Process(target=_worker_main, name=f"tp-worker-{rank}", daemon=True,
                            args=(rank, config, model_config, model_path, eos_token_ids, child))
            p.start()
            self.workers.append(p)
            self.conns.append(parent)
        from engine.model_runner import ModelRunner
        try:
            _init_group(0, config)
            self.runner = ModelRunner(config, model_config, model_path, eos_token_ids)
            for conn in self.conns:
                op, _ = conn.recv()
                assert op == _READY
        except BaseException:
            self.shutdown()
            raise
        self.num_kv_blocks = self.runner.num_kv_blocks

    def execute_model(self, scheduler_output: SchedulerOutput, allowed_token_bitmask=None) -> ModelRunnerOutput:
        return self.collect(self.sample(self.forward(scheduler_output), allowed_token_bitmask))

    def forward(self, scheduler_output: SchedulerOutput):
        # Workers replay the host-side ModelInput, so the engine never overlaps TP steps
        # (a decode input still on rank 0's device would not reach them).
        model_input = self.runner.prepare_inputs(scheduler_output)
        for conn in self.conns:
            conn.send((_EXECUTE, model_input))
        from engine.model_runner import StepHandle
        return StepHandle(scheduler_output, self.runner.run_model(model_input))

    def sample(self, handle, allowed_token_bitmask=None):
        return self.runner.sample(handle, allowed_token_bitmask)

    def collect(self, handle) -> ModelRunnerOutput:
        return self.runner.collect(handle)

    def free_seq(self, seq_id: int) -> None:
        self.runner.free_seq(seq_id)

    def shutdown(self) -> None:
        for conn in self.conns:
            try:
                conn.send((_SHUTDOWN, None))
            except (BrokenPipeError, OSError):
                pass
        for p in self.workers:
            p.join(timeout=10)
            if p.is_alive():
                p.terminate()
        self.workers, self.conns = [], []
        destroy_tp_group()
