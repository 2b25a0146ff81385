"""The validator's record of who holds a batch (``Holders``): only the producer's own announcement names a holder."""

from __future__ import annotations

import pytest

from intellect_node.roles import validator_node
from intellect_node.roles.validator_node import CLAIMANTS, Holders
from intellect_protocol.envelope import Rejected

DIGEST = "d" * 64
PRODUCER, ECHOER = "a" * 32, "e" * 32


def test_an_echo_before_the_acknowledgement_never_names_the_holder() -> None:
    h = Holders()
    assert h.claim(DIGEST, PRODUCER, "peer-producer") == "claim"
    assert h.claim(DIGEST, ECHOER, "peer-echoer") == "claim"  # the last announcer: once, the holder
    assert h.holder(DIGEST) is None  # nobody is, before the run key names the producer
    assert h.produced_by(DIGEST, PRODUCER) == [(ECHOER, "peer-echoer")]  # dropped, for counting and the log
    assert h.holder(DIGEST) == "peer-producer"


def test_once_the_producer_is_known_other_keys_are_refused_and_its_first_peer_is_kept() -> None:
    h = Holders()
    h.produced_by(DIGEST, PRODUCER)
    with pytest.raises(Rejected) as e:
        h.claim(DIGEST, ECHOER, "peer-echoer")
    assert e.value.reason == "not_producer"
    assert h.holder(DIGEST) is None  # acknowledged, not yet announced: the trainer alone is asked
    assert h.claim(DIGEST, PRODUCER, "peer-producer") == "producer"
    assert h.claim(DIGEST, PRODUCER, "peer-replayer") == "repeat"  # its signed announcement, sent on by another
    assert h.holder(DIGEST) == "peer-producer"


def test_an_echoer_without_the_producer_names_nobody() -> None:
    h = Holders()
    h.claim(DIGEST, ECHOER, "peer-echoer")
    assert h.produced_by(DIGEST, PRODUCER) == [(ECHOER, "peer-echoer")]
    assert h.holder(DIGEST) is None


def test_the_bookkeeping_is_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    h = Holders()
    keys = [f"{i:032x}" for i in range(CLAIMANTS + 1)]
    for k in keys[:CLAIMANTS]:
        h.claim(DIGEST, k, "peer")
    with pytest.raises(Rejected) as e:
        h.claim(DIGEST, keys[-1], "peer")
    assert e.value.reason == "claimants_full"
    monkeypatch.setattr(validator_node, "HOLDERS", 8)
    for i in range(20):
        h.claim(f"{i:064x}", PRODUCER, "peer")
        h.produced_by(f"{i:064x}", PRODUCER)
    assert len(h.claims) == len(h.producers) == 8
    assert h.holder(f"{19:064x}") == "peer" and h.holder(f"{0:064x}") is None
