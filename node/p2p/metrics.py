"""Counters and gauges in Prometheus' text format, without a dependency.

Names follow ``node_<service>_<what>_<unit>``; a counter may carry one label (``reason=…``), which is how
every rejection at the peer boundary is counted.
"""

from __future__ import annotations

import threading
from collections import defaultdict


class Metrics:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counters: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))
        self._gauges: dict[str, float] = {}
        self._help: dict[str, str] = {}

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

    def counter(self, name: str, label: str = "") -> float:
        with self._lock:
            return self._counters.get(name, {}).get(label, 0.0)

    def by_label(self, name: str) -> dict[str, float]:
        with self._lock:
            return dict(self._counters.get(name, {}))

    def render(self) -> str:
        """The Prometheus text exposition of every metric."""
        lines: list[str] = []
        with self._lock:
            for name, series in sorted(self._counters.items()):
                if name in self._help:
                    lines.append(f"# HELP {name} {self._help[name]}")
                lines.append(f"# TYPE {name} counter")
                for label, value in sorted(series.items()):
                    tag = f'{{reason="{label}"}}' if label else ""
                    lines.append(f"{name}{tag} {value:g}")
            for name, value in sorted(self._gauges.items()):
                if name in self._help:
                    lines.append(f"# HELP {name} {self._help[name]}")
                lines.append(f"# TYPE {name} gauge")
                lines.append(f"{name} {value:g}")
        return "\n".join(lines) + "\n"
