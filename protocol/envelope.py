"""The signed envelope every message travels in.

Wire form (msgpack map): ``{"v": protocol, "kind": str, "signer": 32-byte Ed25519 public key,
"body": msgpack bytes of the message, "sig": 64-byte signature over (kind, body)}``. The body is verified
before it is decoded, and decoded only into the schema the receiver expects.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Generic, TypeVar

import pydantic

from intellect_protocol import PROTOCOL_VERSION
from intellect_protocol.codec import CodecError, pack, unpack
from intellect_protocol.identity import Identity, node_id_of, verify
from intellect_protocol.messages import WireModel

M = TypeVar("M", bound=WireModel)


class Rejected(ValueError):
    """A message refused at the peer boundary. ``reason`` is a short, countable label."""

    def __init__(self, reason: str, detail: str = "") -> None:
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason = reason
        self.detail = detail


@dataclass(frozen=True)
class Signed(Generic[M]):
    message: M
    signer: bytes
    signer_id: str


def seal(identity: Identity, message: WireModel) -> bytes:
    """Encode ``message`` and sign it with ``identity``; the result is what goes on the wire."""
    body = pack(message.model_dump(mode="python"))
    envelope = {
        "v": PROTOCOL_VERSION,
        "kind": message.KIND,
        "signer": identity.public_key,
        "body": body,
        "sig": identity.sign(message.KIND, body),
    }
    data = pack(envelope)
    if len(data) > message.CHANNEL.value:
        raise ValueError(f"{message.KIND} of {len(data)} bytes exceeds its limit of {message.CHANNEL.value}")
    return data


def open_envelope(data: bytes, schema: type[M]) -> tuple[bytes, bytes]:
    """Check size, envelope, version, kind and signature; returns (signer, body) with the body still encoded.

    Lets a receiver decide whether it wants this signer's message at all before it pays for decoding the body.
    """
    try:
        env = unpack(data, schema.CHANNEL)
    except CodecError as e:
        raise Rejected(e.reason, e.detail) from None
    if not isinstance(env, dict) or not {"v", "kind", "signer", "body", "sig"} <= env.keys():
        raise Rejected("malformed", "not a signed envelope")
    if env["v"] != PROTOCOL_VERSION:
        raise Rejected("version", f"protocol {env['v']!r}, this node speaks {PROTOCOL_VERSION}")
    if env["kind"] != schema.KIND:
        raise Rejected("kind", f"expected {schema.KIND}, got {str(env['kind'])[:32]!r}")
    signer, body, sig = env["signer"], env["body"], env["sig"]
    if not (isinstance(signer, bytes) and isinstance(body, bytes) and isinstance(sig, bytes)):
        raise Rejected("malformed", "signer, body and sig must be bytes")
    if not verify(signer, schema.KIND, body, sig):
        raise Rejected("bad_signature")
    return signer, body


def decode_body(signer: bytes, body: bytes, schema: type[M]) -> Signed[M]:
    """Decode a verified body into ``schema``; raises Rejected('malformed' | 'oversized' | 'schema')."""
    try:
        message = schema.model_validate(unpack(body, schema.CHANNEL))
    except CodecError as e:
        raise Rejected(e.reason, e.detail) from None
    except pydantic.ValidationError as e:
        raise Rejected("schema", str(e).replace("\n", " ")[:300]) from None
    return Signed(message=message, signer=signer, signer_id=node_id_of(signer))


def open_signed(data: bytes, schema: type[M]) -> Signed[M]:
    """Check size, envelope, version, kind and signature, then decode the body into ``schema``.

    Raises Rejected with reason one of: oversized, malformed, version, kind, bad_signature, schema.
    """
    return decode_body(*open_envelope(data, schema), schema)
