"""The DHT record validator that every node of ours runs: only correctly signed records are stored or returned."""

from __future__ import annotations

import time

from hivemind.dht.routing import DHTID
from hivemind.dht.validation import DHTRecord
from hivemind.utils.serializer import MSGPackSerializer

from intellect_node.config import RunConfig
from intellect_node.p2p.dht import RecordValidator
from intellect_protocol.envelope import seal
from intellect_protocol.identity import Identity
from intellect_protocol.messages import NodeRecord, RunSpec
from intellect_protocol.records import nodes_key, spec_key

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
