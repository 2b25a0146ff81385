"""The shared test helpers (tests/helpers) do what the tests that use them rely on."""

from __future__ import annotations

import asyncio
import socket
import time

import pytest

from tests.helpers.keys import Keys
from tests.helpers.net import free_port
from tests.helpers.wait import until


def test_until_returns_once_a_plain_or_an_async_predicate_holds() -> None:
    started = time.monotonic()

    async def soon() -> bool:
        return time.monotonic() - started > 0.05

    asyncio.run(until(lambda: time.monotonic() - started > 0.05, "a plain predicate", 5.0, every=0.01))
    asyncio.run(until(soon, "an async predicate", 5.0, every=0.01))


def test_until_raises_timeout_error_naming_what_it_waited_for() -> None:
    """A bounded wait whose outcome a test checks afterwards suppresses ``TimeoutError`` (weights/test_slots.py)."""
    with pytest.raises(TimeoutError, match="timed out waiting for the moon"):
        asyncio.run(until(lambda: False, "the moon", 0.05, every=0.01))


def test_keys_sign_as_the_node_they_name() -> None:
    keys = Keys()
    a, b = keys.new(), keys.named("b")
    assert a != b and keys.named("b") == b and keys[b].node_id == b and keys[a].node_id == a


def test_a_free_port_can_be_bound() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", free_port()))
