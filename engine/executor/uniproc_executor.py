"""Executors run the model for the engine: in-process (one device) or across TP worker processes.

Both expose the same small surface, so `LLMEngine` doesn't know which it has.
"""
from __future__ import annotations

from pathlib import Path

from engine.config import EngineConfig, ModelConfig
from engine.worker.model_runner import ModelRunner, StepHandle
from engine.core.messages import ModelRunnerOutput, SchedulerOutput


class UniprocExecutor:
    def __init__(self, config: EngineConfig, model_config: ModelConfig, model_path: Path,
                 eos_token_ids: list[int]):
        self.runner = ModelRunner(config, model_config, model_path, eos_token_ids)
        self.num_kv_blocks = self.runner.num_kv_blocks
        self.num_host_kv_blocks = self.runner.num_host_kv_blocks

    # The step in three launches, for overlapped scheduling (see ModelRunner.forward).
    def forward(self, scheduler_output: SchedulerOutput) -> StepHandle:
        return self.runner.forward(scheduler_output)

    def sample(self, handle: StepHandle, allowed_token_bitmask=None) -> StepHandle:
        return self.runner.sample(handle, allowed_token_bitmask)

    def collect(self, handle: StepHandle) -> ModelRunnerOutput:
        return self.runner.collect(handle)

    def free_seq(self, seq_id: int) -> None:
        self.runner.free_seq(seq_id)

    def set_failure_callback(self, callback) -> None:
        """Nothing runs outside this process, so nothing can die behind the engine's back."""

    def shutdown(self) -> None:
        pass
