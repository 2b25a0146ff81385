"""The run's gossip topics on real go-libp2p daemons (started with gossipsub by our DHT process)."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator

import pytest

from intellect_node.p2p.dht import Membership
from intellect_node.p2p.gossip import BURST, LIMITS, RATE_PER_PEER, Gossip
from intellect_node.p2p.metrics import Metrics
from intellect_protocol.envelope import Rejected, open_signed, seal
from intellect_protocol.identity import Identity
from intellect_protocol.messages import VersionNotice
from tests.helpers.wait import until

pytestmark = pytest.mark.integration

RUN_KEY = Identity.generate()
RUN_ID = RUN_KEY.node_id


@contextlib.asynccontextmanager
async def pair() -> AsyncIterator[tuple[Gossip, Gossip]]:
    """Two nodes' daemons, the second joined through the first, each with the run's topics."""
    first = Membership(RUN_KEY, RUN_ID, Metrics())
    second = Membership(Identity.generate(), RUN_ID, Metrics())
    gossips: list[Gossip] = []
    try:
        maddrs = await first.start("127.0.0.1", 0, [])
        await second.start("127.0.0.1", 0, maddrs[:1])
        for m in (first, second):
            gossips.append(Gossip(await m.replicate_p2p(), RUN_ID, m.metrics))
        yield gossips[0], gossips[1]
    finally:
        for g in gossips:
            await g.close()
        await second.close()
        await first.close()


def _notice(version: int, identity: Identity = RUN_KEY) -> bytes:
    return seal(identity, VersionNotice(run_id=RUN_ID, version=version, checkpoint_sha256="a" * 64, issued=time.time()))


async def _subscribed(sender: Gossip, receiver: Gossip, name: str) -> None:
    """Until the sender's daemon sees the receiver in the topic (gossipsub delivers only to known subscribers)."""
    await asyncio.wait_for(receiver.subscribed[name].wait(), 30)

    async def known() -> bool:
        return bool(await sender.peers(name))

    await until(known, f"the sender to see the receiver in {name}", 30.0, every=0.1)


def test_signed_messages_are_delivered_and_forged_ones_are_ignored() -> None:
    asyncio.run(_signed_messages_are_delivered_and_forged_ones_are_ignored())


async def _signed_messages_are_delivered_and_forged_ones_are_ignored() -> None:
    async with pair() as (trainer, volunteer):
        got: list[int] = []
        forged: list[str] = []

        async def on_version(data: bytes, peer: str) -> None:
            signed = open_signed(data, VersionNotice)
            if signed.signer_id != RUN_ID:  # what Volunteer does: only the run key announces versions
                forged.append(signed.signer_id)
                raise Rejected("foreign_notice", signed.signer_id)
            got.append(signed.message.version)

        volunteer.subscribe("versions", on_version)
        await _subscribed(trainer, volunteer, "versions")
        await trainer.publish("versions", _notice(1, Identity.generate()))  # well-formed, signed by another key
        await trainer.publish("versions", _notice(2)[:-5] + b"xxxxx")  # a broken signature
        await trainer.publish("versions", b"\x00not an envelope")
        await trainer.publish("versions", _notice(3))

        async def arrived() -> bool:
            return got == [3]

        await until(arrived, "the message", 30.0, every=0.1)
        assert len(forged) == 1
        rejected = volunteer.metrics.by_label("node_gossip_rejected_total")
        assert (rejected.get("foreign_notice"), rejected.get("bad_signature"), rejected.get("malformed")) == (1, 1, 1)


def test_an_oversized_message_is_refused_before_it_is_published() -> None:
    asyncio.run(_an_oversized_message_is_refused_before_it_is_published())


async def _an_oversized_message_is_refused_before_it_is_published() -> None:
    async with pair() as (trainer, volunteer):
        got: list[bytes] = []

        async def on_message(data: bytes, peer: str) -> None:
            got.append(data)

        volunteer.subscribe("rollouts", on_message)
        await _subscribed(trainer, volunteer, "rollouts")
        with pytest.raises(Rejected) as e:
            await trainer.publish("rollouts", b"\x85" + b"x" * LIMITS["rollouts"])
        assert e.value.reason == "oversized"
        assert trainer.metrics.counter("node_gossip_published_total", "rollouts") == 0
        await trainer.publish("rollouts", b"small")

        async def arrived() -> bool:
            return got == [b"small"]

        await until(arrived, "the message", 30.0, every=0.1)


def test_a_flooding_peer_is_rate_limited() -> None:
    asyncio.run(_a_flooding_peer_is_rate_limited())


async def _a_flooding_peer_is_rate_limited() -> None:
    async with pair() as (trainer, volunteer):
        got: list[bytes] = []

        async def on_message(data: bytes, peer: str) -> None:
            got.append(data)

        volunteer.subscribe("rollouts", on_message)
        await _subscribed(trainer, volunteer, "rollouts")
        sent = int(BURST) + 200
        started = time.monotonic()
        await asyncio.gather(*(trainer.publish("rollouts", b"m%d" % i) for i in range(sent)))

        async def cut() -> bool:
            return volunteer.metrics.counter("node_gossip_dropped_total", "rate") > 0

        await until(cut, "the flood to be cut", 30.0, every=0.1)
        await asyncio.sleep(1.0)
        assert len(got) <= BURST + RATE_PER_PEER * (time.monotonic() - started) + 1
