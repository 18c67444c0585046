"""A tensor-parallel worker process (ranks 1..N-1): `python -m engine.executor.tp_worker <pipe fd>`.

Started by `MultiprocExecutor` as a fresh interpreter, not with multiprocessing's
spawn: spawn re-imports the user's `__main__`, so a script without an
`if __name__ == "__main__":` guard would start engines recursively. Here nothing
of the caller's is imported, so no guard is needed.

Protocol on the pipe (a multiprocessing Connection, pickled tuples):

    engine -> worker   (rank, config, model_config, model_path, eos_token_ids)   config resolved by the engine
    worker -> engine   ("joining", None)          about to join the process group
    worker -> engine   ("ready", num_kv_blocks)   model loaded, KV cache allocated
    engine -> worker   ("execute", ModelInput)*   one per step; the worker runs the forward
    engine -> worker   ("shutdown", None)

Any exception is printed to stderr (the engine keeps its last lines) and exits 1.
EOF on the pipe or the engine process going away ends the worker quietly.
"""
from __future__ import annotations

import os
import sys
import threading
import time
import traceback
from multiprocessing.connection import Connection

JOINING, READY, EXECUTE, SHUTDOWN = "joining", "ready", "execute", "shutdown"


def _exit_with_parent(poll_s: float = 1.0) -> None:
    """Exit when the engine process is gone, even while blocked in a collective or a long load
    (a SIGKILLed engine cannot tell its workers)."""
    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(poll_s)
        os._exit(1)

    threading.Thread(target=watch, name="tp-worker-parent-watch", daemon=True).start()


def serve(conn: Connection) -> None:
    from engine.executor.parallel_state import destroy_tp_group, init_group
    from engine.worker.model_runner import ModelRunner

    rank, config, model_config, model_path, eos_token_ids = conn.recv()
    conn.send((JOINING, None))
    init_group(rank, config)
    try:
        runner = ModelRunner(config, model_config, model_path, eos_token_ids)
        conn.send((READY, runner.num_kv_blocks))
        while True:
            op, arg = conn.recv()
            if op == SHUTDOWN:
                return
            runner.run_model(arg)
    finally:
        destroy_tp_group()


def main() -> int:
    _exit_with_parent()
    conn = Connection(int(sys.argv[1]))
    try:
        serve(conn)
    except (EOFError, BrokenPipeError, KeyboardInterrupt):
        return 0  # the engine went away: nothing left to serve
    except BaseException:  # noqa: BLE001 - the engine reads the traceback from our stderr
        traceback.print_exc()
        sys.stderr.flush()
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
