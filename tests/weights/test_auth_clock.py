"""A node whose clock is off signs relay requests in its parent's time (issue 13, a clock 60 s off): without the
correction its attach falls outside the 30 s window and it could never get a parent."""

from __future__ import annotations

import asyncio
import email.utils
import time
from unittest import mock

import pytest
from aiohttp import web
from aiohttp.test_utils import make_mocked_request

from intellect_node.weights import auth
from intellect_node.weights.auth import Refused, RequestAuth, server_clock_offset, signed_headers
from intellect_protocol.identity import Identity

SERVER = Identity.generate().node_id


def _request(headers: dict[str, str]) -> web.Request:
    return make_mocked_request("POST", "/relay/attach", headers=headers)


def test_a_clock_60s_ahead_is_refused_until_it_signs_in_the_servers_time() -> None:
    asyncio.run(_clock_60s_ahead())


async def _clock_60s_ahead() -> None:
    key = Identity.generate()
    server = RequestAuth(SERVER, None)
    real = time.time
    with mock.patch.object(auth.time, "time", lambda: real() + 60):  # the child's clock
        skewed = signed_headers(key, "POST", "/relay/attach", SERVER)
    with pytest.raises(Refused) as refused:
        await server.check(_request(skewed))
    assert refused.value.reason == "clock"

    # the server's answer carries its time; the child learns how far ahead it is
    offset = server_clock_offset(email.utils.formatdate(real(), usegmt=True))
    assert offset is not None and abs(offset) < 2
    with mock.patch.object(auth.time, "time", lambda: real() + 60):
        learned = offset - 60  # server time minus the child's time, as the child measures it
        fixed = signed_headers(key, "POST", "/relay/attach", SERVER, clock_offset=learned)
    assert await server.check(_request(fixed)) == key.node_id


def test_absurd_or_missing_dates_teach_nothing() -> None:
    assert server_clock_offset(None) is None
    assert server_clock_offset("not a date") is None
    assert server_clock_offset(email.utils.formatdate(time.time() + 10 * 86400, usegmt=True)) is None
