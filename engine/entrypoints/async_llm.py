"""`AsyncLLM`: the engine behind asyncio, for serving.

    callers (event loop)                         EngineCoreClient (entrypoints/core_client.py)
    generate() -- make_request, add_request ---> EngineCore's step loop: a thread here, or
    abort()    -- abort -----------------------> an engine process of its own
               <-- RequestOutputCollector <----- _on_outputs: one call per step, every request

Per step, the event loop is woken once for all requests, not once per request, and a
reader that is behind gets its deltas merged (engine/entrypoints/output_collector.py). A caller may
also ask for fewer, larger outputs (`stream_interval_s`): the end, and everything up to
the first output with text, still come at once.

Where the step loop runs is chosen once, by the client `make_client` builds; nothing here
asks which. An exception in the loop (or a TP worker's exit) reaches every waiting request
through `_die`, and the engine is then dead (check_health raises).
"""
from __future__ import annotations

import asyncio
import collections
import uuid
import weakref
from typing import Any, AsyncIterator, Callable

from engine.config import EngineConfig
from engine.core.engine_core import EngineCore, OutputPair
from engine.core.llm_engine import LLMEngine, PromptType
from engine.core.stats import IterationStats
from engine.entrypoints.core_client import make_client
from engine.entrypoints.output_collector import RequestOutputCollector
from engine.errors import EngineDeadError
from engine.lora.request import LoRARequest
from engine.outputs import RequestOutput
from engine.sampling_params import RequestOutputKind, SamplingParams


class AsyncLLM:
    """Lifecycle: `shutdown()`, `with AsyncLLM(...)` / `async with`, or best effort when collected
    (the step loop and the client's threads hold only weak references). A TP worker that dies fails
    every waiter with EngineDeadError at once, from the executor's watcher thread, and check_health raises."""

    def __init__(self, config: EngineConfig | None = None, *, engine_process: bool = False,
                 engine_core_class: type[EngineCore] = EngineCore, **kwargs: Any):
        """engine_process: run the step loop in a process of its own (entrypoints/core_client.py), out of
        this interpreter's GIL; `engine` is then None. Default: a thread of this process.
        engine_core_class: the step loop to run (a subclass must be importable in an engine process)."""
        config = config or EngineConfig(**kwargs)
        self._waiters: dict[str, tuple[asyncio.AbstractEventLoop, RequestOutputCollector]] = {}
        self._stop = False
        self._error: BaseException | None = None
        self._stats: dict[str, float] = {}  # the step loop's latest snapshot, replaced whole
        # Per-step observations (engine/core/stats.py), handed from the step loop to whoever exports
        # metrics (pop_iteration_stats); bounded, so nobody draining costs a fixed amount of memory.
        self._iteration_stats: collections.deque[IterationStats] = collections.deque(maxlen=4096)
        ref = weakref.ref(self)
        self._client = make_client(config, engine_process,
                                   on_outputs=lambda *a: _call_if_alive(ref, "_on_outputs", *a),
                                   on_dead=lambda e: _call_if_alive(ref, "_die", e),
                                   engine_core_class=engine_core_class)
        self._finalizer = weakref.finalize(self, self._client.close)

    def __enter__(self) -> "AsyncLLM":
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()

    async def __aenter__(self) -> "AsyncLLM":
        return self

    async def __aexit__(self, *exc) -> None:
        await asyncio.to_thread(self.shutdown)

    @property
    def engine(self) -> LLMEngine | None:
        """The engine, if it runs in this process (None with engine_process=True)."""
        return self._client.engine

    @property
    def tokenizer(self):
        return self._client.tokenizer  # AttributeError with engine_process=True: the engine process holds it

    @property
    def model_config(self):
        return self._client.info.model_config

    @property
    def engine_config(self) -> EngineConfig:
        return self._client.info.engine_config

    @property
    def worker_pids(self) -> list[int]:
        """The TP worker processes' pids (none for a single-process engine)."""
        return list(self._client.info.worker_pids)

    @property
    def engine_pid(self) -> int:
        """The pid of the process that runs the step loop."""
        return self._client.info.pid

    @property
    def is_running(self) -> bool:
        return self._client.is_alive() and self._error is None and not self._stop

    # -- public API -------------------------------------------------------------
    async def generate(self, prompt: PromptType, sampling_params: SamplingParams | None = None,
                       request_id: str | None = None, *,
                       stream_interval_s: float | Callable[[], float] = 0.0,
                       lora_request: LoRARequest | None = None, priority: int = 0) -> AsyncIterator[RequestOutput]:
        """Outputs of one request as the engine makes them (by `sampling_params.output_kind`).

        stream_interval_s > 0: after each output, wait that long (or until the request ends)
        before taking the next, so DELTA outputs carry several steps' tokens. Serving uses it
        to pay per chunk, not per token, on every hop downstream; 0 takes every step's output.
        A callable is asked before each wait (serving stretches the interval with its load).
        Nothing is held until an output has carried text: a first token that is only part of
        a character (byte-level BPE splits most CJK characters and emoji), or text held back
        as a possible stop string, must not push the first visible text an interval later.
        lora_request: the adapter this request runs with (docs/lora.md); None: the base model.
        priority: lower runs first, under scheduling_policy="priority" (docs/fleet.md); else 0.
        """
        interval = stream_interval_s if callable(stream_interval_s) else (lambda: stream_interval_s)
        if (first := interval()) < 0:
            raise ValueError(f"stream_interval_s={first} must be >= 0")
        self._raise_if_dead()
        request_id = request_id or uuid.uuid4().hex
        params = sampling_params or SamplingParams()
        # In-process: tokenized and validated now (ValueError raised here); with an engine process,
        # there, and an invalid request's error is its only output.
        request = await self._client.make_request(request_id, prompt, params, lora_request, priority)
        if request_id in self._waiters:
            raise ValueError(f"request_id {request_id!r} is already in use")
        collector = RequestOutputCollector(aggregate=params.output_kind is RequestOutputKind.DELTA)
        self._waiters[request_id] = (asyncio.get_running_loop(), collector)
        # The loop may have died (or been shut down) between the check above and the registration:
        # _die and shutdown set _error/_stop *before* they fail the waiters they can see, so checking
        # again after registering means this request is either failed by them or raised here.
        if self._error is not None or self._stop:
            self._waiters.pop(request_id, None)
            self._raise_if_dead()
        self._add_request(request_id, request)
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
                self._client.abort(request_id)

    async def abort(self, request_id: str) -> None:
        self._client.abort(request_id)

    def get_stats(self) -> dict[str, float]:
        return dict(self._stats)  # a snapshot taken by the step loop; never races the engine

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
            self._client.abort(request_id)
        self._stop = True  # before the waiters are failed: see generate()'s registration
        self._client.close(timeout)  # the aborts above go first: the loop applies them, then stops
        self._fail_all(EngineDeadError("the engine has been shut down"))

    # -- internals -------------------------------------------------------------------------
    def _raise_if_dead(self) -> None:
        if self._error is not None:
            raise EngineDeadError(f"the engine loop died: {self._error!r}") from self._error
        if self._stop or not self._client.is_alive():
            raise EngineDeadError("the engine has been shut down")

    def _add_request(self, request_id: str, request) -> None:
        try:
            self._client.add_request(request)
        except EngineDeadError:  # the engine process is gone
            self._waiters.pop(request_id, None)
            self._raise_if_dead()
            raise

    # -- called from the step loop (or the engine process's reader thread) ----------------------
    def _on_outputs(self, pairs: list[OutputPair], stats: dict | None, iteration_stats: list) -> None:
        self._iteration_stats.extend(iteration_stats)
        if stats is not None:  # None: a refusal sent by the engine process's input thread
            self._stats = stats  # before delivery: a reader never sees stale stats
        if pairs:
            self._deliver(pairs)

    def _die(self, error: BaseException) -> None:
        """The engine cannot go on (the step loop raised, or a TP worker exited): fail every waiter."""
        if self._error is None:
            self._error = error
        self._fail_all(EngineDeadError(f"the engine loop died: {self._error!r}"))

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
                    self._client.abort(request_id)

    def _fail_all(self, error: BaseException) -> None:
        self._deliver([(request_id, error) for request_id in list(self._waiters)])


def _call_if_alive(ref: weakref.ref, method: str, *args) -> None:
    obj = ref()
    if obj is not None:
        getattr(obj, method)(*args)


def _put_all(batch: list[tuple[str, RequestOutputCollector, RequestOutput | BaseException]]) -> None:
    """On the readers' event loop: one step's outputs into their collectors."""
    for _, collector, item in batch:
        collector.put(item)
