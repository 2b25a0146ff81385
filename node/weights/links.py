"""A node's places in the relay trees: one parent per stripe (stripes.py), each held by its own keep-alive.

``Link`` is the state of one: the parent, the path from the origin it last told us, the token it named us with.
In the node's home stripe it takes children, so its path is what it tells them and a cycle is possible (two
nodes that re-parented below each other at once): that link checks for one. In the other stripes it is a leaf.
``Attachments`` chooses, holds and leaves the parents, per link: a part that ``follower.WeightFollower`` builds
and drives (``keep_link`` per stripe, ``climb`` between versions, ``choose`` and ``drop_parent`` when a fetch plans its
sources, ``leave_slow_parent`` after a version), handed what it needs and never reaching into the follower.
"""

from __future__ import annotations

import asyncio
import json
import logging
import random
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import aiohttp

from intellect_node.aio import within
from intellect_node.p2p.http import decimal
from intellect_node.p2p.metrics import Metrics
from intellect_node.weights.auth import server_clock_offset, signed_headers
from intellect_node.weights.fetch import ShardFetcher, read_limited
from intellect_node.weights.relay import MAX_PATH
from intellect_node.weights.sources import faster_than_parent
from intellect_node.weights.store import WeightStore
from intellect_node.weights.tree import Candidate, below, is_path, parents
from intellect_protocol.envelope import Rejected
from intellect_protocol.identity import Identity
from intellect_protocol.messages import NodeRecord

logger = logging.getLogger("intellect_node.weights.follower")
KEEPALIVE_S = 1.0
"""Keep-alive period: also how fast a change of path travels one level down the tree (well under CHILD_TTL_S)."""
CYCLE_AVOID_S = 30.0
REFUSED_AVOID_S = 2.0
UNREACHABLE_AVOID_S = 10.0
UNROOTED_GRACE_S = 5.0
"""How long a parent may be cut off from the origin (re-parenting itself) before its child looks elsewhere."""
MAX_ATTACH_TRIES = 24
RECORDS_MAX_AGE_S = 5.0
"""Sources are planned from records read up to this long ago (alternates only need to be roughly right)."""
ROOTED_RECORDS_AGE_S = 15.0
"""With a parent in every stripe, records are read again in the background this often: they name only alternates
(the root above, holders for the endgame). Each read is answered by every DHT node a lookup visits with the run's
whole record dictionary (~12 KB at 17 nodes), so reading more often costs every node's upload."""
SILENT_KEEPALIVES = 2
"""Keep-alives in a row without a usable answer after which a node leaves its parent."""
FAST_ROUNDS, FAST_KEEPALIVE_S = 6, 0.5
ATTACH_TIMEOUT = aiohttp.ClientTimeout(total=3, connect=1)
KEEPALIVE_TIMEOUT = aiohttp.ClientTimeout(total=1.5, connect=1)
"""Two keep-alives in a row unanswered in this long (a cut-off parent sends no reset): the node leaves, ~3-4 s."""
ASK_STAGGER_S = 0.5
ASK_BACKOFF_S = 1.0, 30.0
"""A stripe without a parent asks again after the first of these, doubled after each round that found none, up to
the second (with a quarter either way at random); at once when the candidates change (a slot freed, a node came).
Asked every keep-alive, the origin and every full relay of the stripe were asked about three times a second by each
parentless node (a red-team swarm whose stripe-0 slot a leaf held: thousands of refusals in minutes, and the asker
past its key's allowance, so answered 429 whatever slot came free)."""
MAX_RETRY_AFTER_S = 60
"""A candidate's Retry-After on a 429 is honoured up to this (a larger one would let a node keep us from asking for
long). A 503's (no slot, in one stripe) is not: the backoff spaces the asking, and another stripe may have room."""
NO_PARENT_LOG_S = 30.0
"""A stripe without a parent says whom it asked and what they answered at most this often (INFO)."""
CHOOSE_BUDGET_S = 10.0
"""At most this long asking for a slot in one go (a fetch waits for it); the next round asks again."""
ATTACH_BODY_LIMIT = 64 * 1024
CLOCK_TOLERANCE_S = 5.0
CLIMB_REFUSED_S = 30.0
"""How long a grandparent that refused to take this node up (Attachments.climb) is not asked again."""
CLIMB_AFTER_MOVE_S = 10.0
"""Nor is one asked this soon after this node moved its home into the stripe: the grandparent decides who is at
home by the records, where the move shows a DHT lag later (follower.REHOME_HOLD_S), and meanwhile takes the
climber for a leaf and refuses it; refused, a node would not ask again for CLIMB_REFUSED_S and stay a level too
deep for a whole version."""


@dataclass(eq=False)
class Link:
    stripe: int
    home: bool
    """Whether this node takes children in this stripe (its path is then theirs, and a cycle is possible)."""
    parent: Candidate | None = None
    parent_was: str | None = None
    path: list[str] = field(default_factory=list)
    """Node ids from the origin down to this node, as the parent last told it."""
    depth: int = -1
    token: str = ""
    """What the parent named us with when it gave us the slot (sent on shard and news requests)."""
    unrooted_since: float | None = None
    unreachable: int = 0
    changed: asyncio.Event = field(default_factory=asyncio.Event)
    """Set when the parent changes (the keep-alive then checks the new parent's path at once)."""
    choosing: asyncio.Lock = field(default_factory=asyncio.Lock)
    unparented_said: float = -1e9
    """When a round of asking that found no parent in this stripe was last logged (NO_PARENT_LOG_S)."""
    ask_after: float = 0.0
    """No round of asking before this (time.monotonic()) unless the candidates changed (ASK_BACKOFF_S)."""
    ask_wait: float = 0.0
    """The wait after the last round that found no parent (doubled each time, 0 once one is found)."""
    asked_among: frozenset[tuple[str, bool]] = frozenset()
    """The candidates of that round and whether each had a free slot: a new one, or one with a slot come free, is
    worth asking at once (one gone is not: the callers leave out different nodes for a while)."""

    def attach_path(self) -> str:
        """Where to ask for (or keep, or give back) the slot; ``home=0``: this node takes no children in the
        stripe, so its slot goes to one that does when the parent has no free one (relay.ShardServer._make_room)."""
        return f"/relay/attach?stripe={self.stripe}" + ("" if self.home else "&home=0")


class Attachments:
    """Choosing, holding and leaving a parent in each stripe: a part of ``follower.WeightFollower``, which builds
    it and hands it what it needs. It owns the links (one per stripe), the nodes it avoids for a while, the clock
    offsets it signs in and the grandparents not to ask again; it reads the records, the version being fetched and
    when the node last moved its home through the callables it is given, and leaves its background work (slots
    given back, records published) to ``background`` and ``publish_soon``. ``start`` hands it the session and
    the fetcher (both made when the node starts)."""

    def __init__(
        self,
        identity: Identity,
        run_id: str,
        metrics: Metrics,
        store: WeightStore,
        read_records: Callable[[float], Awaitable[dict[str, NodeRecord]]],
        plan_stripes: Callable[[dict[str, NodeRecord]], None],
        fetching: Callable[[], int],
        moved_at: Callable[[], float],
        background: Callable[[Awaitable[object]], None],
        publish_soon: Callable[[], None],
    ) -> None:
        self.identity = identity
        self.node_id = identity.node_id
        self.run_id = run_id
        self.metrics = metrics
        self.store = store
        self.read_records = read_records
        """Every node's newest record, from a read at most this many seconds old (follower.WeightFollower._records)."""
        self.plan_stripes = plan_stripes
        """Replaces ``links`` with one per stripe once the origin's record says how many (before any parent)."""
        self.fetching = fetching
        """The version being fetched (-1: none)."""
        self.moved_at = moved_at
        """When this node last moved its home stripe (time.monotonic())."""
        self.background = background
        self.publish_soon = publish_soon
        self.session: aiohttp.ClientSession | None = None
        self.fetcher: ShardFetcher | None = None
        self.links = [Link(0, True)]
        """One parent per stripe; a single tree until the origin's record says how many stripes."""
        self._avoid: dict[str, float] = {}
        """Nodes not to ask for a slot before the time given (we just left them)."""
        self._climb_after: dict[str, float] = {}
        """Nodes not to ask to move up to before the time given (they refused: climb)."""
        self._clock: dict[str, float] = {}
        """How far each node we attach to has its clock ahead of ours (only when over CLOCK_TOLERANCE_S)."""
        self._retry_at: dict[str, float] = {}
        """Nodes that refused a slot with a Retry-After: not asked again before the time given."""

    def start(self, session: aiohttp.ClientSession, fetcher: ShardFetcher) -> None:
        self.session = session
        self.fetcher = fetcher

    @property
    def home_link(self) -> Link:
        return next((x for x in self.links if x.home), self.links[0])

    def token_for(self, node: str) -> str:
        """The token ``node`` named us with, if it is our parent in some stripe (sent on shard and news requests)."""
        return next((x.token for x in self.links if x.parent is not None and x.parent.node_id == node), "")

    def avoiding(self) -> set[str]:
        now = time.monotonic()
        self._avoid = {n: t for n, t in self._avoid.items() if t > now}
        return set(self._avoid)

    async def choose(self, records: dict[str, NodeRecord], exclude: set[str], link: Link | None = None) -> None:
        """Attach, then choose: ask the candidates for a slot, best first; a full node names its children, asked
        next (the free slots are further down). A candidate silent for ``ASK_STAGGER_S`` (cut off, its request
        would wait out the timeout) does not hold up the next: both are in flight, the first slot given wins."""
        if link is None:
            self.plan_stripes(records)
            link = self.home_link
        async with link.choosing:
            if link.parent is not None or self.session is None:
                return
            tried: set[str] = set()
            answers: list[str] = []
            stripe = link.stripe if len(self.links) > 1 else None
            now = time.monotonic()
            queue = parents(records, self.node_id, self.run_id, exclude | self.avoiding(), stripe, link.home)
            among = frozenset((c.node_id, _free(records.get(c.node_id))) for c in queue)
            if now < link.ask_after and among <= link.asked_among:
                return  # asked them all a moment ago and none came or freed a slot: the fetch goes on from alternates
            link.asked_among = among
            self._retry_at = {n: t for n, t in self._retry_at.items() if t > now}
            queue = [c for c in queue if c.node_id not in self._retry_at]
            deadline = now + CHOOSE_BUDGET_S
            asking: dict[asyncio.Task[tuple[int | None, object]], Candidate] = {}
            try:
                while (queue or asking) and time.monotonic() < deadline:
                    while queue and queue[0].node_id in tried:
                        queue.pop(0)
                    more = bool(queue) and len(tried) < MAX_ATTACH_TRIES
                    if more:
                        c = queue.pop(0)
                        tried.add(c.node_id)
                        asking[asyncio.ensure_future(self._post_attach(c, link))] = c
                    elif not asking:
                        break
                    wait = ASK_STAGGER_S if queue and len(tried) < MAX_ATTACH_TRIES else deadline - time.monotonic()
                    done, _ = await asyncio.wait(asking, timeout=max(0.0, wait), return_when=asyncio.FIRST_COMPLETED)
                    for task in done:
                        c = asking.pop(task)
                        status, body = task.result()
                        reason = body.get("reason") if isinstance(body, dict) and status == 409 else None
                        answers.append(f"{c.node_id[:8]}:{status}{'' if reason is None else f' {reason}'}")
                        if status == 200 and link.parent is None and self._adopt(c, body, link):
                            continue
                        if status is None or (status == 200 and link.parent and link.parent.node_id != c.node_id):
                            self._detach_soon(c, link)  # a slot we may hold (timed out) or no longer need
                        if status == 503 and isinstance(body, dict) and isinstance(body.get("children"), list):
                            names = [x for x in body["children"][:64] if isinstance(x, str)]
                            found = below(records, names, tried | exclude | {self.node_id})
                            if stripe is not None:  # only those at home in this stripe take children in it
                                found = [x for x in found if _home(records.get(x.node_id)) == stripe]
                            queue[:0] = found
                    if link.parent is not None:
                        return
            finally:
                for task, c in asking.items():  # still waiting on slower candidates: they may give a slot
                    task.cancel()
                    self._detach_soon(c, link)
                now = time.monotonic()
                if link.parent is None:
                    link.ask_wait = min(ASK_BACKOFF_S[1], max(ASK_BACKOFF_S[0], 2 * link.ask_wait))
                    link.ask_after = now + link.ask_wait * random.uniform(0.75, 1.25)
                if link.parent is None and now - link.unparented_said >= NO_PARENT_LOG_S:
                    link.unparented_said = now
                    logger.info(
                        "no parent in stripe %d (%s here): asked %s",
                        link.stripe,
                        "home" if link.home else "a leaf",
                        ", ".join(answers) or "nobody (no candidate in the records)",
                    )

    def _adopt(self, c: Candidate, body: object, link: Link | None = None) -> bool:
        """Take ``c`` as the parent if its answer shows a path from the origin without us in it."""
        link = link or self.home_link
        path = body.get("path") if isinstance(body, dict) else None
        token = body.get("token") if isinstance(body, dict) else None
        if not (
            is_path(path)
            and path
            and path[0] == self.run_id
            and self.node_id not in path
            and isinstance(token, str)
            and len(token) <= 64
        ):
            self._detach_soon(c, link)
            return False
        link.token = token
        was = link.parent_was
        link.parent = Candidate(c.node_id, c.url, len(path) - 1, True, frozenset({link.stripe}))
        link.path = [*path, self.node_id]
        link.depth = len(path)
        link.unrooted_since = None
        link.unreachable = 0
        link.ask_after, link.ask_wait = 0.0, 0.0
        if self.fetcher is not None:  # refused as an alternate a moment ago (full, say): as our parent it serves us
            self.fetcher.forgive(c.node_id)
        logger.info("parent=%s depth=%d stripe=%d (was %s)", c.node_id, link.depth, link.stripe, was)
        if was is not None:
            self.metrics.inc("node_relay_reparents_total")
        link.changed.set()
        self.publish_soon()
        return True

    async def drop_parent(self, why: str, avoid_s: float, link: Link | None = None) -> None:
        link = link or self.home_link
        c = link.parent
        if c is None:
            return
        logger.info("leaving parent %s (stripe %d): %s", c.node_id, link.stripe, why)
        link.parent_was = c.node_id
        link.parent = None
        link.path = []
        self._avoid[c.node_id] = time.monotonic() + avoid_s
        if self.fetcher is not None and not any(x.parent and x.parent.node_id == c.node_id for x in self.links):
            self.fetcher.abort_source(c.node_id)  # what is in flight from it stops now, not at its deadline
        self._detach_soon(c, link)
        self.publish_soon()

    async def leave(self, why: str, avoid_s: float, link: Link | None = None) -> None:
        """Drop the parent (see attach_once), choose a new one now, and let a running fetch pick it up."""
        link = link or self.home_link
        await self.drop_parent(why, avoid_s, link)
        records = await self.read_records(RECORDS_MAX_AGE_S)
        await self.choose(records, self.fetcher._excluded() if self.fetcher is not None else set(), link)
        if self.fetcher is not None:
            await self.fetcher.refresh_now()

    def _detach_soon(self, c: Candidate, link: Link | None = None) -> None:
        """Give the slot back at once (best effort; it frees itself after the child TTL otherwise)."""
        if self.session is None:
            return
        session, where = self.session, (link or self.home_link).attach_path()
        headers = signed_headers(self.identity, "DELETE", where, c.node_id, self._clock.get(c.node_id, 0.0))

        async def detach() -> None:
            try:
                async with session.delete(f"{c.url}{where}", headers=headers, timeout=ATTACH_TIMEOUT):
                    pass
            except (aiohttp.ClientError, TimeoutError):
                pass

        self.background(detach())

    async def _post_attach(
        self, c: Candidate, link: Link | None = None, timeout: aiohttp.ClientTimeout | None = None
    ) -> tuple[int | None, object]:
        """POST /relay/attach, signed: (status, JSON body or None), (None, None) when the node cannot be reached.
        The body is a peer's word: bounded in size, and anything that is not plain JSON counts as no body."""
        assert self.session is not None
        link = link or self.home_link
        where = link.attach_path()
        fetching = self.fetching()
        if fetching >= 0:  # how far we are: a parent further behind refuses (relay.BEHIND_SHARDS)
            where += f"&v={fetching}&have={self.store.held(fetching, link.stripe, len(self.links))}"
        headers = signed_headers(self.identity, "POST", where, c.node_id, self._clock.get(c.node_id, 0.0))
        try:
            async with self.session.post(f"{c.url}{where}", headers=headers, timeout=timeout or ATTACH_TIMEOUT) as resp:
                offset = server_clock_offset(resp.headers.get("Date"))
                if offset is not None:  # a clock far from the parent's would fail its time window: sign in its time
                    self._clock[c.node_id] = offset if abs(offset) > CLOCK_TOLERANCE_S else 0.0
                    if len(self._clock) > 4096:
                        self._clock.clear()
                retry = decimal(resp.headers.get("Retry-After", ""), 9) if resp.status == 429 else None
                if retry:  # a rate (the address's or the key's, in every stripe): honoured, bounded (choose skips it)
                    self._retry_at[c.node_id] = time.monotonic() + min(retry, MAX_RETRY_AFTER_S)
                    if len(self._retry_at) > 4096:
                        self._retry_at.clear()
                body: object = None
                if resp.status in (200, 409, 503):
                    try:
                        body = json.loads(await read_limited(resp, ATTACH_BODY_LIMIT))
                    except (ValueError, RecursionError, Rejected):
                        body = None
                return resp.status, body
        except (aiohttp.ClientError, TimeoutError):
            return None, None

    async def leave_slow_parent(self) -> None:
        """In each stripe, move below a node that proved much faster than the parent, if it has a slot for us
        (one at home in another stripe refuses: we stay)."""
        for link in self.links:
            f, old = self.fetcher, link.parent
            best = faster_than_parent(f.sources, old.node_id, self.run_id, f.banned) if f and old else None
            if best is None or old is None or f is None:
                continue
            c = Candidate(best.node_id, best.url, best.depth, True)
            was, now = f.sources[old.node_id].bps, best.bps
            status, body = await self._post_attach(c, link)
            if status != 200 or link.parent is not old:
                if status == 200:
                    self._detach_soon(c, link)
                continue
            assert old is not None  # (the identity check above widened it for mypy)
            link.parent_was = old.node_id
            if self._adopt(c, body, link):
                logger.info(
                    "left slow parent %s (%.1f MB/s) for %s (%.1f MB/s)", old.node_id, was / 1e6, c.node_id, now / 1e6
                )
                self.metrics.inc(
                    "node_relay_slow_parent_moves_total", help="moves from a parent much slower than another"
                )
                self._detach_soon(old, link)

    async def climb(self, records: dict[str, NodeRecord]) -> None:
        """Move up in the home stripe: a node at home there serves children, and the shallower it sits the fewer
        relays its subtree's data passes through, each of which shares its upload unevenly between children
        (TCP) and leaves the slower-fed below it idle in a swarm that needs every upload busy. Nodes at home that
        attach late find the nodes near the root full of leaves and go deeper (docs/notes/stripes-history.md). So,
        between versions, a node at home whose parent there is not the
        stripe's root asks its grandparent (its path's, at home there like every node on it) for a slot; a full
        one gives it a leaf's slot (stripes.to_release) and the leaf attaches lower at its next keep-alive. One
        level a round, each node asking only its own grandparent: a node is asked by its grandchildren, at most
        once in CLIMB_REFUSED_S each after refusing them."""
        link, now = self.home_link, time.monotonic()
        c, path = link.parent, link.path
        if c is None or not link.home or len(self.links) < 2 or self.session is None or len(path) < 4:
            return
        up = path[-3]
        r = records.get(up)
        if up == self.run_id or self._climb_after.get(up, 0.0) > now or up in self.avoiding():
            return
        if now - self.moved_at() < CLIMB_AFTER_MOVE_S:
            return
        if r is None or r.relay is None or not r.http_url or r.relay.stripe != link.stripe:
            return
        t = Candidate(up, r.http_url, len(path) - 3, True)
        status, body = await self._post_attach(t, link)
        if link.parent is not c:  # it changed meanwhile (left, re-parented): keep no second slot
            if status == 200:
                self._detach_soon(t, link)
            return
        if status != 200:
            logger.debug(
                "grandparent %s did not take us up in stripe %d (%s): not asked again for %.0fs",
                up[:8],
                link.stripe,
                status,
                CLIMB_REFUSED_S,
            )
            self._climb_after = {n: x for n, x in self._climb_after.items() if x > now}
            self._climb_after[up] = time.monotonic() + CLIMB_REFUSED_S
            return
        assert c is not None  # (the identity check above widened it for mypy)
        link.parent_was = c.node_id
        if self._adopt(t, body, link):
            logger.info("moved up in stripe %d: from below %s to below %s", link.stripe, c.node_id[:8], up[:8])
            self.metrics.inc("node_relay_climbs_total", help="moves nearer the origin in the home stripe")
            self._detach_soon(c, link)

    async def keep_link(self, session: aiohttp.ClientSession, link: Link) -> None:
        """Hold this node's slot at its parent in one stripe, so the tree stays as it is between versions, and
        find a parent when there is none. Right after a change of parent ask every half second for a few rounds:
        a cycle (two nodes that re-parented below each other at once) shows in the parent's path, and is left
        before a version has to go through it."""
        fast = 0
        while True:
            if link.changed.is_set():
                link.changed.clear()
                fast = FAST_ROUNDS
            if fast > 0 or link.unreachable:  # just moved, or the last keep-alive went unanswered: ask sooner
                fast = max(0, fast - 1)
                await asyncio.sleep(FAST_KEEPALIVE_S)
            else:
                try:
                    await within(link.changed.wait(), KEEPALIVE_S)
                    continue
                except TimeoutError:
                    pass
            try:
                if link.parent is None:  # records read afresh when it is time to ask again, else a recent read
                    excluded = self.fetcher._excluded() if self.fetcher else set()
                    fresh = time.monotonic() >= link.ask_after
                    await self.choose(await self.read_records(0.0 if fresh else RECORDS_MAX_AGE_S), excluded, link)
                    if link.parent is not None and self.fetcher is not None:
                        await self.fetcher.refresh_now()
                else:
                    await self.attach_once(session, link)
            except Exception:  # a bug here must not take the node down with it: logged, counted, tried again
                self.metrics.inc("node_errors_total", label="keep_attached")
                logger.exception("keeping the relay tree attachment failed; trying again")

    async def attach_once(self, session: aiohttp.ClientSession, link: Link | None = None) -> None:
        """One keep-alive: hold the slot, learn the parent's depth and path, leave a cycle or a parent that
        lost its way to the origin."""
        link = link or self.home_link
        c = link.parent
        if c is None:
            return
        status, body = await self._post_attach(c, link, KEEPALIVE_TIMEOUT)
        if c is not link.parent:  # changed meanwhile: do not keep a second slot there
            if status == 200 and (link.parent is None or link.parent.node_id != c.node_id):
                self._detach_soon(c, link)
            return
        path = body.get("path") if isinstance(body, dict) else None
        reason = body.get("reason") if isinstance(body, dict) else None
        if status == 409 and reason == "ancestor":  # it found us in its own path: a cycle, as below
            status, path = 200, [self.node_id]
        elif status in (409, 503):  # the slot went to another node, or it lost its own way: choose again
            await self.leave(f"it refused us ({status} {reason or ''})".strip(), REFUSED_AVOID_S, link)
            return
        if status != 200 or not is_path(path):
            # unreachable, or an answer that holds no slot for us: two in a row and we look elsewhere
            link.unreachable += 1
            if link.unreachable >= SILENT_KEEPALIVES:
                await self.leave(f"no usable keep-alive answer ({status})", UNREACHABLE_AVOID_S, link)
            return
        link.unreachable = 0
        assert isinstance(path, list)
        token = body.get("token") if isinstance(body, dict) else None
        if isinstance(token, str) and len(token) <= 64:
            link.token = token
        if self.node_id in path:  # our parent descends from us: nothing can reach us through it
            at = path.index(self.node_id)
            logger.warning("cycle in the relay tree through %s", "->".join(p[:8] for p in path[at:]))
            self.metrics.inc("node_relay_cycles_left_total", help="times this node found itself below its own child")
            await self.leave("cycle", CYCLE_AVOID_S, link)
            return
        if not path or path[0] != self.run_id:  # the parent lost its way to the origin: it may find it again
            link.path = []
            now = time.monotonic()
            link.unrooted_since = link.unrooted_since or now
            if now - link.unrooted_since > UNROOTED_GRACE_S:
                await self.leave("not connected to the origin", REFUSED_AVOID_S, link)
            return
        link.unrooted_since = None
        link.path = [*path[-MAX_PATH:], self.node_id]
        assert c is not None  # (the identity check above widened it for mypy)
        if link.depth != len(path) or c.depth != len(path) - 1:
            link.depth = len(path)  # the parent moved in the tree: so did we
            link.parent = Candidate(c.node_id, c.url, len(path) - 1, True, frozenset({link.stripe}))
            self.publish_soon()


def _free(r: NodeRecord | None) -> bool:
    return r is not None and r.relay is not None and r.relay.slots_free > 0


def _home(r: NodeRecord | None) -> int:
    return r.relay.stripe if r is not None and r.relay is not None else -1
