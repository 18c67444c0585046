"""`AsyncLLM`: the engine behind asyncio, for serving.

    callers (event loop)                     step thread
    generate() -- make_request (validate) -> _pending ----> engine.add_request_state
               <- RequestOutputCollector <-- one call_soon_threadsafe per step: every output
    abort()    ----------------------------> _pending ----> engine.abort_request

Per step, the event loop is woken once for all requests, not once per request, and a
reader that is behind gets its deltas merged (engine/entrypoints/output_collector.py). A caller may
also ask for fewer, larger outputs (`stream_interval_s`): the end, and everything up to
the first output with text, still come at once.

The step loop runs in a thread: torch releases the GIL in the forward, so the
event loop stays responsive. Engine state is touched only by that thread; the
callers talk to it through `_pending`. An exception in the loop reaches every
waiting request, and the engine is then dead (check_health raises).
"""
from __future__ import annotations

import asyncio
import collections
import logging
import os
import threading
import time
import uuid
import weakref
from typing import Any, AsyncIterator, Callable

from engine.config import EngineConfig
from engine.entrypoints.core_client import EngineCoreClient, apply_pending
from engine.errors import EngineDeadError
from engine.core.llm_engine import LLMEngine, PromptType
from engine.entrypoints.output_collector import RequestOutputCollector
from engine.outputs import RequestOutput
from engine.sampling_params import RequestOutputKind, SamplingParams
from engine.core.stats import IterationStats

logger = logging.getLogger(__name__)


class AsyncLLM:
    """Lifecycle: `shutdown()`, `with AsyncLLM(...)` / `async with`, or best effort when collected
    (the step thread holds only a weak reference). A TP worker that dies fails every waiter
    with EngineDeadError at once, from the executor's watcher thread, and check_health raises."""

    def __init__(self, config: EngineConfig | None = None, *, engine_process: bool = False, **kwargs: Any):
        """engine_process: run the step loop in a process of its own (engine/entrypoints/core_client.py), out
        of this interpreter's GIL; `engine` is then None. Default: a thread of this process."""
        config = config or EngineConfig(**kwargs)
        self._pending: collections.deque = collections.deque()  # ("add", state) | ("abort", request_id)
        self._waiters: dict[str, tuple[asyncio.AbstractEventLoop, RequestOutputCollector]] = {}
        self._wakeup = threading.Event()
        self._stop = False
        self._error: BaseException | None = None
        # Per-step observations (engine/core/stats.py), handed from the step thread to whoever exports
        # metrics (pop_iteration_stats); bounded, so nobody draining costs a fixed amount of memory.
        self._iteration_stats: collections.deque[IterationStats] = collections.deque(maxlen=4096)
        ref = weakref.ref(self)
        self._core: EngineCoreClient | None = None
        if engine_process:
            self.engine = None
            self._core = EngineCoreClient(config, _torch_threads(),
                                          on_outputs=lambda *a: _call_if_alive(ref, "_on_core_outputs", *a),
                                          on_dead=lambda e: _call_if_alive(ref, "_die", e))
            self._stats: dict[str, float] = {}
            self._finalizer = weakref.finalize(self, self._core.close)
            return
        self.engine = LLMEngine(config)
        self.engine.stats_log.enabled = True
        self._stats = self.engine.get_stats()
        self.engine.executor.set_failure_callback(lambda e: _call_if_alive(ref, "_die", e))
        self._thread = threading.Thread(target=AsyncLLM._loop, args=(ref,), name="engine-step-loop", daemon=True)
        self._finalizer = weakref.finalize(self, _stop_engine, self._pending, self._wakeup, self.engine)
        self._thread.start()

    def __enter__(self) -> "AsyncLLM":
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()

    async def __aenter__(self) -> "AsyncLLM":
        return self

    async def __aexit__(self, *exc) -> None:
        await asyncio.to_thread(self.shutdown)

    @property
    def tokenizer(self):
        if self._core is not None:
            raise AttributeError("AsyncLLM(engine_process=True) holds no tokenizer: the engine process does")
        return self.engine.tokenizer

    @property
    def model_config(self):
        return self._core.info.model_config if self._core is not None else self.engine.model_config

    @property
    def engine_config(self) -> EngineConfig:
        return self._core.info.engine_config if self._core is not None else self.engine.config

    @property
    def worker_pids(self) -> list[int]:
        """The TP worker processes' pids (none for a single-process engine)."""
        if self._core is not None:
            return list(self._core.info.worker_pids)
        return list(getattr(self.engine.executor, "worker_pids", []))

    @property
    def engine_pid(self) -> int:
        """The pid of the process that runs the step loop."""
        return self._core.info.pid if self._core is not None else os.getpid()

    @property
    def is_running(self) -> bool:
        return self._loop_alive() and self._error is None and not self._stop

    def _loop_alive(self) -> bool:
        return self._core.is_alive() if self._core is not None else self._thread.is_alive()

    # -- public API -------------------------------------------------------------
    async def generate(self, prompt: PromptType, sampling_params: SamplingParams | None = None,
                       request_id: str | None = None, *,
                       stream_interval_s: float | Callable[[], float] = 0.0) -> AsyncIterator[RequestOutput]:
        """Outputs of one request as the engine makes them (by `sampling_params.output_kind`).

        stream_interval_s > 0: after each output, wait that long (or until the request ends)
        before taking the next, so DELTA outputs carry several steps' tokens. Serving uses it
        to pay per chunk, not per token, on every hop downstream; 0 takes every step's output.
        A callable is asked before each wait (serving stretches the interval with its load).
        Nothing is held until an output has carried text: a first token that is only part of
        a character (byte-level BPE splits most CJK characters and emoji), or text held back
        as a possible stop string, must not push the first visible text an interval later.
        """
        interval = stream_interval_s if callable(stream_interval_s) else (lambda: stream_interval_s)
        if (first := interval()) < 0:
            raise ValueError(f"stream_interval_s={first} must be >= 0")
        self._raise_if_dead()
        request_id = request_id or uuid.uuid4().hex
        params = sampling_params or SamplingParams()
        if self._core is not None:  # validated in the engine process: an error is the request's output
            state = (request_id, prompt, params)
        elif params.structured_outputs is not None:  # grammar compilation may take a while: not on the loop
            state = await asyncio.to_thread(self.engine.make_request, request_id, prompt, params)
        else:
            state = self.engine.make_request(request_id, prompt, params)
        if request_id in self._waiters:
            raise ValueError(f"request_id {request_id!r} is already in use")
        collector = RequestOutputCollector(aggregate=params.output_kind is RequestOutputKind.DELTA)
        self._waiters[request_id] = (asyncio.get_running_loop(), collector)
        # The loop may have died (or stopped) between the check above and the registration:
        # it sets _error/_stop *before* it fails the waiters it can see, so checking again
        # after registering means this request is either failed by the loop or raised here.
        if self._error is not None or self._stop:
            self._waiters.pop(request_id, None)
            self._raise_if_dead()
        self._submit(("add", state))
        finished = shown = False
        try:
            while not finished:
                item = await collector.get()
                finished = item.finished
                shown = shown or any(c.text for c in item.outputs)
                yield item
                if shown and not finished:
                    wait_s = interval()
                    if wait_s > 0:
                        await collector.wait_final(wait_s)
        finally:
            self._waiters.pop(request_id, None)
            if not finished:  # cancelled, closed early or failed: free the engine's resources
                self._submit(("abort", request_id))

    async def abort(self, request_id: str) -> None:
        self._submit(("abort", request_id))

    def get_stats(self) -> dict[str, float]:
        return dict(self._stats)  # a snapshot taken by the step thread; never races the engine

    def pop_iteration_stats(self) -> list[IterationStats]:
        """The engine's observations since the previous call (oldest first), for a metrics exporter."""
        out = []
        while self._iteration_stats:  # popleft is atomic: the step thread appends concurrently
            out.append(self._iteration_stats.popleft())
        return out

    async def check_health(self) -> None:
        self._raise_if_dead()

    def shutdown(self, timeout: float = 10.0) -> None:
        """Abort everything in flight (each waiter gets a final 'abort' output), stop the loop and the
        engine (TP workers, process group). Idempotent."""
        for request_id in list(self._waiters):
            self._submit(("abort", request_id))
        if self._core is not None:
            self._stop = True
            self._core.close(timeout)  # the aborts above go first: the child applies them, then stops
            self._fail_all(EngineDeadError("the engine has been shut down"))
            return
        self._submit(("stop", None))
        if self._thread is not threading.current_thread():
            self._thread.join(timeout)
        self._finalizer()

    def inject_step_error_for_testing(self, error: BaseException) -> None:
        """Test-only fault hook: the step loop raises `error` at its next iteration, as if the
        engine had failed there."""
        self._submit(("raise", error))

    # -- the step thread ------------------------------------------------------------
    def _submit(self, item) -> None:
        if self._core is not None:
            try:
                self._core.send(item)
            except (OSError, ValueError):  # the pipe is closed: the engine process is gone
                if item[0] == "add":
                    self._waiters.pop(item[1][0], None)
                    self._raise_if_dead()
                    raise EngineDeadError("the engine process is gone") from None
            return
        self._pending.append(item)
        self._wakeup.set()

    def _on_core_outputs(self, pairs: list, stats: dict, iteration_stats: list) -> None:
        """From the engine process's reader thread: what the step thread delivers in-process."""
        self._iteration_stats.extend(iteration_stats)
        if stats is not None:  # None: a refusal sent by the engine process's input thread
            self._stats = stats
        if pairs:
            self._deliver(pairs)

    def _raise_if_dead(self) -> None:
        if self._error is not None:
            raise EngineDeadError(f"the engine loop died: {self._error!r}") from self._error
        if self._stop or not self._loop_alive():
            raise EngineDeadError("the engine has been shut down")

    @staticmethod
    def _loop(ref: "weakref.ref[AsyncLLM]") -> None:
        # A weak reference between iterations, so a dropped AsyncLLM is collected (and its
        # finalizer stops the engine) instead of being kept alive by its own thread.
        while True:
            self = ref()
            if self is None or not self._run_once():
                return
            del self

    def _run_once(self) -> bool:
        """One drain + step (or an idle wait); False once the loop has stopped or died."""
        try:
            if not apply_pending(self.engine, self._pending, self._deliver):
                self._stop = True
            if self._error is not None:  # failed from the executor's watcher: waiters were told
                return False
            if self._stop:
                # Stopped: whoever registered after shutdown's aborts would otherwise wait forever.
                self._fail_all(EngineDeadError("the engine has been shut down"))
                return False
            if not self.engine.has_unfinished_requests():
                self._stats = self._snapshot_stats()
                self._wakeup.wait(timeout=1.0)
                self._wakeup.clear()
                return True
            outputs = self.engine.step()
            self._stats = self._snapshot_stats()  # before delivery: a reader never sees stale stats
            self._deliver([(out.request_id, out) for out in outputs])
            return True
        except BaseException as e:  # noqa: BLE001 - every waiter must hear about it
            logger.exception("engine step loop died")
            self._die(e)
            return False

    def _die(self, error: BaseException) -> None:
        """The engine cannot go on (the step loop raised, or a TP worker exited): fail every waiter."""
        if self._error is None:
            self._error = error
        self._fail_all(EngineDeadError(f"the engine loop died: {self._error!r}"))
        self._wakeup.set()

    def _snapshot_stats(self) -> dict[str, float]:
        taken = self.engine.stats_log.take()
        if not taken.is_empty:
            self._iteration_stats.append(taken)
        # The step thread's own CPU time: what the engine costs, apart from the event loop's work.
        return {**self.engine.get_stats(), "step_thread_cpu_s": time.thread_time()}

    def _deliver(self, outputs: list) -> None:
        """Hand (request_id, output or error) pairs to their readers: one wake-up per event loop."""
        by_loop: dict[asyncio.AbstractEventLoop, list] = {}
        for request_id, item in outputs:
            waiter = self._waiters.get(request_id)
            if waiter is not None:
                by_loop.setdefault(waiter[0], []).append((request_id, waiter[1], item))
        for loop, batch in by_loop.items():
            try:
                loop.call_soon_threadsafe(_put_all, batch)
            except RuntimeError:  # the caller's loop is closed: nobody is listening any more
                for request_id, _, _ in batch:
                    self._submit(("abort", request_id))

    def _fail_all(self, error: BaseException) -> None:
        self._deliver([(request_id, error) for request_id in list(self._waiters)])


def _call_if_alive(ref: weakref.ref, method: str, *args) -> None:
    obj = ref()
    if obj is not None:
        getattr(obj, method)(*args)


def _torch_threads() -> int:
    import torch

    return torch.get_num_threads()


def _stop_engine(pending: collections.deque, wakeup: threading.Event, engine: LLMEngine) -> None:
    """Finalizer: stop the step loop (if it still runs) and the engine, holding no AsyncLLM."""
    pending.append(("stop", None))
    wakeup.set()
    engine.shutdown()


def _put_all(batch: list[tuple[str, RequestOutputCollector, RequestOutput | BaseException]]) -> None:
    """On the readers' event loop: one step's outputs into their collectors."""
    for _, collector, item in batch:
        collector.put(item)
