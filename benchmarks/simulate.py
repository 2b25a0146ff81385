"""Broadcast simulator: a checkpoint to thousands of volunteers through the relay tree, on a simulated clock.

Runs the project's own tree code (benchmarks/simswarm.py: ``stripes``, ``tree.parents``/``below``/``holders``,
``fetch.pick_source``/``Source``, real ``NodeRecord``s with a DHT lag) against a flow-level network
(benchmarks/simnet.py: every node's upload and download shared among its transfers, max-min fair with a fixed
weight per connection for TCP's uneven sharing (``--tcp-spread``), cut-through relaying with a per-hop lag,
latency per node, nodes that vanish mid-transfer). No packets: 1,000 nodes take under a
minute, 2,000 two and a half (`--coarse`), 10,000 about 20 minutes without churn and under an hour with it
(`--coarse`; the formation is 7-8 minutes of it: docs/weights.md).

Population (``--dc-share``, ``--nat``): volunteers are residential (upload log-uniform 10-300 Mbit/s, download 10x
that within 100-1,000 Mbit/s, one-way latency 5-40 ms) or in a datacenter (upload 500-1,000 Mbit/s, download
1-10 Gbit/s, 2-10 ms); a share of the residential ones is unreachable (NAT: no slots, never a parent). The origin
(the trainer) is in a datacenter (``--origin-gbit``). Every node announces its true upload (its meter has
converged on earlier versions). The tree forms on an earlier version first (nodes join over a minute, then it
settles), then the version is published at t=0. Churn: a share of the nodes vanish (no goodbye) and as many new
ones join, at uniform times over the first 80% of the bound. Time: until every node present at t=0 that stays
holds the whole version; joiners are reported apart (seconds from joining). Bound: max(S / u_origin,
N * S / (u_origin + sum of the N stayers' uploads, NAT ones included), S / slowest stayer's download).

Shardcast (INTELLECT-2's two-level design) in the same model: the origin, ``--sc-relays`` fixed datacenter relays
that poll it every 30 s, clients spread over the relays that poll every 30 s; whole shards only (store and forward).

Per-hop lag: a relay passes on a stripe's bytes ``--hop-lag-s`` seconds after it received them. The relay is
cut-through (64 KiB pieces), so what a level adds is time in buffers: the kernel's send queue and the link's own
queue (tbf in netns, the modem at home), which drain at the link's rate whatever the shard size. The measured
old-chain netns figures grow by about 0.22 s a hop, which fits them within 2% (with the links' payload rate and
the origin's write time modelled; 0.335 s before): a calibration of one parameter on three figures, not a
prediction of them. (It was a lag in bytes before, one shard: the same in the chain, but four times the time for
a stripe at a quarter of the rate, and 19 s a hop for a 64 MiB shard.)

Validation: the network-namespace benchmark (benchmarks/broadcast.py) simulated: origin + N receivers, every
upload 25 Mbit/s, downloads unlimited, 0.1 ms LAN latency, 64 MiB in 1 MiB shards, 90 s to form the tree, the
old single tree by default (``--netns-stripes 1 --netns-slots 1``: within 2%; the striped default,
``--netns-stripes 4 --netns-slots 0``: within 1% at N=4, 3-5% low at N=8, 8-11% low at N=16 over five seeds),
against measured seconds given as ``--netns-measured N:s,...``. TCP's uneven sharing: each connection's weight
at a shared link is log-uniform with a standard deviation of its log of ``--tcp-spread`` (0.05: the spread of the
origin's connections' rates in three netns DEBUG runs, 0.032, 0.047 and 0.08; measured, not fitted to the
completion times; 0 is max-min fair, which read 11-14% low at N=8 and 16). A node paces the connections its
upload limits at equal shares (pacing.FairShare): there what is left is ``--paced-spread`` (0.03: the roots'
stripe rates from the origin in two netns DEBUG runs with pacing, 0.024 and 0.030; 0.077 in one without).

    python benchmarks/simulate.py [--nodes 100 1000] [--size-gb 62] [--churn 0.1] [--netns-measured 4:23.01,...]

Prints one table, then one summary line (for 1,000 nodes with churn, or the largest run):
    scale nodes=1000 size_gb=62 churn=0.1 ours_s=... bound_s=... over_bound=... shardcast_s=... sim_vs_netns_err_pct=...
"""

from __future__ import annotations

import argparse
import math
import random
import sys
import time
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from simnet import Clock, Net  # noqa: E402
from simswarm import ORIGIN, Swarm  # noqa: E402

from intellect_node.weights.stripes import DEFAULT_STRIPES  # noqa: E402

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
    """TCP's uneven sharing of a link: the spread of each connection's weight (simnet.tcp_weights)."""
    paced: float = 0.0
    """What is left of it at an upload that paces its connections (pacing.FairShare; simnet.Net)."""
    exact: bool = True
    """False: bytes move at ticks only (simnet.Clock), and the home-stripe plan is computed once a simulated
    second at most (Swarm.moves_s), for thousands of nodes."""


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


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--nodes", type=int, nargs="*", default=[100, 1000])
    p.add_argument("--size-gb", type=float, default=62.0)
    p.add_argument("--shard-mib", type=float, default=64.0, help="the trainer's shard size (config shard_bytes)")
    p.add_argument("--stripes", type=int, default=DEFAULT_STRIPES)
    p.add_argument("--churn", type=float, default=0.1, help="share leaving (and as many joining); 0 is run too")
    p.add_argument("--churn-values", type=float, nargs="*", help="the churn shares to run (default: 0 and --churn)")
    p.add_argument("--nat", type=float, default=0.25, help="share of unreachable receivers")
    p.add_argument("--dc-share", type=float, default=0.1, help="share of receivers in datacenters")
    p.add_argument("--origin-gbit", type=float, default=10.0)
    p.add_argument("--sc-relays", type=int, default=4, help="shardcast's fixed relays")
    p.add_argument("--sc-relay-gbit", type=float, default=10.0)
    p.add_argument("--skip-shardcast", action="store_true")
    p.add_argument("--skip-ours", action="store_true", help="shardcast only (its figures for a long run of ours)")
    p.add_argument(
        "--hop-lag-s",
        type=float,
        default=0.22,
        help="seconds a relay's bytes wait before going on (see the docstring: fits netns)",
    )
    p.add_argument("--dht-lag", type=float, default=3.0, help="seconds until a published record is seen")
    p.add_argument("--tick", type=float, default=0.0, help="rate recomputation period (0: bound / 3000, <= 1 s)")
    p.add_argument("--netns-measured", default="", help="N:seconds,... measured by benchmarks/broadcast.py")
    p.add_argument(
        "--netns-payload",
        type=float,
        default=WIRE_PAYLOAD,
        help="payload share of the netns links' wire rate (Ethernet+IP+TCP headers; 1: none)",
    )
    p.add_argument(
        "--netns-write-s",
        type=float,
        default=0.35,
        help="the origin's write of the version, on the netns clock (broadcast.py: origin write s)",
    )
    p.add_argument("--netns-stripes", type=int, default=1)
    p.add_argument("--netns-slots", type=int, default=1, help="0: fan-out from upload (the new default)")
    p.add_argument("--no-preempt", action="store_true", help="a home node does not take a leaf's slot")
    p.add_argument(
        "--spare-min-fanout",
        type=int,
        default=10**9,
        help="a spare slot from this fan-out up (default: none, as the node)",
    )
    p.add_argument(
        "--tcp-spread",
        type=float,
        default=0.05,
        help="TCP's uneven sharing of a link: std of the log of each connection's weight (0: max-min "
        "fair); default measured: the origin's connections in three netns DEBUG runs, 0.032-0.08",
    )
    p.add_argument(
        "--paced-spread",
        type=float,
        default=0.03,
        help="what is left of it at an upload that paces its connections (pacing.FairShare); default "
        "measured: the roots' stripe rates from the origin in two netns DEBUG runs, 0.024 and 0.030",
    )
    p.add_argument("--coarse", action="store_true", help="scale runs: bytes move at ticks only (simnet.Clock)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--verbose", action="store_true", help="where the last node's time went")
    args = p.parse_args()
    rows: list[tuple[str, int, float, Result]] = []
    errs: list[float] = []
    for item in filter(None, args.netns_measured.split(",")):
        n, measured = int(item.split(":")[0]), float(item.split(":")[1])
        r = run_ours(netns_scenario(args, n), args.verbose)
        err = 100 * (r.seconds - measured) / measured
        errs.append(abs(err))
        rows.append((f"netns stripes={args.netns_stripes} slots={args.netns_slots} measured={measured:.2f}", n, 0.0, r))
        print(f"  netns N={n}: sim {r.seconds:.2f}s measured {measured:.2f}s err {err:+.1f}%", flush=True)
    summary = None
    for n in args.nodes:
        for churn in sorted(set(args.churn_values) if args.churn_values else {0.0, args.churn}):
            sc = scale_scenario(args, n, churn)
            if args.skip_ours:
                r = Result(
                    math.nan,
                    bound(sc.size, sc.origin, [p for i, p in enumerate(sc.peers) if i not in set(sc.leave)]),
                    0.0,
                    0,
                    False,
                    0,
                    {},
                    0.0,
                )
            else:
                r = run_ours(sc, args.verbose)
                rows.append((f"ours stripes={args.stripes}", n, churn, r))
            print(f"  ours N={n} churn={churn}: {r.seconds:.0f}s bound {r.bound:.0f}s wall {r.wall:.0f}s", flush=True)
            sc_s = math.nan
            if not args.skip_shardcast:
                s = run_shardcast(sc, args.sc_relays, args.sc_relay_gbit * 1000 * MBIT)
                s.bound = r.bound
                sc_s = s.seconds
                rows.append((f"shardcast relays={args.sc_relays}", n, churn, s))
            if churn == args.churn and (summary is None or n == 1000 or summary[0] != 1000):
                summary = (n, churn, r, sc_s)
    print()
    print(
        f"checkpoint {args.size_gb:g} GB in {args.shard_mib:g} MiB shards; origin {args.origin_gbit:g} Gbit/s; "
        f"receivers {args.dc_share:.0%} datacenter, {args.nat:.0%} NAT; per-hop lag {args.hop_lag_s:g} s"
    )
    print(
        f"{'system':<44}{'N':>6}{'churn':>6}{'seconds':>9}{'bound':>8}{'x bound':>8}{'joiner s':>9}{'depth':>6}"
        f"{'reparent':>9}{'no-slot':>8}{'alt':>7}{'wall s':>7}  complete"
    )
    for name, n, churn, r in rows:
        st = r.stats
        print(
            f"{name:<44}{n:>6}{churn:>6.2f}{r.seconds:>9.1f}{r.bound:>8.1f}{r.seconds / r.bound:>8.2f}"
            f"{r.joiner_s:>9.1f}{r.max_depth:>6}{st.get('reparents', 0):>9.0f}{st.get('no_slot_rounds', 0):>8.0f}"
            f"{st.get('alt_shards', 0):>7.0f}{r.wall:>7.0f}  {r.complete}"
        )
    print()
    err = f"{max(errs):.1f}" if errs else "nan"
    if summary is not None:
        n, churn, r, sc_s = summary
        print(
            f"scale nodes={n} size_gb={args.size_gb:g} churn={churn:g} ours_s={r.seconds:.1f} bound_s={r.bound:.1f} "
            f"over_bound={r.seconds / r.bound:.2f} shardcast_s={sc_s:.1f} sim_vs_netns_err_pct={err}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
