"""CPU seconds per process of a local Ray Serve app, read from /proc (Linux). No torch, no Ray.

Ray names its worker processes by what they run (`ray::ServeReplica:llm:Ingress`,
`ray::ProxyActor`, ...), so a snapshot taken before and after a load phase says how many
CPU seconds each hop of the serving path spent on it.
"""
from __future__ import annotations

import os
import threading
from pathlib import Path

# (label, substring of the command line), first match wins; order matters (replicas before the rest).
ROLES = (
    ("proxy", "ray::ProxyActor"),
    ("haproxy", "haproxy"),  # RAY_SERVE_ENABLE_HA_PROXY: HAProxy in front of direct-ingress replicas
    ("ingress", ":Ingress"),
    ("guardrails", ":Guardrails"),
    ("engine_replica", ":EngineDeployment"),
    ("serve_controller", "ray::ServeController"),
    ("ray_agent", "ray::DashboardAgent"),  # Ray's per-node agent (metrics export), there without a dashboard too
    ("haproxy_manager", "ray::HAProxyManager"),
    ("raylet", "raylet"),
    ("gcs_server", "gcs_server"),
)


def role_of(cmdline: str) -> str | None:
    """The hop a process plays in the serving path, from its command line; None if not ours."""
    for label, needle in ROLES:
        if needle in cmdline:
            return label
    return None


def _cpu_seconds(pid: int) -> float | None:
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None  # gone, or not Linux
    # After "(comm)": field 3 is the state, so utime and stime (fields 14, 15) are at 11, 12.
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _child_role(pid: int) -> str | None:
    """A process an engine replica spawned (AsyncLLM's engine process, a spawn-started python
    whose command line names nothing of ours) is the replica's "engine_core"; so is one that an
    Ingress spawned (colocate_ingress: the Ingress runs the engine)."""
    ppid = parent_pid(pid)
    return "engine_core" if ppid is not None and role_of(cmdline(ppid)) in ("engine_replica", "ingress") else None


def parent_pid(pid: int) -> int | None:
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
    except (OSError, IndexError, ValueError):
        return None  # gone, or not Linux


def cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def snapshot(client_pid: int | None = None) -> dict[str, float]:
    """CPU seconds used so far, summed per role; `client_pid` (the load generator) as "client"."""
    totals: dict[str, float] = {}
    for pid in pids():
        role = "client" if pid == client_pid else role_of(cmdline(pid)) or _child_role(pid)
        cpu = _cpu_seconds(pid) if role else None
        if cpu is not None:
            totals[role] = totals.get(role, 0.0) + cpu
    return totals


def difference(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    """CPU seconds spent between two snapshots, per role (a role that vanished counts 0)."""
    return {role: max(after[role] - before.get(role, 0.0), 0.0) for role in after}


def per_process() -> dict[int, float]:
    """CPU seconds used so far by every process on the box, by pid."""
    out = {}
    for pid in pids():
        cpu = _cpu_seconds(pid)
        if cpu is not None:
            out[pid] = cpu
    return out


def pids():
    """The pids of the box's processes (none where there is no /proc)."""
    for entry in Path("/proc").iterdir() if Path("/proc").is_dir() else ():
        if entry.name.isdigit():
            yield int(entry.name)


class ProcessSampler:
    """CPU seconds per process over a `with` block, processes that start or end inside it
    included: /proc is read every `interval` s on a thread, so one that ends inside the block
    loses at most its last interval. `used` maps pid -> (CPU seconds in the block, the last
    command line seen: Ray renames a worker by what it runs)."""

    def __init__(self, interval: float = 2.0):
        self.interval = interval
        self.used: dict[int, tuple[float, str]] = {}
        self._before: dict[int, float] = {}
        self._last: dict[int, float] = {}
        self._names: dict[int, str] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name="process-sampler")

    def __enter__(self) -> "ProcessSampler":
        self._sample()
        self._before = dict(self._last)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self._sample()
        self.used = {pid: (cpu - self._before.get(pid, 0.0), self._names.get(pid, ""))
                     for pid, cpu in self._last.items()}

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            self._sample()

    def _sample(self) -> None:
        for pid, cpu in per_process().items():
            if cpu != self._last.get(pid):  # it ran: read its name again (a fork exec'd, a Ray worker renamed)
                name = cmdline(pid)
                if name:  # empty once it has exited (a zombie's, or gone): keep the last one seen
                    self._names[pid] = name
            self._last[pid] = cpu
