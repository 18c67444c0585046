"""An engine replica that Serve stops: its requests finish within the grace period, or end with an error.

Serve stops a replica (`serve.delete`, `serve.shutdown`, a scale-down, a restart) by draining
it: it polls every `graceful_shutdown_wait_loop_s` until no request is in flight, then calls
the replica's `__del__`; `graceful_shutdown_timeout_s` after the stop began, the controller
kills the actor, whatever is still running. A generation that does not end by itself was
cut there: its HTTP stream closed with no error event and no `[DONE]`. Serve tells user code
nothing when the drain begins, so the engine replica watches for it (`serve_stop_probe`), lets
its requests run while there is grace to spare, then aborts what is left: each stream gets the
engine's final "abort" output, which the Ingress sends as an error event and `[DONE]` (a
non-streaming request: a 503), Serve's drain then sees nothing in flight, and `__del__` stops
the engine before the kill.

    stop begins          abort_after_s                        graceful_shutdown_timeout_s
    |-- requests may finish --|-- aborts reach clients; drain sees 0; __del__ --|-- kill
                              <-- graceful_shutdown_wait_loop_s + SHUTDOWN_RESERVE_S -->
"""
from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from typing import Awaitable, Callable

logger = logging.getLogger(f"ray.serve.{__name__}")  # under Serve's logger: in the replica logs

# What the stop needs after the aborts, besides Serve's drain poll: the error items' way to the
# client, the quiesce of the replica's servers, and the engine's own shutdown in __del__.
SHUTDOWN_RESERVE_S = 3.0
POLL_S = 0.25  # how soon a stop is noticed; a bool read each time


@dataclass(frozen=True)
class DrainPolicy:
    """How long a stopping replica lets its requests run before it aborts them."""

    graceful_shutdown_timeout_s: float  # Serve kills the replica this long after the stop began
    graceful_shutdown_wait_loop_s: float  # Serve's drain polls for "nothing in flight" this often

    @property
    def abort_after_s(self) -> float:
        return max(0.0, self.graceful_shutdown_timeout_s - self.graceful_shutdown_wait_loop_s - SHUTDOWN_RESERVE_S)

    @classmethod
    def of_replica(cls, default_timeout_s: float) -> "DrainPolicy":
        """The deployment's own values (a Serve config file may set them), else Serve's defaults."""
        try:
            from ray import serve

            cfg = serve.get_replica_context()._deployment_config
            return cls(cfg.graceful_shutdown_timeout_s, cfg.graceful_shutdown_wait_loop_s)
        except Exception:  # noqa: BLE001 - outside a Serve replica (tests): Serve's default wait loop
            return cls(default_timeout_s, 2.0)


def serve_stop_probe() -> Callable[[], bool] | None:
    """A function telling whether Serve has begun stopping this replica; None outside a Serve replica.

    Serve has no public hook for the start of a drain: this reads the flag its replica sets
    then (`Replica._shutting_down`, Ray 2.5x-2.6x), through the actor instance Ray's worker
    holds. A Ray without it gives None, and the replica falls back to Serve's own behaviour
    (requests running at the kill are cut); tests/test_serve_shutdown.py notices.
    """
    try:
        from ray._private.worker import global_worker

        replica = global_worker.actors[global_worker.actor_id]._replica_impl
    except Exception:  # noqa: BLE001 - not in a Serve replica, or another Ray layout
        return None
    if not isinstance(getattr(replica, "_shutting_down", None), bool):
        return None
    return lambda: replica._shutting_down


async def abort_when_stopping(is_stopping: Callable[[], bool], policy: DrainPolicy,
                              num_in_flight: Callable[[], int], abort_all: Callable[[], Awaitable[None]]) -> None:
    """Wait for the stop; let the requests run for policy.abort_after_s; then abort whatever is in
    flight (abort_all also refuses what arrives later). A replica whose requests all finish
    sooner is gone sooner: Serve's drain ends, and this task with the replica."""
    while not is_stopping():
        await asyncio.sleep(POLL_S)
    logger.info("replica stopping: %d requests in flight get %.1fs to finish", num_in_flight(),
                policy.abort_after_s)
    await asyncio.sleep(policy.abort_after_s)
    logger.info("replica stopping: aborting %d requests still in flight", num_in_flight())
    await abort_all()


def flush_serve_logs() -> None:
    """Write out the replica's buffered log records: in the high-throughput mode Serve buffers
    1000 of them (RAY_SERVE_REQUEST_PATH_LOG_BUFFER_SIZE) and kills the replica after __del__,
    so the last lines (the access log's, the stop's own) would be lost with the buffer."""
    for handler in logging.getLogger("ray.serve").handlers:
        handler.flush()
