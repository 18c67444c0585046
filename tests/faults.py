"""Fault injection for tests: make an AsyncLLM's step loop fail, as a bug in a step would.

    await fail_next_step(llm, RuntimeError("boom"))
    # every waiter: EngineDeadError("the engine loop died: RuntimeError('boom')"); check_health raises

Production code has no test entry point, so the fault comes in from here:

- in-process (`llm.engine` is in this process), any AsyncLLM: the engine's step is patched;
- engine_process=True: the step runs in another process, out of a patch's reach. Build the
  AsyncLLM with `engine_core_class=StepFaultEngineCore` (it is started in the engine process,
  so this module must be importable there; a spawned process gets its parent's sys.path). The
  error then travels as an abort, the one message any engine takes (an unknown id is a no-op
  elsewhere), whose request id carries it pickled.
"""
from __future__ import annotations

import asyncio
import base64
import pickle

from engine.core.engine_core import EngineCore, OutputPair

_FAIL_NEXT_STEP = "tests.faults/fail-next-step:"  # request id prefix of the abort that carries the error


async def fail_next_step(llm, error: BaseException) -> None:
    """The step loop's next iteration steps, busy or idle, and that step raises `error`.

    `llm`: an in-process AsyncLLM, or one built with engine_process=True and
    engine_core_class=StepFaultEngineCore (TypeError otherwise: nothing could reach its step).
    """
    if llm.engine is not None:
        _patch_step(llm.engine, error)
    elif not issubclass(llm._client.engine_core_class, StepFaultEngineCore):
        raise TypeError("fail_next_step needs AsyncLLM(engine_process=True, engine_core_class=StepFaultEngineCore)")
    # Wakes an idle loop; a StepFaultEngineCore reads the error from the id.
    await llm.abort(_FAIL_NEXT_STEP + base64.b64encode(pickle.dumps(error)).decode())


async def drain_all(streams, timeout_s: float) -> list:
    """Read each AsyncLLM stream to its end, together; each one's last item or the error that ended it.
    Fails (asyncio.TimeoutError) if they have not all ended within timeout_s: a waiter left hanging."""
    async def drain(stream):
        item = None
        async for item in stream:
            pass
        return item
    return await asyncio.wait_for(asyncio.gather(*map(drain, streams), return_exceptions=True), timeout_s)


def _patch_step(engine, error: BaseException) -> None:
    def step():
        raise error
    engine.step = step
    engine.has_unfinished_requests = lambda: True  # so an idle loop steps too


class StepFaultEngineCore(EngineCore):
    """An EngineCore whose next iteration steps and raises the error that fail_next_step's abort carries."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.fault: BaseException | None = None  # set by the caller's (input) thread, read by the loop

    def abort_request(self, request_id: str) -> None:
        if not request_id.startswith(_FAIL_NEXT_STEP):
            super().abort_request(request_id)
            return
        self.fault = pickle.loads(base64.b64decode(request_id[len(_FAIL_NEXT_STEP):]))
        self.wakeup.set()

    def has_work(self) -> bool:
        return self.fault is not None or super().has_work()

    def step(self) -> list[OutputPair]:
        if self.fault is not None:
            raise self.fault
        return super().step()
