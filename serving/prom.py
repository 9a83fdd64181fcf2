"""A minimal Prometheus text-exposition registry (counters, gauges, histograms with labels).

The router's ``/metrics`` is written with it; no ``prometheus_client`` dependency (SGLang brings one,
the router must run without). Label values are escaped as the exposition format requires. Not thread
safe: every update happens on the router's event loop.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Callable, Sequence

LabelValues = tuple[str, ...]

LATENCY_BUCKETS_S: tuple[float, ...] = (
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
)  # fmt: skip
"""Histogram bucket bounds for latencies (TTFT, ITL), seconds."""


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _labels(names: Sequence[str], values: LabelValues, extra: str = "") -> str:
    parts = [f'{n}="{_escape(v)}"' for n, v in zip(names, values, strict=True)]
    if extra:
        parts.append(extra)
    return "{" + ",".join(parts) + "}" if parts else ""


def _num(value: float) -> str:
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    return repr(float(value)) if not float(value).is_integer() else str(int(value))


class _Metric:
    kind = "untyped"

    def __init__(self, name: str, doc: str, labels: Sequence[str] = ()) -> None:
        self.name, self.doc, self.label_names = name, doc, tuple(labels)

    def _key(self, labels: Sequence[str | int]) -> LabelValues:
        if len(labels) != len(self.label_names):
            raise ValueError(f"{self.name}: expected labels {self.label_names}, got {tuple(labels)}")
        return tuple(str(v) for v in labels)

    def header(self) -> list[str]:
        return [f"# HELP {self.name} {self.doc}", f"# TYPE {self.name} {self.kind}"]

    def lines(self) -> list[str]:
        raise NotImplementedError


class Counter(_Metric):
    kind = "counter"

    def __init__(self, name: str, doc: str, labels: Sequence[str] = ()) -> None:
        super().__init__(name, doc, labels)
        self.values: dict[LabelValues, float] = {}

    def inc(self, *labels: str | int, amount: float = 1.0) -> None:
        key = self._key(labels)
        self.values[key] = self.values.get(key, 0.0) + amount

    def get(self, *labels: str | int) -> float:
        return self.values.get(self._key(labels), 0.0)

    def lines(self) -> list[str]:
        return [
            f"{self.name}{_labels(self.label_names, k)} {_num(v)}" for k, v in sorted(self.values.items())
        ]


class Gauge(Counter):
    """A value set now (``set``), or read from ``source`` at every exposition."""

    kind = "gauge"

    def __init__(
        self,
        name: str,
        doc: str,
        labels: Sequence[str] = (),
        source: Callable[[], dict[LabelValues, float]] | None = None,
    ) -> None:
        super().__init__(name, doc, labels)
        self.source = source

    def set(self, value: float, *labels: str | int) -> None:
        self.values[self._key(labels)] = float(value)

    def lines(self) -> list[str]:
        if self.source is not None:
            self.values = dict(self.source())
        return super().lines()


class Histogram(_Metric):
    kind = "histogram"

    def __init__(
        self, name: str, doc: str, labels: Sequence[str] = (), buckets: Sequence[float] = LATENCY_BUCKETS_S
    ) -> None:
        super().__init__(name, doc, labels)
        self.bounds = tuple(sorted(buckets))
        self.counts: dict[LabelValues, list[int]] = {}
        self.sums: dict[LabelValues, float] = {}

    def observe(self, value: float, *labels: str | int) -> None:
        key = self._key(labels)
        counts = self.counts.setdefault(key, [0] * (len(self.bounds) + 1))
        counts[bisect.bisect_left(self.bounds, value)] += 1
        self.sums[key] = self.sums.get(key, 0.0) + value

    def count(self, *labels: str | int) -> int:
        return sum(self.counts.get(self._key(labels), ()))

    def lines(self) -> list[str]:
        out: list[str] = []
        for key, counts in sorted(self.counts.items()):
            running = 0
            for bound, n in zip((*self.bounds, math.inf), counts, strict=True):
                running += n
                le = 'le="' + _num(bound) + '"'
                out.append(f"{self.name}_bucket{_labels(self.label_names, key, le)} {running}")
            out.append(f"{self.name}_sum{_labels(self.label_names, key)} {_num(self.sums[key])}")
            out.append(f"{self.name}_count{_labels(self.label_names, key)} {running}")
        return out


class Registry:
    """Metrics in registration order; ``exposition()`` is the ``/metrics`` body."""

    def __init__(self) -> None:
        self.metrics: list[_Metric] = []

    def add(self, metric: _Metric) -> _Metric:
        self.metrics.append(metric)
        return metric

    def counter(self, name: str, doc: str, labels: Sequence[str] = ()) -> Counter:
        return self.add(Counter(name, doc, labels))  # type: ignore[return-value]

    def gauge(
        self,
        name: str,
        doc: str,
        labels: Sequence[str] = (),
        source: Callable[[], dict[LabelValues, float]] | None = None,
    ) -> Gauge:
        return self.add(Gauge(name, doc, labels, source))  # type: ignore[return-value]

    def histogram(self, name: str, doc: str, labels: Sequence[str] = ()) -> Histogram:
        return self.add(Histogram(name, doc, labels))  # type: ignore[return-value]

    def exposition(self) -> str:
        lines: list[str] = []
        for m in self.metrics:
            lines += m.header() + m.lines()
        return "\n".join(lines) + "\n"


__all__ = ["LATENCY_BUCKETS_S", "Counter", "Gauge", "Histogram", "Registry"]
