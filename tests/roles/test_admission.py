"""Admission: who may take part in a run, tried with forged, expired and used-up invites, unlisted keys and keys
without their proof of work; then an invite-only run with real processes."""

from __future__ import annotations

import json
import time
import urllib.request
from pathlib import Path

import pytest

from intellect_node.launch import NodeExited, NodeProcess
from intellect_node.roles.admission import Admission, mint_invite
from intellect_protocol.admission import invite_envelope, pow_ok, solve_pow
from intellect_protocol.envelope import Rejected, seal
from intellect_protocol.identity import Identity
from intellect_protocol.messages import AdmissionSpec, Invite, NodeRecord

RUN_KEY = Identity.generate()
RUN = RUN_KEY.node_id


def _record(node: Identity, invite: bytes = b"", pow_nonce: int = 0) -> NodeRecord:
    return NodeRecord(run_id=RUN, node_id=node.node_id, role="inference", updated=time.time(), invite=invite,
                      pow_nonce=pow_nonce)  # fmt: skip


def _refusal(admission: Admission, record: NodeRecord) -> str:
    try:
        admission.check(record)
    except Rejected as e:
        return e.reason
    return ""


def test_an_allowlist_admits_the_listed_only() -> None:
    listed, other = Identity.generate(), Identity.generate()
    admission = Admission(AdmissionSpec(policy="allowlist", allowlist=[listed.node_id]), RUN)
    assert _refusal(admission, _record(listed)) == ""
    assert _refusal(admission, _record(other)) == "not_admitted"


def test_invites_are_signed_by_the_run_key_expire_and_run_out() -> None:
    admission = Admission(AdmissionSpec(policy="invite"), RUN)
    token = invite_envelope(mint_invite(RUN_KEY, uses=2, days=1))
    a, b, c = Identity.generate(), Identity.generate(), Identity.generate()
    assert _refusal(admission, _record(a)) == "not_admitted"  # no invite
    assert _refusal(admission, _record(a, token)) == ""
    assert _refusal(admission, _record(a, token)) == ""  # the same node again does not use the invite up
    assert _refusal(admission, _record(b, token)) == ""
    assert _refusal(admission, _record(c, token)) == "invite_used_up"
    forged = seal(Identity.generate(), Invite(run_id=RUN, token_id="0" * 16, expires=time.time() + 60, uses=9))
    assert _refusal(admission, _record(c, forged)) == "bad_invite"
    expired = seal(RUN_KEY, Invite(run_id=RUN, token_id="1" * 16, expires=time.time() - 1, uses=9))
    assert _refusal(admission, _record(c, expired)) == "invite_expired"
    assert _refusal(admission, _record(c, b"\x00garbage")) == "bad_invite"
    restored = Admission(AdmissionSpec(policy="invite"), RUN)  # a restarted trainer keeps the invite's count
    restored.restore(admission.state())
    assert _refusal(restored, _record(c, token)) == "invite_used_up"


def test_a_new_identity_pays_its_proof_of_work_and_earns_trust() -> None:
    admission = Admission(AdmissionSpec(pow_bits=12, probation_batches=2), RUN)
    node = Identity.generate()
    unpaid = next(n for n in range(10_000) if not pow_ok(RUN, node.node_id, n, 12))
    assert _refusal(admission, _record(node, pow_nonce=unpaid)) == "pow"
    nonce = solve_pow(RUN, node.node_id, 12)
    assert _refusal(admission, _record(node, pow_nonce=nonce)) == ""
    other = next(k for k in (Identity.generate() for _ in range(100)) if not pow_ok(RUN, k.node_id, nonce, 12))
    assert _refusal(admission, _record(other, pow_nonce=nonce)) == "pow"  # a proof is for one identity only
    assert admission.on_probation(node.node_id)
    admission.batch_passed(node.node_id)
    admission.batch_passed(node.node_id)
    assert not admission.on_probation(node.node_id)


def test_an_invite_only_run_admits_the_invited_and_tells_others_how_to_join(tmp_path: Path) -> None:
    logs = tmp_path / "logs"
    trainer = NodeProcess("trainer", ["bootstrap", "--data-dir", str(tmp_path / "trainer"), "--max-steps", "3",
                                      "--set", 'admission.policy="invite"', "--invite-uses", "1"], logs)  # fmt: skip
    nodes = [trainer]
    try:
        ready = trainer.wait_ready(timeout=120)
        join = ready["join"].split()
        assert "--invite" in join
        invite = join[join.index("--invite") + 1]
        base = ["join", "--role", "inference", "--peers", ready["p2p_maddrs"][0], "--run-id", ready["run_id"]]
        uninvited = NodeProcess("uninvited", [*base, "--data-dir", str(tmp_path / "u")], logs)
        nodes.append(uninvited)
        with pytest.raises(NodeExited):
            uninvited.wait_ready(timeout=120)
        assert "--invite TOKEN" in uninvited.tail(5)
        invited = NodeProcess("invited", [*base, "--data-dir", str(tmp_path / "i"), "--invite", invite], logs)
        nodes.append(invited)
        node_id = invited.wait_ready(timeout=120)["node_id"]
        trainer.wait_for_line("STEP 3 ", timeout=300)
        with urllib.request.urlopen(ready["status_url"] + "/status", timeout=10) as resp:
            status = json.load(resp)
        assert status["accepted_groups_by_node"].get(node_id, 0) > 0
    finally:
        for node in reversed(nodes):
            node.stop()
