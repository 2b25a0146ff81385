"""The replay table of signed slot requests: a stranger leaves nothing in it, a member only a bounded share, and a
child keeping its slots alive is never refused.

Played over real HTTP on loopback: the attacker signs correct requests with keys the run does not know (or with
one key it does), as fast as the server lets it; the child is the real follower, attached to a real origin.
"""

from __future__ import annotations

import asyncio
import contextlib
from pathlib import Path
from unittest import mock

import aiohttp
import pytest
from aiohttp import web

from intellect_node.p2p.http import HttpServer, Tarpit
from intellect_node.p2p.metrics import Metrics
from intellect_node.weights import auth
from intellect_node.weights.auth import (
    AUTH_WINDOW_S,
    CHILD_HEADER,
    NONCES_PER_KEY,
    Refused,
    RequestAuth,
    signed_headers,
)
from intellect_node.weights.follower import WeightFollower
from intellect_node.weights.links import Link
from intellect_node.weights.relay import ShardServer
from intellect_node.weights.store import WeightStore
from intellect_protocol.identity import Identity
from intellect_protocol.messages import NodeRecord, RelayInfo

SERVER = Identity.generate().node_id
PATH = "/relay/attach"


async def _serve(checker: RequestAuth) -> tuple[web.AppRunner, str]:
    async def attach(request: web.Request) -> web.Response:
        try:
            return web.Response(text=await checker.check(request))
        except Refused as e:
            raise e.http() from None

    app = web.Application()
    app.router.add_post(PATH, attach)
    runner = web.AppRunner(app, shutdown_timeout=0.5)  # answers held in a tarpit are cut off at cleanup
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    return runner, f"http://127.0.0.1:{port}{PATH}"


async def _send(session: aiohttp.ClientSession, url: str, key: Identity) -> tuple[int, str]:
    async with session.post(url, headers=signed_headers(key, "POST", PATH, SERVER)) as r:
        return r.status, await r.text()


def test_a_strangers_correctly_signed_requests_leave_no_nonce_behind() -> None:
    member = Identity.generate()

    async def members(node_id: str) -> bool:
        return node_id == member.node_id

    async def scenario() -> tuple[list[int], int, int]:
        checker = RequestAuth(SERVER, members)
        runner, url = await _serve(checker)
        try:
            async with aiohttp.ClientSession() as session:
                answers = [await _send(session, url, Identity.generate()) for _ in range(80)]
                strangers_left = len(checker._nonces)
                assert (await _send(session, url, member))[0] == 200
                return [status for status, _ in answers], strangers_left, len(checker._nonces)
        finally:
            await runner.cleanup()

    statuses, strangers_left, after_member = asyncio.run(scenario())
    assert set(statuses) == {403}  # every one refused as not of the run ...
    assert strangers_left == 0  # ... and none of them kept: the table holds members' requests only
    assert after_member == 1


def test_slot_requests_past_the_address_rate_are_held_then_closed_before_any_signature_is_checked() -> None:
    """A flood of slot requests past RATE_PER_ADDRESS is refused before its signature costs anything, and the
    refusal is held (a stranger's flood answered at once asked again at once: 69,487 refusals in 60 s in the red
    team's run); past the bound on held answers the refusal closes its connection."""

    async def scenario() -> tuple[list[str], int]:
        with mock.patch.object(auth, "RATE_PER_ADDRESS", 0.001):
            checker = RequestAuth(SERVER, None)  # its buckets take the rate when made
        checker.tarpit = Tarpit(hold_s=60.0, per_source=2)
        verified = 0
        real_verify = auth.verify

        def counting(*args: object) -> bool:
            nonlocal verified
            verified += 1
            return real_verify(*args)  # type: ignore[arg-type]

        runner, url = await _serve(checker)
        held: list[asyncio.Task[tuple[int, str]]] = []
        try:
            with mock.patch.object(auth, "verify", counting):
                async with aiohttp.ClientSession() as session:

                    async def ask() -> str:
                        async with session.post(
                            url, headers=signed_headers(Identity.generate(), "POST", PATH, SERVER)
                        ) as r:
                            assert r.status == 429 and r.headers["Retry-After"] == "1"
                            return "close" if r.headers.get("Connection", "").lower() == "close" else "held"

                    held = [asyncio.create_task(_send(session, url, Identity.generate())) for _ in range(2)]
                    while checker.tarpit.holding < 2:
                        await asyncio.sleep(0.01)
                    past = [await ask() for _ in range(3)]
                    still_held = sum(not t.done() for t in held)
        finally:
            await runner.cleanup()
            await asyncio.gather(*held, return_exceptions=True)
        return past + [str(still_held)], verified

    answers, verified = asyncio.run(scenario())
    assert answers == ["close", "close", "close", "2"]
    assert verified == 0


def test_one_member_key_keeps_a_bounded_share_of_the_table() -> None:
    member = Identity.generate()

    async def members(node_id: str) -> bool:
        return True

    async def scenario() -> tuple[list[int], int]:
        checker = RequestAuth(SERVER, members)
        runner, url = await _serve(checker)
        try:
            async with aiohttp.ClientSession() as session:
                statuses = [(await _send(session, url, member))[0] for _ in range(NONCES_PER_KEY + 10)]
                return statuses, len(checker._nonces)
        finally:
            await runner.cleanup()

    statuses, kept = asyncio.run(scenario())
    assert statuses[:NONCES_PER_KEY] == [200] * NONCES_PER_KEY
    assert set(statuses[NONCES_PER_KEY:]) == {429}  # past its share within the window: refused, not kept
    assert kept == NONCES_PER_KEY


def test_nonces_leave_the_table_once_older_than_the_replay_window() -> None:
    checker = RequestAuth(SERVER, None)
    clock = [1_000_000.0]
    with mock.patch.object(auth.time, "time", lambda: clock[0]):
        for i in range(NONCES_PER_KEY):
            checker._keep("a", f"{i:016x}", clock[0])
        assert len(checker._nonces) == NONCES_PER_KEY
        clock[0] += 2 * AUTH_WINDOW_S + 1
        checker._keep("b", "0" * 16, clock[0])  # each new nonce first drops the expired ones, oldest first
    assert list(checker._nonces) == [("b", "0" * 16)]
    assert dict(checker._per_key) == {"b": 1}


class _Records:
    def __init__(self, records: dict[str, NodeRecord]) -> None:
        self.records = records

    async def get_nodes(self) -> dict[str, NodeRecord]:
        return self.records


@pytest.mark.integration
def test_a_child_of_the_origin_in_three_stripes_asking_in_the_fourth_keeps_its_slots_through_the_window(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The origin serves a child in every stripe it has a slot for, and the child keeps each slot alive every second
    and asks every second for one in the stripe where it has none: four signed requests a second from one key,
    three of them keep-alives. Counted as one allowance, sized for asking, they were refused within 16 s: the child
    left the origin in every stripe and was refused for the rest of the replay window (the red-team swarm's new relay
    fetched nothing for 30 s). The real follower here keeps its three slots through more than a whole window of
    keep-alives: the window is shortened to 24 s (from 60 s), still longer than the 16 s the shared allowance lasted,
    so the test takes half a minute instead of over a minute."""
    monkeypatch.setattr(auth, "AUTH_WINDOW_S", 12.0)  # nonces are remembered for twice this
    run, me = Identity.generate(), Identity.generate()
    stripes = 4
    goal = NONCES_PER_KEY * 3 // 2  # past the allowance for asking one and a half times: 32 s at three a second

    async def main() -> tuple[int, list[int], dict[int, str | None]]:
        metrics = Metrics()
        origin = ShardServer(
            WeightStore(tmp_path / "origin", run.node_id), metrics, slots=stripes - 1, node_id=run.node_id
        )
        origin.stripes, origin.path = stripes, lambda: [run.node_id]
        kept = 0
        attach = origin._attach

        async def counted(request: web.Request) -> web.Response:
            nonlocal kept
            answer = await attach(request)  # a refusal raises
            kept += request.headers.get(CHILD_HEADER) == me.node_id
            return answer

        origin._attach = counted  # type: ignore[method-assign]
        http = HttpServer(metrics, lambda: {}, origin.routes())
        url = f"http://127.0.0.1:{await http.start('127.0.0.1', 0)}"
        relay = RelayInfo(depth=0, slots_total=stripes - 1, slots_free=stripes - 1, stripes=stripes)
        records = {
            run.node_id: NodeRecord(
                run_id=run.node_id, node_id=run.node_id, role="trainer", updated=0.0, http_url=url, relay=relay
            )
        }
        follower = WeightFollower(
            me,
            run.node_id,
            _Records(records),
            WeightStore(tmp_path / "me", run.node_id),  # type: ignore[arg-type]
            Metrics(),
            None,
            2,
            None,
            lambda: asyncio.sleep(0),
        )
        left: list[int] = []
        drop = follower.attachments.drop_parent

        async def dropped(why: str, avoid_s: float, link: Link | None = None) -> None:
            left.append(link.stripe if link is not None else -1)
            await drop(why, avoid_s, link)

        follower.attachments.drop_parent = dropped  # type: ignore[method-assign]
        try:
            async with aiohttp.ClientSession() as session:
                follower.start(session)
                keeping = asyncio.ensure_future(follower.keep_attached(session))
                try:
                    loop = asyncio.get_running_loop()
                    deadline = loop.time() + 300.0
                    while kept < goal and not left and loop.time() < deadline:
                        await asyncio.sleep(0.2)
                    return kept, left, follower.parents()
                finally:
                    keeping.cancel()
                    with contextlib.suppress(asyncio.CancelledError):
                        await keeping
        finally:
            await http.close()

    kept, left, parents = asyncio.run(main())
    assert left == [], (kept, left)
    assert kept >= goal
    assert sorted(parents.values(), key=lambda p: p or "") == [None, run.node_id, run.node_id, run.node_id]
