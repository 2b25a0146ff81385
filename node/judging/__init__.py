"""Judging rollouts: what a task is, what a completion earns, and whether a batch was honestly produced.

Owns task sets and rewards (``tasks``: the registry of task families, one module each in ``families/``), the jail
untrusted programs run in (``jail``), verifiers that run untrusted answers and programs in it (``verifiers``), the
validator's checks of a rollout batch (``validator``: shape, assignment, termination, TOPLOC, seeded sampling)
and held-out evaluation of a policy (``evaluate``).

May import: ``policy`` (to recompute what a model does), ``intellect_kernels``, ``intellect_protocol``; no role.
"""
