"""msgpack encoding with explicit size limits and no code execution.

Every channel has a maximum message size, checked before a single byte is decoded. Decoding refuses msgpack
extension types (the hook that pickle-like formats use), non-string map keys, repeated keys, trailing bytes and
more containers than any honest message holds, so a peer can only ever hand us a bounded amount of plain maps,
lists, strings, bytes and numbers. Envelopes are not decoded by msgpack at all before their signature is checked
(``envelope.open_envelope`` reads their fixed shape byte by byte).
"""

from __future__ import annotations

import enum
from typing import Any

import msgpack


class Channel(enum.IntEnum):
    """Each wire channel with its maximum encoded size in bytes."""

    RUN_SPEC = 16 * 1024
    NODE_RECORD = 4 * 1024
    MANIFEST = 256 * 1024
    ROLLOUT_BATCH = 16 * 1024 * 1024
    REPLY = 4 * 1024
    VERDICT = 8 * 1024
    GOSSIP = 4 * 1024
    INVITE = 512
    LEDGER = 64 * 1024 * 1024
    """One contribution ledger entry (protocol/ledger.py): up to a million batches as columns."""


class CodecError(ValueError):
    """A message that cannot be decoded: malformed, oversized or of the wrong shape."""

    def __init__(self, reason: str, detail: str = "") -> None:
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason = reason
        self.detail = detail


def _refuse_ext(code: int, data: bytes) -> Any:
    raise CodecError("malformed", f"msgpack extension type {code} is not allowed")


def pack(obj: Any) -> bytes:
    """Encode plain data (dict, list, str, bytes, int, float, bool, None) as msgpack."""
    return msgpack.packb(obj, use_bin_type=True)


MAX_MAPS = 4096
"""Maps one message may hold (the largest honest message, a rollout batch, holds a few per group)."""
MAX_ARRAYS = 1 << 16
"""Arrays one message may hold (a few per completion)."""


class _Budget:
    """Counts containers as msgpack builds them and stops the decode past the limits: a frame of a few MiB
    of nested empty maps would otherwise cost hundreds of MB of Python objects."""

    def __init__(self) -> None:
        self.maps = 0
        self.arrays = 0

    def map(self, pairs: list[tuple[Any, Any]]) -> dict[Any, Any]:
        self.maps += 1
        if self.maps > MAX_MAPS:
            raise CodecError("malformed", f"more than {MAX_MAPS} maps")
        out = dict(pairs)
        if len(out) != len(pairs):
            raise CodecError("malformed", "a map repeats a key")
        return out

    def array(self, items: list[Any]) -> list[Any]:
        self.arrays += 1
        if self.arrays > MAX_ARRAYS:
            raise CodecError("malformed", f"more than {MAX_ARRAYS} arrays")
        return items


def unpack(data: bytes, channel: Channel) -> Any:
    """Decode one message of ``channel``; raises CodecError('oversized' | 'malformed')."""
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise CodecError("malformed", f"expected bytes, got {type(data).__name__}")
    if len(data) > channel.value:
        raise CodecError("oversized", f"{len(data)} bytes > {channel.name} limit of {channel.value}")
    budget = _Budget()
    try:
        return msgpack.unpackb(
            data,
            raw=False,
            strict_map_key=True,
            ext_hook=_refuse_ext,
            object_pairs_hook=budget.map,
            list_hook=budget.array,
            max_ext_len=0,
        )
    except CodecError:
        raise
    except (msgpack.ExtraData, msgpack.FormatError, msgpack.StackError, ValueError, TypeError) as e:
        raise CodecError("malformed", str(e)[:200]) from None
