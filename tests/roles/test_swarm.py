"""Integration: a trainer, a validator and two inference nodes as real processes on loopback, and hostile peers.

One swarm serves the whole module: it trains 6 steps (async level 2), every batch judged by the validator node,
while the test process joins the DHT as a plain hivemind client, as a peer that sends bad batches over the
trainer's libp2p submit protocol, and as a registered worker that cheats.
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import json
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgpack
import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey
from hivemind.dht import DHT
from hivemind.p2p import PeerID
from hivemind.utils import get_dht_time

from intellect_kernels.toploc import proof_bytes
from intellect_node.config import RunConfig
from intellect_node.judging.validator import expected_proofs
from intellect_node.launch import NodeProcess
from intellect_node.p2p.keys import load_or_create
from intellect_node.p2p.transport import DELIVERY_ERRORS, HEADER, _read_frame, submit, submit_protocol
from intellect_node.policy.model import build_tokenizer, encode_prompt
from intellect_node.roles.trainer_ledger import parse_framed
from intellect_node.weights.files import MANIFEST_NAME, verify_manifest
from intellect_protocol.codec import Channel
from intellect_protocol.envelope import open_signed, seal
from intellect_protocol.identity import Identity
from intellect_protocol.ledger import LedgerEntry, verify_chain
from intellect_protocol.messages import NodeRecord, RolloutBatch, RolloutGroup, SubmitReply, Verdict
from intellect_protocol.records import NODE_TTL_S, nodes_key
from intellect_protocol.tasks import assigned_task
from tests.helpers.wait import until

pytestmark = pytest.mark.integration

STEPS = 6


@dataclass
class Swarm:
    root: Path
    trainer: NodeProcess
    ready: dict[str, Any]
    workers: list[NodeProcess]
    worker_ready: list[dict[str, Any]]
    client: DHT
    validator_id: str

    @property
    def run_id(self) -> str:
        return str(self.ready["run_id"])

    @property
    def trainer_peer(self) -> str:
        return str(self.ready["p2p_maddrs"][0]).rsplit("/p2p/", 1)[1]

    @property
    def epoch(self) -> int:
        """The run epoch the trainer started (batches of another one are refused as wrong_epoch)."""
        return int(self.status()["epoch"])

    def status(self, url: str | None = None) -> dict[str, Any]:
        with urllib.request.urlopen((url or self.ready["status_url"]) + "/status", timeout=10) as resp:
            data: dict[str, Any] = json.load(resp)
            return data

    def metrics(self) -> str:
        with urllib.request.urlopen(self.ready["status_url"] + "/metrics", timeout=10) as resp:
            return resp.read().decode()

    def verdicts(self) -> list[bytes]:
        with urllib.request.urlopen(self.ready["status_url"] + "/verdicts", timeout=10) as resp:
            return [base64.b64decode(v) for v in json.load(resp)["verdicts"]]


@pytest.fixture(scope="module")
def swarm(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Swarm]:
    root = tmp_path_factory.mktemp("swarm")
    logs = root / "logs"
    nodes: list[NodeProcess] = []
    client: DHT | None = None
    try:
        validator_id = load_or_create(root / "validator" / "node.key").node_id  # its key exists before the run
        trainer = NodeProcess(
            "trainer",
            ["bootstrap", "--data-dir", str(root / "trainer"), "--max-steps", str(STEPS), "--validator", validator_id],
            logs,
        )
        nodes.append(trainer)
        ready = trainer.wait_ready(timeout=120)
        validator = NodeProcess(
            "validator",
            [
                "join",
                "--role",
                "validator",
                "--peers",
                ready["p2p_maddrs"][0],
                "--run-id",
                ready["run_id"],
                "--data-dir",
                str(root / "validator"),
            ],
            logs,
        )
        nodes.append(validator)
        validator.wait_ready(timeout=120)
        workers = []
        for i in range(2):
            argv = [
                "join",
                "--role",
                "inference",
                "--peers",
                ready["p2p_maddrs"][0],
                "--run-id",
                ready["run_id"],
                "--data-dir",
                str(root / f"inference-{i}"),
                "--set",
                "credit_check_s=1",  # the dashboard's credit, checked every second here (60 s by default)
            ]
            workers.append(NodeProcess(f"inference-{i}", argv, logs))
        nodes += workers
        worker_ready = [w.wait_ready(timeout=120) for w in workers]
        trainer.wait_for_line(f"STEP {STEPS} ", timeout=300)
        client = DHT(initial_peers=ready["p2p_maddrs"][:1], start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"])
        yield Swarm(root, trainer, ready, workers, worker_ready, client, validator_id)
    finally:
        if client is not None:
            client.shutdown()
        for node in reversed(nodes):
            node.stop()


def test_training_steps_complete(swarm: Swarm) -> None:
    status = swarm.status()
    assert status["step"] == STEPS >= 3
    assert [h["step"] for h in status["history"]] == list(range(1, STEPS + 1))
    assert all(0.0 <= h["reward_mean"] <= 1.0 and h["staleness_max"] <= 2 for h in status["history"])


def test_each_inference_node_follows_the_versions_and_contributed(swarm: Swarm) -> None:
    """Every worker ends at the trainer's newest version and has groups accepted, and the run's steps came from a
    worker that loaded one version after another. Not "every worker loaded two versions": the trainer makes its
    STEPS steps of the tiny model from one worker's batches in about two seconds, and in CI a worker that came up
    2.7 s after the other joined a finished run, with only the last version to load. The trainer goes on admitting
    and judging fresh batches after its last step, so each worker is given a bounded time for both; and a finished
    run tells a worker whose share it holds to wait long, not to send again four times a second."""
    loaded = {}
    for ready in swarm.worker_ready:
        node_id = ready["node_id"]

        def newest(url: str = ready["status_url"]) -> bool:
            return bool(swarm.status(url)["versions_loaded"][-1:] == [STEPS])

        def contributed(node_id: str = node_id) -> bool:
            return bool(swarm.status()["accepted_groups_by_node"].get(node_id, 0) > 0)

        asyncio.run(until(newest, f"{node_id[:8]} to load version {STEPS}", timeout=60, every=0.5))
        asyncio.run(until(contributed, f"the trainer to accept groups of {node_id[:8]}", timeout=90, every=0.5))
        versions = swarm.status(ready["status_url"])["versions_loaded"]
        assert versions == sorted(set(versions))  # a node that joins late starts at the newest version
        loaded[node_id] = versions
    assert max(len(v) for v in loaded.values()) >= 2, loaded  # step 1 took version 0's rollouts, step STEPS newer
    # the run is finished and holds each worker's full share: each is told to wait long (FINAL_WAIT_S), not to
    # send again within a fraction of a second
    for ready in swarm.worker_ready:

        def held_back(url: str = ready["status_url"]) -> bool:
            return float(swarm.status(url)["held_back_s"]) >= 60.0

        asyncio.run(until(held_back, f"{ready['node_id'][:8]} to be told to wait", timeout=60, every=0.5))


def _batch(identity: Identity, swarm: Swarm, version: int, batch_index: int) -> RolloutBatch:
    """A well-formed batch with exactly the tasks the run assigns to ``identity``, the right answers and made-up
    TOPLOC proofs (so only the tested check can fail)."""
    run = RunConfig()
    tok = build_tokenizer(run.model)
    eos = int(tok.eos_token_id)
    groups = []
    for slot in range(run.task.tasks_per_batch):
        task = assigned_task(run.seed, identity.node_id, version, batch_index, slot, run.task.max_operand)
        answer = list(tok.encode(task.answer, add_special_tokens=False)) + [eos]
        made_up = [bytes(proof_bytes(run.verify.topk))] * expected_proofs(len(answer), run.verify.decode_batch)
        groups.append(
            RolloutGroup(
                slot=slot,
                prompt_ids=encode_prompt(tok, task.prompt),
                completions=[answer] * run.sampling.group_size,
                logprobs=[[-0.1] * len(answer)] * run.sampling.group_size,
                proofs=[made_up] * run.sampling.group_size,
            )
        )
    return RolloutBatch(
        run_id=swarm.run_id,
        node_id=identity.node_id,
        version=version,
        batch_index=batch_index,
        epoch=swarm.epoch,
        groups=groups,
    )


async def _submit(swarm: Swarm, data: bytes) -> SubmitReply:
    p2p = await swarm.client.replicate_p2p()
    try:
        return await submit(p2p, swarm.trainer_peer, swarm.run_id, data, swarm.run_id)
    finally:
        await p2p.shutdown()


async def _send_frame(swarm: Swarm, frame: bytes, p2p: Any = None) -> SubmitReply:
    own = p2p is None
    p2p = p2p or await swarm.client.replicate_p2p()
    try:
        _, reader, writer = await p2p.call_binary_stream_handler(
            PeerID.from_base58(swarm.trainer_peer), submit_protocol(swarm.run_id)
        )
        writer.write(frame)
        await writer.drain()
        reply = open_signed(await _read_frame(reader, Channel.REPLY.value), SubmitReply)
        writer.close()
        assert reply.signer_id == swarm.run_id
        return reply.message
    finally:
        if own:
            await p2p.shutdown()


def _rejections(swarm: Swarm) -> dict[str, float]:
    return dict(swarm.status()["rejected_batches_by_reason"])


def test_batch_signed_by_unknown_key_is_rejected_and_counted(swarm: Swarm) -> None:
    before = _rejections(swarm).get("unknown_signer", 0)
    stranger = Identity.generate()
    reply = asyncio.run(_submit(swarm, seal(stranger, _batch(stranger, swarm, STEPS, 0))))
    assert not reply.ok and reply.reason == "unknown_signer" and not reply.digest, "a stranger costs us no hashing"
    assert _rejections(swarm)["unknown_signer"] == before + 1
    assert 'node_trainer_batches_rejected_total{reason="unknown_signer"}' in swarm.metrics()


def test_batch_claiming_a_stale_version_is_rejected_and_counted(swarm: Swarm) -> None:
    # A registered node replays work on version 0 while the trainer is at STEPS > async_level. (A key of its own:
    # a running worker's key may still be on probation with its one batch being judged, and is then told busy.)
    worker_key = Identity.generate()
    _register(swarm, worker_key)
    before = _rejections(swarm).get("stale_version", 0)
    data = seal(worker_key, _batch(worker_key, swarm, 0, 10_000))
    reply = asyncio.run(_submit(swarm, data))
    assert not reply.ok and reply.reason == "stale_version"
    assert reply.digest == hashlib.sha256(data).hexdigest(), "a refusal for good names the batch it refuses"
    assert _rejections(swarm)["stale_version"] == before + 1


def test_a_batch_of_another_run_epoch_is_refused_before_any_work(swarm: Swarm) -> None:
    # A registered node replays a batch made before the run was started over (its version numbers name other
    # weights now): refused at the door as wrong_epoch, counted, nothing queued for validation.
    worker_key = Identity.generate()
    _register(swarm, worker_key)
    before = _rejections(swarm).get("wrong_epoch", 0)
    old = _batch(worker_key, swarm, swarm.status()["step"], 30_000).model_copy(update={"epoch": swarm.epoch - 1})
    reply = asyncio.run(_submit(swarm, seal(worker_key, old)))
    assert not reply.ok and reply.reason == "wrong_epoch"
    assert _rejections(swarm)["wrong_epoch"] == before + 1


def test_tampered_and_malformed_and_oversized_input_is_rejected(swarm: Swarm) -> None:
    worker_key = load_or_create(swarm.root / "inference-1" / "node.key")
    env = msgpack.unpackb(seal(worker_key, _batch(worker_key, swarm, STEPS, 20_000)), raw=False)
    env["sig"] = bytes(64)
    tampered = msgpack.packb(env, use_bin_type=True)
    garbage = b"\xc1 this is not msgpack"
    cases = {
        "bad_signature": len(tampered).to_bytes(HEADER, "big") + tampered,
        "malformed": len(garbage).to_bytes(HEADER, "big") + garbage,
        "oversized": (Channel.ROLLOUT_BATCH.value + 1).to_bytes(HEADER, "big"),  # refused before the body is read
    }
    before = _rejections(swarm)

    async def attack() -> list[SubmitReply]:
        """From a peer of its own: three unusable frames put it in the penalty box (refused unread a minute)."""
        from hivemind.p2p import P2P

        attacker = await P2P.create(initial_peers=swarm.ready["p2p_maddrs"][:1], host_maddrs=["/ip4/127.0.0.1/tcp/0"])
        try:
            replies = [await _send_frame(swarm, frame, attacker) for frame in [*cases.values(), cases["malformed"]]]
            # and its connection is dropped (each later frame then comes after a handshake, with the initial
            # flow-control window only: envelope bombs on a warm connection cost the trainer 30% of its rate)
            trainer_peer = swarm.ready["p2p_maddrs"][0].rsplit("/p2p/", 1)[-1]
            for _ in range(100):
                if trainer_peer not in {p.peer_id.to_base58() for p in await attacker.list_peers()}:
                    break
                await asyncio.sleep(0.1)
            else:
                raise AssertionError("the trainer kept its connection to a penalized peer")
            return replies
        finally:
            await attacker.shutdown()

    replies = asyncio.run(attack())
    assert [r.reason for r in replies] == [*cases, "busy"] and not any(r.ok for r in replies)
    after = _rejections(swarm)
    assert all(after[r] == before.get(r, 0) + 1 for r in cases)
    assert swarm.trainer.proc.poll() is None
    with urllib.request.urlopen(swarm.ready["status_url"] + "/health", timeout=10) as resp:
        assert json.load(resp) == {"ok": True}


def test_a_plain_hivemind_client_reads_the_trainers_record(swarm: Swarm) -> None:
    """Follows docs/dht.md with hivemind, msgpack and cryptography only: no project code."""
    found = swarm.client.get(f"intellect-node/{swarm.run_id}/nodes", latest=True)
    assert found is not None
    envelope = msgpack.unpackb(found.value[swarm.run_id].value, raw=False)
    signer, body, sig = envelope["signer"], envelope["body"], envelope["sig"]
    assert hashlib.sha256(signer).digest()[:16].hex() == swarm.run_id
    Ed25519PublicKey.from_public_bytes(signer).verify(sig, b"intellect-node/v1/node_record\0" + body)
    record = msgpack.unpackb(body, raw=False)
    assert record["role"] == "trainer" and record["node_id"] == swarm.run_id
    assert record["weight_version"] == STEPS and record["http_url"].startswith("http://127.0.0.1:")
    assert record["updated"] <= time.time() + 1
    spec_env = msgpack.unpackb(
        swarm.client.get(f"intellect-node/{swarm.run_id}/spec", latest=True).value[swarm.run_id].value
    )
    assert msgpack.unpackb(spec_env["body"])["train"]["async_level"] == 2


def test_the_trainers_ledger_credits_every_step_and_checks_with_the_run_id_alone(swarm: Swarm) -> None:
    """Issue 39 item 1, as a volunteer checks it: the head from the trainer's DHT record (no trust in its HTTP
    server), the entries from GET /ledger/entries, the chain checked with the run id alone. One entry per version,
    each crediting the batches trained, each batch one that a validator judged ok, from the run's producers, with
    every rollout of the step's groups."""
    run = RunConfig()

    def recorded() -> bool:
        ledger = swarm.status()["ledger"]
        return ledger is not None and ledger["length"] == STEPS

    asyncio.run(until(recorded, f"the trainer's ledger to hold {STEPS} entries", timeout=60, every=0.5))

    head: dict[str, Any] = {}

    def announced() -> bool:
        found = swarm.client.get(nodes_key(swarm.run_id), latest=True)
        if found is None or swarm.run_id not in found.value:
            return False
        record = open_signed(found.value[swarm.run_id].value, NodeRecord).message
        if record.ledger is not None and record.ledger.length == STEPS:
            head.update(record.ledger.model_dump())
        return bool(head)

    asyncio.run(until(announced, "the trainer's DHT record to name its ledger's head", timeout=60, every=0.5))
    with urllib.request.urlopen(swarm.ready["status_url"] + "/ledger/entries", timeout=10) as resp:
        sealed = parse_framed(resp.read())
    assert verify_chain(sealed, swarm.run_id).hash == head["head"] and len(sealed) == head["length"]
    entries = [open_signed(s, LedgerEntry).message for s in sealed]
    assert [e.version for e in entries] == list(range(1, STEPS + 1)) and {e.epoch for e in entries} == {swarm.epoch}
    judged_ok = {open_signed(v, Verdict).message.batch_sha256 for v in swarm.verdicts()}
    producers = {r["node_id"] for r in swarm.worker_ready}
    for e in entries:
        assert e.parent == e.version - 1 and set(e.producers) <= producers
        assert set(e.digests) <= judged_ok, "every credited batch passed a validator"
        assert sum(e.rollouts) == run.train.batch_groups * run.sampling.group_size
        assert all(t > 0 for t in e.tokens) and all(m < e.version for m in e.made_on)
    held = swarm.root / "trainer" / "weights" / swarm.run_id
    for e in entries:  # each entry names the weights its version was published with
        manifest = held / str(e.version) / MANIFEST_NAME
        if manifest.exists():
            assert verify_manifest(manifest.read_bytes(), swarm.run_id, e.version).checkpoint_sha256 == e.weights
    # each volunteer's own check (issue 39 item 2): `intellect-node credit` on its data dir, through the CLI
    credited = 0
    for i, ready in enumerate(swarm.worker_ready):
        mine = {d for e in entries for p, d in zip(e.producers, e.digests, strict=True) if p == ready["node_id"]}
        out = subprocess.run(
            [sys.executable, "-m", "intellect_node.cli", "credit", "--data-dir", str(swarm.root / f"inference-{i}")],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert out.returncode == 0, out.stdout + out.stderr
        summary = dict(kv.split("=", 1) for kv in out.stdout.splitlines()[-1].split()[1:])
        assert summary["node"] == ready["node_id"] and summary["twin_batches"] == "0", out.stdout
        assert int(summary["trained"]) == len(mine), out.stdout  # every batch the ledger credits it, found
        credited += len(mine)

        def shown(url: str = ready["status_url"], trained: int = len(mine)) -> bool:  # on the dashboard too
            credit = swarm.status(url)["credit"]
            return bool(credit["ledger_entries"] == STEPS and credit["trained"] == trained and not credit["error"])

        asyncio.run(until(shown, f"{ready['node_id'][:8]}'s status to show its credit", timeout=30, every=0.5))
        assert swarm.status(ready["status_url"])["credit"]["twin_batches"] == 0
    assert credited > 0


def test_every_batch_is_judged_by_the_validator_node_and_its_verdicts_are_signed(swarm: Swarm) -> None:
    verdicts = [open_signed(v, Verdict) for v in swarm.verdicts()]
    assert verdicts, "no verdicts published"
    from_validator = [v for v in verdicts if v.signer_id == swarm.validator_id]
    assert from_validator and all(v.message.ok for v in from_validator)  # honest workers pass every check
    assert {v.message.node_id for v in from_validator} <= {r["node_id"] for r in swarm.worker_ready}
    assert "node_trainer_remote_verdicts_total" in swarm.metrics()
    assert swarm.status()["banned"] == {}


def _register(swarm: Swarm, identity: Identity) -> None:
    """Publish a signed inference record for ``identity``, as a joining node does (docs/dht.md)."""
    record = NodeRecord(run_id=swarm.run_id, node_id=identity.node_id, role="inference", updated=time.time())
    stored = swarm.client.store(
        nodes_key(swarm.run_id), seal(identity, record), get_dht_time() + NODE_TTL_S, subkey=identity.node_id
    )
    assert stored
    deadline = time.time() + 30
    while time.time() < deadline:  # visible in the DHT before the trainer is asked to look it up
        found = swarm.client.get(nodes_key(swarm.run_id), latest=True)
        if found is not None and identity.node_id in found.value:
            return
        time.sleep(0.2)
    raise AssertionError("the record never became readable from the DHT")


def test_a_registered_worker_that_cheats_is_caught_and_banned(swarm: Swarm) -> None:
    """Its batch passes every check at the door (signature, registration, version, order, assigned tasks) but
    carries made-up completions with no TOPLOC proofs: the validator rejects it and the trainer bans the node."""
    cheater = Identity.generate()
    _register(swarm, cheater)
    version = swarm.status()["step"]
    reply = asyncio.run(_submit(swarm, seal(cheater, _batch(cheater, swarm, version, 0))))
    assert reply.ok, reply  # taken for validation
    deadline = time.time() + 60
    while cheater.node_id not in swarm.status()["banned"] and time.time() < deadline:
        time.sleep(0.5)
    assert swarm.status()["banned"].get(cheater.node_id) == "toploc"
    verdict = [
        v for v in map(lambda b: open_signed(b, Verdict), swarm.verdicts()) if v.message.node_id == cheater.node_id
    ]
    assert verdict and not verdict[-1].message.ok and verdict[-1].signer_id == swarm.validator_id
    again = asyncio.run(_submit(swarm, seal(cheater, _batch(cheater, swarm, version, 1))))
    assert not again.ok and again.reason == "banned"
    assert cheater.node_id not in swarm.status()["accepted_groups_by_node"]


def test_one_signed_batch_sent_on_16_streams_at_once_is_admitted_once(swarm: Swarm) -> None:
    """The duplicate check and the admission are one step: copies racing on parallel streams (8 peers, 2 streams
    each, the most the trainer reads at once from one peer) are refused."""
    from hivemind.p2p import P2P

    sender = Identity.generate()
    _register(swarm, sender)
    step = swarm.status()["step"]
    early = asyncio.run(_submit(swarm, seal(sender, _batch(sender, swarm, step, 5))))
    assert early.reason == "out_of_order"  # the trainer has looked the key up: every copy below gets that far
    data = seal(sender, _batch(sender, swarm, step, 0))

    async def flood() -> list[SubmitReply | BaseException]:
        peers = [
            await P2P.create(initial_peers=swarm.ready["p2p_maddrs"][:1], host_maddrs=["/ip4/127.0.0.1/tcp/0"])
            for _ in range(8)
        ]
        try:
            return await asyncio.gather(
                *(submit(p, swarm.trainer_peer, swarm.run_id, data, swarm.run_id) for p in peers for _ in range(2)),
                return_exceptions=True,
            )
        finally:
            for p in peers:
                await p.shutdown()

    answers = asyncio.run(flood())
    # Under this load the daemon now and then resets a stream after the trainer answered (the trainer's log shows
    # all 16 answers); a producer resends such a batch. What must hold: at most one copy is admitted.
    broken = [a for a in answers if isinstance(a, DELIVERY_ERRORS)]
    replies = [a for a in answers if isinstance(a, SubmitReply)]
    assert len(broken) + len(replies) == len(answers), answers
    assert sum(r.ok for r in replies) == 1 or (broken and sum(r.ok for r in replies) == 0), [r.reason for r in replies]
    # the copies: a duplicate, or refused while the first was being checked ("banned" once its fake proofs fail)
    assert {r.reason for r in replies if not r.ok} <= {"duplicate", "busy", "banned"}
    one_batch = RunConfig().task.tasks_per_batch
    assert swarm.status()["accepted_groups_by_node"].get(sender.node_id, 0) <= one_batch


def test_a_producer_out_of_step_is_told_where_to_continue(swarm: Swarm) -> None:
    """A restarted producer that numbers its batches from the wrong place learns the index the trainer expects."""
    restarted = Identity.generate()
    _register(swarm, restarted)
    reply = asyncio.run(_submit(swarm, seal(restarted, _batch(restarted, swarm, swarm.status()["step"], 3))))
    assert not reply.ok and reply.reason == "out_of_order" and reply.next_index == 0


def test_stalled_streams_from_one_peer_do_not_starve_honest_producers(swarm: Swarm) -> None:
    """A peer opens 16 submit streams and sends nothing (it used to hold every handling slot): its streams past
    the per-peer cap are refused as busy at once, and an honest producer's batch is answered meanwhile."""
    from hivemind.p2p import P2P

    honest = Identity.generate()
    _register(swarm, honest)
    data = seal(honest, _batch(honest, swarm, swarm.status()["step"], 0))

    async def attack() -> tuple[list[bytes | None], SubmitReply]:
        attacker = await P2P.create(initial_peers=swarm.ready["p2p_maddrs"][:1], host_maddrs=["/ip4/127.0.0.1/tcp/0"])
        streams = []
        try:
            for _ in range(16):
                streams.append(
                    await attacker.call_binary_stream_handler(
                        PeerID.from_base58(swarm.trainer_peer), submit_protocol(swarm.run_id)
                    )
                )
            refused: list[bytes | None] = []
            for _, reader, _ in streams[2:]:  # past the cap: answered at once, without a frame sent
                try:
                    refused.append(await asyncio.wait_for(_read_frame(reader, Channel.REPLY.value), 10))
                except DELIVERY_ERRORS:  # the daemon now and then resets such a stream instead: refused all the same
                    refused.append(None)
            reply = await asyncio.wait_for(_submit(swarm, data), 20)  # while the first two still stall
            return refused, reply
        finally:
            for _, _, writer in streams:
                writer.close()
            await attacker.shutdown()

    refused, reply = asyncio.run(attack())
    assert all(open_signed(r, SubmitReply).message.reason == "busy" for r in refused if r is not None)
    assert sum(r is not None for r in refused) >= len(refused) // 2
    assert reply.ok or reply.reason == "banned", reply
