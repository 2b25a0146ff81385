"""Who keeps a relay slot (weights/earned.py), with an attacker at the origin: keys of the run that take slots and
only send keep-alives, records that name made-up parents, a record claiming a huge upload. Real shard servers on
loopback, real signed slot requests from keys the origin counts as members, a real follower for the honest node;
trust is the trainer's Admission (past probation or not)."""

from __future__ import annotations

import asyncio
import contextlib
from pathlib import Path
from types import SimpleNamespace

import aiohttp
import pytest
import torch

from intellect_node.p2p.http import HttpServer
from intellect_node.p2p.metrics import Metrics
from intellect_node.roles.admission import Admission
from intellect_node.weights import earned, relay
from intellect_node.weights.auth import signed_headers
from intellect_node.weights.earned import Earned, vouched
from intellect_node.weights.files import write_checkpoint
from intellect_node.weights.follower import WeightFollower
from intellect_node.weights.relay import ShardServer
from intellect_node.weights.store import WeightStore
from intellect_node.weights.stripes import announced_home
from intellect_protocol.identity import Identity
from intellect_protocol.messages import AdmissionSpec, NodeRecord, RelayInfo
from tests.helpers.keys import Keys
from tests.helpers.wait import until

RUN_KEY = Identity.generate()
RUN = RUN_KEY.node_id
MBIT = 1e6 / 8
KEYS = Keys()


def _publish(root: Path, version: int, shards: int = 4) -> None:
    tensors = {f"t{i}": torch.full((4096,), float(version + i)) for i in range(shards)}
    write_checkpoint(root, RUN_KEY, RUN, version, tensors, shard_bytes=4096 * 4)


def _rec(
    nid: str,
    parent: str | None = None,
    version: int = 1,
    role: str = "relay",
    url: str = "",
    bps: float = 0.0,
    stripes: int = 1,
    home: int = 0,
) -> NodeRecord:
    relay_info = RelayInfo(
        stripe=home,
        depth=0 if nid == RUN else 1,
        parent=parent,
        slots_total=4,
        slots_free=4,
        upload_bps=bps,
        stripes=stripes,
        versions=[version] if version >= 0 else [],
    )
    return NodeRecord(
        run_id=RUN,
        node_id=nid,
        role=role,
        updated=0.0,
        weight_version=version,  # type: ignore[arg-type]
        http_url=url or f"http://{nid[:4]}",
        relay=relay_info,
    )


class _Trust:
    """The trainer's side: its Admission (probation_batches 2), the records it read, who it counts as a member."""

    def __init__(self) -> None:
        self.admission = Admission(AdmissionSpec(probation_batches=2), RUN)
        self.records: dict[str, NodeRecord] = {}
        self.members: set[str] = set()

    def past_probation(self, node: str) -> None:
        for _ in range(2):
            self.admission.batch_passed(node)

    def trusted(self, node: str) -> bool:
        return not self.admission.on_probation(node)

    async def is_member(self, node: str) -> bool:
        return node in self.members

    def earned(self) -> Earned:
        return Earned(self.trusted, lambda: self.records, RUN, lambda: 0)


async def _origin(root: Path, slots: int, stripes: int, trust: _Trust) -> tuple[ShardServer, HttpServer, str]:
    """The trainer's origin as trainer.py wires it: members and earned from the trainer's view."""
    server = ShardServer(WeightStore(root, RUN), Metrics(), slots=slots, node_id=RUN, members=trust.is_member)
    server.path, server.stripes = (lambda: [RUN]), stripes
    server.earned = trust.earned()
    server.home_of = lambda n: announced_home(trust.records, n)
    http = HttpServer(Metrics(), lambda: {}, server.routes())
    return server, http, f"http://127.0.0.1:{await http.start('127.0.0.1', 0)}"


async def _ask(session: aiohttp.ClientSession, url: str, node: str, query: str) -> tuple[int, object]:
    """A signed slot request (or keep-alive) of ``node``: the status and the JSON body."""
    where = f"/relay/attach?{query}"
    async with session.post(url + where, headers=signed_headers(KEYS[node], "POST", where, RUN)) as r:
        body = await r.json() if r.content_type == "application/json" else None
        return r.status, body


async def _fetch_shard(session: aiohttp.ClientSession, url: str, root: Path, node: str, token: str) -> int:
    """``node`` fetches the first shard of version 1 through the slot ``token`` names: the status."""
    heads = {"X-Intellect-Node": node, "X-Intellect-Token": token}
    shard = WeightStore(root, RUN).manifest(1).shards[0].name  # type: ignore[union-attr]
    async with session.get(f"{url}/weights/1/{shard}", headers=heads) as r:
        await r.read()
        return r.status


class _Records:
    def __init__(self, records: dict[str, NodeRecord]) -> None:
        self.records = records

    async def get_nodes(self) -> dict[str, NodeRecord]:
        return self.records


def _follower(root: Path, me: str, records: dict[str, NodeRecord]) -> WeightFollower:
    async def publish() -> None:
        return None

    return WeightFollower(
        KEYS[me],
        RUN,
        _Records(records),
        WeightStore(root, RUN),
        Metrics(),
        None,
        2,
        None,
        publish,
    )  # type: ignore[arg-type]


async def _squat(session: aiohttp.ClientSession, url: str, keys: list[str], stripes: int) -> None:
    """The attacker: every key asks for (or keeps) a slot in every stripe once a second, and fetches nothing."""
    while True:
        for key in keys:
            for s in range(stripes):
                await _ask(session, url, key, f"stripe={s}")
        await asyncio.sleep(relay.CONTESTED_TTL_S / 4)  # its keep-alive period: well within the silence allowed


def test_squatters_holding_every_origin_slot_cannot_keep_an_earned_node_out(tmp_path: Path) -> None:
    """Five member keys on probation take the origin's slot in both stripes before anyone else and keep them with
    keep-alives. A node past probation asks: it takes a squatter's slot in each stripe at once, keeps it against
    their asking, and receives the version through them."""
    trust = _Trust()
    squatters, honest = [KEYS.new() for _ in range(5)], KEYS.new()
    trust.members |= {*squatters, honest}
    trust.past_probation(honest)
    _publish(tmp_path / "o", 1)

    async def main() -> tuple[dict[int, str | None], list[int], list[str]]:
        server, http, url = await _origin(tmp_path / "o", slots=2, stripes=2, trust=trust)
        records = {RUN: _rec(RUN, role="trainer", url=url, stripes=2)}
        follower = _follower(tmp_path / "e", honest, records)
        try:
            async with aiohttp.ClientSession() as session:
                for key in squatters:
                    for s in range(2):
                        await _ask(session, url, key, f"stripe={s}")
                assert server.slots_free() == 0 and honest not in server.children()  # every slot squatted
                attacker = asyncio.create_task(_squat(session, url, squatters, 2))
                follower.start(session)
                keeping = asyncio.create_task(follower.keep_attached(session))
                try:
                    with contextlib.suppress(TimeoutError):  # a slot in every stripe, in bounded time
                        await until(
                            lambda: follower._planned and all(follower.parents().values()),
                            "a parent in every stripe",
                            10.0,
                            every=0.02,
                        )
                    if all(follower.parents().values()):
                        await asyncio.wait_for(follower.sync(1), 30.0)
                    return follower.parents(), follower.store.complete_versions(), server.children()
                finally:
                    for task in (attacker, keeping):
                        task.cancel()
                        with contextlib.suppress(asyncio.CancelledError):
                            await task
                    for task in list(follower._tasks):
                        task.cancel()
        finally:
            await http.close()

    parents, held, children = asyncio.run(main())
    assert parents == {0: RUN, 1: RUN} and held == [1]
    assert honest in children


def test_an_unearned_newcomer_still_gets_the_version_while_squatters_hold_every_slot(tmp_path: Path) -> None:
    """Nobody has earned anything (a new swarm, or one the attacker got to first): squatters on probation hold
    every slot, and a newcomer on probation, that cannot move them, still receives the version from the origin's
    idle upload (relay.py: alternates are served while no child is being sent anything)."""
    trust = _Trust()
    squatters, newcomer = [KEYS.new() for _ in range(3)], KEYS.new()
    trust.members |= {*squatters, newcomer}
    _publish(tmp_path / "o", 1)

    async def main() -> tuple[list[int], list[str]]:
        server, http, url = await _origin(tmp_path / "o", slots=2, stripes=2, trust=trust)
        follower = _follower(tmp_path / "n", newcomer, {RUN: _rec(RUN, role="trainer", url=url, stripes=2)})
        try:
            async with aiohttp.ClientSession() as session:
                attacker = asyncio.create_task(_squat(session, url, squatters, 2))
                try:
                    await until(lambda: server.slots_free() == 0, "every slot taken", 10.0, every=0.02)
                    follower.start(session)
                    await asyncio.wait_for(follower.sync(1), 60.0)
                    return follower.store.complete_versions(), server.children()
                finally:
                    attacker.cancel()
                    with contextlib.suppress(asyncio.CancelledError):
                        await attacker
                    for task in list(follower._tasks):
                        task.cancel()
        finally:
            await http.close()

    held, children = asyncio.run(main())
    assert held == [1] and newcomer not in children


def test_a_child_that_never_fetches_loses_its_slot_after_the_grace(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Keep-alives alone keep no slot. A child that says it is fetching version 1, which the origin holds, and
    fetches nothing, keeps its slot against a node that asks only for FEED_GRACE_S, then loses it to it. The new
    child fetches a shard and keeps its slot past the grace; when version 2 arrives and it fetches none of it, it
    loses the slot in turn."""
    squatter, contender, third = KEYS.new(), KEYS.new(), KEYS.new()
    trust = _Trust()
    trust.members |= {squatter, contender, third}
    root = tmp_path / "o"
    _publish(root, 1)
    clock = [1000.0]  # the origin's clock, moved by hand: a grace is a number of seconds, not a wait
    monkeypatch.setattr(relay, "time", SimpleNamespace(monotonic=lambda: clock[0]))
    step = relay.CONTESTED_TTL_S * 3 / 4  # keep-alives this far apart: never silent

    async def main() -> dict[str, object]:
        server, http, url = await _origin(root, slots=1, stripes=1, trust=trust)
        out: dict[str, object] = {}
        try:
            async with aiohttp.ClientSession() as session:

                async def wait_out_grace(holder: str) -> None:
                    start = clock[0]
                    while clock[0] - start < earned.FEED_GRACE_S + step:
                        clock[0] += step
                        assert (await _ask(session, url, holder, "stripe=0"))[0] == 200  # its keep-alive

                out["squat"] = (await _ask(session, url, squatter, "stripe=0&v=1&have=0"))[0]
                out["early"] = (await _ask(session, url, contender, "stripe=0&v=1&have=0"))[0]
                await wait_out_grace(squatter)
                status, body = await _ask(session, url, contender, "stripe=0&v=1&have=0")
                out["after_grace"] = status
                out["squatter_kept"] = (await _ask(session, url, squatter, "stripe=0"))[0]
                out["children"] = server.children()
                if status != 200 or not isinstance(body, dict):
                    return out
                out["fetch"] = await _fetch_shard(session, url, root, contender, body["token"])
                await wait_out_grace(contender)
                out["fed_kept"] = (await _ask(session, url, third, "stripe=0&v=1&have=0"))[0]
                _publish(root, 2)  # a new version: the child fetches none of it
                server.store.added()
                await wait_out_grace(contender)
                out["unfed_v2"] = (await _ask(session, url, third, "stripe=0&v=2&have=0"))[0]
                out["children_end"] = server.children()
        finally:
            await http.close()
        return out

    out = asyncio.run(main())
    assert out["squat"] == 200 and out["early"] == 503
    assert out["after_grace"] == 200 and out["squatter_kept"] == 503 and out["children"] == [contender]
    assert out["fetch"] == 200 and out["fed_kept"] == 503
    assert out["unfed_v2"] == 200 and out["children_end"] == [third]


def test_a_503_names_no_child_that_has_not_earned_its_place(tmp_path: Path) -> None:
    """The origin is full: a relay on probation (relays produce no batches) that a node past probation names as
    its parent, and a squatter whose records name a made-up child of its own (a key on probation). A newcomer
    refused a slot is told to ask the relay, never the squatter."""
    trust = _Trust()
    relay_node, receiver, squatter, sybil, newcomer = (KEYS.new() for _ in range(5))
    trust.members |= {relay_node, squatter, newcomer}
    trust.past_probation(receiver)
    trust.records.update(
        {
            relay_node: _rec(relay_node, parent=RUN),
            receiver: _rec(receiver, parent=relay_node, role="inference"),
            squatter: _rec(squatter, parent=RUN),
            sybil: _rec(sybil, parent=squatter),
        }
    )
    _publish(tmp_path / "o", 1)

    async def main() -> tuple[list[int], int, object, list[str]]:
        server, http, url = await _origin(tmp_path / "o", slots=2, stripes=1, trust=trust)
        try:
            async with aiohttp.ClientSession() as session:
                held = [(await _ask(session, url, n, "stripe=0"))[0] for n in (relay_node, squatter)]
                status, body = await _ask(session, url, newcomer, "stripe=0")
                return held, status, body, server.children()
        finally:
            await http.close()

    held, status, body, children = asyncio.run(main())
    assert held == [200, 200] and children == sorted([relay_node, squatter])
    assert status == 503 and body == {"children": [relay_node]}


def test_a_503_names_a_child_that_receives_through_its_slot_though_nobody_earned_one(tmp_path: Path) -> None:
    """A swarm of relays alone, where nobody is past probation: the origin is full with a relay that fetched a
    shard through its slot and a squatter that fetched nothing. A node refused a slot is told to ask the relay
    (whose leaf slots a node at home in the stripe may take), never the squatter. Before, the 503 named nobody, and
    two relays at home in a stripe whose only serving node was full never found a parent there."""
    trust = _Trust()
    relay_node, squatter, newcomer = (KEYS.new() for _ in range(3))
    trust.members |= {relay_node, squatter, newcomer}
    trust.records.update({relay_node: _rec(relay_node, parent=RUN), squatter: _rec(squatter, parent=RUN)})
    root = tmp_path / "o"
    _publish(root, 1)

    async def main() -> tuple[list[int], int, int, object]:
        server, http, url = await _origin(root, slots=2, stripes=1, trust=trust)
        try:
            async with aiohttp.ClientSession() as session:
                status, body = await _ask(session, url, relay_node, "stripe=0&v=1&have=0")
                held = [status, (await _ask(session, url, squatter, "stripe=0"))[0]]
                assert isinstance(body, dict)
                fetched = await _fetch_shard(session, url, root, relay_node, body["token"])
                status, body = await _ask(session, url, newcomer, "stripe=0")
                return held, fetched, status, body
        finally:
            await http.close()

    held, fetched, status, body = asyncio.run(main())
    assert held == [200, 200] and fetched == 200
    assert status == 503 and body == {"children": [relay_node]}


def test_a_relay_at_home_in_a_stripe_whose_origin_slot_a_leaf_holds_becomes_its_root(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The origin has one slot per stripe; a node past probation, at home in stripe 1, holds stripe 0's as a leaf, so
    stripe 0 has no root. A relay at home in stripe 0 (relays produce nothing: it has earned nothing) takes that slot;
    the earned leaf asking again at once (before the relay fetched anything) is sent to the relay, not given its slot
    back. Past relay.ROOT_TRIAL_S the relay, still unearned, is a child like any, and the leaf asking again takes the
    slot back; the relay may not root the stripe again within relay.ROOT_RETRY_S. Before, an earned leaf's slot never
    went to a node that had not earned one: the red team's relay never got a parent in its home stripe all run."""
    trust = _Trust()
    leaf, relay_node, other = KEYS.new(), KEYS.new(), KEYS.new()
    trust.members |= {leaf, relay_node, other}
    trust.past_probation(leaf)
    trust.records.update(
        {
            leaf: _rec(leaf, parent=RUN, role="inference", home=1, stripes=2),
            relay_node: _rec(relay_node, home=0, stripes=2),
            other: _rec(other, home=1, stripes=2),
        }
    )
    root = tmp_path / "o"
    _publish(root, 1)
    clock = [1000.0]  # the origin's clock, moved by hand: a trial is a number of seconds, not a wait
    monkeypatch.setattr(relay, "time", SimpleNamespace(monotonic=lambda: clock[0]))

    async def main() -> dict[str, object]:
        server, http, url = await _origin(root, slots=2, stripes=2, trust=trust)
        out: dict[str, object] = {}
        try:
            async with aiohttp.ClientSession() as session:
                out["leaf"] = (await _ask(session, url, leaf, "stripe=0&home=0"))[0]
                out["other"] = (await _ask(session, url, other, "stripe=1"))[0]
                status, body = await _ask(session, url, relay_node, "stripe=0&v=1&have=0")
                out["relay"] = status
                out["children"] = server.children()
                out["leaf_at_once"] = await _ask(session, url, leaf, "stripe=0&home=0&v=1&have=0")
                if status != 200 or not isinstance(body, dict):
                    return out
                out["fetch"] = await _fetch_shard(session, url, root, relay_node, body["token"])
                out["rooted"] = server.metrics.counter("node_relay_rootless_stripes_rooted_total")
                start = clock[0]
                while clock[0] - start < relay.ROOT_TRIAL_S + 1:  # keep-alives: nobody falls silent meanwhile
                    clock[0] += relay.CONTESTED_TTL_S / 2
                    for node, query in ((relay_node, "stripe=0"), (other, "stripe=1")):
                        assert (await _ask(session, url, node, query))[0] == 200
                out["leaf_after_trial"] = (await _ask(session, url, leaf, "stripe=0&home=0&v=1&have=0"))[0]
                out["relay_again"] = (await _ask(session, url, relay_node, "stripe=0&v=1&have=1"))[0]
                out["end"] = server.children()
        finally:
            await http.close()
        return out

    out = asyncio.run(main())
    assert out["leaf"] == 200 and out["other"] == 200
    assert out["relay"] == 200 and out["children"] == sorted([relay_node, other])
    assert out["leaf_at_once"] == (503, {"children": [relay_node]})
    assert out["fetch"] == 200 and out["rooted"] == 1
    assert out["leaf_after_trial"] == 200 and out["relay_again"] == 503
    assert out["end"] == sorted([leaf, other])


def test_keys_at_home_that_serve_nobody_hold_a_stripes_origin_slot_a_trial_at_most(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The root rule is no squatter's door. A key whose record says it is at home in stripe 0 takes the earned leaf's
    slot there and fetches nothing: the leaf is refused for relay.ROOT_TRIAL_S, then takes the slot back. Neither
    that key nor another at home in the stripe (keys are free) roots the stripe again within relay.ROOT_RETRY_S,
    and a second key asking while the first holds the slot finds the stripe rooted."""
    trust = _Trust()
    leaf, squatter, sybil = KEYS.new(), KEYS.new(), KEYS.new()
    trust.members |= {leaf, squatter, sybil}
    trust.past_probation(leaf)
    trust.records.update(
        {
            leaf: _rec(leaf, parent=RUN, role="inference", home=1, stripes=2),
            squatter: _rec(squatter, home=0, stripes=2),
            sybil: _rec(sybil, home=0, stripes=2),
        }
    )
    _publish(tmp_path / "o", 1)
    clock = [1000.0]
    monkeypatch.setattr(relay, "time", SimpleNamespace(monotonic=lambda: clock[0]))

    async def main() -> list[object]:
        server, http, url = await _origin(tmp_path / "o", slots=2, stripes=2, trust=trust)
        try:
            async with aiohttp.ClientSession() as session:
                seen: list[object] = [(await _ask(session, url, leaf, "stripe=0&home=0"))[0]]
                for node, query in ((squatter, "stripe=0"), (leaf, "stripe=0&home=0"), (sybil, "stripe=0")):
                    seen += [(await _ask(session, url, node, query))[0]]
                seen.append(server.children())
                start = clock[0]
                while clock[0] - start < relay.ROOT_TRIAL_S + 1:
                    clock[0] += relay.CONTESTED_TTL_S / 2
                    assert (await _ask(session, url, squatter, "stripe=0"))[0] == 200
                for node, query in ((leaf, "stripe=0&home=0"), (squatter, "stripe=0"), (sybil, "stripe=0")):
                    seen += [(await _ask(session, url, node, query))[0]]
                seen.append(server.children())
                return seen
        finally:
            await http.close()

    seen = asyncio.run(main())
    assert seen == [200, 200, 503, 503, [squatter], 200, 503, 503, [leaf]]


def test_a_record_claiming_a_huge_upload_does_not_change_the_origins_plan(tmp_path: Path) -> None:
    """The origin sizes its slots from its own measured upload (250 Mbit/s here): sixteen records of 25 Mbit/s,
    the same with one claiming 10 Gbit/s, and 64 records claiming 1 byte/s all give the same plan."""
    honest = {n: _rec(n, bps=25 * MBIT, stripes=4) for n in (KEYS.new() for _ in range(16))}
    liar = KEYS.new()
    huge = {**dict(list(honest.items())[:15]), liar: _rec(liar, bps=1.25e9, stripes=4)}
    tiny = {n: _rec(n, bps=1.0, stripes=4) for n in (KEYS.new() for _ in range(64))}
    tiny_and_honest = {**honest, **dict(list(tiny.items())[:48])}  # as many records as ``tiny``

    async def main() -> list[int]:
        server, http, _ = await _origin(tmp_path / "o", slots=4, stripes=4, trust=_Trust())
        server.upload_bps = lambda: 250 * MBIT  # type: ignore[method-assign]  # as its meter measured it
        try:
            return [server.origin_info(r, [1], None).slots_total for r in (honest, huge, tiny, tiny_and_honest)]
        finally:
            await http.close()

    plans = asyncio.run(main())
    assert plans[0] == plans[1] >= 4 and plans[2] == plans[3] >= 4, plans


def test_a_trusted_node_vouches_for_one_node_the_origins_child_above_it() -> None:
    """``vouched``: the records' parent fields, followed from each trusted node that holds a version of the epoch
    up to the origin, name the origin's child it hangs from; nothing else is vouched for."""
    relay1, relay2, inference, lone, chain_top, s1, s2, sybil, stale, c1, c2 = (KEYS.new() for _ in range(11))
    colluder, looped = KEYS.new(), KEYS.new()
    trusted = {inference, lone, stale, colluder, looped}
    records = {
        relay1: _rec(relay1, parent=RUN),
        relay2: _rec(relay2, parent=relay1),
        inference: _rec(inference, parent=relay2),  # honest: origin -> relay1 -> relay2 -> inference
        lone: _rec(lone, parent=RUN),  # the origin's own child: vouches for nobody
        chain_top: _rec(chain_top, parent=RUN),
        s1: _rec(s1, parent=chain_top),
        s2: _rec(s2, parent=s1),
        colluder: _rec(colluder, parent=s2),  # a trusted colluder below a chain of made-up records: one vouch
        sybil: _rec(sybil, parent=lone),  # not trusted: vouches for nobody
        stale: _rec(stale, parent=relay2, version=-1),  # holds no version
        c1: _rec(c1, parent=c2),
        c2: _rec(c2, parent=c1),
        looped: _rec(looped, parent=c1),  # a cycle
    }
    assert vouched(records, trusted.__contains__, RUN, 0) == {relay1, chain_top}
    assert vouched(records, trusted.__contains__, RUN, 1) == set()  # records of another epoch's weights
