"""The contribution ledger's format: Merkle proofs against RFC 6962's tree, and chains checked with the run id alone
(forks, gaps, other signers, tampered entries each named)."""

from __future__ import annotations

import hashlib

import pytest

from intellect_protocol.codec import Channel
from intellect_protocol.envelope import seal
from intellect_protocol.identity import Identity
from intellect_protocol.ledger import (
    BatchCredit,
    Head,
    LedgerError,
    entry_hash,
    entry_of,
    genesis,
    inclusion_proof,
    leaf_hash,
    merkle_root,
    verify_chain,
    verify_entry,
    verify_inclusion,
)

TRAIN = hashlib.sha256(b"train settings").hexdigest()


def _reference_root(leaves: list[bytes]) -> bytes:
    """RFC 6962 section 2.1, as written: the split at the largest power of two smaller than n."""
    if len(leaves) == 1:
        return leaves[0]
    k = 1
    while k * 2 < len(leaves):
        k *= 2
    return hashlib.sha256(b"\x01" + _reference_root(leaves[:k]) + _reference_root(leaves[k:])).digest()


def _credits(n: int, salt: str = "") -> list[BatchCredit]:
    return [
        BatchCredit(
            producer=hashlib.sha256(f"node-{i % 7}".encode()).hexdigest()[:32],
            digest=hashlib.sha256(f"batch-{salt}-{i}".encode()).hexdigest(),
            made_on=i % 3,
            rollouts=8,
            tokens=100 + i,
        )
        for i in range(n)
    ]


def test_merkle_roots_are_rfc_6962s_and_every_leaf_proves_its_place() -> None:
    for n in range(1, 41):
        leaves = [leaf_hash(c) for c in _credits(n)]
        root = merkle_root(leaves)
        assert root == _reference_root(leaves)
        for i in range(n):
            proof = inclusion_proof(leaves, i)
            assert len(proof) <= max(1, n - 1).bit_length()
            assert verify_inclusion(leaves[i], i, n, proof, root)
            assert not verify_inclusion(leaves[i], (i + 1) % n, n, proof, root) or n == 1
            assert not verify_inclusion(leaves[(i + 1) % n], i, n, proof, root) or n == 1
            assert not verify_inclusion(leaves[i], n, n, proof, root)  # the size comes from the signed entry
            assert not verify_inclusion(leaves[i], i, n, [*proof, root], root)
    assert merkle_root([]) == hashlib.sha256(b"").digest()


def _chain(run: Identity, versions: list[tuple[int, int]], batches: int = 3) -> list[bytes]:
    """Sealed entries for (epoch, version) in order, each linked to the one before."""
    out: list[bytes] = []
    prev = genesis(run.node_id)
    for epoch, version in versions:
        credits = _credits(batches, f"{epoch}/{version}")
        entry = entry_of(run.node_id, epoch, version, max(0, version - 1), prev, 1.0e9, TRAIN, credits)
        sealed = seal(run, entry)
        out.append(sealed)
        prev = entry_hash(sealed)
    return out


def test_a_whole_chain_checks_with_the_run_id_alone_across_epochs() -> None:
    run = Identity.generate()
    sealed = _chain(run, [(0, 1), (0, 2), (0, 3), (5, 1), (5, 2)])
    head = verify_chain(sealed, run.node_id)
    assert head == Head(5, entry_hash(sealed[-1]), 5, 2)
    # checked in two parts from the head of the first: the same
    assert verify_chain(sealed[3:], run.node_id, verify_chain(sealed[:3], run.node_id)) == head


def _reason(sealed: list[bytes], run_id: str) -> tuple[str, int]:
    with pytest.raises(LedgerError) as caught:
        verify_chain(sealed, run_id)
    return caught.value.reason, caught.value.position


def test_broken_chains_are_named() -> None:
    run, other = Identity.generate(), Identity.generate()
    sealed = _chain(run, [(0, 1), (0, 2), (0, 3)])
    assert _reason([sealed[0], sealed[2]], run.node_id) == ("fork", 1)  # an entry left out
    fork = _chain(run, [(0, 1), (0, 2)], batches=4)  # another history from the same start
    assert _reason([sealed[0], fork[1]], run.node_id) == ("fork", 1)
    assert _reason(_chain(run, [(0, 1), (0, 3)]), run.node_id) == ("gap", 1)
    assert _reason(_chain(run, [(0, 2)]), run.node_id) == ("gap", 0)
    assert _reason(_chain(run, [(3, 1), (2, 2)]), run.node_id) == ("epoch_back", 1)
    assert _reason(_chain(other, [(0, 1)]), run.node_id)[0] == "wrong_signer"
    tampered = bytearray(sealed[1])
    tampered[-80] ^= 1  # a byte of the body: the signature no longer holds
    assert _reason([sealed[0], bytes(tampered), sealed[2]], run.node_id) == ("bad_signature", 1)
    assert _reason([sealed[0], sealed[1][:-5]], run.node_id)[0] == "malformed"  # truncated in transit


def test_an_entry_whose_batches_do_not_hash_to_its_root_is_refused() -> None:
    run = Identity.generate()
    entry = entry_of(run.node_id, 0, 1, 0, genesis(run.node_id), 1.0e9, TRAIN, _credits(4))
    lying = entry.model_copy(update={"tokens": [t + 1 for t in entry.tokens]})  # the root of other batches
    with pytest.raises(LedgerError, match="bad_root"):
        verify_entry(seal(run, lying), run.node_id, Head(0, genesis(run.node_id)))


@pytest.mark.integration  # seconds by design (a whole 100,000-batch step)
def test_a_step_of_100000_batches_fits_one_entry_and_proves_one_batch_in_17_hashes() -> None:
    run = Identity.generate()
    credits = _credits(100_000)
    refusals = {credits[0].producer: {"stale_version": 3, "bad_proof": 1}}
    entry = entry_of(run.node_id, 0, 1, 0, genesis(run.node_id), 1.0e9, TRAIN, credits, refusals)
    sealed = seal(run, entry)
    assert len(sealed) < Channel.LEDGER.value
    signed, head = verify_entry(sealed, run.node_id, Head(0, genesis(run.node_id)))
    assert head.length == 1 and signed.message.credits()[12345] == credits[12345]
    assert signed.message.refusals() == refusals
    leaves = [leaf_hash(c) for c in credits]
    proof = inclusion_proof(leaves, 12345)
    assert len(proof) == 17
    assert verify_inclusion(leaf_hash(credits[12345]), 12345, len(credits), proof, bytes.fromhex(entry.root))


def test_batches_dropped_after_acknowledgement_travel_in_the_signed_entry() -> None:
    run = Identity.generate()
    credits = _credits(2)
    dropped = [(credits[0].producer, "a" * 64, "stale"), (credits[1].producer, "b" * 64, "invalid")]
    entry = entry_of(run.node_id, 0, 1, 0, genesis(run.node_id), 1.0e9, TRAIN, credits, dropped=dropped)
    signed, _ = verify_entry(seal(run, entry), run.node_id, Head(0, genesis(run.node_id)))
    assert signed.message.drops() == dropped
    with pytest.raises(ValueError, match="dropped columns"):
        entry.model_validate({**entry.model_dump(), "dropped_reasons": ["stale"]})
