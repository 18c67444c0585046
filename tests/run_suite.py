"""`make test`: the suite as two pytest processes side by side, the Ray tests and the rest.

The Ray tests (marked `ray` by tests/conftest.py) spend much of their time waiting on Ray and
Serve (replicas starting, metrics published, controllers reconciling), so the rest runs beside
them, at the lowest CPU priority and on one torch thread, in the time the Ray tests leave idle. One process each rather
than pytest-xdist workers: xdist's groups (`--dist loadgroup`) do not reach the node ids under
pytest 9, so its workers split the Ray tests between them and ran two clusters at once.

Each process runs with -X faulthandler (a crash, even at exit, prints every thread's stack)
and --durations. The Ray tests' output streams; the rest's is printed when both are done. The
exit status is the first non-zero of the two (one side selecting nothing is not a failure). Extra arguments go to both pytest commands.

    python tests/run_suite.py [pytest args]
"""
from __future__ import annotations

import os
import subprocess
import sys
import tempfile

PYTEST = [sys.executable, "-X", "faulthandler", "-m", "pytest", "-q"]
# The rest's torch threads (tests/conftest.py reads it): the Ray tests' processes keep a core.
THREADS_ENV = "RAYLLM_TEST_TORCH_THREADS"
NO_TESTS = 5  # pytest's exit status when nothing was selected


def _lowest_priority() -> None:
    """The rest runs at the lowest priority, and the clusters the Ray tests start run their workers
    (the replicas, where the Ray tests' engines compute) at nice 0 (RAY_worker_niceness), not Ray's
    default 15: beside a rest at nice 0 the replicas got a fraction of a core and the Ray tests took
    longer than the whole suite in one process. Where the kernel groups processes by session
    (sched_autogroup), nice orders processes only within a group, so the rest also gets a session
    of its own whose group is niced: it yields to every other group, wherever Ray's processes are."""
    os.setsid()
    try:
        with open("/proc/self/autogroup", "w") as f:
            f.write("19")
    except OSError:  # no autogroup on this kernel: nice is all there is
        pass
    os.nice(19)


def main(args: list[str]) -> int:
    with tempfile.TemporaryFile("w+") as rest_log:
        rest = subprocess.Popen([*PYTEST, "-m", "not ray", "--durations=10", *args], preexec_fn=_lowest_priority,
                                stdout=rest_log, stderr=subprocess.STDOUT, env={**os.environ, THREADS_ENV: "1"})
        try:
            ray_status = subprocess.call([*PYTEST, "-m", "ray", "--durations=25", *args],
                                         env={**os.environ, "RAY_worker_niceness": "0"})
            rest_status = rest.wait()
        finally:
            if rest.poll() is None:
                rest.kill()
        rest_log.seek(0)
        print("\n==================== the tests outside Ray (run beside the Ray tests above) ====================")
        sys.stdout.write(rest_log.read())
    print(f"\nmake test: Ray tests exit {ray_status}, the rest exit {rest_status}")
    if {ray_status, rest_status} == {NO_TESTS, 0}:  # arguments that select tests of one kind only
        return 0
    return ray_status or rest_status


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
