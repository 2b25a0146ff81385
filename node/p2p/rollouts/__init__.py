"""Rollout transports by name: how batches go from producers to the trainer (the seam: node/p2p/rollouts/base.py).

A transport is a sink class (the producer's end) and a source class (the trainer's end), each built from an
``Endpoint``; ``TRANSPORTS`` names them. Adding one is a module beside ``libp2p.py`` and one line here. Both ends
of a run must speak the same one.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from intellect_node.p2p.rollouts.base import Acknowledged, Endpoint, Receiver, RolloutSink, RolloutSource
from intellect_node.p2p.rollouts.libp2p import Libp2pSink, Libp2pSource

__all__ = [
    "DEFAULT",
    "TRANSPORTS",
    "Acknowledged",
    "Endpoint",
    "Receiver",
    "RolloutSink",
    "RolloutSource",
    "Transport",
    "make_sink",
    "make_source",
]


@dataclass(frozen=True)
class Transport:
    sink: Callable[[Endpoint], RolloutSink]
    source: Callable[[Endpoint], RolloutSource]


TRANSPORTS: dict[str, Transport] = {
    "libp2p": Transport(Libp2pSink, Libp2pSource),
}
DEFAULT = "libp2p"


def _transport(name: str) -> Transport:
    transport = TRANSPORTS.get(name)
    if transport is None:
        raise ValueError(f"rollout transport {name!r} is not one this node knows ({', '.join(sorted(TRANSPORTS))})")
    return transport


def make_sink(endpoint: Endpoint, name: str = DEFAULT) -> RolloutSink:
    """The producer's end of transport ``name``."""
    return _transport(name).sink(endpoint)


def make_source(endpoint: Endpoint, name: str = DEFAULT) -> RolloutSource:
    """The trainer's end of transport ``name``."""
    return _transport(name).source(endpoint)
