"""The engine's step loop in a process of its own, for `AsyncLLM(engine_process=True)`.

    AsyncLLM (caller's process)                        engine core process
    generate() -- ("add", (id, prompt, params)) --> reader thread: make_request -> pending
    abort()    -- ("abort", id) ------------------> pending
               <-- ("out", outputs, stats, iteration stats) -- step loop, one message per step
    reader thread: outputs -> the collectors (one wake-up per event loop, as in-process)

Why a process: in-process, the step thread shares its interpreter's GIL with the caller's
event loop and every other Python thread there (in a Serve replica: Ray's gRPC serialization,
the replica's request machinery, metrics). Each torch op releases the GIL and takes it back,
so whenever the loop holds it the step thread (and its OpenMP team) waits: on the 2-core CPU
box a served engine got ~1.35 cores with 13% of the box idle, its step thread waiting for the
GIL ~15% of the time (py-spy, docs/benchmarks.md). A process has its own GIL; the price is one
pickled message per step each way. The step loop pickles its own, so a step's message holds only
what changed: a request's prompt (text and token ids) crosses once, with its first output, and
the parent puts it back into each later one (`PromptCache`). Sent with every delta, 256 requests'
512-token prompts made a step's message 426 kB instead of 40 kB (5.6 ms to pickle, 11.8 ms to
unpickle on the CPU box), and an H100 decode step is ~15 ms.

The child runs `EngineCoreProc`; the parent holds an `EngineCoreClient`. Requests are
tokenized and validated in the child (it owns the tokenizer); an invalid one gets its error
back as its only output. The child exits when told to stop or when its input pipe closes
(the parent died), so it never outlives its owner for long.
"""
from __future__ import annotations

import collections
import logging
import multiprocessing
import os
import threading
import time
from dataclasses import dataclass
from typing import Callable

from engine.config import EngineConfig, ModelConfig
from engine.errors import EngineDeadError
from engine.outputs import RequestOutput

logger = logging.getLogger(__name__)

START_TIMEOUT_S = 600.0  # model load included


@dataclass
class CoreInfo:
    """What the parent needs of the engine it does not hold."""
    engine_config: EngineConfig
    model_config: ModelConfig
    pid: int
    worker_pids: list[int]


class EngineCoreClient:
    """The parent's side: spawns the core, sends it requests, hands its outputs to `on_outputs`.

    on_outputs(pairs, stats, iteration_stats) and on_dead(error) are called from the reader
    thread. Thread-safe `send`.
    """

    def __init__(self, config: EngineConfig, num_threads: int,
                 on_outputs: Callable[[list, dict, list], None], on_dead: Callable[[BaseException], None]):
        ctx = multiprocessing.get_context("spawn")  # no fork after torch's threads exist
        self._in_recv, self._in_send = ctx.Pipe(duplex=False)     # parent -> child
        self._out_recv, self._out_send = ctx.Pipe(duplex=False)   # child -> parent
        self._send_lock = threading.Lock()
        self._stopping = False
        # Not a daemon: a daemonic process may not start the TP workers.
        self.proc = ctx.Process(target=run_engine_core, name="engine-core", daemon=False,
                                args=(config, num_threads, self._in_recv, self._out_send))
        self.proc.start()
        self._in_recv.close()   # the child's ends: closed here, so EOF means the other side is gone
        self._out_send.close()
        self.info = self._wait_ready()
        self._on_outputs, self._on_dead = on_outputs, on_dead
        self._prompts = PromptCache()  # the reader thread's alone
        self._reader = threading.Thread(target=self._read, name="engine-core-reader", daemon=True)
        self._reader.start()

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

    def send(self, item: tuple) -> None:
        with self._send_lock:
            self._in_send.send(item)

    def is_alive(self) -> bool:
        return self.proc.is_alive()

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

    def close(self, timeout: float = 10.0) -> None:
        """Stop the child (it shuts its engine and TP workers down); kill it if it does not exit."""
        self._stopping = True
        try:
            self.send(("stop", None))
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


class PromptCache:
    """Each request's prompt crosses the pipe once: `strip` (the child) clears it from every output
    after the request's first, `restore` (the parent) puts it back. Both forget a request at its
    finished output, the last one it has."""

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


def apply_pending(engine, pending: collections.deque, deliver: Callable[[list], None]) -> bool:
    """Apply the ops callers queued for the step loop, between steps: ("add", RequestState),
    ("abort", request_id), ("stop", None), ("raise", error). Refusals and abort outputs go to
    `deliver` as (request_id, item) pairs. False if a stop was among them. Both step loops use
    it: AsyncLLM's thread and the engine process's."""
    running = True
    while pending:
        op, arg = pending.popleft()
        if op == "add":
            try:
                engine.add_request_state(arg)
            except ValueError as e:
                deliver([(arg.request_id, e)])
        elif op == "abort":
            out = engine.abort_request(arg)
            if out is not None:
                deliver([(arg, out)])
        elif op == "stop":
            running = False
        elif op == "raise":
            raise arg
    return running


# -- the child ---------------------------------------------------------------------------
def run_engine_core(config: EngineConfig, num_threads: int, in_conn, out_conn) -> None:
    """The engine core process's main: build the engine, then step until told to stop."""
    import torch

    torch.set_num_threads(num_threads)
    try:
        from engine.core.llm_engine import LLMEngine

        engine = LLMEngine(config)
    except BaseException as e:  # noqa: BLE001 - the parent raises it as its constructor's error
        out_conn.send(("failed", _picklable(e)))
        return
    core = EngineCoreProc(engine, out_conn)
    out_conn.send(("ready", CoreInfo(engine.config, engine.model_config, os.getpid(),
                                     list(getattr(engine.executor, "worker_pids", [])))))
    threading.Thread(target=core.read_requests, args=(in_conn,), name="engine-core-input", daemon=True).start()
    try:
        while core.run_once():
            pass
    finally:
        engine.shutdown()
        out_conn.close()


class EngineCoreProc:
    """The step loop of the child: the same drain + step as AsyncLLM's thread, emitting to a pipe."""

    def __init__(self, engine, out_conn):
        self.engine = engine
        self.out_conn = out_conn
        self.send_lock = threading.Lock()  # the step loop, the input thread and the TP watcher send
        self.pending: collections.deque = collections.deque()
        self.prompts = PromptCache()  # the step thread's alone
        self.wakeup = threading.Event()
        self.dead = False
        engine.stats_log.enabled = True
        engine.executor.set_failure_callback(self.die)

    def read_requests(self, in_conn) -> None:
        """Input thread: validate requests off the step loop; EOF (the parent is gone) stops the loop."""
        while True:
            try:
                op, arg = in_conn.recv()
            except (EOFError, OSError):
                op, arg = "stop", None
            if op == "add":
                request_id, prompt, params = arg
                try:
                    arg = self.engine.make_request(request_id, prompt, params)
                except Exception as e:  # noqa: BLE001 - the request's own error, its only output
                    # No stats with it: the engine's are the step thread's to read.
                    self._send(("out", [(request_id, _picklable(e))], None, []))
                    continue
            self.pending.append((op, arg))
            self.wakeup.set()
            if op == "stop":
                return

    def run_once(self) -> bool:
        try:
            if not apply_pending(self.engine, self.pending, self.emit) or self.dead:
                return False
            if not self.engine.has_unfinished_requests():
                self.emit([])  # fresh stats while idle
                self.wakeup.wait(timeout=1.0)
                self.wakeup.clear()
                return True
            outputs = self.engine.step()
            self.emit([(out.request_id, out) for out in outputs])
            return True
        except BaseException as e:  # noqa: BLE001 - the parent fails every waiter
            logger.exception("engine step loop died")
            self.die(e)
            return False

    def emit(self, pairs: list) -> None:
        taken = self.engine.stats_log.take()
        stats = {**self.engine.get_stats(), "step_thread_cpu_s": time.thread_time()}
        self._send(("out", self.prompts.strip(pairs), stats, [] if taken.is_empty else [taken]))

    def die(self, error: BaseException) -> None:
        if not self.dead:
            self.dead = True
            self._send(("dead", _picklable(error)))
            self.wakeup.set()

    def _send(self, message: tuple) -> None:
        with self.send_lock:
            try:
                self.out_conn.send(message)
            except (OSError, ValueError):  # the parent is gone: the input thread sees EOF and stops us
                pass


def _picklable(e: BaseException) -> BaseException:
    """The exception itself if it crosses a pipe, else a RuntimeError that says what it was."""
    import pickle

    try:
        pickle.loads(pickle.dumps(e))
        return e
    except Exception:  # noqa: BLE001
        return RuntimeError(f"{type(e).__name__}: {e}")

