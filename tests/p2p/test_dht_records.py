"""The DHT record validator that every node of ours runs: only correctly signed records are stored or returned."""

from __future__ import annotations

import asyncio
import time

import pytest
from hivemind.dht.routing import DHTID
from hivemind.dht.validation import DHTRecord
from hivemind.utils.serializer import MSGPackSerializer

from intellect_node.config import RunConfig
from intellect_node.p2p.dht import Membership, RecordValidator, check_node_record
from intellect_node.p2p.metrics import Metrics
from intellect_protocol.envelope import Rejected, seal
from intellect_protocol.identity import Identity
from intellect_protocol.messages import NodeRecord, RunSpec
from intellect_protocol.records import CLOCK_SKEW_S, NODE_TTL_S, nodes_key, spec_key

RUN_KEY = Identity.generate()
RUN_ID = RUN_KEY.node_id
WORKER = Identity.generate()
VALIDATOR = RecordValidator(RUN_ID)


def _record(key: str, subkey: object, value: object) -> DHTRecord:
    return DHTRecord(
        DHTID.generate(source=key).to_bytes(),
        MSGPackSerializer.dumps(subkey),
        MSGPackSerializer.dumps(value),
        time.time() + 30,
    )


def _node(identity: Identity, role: str = "inference", run_id: str = RUN_ID, node_id: str | None = None) -> bytes:
    rec = NodeRecord(run_id=run_id, node_id=node_id or identity.node_id, role=role, updated=time.time())  # type: ignore[arg-type]
    return seal(identity, rec)


def _spec(identity: Identity, run_id: str = RUN_ID) -> bytes:
    return seal(identity, RunSpec(run_id=run_id, created=time.time(), seed=0, model=RunConfig().model))


def test_valid_records_are_accepted() -> None:
    assert VALIDATOR.validate(_record(nodes_key(RUN_ID), WORKER.node_id, _node(WORKER)))
    assert VALIDATOR.validate(_record(nodes_key(RUN_ID), RUN_ID, _node(RUN_KEY, role="trainer")))
    assert VALIDATOR.validate(_record(spec_key(RUN_ID), RUN_ID, _spec(RUN_KEY)))


def test_records_of_other_applications_are_left_alone() -> None:
    assert VALIDATOR.validate(_record("someone-else/key", "x", b"anything"))


def test_forged_records_are_refused() -> None:
    other = Identity.generate()
    nodes = nodes_key(RUN_ID)
    assert not VALIDATOR.validate(_record(nodes, WORKER.node_id, _node(other)))  # subkey is not the signer
    assert not VALIDATOR.validate(_record(nodes, WORKER.node_id, _node(other, node_id=WORKER.node_id)))
    assert not VALIDATOR.validate(_record(nodes, WORKER.node_id, _node(WORKER, run_id=other.node_id)))
    assert not VALIDATOR.validate(_record(nodes, other.node_id, _node(other, role="trainer")))  # not the run key
    assert not VALIDATOR.validate(_record(nodes, WORKER.node_id, b"\xc1garbage"))
    assert not VALIDATOR.validate(_record(nodes, WORKER.node_id, 12345))
    assert not VALIDATOR.validate(_record(spec_key(RUN_ID), RUN_ID, _spec(other)))  # spec not by the run key
    assert not VALIDATOR.validate(_record(spec_key(RUN_ID), "other", _spec(RUN_KEY)))


def _at(identity: Identity, updated: float) -> bytes:
    return seal(identity, NodeRecord(run_id=RUN_ID, node_id=identity.node_id, role="inference", updated=updated))


def test_the_validator_judges_a_record_the_same_at_store_time_and_ever_after() -> None:
    """hivemind re-validates on every read and drops the whole ``nodes`` dictionary when one sub-record fails, so
    no rule may turn false as time passes: freshness is the reader's business, and the expiration is bounded by
    the record's own ``updated``."""
    nodes = nodes_key(RUN_ID)
    old = time.time() - NODE_TTL_S - CLOCK_SKEW_S - 60  # stale to any reader
    kept_short = DHTRecord(
        DHTID.generate(source=nodes).to_bytes(),
        MSGPackSerializer.dumps(WORKER.node_id),
        MSGPackSerializer.dumps(_at(WORKER, old)),
        old + NODE_TTL_S,
    )
    assert VALIDATOR.validate(kept_short)  # expired by its own bound: nothing to refuse at a later read
    kept_alive = _record(nodes, WORKER.node_id, _at(WORKER, old))  # a stale record given a fresh expiration
    assert not VALIDATOR.validate(kept_alive)
    future = _record(nodes, WORKER.node_id, _at(WORKER, time.time() + CLOCK_SKEW_S + 60))
    assert not VALIDATOR.validate(future)
    with pytest.raises(Rejected, match="stale_record"):
        check_node_record(_at(WORKER, old), WORKER.node_id, RUN_ID)


@pytest.mark.integration
def test_one_record_going_stale_does_not_hide_the_others_from_readers() -> None:
    """The attack: a signed record that passes the store-time checks and turns stale while the DHT keeps it made
    hivemind drop every node's record for every reader (the trainer then refused all batches as unknown_signer).
    Two real DHT peers; the attacker stores through the reader's peer."""

    async def scenario() -> tuple[bool, set[str], set[str]]:
        a = Membership(RUN_KEY, RUN_ID, Metrics())
        b = Membership(WORKER, RUN_ID, Metrics())
        try:
            maddrs = await a.start("127.0.0.1", 0, [])
            await b.start("127.0.0.1", 0, maddrs[:1])
            assert await b.publish_record(
                NodeRecord(run_id=RUN_ID, node_id=WORKER.node_id, role="inference", updated=time.time())
            )
            honest = Identity.generate()
            now = time.time()
            assert b.dht is not None
            store = b.dht.store
            ok = await asyncio.to_thread(
                store, nodes_key(RUN_ID), _at(honest, now), now + NODE_TTL_S, subkey=honest.node_id
            )
            assert ok
            attacker = Identity.generate()
            edge = now - NODE_TTL_S - CLOCK_SKEW_S + 1.0  # fresh for one more second
            far = now + NODE_TTL_S + CLOCK_SKEW_S - 1
            old_attack = await asyncio.to_thread(
                store, nodes_key(RUN_ID), _at(attacker, edge), far, subkey=attacker.node_id
            )
            allowed = await asyncio.to_thread(
                store, nodes_key(RUN_ID), _at(attacker, edge), edge + NODE_TTL_S + CLOCK_SKEW_S, subkey=attacker.node_id
            )
            assert allowed  # a record may live as long as it is fresh, not longer
            while time.time() < edge + NODE_TTL_S + CLOCK_SKEW_S + 0.5:  # until it has turned stale
                await asyncio.sleep(0.1)
            return old_attack, set(await a.get_nodes()), set(await b.get_nodes())
        finally:
            await b.close()
            await a.close()

    old_attack, seen_a, seen_b = asyncio.run(scenario())
    assert not old_attack  # a stale-to-be record kept alive past its freshness is refused at store time
    assert WORKER.node_id in seen_a and WORKER.node_id in seen_b
    assert len(seen_a) == len(seen_b) == 2  # the two honest records; the attacker's is gone


def test_a_record_is_verified_once_but_its_age_is_judged_at_every_read(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every read of the nodes key returns every record: 200 made-up keys in the DHT made each read re-verify 200
    signatures (twice: DHT process and reader), and the trainer's training rate halved under a sybil flood. A
    record's signature is checked once per exact bytes; its freshness, and any other bytes, still every time."""
    from intellect_node.p2p import dht

    calls: list[int] = []
    real = dht.open_signed

    def counting(*args: object, **kwargs: object) -> object:
        calls.append(1)
        return real(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(dht, "open_signed", counting)
    keys = [Identity.generate() for _ in range(20)]
    values = [(k.node_id, _node(k)) for k in keys]
    now = time.time()
    for subkey, value in values:
        check_node_record(value, subkey, RUN_ID, now=now)
    first = len(calls)
    for subkey, value in values:
        check_node_record(value, subkey, RUN_ID, now=now)
    assert first == 20 and len(calls) == 20  # the second read verified nothing again
    later = now + NODE_TTL_S + CLOCK_SKEW_S + 1
    with pytest.raises(Rejected, match="stale_record"):  # cached, and still refused once it is old
        check_node_record(values[0][1], values[0][0], RUN_ID, now=later)
    with pytest.raises(Rejected, match="signer_mismatch"):  # the same bytes under another node's subkey
        check_node_record(values[0][1], values[1][0], RUN_ID, now=now)
    tampered = values[0][1][:-1] + bytes([values[0][1][-1] ^ 1])
    with pytest.raises(Rejected):
        check_node_record(tampered, values[0][0], RUN_ID, now=now)

    stored = [_record(nodes_key(RUN_ID), s, v) for s, v in values]
    validator = RecordValidator(RUN_ID)
    monkeypatch.setattr(dht, "_RECORDS", dht._Verified())  # as in the DHT process: nothing read there yet
    before = len(calls)
    assert all(validator.validate(r) for r in stored) and all(validator.validate(r) for r in stored)
    assert len(calls) - before == 20  # the DHT process's validator too: once per record
    forged = _record(nodes_key(RUN_ID), keys[0].node_id, _node(keys[1]))
    assert not validator.validate(forged) and not validator.validate(forged)  # a refusal is never remembered


def test_a_clean_stop_logs_no_go_libp2p_error() -> None:
    """Every clean stop printed the daemon's "error accepting connection ... use of closed network connection" at
    ERROR, and often hivemind's "DHT did not shut down within the grace period" at WARNING: dropped, and only those."""
    import logging

    from intellect_node.p2p.dht import quiet_clean_stops

    quiet_clean_stops()
    seen: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            seen.append(record.getMessage())

    daemon, dht = logging.getLogger("hivemind.p2p.p2p_daemon"), logging.getLogger("hivemind.dht.dht")
    keep = Keep()
    for log in (daemon, dht):
        log.addHandler(keep)
    try:
        daemon.error("error accepting connection: accept unix /tmp/x.sock: use of closed network connection")
        dht.warning("DHT did not shut down within the grace period; terminating it the hard way")
        daemon.error("failed to connect to bootstrap peers")
        dht.warning("could not store the record")
    finally:
        for log in (daemon, dht):
            log.removeHandler(keep)
    assert seen == ["failed to connect to bootstrap peers", "could not store the record"]
