"""A one-line progress bar for a checkpoint being received (fetch.ShardFetcher), on a terminal only."""

from __future__ import annotations

import sys
import time


class Progress:
    """A one-line progress bar on a terminal; silent otherwise."""

    def __init__(self, version: int, total: int) -> None:
        self.version, self.total, self.done = version, total, 0
        self.started = time.monotonic()
        self.enabled = sys.stderr.isatty()

    def add(self, n: int) -> None:
        self.done += n
        if self.enabled:
            frac = self.done / max(1, self.total)
            rate = self.done / max(1e-6, time.monotonic() - self.started) / 1e6
            bar = "#" * int(frac * 30)
            sys.stderr.write(
                f"\rweights v{self.version} [{bar:<30}] {frac:5.1%} "
                f"{self.done / 1e6:.1f}/{self.total / 1e6:.1f} MB {rate:.1f} MB/s"
            )
            if self.done >= self.total:
                sys.stderr.write("\n")
            sys.stderr.flush()
