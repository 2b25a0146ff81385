"""The weight origin of a run, without training: what `intellect-node bootstrap` runs, minus the trainer.

Used by benchmarks/broadcast.py. It holds the run key, starts the first DHT peer and the shard server, publishes
the signed run spec, the trainer record and a tiny version 0, and prints ``READY {json}``. On the line
``PUBLISH`` on stdin it writes version 1 (``--size-mb`` of random fp32 tensors in ``--shard-mb`` shards, signed
manifest), announces it in the DHT and prints ``PUBLISHED at=<unix time>`` (taken before writing, as the
baseline's clock starts before it shards and hashes), ``written_at`` (written, fsynced, and the relays below
told) and ``ready_at`` (announced in the DHT too).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import sys
import time
from pathlib import Path

import torch

from intellect_node import __version__
from intellect_node.config import RunConfig
from intellect_node.p2p.dht import Membership
from intellect_node.p2p.http import HttpServer
from intellect_node.p2p.metrics import Metrics
from intellect_node.weights.files import write_checkpoint
from intellect_node.weights.relay import ShardServer
from intellect_node.weights.store import WeightStore
from intellect_protocol.identity import Identity
from intellect_protocol.messages import NodeRecord, RunSpec


async def main(args: argparse.Namespace) -> None:
    identity = Identity.generate()
    run_id = identity.node_id
    run = RunConfig()
    spec = RunSpec(run_id=run_id, name="broadcast-bench", created=time.time(), seed=0, model=run.model)
    metrics = Metrics()
    store = WeightStore(Path(args.data_dir) / run_id, run_id)
    limit = args.upload_limit_mbps * 1e6 / 8 if args.upload_limit_mbps else None
    origin = ShardServer(store, metrics, args.slots or args.stripes, limit, node_id=run_id)
    origin.path = lambda: [run_id]  # the root of every path in the tree
    origin.stripes = args.stripes
    http = HttpServer(metrics, lambda: {"role": "origin", "versions": store.complete_versions()}, origin.routes())
    port = await http.start(args.host, 0)
    url = f"http://{args.host}:{port}"
    membership = Membership(identity, run_id, metrics)
    maddrs = await membership.start(args.host, 0, [])
    write_checkpoint(store.root, identity, run_id, 0, {"w": torch.zeros(16)}, 1 << 20)
    version = 0

    def record() -> NodeRecord:
        relay = origin.origin_info({}, store.complete_versions(), args.slots)
        return NodeRecord(
            run_id=run_id,
            node_id=run_id,
            role="trainer",
            p2p_maddrs=maddrs,
            http_url=url,
            weight_version=version,
            updated=time.time(),
            software=f"intellect-node/{__version__}",
            relay=relay,
        )

    await membership.publish_spec(spec)
    await membership.publish_record(record())
    print("READY " + json.dumps({"run_id": run_id, "p2p_maddrs": maddrs, "status_url": url}), flush=True)
    republish = asyncio.ensure_future(membership.republish_forever(record, spec))
    try:
        loop = asyncio.get_running_loop()
        while (line := await loop.run_in_executor(None, sys.stdin.readline)).strip() != "EXIT":
            if line.strip() != "PUBLISH" or not line:
                if not line:
                    break
                continue
            g = torch.Generator().manual_seed(version + 1)
            per = args.shard_mb * 2**20 // 4
            n = args.size_mb // args.shard_mb
            tensors = {f"t{i:04d}": torch.rand(per, generator=g) for i in range(n)}
            started = time.time()  # a trainer holds its tensors already: the time starts with writing them
            version += 1
            await asyncio.to_thread(write_checkpoint, store.root, identity, run_id, version, tensors, per * 4)
            store.added()  # as the trainer does: relays below learn of it through the tree
            written = time.time()
            await membership.publish_record(record())
            print(f"PUBLISHED at={started:.6f} written_at={written:.6f} ready_at={time.time():.6f}", flush=True)
    finally:
        republish.cancel()
        await http.close()
        await membership.close()


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--data-dir", required=True)
    p.add_argument("--slots", type=int, help="default: from the measured upload, as the trainer")
    p.add_argument("--stripes", type=int, default=4)
    p.add_argument("--size-mb", type=int, default=64)
    p.add_argument("--shard-mb", type=int, default=1)
    p.add_argument("--upload-limit-mbps", type=float, help="in-process upload cap (when tc is not available)")
    os.environ.setdefault("HIVEMIND_LOGLEVEL", "WARNING")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    asyncio.run(main(p.parse_args()))
