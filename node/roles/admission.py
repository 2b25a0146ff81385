"""The trainer's admission policy (the run spec's ``admission``): who may submit, and how much a newcomer may ask.

``check(record)`` runs at the door on every batch and relay slot request, after the signature and the registry
lookup and before any work: the policy (open, allowlist, invite), then the proof of work. ``on_probation`` says
whether a key has yet to earn trust: the trainer then checks every one of its completions itself and holds at most
``probation_pending`` of its batches at once, and all keys on probation together at most ``probation_share`` of
the pending capacity, so a flood of fresh keys cannot crowd out the nodes that already proved honest.
"""

from __future__ import annotations

import secrets
import time
from collections import Counter
from typing import Any

from intellect_protocol.admission import invite_text, pow_ok
from intellect_protocol.envelope import Rejected, open_signed, seal
from intellect_protocol.identity import Identity
from intellect_protocol.messages import AdmissionSpec, Invite, NodeRecord

MAX_TRACKED = 100_000


class Admission:
    def __init__(self, spec: AdmissionSpec, run_id: str) -> None:
        self.spec = spec
        self.run_id = run_id
        self.passed: Counter[str] = Counter()
        """Batches of each node that passed validation."""
        self.invite_users: dict[str, set[str]] = {}
        """Invite token id -> the node ids that joined with it."""
        self._admitted: dict[str, bytes] = {}
        """Node id -> the invite it was admitted with (checked once per invite, not per batch)."""

    def check(self, record: NodeRecord) -> None:
        """Raise Rejected('not_admitted' | 'bad_invite' | 'invite_used_up' | 'invite_expired' | 'pow') unless the
        run's policy admits this node."""
        node_id = record.node_id
        if node_id == self.run_id:
            return
        policy = self.spec.policy
        if policy == "allowlist" and node_id not in self.spec.allowlist:
            raise Rejected("not_admitted", "this run admits listed node ids only; ask its operator to list yours")
        if policy == "invite":
            self._check_invite(record)
        if not pow_ok(self.run_id, node_id, record.pow_nonce, self.spec.pow_bits):
            raise Rejected("pow", f"this run asks every new identity for {self.spec.pow_bits} bits of proof of work")

    def _check_invite(self, record: NodeRecord) -> None:
        if self._admitted.get(record.node_id) == record.invite and record.invite:
            return
        if not record.invite:
            raise Rejected("not_admitted", "this run admits invited nodes only: join with --invite TOKEN")
        try:
            signed = open_signed(record.invite, Invite)
        except Rejected as e:
            raise Rejected("bad_invite", f"the invite does not verify ({e.reason})") from None
        invite = signed.message
        if signed.signer_id != self.run_id or invite.run_id != self.run_id:
            raise Rejected("bad_invite", "the invite is not signed by this run's key")
        if invite.expires < time.time():
            raise Rejected("invite_expired", "the invite has expired; ask the run's operator for a new one")
        users = self.invite_users.setdefault(invite.token_id, set())
        if record.node_id not in users:
            if len(users) >= invite.uses:
                raise Rejected("invite_used_up", f"the invite was for {invite.uses} node(s), all taken")
            users.add(record.node_id)
        if len(self._admitted) > MAX_TRACKED:
            self._admitted.clear()
        self._admitted[record.node_id] = record.invite

    def on_probation(self, node_id: str) -> bool:
        return node_id != self.run_id and self.passed[node_id] < self.spec.probation_batches

    def batch_passed(self, node_id: str) -> None:
        self.passed[node_id] += 1

    def state(self) -> dict[str, Any]:
        """What a checkpoint keeps (trust earned and invites used survive a restart)."""
        return {"passed": dict(self.passed), "invite_users": {k: sorted(v) for k, v in self.invite_users.items()}}

    def restore(self, state: dict[str, Any]) -> None:
        self.passed = Counter({str(k): int(v) for k, v in state.get("passed", {}).items()})
        self.invite_users = {str(k): set(v) for k, v in state.get("invite_users", {}).items()}


def mint_invite(run_key: Identity, uses: int, days: float) -> str:
    """A new invite to the run of ``run_key``: valid ``days`` days, for ``uses`` distinct nodes (text for --invite)."""
    invite = Invite(run_id=run_key.node_id, token_id=secrets.token_hex(8), expires=time.time() + days * 86400,
                    uses=uses)  # fmt: skip
    return invite_text(seal(run_key, invite))
