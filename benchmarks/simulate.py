"""Broadcast simulator: a checkpoint to thousands of volunteers through the relay tree, on a simulated clock.

Runs the project's own tree code (benchmarks/sim/swarm.py: ``stripes``, ``tree.parents``/``below``/``holders``,
``fetch.pick_source``/``Source``, real ``NodeRecord``s with a DHT lag) against a flow-level network
(benchmarks/sim/net.py: every node's upload and download shared among its transfers, max-min fair with a fixed
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
import sys

from intellect_node.weights.stripes import DEFAULT_STRIPES

from sim.runs import Result, run_ours, run_shardcast
from sim.scenario import MBIT, WIRE_PAYLOAD, bound, netns_scenario, scale_scenario


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
    p.add_argument("--coarse", action="store_true", help="scale runs: bytes move at ticks only (sim.net.Clock)")
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
