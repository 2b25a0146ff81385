"""The shard server: every node that holds weights serves them, verified shard by verified shard.

``GET /weights/<version>/manifest.msgpack`` and ``GET /weights/<version>/<shard>`` (Range and HEAD supported).
A shard of a version still arriving is served the moment its bytes arrive (cut-through) to the node's children:
their requests wait (long poll) instead of failing, so each level of the relay tree adds about a round trip.

Children: a downstream node attaches with ``POST /relay/attach?stripe=S``, signed with its node key (``auth.py``: only
keys the run knows, fresh, once, rate-limited per address), which takes one of this node's upload slots and
answers with this node's path from the origin and a token the child names itself with on its other requests; the
child keeps the slot with the same signed request at least every ``CHILD_TTL_S`` and gives it back with a signed
``DELETE /relay/attach``. A node takes children only in its home stripe (stripes.py; the origin in every stripe,
an equal share of its slots in each), only while it is itself connected to the origin (its path is known) and
never one of its own ancestors, so the tree has no cycles to begin with; without a free slot it answers 503 with
its children that earned their place or receive through it, the places to look for one further down. Keep-alives
alone keep no slot: a child that receives nothing through its slot while this node holds something for it loses
the slot to the next node that asks, and at the origin a node that earned a slot comes before one that has not
(``earned.py``: the rules, and why a liar cannot pass for earned). Other nodes (alternates) are served only what
this node already has, at once and while a slot is free, which each uses until its response ends, or on spare upload (no
child is being sent anything), cut short the moment a child is; anonymous clients (curl, a mirror) too, and they
wait for what is arriving only while fewer than ``MAX_ANON_WAITS`` of them do. An optional upload limit (a token
bucket over all responses) lets a volunteer cap what the node sends."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import secrets
import time
from collections.abc import AsyncIterator, Callable, Iterator
from typing import BinaryIO

from aiohttp import web

from intellect_node.aio import within
from intellect_node.p2p.http import decimal
from intellect_node.p2p.metrics import Metrics
from intellect_node.weights.auth import CHILD_HEADER, TOKEN_HEADER, Members, Refused, RequestAuth
from intellect_node.weights.earned import Feeding
from intellect_node.weights.files import MANIFEST_NAME
from intellect_node.weights.pacing import (
    FairShare,
    TokenBucket,
    Yielded,
    backlogged,
    on_the_wire,
    pace,
    place_in_stripe,
    respond,
    rwnd_limited_us,
)
from intellect_node.weights.store import Growing, WeightStore
from intellect_node.weights.stripes import UploadMeter, has_room, origin_slots, over_share, stripe_of, to_release
from intellect_protocol.messages import NodeRecord, RelayInfo

logger = logging.getLogger(__name__)

VERSION_HEADER = "X-Intellect-Version"
STREAM_STALL_S = 15.0
"""A response that cannot move on this long is cut short: its upstream bytes (cut-through) stop, or its receiver
reads nothing."""
SHARD_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
MAX_PATH = 1024
CHILD_TTL_S = 10.0
"""A child that has not asked for anything this long gives its slot back."""
CONTESTED_TTL_S = 4.0
"""A child silent this long (children keep their slot alive every second) loses it to a node that asks for a slot
when none is free: a relay that died holds its parent's slot, and its subtree waits, only this long."""
LONG_POLL_S = 10.0
MANIFEST_POLL_S = 2.0
"""How long a request for the manifest of a version not yet begun here waits before a 404."""
_CHUNK = 256 * 1024
MAX_ANON_WAITS = 32
"""Requests from non-children waiting (long polls) at once; past this they get what is here, at once."""
BEHIND_SHARDS = 2
"""A new child holding over twice the shards of its version in the stripe this node holds, plus this many, is
refused: a node that joined mid-version starts from nothing, and as a parent it would hold back every node that
re-parents under it. Only a child well ahead is refused: refusing any child a few shards ahead leaves a leaf that
the origin gave up without a parent. Lying high only costs the liar. (docs/weights.md and
docs/notes/weights-findings.md, "Parents ahead of their children".)"""

ROOT_TRIAL_S = 30.0
"""How long a node that rooted a stripe at the origin by the root rule (ShardServer._make_room) keeps the slot against
earned leaves without having earned it: long enough for the leaves it turned away to attach below it (each asks again
within its backoff, links.ASK_BACKOFF_S), and all a key that serves nobody gets."""
ROOT_RETRY_S = 120.0
"""The root rule roots a stripe at most once in this long, whoever asks: Sybil keys each at home in the stripe take
turns at most this often, so leaves are turned away ROOT_TRIAL_S of every ROOT_RETRY_S at most."""


_GIVEN = {
    "unearned": ("node_relay_unearned_children_replaced_total", "it had not earned its slot, the asker had"),
    "leaf": ("node_relay_leaves_preempted_total", "a leaf's, or past its stripe's share, for an interior node"),
    "root": ("node_relay_rootless_stripes_rooted_total", "its stripe had no root here, the asker is at home in it"),
    "silent": ("node_relay_silent_children_replaced_total", "it fell silent"),
    "idle": ("node_relay_idle_children_replaced_total", "it received nothing through its slot"),
}
"""Why a child gave its slot to a node that asked (ShardServer._make_room): the counter, and the words logged."""


class ShardServer:
    def __init__(
        self,
        store: WeightStore,
        metrics: Metrics,
        slots: int,
        upload_limit_bps: float | None = None,
        on_change: Callable[[], None] | None = None,
        node_id: str = "",
        members: Members | None = None,
    ) -> None:
        """``node_id``: this node's id, which children sign their slot requests for; ``members``: who belongs to
        the run (None: any signed key, for a standalone origin)."""
        self.store = store
        self.auth = RequestAuth(node_id, members)
        self.metrics = metrics
        self.slots = slots
        self.kept = 0
        """Slots beyond ``slots`` lent to alternates only (a stripe's root keeps one: stripes.root_fanout)."""
        self.upload_limit_bps = upload_limit_bps or 0.0
        self.home: Callable[[], int | None] = lambda: None
        """The one stripe this node takes children in (None: every stripe, as the origin)."""
        self.home_of: Callable[[str], int | None] = lambda node: None
        """The stripe a node's record says it takes children in (None: no record; see _make_room)."""
        self.earned: Callable[[str], bool] = lambda node: True
        """Whether a node earned a slot here (the trainer's earned.Earned at the origin; every node elsewhere)."""
        self.feeding = Feeding()
        """Which child slots owe a fetch (earned.Feeding): idle ones go to the next node that asks."""
        self.on_change = on_change
        """Called when the set of children changes (the node then republishes its free slots)."""
        self.depth: Callable[[], int] = lambda: 0
        """This node's depth in the tree (0: the origin), in each keep-alive answer; children go by the path."""
        self.path: Callable[[], list[str]] = lambda: []
        """Node ids from the origin down to this node, told to children in each keep-alive: a child that finds
        itself in its parent's path has closed a cycle (two nodes chose each other at once) and leaves."""
        self._children: dict[str, float] = {}
        """Child slot -> last heard from; a slot is ``node_id/stripe`` (the origin can serve a node in several)."""
        self._tokens: dict[str, str] = {}
        """Token -> child slot: what a child names itself with on shard and news requests."""
        self._sending = 0
        self._to_children = 0
        """Responses to children in progress: while there is none, alternates may use the idle upload."""
        self._sent_at = -1e9
        self.meter = UploadMeter()
        self.fair = FairShare(self.meter.peak_bps)
        self._leaves: set[str] = set()
        """Child slots held by nodes that are leaves in that stripe (they take no children there)."""
        self._rooted: dict[int, float] = {}
        """Stripe -> when the root rule (_make_room) last rooted it: not again within ROOT_RETRY_S."""
        self._trials: dict[str, float] = {}
        """Child slot -> when it took its slot by the root rule (kept against earned leaves for ROOT_TRIAL_S)."""
        self._told_bps = 0.0
        self._anon_waits = 0
        self._lent = 0
        """Requests of nodes that are not our children (alternates, anonymous) being served: each uses a slot."""
        self._bucket = TokenBucket(upload_limit_bps) if upload_limit_bps else None
        self.stripes = 1
        """Stripes per version (the origin's, announced in its record); shard i belongs to stripe i mod this."""
        self.auth.stripes = lambda: self.stripes if self.home() is None else 1

    def routes(self) -> list[web.RouteDef]:
        return [
            web.get("/weights/{version}/{name}", self._get),
            web.post("/relay/attach", self._attach),
            web.delete("/relay/attach", self._detach),
            web.get("/relay/next", self._next),
        ]

    def _active_children(self) -> dict[str, float]:
        now = time.monotonic()
        before = len(self._children)
        self._children = {c: t for c, t in self._children.items() if now - t < CHILD_TTL_S}
        if len(self._children) != before:
            self._tokens = {t: c for t, c in self._tokens.items() if c in self._children}
            self.feeding.keep(self._children)
            self._leaves &= set(self._children)
            if self.on_change is not None:
                self.on_change()
        return self._children

    def _child_of(self, request: web.Request, version: int = -1, name: str = "") -> str | None:
        """The attached child slot a request comes from (by its token), or None; for shard ``name`` of ``version``
        only a slot in that shard's stripe: a child taking another stripe from us is an alternate there (else the
        origin's child in one stripe could take every stripe from it, k shares of the run's bottleneck)."""
        child = self._tokens.get(request.headers.get(TOKEN_HEADER, "")[:64])
        if child is None or child not in self._active_children():
            return None
        index = self.store.index(version, name) if name and self.stripes > 1 else None
        slot = child if index is None else f"{child.split('/')[0]}/{stripe_of(index, self.stripes)}"
        return slot if slot in self._children else None

    @staticmethod
    def _stripe_wanted(request: web.Request) -> int:
        stripe = decimal(request.query.get("stripe", "0"), 2)
        if stripe is None or stripe >= 64:
            raise web.HTTPBadRequest(text="stripe=<0..63>")
        return stripe

    def _token(self, child: str) -> str:
        for token, owner in self._tokens.items():
            if owner == child:
                return token
        token = secrets.token_hex(16)
        self._tokens[token] = child
        return token

    async def _authentic(self, request: web.Request) -> str:
        """The node a signed slot request comes from (auth.py); a keep-alive of a slot it holds is told apart."""
        slot = request.query.get("stripe", "0")
        try:
            return await self.auth.check(request, lambda node: f"{node}/{slot}" in self._active_children())
        except Refused as e:
            self.metrics.inc("node_relay_requests_refused_total", label=e.reason)
            raise e.http() from None

    def slots_free(self) -> int:
        return max(0, self.slots - len(self._active_children()))

    def idle_s(self) -> float:
        """Seconds since this node last sent a shard (0 while it sends one)."""
        return 0.0 if self._sending else time.monotonic() - self._sent_at

    def children(self) -> list[str]:
        """The nodes attached here (in any stripe)."""
        return sorted({c.split("/")[0] for c in self._active_children()})

    def upload_bps(self) -> float:
        """Upload capacity measured over seconds spent sending (stripes.UploadMeter; 0 until measured)."""
        return self.meter.bps()

    def origin_info(self, records: dict[str, NodeRecord], versions: list[int], slots: int | None) -> RelayInfo:
        """What the origin announces of itself as a relay: its slots ``slots``, or by default from its measured
        upload and the number of ``records`` (stripes.origin_slots), and the stripes each version has."""
        if slots is None:  # the records' number only: what they say of their uploads is their word (origin_slots)
            self.slots = origin_slots(
                sum(r.role != "trainer" for r in records.values()), self.upload_bps(), self.stripes
            )
        self.slots = max(self.slots, self.stripes)  # a slot for each stripe at least: else a stripe has no root
        self.shed()
        return RelayInfo(
            depth=0,
            slots_total=self.slots,
            slots_free=self.slots_free(),
            upload_bps=self.upload_bps(),
            versions=versions[-16:],
            stripes=self.stripes,
        )

    def shed(self) -> None:
        """Children past this node's slots (planned down since they attached; at the origin, past their stripe's
        share) give theirs up, told at their next keep-alive (503): slots planned early on, with few records read,
        can be twice what the upload carries, and a subtree kept on them takes twice as long (docs/weights.md,
        "Children past the slots give theirs up")."""
        for child in over_share(self._child_info(), self.slots, self.stripes if self.home() is None else 1):
            logger.info("child %s gives its slot up: past its stripe's share of %d slots", child[:8], self.slots)
            self._release(child)

    def _room(self, child: str) -> bool:
        """Whether a slot is free for ``child`` (``node/stripe``): stripes.has_room."""
        stripes = [int(c.split("/")[1]) for c in self._children]  # as the caller filtered it
        return has_room(stripes, int(child.split("/")[1]), self.slots, self.stripes if self.home() is None else None)

    def _child_info(self) -> dict[str, tuple[int, bool, float]]:
        """Each child slot's stripe, whether it is a leaf there, and when it was last heard from (stripes.py)."""
        return {c: (int(c.split("/")[1]), c in self._leaves, t) for c, t in self._active_children().items()}

    def _make_room(self, child: str, leaf: bool, lacks: bool) -> None:
        """No slot is free for ``child``: at most one child gives its slot up to it, the first of these that applies
        (each one whose leaving makes room for ``child``; ``earned.py`` says why):

        1. to a node that earned a slot here, a child that has not earned its own: an idle one first, then a leaf,
           then the one heard from longest ago (only where ``earned`` tells them apart: the origin);
        2. ``stripes.to_release``: a leaf's slot to a node at home in the stripe, a slot of a stripe over its share;
           never one of a child that earned its slot to a node that has not;
        3. the slot of a child silent for ``CONTESTED_TTL_S``: a relay that died holds its slot only this long;
        4. to a node that has something to fetch here (``lacks``), the slot of a child idle longest (it receives
           nothing through it; earned.Feeding), a leaf first.

        Between 2 and 3, at the origin, a stripe with no root (no child at home in it): a node whose record says it
        is at home in the stripe takes the slot of a child there (an unearned one first, then an idle one), earned
        or not, once in ``ROOT_RETRY_S`` per stripe, whoever asks (keys are free: a bound per key bounds nothing).
        The origin has one slot per stripe by default; held by a leaf, the stripe's tree has no root, every other
        node fetches the stripe from alternates, and a relay (which earns only through the trusted nodes below it)
        could never take it. For ``ROOT_TRIAL_S`` the new root keeps the slot against earned leaves (rule 1 spares
        it; the 503 names it to them, and they attach below it); past that, unless it earned its place, it is an
        unearned child like any: a key that serves nobody holds the slot against the leaves it turned away for the
        trial at most, one trial per stripe per ``ROOT_RETRY_S``. An earned node at home there takes it at any time,
        and an idle one loses it as any child does."""
        now = time.monotonic()
        stripe, k = int(child.split("/")[1]), self.stripes if self.home() is None else None
        info = self._child_info()
        mine = self.earned(child.split("/")[0])

        held = [x[0] for x in info.values()]

        def room_without(s: int) -> bool:
            rest = list(held)
            rest.remove(s)
            return has_room(rest, stripe, self.slots, k)

        room = {s: room_without(s) for s in set(held)}  # whether a child's leaving makes room: by its stripe only
        movable = [c for c in info if room[info[c][0]]]

        def earned(c: str) -> bool:
            return self.earned(c.split("/")[0])

        def at_home(c: str) -> bool:  # by its record and its requests: a node that takes children in the stripe
            return not info[c][1] and self.home_of(c.split("/")[0]) == info[c][0]

        def on_trial(c: str) -> bool:  # rooted its stripe by the rule below a moment ago, and receives
            return now - self._trials.get(c, -1e9) < ROOT_TRIAL_S and at_home(c) and not self.feeding.idle(c, now)

        out, why = None, ""
        if mine and (unearned := [c for c in movable if not earned(c) and not (leaf and on_trial(c))]):
            out, why = (
                min(unearned, key=lambda c: (not self.feeding.idle(c, now), not info[c][1], info[c][2])),
                "unearned",
            )
        if out is None:
            out, why = to_release(info, stripe, leaf, self.slots, k, None if mine else lambda c: not earned(c)), "leaf"
        node = child.split("/")[0]
        if out is None and k is not None and not leaf and self.home_of(node) == stripe:
            mine_s = [c for c in info if info[c][0] == stripe]
            if mine_s and not any(at_home(c) for c in mine_s) and now - self._rooted.get(stripe, -1e9) >= ROOT_RETRY_S:
                out = min(mine_s, key=lambda c: (earned(c), not self.feeding.idle(c, now), info[c][2]))
                why = "root"
                self._rooted[stripe] = now
                self._trials = {c: t for c, t in self._trials.items() if now - t < ROOT_TRIAL_S}
                self._trials[child] = now  # it gets the slot now made free (_admit)
        if out is None:
            silent = [c for c in movable if now - info[c][2] >= CONTESTED_TTL_S]
            out, why = min(silent, key=lambda c: info[c][2], default=None), "silent"
        if out is None and lacks:
            idle = [c for c in movable if self.feeding.idle(c, now)]
            out, why = min(idle, key=lambda c: (not info[c][1], -self.feeding.idle_s(c, now)), default=None), "idle"
        if out is None:
            return
        logger.info("child %s gives its slot to %s in stripe %d: %s", out[:8], child[:8], stripe, _GIVEN[why][1])
        self.metrics.inc(_GIVEN[why][0], help=f"children's slots given to a node that asked: {_GIVEN[why][1]}")
        self._release(out)

    def _admit(self, child: str, leaf: bool = False, lacks: bool = False) -> bool:
        """Give ``child`` (``node/stripe``) a slot, or keep it its own; ``lacks``: it has something to fetch here."""
        active = self._active_children()
        if child not in active and not self._room(child):
            self._make_room(child, leaf, lacks)
            active = self._active_children()
        if child in active or self._room(child):
            new = child not in active
            active[child] = time.monotonic()
            if new:
                self.feeding.attached(child, lacks, active[child])
            if leaf:
                self._leaves.add(child)
            else:
                self._leaves.discard(child)
            if new and self.on_change is not None:
                self.on_change()
            return True
        return False

    def _note_versions(self) -> None:
        """The child slots of a stripe owe a fetch once the newest version here holds a shard of that stripe
        (earned.Feeding); a stripe a version has no shard in owes nothing (a version of one shard, say)."""
        self.feeding.epoch(self.store.epoch)
        newest, home = self.store.newest(), self.home()
        if newest < 0:
            return
        for s in range(self.stripes) if home is None else [home]:
            if self.feeding.noted(s) < newest and self.store.held(newest, s, self.stripes) > 0:
                slots = [c for c in self._children if c.endswith(f"/{s}")]
                self.feeding.began(s, newest, slots, time.monotonic())

    def _alternatives(self) -> list[str]:
        """The children a node refused a slot is told to ask instead: those that hold no idle slot and earned their
        place here, received shards through it (earned.py), or just rooted a stripe (_make_room: the leaves it
        turned away attach below it). A node that only holds a slot is never named (it would send the asker
        nowhere)."""
        now, slots = time.monotonic(), self._active_children()
        idle = {c.split("/")[0] for c in slots if self.feeding.idle(c, now)}
        trial = {c.split("/")[0] for c in slots if now - self._trials.get(c, -1e9) < ROOT_TRIAL_S}
        fed = {c.split("/")[0] for c in slots if self.feeding.was_fed(c)} | trial
        nodes = sorted({c.split("/")[0] for c in slots})  # self.children(), from the slots already read
        return [n for n in nodes if n not in idle and (n in fed or self.earned(n))]

    async def _attach(self, request: web.Request) -> web.Response:
        """Take (or keep) a slot as a child: answers this node's depth, its path from the origin and the child's
        token. Only a signed request from a node of the run gets that far (``auth.py``)."""
        node = await self._authentic(request)
        stripe, home = self._stripe_wanted(request), self.home()
        child = f"{node}/{stripe}"
        path = self.path()
        if home is not None and stripe != home:
            raise self._conflict("wrong_stripe", f"this node takes children in stripe {home}")
        if node in path:  # it re-parented below us (a cycle): it must leave, and its slot is free again
            self._release(child)
            raise self._conflict("ancestor", "you are above this node: it would close a cycle")
        new = child not in self._active_children()
        if not path and new:
            raise self._conflict("not_rooted", "this node is not connected to the origin yet")
        if home is not None and new and self._behind(request, stripe):
            raise self._conflict("behind", "this node holds less of the version than you: a parent ahead of you")
        # "home=0": it takes no children in this stripe (said on every keep-alive, so a change of home counts); a
        # node whose record says another home is a leaf here whatever it says (only a node at home moves leaves)
        said = self.home_of(node)
        self._note_versions()
        leaf = request.query.get("home") == "0" or said not in (None, stripe)
        if not self._admit(child, leaf, lacks=new and self._lacks(request, stripe)):
            self.metrics.inc("node_relay_requests_refused_total", label="no_slot")
            raise web.HTTPServiceUnavailable(
                text=json.dumps({"children": self._alternatives()}),
                content_type="application/json",
                headers={"Retry-After": "1"},
            )
        return web.json_response({"depth": self.depth(), "path": path[-MAX_PATH:], "token": self._token(child)})

    def _conflict(self, reason: str, error: str) -> web.HTTPConflict:
        self.metrics.inc("node_relay_requests_refused_total", label=reason)
        return web.HTTPConflict(text=json.dumps({"reason": reason, "error": error}), content_type="application/json")

    @staticmethod
    def _fetching(request: web.Request) -> tuple[int, int] | None:
        """What a child's ``v`` and ``have`` (signed) say: the version it fetches and its shards of the stripe."""
        v, have = decimal(request.query.get("v", ""), 10), decimal(request.query.get("have", ""), 7)
        return None if v is None or have is None else (v, have)

    def _behind(self, request: web.Request, stripe: int) -> bool:
        """Whether a new child says it holds over twice what this node does."""
        said = self._fetching(request)
        return said is not None and self.store.held(said[0], stripe, self.stripes) + BEHIND_SHARDS < said[1] // 2

    def _lacks(self, request: web.Request, stripe: int) -> bool:
        """Whether a child says it holds fewer shards of the version it fetches, in ``stripe``, than this node."""
        said = self._fetching(request)
        return said is not None and self.store.held(said[0], stripe, self.stripes) > said[1]

    async def _detach(self, request: web.Request) -> web.Response:
        """A child that moved elsewhere gives its slot back now (else after ``CHILD_TTL_S``); only itself can."""
        node = await self._authentic(request)
        self._release(f"{node}/{self._stripe_wanted(request)}")
        return web.Response(status=204)

    def _release(self, child: str) -> None:
        self._leaves.discard(child)
        self._trials.pop(child, None)
        self.feeding.forget(child)
        self._tokens = {t: c for t, c in self._tokens.items() if c != child}
        if self._children.pop(child, None) is not None and self.on_change is not None:
            self.on_change()

    async def _next(self, request: web.Request) -> web.Response:
        """``GET /relay/next?after=N``: the signed manifest of the newest version here once it is newer than N
        (long poll, 204 after ``LONG_POLL_S``). Children learn of a new version from their parent as it starts
        arriving, not at their next look at the DHT; the run key's signature makes the news trustworthy. Others
        wait only while fewer than MAX_ANON_WAITS do."""
        after = decimal(request.query.get("after", "-1"), 10, negative=True)
        if after is None:
            raise web.HTTPBadRequest(text="after=<version>")
        async with self._waiting(self._child_of(request) is not None) as wait_s:
            newest = await self.store.wait_newer(after, wait_s)
        data = self.store.manifest_bytes(newest) if newest is not None else None
        if newest is None or data is None:
            return web.Response(status=204)
        return web.Response(body=data, content_type="application/octet-stream", headers={VERSION_HEADER: str(newest)})

    @contextlib.asynccontextmanager
    async def _waiting(self, child: bool) -> AsyncIterator[float]:
        """How long a request may wait: a child the full long poll; others while few of them wait, else not."""
        if child:
            yield LONG_POLL_S
            return
        if self._anon_waits >= MAX_ANON_WAITS:
            self.metrics.inc("node_relay_anonymous_waits_refused_total", help="long polls refused to non-children")
            yield 0.0
            return
        self._anon_waits += 1
        try:
            yield LONG_POLL_S
        finally:
            self._anon_waits -= 1

    async def _get(self, request: web.Request) -> web.StreamResponse:
        v, name = decimal(request.match_info["version"], 10), request.match_info["name"]
        if v is None or not SHARD_NAME.match(name) or name.endswith(".part"):
            raise web.HTTPNotFound()
        version = v
        if name == MANIFEST_NAME:
            data = self.store.manifest_bytes(version)
            if data is None and await self.store.wait_begun(version, MANIFEST_POLL_S):
                data = self.store.manifest_bytes(version)
            if data is None:
                raise web.HTTPNotFound()
            return web.Response(body=data, content_type="application/octet-stream")
        child = self._child_of(request, version, name)
        stranger = child is None and CHILD_HEADER in request.headers  # another node's child (an alternate)
        spare = False
        if child is not None:
            self._children[child] = time.monotonic()
        elif len(self._active_children()) + self._lent >= self.slots + self.kept:
            # not a child (an alternate, anonymous): only while a slot is free, used while served, never kept, so
            # a crowd of alternates cannot share a node's upload at a crawl each ("Alternates hold a slot", weights.md)
            # Or while no child is being sent anything (spare: it yields the moment one is, see _write)
            spare = self._to_children == 0 and self._lent < self.slots + self.kept
            if not spare:
                self.metrics.inc("node_relay_requests_refused_total", label="no_slot")
                raise web.HTTPServiceUnavailable(text="no free upload slot", headers={"Retry-After": "1"})
        self._lent += child is None
        try:
            if spare:  # only a whole shard: one still arriving here would hold an endgame's last shard at its pace
                found = self.store.shard_file(version, name)
            elif stranger:  # an alternate serves only what is here: no long poll
                found = self.store.shard_file(version, name) or self.store.growing(version, name)
            else:
                found = self.store.shard_file(version, name)
                if found is None:
                    async with self._waiting(child is not None) as wait_s:
                        found = await self.store.wait_shard(version, name, wait_s)
            if found is None:
                raise web.HTTPNotFound()
            # opened right after it was found, with no await between: it cannot be renamed (verified) or moved (its
            # version finished) meanwhile, as it could across an await (a 500 FileNotFoundError)
            with open(found.path if isinstance(found, Growing) else found, "rb") as f:
                if isinstance(found, Growing):
                    return await self._stream(request, found, f, child, spare)
                return await self._send(request, f, child, spare)
        finally:
            self._lent -= child is None

    async def _stream(
        self, request: web.Request, growing: Growing, f: BinaryIO, child: str | None, spare: bool = False
    ) -> web.StreamResponse:
        """Cut-through: send a shard's bytes as they arrive here, so a level of the tree adds about a network
        round trip, not a shard's transfer time. Marked unverified; if this node's own attempt fails, the
        response is cut short (the receiver resumes or goes elsewhere), never completed with other bytes."""
        resp, start, size = await respond(request, growing.total, cut_through=True)
        self.metrics.inc("node_relay_streams_total", help="shards relayed cut-through, before verifying them here")
        pos = start
        with self._busy(child, request), self._hung_up(request):
            while pos < size:
                if growing.size > pos:
                    f.seek(pos)
                    chunk = f.read(min(_CHUNK, growing.size - pos))
                    if not chunk:
                        break
                    await self._write(
                        request,
                        resp,
                        chunk,
                        child,
                        spare,
                        (pos + len(chunk), growing.total),
                        growing.size - pos > len(chunk),
                    )
                    pos += len(chunk)
                    continue
                if growing.state == "failed":
                    break
                self.fair.update(request, False)  # it waits for its bytes, not for the link
                changed = growing.changed
                try:
                    await within(changed.wait(), STREAM_STALL_S)
                except TimeoutError:
                    break
        sent = pos - start
        self.metrics.inc("node_relay_bytes_sent_total", sent, help="weight bytes served to other nodes")
        if pos < size:
            self.metrics.inc("node_relay_streams_cut_total", help="cut-through responses cut short")
            if request.transport is not None:
                request.transport.close()  # the receiver sees a short body, never a complete wrong one
            return resp
        await resp.write_eof()
        self.metrics.inc("node_relay_shards_served_total")
        return resp

    @contextlib.contextmanager
    def _hung_up(self, request: web.Request) -> Iterator[None]:
        """The receiver went away mid-response: its business, not an error here (counted, the rest not sent)."""
        try:
            yield
        except ConnectionResetError as e:
            if not isinstance(e, Yielded):
                self.metrics.inc("node_relay_responses_abandoned_total", help="responses the receiver hung up on")
            if request.transport is not None:
                request.transport.close()

    @contextlib.contextmanager
    def _busy(self, child: str | None, request: web.Request) -> Iterator[None]:
        """A response in progress: the upload meter counts only seconds with one throughout."""
        self._sending += 1
        self._to_children += child is not None
        try:
            yield
        finally:
            self._sending -= 1
            self._to_children -= child is not None
            self.fair.done(request, time.monotonic())
            self._sent_at = time.monotonic()
            if self._sending == 0:
                self.meter.idle(time.monotonic())

    async def _write(
        self,
        request: web.Request,
        resp: web.StreamResponse,
        chunk: bytes,
        child: str | None,
        spare: bool = False,
        at: tuple[int, int] = (0, 1),
        ready: bool = True,
    ) -> None:
        """One chunk of a response, within the upload limit; the child's slot counts as in use. A response served
        on spare upload stops the moment a child is being sent anything (the receiver resumes it elsewhere).
        ``at``: the bytes of the shard written with this chunk, of its size (a child's place: pacing.FairShare)."""
        if spare and self._to_children:
            self.metrics.inc("node_relay_spare_yielded_total", help="alternates' responses cut for a child's")
            raise Yielded()
        if self._bucket is not None:
            await self._bucket.take(len(chunk))
        behind, now = backlogged(request), time.monotonic()
        who = child.split("/")[0] if child else request.remote or ""
        pace(request, self.fair.cap(self.meter.peak_bps(now), now, who))
        try:  # a receiver that reads nothing holds no slot for long (a member's grudge: a relay's free slots)
            await within(resp.write(chunk), STREAM_STALL_S)
        except TimeoutError:
            self.metrics.inc("node_relay_responses_stalled_total", help="responses cut: nothing read for a while")
            raise ConnectionResetError("the receiver read nothing") from None
        acked, now = on_the_wire(request, len(chunk)), time.monotonic()
        self.meter.sent(acked, now, backlogged=behind)
        v, name = int(request.match_info["version"]), request.match_info["name"]  # an alternate's: any stripe, no place
        place = place_in_stripe(v, self.store.index(v, name), self.stripes, *at) if child else None
        self.fair.update(request, ready, acked, now, who, rwnd_limited_us(request), place)
        if abs(self.meter.bps() - self._told_bps) > 0.2 * self._told_bps:
            self._told_bps = self.meter.bps()
            logger.info("upload measured at %.1f Mbit/s", self._told_bps * 8 / 1e6)
        if child is not None and child in self._children:
            self._children[child] = time.monotonic()
            self.feeding.fed(child, v)

    async def _send(
        self, request: web.Request, f: BinaryIO, child: str | None, spare: bool = False
    ) -> web.StreamResponse:
        resp, start, stop = await respond(request, os.fstat(f.fileno()).st_size)
        if request.method == "HEAD":
            return resp
        sent = 0
        with self._busy(child, request), self._hung_up(request):
            f.seek(start)
            while sent < stop - start:
                chunk = f.read(min(_CHUNK, stop - start - sent))
                if not chunk:
                    break
                await self._write(request, resp, chunk, child, spare, (start + sent + len(chunk), stop))
                sent += len(chunk)
        self.metrics.inc("node_relay_bytes_sent_total", sent, help="weight bytes served to other nodes")
        if sent < stop - start:  # hung up on, or the file shrank: never completed with other bytes
            if request.transport is not None:
                request.transport.close()
            return resp
        await resp.write_eof()
        self.metrics.inc("node_relay_shards_served_total")
        return resp
