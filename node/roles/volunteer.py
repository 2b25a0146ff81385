"""What every joining node does: join the DHT, read the signed run spec, follow the trainer's weights.

``Volunteer`` owns the node's identity, DHT membership, HTTP server, weight store, shard server (when relaying)
and weight follower; the roles (``inference``, ``relay``) subclass it and add their work loop.
"""

from __future__ import annotations

import abc
import asyncio
import logging
import math
import shutil
import time
from typing import Any

import aiohttp

from intellect_node import __version__
from intellect_node.aio import Backoff
from intellect_node.config import NodeConfig
from intellect_node.judging.tasks import require_jail
from intellect_node.p2p.dht import Membership, PeersUnreachable
from intellect_node.p2p.gossip import Gossip
from intellect_node.p2p.http import HttpServer
from intellect_node.p2p.keys import load_or_create
from intellect_node.p2p.metrics import Metrics
from intellect_node.p2p.reach import announced, ask_dialback
from intellect_node.p2p.transport import DELIVERY_ERRORS
from intellect_node.roles.invites import FIXES, call_redeem
from intellect_node.runtime import announce
from intellect_node.weights.files import HTTP_TIMEOUT
from intellect_node.weights.follower import WeightFollower
from intellect_node.weights.relay import ShardServer
from intellect_node.weights.store import WeightStore
from intellect_node.weights.stripes import DEFAULT_STRIPES
from intellect_protocol.admission import invite_envelope, solve_pow
from intellect_protocol.envelope import Rejected, open_signed
from intellect_protocol.messages import NodeRecord, Role, RunSpec, VersionNotice

logger = logging.getLogger(__name__)
POLL_S = 0.25
"""How often to look at the trainer's record while waiting for something to do."""
PUBLISH_MIN_S = 1.0
TRAINER_REFRESH_S = 10.0
"""The trainer's DHT record is read at most this often: new versions arrive as signed notices on the run's
``versions`` topic (node/p2p/gossip.py); the record is for the trainer's addresses and the run's epoch."""
REBOOTSTRAP_S = 20.0
"""Without a trainer record signed in the last this many seconds (it republishes every 8), a volunteer re-joins
the DHT through the trainer's last known address and --peers."""
JOIN_RETRY_MAX_S = 30.0
"""Longest wait between two tries to join the DHT through --peers (doubling from 1 s, with jitter)."""
RECHECK_S = 120.0
"""A node whose reachability could not be checked (the trainer refused, was silent or could not be found) asks
again this often, announcing no address meanwhile."""


class Volunteer(abc.ABC):
    role: Role = "inference"

    def __init__(self, node: NodeConfig) -> None:
        if node.run_id is None:
            raise SystemExit("join needs --run-id: copy the whole line that `intellect-node bootstrap` printed")
        if not node.peers:
            raise SystemExit("join needs --peers <multiaddr>: copy the line that `intellect-node bootstrap` printed")
        self.cfg = node
        self.run_id: str = node.run_id
        self.identity = load_or_create(node.data_dir / "node.key")
        self.metrics = Metrics()
        self.membership = Membership(self.identity, self.run_id, self.metrics)
        if node.fresh:  # (join --fresh) the weights go; the keys stay
            shutil.rmtree(node.data_dir / "weights", ignore_errors=True)
            logger.info("--fresh: deleted the weights held under %s", node.data_dir / "weights")
        self.store = WeightStore(node.data_dir / "weights" / self.run_id, self.run_id)
        limit = node.upload_limit_mbps * 1e6 / 8 if node.upload_limit_mbps else None
        self._publish_soon = asyncio.Event()
        self.server = (
            ShardServer(
                self.store,
                self.metrics,
                node.relay_slots or DEFAULT_STRIPES,
                limit,
                on_change=self._publish_soon.set,
                node_id=self.identity.node_id,
            )
            if node.relay
            else None
        )
        self.http = HttpServer(self.metrics, self.status, self.server.routes() if self.server else [])
        self.follower: WeightFollower | None = None
        self.spec: RunSpec | None = None
        self.pow_nonce = 0
        try:
            self.invite = invite_envelope(node.invite) if node.invite else b""
        except ValueError as e:
            raise SystemExit(f"--invite: {e}; copy the whole token the run's operator gave you") from None
        self.status_url = ""
        self.maddrs: list[str] = []
        self._trainer_seen = time.monotonic()
        self._fetch_failed = -1
        self._said_away = -math.inf
        """When the trainer's absence was last logged (once per absence at WARNING)."""
        """The version whose fetch last failed (``fetch_failed``)."""
        self._trainer_maddrs: list[str] = []
        self._rebootstrapped = -math.inf
        self.p2p: Any = None
        self.reachable = False
        """True once the trainer's dial-back reached both the p2p and the HTTP port (node/p2p/reach.py): only then
        are the HTTP URL and relay slots announced."""
        self.p2p_reached = False
        """True once the trainer's dial-back reached the p2p port: only then are the p2p addresses announced."""
        self.reachability: dict[str, Any] = {"checked": False}
        self.gossip: Gossip | None = None
        self.notice: VersionNotice | None = None
        """The newest version notice heard from the run key (none yet: None)."""
        self.news = asyncio.Event()
        self._record: NodeRecord | None = None
        self._record_at = -math.inf

    @property
    def version(self) -> int:
        """The newest complete version held (-1: none)."""
        return max(self.store.complete_versions(), default=-1)

    def record(self) -> NodeRecord:
        return NodeRecord(
            run_id=self.run_id,
            node_id=self.identity.node_id,
            role=self.role,
            p2p_maddrs=self.maddrs[:8] if self.p2p_reached else [],
            http_url=self.status_url if self.reachable else None,
            weight_version=self.version,
            epoch=self.store.epoch or 0,
            updated=time.time(),
            software=f"intellect-node/{__version__}",
            relay=self.follower.relay_info() if self.follower is not None and self.reachable else None,
            pow_nonce=self.pow_nonce,
        )

    async def publish(self) -> None:
        try:
            await self.membership.publish_record(self.record())
        except Exception as e:  # a DHT that times out, fails or hands us something we cannot use
            logger.warning("could not publish the DHT record: %s", e)

    async def _coalesced_publish(self) -> None:
        """The follower's changes (parent, versions held) go out with the next coalesced store."""
        self._publish_soon.set()

    async def publish_on_change(self) -> None:
        """Republish as soon as something others plan with changes (a slot taken or freed)."""
        while True:
            await self._publish_soon.wait()
            self._publish_soon.clear()
            await self.publish()
            # at most one DHT store a second, however busy the slots and versions are: each store of a record
            # travels to several DHT peers, and a record's stores are most of a node's libp2p bytes
            await asyncio.sleep(PUBLISH_MIN_S)

    def fetch_failed(self, version: int, error: object) -> None:
        """A version could not be fetched: said at WARNING once per version, at DEBUG when it fails again (while the
        trainer is down a volunteer tries every few seconds; the state says it waits)."""
        say = logger.debug if version == self._fetch_failed else logger.warning
        say("could not fetch version %d: %s", version, error)
        self._fetch_failed = version

    def state(self) -> dict[str, Any]:
        """Whether this node does its job now, and what it does or waits for, in words: in ``/status``, in
        ``intellect-node status`` (which exits 1 when it is not ok) and on the dashboard. A volunteer whose trainer
        is gone, or whose every batch is refused, says so rather than looking healthy."""
        if self.spec is None:
            return {"ok": False, "doing": "looking for the run in the DHT (check --run-id and --peers)"}
        away = time.monotonic() - self._trainer_seen
        if away > REBOOTSTRAP_S:
            return {
                "ok": False,
                "doing": f"waiting for the trainer: no record of it for {away:.0f} s (stopped, restarting, or cut off "
                "from this node); nothing to do until it is back",
            }
        return self.working()

    def working(self) -> dict[str, Any]:
        """The role's own part of ``state`` (the run and its trainer are found)."""
        return {"ok": True, "doing": f"relaying the weights (version {self.version})"}

    def status(self) -> dict[str, Any]:
        f = self.follower
        return {
            "role": self.role,
            "state": self.state(),
            "node_id": self.identity.node_id,
            "run_id": self.run_id,
            "epoch": self.store.epoch,
            "weight_version": self.version,
            "reachability": self.reachability,
            "peers": len(f._seen) if f else 0,  # nodes whose records it read (the relay tree's view)
            "versions_held": self.store.complete_versions(),
            "relay": {
                "enabled": self.server is not None,
                "depth": f.depth if f else -1,
                "parent": f.parent if f else None,
                "home_stripe": f.home if f else -1,
                "parents": {str(s): p for s, p in f.parents().items()} if f else {},
                "children": self.server.children() if self.server else [],
                "slots": self.server.slots if self.server else 0,
                "slots_free": self.server.slots_free() if self.server else 0,
                "upload_mbps": round(self.server.upload_bps() * 8 / 1e6, 2) if self.server else 0.0,
                "fetching": f.fetching if f else -1,
                "fetching_verified_shards": self.store.verified_count(f.fetching) if f and f.fetching >= 0 else 0,
                "bans": self.metrics.counter("node_relay_bans_total"),
                "bytes_received": self.metrics.counter("node_relay_bytes_received_total"),
                "bytes_sent": self.metrics.counter("node_relay_bytes_sent_total"),
            },
        }

    def _join_deadline(self) -> float:
        """When ``join`` stops looking for the run: ``--join-timeout`` seconds from now, never for 0 (the Docker
        image's default: a container restarted while the trainer restarts waits for it)."""
        t = self.cfg.join_timeout_s
        return time.monotonic() + t if t > 0 else math.inf

    async def _join_dht(self) -> list[str]:
        """Join the DHT through ``--peers``, trying again while none of them answers (a trainer restarting, a
        volunteer started first) with waits doubling from 1 s to ``JOIN_RETRY_MAX_S`` (aio.Backoff), until
        ``--join-timeout``. A taken port or a clock far off ends the node at once (no try would do better)."""
        deadline, waits = self._join_deadline(), Backoff(1.0, JOIN_RETRY_MAX_S)
        while True:
            try:
                return await self.membership.start(self.cfg.host, self.cfg.p2p_port, self.cfg.peers, self.cfg.data_dir)
            except PeersUnreachable as e:
                pause = waits.next()
                if time.monotonic() + pause >= deadline:
                    raise SystemExit(
                        f"{e.code} (tried {waits.failures} times in {self.cfg.join_timeout_s:.0f}s; --join-timeout 0 "
                        "waits for ever)"
                    ) from None
                logger.warning("none of --peers answered (try %d); trying again in %.0fs", waits.failures, pause)
                self.metrics.inc("node_join_retries_total", help="tries to join the DHT that found no peer answering")
                await asyncio.sleep(pause)

    async def _wait_for_spec(self) -> RunSpec:
        deadline = self._join_deadline()
        while time.monotonic() < deadline:
            spec = await self.membership.get_spec()
            if spec is not None:
                return spec
            await asyncio.sleep(POLL_S)
        raise SystemExit(
            f"no run {self.run_id} found in the DHT within {self.cfg.join_timeout_s:.0f}s; check --run-id and "
            "--peers against the line the trainer printed, and that the trainer is still running"
        )

    async def _prove_identity(self, spec: RunSpec) -> None:
        """What the run's admission policy asks of this identity first: its proof of work (once per run epoch).
        An invite is redeemed once the node can reach the trainer (``redeem_invite``)."""
        a = spec.admission
        if a.pow_bits:
            started = time.monotonic()
            self.pow_nonce = await asyncio.to_thread(
                solve_pow, self.run_id, spec.epoch, self.identity.node_id, a.pow_bits
            )
            logger.info("proof of work bits=%d seconds=%.2f", a.pow_bits, time.monotonic() - started)

    async def _on_version(self, data: bytes, peer: str) -> None:
        """A version notice: believed only when signed by the run key, and then only as news (the version itself
        is checked against its signed manifest when fetched)."""
        signed = open_signed(data, VersionNotice)
        n = signed.message
        if signed.signer_id != self.run_id or n.run_id != self.run_id:
            raise Rejected("foreign_notice", f"a version notice signed by {signed.signer_id}")
        if self.notice is None or (n.epoch, n.version) > (self.notice.epoch, self.notice.version):
            self.notice = n
            self.news.set()
            self.metrics.set("node_version_noticed", n.version, help="newest version announced on gossip")

    def _noticed(self, record: NodeRecord) -> NodeRecord:
        """The trainer's record, with the version of a newer notice of the same epoch."""
        n = self.notice
        if n is not None and n.epoch == record.epoch and n.version > record.weight_version:
            return record.model_copy(update={"weight_version": n.version})
        return record

    async def trainer(self) -> NodeRecord | None:
        """The trainer's current record (its version raised by newer gossip notices); None while it cannot be read
        (the caller waits and asks again). The DHT is read at most every TRAINER_REFRESH_S, or at once when a
        notice names a newer epoch. After REBOOTSTRAP_S without the record, the node re-joins the DHT through the
        trainer's last known address and --peers: a restarted trainer keeps its address, but a node whose only
        DHT contact it was is cut off meanwhile."""
        cached, n = self._record, self.notice
        if cached is not None and time.monotonic() - self._record_at < TRAINER_REFRESH_S:
            if n is None or n.epoch <= cached.epoch:
                return self._noticed(cached)
        record = None
        try:
            self.metrics.inc("node_dht_trainer_reads_total", help="reads of the trainer's record from the DHT")
            record = await self.membership.get_trainer()
        except Exception as e:  # a DHT that times out, fails or hands us something we cannot use
            self.metrics.inc("node_dht_read_failures_total")
            logger.warning("could not read the trainer's record from the DHT: %r", e)
        now = time.monotonic()
        # a record the trainer has not renewed for a while is one our DHT peer still holds while cut off from it
        if record is not None and time.time() - record.updated < REBOOTSTRAP_S:
            self._trainer_seen = now
            self._trainer_maddrs = list(record.p2p_maddrs)
            self._record, self._record_at = record, now
            if self.gossip is not None:  # its messages (acknowledgements for a whole swarm) are not rate-limited
                self.gossip.unlimited = {m.rsplit("/p2p/", 1)[-1] for m in record.p2p_maddrs if "/p2p/" in m}
        elif now - self._trainer_seen > REBOOTSTRAP_S and now - self._rebootstrapped > REBOOTSTRAP_S:
            self._rebootstrapped = now
            known = [*self._trainer_maddrs, *self.cfg.peers]
            try:
                answered = await self.membership.rebootstrap(known)
                # said once while the trainer is away (the state says it waits), then at DEBUG
                say = logger.warning if self._trainer_seen > self._said_away else logger.debug
                self._said_away = now
                say(
                    "no trainer record for %.0fs: re-joined the DHT through %d of %d known peers",
                    now - self._trainer_seen,
                    answered,
                    len(known),
                )
            except Exception as e:
                logger.warning("could not re-join the DHT through the known peers: %r", e)
        return self._noticed(record) if record is not None else None

    async def follow_epoch(self, trainer: NodeRecord) -> bool:
        """Follow the run into a newer epoch (the trainer started it over: its versions count from 0 again and
        name other weights): the new signed spec replaces ours and every version of the old epoch is deleted.
        True when that happened. A record of an older epoch (a replay, a DHT replica behind) changes nothing; the
        caller acts on the trainer's record only once its epoch is ours."""
        assert self.spec is not None
        if trainer.epoch <= self.spec.epoch:
            if trainer.epoch < self.spec.epoch:
                self.metrics.inc(
                    "node_older_epoch_records_ignored_total", help="trainer records of an earlier start of the run"
                )
            return False
        try:
            spec = await self.membership.get_spec()
        except Exception as e:  # a DHT that times out: the next look tries again
            logger.debug("could not read the run spec: %r", e)
            return False
        if spec is None or spec.epoch != trainer.epoch:
            return False  # the spec of the new epoch has not reached the replicas we asked yet
        if self.role in ("validator", "auditor"):  # they score completions (producers score none that need the jail)
            require_jail(spec.task)
        logger.warning(
            "the run was started over (epoch %d -> %d): dropping the old versions and following the new ones",
            self.spec.epoch,
            spec.epoch,
        )
        self.metrics.inc("node_epochs_followed_total", help="times the run was started over and this node followed")
        self.spec = spec
        self.store.set_epoch(spec.epoch)
        await self._prove_identity(spec)  # a proof of work is made for one epoch
        self._publish_soon.set()
        if self.follower is not None:
            self.follower.announced = -1
        self._publish_soon.set()
        return True

    @abc.abstractmethod
    async def work(self, spec: RunSpec, session: aiohttp.ClientSession) -> None:
        """The role's own loop (generate rollouts, or only relay)."""

    async def run(self) -> None:
        try:
            # the DHT process first: it must not inherit a listening socket (it would hold the port after a crash)
            self.maddrs = await self._join_dht()
            port = await self.http.start(self.cfg.host, self.cfg.http_port)
            self.maddrs, self.status_url = announced(self.cfg.host, self.cfg.announce, self.maddrs, port)
            (self.cfg.data_dir / "http.url").write_text(f"http://127.0.0.1:{port}\n")  # for `intellect-node status`
            spec = self.spec = await self._wait_for_spec()
            self.store.set_epoch(spec.epoch)  # versions held from an earlier start of the run are deleted
            await self._prove_identity(spec)
            if self.role in ("validator", "auditor"):  # they score completions: code, math and rubrics run jailed
                require_jail(spec.task)
            self.p2p = await self.membership.replicate_p2p()
            await self.redeem_invite(spec)
            await self.check_reachability()
            keep = self.cfg.keep_versions or spec.train.async_level + 1
            max_bytes = int(self.cfg.max_disk_gb * 1e9) if self.cfg.max_disk_gb else None
            self.follower = WeightFollower(
                self.identity,
                self.run_id,
                self.membership,
                self.store,
                self.metrics,
                self.server,
                keep,
                max_bytes,
                self._coalesced_publish,
            )
            if self.server is not None:
                follower = self.follower
                self.server.auth.members = follower.is_member
                self.server.depth = lambda: follower.depth
                self.server.path = lambda: follower.path
                self.server.home = lambda: follower.home
                self.server.home_of = follower.home_of
                follower.auto_slots = self.cfg.relay_slots is None
            await self.publish()
            await self.ready(spec)
            async with aiohttp.ClientSession(timeout=HTTP_TIMEOUT) as session:
                self.follower.start(session)
                async with asyncio.TaskGroup() as tasks:
                    tasks.create_task(self.membership.republish_forever(self.record))
                    if not self.reachability["checked"]:
                        tasks.create_task(self.recheck_reachability())
                    tasks.create_task(self.publish_on_change())
                    tasks.create_task(self.follower.keep_attached(session))
                    if self.role in ("relay", "inference"):  # news from the parent; validators read the record
                        tasks.create_task(self.follower.watch_parent(session))
                    tasks.create_task(self.work(spec, session))
        finally:
            if self.gossip is not None:
                await self.gossip.close()
            await self.http.close()
            await self.membership.close()

    async def redeem_invite(self, spec: RunSpec) -> None:
        """In an invite-only run, have the trainer bind the invite given on the command line to this node, once
        (node/roles/invites.py); a node admitted before needs none. Tries until ``--join-timeout`` while the
        trainer cannot be reached or is busy; a refusal ends the node with the reason and what to do."""
        if spec.admission.policy != "invite":
            return
        deadline = self._join_deadline()
        detail = "the trainer's record could not be read"
        while time.monotonic() < deadline:
            trainer = await self.membership.get_trainer()
            if trainer is None or not trainer.p2p_maddrs:
                await asyncio.sleep(POLL_S)
                continue
            try:
                reply = await call_redeem(
                    self.p2p, self.identity, self.run_id, trainer.p2p_maddrs[0].rsplit("/p2p/", 1)[-1], self.invite
                )
            except (*DELIVERY_ERRORS, Rejected) as e:
                detail = f"the trainer did not answer: {e!r}"
                await asyncio.sleep(1.0)
                continue
            if reply.ok:
                logger.info("admitted to the invite-only run %s", self.run_id)
                return
            if reply.reason != "busy":
                raise SystemExit(
                    f"the trainer refused this node ({reply.reason}: {reply.detail}); "
                    f"{FIXES.get(reply.reason, 'ask the run operator')}"
                )
            detail = "the trainer is busy"
            await asyncio.sleep(1.0)
        raise SystemExit(
            f"could not redeem the invite within {self.cfg.join_timeout_s:.0f}s ({detail}); check that "
            "the trainer is running and reachable"
        )

    async def check_reachability(self) -> None:
        """Ask the trainer to dial us back (node/p2p/reach.py). Only what it reached is announced: the p2p
        addresses once it reached the p2p port, the HTTP URL and relay slots once it reached both (so nobody picks
        an unreachable node as a weight parent). Unreachable, refused or unanswered, the node still produces
        rollouts."""
        trainer = None
        for _ in range(20):
            try:
                trainer = await self.membership.get_trainer()
            except Exception as e:  # a DHT that times out, fails or hands us something we cannot use: look again
                logger.debug("could not read the trainer's record: %r", e)
            if trainer is not None and trainer.p2p_maddrs:
                break
            await asyncio.sleep(POLL_S)
        p2p_port = self.maddrs[0].split("/tcp/")[1].split("/")[0] if self.maddrs and "/tcp/" in self.maddrs[0] else "?"
        http_port = int(self.status_url.rsplit(":", 1)[-1])
        if trainer is None or not trainer.p2p_maddrs:
            self._unchecked("the trainer's record could not be read", p2p_port, http_port)
            return
        try:
            r = await ask_dialback(
                self.p2p,
                self.identity,
                self.run_id,
                trainer.p2p_maddrs[0].rsplit("/p2p/", 1)[-1],
                self.maddrs,
                http_port,
            )
        except Rejected as e:
            self._unchecked(f"the trainer did not check ({e})", p2p_port, http_port)
            return
        except DELIVERY_ERRORS as e:
            self._unchecked(f"the trainer did not answer a dial-back ({e!r})", p2p_port, http_port)
            return
        self.p2p_reached = r.p2p_ok
        self.reachable = r.p2p_ok and r.http_ok
        self.reachability = {"checked": True, "observed_ip": r.observed_ip, "p2p": r.p2p_ok, "http": r.http_ok}
        self.metrics.set("node_reachable", float(self.reachable), help="1 when the trainer could dial this node back")
        self._publish_soon.set()
        if not self.reachable:
            self.reachability["fix"] = (
                f"peers cannot reach this node at {r.observed_ip} (p2p {'ok' if r.p2p_ok else 'unreachable'}, "
                f"http {'ok' if r.http_ok else 'unreachable'}): it produces rollouts but relays no weights. To "
                f"relay too, forward TCP ports {p2p_port} and {http_port} of your router to this machine (start with "
                f"--p2p-port and --http-port to keep them fixed), --host 0.0.0.0 and --announce {r.observed_ip}"
            )
            logger.warning("reachability: %s", self.reachability["fix"])

    def _unchecked(self, why: str, p2p_port: str, http_port: int) -> None:
        """No dial-back answer: nothing is announced as reachable, and the volunteer is told what to check."""
        self.reachable = self.p2p_reached = False
        fix = (
            f"{why}: until a dial-back confirms them this node announces no addresses, relays no weights (it still "
            f"produces rollouts) and asks again every {RECHECK_S:.0f} s. Make sure TCP ports {p2p_port} and "
            f"{http_port} reach this machine from outside (forward them on your router; start with --p2p-port and "
            "--http-port to keep them fixed, --host 0.0.0.0 and --announce <your public IP>); `intellect-node doctor "
            f"--peers <the join line's multiaddr> --run-id {self.run_id}` checks them"
        )
        self.reachability = {"checked": False, "detail": why, "fix": fix}
        self.metrics.set("node_reachable", 0.0, help="1 when the trainer could dial this node back")
        logger.warning("reachability not checked: %s", fix)

    async def recheck_reachability(self) -> None:
        """Ask again every RECHECK_S while no dial-back has answered (a trainer busy or silent at join)."""
        while not self.reachability["checked"]:
            await asyncio.sleep(RECHECK_S)
            await self.check_reachability()

    async def ready(self, spec: RunSpec) -> None:
        self.gossip = Gossip(self.p2p, self.run_id, self.metrics)
        self.gossip.subscribe("versions", self._on_version)
        info = {"p2p_maddrs": self.maddrs, "status_url": self.status_url, "reachability": self.reachability}
        announce(self.role, self.identity.node_id, self.run_id, info)
