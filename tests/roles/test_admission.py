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
from intellect_protocol.admission import invite_envelope, invite_text, pow_ok, solve_pow
from intellect_protocol.envelope import Rejected, seal
from intellect_protocol.identity import Identity
from intellect_protocol.messages import AdmissionSpec, Invite, NodeRecord

RUN_KEY = Identity.generate()
RUN = RUN_KEY.node_id


def _record(node: Identity, pow_nonce: int = 0) -> NodeRecord:
    return NodeRecord(run_id=RUN, node_id=node.node_id, role="inference", updated=time.time(), pow_nonce=pow_nonce)


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


def _redeemed(admission: Admission, node: Identity, invite: bytes) -> str:
    try:
        admission.redeem(node.node_id, invite)
    except Rejected as e:
        return e.reason
    return ""


def test_invites_are_signed_by_the_run_key_expire_and_run_out_across_restarts(tmp_path: Path) -> None:
    path = tmp_path / "admission" / f"{RUN}.json"
    admission = Admission(AdmissionSpec(policy="invite"), RUN, path)
    token = invite_envelope(mint_invite(RUN_KEY, uses=2, days=1))
    a, b, c = Identity.generate(), Identity.generate(), Identity.generate()
    assert _redeemed(admission, a, b"") == "not_admitted"  # no invite
    assert _refusal(admission, _record(a)) == "not_admitted"  # not redeemed: refused at the door too
    assert _redeemed(admission, a, token) == ""
    assert _refusal(admission, _record(a)) == ""  # admitted by its redemption; the record carries nothing
    assert _redeemed(admission, a, token) == ""  # the same node again does not use the invite up ...
    assert _redeemed(admission, a, b"") == ""  # ... and needs no invite after a restart
    assert _redeemed(admission, b, token) == ""
    assert _redeemed(admission, c, token) == "invite_used_up"
    forged = seal(Identity.generate(), Invite(run_id=RUN, token_id="0" * 16, expires=time.time() + 60, uses=9))
    assert _redeemed(admission, c, forged) == "bad_invite"
    expired = seal(RUN_KEY, Invite(run_id=RUN, token_id="1" * 16, expires=time.time() - 1, uses=9))
    assert _redeemed(admission, c, expired) == "invite_expired"
    assert _redeemed(admission, c, b"\x00garbage") == "bad_invite"
    assert _refusal(admission, _record(c)) == "not_admitted"
    # a restarted trainer, a new epoch or a --fresh start: the redemptions are read back from their own file
    restarted = Admission(AdmissionSpec(policy="invite"), RUN, path)
    assert _redeemed(restarted, c, token) == "invite_used_up"
    assert _refusal(restarted, _record(a)) == "" and _refusal(restarted, _record(b)) == ""
    assert _refusal(restarted, _record(c)) == "not_admitted"


def test_an_invite_that_is_already_expired_is_not_minted() -> None:
    with pytest.raises(ValueError, match="days > 0"):
        mint_invite(RUN_KEY, uses=1, days=0)


def test_a_new_identity_pays_its_proof_of_work_and_earns_trust() -> None:
    admission = Admission(AdmissionSpec(pow_bits=12, probation_batches=2), RUN)
    node = Identity.generate()
    unpaid = next(n for n in range(10_000) if not pow_ok(RUN, 0, node.node_id, n, 12))
    assert _refusal(admission, _record(node, pow_nonce=unpaid)) == "pow"
    nonce = solve_pow(RUN, 0, node.node_id, 12)
    assert _refusal(admission, _record(node, pow_nonce=nonce)) == ""
    other = next(k for k in (Identity.generate() for _ in range(100)) if not pow_ok(RUN, 0, k.node_id, nonce, 12))
    assert _refusal(admission, _record(other, pow_nonce=nonce)) == "pow"  # a proof is for one identity only
    next_epoch = Admission(AdmissionSpec(pow_bits=12, probation_batches=2), RUN, epoch=1)
    if not pow_ok(RUN, 1, node.node_id, nonce, 12):  # (a nonce may happen to prove both: 1 in 4096)
        assert _refusal(next_epoch, _record(node, pow_nonce=nonce)) == "pow"  # nor for another start of the run
    assert _refusal(next_epoch, _record(node, pow_nonce=solve_pow(RUN, 1, node.node_id, 12))) == ""
    assert admission.on_probation(node.node_id)
    admission.batch_passed(node.node_id)
    admission.batch_passed(node.node_id)
    assert not admission.on_probation(node.node_id)


@pytest.mark.integration
def test_an_invite_only_run_admits_the_invited_once_and_tells_others_why_not(tmp_path: Path) -> None:
    """Real processes. The invite in the join line is for one node: the invitee redeems it at join, and a stranger
    who got hold of the same token afterwards (it is in no DHT record; say it was seen over a shoulder) is refused
    at join, with the reason; so is a node with an expired invite. None of them runs on as if admitted."""
    logs = tmp_path / "logs"
    trainer = NodeProcess(
        "trainer",
        [
            "bootstrap",
            "--data-dir",
            str(tmp_path / "trainer"),
            "--max-steps",
            "3",
            "--set",
            'admission.policy="invite"',
            "--invite-uses",
            "1",
        ],
        logs,
    )
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
        thief = NodeProcess("thief", [*base, "--data-dir", str(tmp_path / "s"), "--invite", invite], logs)
        nodes.append(thief)
        with pytest.raises(NodeExited):
            thief.wait_ready(timeout=120)
        assert "invite_used_up" in thief.tail(5) and "intellect-node invite" in thief.tail(5)
        run_key = Identity.from_private_bytes((tmp_path / "trainer" / "node.key").read_bytes())
        expired = invite_text(seal(run_key, Invite(run_id=run_key.node_id, token_id="2" * 16, expires=time.time() - 1)))
        late = NodeProcess("late", [*base, "--data-dir", str(tmp_path / "l"), "--invite", expired], logs)
        nodes.append(late)
        with pytest.raises(NodeExited):
            late.wait_ready(timeout=120)
        assert "invite_expired" in late.tail(5)
        trainer.wait_for_line("STEP 3 ", timeout=300)
        with urllib.request.urlopen(ready["status_url"] + "/status", timeout=10) as resp:
            status = json.load(resp)
        assert status["accepted_groups_by_node"].get(node_id, 0) > 0
        assert set(status["accepted_groups_by_node"]) <= {node_id}
    finally:
        for node in reversed(nodes):
            node.stop()
