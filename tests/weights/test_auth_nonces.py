"""The replay table of signed slot requests: a stranger leaves nothing in it, a member only a bounded share.

Played over real HTTP on loopback: the attacker signs correct requests with keys the run does not know (or with
one key it does), as fast as the server lets it.
"""

from __future__ import annotations

import asyncio
from unittest import mock

import aiohttp
from aiohttp import web

from intellect_node.weights import auth
from intellect_node.weights.auth import AUTH_WINDOW_S, NONCES_PER_KEY, Refused, RequestAuth, signed_headers
from intellect_protocol.identity import Identity

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
    runner = web.AppRunner(app)
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
