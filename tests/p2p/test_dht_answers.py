"""A DHT peer that lies about how long its answers live cannot freeze or empty a run key.

The attacker is a real hivemind DHT peer (its own process and go-libp2p daemon) whose find handler answers every
key with a dictionary that expires at infinity: empty, so that a reader that takes it has no nodes, no trainer and no
run spec, and caches that for ever (and hands it on to whoever asks the reader).
"""

from __future__ import annotations

import asyncio
import functools
import time
from typing import Any

import pytest
from hivemind.dht import DHT
from hivemind.dht.protocol import DHTProtocol
from hivemind.dht.routing import DHTID
from hivemind.dht.storage import DictionaryDHTValue
from hivemind.p2p import P2PContext
from hivemind.proto import dht_pb2
from hivemind.utils import ValueWithExpiration
from hivemind.utils.serializer import MSGPackSerializer

from intellect_node.config import RunConfig
from intellect_node.p2p.dht import Membership, bounded_answer
from intellect_node.p2p.metrics import Metrics
from intellect_protocol.envelope import seal
from intellect_protocol.identity import Identity
from intellect_protocol.messages import NodeRecord
from intellect_protocol.records import NODE_TTL_S, nodes_key

RUN_KEY = Identity.generate()
RUN_ID = RUN_KEY.node_id


class _Liar(DHT):
    """A DHT peer whose every find answer is an empty dictionary that never expires (routing answers kept, so it
    looks like any other peer)."""

    def run(self) -> None:
        honest = DHTProtocol.rpc_find

        async def rpc_find(
            protocol: DHTProtocol, request: dht_pb2.FindRequest, context: P2PContext
        ) -> dht_pb2.FindResponse:
            response = await honest(protocol, request, context)
            for item in response.results:
                item.type = dht_pb2.FOUND_DICTIONARY
                item.value = MSGPackSerializer.dumps(DictionaryDHTValue())
                item.expiration_time = float("inf")
            return response

        DHTProtocol.rpc_find = rpc_find  # type: ignore[method-assign]
        super().run()


async def _hold_only_here(key: str, subkey: str, value: bytes, expiration: float, _dht: DHT, node: Any) -> bool:
    """Inside one DHT process: keep a record in this peer's storage only (no other peer gets a copy)."""
    return bool(node.protocol.storage.store_subkey(DHTID.generate(source=key), subkey, value, expiration))


def _record(identity: Identity, role: str = "inference") -> NodeRecord:
    return NodeRecord(run_id=RUN_ID, node_id=identity.node_id, role=role, updated=time.time())  # type: ignore[arg-type]


@pytest.mark.integration
def test_an_answer_that_never_expires_neither_empties_nor_freezes_a_run_key() -> None:
    worker_key = Identity.generate()

    async def scenario() -> tuple[set[str], bool, bool, set[str]]:
        trainer = Membership(RUN_KEY, RUN_ID, Metrics())
        worker = Membership(worker_key, RUN_ID, Metrics())
        reader = Membership(Identity.generate(), RUN_ID, Metrics())
        liar: DHT | None = None
        try:
            maddrs = await trainer.start("127.0.0.1", 0, [])
            await worker.start("127.0.0.1", 0, maddrs[:1])
            assert await trainer.publish_spec(RunConfig().spec(RUN_ID, created=time.time()))
            assert await trainer.publish_record(_record(RUN_KEY, "trainer"))
            assert await worker.publish_record(_record(worker_key))
            liar = _Liar(initial_peers=maddrs[:1], start=True)  # after the stores: it holds none of them
            await reader.start("127.0.0.1", 0, [str(m) for m in liar.get_visible_maddrs()][:1])
            first = set(await reader.get_nodes())
            trainer_found = await reader.get_trainer() is not None
            spec_found = await reader.get_spec() is not None
            # A node that joins later, its record held by the trainer's peer alone: the reader must ask again.
            late = Identity.generate()
            assert trainer.dht is not None
            place = functools.partial(
                _hold_only_here,
                nodes_key(RUN_ID),
                late.node_id,
                MSGPackSerializer.dumps(seal(late, _record(late))),
                time.time() + NODE_TTL_S,
            )
            assert await asyncio.to_thread(trainer.dht.run_coroutine, place)
            second = set(await reader.get_nodes())
            return first, trainer_found, spec_found, second - first
        finally:
            await reader.close()
            if liar is not None:
                liar.shutdown()
            await worker.close()
            await trainer.close()

    first, trainer_found, spec_found, added = asyncio.run(scenario())
    assert first == {RUN_ID, worker_key.node_id}
    assert trainer_found and spec_found
    assert len(added) == 1  # the late node's record: the reader did not stop at an answer it had cached


def test_a_dictionary_answer_expires_with_its_latest_record() -> None:
    value = DictionaryDHTValue()
    now = time.time()
    value.store("a", b"x", now + 10)
    value.store("b", b"y", now + 30)
    bounded = bounded_answer(ValueWithExpiration(value, float("inf")))
    assert bounded is not None and bounded.expiration_time == now + 30
    assert bounded_answer(ValueWithExpiration(value, now + 5)).expiration_time == now + 5  # an earlier bound stays
    assert bounded_answer(ValueWithExpiration(DictionaryDHTValue(), float("inf"))) is None  # no record, no answer
    regular = ValueWithExpiration(b"v", now + 1)
    assert bounded_answer(regular) is regular  # regular values: the record validator bounds them
    assert bounded_answer(None) is None
