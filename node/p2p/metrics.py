"""A node's metrics, exposed through ``prometheus_client`` (the standard exposition, with real histograms).

Names follow ``node_<service>_<what>_<unit>``; a counter may carry one label (``reason=…``), which is how every
rejection at the peer boundary is counted. Counters and gauges are kept here (so that code reads them back:
``counter``, ``by_label``) and handed to prometheus_client by a collector at each scrape; histograms are
prometheus_client's own. Each ``Metrics`` has a registry of its own: several nodes may share a process (tests).

Histograms: ``node_trainer_step_seconds``, ``node_validation_seconds`` (a batch judged, by the trainer or a
validator node), ``node_weights_fetch_seconds`` (a version received and loaded) and
``node_generation_tokens_per_second`` (an inference batch).
"""

from __future__ import annotations

import threading
from collections import Counter, defaultdict
from collections.abc import Iterator, Sequence

from prometheus_client import CollectorRegistry, Histogram, disable_created_metrics, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

disable_created_metrics()  # no *_created series: a scrape shows what the node counts, nothing else

SECONDS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 25.0, 60.0, 150.0, 300.0)
TOKENS_PER_S = (10.0, 25.0, 50.0, 100.0, 250.0, 500.0, 1000.0, 2500.0, 5000.0, 10000.0, 25000.0)


class Metrics(Collector):
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counters: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))
        self._gauges: dict[str, float] = {}
        self._help: dict[str, str] = {}
        self._histograms: dict[str, Histogram] = {}
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(self)

    def inc(self, name: str, amount: float = 1.0, label: str = "", help: str = "") -> None:
        with self._lock:
            self._counters[name][label] += amount
            if help:
                self._help.setdefault(name, help)

    def set(self, name: str, value: float, help: str = "") -> None:
        with self._lock:
            self._gauges[name] = value
            if help:
                self._help.setdefault(name, help)

    def observe(self, name: str, value: float, help: str = "", buckets: Sequence[float] = SECONDS) -> None:
        """One observation of histogram ``name`` (created at its first observation, with ``buckets``)."""
        with self._lock:
            histogram = self._histograms.get(name)
            if histogram is None:
                histogram = self._histograms[name] = Histogram(
                    name, help or name, buckets=tuple(buckets), registry=self.registry
                )
        histogram.observe(value)

    def counter(self, name: str, label: str = "") -> float:
        with self._lock:
            return self._counters.get(name, {}).get(label, 0.0)

    def by_label(self, name: str) -> dict[str, float]:
        with self._lock:
            return dict(self._counters.get(name, {}))

    def collect(self) -> Iterator[Metric]:
        """prometheus_client's view of the counters and gauges, at scrape time."""
        with self._lock:
            counters = {name: dict(series) for name, series in self._counters.items()}
            gauges = dict(self._gauges)
            helps = dict(self._help)
        for name, series in sorted(counters.items()):
            labelled = any(series)
            family = CounterMetricFamily(name, helps.get(name, name), labels=["reason"] if labelled else None)
            for label, value in sorted(series.items()):
                family.add_metric([label] if labelled else [], value)
            yield family
        for name, value in sorted(gauges.items()):
            yield GaugeMetricFamily(name, helps.get(name, name), value=value)

    def render(self) -> str:
        """The Prometheus text exposition of every metric."""
        return generate_latest(self.registry).decode()


class BoundedCounter(Counter[str]):
    """Counts per node id that peers cannot grow without bound: a count that falls to zero is dropped and, with
    ``limit``, past that many node ids the smallest count is folded into ``others`` (what a status page shows per
    node stays readable, and a flood of new keys costs a bounded dict)."""

    def __init__(self, limit: int | None = None) -> None:
        super().__init__()
        self.limit = limit
        self.others = 0

    def __setitem__(self, key: str, value: int) -> None:
        if value <= 0:
            self.pop(key, None)
            return
        if self.limit is not None and key not in self and len(self) >= self.limit:
            smallest = min(self, key=self.__getitem__)
            self.others += self.pop(smallest)
        super().__setitem__(key, value)
