"""The contribution ledger's wire format: one entry per published version, signed by the run key, chained by hash,
with a Merkle root over the batches the step trained on.

An entry (``LedgerEntry``) says what the step that produced ``version`` consumed: for every batch trained on, its
producer, the SHA-256 of the batch as its producer signed it, the weight version it was made with, and the
rollouts and tokens trained; the batches refused since the previous entry, by producer and reason; the groups in
the order the step packed them (batch and slot: what a replay of the step needs, node/roles/audit.py); and the
hash of the training settings it ran with. Batches are stored as columns (parallel lists): a step of 100,000 batches
is one flat message of a few MB, within the codec's container budget.

Hashes (SHA-256, hex):

- ``entry_hash(sealed)``: of the sealed entry as published (envelope and signature included). Entry ``n`` names
  entry ``n - 1`` in ``prev``; the first entry of a run names ``genesis(run_id)``. One head hash commits to the
  whole history: a node that holds it can check any copy of the ledger.
- ``leaf_hash(credit)``: of one batch credit, ``0x00`` then its msgpack; ``merkle_root`` over the leaves in the
  entry's order, RFC 6962's tree (``0x01`` then the two children for an inner node; the split at the largest
  power of two below the size). ``inclusion_proof`` / ``verify_inclusion``: a batch's membership in O(log n)
  hashes, checked against the root alone.

``verify_chain`` checks a sequence of sealed entries with the run id alone: each signed by the run key, of this
run, its ``prev`` the hash of the one before, versions consecutive within an epoch (a new epoch starts at 1),
epochs never going back, its root the root of its batches. The first failure raises ``LedgerError`` naming the
entry and the reason.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Annotated, ClassVar

from pydantic import Field, model_validator

from intellect_protocol.codec import Channel, pack
from intellect_protocol.envelope import Rejected, Signed, open_signed
from intellect_protocol.messages import U31, U63, NodeId, Sha256Hex, WireModel

MAX_BATCHES = 1_000_000
"""Batches one entry may credit (a step of 100,000 batches encodes to about 15 MB)."""
MAX_REFUSALS = 65_536
"""(producer, reason) pairs one entry may count."""
MAX_GROUPS = 4 * MAX_BATCHES
"""Groups one entry may list (a step's packing order)."""
REASON = Annotated[str, Field(pattern=r"^[a-z_]{1,32}$")]


def genesis(run_id: str) -> str:
    """The ``prev`` of a run's first entry: a hash no entry can have, bound to the run."""
    return hashlib.sha256(b"intellect-node/ledger/genesis/" + run_id.encode()).hexdigest()


@dataclass(frozen=True)
class BatchCredit:
    """One batch trained on: its producer, its digest (SHA-256 of the sealed batch), the weight version it was made
    with, and the rollouts and tokens of it the step trained on."""

    producer: str
    digest: str
    made_on: int
    rollouts: int
    tokens: int


class LedgerEntry(WireModel):
    """What the step that produced ``version`` consumed; sealed by the run key (module docstring)."""

    KIND: ClassVar[str] = "ledger_entry"
    CHANNEL: ClassVar[Channel] = Channel.LEDGER
    run_id: NodeId
    epoch: U63
    version: U31
    """The version this step produced (the first step of an epoch produces 1)."""
    parent: U31
    """The version whose weights the step started from: ``version - 1``, except after a trainer resumed from a
    checkpoint older than the newest version it had published (the versions between were lost)."""
    prev: Sha256Hex
    """``entry_hash`` of the entry before, or ``genesis(run_id)``."""
    created: float
    train: Sha256Hex
    """SHA-256 of the run spec's training settings as msgpack (what an auditor replays the step with)."""
    weights: Annotated[str, Field(pattern=r"^([0-9a-f]{64})?$")] = ""
    """The ``checkpoint_sha256`` of the version's signed manifest: the weights this step produced. Empty for a step
    whose version was never published (its publication failed; the next step's entry follows it)."""
    state: Annotated[str, Field(pattern=r"^([0-9a-f]{64})?$")] = ""
    """SHA-256 of the trainer's checkpoint file of this version (``step-<version>.pt``: the engine's fp32 weights
    and optimizer state after the step, and what the trainer needs to resume), when one was written before the
    entry; empty when none was. An auditor replays the next step from that file and checks it against this hash
    first, so the state a step starts from is fixed before the step is taken (node/roles/audit.py)."""
    producers: Annotated[list[NodeId], Field(max_length=MAX_BATCHES)] = []
    digests: Annotated[list[Sha256Hex], Field(max_length=MAX_BATCHES)] = []
    made_on: Annotated[list[U31], Field(max_length=MAX_BATCHES)] = []
    rollouts: Annotated[list[U31], Field(max_length=MAX_BATCHES)] = []
    tokens: Annotated[list[U63], Field(max_length=MAX_BATCHES)] = []
    root: Sha256Hex
    """``merkle_root`` of the batch credits, in this order."""
    refused_producers: Annotated[list[NodeId], Field(max_length=MAX_REFUSALS)] = []
    refused_reasons: Annotated[list[REASON], Field(max_length=MAX_REFUSALS)] = []
    refused_counts: Annotated[list[U31], Field(max_length=MAX_REFUSALS)] = []
    dropped_producers: Annotated[list[NodeId], Field(max_length=MAX_BATCHES)] = []
    dropped_digests: Annotated[list[Sha256Hex], Field(max_length=MAX_BATCHES)] = []
    dropped_reasons: Annotated[list[REASON], Field(max_length=MAX_BATCHES)] = []
    """Batches the trainer acknowledged since the previous entry and then trained none of: each one's producer,
    digest and why its last group was dropped (``stale``: too old by the time a step could take it, ``invalid``:
    it failed the check, ``banned``: its producer was caught cheating, ``unscorable``, ``filtered``: every group's
    rewards were equal, so no gradient). Without them a volunteer could not tell such a batch from one the trainer
    acknowledged and then lost."""
    group_batch: Annotated[list[U31], Field(max_length=MAX_GROUPS)] = []
    group_slot: Annotated[list[U31], Field(max_length=MAX_GROUPS)] = []
    """The groups the step trained, in the order it packed them: each one's batch (an index into the credits) and
    slot. With the batches' bodies, the previous version's engine state and the training settings, this is all a
    replay of the step needs (node/roles/audit.py)."""

    @model_validator(mode="after")
    def _columns(self) -> LedgerEntry:
        if self.parent >= self.version:
            raise ValueError(f"a step from version {self.parent} cannot produce version {self.version}")
        n = len(self.producers)
        if not len(self.digests) == len(self.made_on) == len(self.rollouts) == len(self.tokens) == n:
            raise ValueError("the batch columns differ in length")
        if not len(self.refused_reasons) == len(self.refused_counts) == len(self.refused_producers):
            raise ValueError("the refusal columns differ in length")
        if not len(self.dropped_producers) == len(self.dropped_digests) == len(self.dropped_reasons):
            raise ValueError("the dropped columns differ in length")
        if len(self.group_batch) != len(self.group_slot) or any(b >= n for b in self.group_batch):
            raise ValueError("the group columns differ in length or name a batch the entry does not credit")
        return self

    def credits(self) -> list[BatchCredit]:
        """The batches trained on, in order."""
        return [
            BatchCredit(*row)
            for row in zip(self.producers, self.digests, self.made_on, self.rollouts, self.tokens, strict=True)
        ]

    def drops(self) -> list[tuple[str, str, str]]:
        """Batches acknowledged, then dropped untrained: (producer, digest, reason)."""
        return list(zip(self.dropped_producers, self.dropped_digests, self.dropped_reasons, strict=True))

    def refusals(self) -> dict[str, dict[str, int]]:
        """Refused batches since the previous entry: producer -> reason -> count."""
        out: dict[str, dict[str, int]] = {}
        for node, reason, count in zip(self.refused_producers, self.refused_reasons, self.refused_counts, strict=True):
            out.setdefault(node, {})[reason] = out.get(node, {}).get(reason, 0) + count
        return out


def entry_of(
    run_id: str,
    epoch: int,
    version: int,
    parent: int,
    prev: str,
    created: float,
    train: str,
    credits: Sequence[BatchCredit],
    refusals: dict[str, dict[str, int]] | None = None,
    groups: Sequence[tuple[int, int]] = (),
    weights: str = "",
    state: str = "",
    dropped: Sequence[tuple[str, str, str]] = (),
) -> LedgerEntry:
    """An entry with its columns and Merkle root filled in from ``credits``, ``refusals`` and ``groups`` (each
    trained group's credit index and slot, in packing order)."""
    refused = [(node, reason, n) for node, by in sorted((refusals or {}).items()) for reason, n in sorted(by.items())]
    return LedgerEntry(
        run_id=run_id,
        epoch=epoch,
        version=version,
        parent=parent,
        prev=prev,
        created=created,
        train=train,
        weights=weights,
        state=state,
        producers=[c.producer for c in credits],
        digests=[c.digest for c in credits],
        made_on=[c.made_on for c in credits],
        rollouts=[c.rollouts for c in credits],
        tokens=[c.tokens for c in credits],
        root=merkle_root([leaf_hash(c) for c in credits]).hex(),
        refused_producers=[r[0] for r in refused],
        refused_reasons=[r[1] for r in refused],
        refused_counts=[r[2] for r in refused],
        dropped_producers=[d[0] for d in dropped],
        dropped_digests=[d[1] for d in dropped],
        dropped_reasons=[d[2] for d in dropped],
        group_batch=[g[0] for g in groups],
        group_slot=[g[1] for g in groups],
    )


def train_hash(train: WireModel) -> str:
    """An entry's ``train``: SHA-256 of the run spec's training settings (``RunSpec.train``) as msgpack."""
    return hashlib.sha256(pack(train.model_dump(mode="json"))).hexdigest()


def entry_hash(sealed: bytes) -> str:
    """The hash the next entry names in ``prev``: SHA-256 of the sealed entry as published."""
    return hashlib.sha256(sealed).hexdigest()


# -- Merkle tree (RFC 6962) -----------------------------------------------------------------------------------


def leaf_hash(credit: BatchCredit) -> bytes:
    row = [credit.producer, credit.digest, credit.made_on, credit.rollouts, credit.tokens]
    return hashlib.sha256(b"\x00" + pack(row)).digest()


def _node(left: bytes, right: bytes) -> bytes:
    return hashlib.sha256(b"\x01" + left + right).digest()


def merkle_root(leaves: Sequence[bytes]) -> bytes:
    """RFC 6962's Merkle tree hash of ``leaves`` (already leaf-hashed); SHA-256 of nothing for none."""
    if not leaves:
        return hashlib.sha256(b"").digest()
    level = list(leaves)
    # level by level, pairing from the left and carrying an odd last node up: the same tree as RFC 6962's
    # recursive split at the largest power of two below the size
    while len(level) > 1:
        paired = [_node(level[i], level[i + 1]) for i in range(0, len(level) - 1, 2)]
        if len(level) % 2:
            paired.append(level[-1])
        level = paired
    return level[0]


def inclusion_proof(leaves: Sequence[bytes], index: int) -> list[bytes]:
    """The audit path of leaf ``index``: the sibling hashes from the leaf up to the root."""
    if not 0 <= index < len(leaves):
        raise IndexError(f"leaf {index} of {len(leaves)}")
    proof: list[bytes] = []
    level, i = list(leaves), index
    while len(level) > 1:
        sibling = i ^ 1
        if sibling < len(level):
            proof.append(level[sibling])
        paired = [_node(level[j], level[j + 1]) for j in range(0, len(level) - 1, 2)]
        if len(level) % 2:
            paired.append(level[-1])
        level, i = paired, i // 2
    return proof


def verify_inclusion(leaf: bytes, index: int, size: int, proof: Sequence[bytes], root: bytes) -> bool:
    """Whether ``leaf`` is leaf ``index`` of a tree of ``size`` leaves whose root is ``root`` (RFC 9162 2.1.3.2)."""
    if not 0 <= index < size:
        return False
    fn, sn, r = index, size - 1, leaf
    for p in proof:
        if sn == 0:
            return False
        if fn & 1 or fn == sn:
            r = _node(p, r)
            if not fn & 1:
                while fn and not fn & 1:
                    fn >>= 1
                    sn >>= 1
        else:
            r = _node(r, p)
        fn >>= 1
        sn >>= 1
    return sn == 0 and r == root


# -- checking a chain -----------------------------------------------------------------------------------------


class LedgerError(ValueError):
    """An entry that breaks the chain: ``reason`` is countable, ``position`` counts entries from 0."""

    def __init__(self, reason: str, position: int, detail: str = "") -> None:
        super().__init__(f"ledger entry {position}: {reason}" + (f" ({detail})" if detail else ""))
        self.reason = reason
        self.position = position
        self.detail = detail


@dataclass(frozen=True)
class Head:
    """Where a checked chain ends: its length, the hash of its last entry (``genesis`` when empty), and that entry's
    epoch and version."""

    length: int
    hash: str
    epoch: int = 0
    version: int = 0


def start(run_id: str) -> Head:
    return Head(0, genesis(run_id))


def verify_entry(sealed: bytes, run_id: str, head: Head) -> tuple[Signed[LedgerEntry], Head]:
    """Check one sealed entry against the chain so far (``head``); returns it and the new head, or raises
    ``LedgerError``: signature and run first (cheap), then the link, then the Merkle root (work)."""
    at = head.length
    try:
        signed = open_signed(sealed, LedgerEntry)
    except Rejected as e:
        raise LedgerError(e.reason, at, e.detail) from None
    entry = signed.message
    if signed.signer_id != run_id or entry.run_id != run_id:
        raise LedgerError("wrong_signer", at, f"signed by {signed.signer_id}, for run {entry.run_id}")
    new_head = extend(head, entry, sealed)
    if merkle_root([leaf_hash(c) for c in entry.credits()]).hex() != entry.root:
        raise LedgerError("bad_root", at, "the batches do not hash to the entry's root")
    return signed, new_head


def extend(head: Head, entry: LedgerEntry, sealed: bytes) -> Head:
    """The head after ``entry`` (sealed as ``sealed``), or LedgerError when it does not link to ``head``: its
    ``prev``, its epoch and version. The checks that need no signature nor root: what a writer that sealed the entry
    itself still checks (node/roles/trainer_ledger.py)."""
    at = head.length
    if entry.prev != head.hash:
        raise LedgerError("fork", at, f"names {entry.prev[:16]}..., the chain's head is {head.hash[:16]}...")
    if head.length and entry.epoch < head.epoch:
        raise LedgerError("epoch_back", at, f"epoch {entry.epoch} after {head.epoch}")
    expected = head.version + 1 if head.length and entry.epoch == head.epoch else 1
    if entry.version != expected:
        raise LedgerError("gap", at, f"version {entry.version}, expected {expected}")
    return Head(at + 1, entry_hash(sealed), entry.epoch, entry.version)


def verify_chain(sealed_entries: Iterable[bytes], run_id: str, head: Head | None = None) -> Head:
    """Check sealed entries in order from ``head`` (the run's start when None); the new head, or LedgerError."""
    head = head or start(run_id)
    for sealed in sealed_entries:
        _, head = verify_entry(sealed, run_id, head)
    return head
