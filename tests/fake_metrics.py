"""An in-memory stand-in for Ray's metric classes (serve_app.metrics' factory), for tests without Ray."""
from __future__ import annotations


class RecordingMetric:
    def __init__(self, kind: str, name: str, tag_keys: tuple[str, ...], boundaries):
        self.kind, self.name, self.tag_keys, self.boundaries = kind, name, tag_keys, boundaries
        self.default_tags: dict[str, str] = {}
        self.values: dict[tuple, float] = {}          # counters and gauges, by tag values
        self.observations: dict[tuple, list[float]] = {}  # histograms

    def set_default_tags(self, tags):
        assert set(tags) <= set(self.tag_keys), tags
        self.default_tags = dict(tags)
        return self

    def _key(self, tags) -> tuple:
        merged = {**self.default_tags, **(tags or {})}
        assert set(merged) == set(self.tag_keys), f"{self.name}: tags {merged} != {self.tag_keys}"
        return tuple(sorted(merged.items()))

    def inc(self, value=1.0, tags=None):
        assert self.kind == "counter" and value > 0
        key = self._key(tags)
        self.values[key] = self.values.get(key, 0.0) + value

    def set(self, value, tags=None):
        assert self.kind == "gauge"
        self.values[self._key(tags)] = value

    def observe(self, value, tags=None):
        assert self.kind == "histogram"
        self.observations.setdefault(self._key(tags), []).append(value)


class Recorder:
    """The factory: `Recorder()(kind, name, description, tag_keys, boundaries)`; then read values by name."""

    def __init__(self):
        self.metrics: dict[str, RecordingMetric] = {}

    def __call__(self, kind, name, description, tag_keys, boundaries=None):
        assert description and name not in self.metrics
        self.metrics[name] = RecordingMetric(kind, name, tag_keys, boundaries)
        return self.metrics[name]

    def value(self, name: str, **tags) -> float:
        m = self.metrics[name]
        return sum(v for k, v in m.values.items() if set(tags.items()) <= set(k))

    def observed(self, name: str, **tags) -> list[float]:
        m = self.metrics[name]
        return [x for k, xs in m.observations.items() if set(tags.items()) <= set(k) for x in xs]
