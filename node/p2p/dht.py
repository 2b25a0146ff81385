"""DHT membership: the run spec and every node's signed, expiring record in a hivemind DHT.

Each node runs a hivemind DHT peer (its own process plus the go-libp2p daemon). Values under this run's keys
are signed envelopes (see ``protocol/records.py`` and docs/dht.md); ``RecordValidator`` makes every DHT peer
of ours refuse to store or return a record whose signature, signer or schema is wrong, and readers check again.

The DHT process dies with the node however the node dies (it watches its parent, and kills the go-libp2p daemon
on the way out), and is started before the node listens on any socket, so it never holds the node's ports. The
libp2p identity and port are kept in the node's data dir: a restarted node has the same multiaddr, so the join
line its operator printed, and every peer's routing table, stay valid.
"""

from __future__ import annotations

import asyncio
import errno
import functools
import hashlib
import logging
import os
import re
import socket
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Hashable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, TypeVar

import psutil
from hivemind.dht import DHT
from hivemind.dht.protocol import DHTProtocol
from hivemind.dht.routing import DHTID
from hivemind.dht.storage import DictionaryDHTValue
from hivemind.dht.validation import DHTRecord, RecordValidatorBase
from hivemind.p2p import P2P, PeerID
from hivemind.utils import ValueWithExpiration, get_dht_time
from hivemind.utils.multiaddr import Multiaddr
from hivemind.utils.serializer import MSGPackSerializer

from intellect_node.aio import within
from intellect_node.p2p.gossip import enable_pubsub
from intellect_node.p2p.metrics import Metrics
from intellect_protocol.envelope import Rejected, open_signed, seal
from intellect_protocol.identity import Identity
from intellect_protocol.messages import NodeRecord, RunSpec
from intellect_protocol.records import (
    CLOCK_SKEW_S,
    NODE_TTL_S,
    REPUBLISH_S,
    SPEC_TTL_S,
    nodes_key,
    spec_key,
    trainer_key,
)

logger = logging.getLogger(__name__)
DHT_TIMEOUT_S = 15.0
DHT_THREADS = 4
PARENT_POLL_S = 0.5
STORE_BEAM = 5
"""DHT nodes a store's lookup visits (hivemind's default: its bucket size, 20; it stores at the 5 nearest). Each node
a lookup visits answers with the key's whole value, which a store discards: for the run's ``nodes`` key every
record (~12 KB at 17 nodes), so with every node republishing each REPUBLISH_S, answering stores at 20 takes about
40 KB/s of each node's upload at 16 nodes (docs/notes/stripes-history.md, "The libp2p bytes were the DHT's
lookups"). Reads still visit 20: they find a record stored a little off its nearest."""
SHUTDOWN_S = 5.0
"""How long closing waits for the DHT process before it is killed (with its daemon)."""
T = TypeVar("T")
_CLOCK = re.compile(r"local time must be within .*local: ([0-9.]+), peer: ([0-9.]+)")


class PeersUnreachable(SystemExit):
    """The DHT peer could not start through the peers given: none answered (the trainer restarting, say, or a
    wrong address). Worth trying again, unlike a taken port or a clock off by minutes."""


def _require_free(host: str, port: int) -> None:
    """Refuse a --p2p-port another program listens on, saying so (the daemon reports it as a failure to reach
    the bootstrap peers)."""
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError as e:
            if e.errno == errno.EADDRINUSE:
                raise SystemExit(
                    f"--p2p-port {port} is already in use on {host} (another intellect-node, or another "
                    "program): stop it, or choose another port"
                ) from None
            raise SystemExit(
                f"--host {host} --p2p-port {port}: cannot listen there ({e.strerror}); give an address of this machine"
            ) from None


def die_with_parent(node_pid: int, poll_s: float = PARENT_POLL_S) -> None:
    """In a node's DHT process: once the node is gone (killed with SIGKILL, say, so that it could clean nothing up,
    or killed and not yet reaped: a zombie), kill this process's own children (the go-libp2p daemon) and exit.
    Polls the node's pid (the kernel's parent-death signal is tied to the thread that forked, which is not the
    process's lifetime); the node is the parent, or the fork server's client when started by one."""
    try:
        node = psutil.Process(node_pid)
    except psutil.NoSuchProcess:
        os._exit(0)

    def alive() -> bool:
        try:  # is_running: the same process, not a reused pid
            return node.is_running() and node.status() != psutil.STATUS_ZOMBIE
        except psutil.Error:
            return False

    def watch() -> None:
        while alive():
            time.sleep(poll_s)
        for child in psutil.Process().children(recursive=True):
            try:
                child.kill()
            except psutil.Error:
                pass
        os._exit(0)

    threading.Thread(target=watch, name="die-with-parent", daemon=True).start()


def bounded_answer(answer: Any) -> Any:
    """A peer's answer to a find, with a dictionary's own expiration bounded by its latest record's.

    hivemind checks every record inside a dictionary answer (our ``RecordValidator`` bounds each record's expiration
    by its lifetime), but takes the answer's own expiration as the peer says it. One answer under a run key with an
    expiration at infinity, empty or holding old records, would end every search for that key (a read asks for the
    latest value, ``sufficient_expiration_time`` infinity, and infinity reaches it), be cached by the reader for
    ever and be handed on by it to everyone who asks: the registry frozen or empty for the rest of the run. Bounded
    here, an answer expires when its latest record does, so no answer reaches a read's infinite bar: every read of
    a run key asks its peers again, and merges what they hold. An answer with no record is no answer."""
    if answer is None or not isinstance(answer.value, DictionaryDHTValue):
        return answer  # a regular value: its expiration goes through the record validator as it is
    with answer.value.freeze():  # expired records are kept for now: the merge and the readers judge them
        latest = max((expiration for _, (_, expiration) in answer.value.items()), default=None)
    if latest is None:
        return None
    return ValueWithExpiration(answer.value, min(answer.expiration_time, latest))


_CLOSING_NOISE = (
    ("hivemind.p2p.p2p_daemon", "use of closed network connection"),
    ("hivemind.dht.dht", "DHT did not shut down within the grace period"),
)
"""What hivemind logs at WARNING or ERROR on every clean stop of a node: the daemon's socket closing under its
accept loop, and a DHT process slower to end than hivemind's grace (Membership.close ends what is left of it)."""


def _not_closing_noise(record: logging.LogRecord) -> bool:
    return not any(record.name == name and text in record.getMessage() for name, text in _CLOSING_NOISE)


def quiet_clean_stops() -> None:
    """Drop ``_CLOSING_NOISE`` (an operator read every stop's go-libp2p ERROR line as a failure)."""
    for name, _ in _CLOSING_NOISE:
        if _not_closing_noise not in logging.getLogger(name).filters:
            logging.getLogger(name).addFilter(_not_closing_noise)


def bound_answers() -> None:
    """In the DHT process, before it starts: every find answer a peer sends goes through ``bounded_answer``."""
    if getattr(DHTProtocol, "_intellect_bounded", False):
        return
    find = DHTProtocol.call_find

    async def call_find(self: DHTProtocol, peer: PeerID, keys: Any) -> Any:
        found = await find(self, peer, keys)
        if found is None:
            return None
        return {key: (bounded_answer(answer), nearest) for key, (answer, nearest) in found.items()}

    DHTProtocol.call_find = call_find  # type: ignore[method-assign]
    DHTProtocol._intellect_bounded = True  # type: ignore[attr-defined]


class _NodeDHT(DHT):
    """hivemind's DHT process, which dies with the node process, and whose daemon runs gossipsub.

    With ``fresh_process`` it is started by multiprocessing's fork server, not forked from the node. A fork shares
    the node's pages copy-on-write, and every page the node writes afterwards is copied, the child keeping the old
    one: the trainer's weights (and a resumed checkpoint), in memory before its DHT starts and written each step,
    would cost twice (docs/training.md, "Memory: the demo in 4 GB"). The fork server is a fresh interpreter that
    imports this module, hivemind and torch only (~440 MB with the DHT process, against ~240 MB for a fork of a
    node that has not loaded its model yet, which volunteers' nodes still do)."""

    fresh_process = False

    @staticmethod
    def _Popen(process_obj: Any) -> Any:
        if not process_obj.fresh_process:
            return DHT._Popen(process_obj)
        from multiprocessing import forkserver, popen_forkserver

        forkserver.set_forkserver_preload(["intellect_node.p2p.dht"])
        return popen_forkserver.Popen(process_obj)

    def run(self) -> None:
        die_with_parent(self._parent_pid)  # the node that created this DHT object
        quiet_clean_stops()
        bound_answers()  # no peer's answer may freeze a run key (bounded_answer)
        enable_pubsub()  # the run's gossip topics (node/p2p/gossip.py) ride on this daemon
        super().run()


async def _rebootstrap(maddrs: list[str], _dht: DHT, node: Any) -> int:
    """Inside the DHT process: connect to the peers at ``maddrs``, add those that answer to the routing table and
    look up our neighbours again. Returns how many answered."""
    answered = 0
    for maddr in maddrs:
        try:
            peer = PeerID.from_base58(maddr.rsplit("/p2p/", 1)[-1])
            await within(node.p2p._client.connect(peer, [Multiaddr(maddr.rsplit("/p2p/", 1)[0])]), 5)
            if await within(node.protocol.call_ping(peer), 5) is not None:
                answered += 1
        except Exception as e:  # unreachable, or a malformed address from a record: the next one
            logger.debug("re-bootstrap through %s failed: %r", maddr[:80], e)
    if answered:
        await within(node.find_nearest_nodes([node.node_id]), 10)
    return answered


def check_spec(value: object, run_id: str) -> RunSpec:
    if not isinstance(value, bytes):
        raise Rejected("malformed", "DHT value is not bytes")
    signed = open_signed(value, RunSpec)
    if signed.signer_id != run_id or signed.message.run_id != run_id:
        raise Rejected("foreign_spec", f"run spec signed by {signed.signer_id}, not by the run key {run_id}")
    return signed.message


class _Verified:
    """What already checked out, by the exact bytes checked: bounded, least recently used out first, thread-safe.

    Every read of the run's ``nodes`` key returns every node's record, each checked in the DHT process and again by the
    reader, at 0.14 ms a record: checked anew each time, 200 made-up keys registered in the DHT would cost each reader
    ~60 ms of CPU per read, and the trainer, which reads on every unknown signer, half its training rate (measured:
    benchmarks/adversary.py, sybil flood). A record's signature and schema do not change while its bytes do not, so they
    are checked once; what depends on the time is checked at every read."""

    def __init__(self, size: int = 4096) -> None:
        self.size = size
        self._items: OrderedDict[Hashable, Any] = OrderedDict()
        self._lock = threading.Lock()

    def __getstate__(self) -> dict[str, Any]:  # the validator travels to the DHT process: without the lock
        return {"size": self.size}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state["size"])  # type: ignore[misc]

    def get(self, key: Hashable) -> Any:
        with self._lock:
            found = self._items.get(key)
            if found is not None:
                self._items.move_to_end(key)
            return found

    def put(self, key: Hashable, value: Any) -> None:
        with self._lock:
            self._items[key] = value
            self._items.move_to_end(key)
            while len(self._items) > self.size:
                self._items.popitem(last=False)


_RECORDS = _Verified()


def _digest(*parts: bytes) -> bytes:
    """What the caches are keyed by: a digest, not the bytes (a record may be a few KiB, and there are thousands)."""
    h = hashlib.blake2b(digest_size=16)
    for part in parts:
        h.update(len(part).to_bytes(4, "big"))
        h.update(part)
    return h.digest()


def check_node_record(
    value: object, subkey: object, run_id: str, now: float | None = None, fresh: bool = True
) -> NodeRecord:
    """A node's record, checked: signed by the node it names, of this run, not from the future and, with
    ``fresh``, signed within the last ``NODE_TTL_S`` (plus clock skew). Readers check freshness per record; the
    DHT's own validator must not (see ``RecordValidator``). The signature and schema are checked once per exact
    record (``_Verified``)."""
    if not isinstance(value, bytes):
        raise Rejected("malformed", "DHT value is not bytes")
    key = (_digest(value), subkey, run_id) if isinstance(subkey, str) else None
    record: NodeRecord | None = _RECORDS.get(key) if key is not None else None
    checked = record is not None
    if record is None:
        signed = open_signed(value, NodeRecord)
        record = signed.message
    now = time.time() if now is None else now
    if record.updated > now + CLOCK_SKEW_S:
        raise Rejected("future_record", f"record signed at {record.updated:.0f}, now is {now:.0f}")
    if fresh and record.updated < now - NODE_TTL_S - CLOCK_SKEW_S:
        raise Rejected("stale_record", f"record signed at {record.updated:.0f}, now is {now:.0f}")
    if checked:
        return record
    if signed.signer_id != record.node_id or subkey != record.node_id:
        raise Rejected("signer_mismatch", f"record of {record.node_id} signed by {signed.signer_id}")
    if record.run_id != run_id:
        raise Rejected("wrong_run", f"record of run {record.run_id}")
    if record.role == "trainer" and record.node_id != run_id:
        raise Rejected("foreign_trainer", "only the run key's node may announce the trainer role")
    if key is not None:
        _RECORDS.put(key, record)
    return record


class RecordValidator(RecordValidatorBase):
    """Runs inside the DHT process: refuses records under this run's keys that fail our checks.

    hivemind calls this when a record is stored and again on every read, and drops a whole dictionary (every
    node's record under ``nodes``) when one sub-record fails on read. So every rule here must hold for ever once it
    held at store time: nothing that turns false as time passes (a record going stale). Freshness is judged per
    record by readers; here the expiration is bounded by the record's own ``updated``, so a stale record cannot be
    kept alive, and nothing is from the future."""

    def __init__(self, run_id: str) -> None:
        self.run_id = run_id
        self._spec = DHTID.generate(source=spec_key(run_id)).to_bytes()
        self._nodes = DHTID.generate(source=nodes_key(run_id)).to_bytes()
        self._trainer = DHTID.generate(source=trainer_key(run_id)).to_bytes()
        self._valid = _Verified()

    def validate(self, record: DHTRecord) -> bool:
        if record.key not in (self._spec, self._nodes, self._trainer):
            return True  # not ours: other applications may share the DHT
        seen = (_digest(record.key, record.subkey, record.value), record.expiration_time)
        if self._valid.get(seen):  # passed before; every rule below that held once holds for ever
            return True
        ok = self._validate(record)
        if ok:
            self._valid.put(seen, True)
        return ok

    def _validate(self, record: DHTRecord) -> bool:
        try:
            subkey = MSGPackSerializer.loads(record.subkey)
            value = MSGPackSerializer.loads(record.value)
            ttl = SPEC_TTL_S if record.key == self._spec else NODE_TTL_S
            if record.expiration_time > get_dht_time() + ttl + CLOCK_SKEW_S:
                return False
            if record.key == self._spec:
                check_spec(value, self.run_id)
                return bool(subkey == self.run_id)
            node = check_node_record(value, subkey, self.run_id, fresh=False)
            if record.expiration_time > node.updated + NODE_TTL_S + CLOCK_SKEW_S:
                return False  # kept alive past its freshness: refused now, and equally at every later read
            return record.key == self._nodes or node.role == "trainer"
        except Exception:  # any failure to parse a peer's record means: do not store it
            return False


class Membership:
    """Owns the node's DHT peer: start, publish, read, close."""

    def __init__(self, identity: Identity, run_id: str, metrics: Metrics) -> None:
        quiet_clean_stops()  # hivemind's word on a slow DHT stop is logged here, in the node's process
        self.identity = identity
        self.run_id = run_id
        self.metrics = metrics
        self.dht: DHT | None = None
        self.maddrs: list[str] = []
        self._executor = ThreadPoolExecutor(DHT_THREADS, thread_name_prefix="dht")
        """DHT calls block a thread until hivemind answers (a timeout here does not free it): they get threads of
        their own, so a slow or flooded DHT never holds up training, validation or publishing."""

    def _call(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> asyncio.Future[T]:
        return asyncio.get_running_loop().run_in_executor(self._executor, functools.partial(fn, *args, **kwargs))

    async def start(
        self, host: str, port: int, peers: list[str], state_dir: Path | None = None, fresh_process: bool = False
    ) -> list[str]:
        """Join the DHT (alone when ``peers`` is empty). With ``state_dir``, the libp2p key is kept there
        (``p2p.key``), and with ``port`` 0 the port of the last start is tried first (``p2p.port``). With
        ``fresh_process`` (a node that already holds much memory) the DHT process is not forked from this one."""
        if port:
            _require_free(host, port)
        identity_path = None
        saved_port = 0
        if state_dir is not None:
            state_dir.mkdir(parents=True, exist_ok=True)
            identity_path = state_dir / "p2p.key"
            try:
                saved_port = int((state_dir / "p2p.port").read_text()) if port == 0 else 0
            except (OSError, ValueError):
                saved_port = 0

        def _start(at: int) -> DHT:
            extra: dict[str, Any] = {}
            if identity_path is not None:
                extra = {"identity_path": str(identity_path), "check_if_identity_free": False}
            dht = _NodeDHT(
                initial_peers=peers or None,
                start=False,
                host_maddrs=[f"/ip4/{host}/tcp/{at}"],
                record_validators=[RecordValidator(self.run_id)],
                startup_timeout=30,
                **extra,
            )
            dht.fresh_process = fresh_process
            dht.run_in_background(await_ready=True)
            return dht

        try:
            try:
                dht = await asyncio.to_thread(_start, saved_port or port)
            except Exception:
                if not saved_port:
                    raise
                logger.info("the p2p port of the last start (%d) is taken; using another", saved_port)
                dht = await asyncio.to_thread(_start, port)
        except Exception as e:
            hint = (
                "check the multiaddr (copy it from the line `intellect-node bootstrap` printed) and that "
                "the trainer is running and reachable"
                if peers
                else f"check that {host}:{port} is free (--p2p-port)"
            )
            skew = _CLOCK.search(str(e))
            if skew:  # hivemind refuses peers whose clocks differ by more than a few seconds
                ahead = float(skew.group(1)) - float(skew.group(2))
                raise SystemExit(
                    f"this machine's clock is {abs(ahead):.0f} s {'ahead of' if ahead > 0 else 'behind'} the run's "
                    "peers, and the DHT accepts a few seconds at most: turn on time sync (`timedatectl set-ntp true`, "
                    "or install chrony) and join again"
                ) from None
            if peers:
                raise PeersUnreachable(f"could not start the DHT peer: {e}; {hint}") from None
            raise SystemExit(f"could not start the DHT peer: {e}; {hint}") from None
        self.dht = dht
        self.maddrs = [str(m) for m in dht.get_visible_maddrs()]
        if identity_path is not None and state_dir is not None:
            os.chmod(identity_path, 0o600)
            ports = [m.rsplit("/tcp/", 1)[-1].split("/")[0] for m in self.maddrs if "/tcp/" in m]
            if ports and ports[0].isdigit():
                (state_dir / "p2p.port").write_text(ports[0])
        return self.maddrs

    async def rebootstrap(self, maddrs: list[str]) -> int:
        """Reconnect a node cut off from the DHT (its only contact restarted, say) through ``maddrs``: the
        trainer's last known addresses and saved peers. Returns how many of them answered."""
        dht = self._require()
        fn = functools.partial(_rebootstrap, [m for m in maddrs if "/p2p/" in m][:16])
        answered = await within(self._call(dht.run_coroutine, fn), DHT_TIMEOUT_S + 30)
        self.metrics.inc("node_dht_rebootstraps_total", help="times this node re-joined the DHT through known peers")
        return int(answered)

    def _require(self) -> DHT:
        if self.dht is None:
            raise RuntimeError("Membership.start() has not run")
        return self.dht

    async def replicate_p2p(self) -> P2P:
        return await self._require().replicate_p2p()

    async def _store(self, key: str, subkey: str, value: bytes, ttl: float) -> bool:
        dht = self._require()
        self.metrics.inc("node_dht_stores_total", label=key.rsplit("/", 1)[-1], help="DHT stores, by key")
        stored = self._call(dht.store, key, value, get_dht_time() + ttl, subkey=subkey, beam_size=STORE_BEAM)
        return bool(await within(stored, DHT_TIMEOUT_S))

    async def _get(self, key: str) -> dict[object, object]:
        dht = self._require()
        self.metrics.inc("node_dht_gets_total", label=key.rsplit("/", 1)[-1], help="DHT reads, by key")
        found = await within(self._call(dht.get, key, True), DHT_TIMEOUT_S)
        if found is None or not isinstance(found.value, dict):
            return {}
        return {k: v.value for k, v in found.value.items()}

    async def publish_spec(self, spec: RunSpec) -> bool:
        return await self._store(spec_key(self.run_id), self.run_id, seal(self.identity, spec), SPEC_TTL_S)

    async def publish_record(self, record: NodeRecord) -> bool:
        data = seal(self.identity, record)
        stored = await self._store(nodes_key(self.run_id), record.node_id, data, NODE_TTL_S)
        if record.role == "trainer":
            stored = await self._store(trainer_key(self.run_id), record.node_id, data, NODE_TTL_S) and stored
        return stored

    async def get_trainer(self) -> NodeRecord | None:
        """The trainer's record, from the key only the run key can write."""
        for subkey, value in (await self._get(trainer_key(self.run_id))).items():
            try:
                record = check_node_record(value, subkey, self.run_id)
            except Rejected as e:
                self.metrics.inc("node_dht_records_rejected_total", label=e.reason)
                continue
            if record.role == "trainer" and record.node_id == self.run_id:
                return record
        return None

    async def get_spec(self) -> RunSpec | None:
        for subkey, value in (await self._get(spec_key(self.run_id))).items():
            try:
                if subkey == self.run_id:
                    return check_spec(value, self.run_id)
            except Rejected as e:
                self.metrics.inc("node_dht_records_rejected_total", label=e.reason)
                logger.debug("ignored run spec reason=%s detail=%s", e.reason, e.detail)
        return None

    async def get_nodes(self) -> dict[str, NodeRecord]:
        nodes: dict[str, NodeRecord] = {}
        for subkey, value in (await self._get(nodes_key(self.run_id))).items():
            try:
                record = check_node_record(value, subkey, self.run_id)
            except Rejected as e:
                self.metrics.inc("node_dht_records_rejected_total", label=e.reason)
                logger.debug("ignored node record subkey=%s reason=%s", str(subkey)[:40], e.reason)
                continue
            nodes[record.node_id] = record
        return nodes

    async def republish_forever(self, make_record: Callable[[], NodeRecord], spec: RunSpec | None = None) -> None:
        """Keep this node's record (and, for the trainer, the run spec) alive in the DHT."""
        last_spec = 0.0
        while True:
            try:
                await self.publish_record(make_record())
                if spec is not None and time.monotonic() - last_spec > SPEC_TTL_S / 3:
                    await self.publish_spec(spec)
                    last_spec = time.monotonic()
            except Exception as e:  # a DHT that times out, fails or hands us something we cannot use
                self.metrics.inc("node_dht_publish_failures_total")
                logger.warning("could not republish the DHT record: %s", e)
            await asyncio.sleep(REPUBLISH_S)

    async def close(self) -> None:
        """Stop the DHT process within SHUTDOWN_S, whatever state it is in (already killed by a signal sent to the
        whole process group, or hung): what is left of it and its daemon is killed."""
        dht, self.dht = self.dht, None
        if dht is not None:
            family: list[psutil.Process] = []  # taken now: psutil refuses to signal a pid reused since
            try:
                if dht.pid:
                    proc = psutil.Process(dht.pid)
                    family = [proc, *proc.children(recursive=True)]
            except psutil.Error:
                pass
            try:
                await within(asyncio.to_thread(dht.shutdown), SHUTDOWN_S)
            except (Exception, TimeoutError) as e:
                logger.warning("the DHT process did not stop in %.0fs (%r); killing it", SHUTDOWN_S, e)
            for p in family:  # what is left of it and its daemon
                try:
                    p.kill()
                except psutil.Error:
                    pass
        self._executor.shutdown(wait=False, cancel_futures=True)
