"""A relay's server knows the run's stripes from the origin's record, as its fetcher does: a child that holds a slot
in one stripe and asks for a shard of another is an alternate there, told at once that the shard is not here, not
held for a long poll. A server left at one stripe held every child for the whole poll: two nodes, each the other's
parent in stripes a version has no shard in, held each other's only fetch for ``LONG_POLL_S`` (a version took 10 s
to load while the trainer published one every 0.3 s). Real shard server on loopback, real requests."""

from __future__ import annotations

import asyncio
from pathlib import Path

import aiohttp
import pytest

from intellect_node.p2p.metrics import Metrics
from intellect_node.weights import relay
from intellect_node.weights.follower import WeightFollower
from intellect_protocol.identity import Identity
from intellect_protocol.messages import NodeRecord, RelayInfo
from tests.weights.test_hostile_parent import _Records
from tests.weights.test_spare import RUN, _attach, _checkpoint, _server, _shard

STRIPES = 4
HOME = 3


def _origin() -> NodeRecord:
    relay_info = RelayInfo(depth=0, slots_total=8, slots_free=8, stripes=STRIPES)
    url = "http://o"
    return NodeRecord(run_id=RUN, node_id=RUN, role="trainer", updated=0.0, http_url=url, relay=relay_info)  # type: ignore[arg-type]


@pytest.mark.integration
def test_a_child_asking_for_another_stripes_missing_shard_is_answered_at_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(relay, "LONG_POLL_S", 600.0)  # a long poll would outlast the test's bound by far
    _checkpoint(tmp_path, STRIPES, 0.01)
    for shard in tmp_path.rglob(_shard(0)):  # the version has begun here; its stripe-0 shard has not arrived
        shard.unlink()
    node, child = Identity.generate(), Identity.generate()

    async def main() -> tuple[int, int]:
        server, http, url, _ = await _server(tmp_path, node, slots=2, stripes=1, home=HOME)
        follower = WeightFollower(
            node, RUN, _Records({RUN: _origin()}), server.store, Metrics(), server, 2, None, lambda: asyncio.sleep(0)
        )  # type: ignore[arg-type]
        try:
            follower._plan_stripes({RUN: _origin()})  # as the first read of the records does
            assert server.stripes == STRIPES
            async with aiohttp.ClientSession() as session:
                token = await _attach(session, url, child, node.node_id, HOME)
                headers = {relay.CHILD_HEADER: child.node_id, relay.TOKEN_HEADER: token}
                ask = session.get(f"{url}/weights/1/{_shard(0)}", headers=headers)
                async with await asyncio.wait_for(ask, timeout=30) as r:
                    missing = r.status
                async with session.get(f"{url}/weights/1/{_shard(HOME)}", headers=headers) as r:
                    await r.read()
                    present = r.status
        finally:
            await http.close()
        return missing, present

    missing, present = asyncio.run(main())
    assert missing == 404  # another stripe's shard, not here: at once
    assert present == 200  # its own stripe's shard: served as to a child
