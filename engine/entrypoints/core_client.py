"""How `AsyncLLM` reaches its `EngineCore`: one interface, two clients, chosen once by `make_client`.

    InprocClient: EngineCore on a daemon thread of this process
        AsyncLLM -- make_request (validated here) --> core.add_request --> step loop thread
                 <-- on_outputs(pairs, stats, iteration stats), called by that thread

    MPClient: EngineCore in a spawned engine process, pickled messages over two pipes
        AsyncLLM -- ("add", (id, prompt, params, lora, priority)) --> input thread: make_request -> core.add_request
                 -- ("abort", id) | ("stop", None) --> core.abort_request | core.stop
                 <-- ("out", pairs, stats, iteration stats) | ("dead", error) -- step loop
        reader thread: each message -> on_outputs / on_dead

Why a process: its own GIL, which an in-process step thread shares with the caller's event loop
and the serving machinery (docs/benchmarks.md, "the engine's step loop in its own process"). The
price is a pickled message per step each way, kept small by sending each prompt once (`PromptCache`).

In the engine process requests are tokenized and validated there (it owns the tokenizer): an
invalid one gets its error back as its only output. The process (engine/core/engine_core.py,
`run_engine_core`) exits when told to stop or when its input pipe closes (the parent died), so
it never outlives its owner for long.
"""
from __future__ import annotations

import abc
import asyncio
import logging
import multiprocessing
import threading
from typing import Callable

from engine.config import EngineConfig
from engine.core.engine_core import CoreInfo, EngineCore, OnOutputs, PromptCache, run_engine_core
from engine.core.llm_engine import LLMEngine, PromptType
from engine.errors import EngineDeadError
from engine.lora.request import LoRARequest
from engine.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

START_TIMEOUT_S = 600.0  # model load included
OnDead = Callable[[BaseException], None]


def make_client(config: EngineConfig, engine_process: bool, on_outputs: OnOutputs, on_dead: OnDead,
                engine_core_class: type[EngineCore] = EngineCore) -> "EngineCoreClient":
    """The client for this mode, started. on_outputs / on_dead are called from the step loop's
    thread (in-process) or the reader thread (engine process); they must hold the caller weakly."""
    client_class = MPClient if engine_process else InprocClient
    return client_class(config, on_outputs, on_dead, engine_core_class)


class EngineCoreClient(abc.ABC):
    """A started EngineCore and the way to it. Thread-safe add_request / abort."""

    info: CoreInfo
    engine: LLMEngine | None  # the engine, if it lives in this process

    @property
    @abc.abstractmethod
    def tokenizer(self):
        """The engine's tokenizer; AttributeError where it lives in another process."""

    @abc.abstractmethod
    async def make_request(self, request_id: str, prompt: PromptType, params: SamplingParams,
                           lora_request: LoRARequest | None = None, priority: int = 0):
        """What add_request takes: in-process, a validated RequestState (ValueError raised here);
        for an engine process, the request as given (validated there: an error is its only output)."""

    @abc.abstractmethod
    def add_request(self, request) -> None:
        """Queue a request for the step loop; EngineDeadError if the engine cannot be reached."""

    @abc.abstractmethod
    def abort(self, request_id: str) -> None:
        """Abort a request if the engine has it (its final output comes with finish_reason "abort")."""

    @abc.abstractmethod
    def is_alive(self) -> bool:
        """The step loop still runs."""

    @abc.abstractmethod
    def close(self, timeout: float = 10.0) -> None:
        """Stop the step loop (after what was queued before) and the engine with its TP workers. Idempotent."""


class InprocClient(EngineCoreClient):
    """The EngineCore on a daemon thread of this process: torch releases the GIL in the forward,
    so the caller's event loop stays responsive."""

    def __init__(self, config: EngineConfig, on_outputs: OnOutputs, on_dead: OnDead,
                 engine_core_class: type[EngineCore] = EngineCore):
        self.engine = LLMEngine(config)
        self.info = CoreInfo.of(self.engine)
        on_outputs([], self.engine.get_stats(), [])  # stats from the start, before the loop's first
        self.core = engine_core_class(self.engine, on_outputs, on_dead)
        self._thread = threading.Thread(target=self.core.run_busy_loop, name="engine-step-loop", daemon=True)
        self._thread.start()

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    async def make_request(self, request_id: str, prompt: PromptType, params: SamplingParams,
                           lora_request: LoRARequest | None = None, priority: int = 0):
        if params.structured_outputs is not None:  # grammar compilation may take a while: not on the loop
            return await asyncio.to_thread(self.engine.make_request, request_id, prompt, params,
                                           lora_request=lora_request, priority=priority)
        return self.engine.make_request(request_id, prompt, params, lora_request=lora_request, priority=priority)

    def add_request(self, request) -> None:
        self.core.add_request(request)

    def abort(self, request_id: str) -> None:
        self.core.abort_request(request_id)

    def is_alive(self) -> bool:
        return self._thread.is_alive()

    def close(self, timeout: float = 10.0) -> None:
        self.core.stop()
        if self._thread is not threading.current_thread():  # a finalizer may run on the loop's thread
            self._thread.join(timeout)
        self.engine.shutdown()


class MPClient(EngineCoreClient):
    """The EngineCore in an engine process of its own; a reader thread hands its messages on.

    engine_core_class runs in the child, so it must be importable there (pickled by name).
    """

    engine = None

    def __init__(self, config: EngineConfig, on_outputs: OnOutputs, on_dead: OnDead,
                 engine_core_class: type[EngineCore] = EngineCore):
        ctx = multiprocessing.get_context("spawn")  # no fork after torch's threads exist
        self._in_recv, self._in_send = ctx.Pipe(duplex=False)     # parent -> child
        self._out_recv, self._out_send = ctx.Pipe(duplex=False)   # child -> parent
        self._send_lock = threading.Lock()
        self._stopping = False
        self.engine_core_class = engine_core_class
        # Not a daemon: a daemonic process may not start the TP workers.
        self.proc = ctx.Process(target=run_engine_core, name="engine-core", daemon=False,
                                args=(config, engine_core_class, _torch_threads(), self._in_recv, self._out_send))
        self.proc.start()
        self._in_recv.close()   # the child's ends: closed here, so EOF means the other side is gone
        self._out_send.close()
        self.info = self._wait_ready()
        self._on_outputs, self._on_dead = on_outputs, on_dead
        self._prompts = PromptCache()  # the reader thread's alone
        self._reader = threading.Thread(target=self._read, name="engine-core-reader", daemon=True)
        self._reader.start()

    @property
    def tokenizer(self):
        raise AttributeError("AsyncLLM(engine_process=True) holds no tokenizer: the engine process does")

    async def make_request(self, request_id: str, prompt: PromptType, params: SamplingParams,
                           lora_request: LoRARequest | None = None, priority: int = 0):
        # Validated in the engine process: an error is the request's output.
        return request_id, prompt, params, lora_request, priority

    def add_request(self, request) -> None:
        try:
            self._send(("add", request))
        except (OSError, ValueError):  # the pipe is closed: the engine process is gone
            raise EngineDeadError("the engine process is gone") from None

    def abort(self, request_id: str) -> None:
        try:
            self._send(("abort", request_id))
        except (OSError, ValueError):
            pass  # the engine process is gone, and the request with it

    def is_alive(self) -> bool:
        return self.proc.is_alive()

    def close(self, timeout: float = 10.0) -> None:
        """Stop the child (it shuts its engine and TP workers down); kill it if it does not exit."""
        self._stopping = True
        try:
            self._send(("stop", None))
        except (OSError, ValueError):
            pass  # already gone
        self.proc.join(timeout)
        if self.proc.is_alive():
            logger.warning("engine process %d did not stop in %.0f s: killing it", self.proc.pid, timeout)
            self.proc.kill()
            self.proc.join(5.0)
        reader = getattr(self, "_reader", None)
        if reader is not None and reader is not threading.current_thread():
            reader.join(timeout)  # every output the child sent before it stopped is delivered
        for conn in (self._in_send, self._out_recv):
            conn.close()

    def _send(self, message: tuple) -> None:
        with self._send_lock:
            self._in_send.send(message)

    def _wait_ready(self) -> CoreInfo:
        if not self._out_recv.poll(START_TIMEOUT_S):
            self.close(timeout=1.0)
            raise EngineDeadError(f"the engine process did not start within {START_TIMEOUT_S:.0f} s")
        try:
            kind, payload = self._out_recv.recv()
        except EOFError:
            self.proc.join(5.0)
            raise EngineDeadError(f"the engine process exited while starting (exit code {self.proc.exitcode})") \
                from None
        if kind == "failed":  # the engine's own error (bad model, out of memory, ...), as raised in-process
            self.proc.join(5.0)
            raise payload
        return payload

    def _read(self) -> None:
        while True:
            try:
                kind, *payload = self._out_recv.recv()
            except (EOFError, OSError):
                if not self._stopping:
                    self._on_dead(EngineDeadError(f"the engine process exited (exit code {self.proc.exitcode})"))
                return
            try:
                if kind == "out":
                    pairs, *rest = payload
                    self._on_outputs(self._prompts.restore(pairs), *rest)
                elif kind == "dead":
                    self._on_dead(payload[0])
            except Exception as e:  # noqa: BLE001 - a bug on this side: fail the waiters, never leave them hanging
                logger.exception("the engine process's outputs could not be delivered")
                self._stopping = True
                self.proc.kill()  # nobody reads its outputs any more
                self._on_dead(EngineDeadError(f"the engine's outputs could not be delivered: {e!r}"))
                return


def _torch_threads() -> int:
    import torch

    return torch.get_num_threads()
