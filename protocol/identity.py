"""Ed25519 identities: every node has one; the trainer's is the run key.

A node id is the hex of the first 16 bytes of SHA-256 over the raw public key, so anyone holding a public key
can check which node id it belongs to, and a run id is the node id of the run key. Signatures are always over a
domain-separated message (``intellect-node/v<protocol>/<kind>\\0<body>``), so a signature made for one kind of
message can never be replayed as another.
"""

from __future__ import annotations

import hashlib

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey
from cryptography.hazmat.primitives.serialization import Encoding, NoEncryption, PrivateFormat, PublicFormat

from intellect_protocol import PROTOCOL_VERSION

PUBLIC_KEY_BYTES = 32
SIGNATURE_BYTES = 64


def node_id_of(public_key: bytes) -> str:
    """The node id (32 hex characters) that a raw 32-byte Ed25519 public key stands for."""
    if len(public_key) != PUBLIC_KEY_BYTES:
        raise ValueError(f"an Ed25519 public key has {PUBLIC_KEY_BYTES} bytes, got {len(public_key)}")
    return hashlib.sha256(public_key).digest()[:16].hex()


def signing_message(kind: str, body: bytes) -> bytes:
    return f"intellect-node/v{PROTOCOL_VERSION}/{kind}".encode() + b"\0" + body


class Identity:
    """A private Ed25519 key with the node id it stands for."""

    def __init__(self, private_key: Ed25519PrivateKey) -> None:
        self._key = private_key
        self.public_key: bytes = private_key.public_key().public_bytes(Encoding.Raw, PublicFormat.Raw)
        self.node_id: str = node_id_of(self.public_key)

    @classmethod
    def generate(cls) -> Identity:
        return cls(Ed25519PrivateKey.generate())

    @classmethod
    def from_private_bytes(cls, raw: bytes) -> Identity:
        return cls(Ed25519PrivateKey.from_private_bytes(raw))

    def private_bytes(self) -> bytes:
        return self._key.private_bytes(Encoding.Raw, PrivateFormat.Raw, NoEncryption())

    def sign(self, kind: str, body: bytes) -> bytes:
        return self._key.sign(signing_message(kind, body))

    def __repr__(self) -> str:
        return f"Identity(node_id={self.node_id})"


def verify(public_key: bytes, kind: str, body: bytes, signature: bytes) -> bool:
    """True when ``signature`` is the signature of ``public_key`` over (kind, body)."""
    if len(public_key) != PUBLIC_KEY_BYTES or len(signature) != SIGNATURE_BYTES:
        return False
    try:
        Ed25519PublicKey.from_public_bytes(public_key).verify(signature, signing_message(kind, body))
    except (InvalidSignature, ValueError):
        return False
    return True
