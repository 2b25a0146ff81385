"""Admission policies: who may submit to a run (the run spec's ``admission.policy`` names one).

A policy is an ``AdmissionPolicy``: given the run's ``AdmissionSpec`` it answers, for a node id, admitted or
``Rejected("not_admitted", what its operator can do)``. ``Admission.check`` (``admission.py``) asks it at the door
on every batch, announcement and relay slot request, after the signature and the registry lookup and before any
work, so a policy is cheap: no I/O, no blocking. Probation, proof of work and invite redemption stay with
``Admission`` and apply under every policy.

Adding a policy: a module with an ``AdmissionPolicy`` subclass and one line in ``POLICIES`` (``admission.py``).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import ClassVar

from intellect_protocol.envelope import Rejected
from intellect_protocol.messages import AdmissionSpec


class AdmissionPolicy(ABC):
    takes_invites: ClassVar[bool] = False
    """Whether nodes join by redeeming an invite: ``Admission.redeem`` binds one to a node only under such a policy."""

    def __init__(self, spec: AdmissionSpec) -> None:
        self.spec = spec

    @abstractmethod
    def check(self, node_id: str, invited: bool) -> None:
        """Raise ``Rejected("not_admitted", ...)`` naming what to do unless ``node_id`` is admitted; ``invited``:
        it redeemed one of the run's invites. Never called for the run's own key."""


class Open(AdmissionPolicy):
    """Anyone may join; a new key is on probation until it has earned trust (``Admission.on_probation``)."""

    def check(self, node_id: str, invited: bool) -> None:
        return


class Allowlist(AdmissionPolicy):
    """The node ids in ``spec.allowlist`` only."""

    def check(self, node_id: str, invited: bool) -> None:
        if node_id not in self.spec.allowlist:
            raise Rejected("not_admitted", "this run admits listed node ids only; ask its operator to list yours")


class InviteOnly(AdmissionPolicy):
    """Nodes that redeemed an invite signed by the run key (``Admission.redeem``)."""

    takes_invites = True

    def check(self, node_id: str, invited: bool) -> None:
        if not invited:
            raise Rejected("not_admitted", "this run admits invited nodes only: join with --invite TOKEN")
