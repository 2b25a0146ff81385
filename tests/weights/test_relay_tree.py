"""Integration: the relay tree with real nodes on loopback (a trainer as origin and relay-role processes).

The origin publishes version 0 of a ~38 MB model (1-2 MB shards) and no training happens (`--max-steps 0`);
upload limits keep transfers long enough that the tree forms while data flows, as it does across the internet.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import signal
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web

from intellect_node.launch import NodeProcess
from intellect_node.p2p.dht import Membership
from intellect_node.p2p.metrics import Metrics
from intellect_node.weights.files import MANIFEST_NAME, verify_manifest, write_checkpoint
from intellect_protocol.identity import Identity
from intellect_protocol.messages import NodeRecord, RelayInfo

pytestmark = pytest.mark.integration

BIG_MODEL = ["--set", "model.hidden_size=512", "--set", "model.intermediate_size=1024", "--set", "model.num_layers=4"]


class Cluster:
    def __init__(self, root: Path) -> None:
        self.root = root
        self.nodes: list[NodeProcess] = []
        self.trainer: NodeProcess | None = None
        self.ready: dict[str, Any] = {}

    def start_origin(self, slots: int | None, mbps: float, stripes: int = 1) -> dict[str, Any]:
        """The trainer as origin; one stripe (a single tree, whose shape these tests look at) unless told."""
        argv = [
            "bootstrap",
            "--data-dir",
            str(self.root / "trainer"),
            "--max-steps",
            "0",
            "--shard-mb",
            "1",
            "--upload-limit-mbps",
            str(mbps),
            "--stripes",
            str(stripes),
            *BIG_MODEL,
        ]
        argv += ["--relay-slots", str(slots)] if slots else []
        self.trainer = NodeProcess("trainer", argv, self.root / "logs")
        self.nodes.append(self.trainer)
        self.ready = self.trainer.wait_ready(timeout=120)
        return self.ready

    def start_relay(self, name: str, slots: int | None = 2, mbps: float | None = None) -> NodeProcess:
        argv = [
            "join",
            "--role",
            "relay",
            "--peers",
            self.ready["p2p_maddrs"][0],
            "--run-id",
            self.ready["run_id"],
            "--data-dir",
            str(self.root / name),
        ]
        argv += ["--relay-slots", str(slots)] if slots else []
        if mbps is not None:
            argv += ["--upload-limit-mbps", str(mbps)]
        node = NodeProcess(name, argv, self.root / "logs")
        self.nodes.append(node)
        return node

    def origin_manifest(self) -> bytes:
        return (self.root / "trainer" / "weights" / self.ready["run_id"] / "0" / MANIFEST_NAME).read_bytes()

    def holds_verified_v0(self, name: str) -> bool:
        """Check the node's copy on disk against the origin's signed manifest, byte for byte."""
        manifest = verify_manifest(self.origin_manifest(), self.ready["run_id"], 0)
        folder = self.root / name / "weights" / self.ready["run_id"] / "0"
        return all(
            (folder / s.name).is_file() and hashlib.sha256((folder / s.name).read_bytes()).hexdigest() == s.sha256
            for s in manifest.shards
        )

    def stop(self) -> None:
        for n in self.nodes:
            n.terminate()
        for n in reversed(self.nodes):
            n.stop()


def status(node: NodeProcess) -> dict[str, Any]:
    assert node.ready is not None
    with urllib.request.urlopen(node.ready["status_url"] + "/status", timeout=10) as resp:
        data: dict[str, Any] = json.load(resp)
        return data


@contextmanager
def cluster(tmp_path: Path) -> Iterator[Cluster]:
    c = Cluster(tmp_path)
    try:
        yield c
    finally:
        c.stop()


def _wait(predicate: Any, timeout: float, what: str, state: Any = None) -> None:
    """Wait for ``predicate``; on timeout the error says ``what`` and, where given, what ``state()`` returns."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise TimeoutError(what if state is None else f"{what}: {state()}")
        time.sleep(0.1)


def test_a_tree_of_three_levels_forms_by_itself(tmp_path: Path) -> None:
    with cluster(tmp_path) as c:
        c.start_origin(slots=1, mbps=40)
        relays = [c.start_relay(f"relay-{i}", slots=2, mbps=40) for i in range(5)]
        for r in relays:
            r.wait_ready(timeout=120)
        for r in relays:
            r.wait_for_line("HOLDING 0", timeout=240)
        ids = {status(r)["node_id"]: r.name for r in relays}

        def consistent() -> bool:
            """Each depth is its parent's plus one (the origin is 0); depths follow re-parenting within a
            keep-alive period, so this is waited for, not expected at the first look."""
            views = {r.name: status(r)["relay"] for r in relays}
            depths = {name: v["depth"] for name, v in views.items()}
            return all(
                v["depth"] == (0 if v["parent"] == c.ready["run_id"] else depths[ids[v["parent"]]]) + 1
                for v in views.values()
            )

        _wait(consistent, 30, "depths did not settle")
        depths = {r.name: status(r)["relay"]["depth"] for r in relays}
        assert max(depths.values()) >= 3, depths
        assert all(c.holds_verified_v0(r.name) for r in relays)


def test_striped_every_relay_has_a_parent_in_each_stripe_and_serves_children_only_in_its_home(
    tmp_path: Path,
) -> None:
    """Fan-out from the measured upload, two stripes. Every relay holds a parent in every stripe, a parent in
    stripe s is the origin or a relay at home in s, no relay has more children than its slots, the homes spread
    over the stripes, and every relay holds the version, verified. Two stripes, not the default four: six equal
    relays of four slots cannot give everyone a parent in four stripes (each stripe needs five children served
    by its home nodes; a stripe with one home node has four), a known limit of stripes without spare capacity."""
    with cluster(tmp_path) as c:
        c.start_origin(slots=None, mbps=40, stripes=2)
        relays = [c.start_relay(f"relay-{i}", slots=None, mbps=40) for i in range(6)]
        for r in relays:
            r.wait_ready(timeout=120)
        for r in relays:
            r.wait_for_line("HOLDING 0", timeout=240)
        run = c.ready["run_id"]

        seen: dict[str, dict[str, Any]] = {}

        def attached() -> bool:
            """Whether one pass over the relays' views shows every relay with a parent in each stripe, the origin or a
            relay at home there. The asserts below check that pass's views: the tree goes on moving between versions
            (a node moves its home, a slot goes to a node at home in its stripe and its holder re-parents), so a
            second read a moment later can catch a relay between two parents (the fresh-clone CI at 93523cb did)."""
            views = {s["node_id"]: s["relay"] for s in (status(r) for r in relays)}
            if not all(len(v["parents"]) == 2 and None not in v["parents"].values() for v in views.values()):
                return False
            homes = {nid: v["home_stripe"] for nid, v in views.items()}
            # a parent that has just moved its home elsewhere keeps its children there until their next keep-alive
            if not all(p == run or homes.get(p) == int(s) for v in views.values() for s, p in v["parents"].items()):
                return False
            seen.clear()
            seen.update(views)
            return True

        def tree() -> dict[str, Any]:
            keys = ("home_stripe", "parents", "children", "slots")
            out: dict[str, Any] = {}
            for r in relays:
                s = status(r)
                out[s["node_id"][:8]] = {k: s["relay"].get(k) for k in keys}
            assert c.trainer is not None
            out["origin"] = status(c.trainer).get("relay")
            return out

        # 2-10 s here with a CPU hog beside it; 90 s once failed in CI: a node that moved its home into a stripe
        # after the version found every node at home there full and the origin's 503 naming nobody (tree.parents)
        _wait(attached, 60, "some relay has no parent in some stripe, or one not at home there", tree)
        views = seen
        homes = {nid: v["home_stripe"] for nid, v in views.items()}
        for nid, v in views.items():
            for stripe, parent in v["parents"].items():
                assert parent == run or homes[parent] == int(stripe), (nid, stripe, parent, homes)
            assert len(v["children"]) <= v["slots"], v
        assert len(set(homes.values())) >= 2, homes
        assert all(c.holds_verified_v0(r.name) for r in relays)


def test_a_relay_killed_mid_transfer_costs_its_children_only_a_reparent(tmp_path: Path) -> None:
    with cluster(tmp_path) as c:
        # 38 MB at 10 Mbit/s: relay-a needs ~30 s for everything, several times the children's start-up (at
        # 40 Mbit/s it once finished within it on a loaded CI machine, and the kill came too late to test anything)
        c.start_origin(slots=1, mbps=10)
        first = c.start_relay("relay-a", slots=2, mbps=20)
        first.wait_ready(timeout=120)
        _wait(lambda: status(first)["relay"]["fetching_verified_shards"] >= 1, 60, "relay-a never started")
        children = [c.start_relay(f"relay-{x}", slots=2) for x in "bc"]
        for child in children:
            child.wait_ready(timeout=120)
        a_id = status(first)["node_id"]
        below_a = {a_id, *(status(ch)["node_id"] for ch in children)}  # under relay-a, or under the other child

        def receiving_below_a() -> bool:
            views = [status(ch)["relay"] for ch in children]
            return any(v["parent"] == a_id for v in views) and all(
                v["parent"] in below_a and v["bytes_received"] > 0 for v in views
            )

        _wait(receiving_below_a, 60, "the children did not pick relay-a")
        os.killpg(first.proc.pid, signal.SIGKILL)
        for child in children:
            child.wait_for_line("HOLDING 0", timeout=240)
            view = status(child)["relay"]
            assert view["parent"] != a_id
        assert all(c.holds_verified_v0(ch.name) for ch in children)
        assert not c.holds_verified_v0("relay-a")  # it really died before it had everything


def test_a_relay_serving_corrupted_bytes_is_banned_and_the_download_completes(tmp_path: Path) -> None:
    with cluster(tmp_path) as c:
        c.start_origin(slots=2, mbps=200)
        liar = c.start_relay("relay-liar", slots=4)
        liar.wait_ready(timeout=120)
        liar.wait_for_line("HOLDING 0", timeout=120)
        folder = tmp_path / "relay-liar" / "weights" / c.ready["run_id"] / "0"
        for shard in folder.glob("*.safetensors"):  # its disk rots after it verified the shards
            data = bytearray(shard.read_bytes())
            data[len(data) // 2] ^= 0xFF
            shard.write_bytes(bytes(data))
        victim = c.start_relay("relay-victim")
        victim.wait_ready(timeout=120)
        victim.wait_for_line("HOLDING 0", timeout=120)
        assert status(victim)["relay"]["bans"] >= 1
        assert c.holds_verified_v0("relay-victim")


def test_a_manifest_signed_by_another_key_is_ignored(tmp_path: Path) -> None:
    """A peer announces itself as a relay (a valid record of its own), takes the newcomer as its child and serves
    it a forged version 0."""
    with cluster(tmp_path) as c:
        ready = c.start_origin(slots=2, mbps=200)
        forger = Identity.generate()
        forged_root = tmp_path / "forged"
        write_checkpoint(forged_root, forger, ready["run_id"], 0, {"w": __import__("torch").zeros(4)}, 1 << 20)

        async def serve_and_announce() -> None:
            async def attach(request: web.Request) -> web.Response:  # it plays the relay: takes every child
                return web.json_response({"depth": 1, "path": [ready["run_id"], forger.node_id], "token": "t"})

            app = web.Application()
            app.router.add_static("/weights/", forged_root)
            app.router.add_post("/relay/attach", attach)
            runner = web.AppRunner(app)
            await runner.setup()
            site = web.TCPSite(runner, "127.0.0.1", 0)
            await site.start()
            port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
            membership = Membership(forger, ready["run_id"], Metrics())
            await membership.start("127.0.0.1", 0, ready["p2p_maddrs"][:1])
            try:
                trainer = await membership.get_trainer()
                assert trainer is not None
                relay = RelayInfo(depth=1, slots_total=8, slots_free=8, versions=[0])
                record = NodeRecord(
                    run_id=ready["run_id"],
                    node_id=forger.node_id,
                    role="relay",
                    epoch=trainer.epoch,
                    http_url=f"http://127.0.0.1:{port}",
                    updated=time.time(),
                    relay=relay,
                )
                assert await membership.publish_record(record)
                victim = c.start_relay("relay-victim")
                await asyncio.to_thread(victim.wait_ready, 120)
                await asyncio.to_thread(victim.wait_for_line, "HOLDING 0", 120)
                assert status(victim)["relay"]["bans"] >= 1
            finally:
                await membership.close()
                await runner.cleanup()

        asyncio.run(serve_and_announce())
        assert c.holds_verified_v0("relay-victim")


def test_a_node_restarted_mid_download_keeps_its_verified_shards(tmp_path: Path) -> None:
    with cluster(tmp_path) as c:
        c.start_origin(slots=1, mbps=48)  # the version in about 6 s: the kill lands well before its last shard
        node = c.start_relay("relay-r")
        node.wait_ready(timeout=120)
        _wait(lambda: status(node)["relay"]["fetching_verified_shards"] >= 3, 120, "no shard arrived")
        os.killpg(node.proc.pid, signal.SIGKILL)
        node.stop()
        partial = tmp_path / "relay-r" / "weights" / c.ready["run_id"] / "0.partial"
        kept = sum(p.stat().st_size for p in partial.glob("*.safetensors"))
        total = verify_manifest(c.origin_manifest(), c.ready["run_id"], 0).total_size
        assert 0 < kept < total
        again = c.start_relay("relay-r")
        again.wait_ready(timeout=120)
        again.wait_for_line("HOLDING 0", timeout=240)
        assert status(again)["relay"]["bytes_received"] <= total - kept
        assert c.holds_verified_v0("relay-r")
