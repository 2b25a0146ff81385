"""What the broadcast simulator runs: a population of volunteers, the scenario a run simulates, and its bound.

A scale scenario draws its volunteers (residential or datacenter, a share behind NAT), the ones that leave and
the ones that join from ``--seed`` and the swarm's size, so a run is the same on every machine. A netns scenario
is the network-namespace benchmark (benchmarks/broadcast.py) in the model: identical 25 Mbit/s links.
"""

from __future__ import annotations

import argparse
import math
import random
from dataclasses import dataclass

MBIT = 1e6 / 8


@dataclass
class Peer:
    up: float
    down: float
    reachable: bool
    latency: float


@dataclass
class Scenario:
    size: float
    shard: float
    stripes: int
    slots: int | None
    """Fixed slots for every node (the old design); None: fan-out from upload (stripes.fanout)."""
    origin: Peer
    peers: list[Peer]
    joiners: list[Peer]
    leave: list[int]
    """Indexes into ``peers`` of the nodes that vanish during the broadcast."""
    window: float
    """Churn happens at uniform times in [0, window]."""
    lag: float
    dht_lag: float
    tick: float
    formation: float = 90.0
    seed: int = 0
    preempt: bool = True
    spare_min: int = 10**9
    publish_at: float = 0.0
    """When the version is out (t=0 is when the clock starts): the netns benchmark's clock runs while the origin
    writes it (broadcast.py's "origin write s")."""
    unfair: float = 0.0
    """TCP's uneven sharing of a link: the spread of each connection's weight (net.tcp_weights)."""
    paced: float = 0.0
    """What is left of it at an upload that paces its connections (pacing.FairShare; net.Net)."""
    exact: bool = True
    """False: bytes move at ticks only (net.Clock), and the home-stripe plan is computed once a simulated
    second at most (swarm.Swarm.moves_s), for thousands of nodes."""


def population(n: int, rng: random.Random, dc_share: float, nat: float) -> list[Peer]:
    out = []
    for _ in range(n):
        if rng.random() < dc_share:
            out.append(
                Peer(rng.uniform(500, 1000) * MBIT, rng.uniform(1000, 10000) * MBIT, True, rng.uniform(0.002, 0.010))
            )
        else:
            up = math.exp(rng.uniform(math.log(10), math.log(300)))
            nat_here = nat / max(1e-9, 1 - dc_share)  # NAT nodes are residential
            out.append(
                Peer(
                    up * MBIT, min(1000, max(100, 10 * up)) * MBIT, rng.random() >= nat_here, rng.uniform(0.005, 0.040)
                )
            )
    return out


def bound(size: float, origin: Peer, stayers: list[Peer]) -> float:
    n = len(stayers)
    return max(
        size / origin.up,
        n * size / (origin.up + sum(p.up for p in stayers)),
        size / min((p.down for p in stayers), default=math.inf),
    )


def scale_scenario(args: argparse.Namespace, n: int, churn: float) -> Scenario:
    rng = random.Random(args.seed * 1000 + n)
    peers = population(n, rng, args.dc_share, args.nat)
    joiners = population(round(churn * n), rng, args.dc_share, args.nat)
    leave = rng.sample(range(n), round(churn * n))
    size = args.size_gb * 1e9
    origin = Peer(args.origin_gbit * 1000 * MBIT, args.origin_gbit * 1000 * MBIT, True, 0.002)
    b = bound(size, origin, [p for i, p in enumerate(peers) if i not in set(leave)])
    return Scenario(
        size=size,
        shard=args.shard_mib * 2**20,
        stripes=args.stripes,
        slots=None,
        origin=origin,
        peers=peers,
        joiners=joiners,
        leave=leave,
        window=0.8 * b,
        lag=args.hop_lag_s,
        dht_lag=args.dht_lag,
        tick=args.tick or min(1.0, max(0.005, b / 3000)),
        formation=max(60.0, n / 50),
        seed=args.seed,
        preempt=not args.no_preempt,
        spare_min=args.spare_min_fanout,
        exact=not args.coarse,
        unfair=args.tcp_spread,
        paced=args.paced_spread,
    )


WIRE_PAYLOAD = 1448 / 1514
"""Payload bytes per byte on the netns benchmark's wire: tbf counts whole Ethernet frames (1,514 bytes at MTU 1500,
GSO segments counted one by one), of which TCP with timestamps carries 1,448. Its 25 Mbit/s links move 23.9 Mbit/s
of shards (the benchmark's bound, 21.47 s for 64 MiB, is in payload: the wire alone takes 22.45 s)."""


def netns_scenario(args: argparse.Namespace, n: int) -> Scenario:
    link = Peer(25 * MBIT * args.netns_payload, 1e12, True, 0.00005)
    size = 64 * 2**20
    return Scenario(
        size=size,
        shard=2**20,
        stripes=args.netns_stripes,
        slots=args.netns_slots or None,
        origin=link,
        peers=[link] * n,
        joiners=[],
        leave=[],
        window=0.0,
        lag=args.hop_lag_s,
        dht_lag=1.0,
        tick=0.005,
        formation=90.0,
        seed=args.seed,
        preempt=not args.no_preempt,
        spare_min=args.spare_min_fanout,
        publish_at=args.netns_write_s,
        unfair=args.tcp_spread,
        paced=args.paced_spread,
    )
