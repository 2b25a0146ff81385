"""A node's metrics, exposed through ``prometheus_client`` (the standard exposition, with real histograms).

Names follow ``node_<service>_<what>_<unit>``; a counter may carry one label, ``reason=…`` (how every rejection at
the peer boundary is counted) unless ``LABEL_NAMES`` names it otherwise (a DHT key, a gossip topic, an outcome).
Counters and gauges are kept here (so that code reads them back: ``counter``, ``by_label``) and handed to
prometheus_client by a collector at each scrape; histograms are prometheus_client's own. Each ``Metrics`` has a
registry of its own: several nodes may share a process (tests).

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


LABEL_NAMES = {
    "node_dht_stores_total": "key",
    "node_dht_gets_total": "key",
    "node_gossip_published_total": "topic",
    "node_gossip_published_bytes_total": "topic",
    "node_gossip_received_total": "topic",
    "node_gossip_received_bytes_total": "topic",
    "node_gossip_resubscribes_total": "topic",
    "node_gossip_publish_failures_total": "topic",
    "node_errors_total": "where",
    "node_trainer_persist_failures_total": "stage",
    "node_validator_fetches_total": "source",
    "node_dialbacks_total": "outcome",
    "node_trainer_pulls_total": "outcome",
    "node_trainer_redeems_total": "outcome",
    "node_batches_served_total": "outcome",
    "node_validator_announcements_total": "outcome",
    "node_validator_batches_total": "outcome",
    "node_audit_downloads_total": "outcome",
    "node_audits_total": "outcome",
}
"""The label of the counters whose label is not a reason for a refusal or a failure."""


HELP = {
    "node_trainer_pulls_total": "announced batches fetched from their producer, or not (busy), by outcome",
    "node_dht_publish_failures_total": "stores of this node's DHT record that failed (tried again)",
    "node_dht_read_failures_total": "DHT reads that failed or timed out (the last records read are used meanwhile)",
    "node_dht_records_rejected_total": "DHT records refused when read (bad signature, wrong run, malformed)",
    "node_errors_total": "unexpected errors caught in a loop that goes on (each logged with its traceback)",
    "node_gossip_publish_failures_total": "gossip messages this node could not publish (its daemon restarting)",
    "node_gossip_published_bytes_total": "bytes of the gossip messages published",
    "node_gossip_received_bytes_total": "bytes of the gossip messages handled",
    "node_gossip_resubscribes_total": "times a gossip subscription ended and was made again",
    "node_inference_batches_deferred_total": "batches the trainer deferred without deciding (sent again later)",
    "node_inference_batches_refused_total": "batches the trainer refused, by its reason",
    "node_inference_batches_sent_total": "batches delivered to the trainer and answered",
    "node_inference_submit_failures_total": "deliveries of a batch that failed (the trainer unreachable; sent again)",
    "node_inference_weight_version": "the weight version this node generates with",
    "node_relay_bytes_received_total": "weight shard bytes received from parents and other sources",
    "node_relay_reparents_total": "times this node changed its parent in a stripe",
    "node_relay_requests_refused_total": "relay requests (slots, shards) refused, by reason",
    "node_relay_shards_served_total": "weight shards sent whole to other nodes",
    "node_trainer_batches_pending_validation": "batches waiting to be judged",
    "node_trainer_checkpoint_seconds_total": "seconds spent writing checkpoints",
    "node_trainer_checkpoint_step": "the step of the newest checkpoint on disk",
    "node_trainer_groups_dropped_banned_total": "rollout groups dropped because their producer was banned",
    "node_trainer_groups_stale_dropped_total": "rollout groups dropped for a policy too many steps old",
    "node_trainer_persist_failures_total": "checkpoint, spool or publish writes that failed (tried again)",
    "node_trainer_reward_mean": "mean reward of the rollouts in the last step",
    "node_trainer_staleness_mean": "steps from a trained rollout's policy to its step (last step's mean)",
    "node_trainer_step": "training steps taken in this run",
    "node_trainer_steps_total": "training steps taken by this process",
    "node_trainer_weight_version": "the newest weight version published",
    "node_validator_batches_total": "batches judged, by verdict",
    "node_validator_fetch_failures_total": "batch bodies a validator could not fetch, by why",
    "node_validator_requests_refused_total": "requests to this validator refused, by reason",
    "node_validator_seconds_total": "seconds spent judging batches",
    "node_weights_fetch_failures_total": "weight versions that could not be fetched or stored, by why",
    "node_weights_versions_held": "complete weight versions on this node's disk",
    "node_weights_versions_received_total": "weight versions received and verified",
}
"""What a metric counts, for those whose code gives no ``help`` where it counts (tests/p2p/test_status.py checks
that every metric the code names has one)."""


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
                    name, help or HELP.get(name, name), buckets=tuple(buckets), registry=self.registry
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
            label_name = LABEL_NAMES.get(name, "reason")
            what = helps.get(name) or HELP.get(name, name)
            family = CounterMetricFamily(name, what, labels=[label_name] if labelled else None)
            for label, value in sorted(series.items()):
                family.add_metric([label] if labelled else [], value)
            yield family
        for name, value in sorted(gauges.items()):
            yield GaugeMetricFamily(name, helps.get(name) or HELP.get(name, name), value=value)

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
