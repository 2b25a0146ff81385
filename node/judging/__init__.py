"""Judging rollouts: what a task is, what a completion earns, and whether a batch was honestly produced.

Owns task sets and rewards (``tasks``), verifiers that run untrusted answers and programs (``verifiers``), the
validator's checks of a rollout batch (``validator``: shape, assignment, termination, TOPLOC, seeded sampling)
and held-out evaluation of a policy (``evaluate``).

May import: ``policy`` (to recompute what a model does), ``intellect_kernels``, ``intellect_protocol``; no role.
"""
