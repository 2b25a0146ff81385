"""Who may hold a relay slot: requests signed by a node key of the run, fresh, never replayed, rate-limited.

A child proves its node id on every slot request (``POST`` and ``DELETE /relay/attach``) with three headers:
its node id, its raw Ed25519 public key (hex) and ``<unix time>:<nonce>:<signature>``, the signature over
``"<METHOD> <path> <server node id> <time> <nonce>"`` with kind ``relay_request`` (domain-separated, see
protocol/identity.py). The server checks, cheapest first: a rate limit per remote address (a refusal is held a
second, http.Tarpit: a flood that was refused at once asked again at once), the headers' shape,
that the key is the node id's, the time within ``AUTH_WINDOW_S``, the nonce unseen, the signature, that the node
id belongs to the run (a registered DHT record; a DHT lookup at most, bounded by the caller), and last that the key
has not signed more than its allowance within the replay window: ``NONCES_PER_KEY`` requests asking for a slot, and
apart from those ``NONCES_PER_SLOT`` keep-alives of slots it holds here per stripe it may hold one in (so that
asking, however often, never costs a child the slots it has). Only then is the nonce kept: a stranger's request,
however well signed, leaves nothing behind. Nonces are kept in arrival order and dropped once older than twice the
window, so the table costs O(1) per request and holds at most that allowance per member.
A granted slot comes with a random token that the child sends on its shard and news requests, so those need no
signature; a request with a node id but no valid token is a stranger's.

So nobody can take slots under made-up node ids, evict a real child, or learn who the children are without a key
the run knows.
"""

from __future__ import annotations

import email.utils
import re
import secrets
import time
from collections import Counter, OrderedDict
from collections.abc import Awaitable, Callable

from aiohttp import web

from intellect_node.p2p.gossip import TokenBuckets
from intellect_node.p2p.http import Tarpit, source_of
from intellect_protocol.identity import Identity, node_id_of, verify

CHILD_HEADER = "X-Intellect-Node"
KEY_HEADER = "X-Intellect-Key"
AUTH_HEADER = "X-Intellect-Auth"
TOKEN_HEADER = "X-Intellect-Token"
KIND = "relay_request"
AUTH_WINDOW_S = 30.0
MAX_NONCES = 100_000
"""Nonces kept at most, all keys together: past this a request is refused as busy (NONCES_PER_KEY members' worth)."""
NONCES_PER_KEY = 64
"""Requests for a slot one key may sign within twice the replay window (past this, asking is refused as too often)."""
NONCES_PER_SLOT = 128
"""Keep-alives of the slots a key holds here it may sign within twice the replay window, per stripe it may hold one
in (the origin: every stripe; a relay: its home). A child keeps each slot alive every second, every half second for
a few rounds after a change or an unanswered one (links.KEEPALIVE_S, FAST_KEEPALIVE_S): up to 120 a slot. Counted
apart from the asking: under one allowance, a child of the origin in four stripes would be refused within 16 s
and lose its slot in every stripe."""
KEY_RETRY_AFTER_S = 10
"""The Retry-After of a key past its allowance: a node honours it (links.Attachments) and asks elsewhere meanwhile;
at one ask in this long a key stays within NONCES_PER_KEY."""
RATE_PER_ADDRESS = 50.0
"""Slot requests per second from one remote address (a burst of twice this)."""
MAX_ADDRESSES = 10_000
_HEX32 = re.compile(r"^[0-9a-f]{32}$")
_HEX64 = re.compile(r"^[0-9a-f]{64}$")
_AUTH = re.compile(r"^(\d{1,12}\.\d{1,6}):([0-9a-f]{16}):([0-9a-f]{128})$")

Members = Callable[[str], Awaitable[bool]]
"""Whether a node id belongs to the run (has a valid record); may read the DHT."""


def signed_headers(
    identity: Identity, method: str, path: str, server_id: str, clock_offset: float = 0.0
) -> dict[str, str]:
    """The headers that prove ``identity`` sends this request to ``server_id``. ``clock_offset``: how far the
    server's clock is ahead of ours (learned from its answers' Date header; see ``server_clock_offset``), so that a
    node whose clock is off still signs a time the server accepts."""
    stamp = f"{time.time() + clock_offset:.3f}"
    nonce = secrets.token_hex(8)
    message = f"{method} {path} {server_id} {stamp} {nonce}".encode()
    return {
        CHILD_HEADER: identity.node_id,
        KEY_HEADER: identity.public_key.hex(),
        AUTH_HEADER: f"{stamp}:{nonce}:{identity.sign(KIND, message).hex()}",
    }


def server_clock_offset(date_header: str | None) -> float | None:
    """How far a server's clock is ahead of ours, from the Date header of its answer (1 s resolution); None when
    there is none or it is absurd (over a day off)."""
    if not date_header:
        return None
    try:
        offset = email.utils.parsedate_to_datetime(date_header).timestamp() - time.time()
    except (TypeError, ValueError, IndexError, OverflowError):
        return None
    return offset if abs(offset) < 86400 else None


class Refused(Exception):
    """A slot request that is not authentic: ``status`` and ``reason`` for the answer and the counter."""

    def __init__(self, status: int, reason: str, close: bool = False, retry_after: int | None = None) -> None:
        super().__init__(reason)
        self.status = status
        self.reason = reason
        self.close = close
        """Close the connection after the answer (a tarpit with no room left)."""
        self.retry_after = retry_after
        """Seconds after which asking again may be answered: the address's rate, or KEY_RETRY_AFTER_S for a key past
        its allowance (a hint: the allowance comes back as the key's oldest requests leave the replay window)."""

    def http(self) -> web.HTTPException:
        """The answer: 429 for too many, 403 for a key the run does not know, else 401."""
        kinds: dict[int, type[web.HTTPException]] = {429: web.HTTPTooManyRequests, 403: web.HTTPForbidden}
        answer = kinds.get(self.status, web.HTTPUnauthorized)(text=self.reason)
        if self.retry_after is not None:
            answer.headers["Retry-After"] = str(self.retry_after)
        if self.close:
            answer.force_close()
        return answer


class RequestAuth:
    def __init__(self, server_id: str, members: Members | None) -> None:
        """``members`` None accepts any correctly signed key (a standalone origin with no DHT, as in the
        broadcast benchmark); a node of a run always passes its registry."""
        self.server_id = server_id
        self.members = members
        self._nonces: OrderedDict[tuple[str, str], tuple[float, bool]] = OrderedDict()
        """(node id, nonce) -> when it was accepted and whether it kept a held slot, oldest first: the requests that
        may not be replayed."""
        self._per_key: Counter[str] = Counter()
        """Per key, the requests asking for a slot in the table."""
        self._keeping: Counter[str] = Counter()
        """Per key, the keep-alives of held slots in the table."""
        self._buckets = TokenBuckets(RATE_PER_ADDRESS, 2 * RATE_PER_ADDRESS, MAX_ADDRESSES)
        self.tarpit = Tarpit()
        self.stripes: Callable[[], int] = lambda: 1
        """Stripes a node may hold a slot in here (relay.ShardServer: every one at the origin, else its home)."""

    def allow(self, address: str) -> bool:
        """One request from ``address`` within its rate (a token bucket per address, MAX_ADDRESSES of them at
        most: the longest idle go first)."""
        return self._buckets.take(address)

    async def check(self, request: web.Request, holds: Callable[[str], bool] = lambda node_id: False) -> str:
        """The authenticated node id of a slot request; raises Refused. ``holds``: whether the node already holds
        the slot the request is for (a keep-alive, counted apart from requests asking for one)."""
        if not self.allow(source_of(request.remote)):
            raise Refused(429, "rate", close=not await self.tarpit.hold(request), retry_after=1)
        node_id = request.headers.get(CHILD_HEADER, "")
        key_hex = request.headers.get(KEY_HEADER, "")
        match = _AUTH.match(request.headers.get(AUTH_HEADER, ""))
        if not (_HEX32.match(node_id) and _HEX64.match(key_hex) and match):
            raise Refused(401, "unsigned")
        key = bytes.fromhex(key_hex)
        stamp, nonce, sig = match.groups()
        if node_id_of(key) != node_id:
            raise Refused(401, "wrong_key")
        now = time.time()
        if abs(now - float(stamp)) > AUTH_WINDOW_S:
            raise Refused(401, "clock")
        if (node_id, nonce) in self._nonces:
            raise Refused(401, "replayed")
        message = f"{request.method} {request.path_qs} {self.server_id} {stamp} {nonce}".encode()
        if not verify(key, KIND, message, bytes.fromhex(sig)):
            raise Refused(401, "bad_signature")
        if self.members is not None and not await self.members(node_id):
            raise Refused(403, "unregistered")
        self._keep(node_id, nonce, time.time(), holds(node_id))
        return node_id

    def _keep(self, node_id: str, nonce: str, now: float, keeping: bool = False) -> None:
        """Remember an accepted request's nonce (``keeping``: a keep-alive of a held slot); raises Refused when it
        was used meanwhile (the membership check awaits), or when the key, or everybody together, signed too many
        within the window."""
        while self._nonces:
            (old_id, _), (at, kept) = next(iter(self._nonces.items()))
            if now - at < 2 * AUTH_WINDOW_S:
                break
            self._nonces.popitem(last=False)
            counts = self._keeping if kept else self._per_key
            counts[old_id] -= 1
            if counts[old_id] <= 0:
                del counts[old_id]
        if (node_id, nonce) in self._nonces:
            raise Refused(401, "replayed")
        counts = self._keeping if keeping else self._per_key
        if counts[node_id] >= (NONCES_PER_SLOT * max(1, self.stripes()) if keeping else NONCES_PER_KEY):
            raise Refused(429, "rate", retry_after=KEY_RETRY_AFTER_S)
        if len(self._nonces) >= MAX_NONCES:
            raise Refused(429, "busy")
        self._nonces[(node_id, nonce)] = (now, keeping)
        counts[node_id] += 1
