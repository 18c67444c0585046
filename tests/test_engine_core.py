"""EngineCore, the one step loop, over a stand-in engine: op order, stop, death, stats, wake-ups."""
import gc
import threading
import time
import types
import weakref

from engine.core.engine_core import IDLE_WAIT_S, EngineCore
from engine.core.stats import StatsLog
from engine.outputs import CompletionOutput, RequestOutput


class _Executor:
    def __init__(self):
        self.on_failure = None

    def set_failure_callback(self, callback):
        self.on_failure = callback


class _Engine:
    """What EngineCore uses of an LLMEngine: each step finishes every request with one token."""

    def __init__(self):
        self.stats_log = StatsLog()
        self.executor = _Executor()
        self.requests: dict[str, object] = {}
        self.num_steps = 0

    def add_request_state(self, state):
        if state.request_id in self.requests:
            raise ValueError(f"request_id {state.request_id!r} is already in use")
        self.requests[state.request_id] = state

    def abort_request(self, request_id):
        return _output(request_id, "abort") if self.requests.pop(request_id, None) else None

    def has_unfinished_requests(self):
        return bool(self.requests)

    def step(self):
        self.num_steps += 1
        self.stats_log.on_step(len(self.requests))
        outputs = [_output(request_id, "length") for request_id in self.requests]
        self.requests.clear()
        return outputs

    def get_stats(self):
        return {"num_requests_running": len(self.requests)}


def _output(request_id: str, finish_reason: str) -> RequestOutput:
    return RequestOutput(request_id, "p", [1], [CompletionOutput(0, "t", [2], finish_reason=finish_reason)], True)


def _state(request_id: str):
    return types.SimpleNamespace(request_id=request_id)


def _core():
    engine, emitted, dead = _Engine(), [], []
    core = EngineCore(engine, lambda *args: emitted.append(args), dead.append)
    return engine, core, emitted, dead


def _summary(pairs):
    """(request_id, finish reason or error type) per pair."""
    return [(rid, type(item).__name__ if isinstance(item, BaseException) else item.outputs[0].finish_reason)
            for rid, item in pairs]


def test_ops_apply_in_order_and_their_outputs_come_before_the_step():
    engine, core, emitted, _ = _core()
    core.add_request(_state("a"))
    core.add_request(_state("b"))
    core.abort_request("a")
    core.add_request(_state("b"))  # still in use: refused, the request's only output
    core.abort_request("unknown")  # nothing to abort: no output
    assert core.run_once()
    assert [_summary(pairs) for pairs, _, _ in emitted] == [[("a", "abort"), ("b", "ValueError")],
                                                          [("b", "length")]]
    assert engine.num_steps == 1


def test_stop_applies_what_came_before_it_then_ends_the_loop():
    engine, core, emitted, dead = _core()
    core.add_request(_state("a"))
    core.abort_request("a")
    core.stop()
    assert not core.run_once()
    assert [_summary(pairs) for pairs, _, _ in emitted] == [[("a", "abort")]]
    assert engine.num_steps == 0 and not dead


def test_a_step_that_raises_reaches_on_dead_once_and_ends_the_loop():
    engine, core, emitted, dead = _core()
    error = RuntimeError("step failed")

    def boom():
        raise error
    engine.step = boom
    core.add_request(_state("a"))
    assert not core.run_once()
    core.die(RuntimeError("later"))  # e.g. the TP watcher too: the first error is the one reported
    assert dead == [error] and core.error is error and not emitted


def test_a_tp_worker_death_ends_the_loop_before_its_next_step():
    engine, core, _, dead = _core()
    core.add_request(_state("a"))
    error = RuntimeError("rank 1 exited")
    engine.executor.on_failure(error)  # from the executor's watcher thread, in real use
    assert dead == [error]
    assert not core.run_once() and engine.num_steps == 0


def test_every_emit_carries_stats_and_iteration_stats_once():
    _, core, emitted, _ = _core()
    core.add_request(_state("a"))
    core.add_request(_state("b"))
    assert core.run_once()  # the step
    assert core.run_once()  # idle: stats only (the wakeup is still set, so no wait)
    (step_pairs, step_stats, step_iters), (idle_pairs, idle_stats, idle_iters) = emitted
    assert len(step_pairs) == 2 and step_stats["num_requests_running"] == 0
    assert [it.iteration_tokens for it in step_iters] == [[2]]
    assert idle_pairs == [] and idle_iters == []  # taken once, not sent again
    assert 0 <= step_stats["step_thread_cpu_s"] <= idle_stats["step_thread_cpu_s"]


def test_an_idle_loop_takes_a_request_at_once():
    engine, core, emitted, _ = _core()
    thread = threading.Thread(target=core.run_busy_loop, daemon=True)
    thread.start()
    try:
        time.sleep(0.1)  # idle, waiting for work
        t0 = time.monotonic()
        core.add_request(_state("a"))
        while not any(pairs for pairs, _, _ in emitted):
            assert time.monotonic() - t0 < IDLE_WAIT_S / 2, "the loop slept through the request"
            time.sleep(0.005)
    finally:
        core.stop()
        thread.join(5)
    assert not thread.is_alive() and engine.num_steps == 1


def test_the_executor_holds_the_core_weakly():
    engine, core, _, dead = _core()
    ref = weakref.ref(core)
    del core
    gc.collect()
    assert ref() is None
    engine.executor.on_failure(RuntimeError("late"))  # nobody left to tell: a no-op
    assert not dead
