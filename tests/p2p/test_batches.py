"""Batch bodies by digest (``batch/v1``) between real daemons, with the callers a holder must expect."""

from __future__ import annotations

import asyncio
import hashlib

import pytest

from intellect_node.p2p.batches import RATE, BatchServer, fetch_batch
from intellect_node.p2p.dht import Membership
from intellect_node.p2p.metrics import Metrics
from intellect_protocol.envelope import Rejected
from intellect_protocol.identity import Identity

pytestmark = pytest.mark.integration

RUN_KEY = Identity.generate()
RUN_ID = RUN_KEY.node_id


def test_bodies_by_digest_and_the_callers_a_holder_must_expect() -> None:
    asyncio.run(_batches())


async def _batches() -> None:
    holder, asker = Membership(RUN_KEY, RUN_ID, Metrics()), Membership(Identity.generate(), RUN_ID, Metrics())
    body = b"\x85" + b"a signed batch, as its producer sent it" * 10
    digest = hashlib.sha256(body).hexdigest()
    held = {digest: body}
    server = None
    try:
        maddrs = await holder.start("127.0.0.1", 0, [])
        server = BatchServer(await holder.replicate_p2p(), RUN_ID, held.get, holder.metrics)
        await server.start()
        await asker.start("127.0.0.1", 0, maddrs[:1])
        p2p, peer, me = await asker.replicate_p2p(), maddrs[0].rsplit("/p2p/", 1)[1], asker.identity

        assert await fetch_batch(p2p, me, RUN_ID, peer, digest) == body
        assert await fetch_batch(p2p, me, RUN_ID, peer, "0" * 64) is None  # not held: an empty answer
        with pytest.raises(Rejected) as e:  # more than the announced size is never read
            await fetch_batch(p2p, me, RUN_ID, peer, digest, limit=len(body) - 1)
        assert e.value.reason == "oversized"
        held["1" * 64] = body  # a holder serving other bytes than the digest names: the asker notices
        with pytest.raises(Rejected) as e:
            await fetch_batch(p2p, me, RUN_ID, peer, "1" * 64)
        assert e.value.reason == "bad_digest"
        with pytest.raises(ConnectionError):  # a request for another run is not answered
            await fetch_batch(p2p, me, Identity.generate().node_id, peer, digest)
        # a peer asking faster than RATE a second is cut off (unanswered), and counted
        outcomes = await asyncio.gather(
            *(fetch_batch(p2p, me, RUN_ID, peer, digest) for _ in range(int(RATE) * 3)), return_exceptions=True
        )
        assert any(isinstance(o, ConnectionError) for o in outcomes)
        assert holder.metrics.counter("node_batches_served_total", "busy") > 0
    finally:
        if server is not None:
            await server.close()
        await asker.close()
        await holder.close()
