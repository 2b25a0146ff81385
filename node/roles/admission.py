"""The trainer's admission policy (the run spec's ``admission``): who may submit, and how much a newcomer may ask.

``check(record)`` runs at the door on every batch, announcement and relay slot request, after the signature and the
registry lookup and before any work: the policy, then the proof of work. The policy is the ``AdmissionPolicy``
(``admission_policies.py``) that ``POLICIES`` registers under the spec's name (``open``, ``allowlist``, ``invite``;
adding one is a module and one line in ``POLICIES``). ``on_probation`` says whether a key has yet to earn trust:
the trainer then checks every one of its completions itself and holds at most ``probation_pending`` of its batches
at once, and all keys on probation together at most ``probation_share`` of the pending capacity, so a flood of
fresh keys cannot crowd out the nodes that already proved honest.

Invites are redeemed, not shown: a node sends its invite once, in a ``Redeem`` request signed by its own key
(``redeem``, over the trainer's redeem protocol), and the trainer binds one of the invite's uses to that node id.
Nothing else ever carries the invite (node records do not), so an invite read off the wire by a stranger is one
the invitee already used, and a stranger cannot redeem an invite it never saw. Redemptions are written to
``Redemptions`` (a file in the trainer's data dir, outside the checkpoints) before the node is told it is in: they
hold across restarts, ``--fresh`` starts and epochs of the run.
"""

from __future__ import annotations

import json
import os
import secrets
import time
from collections import Counter
from pathlib import Path
from typing import Any

from intellect_node.roles.admission_policies import AdmissionPolicy, Allowlist, InviteOnly, Open
from intellect_protocol.admission import invite_text, pow_ok
from intellect_protocol.envelope import Rejected, open_signed, seal
from intellect_protocol.identity import Identity
from intellect_protocol.messages import AdmissionSpec, Invite, NodeRecord

POLICIES: dict[str, type[AdmissionPolicy]] = {
    "open": Open,
    "allowlist": Allowlist,
    "invite": InviteOnly,
}
"""Admission policies by the name a run spec's ``admission.policy`` gives: one line per policy."""


def make_policy(spec: AdmissionSpec) -> AdmissionPolicy:
    """The policy ``spec`` names; raises ``ValueError`` naming the policies this node knows."""
    policy = POLICIES.get(spec.policy)
    if policy is None:
        raise ValueError(
            f"admission.policy {spec.policy!r} is not one this node knows ({', '.join(sorted(POLICIES))}): "
            "set one of those, or run a version of intellect-node that has it (a policy is registered in "
            "POLICIES, intellect_node.roles.admission)"
        )
    return policy(spec)


class Redemptions:
    """Which node ids redeemed which invite: durable (written and fsynced before a redemption is answered)."""

    def __init__(self, path: Path | None) -> None:
        self.path = path
        self.by_token: dict[str, set[str]] = {}
        """Invite token id -> the node ids that redeemed it."""
        self.by_node: dict[str, str] = {}
        """Node id -> the token id it was admitted with."""
        if path is not None and path.exists():
            saved = json.loads(path.read_text())
            for token_id, nodes in saved.get("invites", {}).items():
                self.by_token[str(token_id)] = {str(n) for n in nodes}
                for node_id in nodes:
                    self.by_node[str(node_id)] = str(token_id)

    def add(self, token_id: str, node_id: str) -> None:
        self.by_token.setdefault(token_id, set()).add(node_id)
        self.by_node[node_id] = token_id
        if self.path is None:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_suffix(".tmp")
        with open(tmp, "w") as f:
            json.dump({"invites": {t: sorted(n) for t, n in self.by_token.items()}}, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, self.path)


class Admission:
    def __init__(self, spec: AdmissionSpec, run_id: str, redemptions: Path | None = None, epoch: int = 0) -> None:
        self.spec = spec
        self.run_id = run_id
        self.epoch = epoch
        """The run epoch proofs of work must be made for."""
        self.passed: Counter[str] = Counter()
        """Batches of each node that passed validation."""
        self.redemptions = Redemptions(redemptions)
        self.policy = make_policy(spec)

    def check(self, record: NodeRecord) -> None:
        """Raise Rejected('not_admitted' | 'pow') unless the run's policy admits this node."""
        node_id = record.node_id
        if node_id == self.run_id:
            return
        self.policy.check(node_id, node_id in self.redemptions.by_node)
        if not pow_ok(self.run_id, self.epoch, node_id, record.pow_nonce, self.spec.pow_bits):
            raise Rejected("pow", f"this run asks every new identity for {self.spec.pow_bits} bits of proof of work")

    def redeem(self, node_id: str, envelope: bytes) -> None:
        """Admit ``node_id`` with the invite ``envelope`` (its signer was checked by the caller), or say why not:
        Rejected('not_admitted' | 'bad_invite' | 'invite_expired' | 'invite_used_up'). A node admitted before is
        admitted again, with or without an invite. Blocks while the redemption is written."""
        if node_id == self.run_id or node_id in self.redemptions.by_node or not self.policy.takes_invites:
            return
        if not envelope:
            raise Rejected("not_admitted", "this run admits invited nodes only: join with --invite TOKEN")
        try:
            signed = open_signed(envelope, Invite)
        except Rejected as e:
            raise Rejected("bad_invite", f"the invite does not verify ({e.reason})") from None
        invite = signed.message
        if signed.signer_id != self.run_id or invite.run_id != self.run_id:
            raise Rejected("bad_invite", "the invite is not signed by this run's key")
        if invite.expires < time.time():
            raise Rejected("invite_expired", "the invite has expired; ask the run's operator for a new one")
        if len(self.redemptions.by_token.get(invite.token_id, ())) >= invite.uses:
            raise Rejected(
                "invite_used_up",
                f"the invite was for {invite.uses} node(s), all taken; ask the run's operator for a new one",
            )
        self.redemptions.add(invite.token_id, node_id)

    def on_probation(self, node_id: str) -> bool:
        return node_id != self.run_id and self.passed[node_id] < self.spec.probation_batches

    def batch_passed(self, node_id: str) -> None:
        self.passed[node_id] += 1

    def state(self) -> dict[str, Any]:
        """What a checkpoint keeps (trust earned survives a restart; redemptions have their own file)."""
        return {"passed": dict(self.passed)}

    def restore(self, state: dict[str, Any]) -> None:
        self.passed = Counter({str(k): int(v) for k, v in state.get("passed", {}).items()})
        for token_id, nodes in state.get("invite_users", {}).items():  # a checkpoint from before Redemptions
            for node_id in nodes:
                if str(node_id) not in self.redemptions.by_node:
                    self.redemptions.add(str(token_id), str(node_id))


def mint_invite(run_key: Identity, uses: int, days: float) -> str:
    """A new invite to the run of ``run_key``: valid ``days`` days, for ``uses`` distinct nodes (text for --invite)."""
    if days <= 0:
        raise ValueError(f"an invite must be valid for some time (days > 0, not {days})")
    invite = Invite(
        run_id=run_key.node_id, token_id=secrets.token_hex(8), expires=time.time() + days * 86400, uses=uses
    )
    return invite_text(seal(run_key, invite))
