"""`AsyncLLM`: the engine behind asyncio, for serving.

    callers (event loop)                     step thread
    generate() -- make_request (validate) -> _pending ----> engine.add_request_state
               <- per-request asyncio.Queue <-- call_soon_threadsafe(outputs)
    abort()    ----------------------------> _pending ----> engine.abort_request

The step loop runs in a thread: torch releases the GIL in the forward, so the
event loop stays responsive. Engine state is touched only by that thread; the
callers talk to it through `_pending`. An exception in the loop reaches every
waiting request, and the engine is then dead (check_health raises).
"""
from __future__ import annotations

import asyncio
import collections
import logging
import threading
import uuid
from typing import Any, AsyncIterator

from engine.config import EngineConfig
from engine.llm_engine import LLMEngine, PromptType
from engine.outputs import RequestOutput
from engine.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


class EngineDeadError(RuntimeError):
    """The step loop has stopped; no request can be served by this engine any more."""


class AsyncLLM:
    def __init__(self, config: EngineConfig | None = None, **kwargs: Any):
        config = config or EngineConfig(**kwargs)
        self.engine = LLMEngine(config)
        self._pending: collections.deque = collections.deque()  # ("add", state) | ("abort", request_id)
        self._waiters: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._wakeup = threading.Event()
        self._stop = False
        self._error: BaseException | None = None
        self._stats = self.engine.get_stats()
        self._thread = threading.Thread(target=self._run, name="engine-step-loop", daemon=True)
        self._thread.start()

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    @property
    def model_config(self):
        return self.engine.model_config

    @property
    def engine_config(self) -> EngineConfig:
        return self.engine.config

    @property
    def is_running(self) -> bool:
        return self._thread.is_alive() and self._error is None and not self._stop

    # -- public API -------------------------------------------------------------
    async def generate(self, prompt: PromptType, sampling_params: SamplingParams | None = None,
                       request_id: str | None = None) -> AsyncIterator[RequestOutput]:
        self._raise_if_dead()
        request_id = request_id or uuid.uuid4().hex
        params = sampling_params or SamplingParams()
        if params.structured_outputs is not None:  # grammar compilation may take a while: not on the loop
            state = await asyncio.to_thread(self.engine.make_request, request_id, prompt, params)
        else:
            state = self.engine.make_request(request_id, prompt, params)
        if request_id in self._waiters:
            raise ValueError(f"request_id {request_id!r} is already in use")
        queue: asyncio.Queue = asyncio.Queue()
        self._waiters[request_id] = (asyncio.get_running_loop(), queue)
        # The loop may have died (or stopped) between the check above and the registration:
        # it sets _error/_stop *before* it fails the waiters it can see, so checking again
        # after registering means this request is either failed by the loop or raised here.
        if self._error is not None or self._stop:
            self._waiters.pop(request_id, None)
            self._raise_if_dead()
        self._submit(("add", state))
        finished = False
        try:
            while not finished:
                item = await queue.get()
                if isinstance(item, BaseException):
                    raise item
                finished = item.finished
                yield item
        finally:
            self._waiters.pop(request_id, None)
            if not finished:  # cancelled, closed early or failed: free the engine's resources
                self._submit(("abort", request_id))

    async def abort(self, request_id: str) -> None:
        self._submit(("abort", request_id))

    def get_stats(self) -> dict[str, float]:
        return dict(self._stats)  # a snapshot taken by the step thread; never races the engine

    async def check_health(self) -> None:
        self._raise_if_dead()

    def shutdown(self, timeout: float = 10.0) -> None:
        """Abort everything in flight (each waiter gets a final 'abort' output) and stop the loop."""
        for request_id in list(self._waiters):
            self._submit(("abort", request_id))
        self._submit(("stop", None))
        self._thread.join(timeout)
        self.engine.shutdown()

    # -- the step thread ------------------------------------------------------------
    def _submit(self, item) -> None:
        self._pending.append(item)
        self._wakeup.set()

    def _raise_if_dead(self) -> None:
        if self._error is not None:
            raise EngineDeadError(f"the engine loop died: {self._error!r}") from self._error
        if self._stop or not self._thread.is_alive():
            raise EngineDeadError("the engine has been shut down")

    def _run(self) -> None:
        try:
            while not self._stop:
                self._drain_pending()
                if not self.engine.has_unfinished_requests():
                    self._stats = self.engine.get_stats()
                    self._wakeup.wait(timeout=1.0)
                    self._wakeup.clear()
                    continue
                outputs = self.engine.step()
                self._stats = self.engine.get_stats()  # before delivery: a reader never sees stale stats
                self._deliver(outputs)
        except BaseException as e:  # noqa: BLE001 - every waiter must hear about it
            logger.exception("engine step loop died")
            self._error = e
            self._fail_all(EngineDeadError(f"the engine loop died: {e!r}"))
            return
        # Stopped: whoever registered after shutdown's aborts would otherwise wait forever.
        self._fail_all(EngineDeadError("the engine has been shut down"))

    def _drain_pending(self) -> None:
        while self._pending:
            op, arg = self._pending.popleft()
            if op == "add":
                try:
                    self.engine.add_request_state(arg)
                except ValueError as e:
                    self._deliver_one(arg.request_id, e)
            elif op == "abort":
                out = self.engine.abort_request(arg)
                if out is not None:
                    self._deliver_one(arg, out)
            elif op == "stop":
                self._stop = True

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        for out in outputs:
            self._deliver_one(out.request_id, out)

    def _deliver_one(self, request_id: str, item) -> None:
        waiter = self._waiters.get(request_id)
        if waiter is None:
            return
        loop, queue = waiter
        try:
            loop.call_soon_threadsafe(queue.put_nowait, item)
        except RuntimeError:  # the caller's loop is closed: nobody is listening any more
            self._pending.append(("abort", request_id))

    def _fail_all(self, error: BaseException) -> None:
        for request_id in list(self._waiters):
            self._deliver_one(request_id, error)
