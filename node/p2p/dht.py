"""DHT membership: the run spec and every node's signed, expiring record in a hivemind DHT.

Each node runs a hivemind DHT peer (its own process plus the go-libp2p daemon). Values under this run's keys
are signed envelopes (see ``protocol/records.py`` and docs/dht.md); ``RecordValidator`` makes every DHT peer
of ours refuse to store or return a record whose signature, signer or schema is wrong, and readers check again.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from hivemind.dht import DHT
from hivemind.dht.routing import DHTID
from hivemind.dht.validation import DHTRecord, RecordValidatorBase
from hivemind.p2p import P2P
from hivemind.utils import get_dht_time
from hivemind.utils.serializer import MSGPackSerializer

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
T = TypeVar("T")


def check_spec(value: object, run_id: str) -> RunSpec:
    if not isinstance(value, bytes):
        raise Rejected("malformed", "DHT value is not bytes")
    signed = open_signed(value, RunSpec)
    if signed.signer_id != run_id or signed.message.run_id != run_id:
        raise Rejected("foreign_spec", f"run spec signed by {signed.signer_id}, not by the run key {run_id}")
    return signed.message


def check_node_record(
    value: object, subkey: object, run_id: str, now: float | None = None, fresh: bool = True
) -> NodeRecord:
    """A node's record, checked: signed by the node it names, of this run, not from the future and, with
    ``fresh``, signed within the last ``NODE_TTL_S`` (plus clock skew). Readers check freshness per record; the
    DHT's own validator must not (see ``RecordValidator``)."""
    if not isinstance(value, bytes):
        raise Rejected("malformed", "DHT value is not bytes")
    signed = open_signed(value, NodeRecord)
    record = signed.message
    now = time.time() if now is None else now
    if record.updated > now + CLOCK_SKEW_S:
        raise Rejected("future_record", f"record signed at {record.updated:.0f}, now is {now:.0f}")
    if fresh and record.updated < now - NODE_TTL_S - CLOCK_SKEW_S:
        raise Rejected("stale_record", f"record signed at {record.updated:.0f}, now is {now:.0f}")
    if signed.signer_id != record.node_id or subkey != record.node_id:
        raise Rejected("signer_mismatch", f"record of {record.node_id} signed by {signed.signer_id}")
    if record.run_id != run_id:
        raise Rejected("wrong_run", f"record of run {record.run_id}")
    if record.role == "trainer" and record.node_id != run_id:
        raise Rejected("foreign_trainer", "only the run key's node may announce the trainer role")
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

    def validate(self, record: DHTRecord) -> bool:
        if record.key not in (self._spec, self._nodes, self._trainer):
            return True  # not ours: other applications may share the DHT
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

    async def start(self, host: str, port: int, peers: list[str]) -> list[str]:
        def _start() -> DHT:
            return DHT(
                initial_peers=peers or None,
                start=True,
                host_maddrs=[f"/ip4/{host}/tcp/{port}"],
                record_validators=[RecordValidator(self.run_id)],
                startup_timeout=30,
            )

        try:
            dht = await asyncio.to_thread(_start)
        except Exception as e:
            hint = (
                "check the multiaddr (copy it from the line `intellect-node bootstrap` printed) and that "
                "the trainer is running and reachable"
                if peers
                else f"check that {host}:{port} is free (--p2p-port)"
            )
            raise SystemExit(f"could not start the DHT peer: {e}; {hint}") from None
        self.dht = dht
        self.maddrs = [str(m) for m in dht.get_visible_maddrs()]
        return self.maddrs

    def _require(self) -> DHT:
        if self.dht is None:
            raise RuntimeError("Membership.start() has not run")
        return self.dht

    async def replicate_p2p(self) -> P2P:
        return await self._require().replicate_p2p()

    async def _store(self, key: str, subkey: str, value: bytes, ttl: float) -> bool:
        dht = self._require()
        return bool(
            await asyncio.wait_for(
                self._call(dht.store, key, value, get_dht_time() + ttl, subkey=subkey), DHT_TIMEOUT_S
            )
        )

    async def _get(self, key: str) -> dict[object, object]:
        dht = self._require()
        found = await asyncio.wait_for(self._call(dht.get, key, True), DHT_TIMEOUT_S)
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
        if self.dht is not None:
            await asyncio.to_thread(self.dht.shutdown)
            self.dht = None
        self._executor.shutdown(wait=False, cancel_futures=True)
