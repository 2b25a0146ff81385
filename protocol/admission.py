"""Admission of identities to a run: proof of work on a node id, and invite tokens as text.

Pure functions both sides agree on; the trainer enforces the run's AdmissionSpec (node/roles/admission.py).
"""

from __future__ import annotations

import base64
import hashlib

POW_DOMAIN = "intellect-node/pow"


def pow_digest(run_id: str, epoch: int, node_id: str, nonce: int) -> bytes:
    """What a proof of work hashes: the run, its epoch (a proof made for one start of the run is worth nothing in
    the next), the node id and the nonce."""
    return hashlib.sha256(f"{POW_DOMAIN}/{run_id}/{epoch}/{node_id}/{nonce}".encode()).digest()


def leading_zero_bits(digest: bytes) -> int:
    value = int.from_bytes(digest, "big")
    return len(digest) * 8 - value.bit_length()


def pow_ok(run_id: str, epoch: int, node_id: str, nonce: int, bits: int) -> bool:
    """Whether ``nonce`` proves ``bits`` bits of work on ``node_id`` for this run's epoch (free when ``bits`` is 0)."""
    return bits <= 0 or leading_zero_bits(pow_digest(run_id, epoch, node_id, nonce)) >= bits


def solve_pow(run_id: str, epoch: int, node_id: str, bits: int) -> int:
    """The first nonce that proves ``bits`` bits of work (about 2**bits hashes)."""
    nonce = 0
    while not pow_ok(run_id, epoch, node_id, nonce, bits):
        nonce += 1
    return nonce


def invite_text(envelope: bytes) -> str:
    """An invite envelope as one copy-pasteable word (base64url, no padding)."""
    return base64.urlsafe_b64encode(envelope).decode().rstrip("=")


def invite_envelope(text: str) -> bytes:
    """The envelope of an invite given as text; raises ValueError when it is not base64url."""
    text = text.strip()
    if len(text) > 1024:
        raise ValueError("an invite is at most 1024 characters")
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))
