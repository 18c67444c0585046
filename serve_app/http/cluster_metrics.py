"""`GET /metrics`: the whole application's series, read from Ray's metrics export of every node.

Each Ray node runs a metrics agent that serves, on its `MetricsExportPort`, every
`ray.util.metrics` series recorded by the processes of that node (Prometheus text). Reading
those endpoints, rather than gathering from replicas, is what makes one scrape complete:

- it covers every replica of every deployment, on every node, including replicas this Ingress
  never talked to and ones Serve is starting or stopping; a Serve handle reaches one replica
  per call, so "ask each replica" cannot be done without reaching into Serve's actor names;
- the numbers are exactly the ones a Prometheus scraping the Ray cluster records (same names,
  same labels), so a dashboard reads either source alike;
- a busy engine replica is not asked anything (its step loop is never interrupted for a scrape).

The price is freshness: Ray's agent publishes what replicas recorded every
`metrics_report_interval_ms` (Ray's default 10 s; `serve_app.local` uses 0.5 s), so a value
appears up to that long after the fact. Engine replicas record every 0.5 s on top of that.
"""
from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

import httpx
from prometheus_client.parser import text_string_to_metric_families

_NODES_TTL_S = 10.0  # how long the list of alive nodes is reused (ray.nodes() asks the GCS)
_DROPPED_LABELS = ("otel_scope_name", "otel_scope_schema_url", "otel_scope_version")


@dataclass
class _Family:
    name: str
    type: str
    documentation: str
    lines: list[str]


def merge_exports(texts: list[str], prefixes: tuple[str, ...]) -> str:
    """Prometheus text of the families whose names start with one of `prefixes`, merged over `texts`.

    Each node's export holds its own processes' series, so merging is a union: one HELP/TYPE per
    family, every sample kept (Ray's labels, WorkerId and the Serve replica, keep them apart).
    """
    families: dict[str, _Family] = {}
    for text in texts:
        for fam in text_string_to_metric_families(_lines_of(text, prefixes)):
            merged = families.setdefault(fam.name, _Family(fam.name, fam.type, fam.documentation, []))
            merged.lines.extend(_sample_line(s.name, s.labels, s.value) for s in fam.samples)
    out = []
    for fam in families.values():
        name = fam.name + "_total" if fam.type == "counter" else fam.name
        out.append(f"# HELP {name} {_escape_help(fam.documentation)}")
        out.append(f"# TYPE {name} {fam.type}")
        out.extend(fam.lines)
    return "\n".join(out) + "\n" if out else ""


def _lines_of(text: str, prefixes: tuple[str, ...]) -> str:
    """The lines of `text` that belong to families named with one of `prefixes`, kept before
    parsing: Ray's export holds every Ray series (tasks, gRPC, Ray Data), several times what an
    app exports, and the Prometheus parser's cost is per line. A family's samples (`_bucket`,
    `_total`, ...) start with its name, so a line's own name decides."""
    kept = []
    for line in text.splitlines():
        if line.startswith("#"):
            parts = line.split(None, 3)
            name = parts[2] if len(parts) > 2 and parts[1] in ("HELP", "TYPE") else ""
        else:
            name = line.partition("{")[0].partition(" ")[0]
        if name.startswith(prefixes):
            kept.append(line)
    return "\n".join(kept) + "\n"


def _sample_line(name: str, labels: dict[str, str], value: float) -> str:
    kept = {k: v for k, v in labels.items() if k not in _DROPPED_LABELS}
    if not kept:
        return f"{name} {value!r}"
    body = ",".join(f'{k}="{_escape_label(v)}"' for k, v in sorted(kept.items()))
    return f"{name}{{{body}}} {value!r}"


def _escape_label(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _escape_help(text: str) -> str:
    return text.replace("\\", "\\\\").replace("\n", "\\n")


class ClusterMetrics:
    """Reads the metrics export of every alive Ray node; one instance per Ingress replica."""

    def __init__(self, prefixes: tuple[str, ...], timeout_s: float = 3.0):
        self.prefixes = prefixes
        self.timeout_s = timeout_s
        self._nodes: list[str] = []
        self._nodes_time = -_NODES_TTL_S

    async def scrape(self) -> str:
        urls = await self._export_urls()
        async with httpx.AsyncClient(timeout=self.timeout_s, trust_env=False) as client:
            answers = await asyncio.gather(*(client.get(u) for u in urls), return_exceptions=True)
        texts, missing = [], []
        for url, answer in zip(urls, answers):
            if isinstance(answer, httpx.Response) and answer.status_code == 200:
                texts.append(answer.text)
            else:  # a node going away: the rest of the picture is still worth serving
                missing.append(url)
        # Off the event loop: parsing a big cluster's export takes long enough to hold up streams.
        body = await asyncio.to_thread(merge_exports, texts, self.prefixes)
        return "".join(f"# node export unreachable: {u}\n" for u in missing) + body

    async def _export_urls(self) -> list[str]:
        if time.monotonic() - self._nodes_time > _NODES_TTL_S:
            import ray

            nodes = await asyncio.to_thread(ray.nodes)
            self._nodes = [f"http://{_host(n['NodeManagerAddress'])}:{n['MetricsExportPort']}/metrics"
                           for n in nodes if n.get("Alive") and n.get("MetricsExportPort")]
            self._nodes_time = time.monotonic()
        return self._nodes


def _host(address: str) -> str:
    return f"[{address}]" if ":" in address else address  # an IPv6 node address goes in brackets
