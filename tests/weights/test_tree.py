"""Parent choice in the relay tree: the order DHT records give, and attaching to real shard servers (loopback)."""

from __future__ import annotations

import asyncio
import contextlib
import shutil
from collections.abc import AsyncIterator
from pathlib import Path
from types import SimpleNamespace

import aiohttp
import pytest
import torch
from aiohttp import web

from intellect_node.config import NodeConfig
from intellect_node.p2p.http import HttpServer
from intellect_node.p2p.metrics import Metrics
from intellect_node.roles import validator_node
from intellect_node.roles.validator_node import ValidatorNode
from intellect_node.weights import relay
from intellect_node.weights.auth import signed_headers
from intellect_node.weights.files import write_checkpoint
from intellect_node.weights.follower import WeightFollower
from intellect_node.weights.relay import ShardServer
from intellect_node.weights.sources import Source
from intellect_node.weights.store import WeightStore
from intellect_node.weights.tree import holders, parents
from intellect_protocol.envelope import Rejected
from intellect_protocol.identity import Identity
from intellect_protocol.messages import ModelSpec, NodeRecord, RelayInfo, RunSpec, TrainSpec
from tests.helpers.keys import Keys
from tests.helpers.wait import until

ORIGIN = "0" * 32
KEYS = Keys()
_id = KEYS.named
"""The id of the test's node ``label`` (a real key: relay slot requests are signed)."""


def _signed(node_id: str, server_id: str) -> dict[str, str]:
    return signed_headers(KEYS[node_id], "POST", "/relay/attach", server_id)


def _rec(
    nid: str,
    depth: int,
    free: int,
    parent: str | None = None,
    versions: tuple[int, ...] = (1,),
    fetching: int = -1,
    bps: float = 0.0,
) -> NodeRecord:
    return NodeRecord(
        run_id=ORIGIN,
        node_id=nid,
        role="trainer" if nid == ORIGIN else "relay",
        updated=0.0,
        weight_version=max(versions, default=-1),
        http_url=f"http://{nid[:4]}",
        relay=RelayInfo(
            depth=depth,
            parent=parent,
            slots_total=2,
            slots_free=free,
            versions=list(versions),
            fetching=fetching,
            upload_bps=bps,
        ),
    )


def _records(*recs: NodeRecord) -> dict[str, NodeRecord]:
    return {r.node_id: r for r in recs}


def test_relays_by_depth_then_speed_and_the_origin_last() -> None:
    a, b, c, full = _id("a"), _id("b"), _id("c"), _id("f")
    recs = _records(
        _rec(ORIGIN, 0, 2),
        _rec(a, 2, 1, b),
        _rec(b, 1, 1, ORIGIN, bps=1e6),
        _rec(c, 1, 1, ORIGIN, bps=9e6),
        _rec(full, 1, 0, ORIGIN),
    )
    assert [x.node_id for x in parents(recs, _id("e"), ORIGIN)] == [c, b, a, ORIGIN]
    assert [x.node_id for x in parents(recs, _id("e"), ORIGIN, exclude={c, ORIGIN})] == [b, a]


def test_a_node_at_home_in_a_stripe_asks_its_full_relays_after_the_origin() -> None:
    """A full relay gives a leaf's slot to a node at home in its stripe, so such a node asks the full relays at
    home there last; a leaf there, or a node in a tree of one stripe, asks only relays with a free slot."""
    free, full_deep, full = _id("a"), _id("b"), _id("f")
    recs = _records(_rec(ORIGIN, 0, 0), _rec(free, 2, 1, full), _rec(full_deep, 2, 0, full), _rec(full, 1, 0, ORIGIN))
    me = _id("e")
    assert [x.node_id for x in parents(recs, me, ORIGIN, stripe=0, home=True)] == [free, ORIGIN, full, full_deep]
    assert [x.node_id for x in parents(recs, me, ORIGIN, stripe=0, home=False)] == [free, ORIGIN]
    assert [x.node_id for x in parents(recs, me, ORIGIN)] == [free, ORIGIN]


def test_never_a_descendant_by_the_records() -> None:
    me, child, grandchild, other = _id("e"), _id("c"), _id("d"), _id("a")
    recs = _records(_rec(ORIGIN, 0, 0), _rec(child, 1, 2, me), _rec(grandchild, 2, 2, child), _rec(other, 3, 1, ORIGIN))
    assert [x.node_id for x in parents(recs, me, ORIGIN)] == [other, ORIGIN]


def test_alternates_hold_the_whole_version() -> None:
    a, b, c = _id("a"), _id("b"), _id("c")
    recs = _records(
        _rec(ORIGIN, 0, 1, versions=(3,)),
        _rec(a, 1, 1, ORIGIN, versions=(2, 3)),
        _rec(b, 2, 1, a, versions=(2,), fetching=3),
        _rec(c, 2, 0, a, versions=(3,)),
    )
    assert [x.node_id for x in holders(recs, _id("e"), ORIGIN, 3)] == [a]  # b is still receiving, c is full


class _Records:
    """The DHT as the follower sees it: a fixed set of records (the HTTP side below is real)."""

    def __init__(self, records: dict[str, NodeRecord]) -> None:
        self.records = records

    async def get_nodes(self) -> dict[str, NodeRecord]:
        return self.records


async def _serve(
    tmp_path: Path, name: str, slots: int, path: list[str], node_id: str
) -> tuple[ShardServer, HttpServer, str]:
    server = ShardServer(WeightStore(tmp_path / name, ORIGIN), Metrics(), slots=slots, node_id=node_id)
    server.path = lambda: path
    http = HttpServer(Metrics(), lambda: {}, server.routes())
    port = await http.start("127.0.0.1", 0)
    return server, http, f"http://127.0.0.1:{port}"


def _follower(
    tmp_path: Path, me: str, records: dict[str, NodeRecord], metrics: Metrics, run: str = ORIGIN
) -> WeightFollower:
    async def publish() -> None:
        return None

    return WeightFollower(
        KEYS[me],
        run,
        _Records(records),
        WeightStore(tmp_path / me[:4], run),
        metrics,
        None,
        2,
        None,
        publish,
    )  # type: ignore[arg-type]


async def _settled(follower: WeightFollower) -> None:
    """Until the follower's background work (slots given back, records published) is done."""
    while follower._tasks:
        await asyncio.gather(*follower._tasks)


def test_a_full_node_sends_the_newcomer_down_to_a_free_slot(tmp_path: Path) -> None:
    """The records are stale (they show the origin and its child with free slots); attaching finds the truth:
    the origin is full and names its child, the child is full and names the grandchild, which takes us."""
    me, a, b = _id("e"), _id("a"), _id("b")

    async def main() -> tuple[str | None, int, list[str], list[str]]:
        origin, http_o, url_o = await _serve(tmp_path, "o", 1, [ORIGIN], ORIGIN)
        sa, http_a, url_a = await _serve(tmp_path, "a", 1, [ORIGIN, a], a)
        sb, http_b, url_b = await _serve(tmp_path, "b", 1, [ORIGIN, a, b], b)
        try:
            async with aiohttp.ClientSession() as session:
                for url, child, server in ((url_o, a, ORIGIN), (url_a, b, a)):  # the tree: origin -> a -> b
                    async with session.post(f"{url}/relay/attach", headers=_signed(child, server)) as r:
                        assert r.status == 200
                records = {
                    ORIGIN: _rec(ORIGIN, 0, 1).model_copy(update={"http_url": url_o}),
                    a: _rec(a, 1, 1, ORIGIN).model_copy(update={"http_url": url_a}),
                    b: _rec(b, 2, 1, a).model_copy(update={"http_url": url_b}),
                }
                follower = _follower(tmp_path, me, records, Metrics())
                follower.start(session)
                await follower.attachments.choose(await follower._records(), set())
                return follower.parent, follower.depth, follower.path, sb.children()
        finally:
            for h in (http_o, http_a, http_b):
                await h.close()

    parent, depth, path, b_children = asyncio.run(main())
    assert parent == _id("b") and depth == 3 and path == [ORIGIN, _id("a"), _id("b"), me]
    assert b_children == [me]


def test_a_node_takes_no_child_above_it_nor_any_while_cut_off(tmp_path: Path) -> None:
    me, a = _id("e"), _id("a")

    async def main() -> list[int]:
        _, http_a, url_a = await _serve(tmp_path, "a", 2, [ORIGIN, me, a], a)  # a hangs below us
        _, http_c, url_c = await _serve(tmp_path, "c", 2, [], _id("c"))  # lost its parent, not yet reattached
        statuses = []
        try:
            async with aiohttp.ClientSession() as session:
                for url, server in ((url_a, a), (url_c, _id("c"))):
                    async with session.post(f"{url}/relay/attach", headers=_signed(me, server)) as r:
                        statuses.append(r.status)
        finally:
            await http_a.close()
            await http_c.close()
        return statuses

    assert asyncio.run(main()) == [409, 409]


def test_a_cycle_is_left_at_the_next_keep_alive(tmp_path: Path) -> None:
    """Two nodes that re-parented below each other at once: at the next keep-alive the parent sees its child in
    its own path from the origin and refuses it; the child leaves (its slot there is given back) and attaches to
    another node (here the origin)."""
    me, b = _id("e"), _id("b")

    async def main() -> tuple[str | None, float, list[str], list[str]]:
        metrics = Metrics()
        b_server, http_b, url_b = await _serve(tmp_path, "b", 2, [ORIGIN], b)
        _, http_o, url_o = await _serve(tmp_path, "o", 2, [ORIGIN], ORIGIN)
        records = {
            ORIGIN: _rec(ORIGIN, 0, 2).model_copy(update={"http_url": url_o}),
            b: _rec(b, 1, 1, ORIGIN).model_copy(update={"http_url": url_b}),
        }
        try:
            async with aiohttp.ClientSession() as session:
                follower = _follower(tmp_path, me, records, metrics)
                follower.start(session)
                await follower.attachments.choose(await follower._records(), set())
                assert follower.parent == b
                b_server.path = lambda: [ORIGIN, me, b]  # meanwhile b re-parented below us
                await follower.attachments.attach_once(session)
                await _settled(follower)  # the slot at b is given back in the background
                return (
                    follower.parent,
                    metrics.counter("node_relay_reparents_total"),
                    follower.path,
                    b_server.children(),
                )
        finally:
            await http_b.close()
            await http_o.close()

    parent, reparents, path, b_children = asyncio.run(main())
    assert parent == ORIGIN and reparents == 1 and path == [ORIGIN, me] and b_children == []


@contextlib.asynccontextmanager
async def _below_origin(
    tmp_path: Path, run: str, me: str, metrics: Metrics
) -> AsyncIterator[tuple[WeightStore, WeightFollower, aiohttp.ClientSession]]:
    """An origin (a shard server on loopback, store empty) and ``me`` attached below it: the origin's store, the
    follower and its session."""
    store = WeightStore(tmp_path / "o", run)
    server = ShardServer(store, Metrics(), slots=2, node_id=run)
    server.path = lambda: [run]
    http = HttpServer(Metrics(), lambda: {}, server.routes())
    url = f"http://127.0.0.1:{await http.start('127.0.0.1', 0)}"
    records = {run: _rec(run, 0, 2).model_copy(update={"http_url": url})}
    follower = _follower(tmp_path, me, records, metrics, run)
    try:
        async with aiohttp.ClientSession() as session:
            follower.start(session)
            await follower.attachments.choose(await follower._records(), set())
            assert follower.parent == run
            yield store, follower, session
    finally:
        await http.close()


@pytest.mark.integration
def test_children_hear_of_a_new_version_from_their_parent_and_only_a_signed_one(tmp_path: Path) -> None:
    """GET /relay/next: the child learns of version 1 as soon as its parent has it (no DHT read), and a manifest
    signed by another key announces nothing."""
    key, forger, me = Identity.generate(), Identity.generate(), _id("e")
    run = key.node_id

    async def main() -> tuple[int, int]:
        metrics = Metrics()
        async with _below_origin(tmp_path, run, me, metrics) as (store, follower, session):
            watch = asyncio.create_task(follower.watch_parent(session))
            try:
                write_checkpoint(store.root, forger, run, 1, {"w": torch.zeros(4)}, 1 << 20)
                store.added()
                await until(
                    lambda: metrics.counter("node_relay_news_rejected_total", "foreign_manifest") > 0,
                    "the forged manifest's refusal",
                    5.0,
                    every=0.01,
                )
                after_forgery = follower.announced
                shutil.rmtree(store.folder(1))
                write_checkpoint(store.root, key, run, 1, {"w": torch.ones(4)}, 1 << 20)
                store.added()
                await asyncio.wait_for(follower.news.wait(), 5.0)
                return after_forgery, follower.announced
            finally:
                watch.cancel()

    assert asyncio.run(main()) == (-1, 1)


def test_a_node_receives_each_announced_version_while_its_own_work_asks_for_none(tmp_path: Path) -> None:
    """An inference node at home in a stripe asked for a version only before each batch, so its children there
    waited for its generation (4-6 s a version in the red team's swarm). With ``receive_announced`` running, a
    version its parent announces arrives here though nobody calls ``sync``; a ``sync`` of it at the same moment
    waits for that fetch instead of starting a second (one version received, once); and the node's generation loop,
    whose trainer record still says version 1, loads version 2 (``newest``)."""
    key, me = Identity.generate(), _id("e")
    run = key.node_id

    async def main() -> tuple[list[int], float, int]:
        metrics = Metrics()
        async with _below_origin(tmp_path, run, me, metrics) as (store, follower, session):
            tasks = [
                asyncio.create_task(follower.watch_parent(session)),
                asyncio.create_task(follower.receive_announced()),
            ]
            try:
                write_checkpoint(store.root, key, run, 1, {"w": torch.ones(4)}, 1 << 20)
                store.added()
                await until(lambda: 1 in follower.store.complete_versions(), "version 1 held", 10.0, every=0.01)
                write_checkpoint(store.root, key, run, 2, {"w": torch.full((4,), 2.0)}, 1 << 20)
                store.added()
                await asyncio.wait_for(follower.news.wait(), 5.0)
                await asyncio.wait_for(follower.sync(2), 10.0)  # while the background fetch of 2 is under way
                received = metrics.counter("node_weights_versions_received_total")
                async with follower.newest(1) as (newest, manifest):  # what an inference node loads
                    assert (newest, manifest.version) == (2, 2)
                return follower.store.complete_versions(), received, follower.announced
            finally:
                for task in tasks:
                    task.cancel()
                await asyncio.gather(*tasks, return_exceptions=True)

    held, received, announced = asyncio.run(main())
    assert held == [1, 2] and received == 2 and announced == 2


def test_a_validator_fetches_the_newest_version_and_an_older_one_only_for_a_batch_that_claims_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A validator is at home in a stripe and serves it: its work loop fetches the trainer's newest version only
    (walking through every version a rollout may claim kept its children 4-6 s behind after each burst of versions).
    A batch on an older version it does not hold is judged all the same: the judging fetches that version
    (``_hold``); a batch on a version newer than the trainer's record yet is judged once it arrives; a version no
    rollout may claim any more (more than ``async_level`` behind) is refused at once, with nothing fetched; and one
    this node prunes as it arrives (it keeps two versions here) is refused after one fetch, not fetched again and
    again until the wait ends."""
    key, me = Identity.generate(), _id("v")
    run = key.node_id
    monkeypatch.setattr(validator_node, "VERSION_WAIT_S", 10.0)
    spec = RunSpec(run_id=run, created=0.0, seed=0, model=ModelSpec(), train=TrainSpec(async_level=2))

    async def main() -> tuple[list[int], int, str, str, int, list[int]]:
        metrics = Metrics()
        async with _below_origin(tmp_path, run, me, metrics) as (store, follower, _):
            for version in (1, 2, 3, 4):
                write_checkpoint(store.root, key, run, version, {"w": torch.full((4,), float(version))}, 1 << 20)
            store.added()
            node = ValidatorNode(NodeConfig(data_dir=tmp_path / "v", run_id=run, peers=["/ip4/127.0.0.1/tcp/1"]))
            node.follower, node.store, node.spec, node.trainer_at = follower, follower.store, spec, (0, 4)
            await follower.sync(4)  # what the work loop fetches: the newest only
            await node._hold(3, spec)  # a batch made on version 3
            after_three = follower.store.complete_versions()
            with pytest.raises(Rejected) as stale:
                await node._hold(1, spec)  # 1 < 4 - async_level: no rollout may claim it
            received = metrics.counter("node_weights_versions_received_total")
            with pytest.raises(Rejected) as pruned:
                await asyncio.wait_for(node._hold(2, spec), 5.0)  # claimable, but older than the two kept
            fetches_of_two = metrics.counter("node_weights_versions_received_total") - received
            newer = asyncio.create_task(node._hold(5, spec))  # the trainer's record says 4 still
            await until(lambda: follower.fetching == 5, "the fetch of version 5 under way", 5.0, every=0.01)
            write_checkpoint(store.root, key, run, 5, {"w": torch.full((4,), 5.0)}, 1 << 20)
            store.added()
            await asyncio.wait_for(newer, 10.0)
            held = follower.store.complete_versions()
            return after_three, received, stale.value.reason, pruned.value.reason, fetches_of_two, held

    after_three, received, stale, pruned, fetches_of_two, held = asyncio.run(main())
    assert after_three == [3, 4] and received == 2 and stale == "version_unavailable"
    assert pruned == "version_unavailable" and fetches_of_two == 1
    assert held == [4, 5]  # the follower keeps two here


def test_a_parent_much_slower_than_another_source_is_left(tmp_path: Path) -> None:
    """After a fetch in which an alternate delivered far faster than the parent, the node moves below the
    alternate (if it has a slot) and gives its slot at the slow parent back."""
    me, slow, fast = _id("e"), _id("a"), _id("b")

    async def main() -> tuple[str | None, list[str], list[str], float]:
        s_slow, http_s, url_s = await _serve(tmp_path, "s", 1, [ORIGIN, slow], slow)
        s_fast, http_f, url_f = await _serve(tmp_path, "f", 2, [ORIGIN, fast], fast)
        records = {slow: _rec(slow, 1, 1, ORIGIN).model_copy(update={"http_url": url_s})}
        metrics = Metrics()
        try:
            async with aiohttp.ClientSession() as session:
                follower = _follower(tmp_path, me, records, metrics)
                follower.start(session)
                await follower.attachments.choose(await follower._records(), set())
                assert follower.parent == slow and s_slow.children() == [me]
                fetcher = follower.fetcher
                assert fetcher is not None
                fetcher.sources = {  # what the last fetch measured
                    slow: Source(slow, url_s, 1, is_parent=True, bps=0.5e6, ok=5),
                    fast: Source(fast, url_f, 1, bps=20e6, ok=4),
                }
                await follower.attachments.leave_slow_parent()
                await _settled(follower)  # the slot at the slow parent is given back in the background
                return (
                    follower.parent,
                    s_slow.children(),
                    s_fast.children(),
                    metrics.counter("node_relay_slow_parent_moves_total"),
                )
        finally:
            await http_s.close()
            await http_f.close()

    parent, slow_children, fast_children, moves = asyncio.run(main())
    assert parent == fast and slow_children == [] and fast_children == [me] and moves == 1


def test_a_peer_answering_attach_with_hostile_json_is_passed_over(tmp_path: Path) -> None:
    """Deeply nested JSON (json.loads raises RecursionError) or an oversized body from a would-be parent neither
    crashes the node nor makes it a parent: the node attaches to the origin instead."""
    me, nasty, huge = _id("e"), _id("c"), _id("d")

    async def main() -> str | None:
        async def nested(request: web.Request) -> web.Response:
            return web.Response(text="[" * 20_000 + "]" * 20_000, content_type="application/json")

        async def big(request: web.Request) -> web.Response:
            return web.Response(text='{"path": ["' + "x" * 1_000_000 + '"]}', content_type="application/json")

        http_n = HttpServer(Metrics(), lambda: {}, [web.post("/relay/attach", nested)])
        http_h = HttpServer(Metrics(), lambda: {}, [web.post("/relay/attach", big)])
        url_n = f"http://127.0.0.1:{await http_n.start('127.0.0.1', 0)}"
        url_h = f"http://127.0.0.1:{await http_h.start('127.0.0.1', 0)}"
        _, http_o, url_o = await _serve(tmp_path, "o", 2, [ORIGIN], ORIGIN)
        records = {
            ORIGIN: _rec(ORIGIN, 0, 2).model_copy(update={"http_url": url_o}),
            nasty: _rec(nasty, 1, 4, ORIGIN).model_copy(update={"http_url": url_n}),
            huge: _rec(huge, 1, 4, ORIGIN).model_copy(update={"http_url": url_h}),
        }
        try:
            async with aiohttp.ClientSession() as session:
                follower = _follower(tmp_path, me, records, Metrics())
                follower.start(session)
                await follower.attachments.choose(await follower._records(), set())
                return follower.parent
        finally:
            for h in (http_n, http_h, http_o):
                await h.close()

    assert asyncio.run(main()) == ORIGIN


@pytest.mark.integration
def test_relay_slots_are_for_signed_members_only(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The attacks on the old unauthenticated slots, each refused: made-up node ids (unsigned, or signed by a key
    the run does not know) taking slots; a stranger's DELETE evicting a real child; a captured request replayed;
    a stranger learning the children from a 503; anonymous long polls piling up."""
    child, stranger = _id("c"), _id("s")
    members = {child}

    async def is_member(node_id: str) -> bool:
        return node_id in members

    async def main() -> dict[str, object]:
        server = ShardServer(WeightStore(tmp_path / "o", ORIGIN), Metrics(), slots=1, node_id=ORIGIN, members=is_member)
        server.path = lambda: [ORIGIN]
        http = HttpServer(Metrics(), lambda: {}, server.routes())
        url = f"http://127.0.0.1:{await http.start('127.0.0.1', 0)}"
        out: dict[str, object] = {}
        try:
            async with aiohttp.ClientSession() as session:

                async def call(method: str, headers: dict[str, str]) -> tuple[int, str]:
                    async with session.request(method, f"{url}/relay/attach", headers=headers) as r:
                        return r.status, await r.text()

                out["made_up"] = await call("POST", {"X-Intellect-Node": "f" * 32})
                out["not_member"] = await call("POST", _signed(stranger, ORIGIN))
                out["for_another_server"] = await call("POST", _signed(child, _id("x")))
                granted = _signed(child, ORIGIN)
                out["child"] = (await call("POST", granted))[0]
                out["replayed"] = await call("POST", granted)
                evict = signed_headers(KEYS[stranger], "DELETE", "/relay/attach", ORIGIN)
                evict["X-Intellect-Node"] = child  # a stranger naming the child: the key does not match the id
                out["evict"] = (await call("DELETE", evict))[0]
                members.add(stranger)  # even a member cannot free another's slot, nor see who holds them
                out["own_delete"] = (
                    await call("DELETE", signed_headers(KEYS[stranger], "DELETE", "/relay/attach", ORIGIN))
                )[0]
                out["children"] = server.children()
                out["full_unsigned"] = await call("POST", {"X-Intellect-Node": stranger})
                monkeypatch.setattr(relay, "MAX_ANON_WAITS", 2)
                started = asyncio.get_running_loop().time()
                polls = [
                    asyncio.ensure_future(session.get(f"{url}/relay/next", params={"after": "5"})) for _ in range(3)
                ]
                first = await asyncio.wait(polls, return_when=asyncio.FIRST_COMPLETED)
                out["anon_poll_s"] = asyncio.get_running_loop().time() - started
                out["anon_status"] = [t.result().status for t in first[0]]
                for t in polls:
                    t.cancel()
        finally:
            await http.close()
        return out

    out = asyncio.run(main())
    assert out["made_up"] == (401, "unsigned")
    assert out["not_member"] == (403, "unregistered")
    assert out["for_another_server"] == (401, "bad_signature")
    assert out["child"] == 200
    assert out["replayed"] == (401, "replayed")
    assert out["evict"] == 401 and out["own_delete"] == 204 and out["children"] == [child]
    status, body = out["full_unsigned"]  # type: ignore[misc]
    assert status == 401 and child not in body
    assert out["anon_status"] == [204] and out["anon_poll_s"] < 5  # the third poll is answered at once


def test_a_parent_claiming_a_path_of_5000_nodes_is_left_not_believed(tmp_path: Path) -> None:
    """Such a path once made the node's next DHT record invalid (depth > 1024) and the exception killed it."""
    me, liar = _id("e"), _id("l")

    async def main() -> tuple[str | None, object]:
        granted: list[bool] = []

        async def attach(request: web.Request) -> web.Response:
            if granted:
                return web.json_response({"depth": 1, "path": [ORIGIN] + [liar] * 5000, "token": "t"})
            granted.append(True)
            return web.json_response({"depth": 1, "path": [ORIGIN, liar], "token": "t"})

        http_l = HttpServer(Metrics(), lambda: {}, [web.post("/relay/attach", attach)])
        url_l = f"http://127.0.0.1:{await http_l.start('127.0.0.1', 0)}"
        _, http_o, url_o = await _serve(tmp_path, "o", 2, [ORIGIN], ORIGIN)
        records = {
            ORIGIN: _rec(ORIGIN, 0, 2).model_copy(update={"http_url": url_o}),
            liar: _rec(liar, 1, 4, ORIGIN).model_copy(update={"http_url": url_l}),
        }
        try:
            async with aiohttp.ClientSession() as session:
                follower = _follower(tmp_path, me, records, Metrics())
                follower.start(session)
                await follower.attachments.choose(await follower._records(), set())
                assert follower.parent == liar
                for _ in range(3):  # three answers that hold no usable path: it looks elsewhere
                    await follower.attachments.attach_once(session)
                    follower.relay_info()  # the record it would publish stays valid throughout
                await _settled(follower)
                return follower.parent, follower.path
        finally:
            await http_l.close()
            await http_o.close()

    parent, path = asyncio.run(main())
    assert parent == ORIGIN and path == [ORIGIN, me]


def test_a_dead_childs_slot_goes_to_the_next_node_that_asks_a_live_childs_does_not(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A relay killed with SIGKILL cannot give its slot back: its subtree re-parents, but the full parent names the
    dead relay as the place to look until the slot expires. A child silent for CONTESTED_TTL_S loses the slot to
    a node that asks; one that keeps it alive does not, and a stranger's asking cannot evict it."""
    dead, live, newcomer = _id("d"), _id("l"), _id("n")
    clock = [1000.0]  # the relay's clock, moved by hand: silence is a number of seconds, not a wait
    monkeypatch.setattr(relay, "time", SimpleNamespace(monotonic=lambda: clock[0]))

    async def main() -> dict[str, object]:
        server, http, url = await _serve(tmp_path, "o", 1, [ORIGIN], ORIGIN)
        out: dict[str, object] = {}
        try:
            async with aiohttp.ClientSession() as session:

                async def ask(child: str) -> int:
                    async with session.post(f"{url}/relay/attach", headers=_signed(child, ORIGIN)) as r:
                        return r.status

                out["dead"] = await ask(dead)
                out["early"] = await ask(newcomer)  # the slot's holder spoke just now: no slot
                clock[0] += relay.CONTESTED_TTL_S + 0.1  # the holder falls silent
                out["after_silence"] = await ask(newcomer)
                out["children"] = server.children()
                out["dead_again"] = await ask(dead)  # it comes back: its slot went to another meanwhile
                out["live"] = await ask(live)  # newcomer spoke just now; it keeps its slot alive:
                for _ in range(3):
                    clock[0] += relay.CONTESTED_TTL_S * 2 / 3
                    out["kept"] = await ask(newcomer)
                    out["contested"] = await ask(live)
                out["children_end"] = server.children()
        finally:
            await http.close()
        return out

    out = asyncio.run(main())
    assert out["dead"] == 200 and out["early"] == 503 and out["after_silence"] == 200
    assert out["children"] == [newcomer] and out["dead_again"] == 503
    assert out["kept"] == 200 and out["contested"] == 503 and out["children_end"] == [newcomer]


def test_a_candidate_that_never_answers_does_not_hold_up_the_choice(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A partition sends no reset: a request to a cut-off node waits out its whole timeout. The best-ranked
    candidate here accepts connections and never answers (the timeout made a minute long); the node asks the
    next one after ASK_STAGGER_S, takes its slot, and gives back whatever the silent one may grant later."""
    me, silent = _id("e"), _id("z")
    monkeypatch.setattr("intellect_node.weights.links.ATTACH_TIMEOUT", aiohttp.ClientTimeout(total=60, connect=60))

    async def main() -> tuple[str | None, int, list[str]]:
        held: list[asyncio.StreamWriter] = []

        async def never_answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            held.append(writer)  # read nothing, answer nothing

        blackhole = await asyncio.start_server(never_answer, "127.0.0.1", 0)
        url_z = f"http://127.0.0.1:{blackhole.sockets[0].getsockname()[1]}"
        origin, http_o, url_o = await _serve(tmp_path, "o", 2, [ORIGIN], ORIGIN)
        records = {
            ORIGIN: _rec(ORIGIN, 0, 2).model_copy(update={"http_url": url_o}),
            silent: _rec(silent, 1, 2, ORIGIN).model_copy(update={"http_url": url_z}),
        }
        try:
            async with aiohttp.ClientSession() as session:
                follower = _follower(tmp_path, me, records, Metrics())
                follower.start(session)
                await asyncio.wait_for(follower.attachments.choose(await follower._records(), set()), 30)
                asked_silent = len(held)
                return follower.parent, asked_silent, origin.children()
        finally:
            for w in held:
                w.close()
            blackhole.close()
            await http_o.close()

    parent, asked_silent, origin_children = asyncio.run(main())
    assert asked_silent >= 1  # it was asked first...
    assert parent == ORIGIN and origin_children == [me]  # ...and did not hold the node up


def test_a_node_full_as_an_alternate_that_then_gives_a_slot_stays_the_parent(tmp_path: Path) -> None:
    """Seen in the relay-kill chaos run: the origin answered 503 to a shard request (no free slot: the dead relay
    held it), then gave the node a slot; the next fetch plan still counted it full, dropped the new parent as
    'failed to serve', and the node waited 2 s to ask again."""
    me = _id("e")

    async def main() -> tuple[str | None, str | None]:
        _, http_o, url_o = await _serve(tmp_path, "o", 2, [ORIGIN], ORIGIN)
        records = {ORIGIN: _rec(ORIGIN, 0, 2).model_copy(update={"http_url": url_o})}
        try:
            async with aiohttp.ClientSession() as session:
                follower = _follower(tmp_path, me, records, Metrics())
                follower.start(session)
                assert follower.fetcher is not None
                now = asyncio.get_running_loop().time()
                follower.fetcher.sources[ORIGIN] = Source(ORIGIN, url_o, 0, full=True, away_until=now + 60)
                await follower.attachments.choose(await follower._records(), set())
                chosen = follower.parent
                follower.fetcher._find = follower._find
                await follower.fetcher.refresh_now()  # the fetch's next plan
                await _settled(follower)
                return chosen, follower.parent
        finally:
            await http_o.close()

    chosen, kept = asyncio.run(main())
    assert chosen == ORIGIN and kept == ORIGIN


def test_a_node_with_a_parent_plans_its_sources_without_waiting_for_a_dht_read(tmp_path: Path) -> None:
    """Each version's fetch begins by planning its sources. With a parent in every stripe, a node plans with the
    records it has (they name alternates only) and reads them again in the background: a read on a busy DHT held
    up the first request of every version at every level of the tree (netns N=16: 0.7 to 2.0 s after the origin
    was ready; 0.5 to 1.4 s without it). A node without a parent still reads them first."""
    me, relay_id = _id("g"), _id("h")

    async def main() -> tuple[list[str], bool]:
        server, http, url = await _serve(tmp_path, "r", 2, [ORIGIN, relay_id], relay_id)
        dht = _Records(_records(_rec(ORIGIN, 0, 0), _rec(relay_id, 1, 2, ORIGIN).model_copy(update={"http_url": url})))
        follower = _follower(tmp_path, me, dht.records, Metrics())
        follower.membership = dht
        try:
            async with aiohttp.ClientSession() as session:
                follower.start(session)
                await follower._find(set())  # chooses the parent
                assert follower.parent == relay_id
                hung = asyncio.Event()

                async def get_nodes() -> dict[str, NodeRecord]:
                    hung.set()
                    await asyncio.Event().wait()  # a DHT that does not answer
                    return {}

                dht.get_nodes = get_nodes  # type: ignore[method-assign]
                follower._read_at -= 60.0  # the records are a minute old
                found = await asyncio.wait_for(follower._find(set()), 2.0)
                await asyncio.wait_for(hung.wait(), 2.0)  # the records are read again, in the background
                return [c.node_id for c in found], hung.is_set()
        finally:
            for task in list(follower._tasks):
                task.cancel()
            await http.close()

    found, read_again = asyncio.run(main())
    assert found == [relay_id, ORIGIN] and read_again
