"""The broadcast simulator's two systems on a scenario: ours (the relay tree of swarm.py and fetch.py) and
shardcast (origin, fixed relays, clients that poll), each on its own network (net.py) and clock."""

from __future__ import annotations

import math
import random
import sys
import time
from dataclasses import dataclass

from .fetch import ORIGIN
from .net import Clock, Net
from .scenario import MBIT, Peer, Scenario, bound
from .swarm import Swarm


@dataclass
class Result:
    seconds: float
    bound: float
    joiner_s: float
    stayers: int
    complete: bool
    max_depth: int
    stats: dict[str, float]
    wall: float
    swarm: Swarm | None = None
    """The simulated nodes at the end (ours only), for tests."""


def _need(sc: Scenario, stripes: int) -> list[float]:
    shards = math.ceil(sc.size / sc.shard)
    sizes = [sc.shard] * (shards - 1) + [sc.size - sc.shard * (shards - 1)]
    return [sum(sizes[i] for i in range(s, shards, stripes)) for s in range(stripes)]


def run_ours(sc: Scenario, verbose: bool = False) -> Result:
    started = time.monotonic()
    rng = random.Random(sc.seed)
    total = 1 + len(sc.peers) + len(sc.joiners)
    net = Net(
        total, _need(sc, sc.stripes), sc.shard, sc.lag, unfair=sc.unfair, seed=sc.seed, paced=min(sc.unfair, sc.paced)
    )
    clock = Clock(net, sc.tick, start=-sc.formation - 30.0, exact=sc.exact)
    swarm = Swarm(
        net,
        clock,
        sc.stripes,
        sc.dht_lag,
        rng,
        fixed_slots=sc.slots,
        preempt=sc.preempt,
        spare_min=sc.spare_min,
        moves_s=0.0 if sc.exact else 1.0,
    )
    o = swarm.add(sc.origin.up, sc.origin.down, True, sc.origin.latency)
    clock.at(clock.now, swarm.join, o)
    nodes = [swarm.add(p.up, p.down, p.reachable, p.latency) for p in sc.peers]
    for n in nodes:  # the tree forms on an earlier version: joins over the formation time, then 30 s to settle
        clock.at(-sc.formation - 30.0 + rng.random() * sc.formation, swarm.join, n)
    leaving = {nodes[i].idx for i in sc.leave}
    for i in leaving:
        clock.at(rng.random() * sc.window, swarm.depart, swarm.nodes[i])
    joined: dict[int, float] = {}
    for p in sc.joiners:
        n = swarm.add(p.up, p.down, p.reachable, p.latency)
        joined[n.idx] = rng.random() * sc.window
        clock.at(joined[n.idx], swarm.join, n)
    required = {n.idx for n in nodes if n.idx not in leaving} | set(joined)
    left = [len(required)]

    def done(i: int, s: int) -> None:
        was = swarm.nodes[i].done
        swarm.fetch.stripe_done(i, s)
        if i in required and was != was and swarm.nodes[i].done == swarm.nodes[i].done:
            left[0] -= 1

    def publish() -> None:
        swarm.version_out = True
        net.got[ORIGIN, :] = net.need
        o.done = 0.0
        for c, _s in list(o.children):
            clock.at(2 * swarm.rtt(o, swarm.nodes[c]), swarm.fetch.begin, swarm.nodes[c])
        for n in swarm.nodes[1:]:  # no parent to tell it: the trainer's record, read a DHT lag later
            clock.at(sc.dht_lag + rng.random() * 2.0, swarm.fetch.begin, n)

    clock.at(sc.publish_at, publish)

    def progress() -> None:  # a long run says how far it got (a run stopped early still tells something)
        print(
            f"    t={clock.now:.0f}s left={left[0]} events={clock.events} wall={time.monotonic() - started:.0f}s",
            file=sys.stderr,
            flush=True,
        )
        clock.at(clock.now + 300.0, progress)

    if verbose:
        clock.at(clock.now, progress)
    b = bound(sc.size, sc.origin, [sc.peers[i] for i in range(len(sc.peers)) if nodes[i].idx not in leaving])
    clock.run(
        until=50 * b + 3600,
        on_cross=swarm.fetch.crossed,
        on_done=done,
        stop=lambda: left[0] == 0,
        flows_from=0.0,
        on_side=swarm.fetch.side_done,
    )
    stay = [swarm.nodes[i] for i in required if i not in joined]
    finished = [n.done for n in stay]
    depth = max((swarm.depth(n, n.home) for n in swarm.nodes[1:] if n.alive and n.reachable), default=0)
    last = max(stay, key=lambda n: n.done, default=None)
    if last is not None and verbose:
        stripes = " ".join(f"s{s}:{net.done_at[last.idx, s]:.0f}s<-{last.parent[s]}" for s in range(sc.stripes))
        worst = max(range(sc.stripes), key=lambda s: net.done_at[last.idx, s])
        chain = [
            f"{a}:{swarm.nodes[a].up / MBIT:.0f}Mb/{len(swarm.active(swarm.nodes[a]))}of{swarm.nodes[a].slots}"
            for a in swarm.path(last, worst)[1:]
        ]
        late = sum(n.done > 1.3 * b for n in stay)
        print(
            f"    last: node {last.idx} up {last.up / MBIT:.0f} down {last.down / MBIT:.0f} Mbit/s home {last.home} "
            f"nat {not last.reachable}: {stripes}; its stripe {worst} from (node:upload/children of slots) "
            f"{' <- '.join(chain)}; {late} nodes past 1.3x bound; stripe homes (nodes/slots) "
            f"{_homes(swarm, sc.stripes)}"
        )
    stats = {k: float(v) for k, v in vars(swarm.stats).items()}
    stats.update(ticks=clock.ticks, events=clock.events)
    return Result(
        seconds=max(finished, default=math.nan),
        bound=b,
        joiner_s=max((swarm.nodes[i].done - t for i, t in joined.items()), default=0.0),
        stayers=len(stay),
        complete=left[0] == 0,
        max_depth=depth,
        stats=stats,
        wall=time.monotonic() - started,
        swarm=swarm,
    )


def _homes(swarm: Swarm, k: int) -> str:
    """Per stripe: reachable nodes at home there, and their slots."""
    out = []
    for s in range(k):
        home = [n for n in swarm.nodes[1:] if n.alive and n.reachable and n.home == s]
        out.append(f"{len(home)}/{sum(n.slots for n in home)}")
    return " ".join(out)


def run_shardcast(sc: Scenario, relays: int, relay_bps: float, poll_s: float = 30.0) -> Result:
    """Origin -> ``relays`` fixed relays -> clients (round robin), whole shards, polls every ``poll_s``."""
    started = time.monotonic()
    rng = random.Random(sc.seed + 1)
    everyone = [sc.origin, *[Peer(relay_bps, relay_bps, True, 0.005)] * relays, *sc.peers, *sc.joiners]
    net = Net(len(everyone), [sc.size], sc.shard, 0.0, store_forward=True, unfair=sc.unfair, seed=sc.seed)
    clock = Clock(net, sc.tick, exact=sc.exact)
    for i, p in enumerate(everyone):
        net.up[i], net.down[i] = p.up, p.down
    first, joiners = 1 + relays, 1 + relays + len(sc.peers)
    net.alive[:joiners] = True
    net.got[0, 0] = sc.size
    relay_start = [rng.random() * poll_s for _ in range(relays)]
    for r in range(relays):
        net.src[1 + r, 0], net.ready[1 + r, 0], net.want[1 + r, 0] = 0, relay_start[r], True
    for j, i in enumerate(range(first, len(everyone))):
        r = j % relays
        net.src[i, 0], net.want[i, 0] = 1 + r, True
        net.ready[i, 0] = relay_start[r] + rng.random() * poll_s  # its first poll after the relay has it
    leaving = {first + i for i in sc.leave}
    for i in leaving:
        clock.at(rng.random() * sc.window, net.alive.__setitem__, i, False)
    joined = {}
    for i in range(joiners, len(everyone)):
        joined[i] = rng.random() * sc.window
        net.ready[i, 0] = max(net.ready[i, 0], joined[i])
        clock.at(joined[i], net.alive.__setitem__, i, True)
    required = set(range(first, len(everyone))) - leaving
    left = [len(required)]

    def done(i: int, s: int) -> None:
        left[0] -= i in required

    least = (len(sc.peers) + len(sc.joiners)) * sc.size / (relays * relay_bps)  # the relays carry every byte
    clock.run(
        until=4 * least + 50 * sc.size / relay_bps + 2 * sc.window + 3600,
        on_cross=lambda i, s: None,
        on_done=done,
        stop=lambda: left[0] == 0,
    )
    stay = [i for i in required if i not in joined]
    return Result(
        seconds=float(max(net.done_at[i, 0] for i in stay)),
        bound=math.nan,
        joiner_s=max((float(net.done_at[i, 0]) - t for i, t in joined.items()), default=0.0),
        stayers=len(stay),
        complete=left[0] == 0,
        max_depth=2,
        stats={},
        wall=time.monotonic() - started,
    )
