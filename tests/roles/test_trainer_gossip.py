"""The trainer's gossip part on its own (node/roles/trainer_gossip.py ``TrainerGossip``), with no daemon: what
it does with the announcements and verdicts peers send, before anything reaches the door. Real signed messages;
the registry answers from a dict (the DHT reads themselves are tested in tests/p2p)."""

from __future__ import annotations

import asyncio
import hashlib
import time
from pathlib import Path

import pytest

from intellect_node.p2p.metrics import Metrics
from intellect_node.roles.admission import Admission
from intellect_node.roles.trainer_gossip import TrainerGossip, VerdictWait
from intellect_node.weights.store import WeightStore
from intellect_protocol.envelope import Rejected, seal
from intellect_protocol.identity import Identity
from intellect_protocol.messages import AdmissionSpec, BatchAnnounce, NodeRecord, RolloutBatch, Verdict

RUN_KEY = Identity.generate()
RUN = RUN_KEY.node_id


class _Registry:
    def __init__(self) -> None:
        self.records: dict[str, NodeRecord] = {}

    async def registered(self, node_id: str) -> NodeRecord | None:
        return self.records.get(node_id)

    def add(self, key: Identity) -> None:
        self.records[key.node_id] = NodeRecord(run_id=RUN, node_id=key.node_id, role="inference", updated=time.time())


def _gossip(tmp_path: Path, validator: str = "") -> tuple[TrainerGossip, _Registry, dict[str, str]]:
    registry, banned = _Registry(), {}
    part = TrainerGossip(
        RUN,
        0,
        RUN_KEY,
        Metrics(),
        WeightStore(tmp_path, RUN),
        registry,  # type: ignore[arg-type]
        Admission(AdmissionSpec(), RUN),
        banned,
        [validator] if validator else [],
        {},
        lambda node: None,
    )
    return part, registry, banned


def _announce(key: Identity, digest: str, node_id: str = "") -> bytes:
    a = BatchAnnounce(
        run_id=RUN,
        node_id=node_id or key.node_id,
        version=0,
        batch_index=0,
        batch_sha256=digest,
        size=100,
        issued=time.time(),
    )
    return seal(key, a)


def test_announcements_from_strangers_banned_keys_and_for_other_nodes_batches_are_refused(tmp_path: Path) -> None:
    part, registry, banned = _gossip(tmp_path)
    producer, stranger, cheat = Identity.generate(), Identity.generate(), Identity.generate()
    registry.add(producer)
    registry.add(cheat)
    banned[cheat.node_id] = "toploc"
    batch = RolloutBatch.model_construct(node_id=producer.node_id, version=0, batch_index=0)
    envelope = b"the producer's signed batch"
    digest = hashlib.sha256(envelope).hexdigest()

    async def main() -> list[str]:
        assert part.admitted(batch, envelope, [], False) == digest and part.held[digest] == envelope
        reasons = []
        for data in (
            _announce(stranger, "ab" * 32),  # no record in the run
            _announce(cheat, "cd" * 32),  # banned
            _announce(stranger, digest, node_id=producer.node_id),  # signed by another key than the producer's
            _announce(cheat, digest),  # a digest that is another node's batch
        ):
            with pytest.raises(Rejected) as e:
                await part._on_announce(data, "peer")
            reasons.append(e.value.reason)
        await part._on_announce(_announce(producer, digest), "peer")  # its producer: answered, not pulled
        return reasons

    reasons = asyncio.run(main())
    assert reasons == ["unknown_signer", "banned", "signer_mismatch", "foreign_announcement"]
    assert not part._pulling, "nothing is fetched for a refused or already admitted announcement"


def test_a_verdict_counts_only_from_a_named_validator_for_the_batch_its_digest_names(tmp_path: Path) -> None:
    validator, other = Identity.generate(), Identity.generate()
    part, _, _ = _gossip(tmp_path, validator.node_id)
    key = ("b" * 32, 0, 0)
    wait = part.waits["d" * 64] = VerdictWait([validator.node_id], key)

    def verdict(signer: Identity, batch_index: int = 0) -> bytes:
        v = Verdict(run_id=RUN, node_id=key[0], version=0, batch_index=batch_index, batch_sha256="d" * 64, ok=True)
        return seal(signer, v)

    async def main() -> list[str]:
        reasons = []
        for data in (verdict(other), verdict(validator, batch_index=1)):
            with pytest.raises(Rejected) as e:
                await part._on_verdict(data, "peer")
            reasons.append(e.value.reason)
        await part._on_verdict(verdict(validator), "peer")
        return reasons

    assert asyncio.run(main()) == ["untrusted_validator", "foreign_verdict"]
    assert wait.done.is_set() and list(wait.verdicts) == [validator.node_id]
