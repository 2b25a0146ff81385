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
    """A message refused at the peer boundary. ``reason`` is a short, countable label; ``retry_after_s``, where
    the refusal is only for now (``busy``, ``backlog_full``), the refuser's estimate of when to send again (0: none
    given)."""

    def __init__(self, reason: str, detail: str = "", retry_after_s: float = 0.0) -> None:
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason = reason
        self.detail = detail
        self.retry_after_s = retry_after_s


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


class _Reader:
    """Reads an envelope's few msgpack items by hand: nothing is allocated that the fixed shape does not need."""

    def __init__(self, data: bytes) -> None:
        self.data = data
        self.at = 0

    def take(self, n: int) -> bytes:
        if self.at + n > len(self.data):
            raise Rejected("malformed", "the envelope ends early")
        out = self.data[self.at : self.at + n]
        self.at += n
        return bytes(out)

    def byte(self) -> int:
        return self.take(1)[0]

    def uint(self) -> int:
        b = self.byte()
        if b <= 0x7F:
            return b
        if b in (0xCC, 0xCD, 0xCE):
            return int.from_bytes(self.take({0xCC: 1, 0xCD: 2, 0xCE: 4}[b]), "big")
        raise Rejected("malformed", "the protocol version is not a small unsigned integer")

    def str(self, limit: int) -> str:
        b = self.byte()
        if 0xA0 <= b <= 0xBF:
            n = b & 0x1F
        elif b == 0xD9:
            n = self.byte()
        else:
            raise Rejected("malformed", "expected a short string in the envelope")
        if n > limit:
            raise Rejected("malformed", f"a string of {n} bytes in the envelope (at most {limit})")
        try:
            return self.take(n).decode("utf-8")
        except UnicodeDecodeError:
            raise Rejected("malformed", "a string in the envelope is not UTF-8") from None

    def bin(self, limit: int) -> bytes:
        b = self.byte()
        if b not in (0xC4, 0xC5, 0xC6):
            raise Rejected("malformed", "signer, body and sig must be bytes")
        n = int.from_bytes(self.take({0xC4: 1, 0xC5: 2, 0xC6: 4}[b]), "big")
        if n > limit:
            raise Rejected("malformed", f"a field of {n} bytes in the envelope (at most {limit})")
        return self.take(n)


_FIELDS = ("v", "kind", "signer", "body", "sig")


def _parse(data: bytes, limit: int) -> dict[str, object]:
    """The envelope's five fields, read strictly: a map of exactly those keys, each of its type and size, and
    nothing after it. No general msgpack decoder sees a peer's bytes before the signature is checked."""
    reader = _Reader(data)
    if reader.byte() != 0x80 | len(_FIELDS):
        raise Rejected("malformed", "not a signed envelope")
    env: dict[str, object] = {}
    for _ in _FIELDS:
        key = reader.str(8)
        if key not in _FIELDS or key in env:
            raise Rejected("malformed", "not a signed envelope")
        if key == "v":
            env[key] = reader.uint()
        elif key == "kind":
            env[key] = reader.str(64)
        elif key == "signer":
            env[key] = reader.bin(32)
        elif key == "sig":
            env[key] = reader.bin(64)
        else:
            env[key] = reader.bin(limit)
    if reader.at != len(data):
        raise Rejected("malformed", "bytes after the envelope")
    return env


def kind_of(data: bytes, limit: int) -> str:
    """The kind an envelope of at most ``limit`` bytes claims (nothing is verified): for a channel that carries
    several kinds, to choose the schema to open it with. Raises Rejected like ``open_envelope``."""
    if len(data) > limit:
        raise Rejected("oversized", f"{len(data)} bytes > limit of {limit}")
    return str(_parse(bytes(data), limit)["kind"])


def open_envelope(data: bytes, schema: type[M]) -> tuple[bytes, bytes]:
    """Check size, envelope, version, kind and signature; returns (signer, body) with the body still encoded.

    Lets a receiver decide whether it wants this signer's message at all before it pays for decoding the body.
    """
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise Rejected("malformed", f"expected bytes, got {type(data).__name__}")
    if len(data) > schema.CHANNEL.value:
        raise Rejected("oversized", f"{len(data)} bytes > {schema.CHANNEL.name} limit of {schema.CHANNEL.value}")
    env = _parse(bytes(data), schema.CHANNEL.value)
    if env["v"] != PROTOCOL_VERSION:
        raise Rejected("version", f"protocol {env['v']!r}, this node speaks {PROTOCOL_VERSION}")
    if env["kind"] != schema.KIND:
        raise Rejected("kind", f"expected {schema.KIND}, got {str(env['kind'])[:32]!r}")
    signer, body, sig = env["signer"], env["body"], env["sig"]
    assert isinstance(signer, bytes) and isinstance(body, bytes) and isinstance(sig, bytes)
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
