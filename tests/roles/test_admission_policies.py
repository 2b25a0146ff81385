"""The admission policy seam: a policy defined here and nowhere else (one class, one entry in ``POLICIES``) is the
one ``Admission`` asks at the door, with proof of work and probation still applied; a name the trainer does not
have is refused with a clear error."""

from __future__ import annotations

import time

import pytest

from intellect_node.roles.admission import POLICIES, Admission
from intellect_node.roles.admission_policies import AdmissionPolicy
from intellect_protocol.admission import pow_ok, solve_pow
from intellect_protocol.envelope import Rejected
from intellect_protocol.identity import Identity
from intellect_protocol.messages import AdmissionSpec, NodeRecord

RUN = Identity.generate().node_id


class EvenFirstDigit(AdmissionPolicy):
    """Node ids whose first hex digit is even."""

    def check(self, node_id: str, invited: bool) -> None:
        if int(node_id[0], 16) % 2:
            raise Rejected("not_admitted", "this run admits node ids with an even first hex digit only")


@pytest.fixture(autouse=True)
def even_registered(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(POLICIES, "even", EvenFirstDigit)  # the one line a real policy adds to POLICIES


def _refusal(admission: Admission, node_id: str, pow_nonce: int = 0) -> str:
    try:
        admission.check(
            NodeRecord(run_id=RUN, node_id=node_id, role="inference", updated=time.time(), pow_nonce=pow_nonce)
        )
    except Rejected as e:
        return e.reason
    return ""


def test_admission_asks_a_registered_policy() -> None:
    admission = Admission(AdmissionSpec(policy="even"), RUN)
    assert isinstance(admission.policy, EvenFirstDigit)
    for first in "0123456789abcdef":
        node_id = first + "7" * 31
        assert _refusal(admission, node_id) == ("" if int(first, 16) % 2 == 0 else "not_admitted")
    assert _refusal(admission, RUN) == ""  # the run's own key is always admitted
    admission.redeem("1" * 32, b"")  # takes no invites: a redemption is a no-op, admits nobody
    assert _refusal(admission, "1" * 32) == "not_admitted"


def test_proof_of_work_and_probation_apply_under_a_registered_policy() -> None:
    admission = Admission(AdmissionSpec(policy="even", pow_bits=8, probation_batches=1), RUN)
    node_id = "2" + "a" * 31
    unpaid = next(n for n in range(10_000) if not pow_ok(RUN, 0, node_id, n, 8))
    assert _refusal(admission, node_id, unpaid) == "pow"
    assert _refusal(admission, node_id, solve_pow(RUN, 0, node_id, 8)) == ""
    assert admission.on_probation(node_id)
    admission.batch_passed(node_id)
    assert not admission.on_probation(node_id)


def test_a_policy_the_trainer_does_not_have_is_refused_saying_which_it_knows() -> None:
    with pytest.raises(ValueError, match=r"'no_such_policy' is not one this node knows \(allowlist, even, invite"):
        Admission(AdmissionSpec(policy="no_such_policy"), RUN)
    with pytest.raises(ValueError, match="pattern"):
        AdmissionSpec(policy="Not A Name")
