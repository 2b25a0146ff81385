"""Parent choice in the relay tree, from DHT records alone."""

from __future__ import annotations

import asyncio
from pathlib import Path

import aiohttp

from intellect_node.fetch import Source
from intellect_node.follower import WeightFollower
from intellect_node.metrics import Metrics
from intellect_node.relay import ShardServer
from intellect_node.status import HttpServer
from intellect_node.store import WeightStore
from intellect_node.tree import plan
from intellect_protocol.messages import NodeRecord, RelayInfo

ORIGIN = "0" * 32


def _rec(nid: str, depth: int, free: int, parent: str | None = None, versions: tuple[int, ...] = (1,),
         fetching: int = -1, bps: float = 0.0) -> NodeRecord:  # fmt: skip
    return NodeRecord(
        run_id=ORIGIN, node_id=nid, role="trainer" if nid == ORIGIN else "relay", updated=0.0,
        weight_version=max(versions, default=-1),
        http_url=f"http://{nid[:4]}", relay=RelayInfo(depth=depth, parent=parent, slots_total=2, slots_free=free,
        versions=list(versions), fetching=fetching, upload_bps=bps),
    )  # fmt: skip


def _records(*recs: NodeRecord) -> dict[str, NodeRecord]:
    return {r.node_id: r for r in recs}


def test_origin_is_the_last_resort() -> None:
    a = "a" * 32
    parent, sources = plan(_records(_rec(ORIGIN, 0, 2), _rec(a, 1, 1, ORIGIN)), "e" * 32, ORIGIN, 1, None)
    assert parent is not None and parent.node_id == a and parent.is_parent
    assert [s.node_id for s in sources] == [a, ORIGIN]
    parent, _ = plan(_records(_rec(ORIGIN, 0, 2), _rec(a, 1, 0, ORIGIN)), "e" * 32, ORIGIN, 1, None)
    assert parent is not None and parent.node_id == ORIGIN  # the only relay has no free slot


def test_lowest_depth_then_fastest() -> None:
    a, b, c = "a" * 32, "b" * 32, "c" * 32
    recs = _records(
        _rec(ORIGIN, 0, 0), _rec(a, 2, 1, b), _rec(b, 1, 1, ORIGIN, bps=1e6), _rec(c, 1, 1, ORIGIN, bps=9e6)
    )
    parent, sources = plan(recs, "e" * 32, ORIGIN, 1, None)
    assert parent is not None and parent.node_id == c and parent.depth == 1
    assert [s.node_id for s in sources] == [c, b, a, ORIGIN]


def test_a_relay_following_the_run_counts_and_one_left_behind_does_not() -> None:
    a, b, c = "a" * 32, "b" * 32, "c" * 32
    recs = _records(_rec(ORIGIN, 0, 1, versions=(3,)), _rec(a, 1, 1, ORIGIN, versions=(1,)),
                    _rec(b, 2, 1, ORIGIN, versions=(2,)), _rec(c, 3, 1, ORIGIN, versions=(1,), fetching=3))  # fmt: skip
    parent, sources = plan(recs, "e" * 32, ORIGIN, 3, None)
    assert parent is not None and parent.node_id == b  # holds 2: about to fetch 3
    assert a not in {s.node_id for s in sources} and c in {s.node_id for s in sources}


def test_keeps_a_live_parent_and_never_picks_a_descendant() -> None:
    me, a, child, grandchild = "e" * 32, "a" * 32, "c" * 32, "d" * 32
    recs = _records(_rec(ORIGIN, 0, 2), _rec(a, 1, 0, ORIGIN), _rec(child, 2, 2, me), _rec(grandchild, 3, 2, child))
    parent, _ = plan(recs, me, ORIGIN, 1, a)
    assert parent is not None and parent.node_id == a  # full, but we hold one of its slots already
    parent, sources = plan(recs, me, ORIGIN, 1, None)
    assert parent is not None and parent.node_id == ORIGIN
    assert child not in {s.node_id for s in sources} and grandchild not in {s.node_id for s in sources}


def test_excluded_and_dead_parents_are_replaced() -> None:
    a, b = "a" * 32, "b" * 32
    recs = _records(_rec(ORIGIN, 0, 2), _rec(a, 1, 1, ORIGIN), _rec(b, 1, 1, ORIGIN))
    parent, _ = plan(recs, "e" * 32, ORIGIN, 1, a, exclude={a})
    assert parent is not None and parent.node_id == b
    del recs[b]
    parent, _ = plan(recs, "e" * 32, ORIGIN, 1, b)  # b's record expired: it is gone
    assert parent is not None and parent.node_id == a


class _Records:
    """The DHT as the follower sees it: a fixed set of signed-in records (the HTTP side below is real)."""

    def __init__(self, records: dict[str, NodeRecord]) -> None:
        self.records = records

    async def get_nodes(self) -> dict[str, NodeRecord]:
        return self.records


def test_a_node_that_finds_itself_in_its_parents_path_leaves_the_cycle(tmp_path: Path) -> None:
    """Two nodes that chose each other at once: the keep-alive reply carries the parent's path from the origin,
    the child sees its own id in it, drops that parent and takes another (here the origin)."""
    me, b = "e" * 32, "b" * 32

    async def main() -> tuple[str | None, float, list[str]]:
        metrics = Metrics()
        b_server = ShardServer(WeightStore(tmp_path / "b", ORIGIN), Metrics(), slots=2)
        b_server.path = lambda: [ORIGIN, me, b]  # b believes it hangs below us
        origin_server = ShardServer(WeightStore(tmp_path / "o", ORIGIN), Metrics(), slots=2)
        origin_server.path = lambda: [ORIGIN]
        http_b = HttpServer(Metrics(), lambda: {}, b_server.routes())
        http_o = HttpServer(Metrics(), lambda: {}, origin_server.routes())
        port_b, port_o = await http_b.start("127.0.0.1", 0), await http_o.start("127.0.0.1", 0)
        records = {
            ORIGIN: _rec(ORIGIN, 0, 2).model_copy(update={"http_url": f"http://127.0.0.1:{port_o}"}),
            b: _rec(b, 2, 1, me).model_copy(update={"http_url": f"http://127.0.0.1:{port_b}"}),
        }

        async def publish() -> None:
            return None

        follower = WeightFollower(
            me, ORIGIN, _Records(records), WeightStore(tmp_path / "me", ORIGIN), metrics, None, 2, None, publish,
        )  # type: ignore[arg-type]  # fmt: skip
        try:
            async with aiohttp.ClientSession() as session:
                follower.start(session)
                fetcher = follower.fetcher
                assert fetcher is not None
                fetcher._find = follower._find
                fetcher.sources = {b: Source(b, f"http://127.0.0.1:{port_b}", 2, is_parent=True)}
                fetcher.parent = b
                await follower.attach_once(session)
                return fetcher.parent, metrics.counter("node_relay_cycles_left_total"), follower.path
        finally:
            await http_b.close()
            await http_o.close()

    parent, cycles, path = asyncio.run(main())
    assert parent == ORIGIN and cycles == 1 and path == []
