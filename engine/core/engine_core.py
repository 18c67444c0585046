"""`EngineCore`: the one step loop over an `LLMEngine`, wherever it runs.

    callers (any thread)                       the step loop (one thread)
    add_request(state)  --+
    abort_request(id)   --+--> pending ops --> run_once(): apply ops, then step (or wait for work)
    stop()              --+                        |
                                                   +--> on_outputs(pairs, stats, iteration_stats)
    executor watcher --> die(error) ----------------+--> on_dead(error), once

The same loop runs on a thread of the caller's process (entrypoints/core_client.py `InprocClient`)
and in an engine process of its own (`MPClient`); only the two callables differ. Engine state is
touched by the loop's thread alone: callers reach it through the pending deque, which is applied
between steps. A step that raises, or a TP worker that exits, ends the loop and reaches `on_dead`.

The engine process's side of `MPClient` is here too (`run_engine_core`): its main, the input
thread that validates requests off the loop, and the pipe the loop's callables write to.
"""
from __future__ import annotations

import collections
import logging
import os
import threading
import time
import weakref
from dataclasses import dataclass
from typing import Callable

from engine.config import EngineConfig, ModelConfig
from engine.core.llm_engine import LLMEngine
from engine.core.request_state import RequestState
from engine.outputs import RequestOutput

logger = logging.getLogger(__name__)

IDLE_WAIT_S = 1.0  # an idle loop still turns this often, so its stats stay fresh

# (request_id, its output or the error that refused it): what the loop hands to its callers.
OutputPair = tuple[str, RequestOutput | BaseException]
OnOutputs = Callable[[list[OutputPair], dict[str, float], list], None]


@dataclass
class CoreInfo:
    """What a caller needs of the engine, wherever it runs."""
    engine_config: EngineConfig
    model_config: ModelConfig
    pid: int                # the process that runs the step loop
    worker_pids: list[int]  # its TP workers (none for a single-process engine)

    @classmethod
    def of(cls, engine: LLMEngine) -> "CoreInfo":
        return cls(engine.config, engine.model_config, os.getpid(),
                   list(getattr(engine.executor, "worker_pids", [])))


class EngineCore:
    """Drives one LLMEngine; `run_busy_loop()` is the thread's target.

    on_outputs(pairs, stats, iteration_stats) is called by the loop after each step (and while
    idle, with no pairs, to keep stats fresh); on_dead(error) when the loop cannot go on.
    """

    def __init__(self, engine: LLMEngine, on_outputs: OnOutputs, on_dead: Callable[[BaseException], None]):
        self.engine = engine
        self.on_outputs = on_outputs
        self.on_dead = on_dead
        self.pending: collections.deque = collections.deque()  # ("add", state) | ("abort", id) | ("stop", None)
        self.wakeup = threading.Event()  # set with every op, so an idle loop picks it up at once
        self.stopped = False
        self.error: BaseException | None = None
        engine.stats_log.enabled = True  # someone drains them: the client's pop_iteration_stats
        # Weakly: the executor outlives a dropped core in the engine's finalizer, and must not keep it.
        die = weakref.WeakMethod(self.die)
        engine.executor.set_failure_callback(lambda error: _call_weak(die, error))

    # -- callers (any thread) -----------------------------------------------------------
    def add_request(self, state: RequestState) -> None:
        self._submit("add", state)

    def abort_request(self, request_id: str) -> None:
        self._submit("abort", request_id)

    def stop(self) -> None:
        """The loop ends after applying what was queued before this (aborts included)."""
        self._submit("stop", None)

    def die(self, error: BaseException) -> None:
        """The engine cannot go on (a step raised, or a TP worker exited): tell the caller, end the loop."""
        if self.error is None:
            self.error = error
            self.on_dead(error)
            self.wakeup.set()

    def _submit(self, op: str, arg) -> None:
        self.pending.append((op, arg))
        self.wakeup.set()

    # -- the loop's thread -------------------------------------------------------------
    def run_busy_loop(self) -> None:
        while self.run_once():
            pass

    def run_once(self) -> bool:
        """Apply pending ops, then one step (or an idle wait); False once stopped or dead."""
        try:
            pairs = self._apply_pending()
            if pairs:  # abort outputs and refusals now: their readers need no step to finish
                self._emit(pairs)
            if self.stopped or self.error is not None:
                return False
            if self.has_work():
                self._emit(self.step())
            else:
                self._emit([])  # fresh stats while idle
                self.wakeup.wait(timeout=IDLE_WAIT_S)
                self.wakeup.clear()  # an op queued meanwhile is already in `pending`: not lost
            return True
        except BaseException as e:  # noqa: BLE001 - every waiter must hear about it
            logger.exception("engine step loop died")
            self.die(e)
            return False

    def has_work(self) -> bool:
        return self.engine.has_unfinished_requests()

    def step(self) -> list[OutputPair]:
        return [(out.request_id, out) for out in self.engine.step()]

    def _apply_pending(self) -> list[OutputPair]:
        """The callers' ops, in order; returns the abort outputs and refusals they made."""
        pairs: list[OutputPair] = []
        while self.pending:
            op, arg = self.pending.popleft()  # atomic: callers append concurrently
            if op == "add":
                try:
                    self.engine.add_request_state(arg)
                except ValueError as e:  # e.g. an id still in use: the request's only output
                    pairs.append((arg.request_id, e))
            elif op == "abort":
                out = self.engine.abort_request(arg)
                if out is not None:
                    pairs.append((arg, out))
            else:  # "stop": ops queued after it are still applied (their outputs go out)
                self.stopped = True
        return pairs

    def _emit(self, pairs: list[OutputPair]) -> None:
        taken = self.engine.stats_log.take()
        # The loop thread's own CPU time: what the engine costs, apart from its callers' work.
        stats = {**self.engine.get_stats(), "step_thread_cpu_s": time.thread_time()}
        self.on_outputs(pairs, stats, [] if taken.is_empty else [taken])


def _call_weak(method: weakref.WeakMethod, *args) -> None:
    bound = method()
    if bound is not None:
        bound(*args)


class PromptCache:
    """Each request's prompt crosses the pipe once: `strip` (the child) clears it from every output
    after the request's first, `restore` (the parent) puts it back. Both forget a request at its
    finished output, the last one it has. Sent with every delta, the prompts made a step's message
    ~10x larger, slower to pickle than a GPU step takes (docs/benchmarks.md, issue 8's shape)."""

    def __init__(self):
        self._prompts: dict[str, tuple] = {}  # parent: request id -> (prompt, prompt_token_ids)
        self._sent: set[str] = set()          # child: requests whose prompt went out

    def strip(self, pairs: list) -> list:
        for request_id, out in pairs:
            if not isinstance(out, RequestOutput):
                continue
            if request_id in self._sent:
                out.prompt = out.prompt_token_ids = None
            elif not out.finished:
                self._sent.add(request_id)
            if out.finished:
                self._sent.discard(request_id)
        return pairs

    def restore(self, pairs: list) -> list:
        for request_id, out in pairs:
            if not isinstance(out, RequestOutput):
                self._prompts.pop(request_id, None)
                continue
            if out.prompt_token_ids is None:
                out.prompt, out.prompt_token_ids = self._prompts[request_id]
            elif not out.finished:
                self._prompts[request_id] = (out.prompt, out.prompt_token_ids)
            if out.finished:
                self._prompts.pop(request_id, None)
        return pairs

    def __len__(self) -> int:
        return len(self._prompts) + len(self._sent)


# -- the engine process ------------------------------------------------------------------
def run_engine_core(config: EngineConfig, engine_core_class: type[EngineCore], num_threads: int,
                    in_conn, out_conn) -> None:
    """The engine process's main: build the engine, then run the step loop until told to stop."""
    import torch

    torch.set_num_threads(num_threads)
    try:
        engine = LLMEngine(config)
    except BaseException as e:  # noqa: BLE001 - the parent raises it as its constructor's error
        out_conn.send(("failed", _picklable(e)))
        return
    pipe = _OutputPipe(out_conn)
    core = engine_core_class(engine, pipe.send_outputs, pipe.send_dead)
    out_conn.send(("ready", CoreInfo.of(engine)))
    threading.Thread(target=_read_requests, args=(core, in_conn, pipe), name="engine-core-input",
                     daemon=True).start()
    try:
        core.run_busy_loop()
    finally:
        engine.shutdown()
        out_conn.close()


def _read_requests(core: EngineCore, in_conn, pipe: _OutputPipe) -> None:
    """The input thread: validate requests off the step loop; EOF (the parent is gone) stops the loop."""
    while True:
        try:
            op, arg = in_conn.recv()
        except (EOFError, OSError):
            op, arg = "stop", None
        if op == "add":
            request_id, prompt, params, lora_request, priority = arg
            try:
                core.add_request(core.engine.make_request(request_id, prompt, params, lora_request=lora_request,
                                                          priority=priority))
            except Exception as e:  # noqa: BLE001 - the request's own error, its only output
                pipe.send(("out", [(request_id, _picklable(e))], None, []))  # no stats: the loop's to read
        elif op == "abort":
            core.abort_request(arg)
        else:
            core.stop()
            return


class _OutputPipe:
    """The child's end of the outputs pipe, shared by the step loop, the input thread and the TP watcher."""

    def __init__(self, conn):
        self.conn = conn
        self.lock = threading.Lock()
        self.prompts = PromptCache()  # the step loop's alone

    def send_outputs(self, pairs: list, stats: dict, iteration_stats: list) -> None:
        self.send(("out", self.prompts.strip(pairs), stats, iteration_stats))

    def send_dead(self, error: BaseException) -> None:
        self.send(("dead", _picklable(error)))

    def send(self, message: tuple) -> None:
        with self.lock:
            try:
                self.conn.send(message)
            except (OSError, ValueError):  # the parent is gone: the input thread sees EOF and stops the loop
                pass


def _picklable(e: BaseException) -> BaseException:
    """The exception itself if it crosses a pipe, else a RuntimeError that says what it was."""
    import pickle

    try:
        pickle.loads(pickle.dumps(e))
        return e
    except Exception:  # noqa: BLE001
        return RuntimeError(f"{type(e).__name__}: {e}")
