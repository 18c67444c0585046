"""Run records shared by every benchmark: where and when, the JSON file, the last table. No torch."""
from __future__ import annotations

import datetime
import json
import os
import platform
import subprocess
import time
from pathlib import Path


class Stopwatch:
    """Wall time and this process's CPU time (all its threads) of a `with` block.

    On a shared machine the CPU time shows how much of it a run really got:
    cpu_s / (wall_s * threads) well below 1 means others were using the cores.
    """

    def __enter__(self) -> "Stopwatch":
        self._wall, self._cpu = time.perf_counter(), time.process_time()
        return self

    def __exit__(self, *exc) -> None:
        self.wall_s = time.perf_counter() - self._wall
        self.cpu_s = time.process_time() - self._cpu


def git_commit(repo: Path | None = None) -> str:
    """HEAD's hash with a `-dirty` mark when the tree has changes; 'unknown' without git."""
    cwd = repo or Path(__file__).resolve().parent.parent
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=cwd, capture_output=True,
                              text=True, timeout=10)
        if head.returncode != 0:
            return "unknown"
        dirty = subprocess.run(["git", "status", "--porcelain"], cwd=cwd, capture_output=True,
                               text=True, timeout=10).stdout.strip()
        return head.stdout.strip() + ("-dirty" if dirty else "")
    except (OSError, subprocess.TimeoutExpired):
        return "unknown"


def base_metadata(argv: list[str]) -> dict:
    """Date, commit, command and host: docs/benchmarks.md wants all four with every figure.
    The load average says how busy the host was (taken at the end of a run)."""
    return {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "git_commit": git_commit(), "command": " ".join(argv),
            "machine": {"platform": platform.platform(), "processor": platform.processor() or platform.machine(),
                        "cpu_count": os.cpu_count(), "python": platform.python_version(),
                        "load_average": [round(x, 2) for x in os.getloadavg()]}}


def write_json(path: str | os.PathLike, payload: dict) -> Path:
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(payload, indent=2, sort_keys=False) + "\n")
    return out


def format_table(header: list[str], rows: list[list]) -> str:
    """A plain fixed-width table: floats below 100 to 3 significant figures, larger ones whole."""
    def cell(v) -> str:
        if isinstance(v, float):
            return f"{v:,.3g}" if abs(v) < 100 else f"{v:,.0f}"
        return str(v)

    cells = [header] + [[cell(v) for v in row] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    # Numbers right-aligned among themselves, words left-aligned: a long word in a
    # column does not push its numbers to the far right.
    num_widths = [max((len(cell(row[i])) for row in rows if _is_number(row[i])), default=0)
                  for i in range(len(header))]

    def line(row_cells, row_values) -> str:
        parts = []
        for i, (c, w) in enumerate(zip(row_cells, widths)):
            c = c.rjust(num_widths[i]) if row_values is not None and _is_number(row_values[i]) else c
            parts.append(c.ljust(w))
        return "  ".join(parts).rstrip()

    lines = [line(header, None), "  ".join("-" * w for w in widths)]
    lines += [line(c, v) for c, v in zip(cells[1:], rows)]
    return "\n".join(lines)


def _is_number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)
