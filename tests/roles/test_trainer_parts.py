"""The trainer's door, learner and durability, each on its own (node/roles/trainer_door.py, trainer_learner.py,
trainer_checkpoint.py): real tiny-model batches, a real judging pipeline and engine, real files, no network and no
trainer around them.

The door plays the hostile caller: a flood of fresh registered keys, each with a well-formed batch, gets the
newcomers' rate (8 at once, then ``admission.newcomers_per_min``), not one judged batch per key; a key whose batch
was admitted is not charged again. Durability publishes versions in order, each after its checkpoint, with the
spool of accepted batches rotated at each checkpoint. The learner trains on what the queue holds, drops what went
stale, and hands every version to durability."""

from __future__ import annotations

import asyncio
import copy
import hashlib
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from intellect_node.config import NodeConfig, RunConfig
from intellect_node.judging.validator import Gate, Validator
from intellect_node.p2p.metrics import Metrics
from intellect_node.policy.engine import Group, local_engine
from intellect_node.policy.model import build_model, build_tokenizer, state_dict_for_export
from intellect_node.roles.admission import Admission
from intellect_node.roles.inference import RETRY_HINT_MAX_S, RETRY_HINT_SPREAD, generate_batch, hinted_wait
from intellect_node.roles.trainer_checkpoint import CheckpointDir, Durability
from intellect_node.roles.trainer_door import NEWCOMER_BURST, NEWCOMER_GRANT_S, Door, Newcomers
from intellect_node.roles.trainer_learner import Learner
from intellect_node.roles.trainer_ledger import StepRecord, open_ledger
from intellect_node.roles.trainer_state import FINAL_WAIT_S, InFlight, Ledger, Progress, RewardCurve, Shared, TrainQueue
from intellect_node.roles.trainer_validation import Judging
from intellect_node.weights.files import write_checkpoint
from intellect_node.weights.store import WeightStore
from intellect_protocol.envelope import Rejected, seal
from intellect_protocol.identity import Identity
from intellect_protocol.ledger import BatchCredit, train_hash, verify_chain
from intellect_protocol.messages import NodeRecord, RunSpec

RUN_KEY = Identity.generate()
RUN = RUN_KEY.node_id
RUN_CONFIG = RunConfig(sampling={"max_new_tokens": 8, "group_size": 4}, train={"online_filter": False})  # type: ignore[arg-type]
SPEC = RUN_CONFIG.spec(RUN, created=0.0)
TOK = build_tokenizer(SPEC.model)
MODEL = build_model(SPEC.model, TOK)


class _Registry:
    """The registry's calls the door and the judging pipeline make: every key here is registered."""

    def __init__(self) -> None:
        self.records: dict[str, NodeRecord] = {}

    def add(self, key: Identity) -> None:
        self.records[key.node_id] = NodeRecord(run_id=RUN, node_id=key.node_id, role="inference", updated=time.time())

    async def registered(self, node_id: str) -> NodeRecord | None:
        return self.records.get(node_id)

    async def validators(self, wanted: list[str]) -> list[object]:
        return []


def _shared(clock: Callable[[], float] = time.monotonic) -> Shared:
    return Shared(TrainQueue(), InFlight(clock), RewardCurve(), Ledger(SPEC.epoch, lambda: 0), Progress(clock=clock))


def _door(root: Path, shared: Shared, registry: _Registry, spec: RunSpec = SPEC) -> Door:
    write_checkpoint(root, RUN_KEY, RUN, 0, state_dict_for_export(MODEL), shard_bytes=1 << 20, epoch=spec.epoch)
    shared.progress.published = 0
    admission = Admission(spec.admission, RUN)
    judging = Judging(
        spec,
        [],
        RUN_KEY,
        Metrics(),
        registry,  # type: ignore[arg-type]
        admission,
        WeightStore(root, RUN, SPEC.epoch),
        threading.Lock(),
        Validator(SPEC, TOK, copy.deepcopy(MODEL)),
        TOK,
        shared,
        lambda: 0,
        lambda batch, envelope, judges, full: f"{batch.node_id}/{batch.batch_index}",
    )
    spooled: list[bytes] = []

    async def spool(envelope: bytes) -> None:
        spooled.append(envelope)

    return Door(spec, Metrics(), registry, admission, Gate(spec.train.async_level), shared, judging, spool, lambda: 0)  # type: ignore[arg-type]


def test_newcomers_start_probation_at_the_runs_rate_and_a_started_key_is_not_charged_again() -> None:
    clock = [0.0]
    bucket = Newcomers(per_min=12.0, clock=lambda: clock[0])
    keys = [f"{i:064x}" for i in range(NEWCOMER_BURST + 2)]
    for key in keys[:NEWCOMER_BURST]:
        bucket.check(key)
    try:
        bucket.check(keys[NEWCOMER_BURST])
        raise AssertionError("a key past the burst was let in")
    except Exception as e:
        assert getattr(e, "reason", "") == "busy" and "12 new nodes a minute" in str(e) and "in 5 s" in str(e)
    bucket.check(keys[0])  # granted a moment ago: its pull and then its push ask twice, charged once
    clock[0] = 5.0  # 12 a minute: one more after 5 s
    bucket.check(keys[NEWCOMER_BURST])
    bucket.admitted(keys[1])
    clock[0] = 5.0 + NEWCOMER_GRANT_S + 1
    bucket.check(keys[1])  # started: never charged again
    for key in keys[2:NEWCOMER_BURST]:  # their grants ran out unused: they pay again, and the bucket refilled
        bucket.check(key)


def test_a_flood_of_fresh_keys_buys_the_newcomers_rate_of_judged_batches_not_one_each(tmp_path: Path) -> None:
    shared, registry = _shared(), _Registry()
    door = _door(tmp_path, shared, registry)
    sybils = [Identity.generate() for _ in range(3 * NEWCOMER_BURST)]
    for key in sybils:
        registry.add(key)
    torch.manual_seed(0)
    batches = [generate_batch(SPEC, MODEL, TOK, key.node_id, 0, 0) for key in sybils[: NEWCOMER_BURST + 1]]
    batches += [batches[0].model_copy(update={"node_id": key.node_id}) for key in sybils[NEWCOMER_BURST + 1 :]]

    async def flood() -> list[Any]:
        return [await door.on_batch(seal(key, batch), "attacker") for key, batch in zip(sybils, batches, strict=True)]

    replies = asyncio.run(flood())
    admitted = [key for key, r in zip(sybils, replies, strict=True) if r.ok]
    refused = [r for r in replies if not r.ok]
    assert len(admitted) == NEWCOMER_BURST, [r.reason for r in replies]
    assert {r.reason for r in refused} == {"busy"} and all("new nodes a minute" in r.detail for r in refused)
    assert len(shared.inflight) == NEWCOMER_BURST, "each refused key left nothing in flight"
    assert set(door.newcomers.started) == {k.node_id for k in admitted}

    async def judged_then_next() -> Any:  # the first key's batch is judged; its next one needs no new place
        worker = asyncio.ensure_future(door.judging.validate_forever())
        try:
            while len(shared.inflight):
                await asyncio.sleep(0.05)
        finally:
            worker.cancel()
            door.judging.close()
        first = admitted[0]
        return await door.on_batch(seal(first, generate_batch(SPEC, MODEL, TOK, first.node_id, 0, 1)), "p")

    reply = asyncio.run(judged_then_next())
    assert reply.ok, reply


def test_the_door_tells_a_producer_when_to_send_again(tmp_path: Path) -> None:
    """Pacing (issue 37 item 4, 38 item 6): a producer on probation with a batch being judged is told busy with the
    time its verdict is expected (the running time to a verdict less the batch's age; half that time again once
    overdue); a trusted producer is told, with the acceptance that fills its share and with the backlog_full
    refusals after it, when the next version is expected (the running time between versions less the time since
    the last; a quarter of it again once overdue). Before any verdict a newcomer is told half its batch's age (a
    second at least: its asks grow apart as the judging takes long); with one version published no time is given,
    and the producer falls back on its own backoff."""
    clock = [0.0]
    shared, registry = _shared(lambda: clock[0]), _Registry()
    door = _door(tmp_path / "probation", shared, registry)
    newcomer = Identity.generate()
    registry.add(newcomer)
    torch.manual_seed(0)
    made = [generate_batch(SPEC, MODEL, TOK, newcomer.node_id, 0, i) for i in range(3)]

    async def offer(key: Identity, batch: Any) -> Any:
        return await door.on_batch(seal(key, batch), "p")

    assert asyncio.run(offer(newcomer, made[0])).ok
    first = asyncio.run(offer(newcomer, made[1]))
    assert (first.reason, first.retry_after_ms) == ("busy", 1000), "no verdict yet: no estimate, a second at least"
    assert "no batch judged yet" in first.detail
    clock[0] = 12.0
    later = asyncio.run(offer(newcomer, made[1]))
    assert later.retry_after_ms == 6000, "no estimate: half the waiting batch's age (asks grow apart, not 1/s)"
    clock[0] = 20.0
    shared.inflight.done((newcomer.node_id, 0, 0), len(made[0].groups))  # its verdict took 20 s
    assert asyncio.run(offer(newcomer, made[1])).ok
    clock[0] = 25.0
    busy = asyncio.run(offer(newcomer, made[2]))
    assert (busy.reason, busy.retry_after_ms) == ("busy", 15_000) and "expected in 15 s" in busy.detail
    clock[0] = 60.0
    assert asyncio.run(offer(newcomer, made[2])).retry_after_ms == 10_000, "overdue: half the running time again"

    trusting = RUN_CONFIG.model_copy(
        update={"admission": RUN_CONFIG.admission.model_copy(update={"probation_batches": 0})}
    )
    spec = trusting.spec(RUN, created=0.0)
    clock[0] = 0.0
    shared = _shared(lambda: clock[0])
    door = _door(tmp_path / "trusted", shared, registry, spec)
    shared.progress.publish(0)
    producer = Identity.generate()
    registry.add(producer)
    share = max(2, spec.train.async_level) * spec.train.batch_groups
    per_batch = spec.task.tasks_per_batch
    made = [generate_batch(spec, MODEL, TOK, producer.node_id, 0, i) for i in range(share // per_batch + 1)]
    door.check_announced(producer.node_id)  # room: an announced batch is pulled
    replies = [asyncio.run(offer(producer, batch)) for batch in made[:-1]]
    assert all(r.ok for r in replies) and replies[-1].retry_after_ms == 0, "one version published: no estimate"
    with pytest.raises(Rejected, match="backlog_full"):  # not pulled only to be refused (it cost a whole body)
        door.check_announced(producer.node_id)
    clock[0] = 100.0
    shared.progress.publish(1)  # a version took 100 s
    clock[0] = 130.0
    full = asyncio.run(offer(producer, made[-1]))
    assert (full.reason, full.retry_after_ms) == ("backlog_full", 70_000) and "expected in 70 s" in full.detail
    clock[0] = 250.0
    assert asyncio.run(offer(producer, made[-1])).retry_after_ms == 25_000, "overdue: a quarter again"
    shared.inflight.done((producer.node_id, 0, 0), per_batch)  # a batch judged and trained: room for one more
    clock[0] = 260.0
    shared.progress.publish(2)  # this one took 160 s: the running estimate moves to 0.7 x 100 + 0.3 x 160
    last = asyncio.run(offer(producer, made[-1]))
    assert last.ok and last.retry_after_ms == 118_000, "the acceptance that fills the share says when to come back"
    shared.progress.final = True  # max_steps made: no version follows (it said "next in 0 s": 4 tries a second)
    done = asyncio.run(offer(producer, generate_batch(spec, MODEL, TOK, producer.node_id, 0, len(made))))
    assert (done.reason, done.retry_after_ms) == ("backlog_full", FINAL_WAIT_S * 1000)
    assert "last step" in done.detail and "expected" not in done.detail
    fresh = Progress(clock=lambda: clock[0])  # a trainer's life before its second version: a step's duration
    fresh.publish(0)
    assert fresh.until_version() == 0.0
    fresh.stepped(50.0)
    clock[0] += 20.0
    assert fresh.until_version() == 30.0
    # the producer's side: a hint is waited (spread by up to a fifth, capped), none leaves its own backoff
    waits = [hinted_wait(last.retry_after_ms) for _ in range(200)]
    assert all(118.0 <= w <= RETRY_HINT_MAX_S for w in waits) and max(waits) > 118.0
    assert 200_000 / 1000 * (1 + RETRY_HINT_SPREAD) > RETRY_HINT_MAX_S == hinted_wait(200_000)
    assert all(15.0 <= hinted_wait(15_000) <= 18.0 for _ in range(200)) and hinted_wait(0) == 0.0


def _durability(root: Path, announced: list[int], on_announce: Callable[[int], None] = lambda v: None) -> Durability:
    cfg = NodeConfig(data_dir=root, checkpoint_every=1)

    async def announce(version: int) -> None:
        announced.append(version)
        on_announce(version)

    return Durability(
        cfg,
        RUN_KEY,
        SPEC.epoch,
        SPEC.train.async_level,
        CheckpointDir(root / "checkpoints"),
        WeightStore(root / "weights", RUN, SPEC.epoch),
        threading.Lock(),
        Metrics(),
        Progress(),
        announce,
        train_hash(SPEC.train),
    )


def test_durability_publishes_each_version_after_its_checkpoint_in_order(tmp_path: Path) -> None:
    announced: list[int] = []
    durability = _durability(tmp_path, announced)
    tensors = state_dict_for_export(MODEL)

    async def main() -> None:
        await durability.publish_current(lambda: tensors)
        durability.start()
        await durability.spool(b"accepted before checkpoint 1")
        for step in (1, 2):
            await durability.after_step(step, tensors, {"weights": step}, lambda: {"history": [], "history_len": 0})
        await durability.spool(b"accepted after checkpoint 2")
        await durability.drain()

    asyncio.run(main())
    assert announced == [1, 2] and durability.progress.published == 2
    assert durability.store.complete_versions()[-2:] == [1, 2]
    assert durability.ckpt.steps() == [1, 2]
    assert list(durability.ckpt.spooled_since(2)) == [b"accepted after checkpoint 2"]
    assert durability.ckpt.latest()["engine"] == {"weights": 2}  # type: ignore[index]


def test_each_version_is_published_after_its_ledger_entry_and_a_failed_append_publishes_nothing(
    tmp_path: Path,
) -> None:
    """Issue 39 item 1 and 4: the entry of version n is durable before n is published (what a volunteer sees
    published is in the chain); an append that fails (disk full) publishes nothing, and the next step writes both
    entries, in order, then publishes; a trainer killed between an entry and its publication drops that entry at
    restart and writes the step again, with no gap and no duplicate. The chain checks with the run id alone."""
    announced: list[int] = []
    entries_at: dict[int, int] = {}
    durability = _durability(tmp_path, announced, lambda v: entries_at.update({v: len(durability.ledger or [])}))
    tensors = state_dict_for_export(MODEL)
    producer = "cd" * 16
    credit = [BatchCredit(producer, hashlib.sha256(b"batch").hexdigest(), 0, 8, 96)]
    record = StepRecord(credit, {producer: {"unassigned_task": 2}})

    async def steps(first: int, last: int) -> None:
        for step in range(first, last + 1):
            await durability.after_step(step, tensors, None, dict, record)
        await durability.drain()

    async def start() -> None:
        await durability.publish_current(lambda: tensors)
        ledger = open_ledger(tmp_path / "ledger", RUN, SPEC.epoch, durability.progress.published)
        durability.ledger = ledger

    asyncio.run(start())
    asyncio.run(steps(1, 2))
    assert announced == [1, 2] and entries_at == {1: 1, 2: 2}, "each entry before its version"
    ledger = durability.ledger
    assert ledger is not None
    append, failures = ledger.append, [OSError(28, "No space left on device")]

    def full_disk(sealed: bytes, entry: Any = None) -> Any:
        if failures:
            raise failures.pop()
        return append(sealed, entry)

    ledger.append = full_disk  # type: ignore[method-assign]
    asyncio.run(steps(3, 4))
    assert announced == [1, 2, 4] and entries_at[4] == 4 and 3 not in durability.store.complete_versions()
    entries = [ledger.entry(i) for i in range(len(ledger))]
    assert [e.version for e in entries] == [1, 2, 3, 4] and [e.parent for e in entries] == [0, 1, 2, 3]
    assert entries[0].credits() == credit and entries[0].refusals() == {producer: {"unassigned_task": 2}}
    published = {v: durability.store.manifest(v) for v in (1, 2, 4)}
    assert [e.weights for e in entries] == [
        published[1].checkpoint_sha256,  # type: ignore[union-attr]
        published[2].checkpoint_sha256,  # type: ignore[union-attr]
        "",  # never published
        published[4].checkpoint_sha256,  # type: ignore[union-attr]
    ]
    assert verify_chain(ledger.read(0, 10), RUN).length == 4
    # killed after version 5's entry was written, before it was published: the next life drops the entry
    ledger.append = append  # type: ignore[method-assign]
    durability._unrecorded.append((5, record))
    durability._write_entries(5)
    assert len(ledger) == 5 and max(durability.store.complete_versions()) == 4
    again = _durability(tmp_path, announced)
    again.progress.step = 4
    asyncio.run(again.publish_current(lambda: tensors))
    again.ledger = open_ledger(tmp_path / "ledger", RUN, SPEC.epoch, again.progress.published)
    assert again.ledger is not None and len(again.ledger) == 4
    durability = again
    asyncio.run(steps(5, 5))
    assert verify_chain(again.ledger.read(0, 10), RUN).version == 5 and announced[-1] == 5
    # a ledger behind what was published (deleted, or older than the ledger) is not continued with a gap
    (tmp_path / "ledger" / f"{RUN}.log").unlink()
    assert open_ledger(tmp_path / "ledger", RUN, SPEC.epoch, 5) is None


def test_the_learner_trains_fresh_groups_drops_stale_ones_and_hands_each_version_on(tmp_path: Path) -> None:
    shared = _shared()
    announced: list[int] = []
    durability = _durability(tmp_path, announced)
    gate = Gate(SPEC.train.async_level)
    learner = Learner(
        SPEC,
        local_engine(SPEC, TOK, device="cpu"),
        int(TOK.pad_token_id),
        Metrics(),
        shared,
        gate,
        durability,
        lambda: shared.progress.step - SPEC.train.async_level,
        lambda: {"history": [], "history_len": 0},
        lambda: 0.0,
        max_steps=2,
        checkpoint_every=1,
    )
    torch.manual_seed(0)
    producer = Identity.generate().node_id
    batch = generate_batch(SPEC, MODEL, TOK, producer, 0, 0)
    n = SPEC.train.batch_groups

    def groups(version: int) -> list[Group]:
        g = batch.groups[0]
        rewards = [float(i % 2) for i in range(len(g.completions))]
        return [Group(producer, version, g.prompt_ids, g.completions, g.logprobs, rewards, 0, s) for s in range(n)]

    before = {k: v.clone() for k, v in learner.engine.export_state().items()}

    async def main() -> None:
        shared.queue.add(producer, groups(0) + groups(0))
        task = asyncio.ensure_future(learner.train_forever())
        while shared.progress.step < 2:
            await asyncio.sleep(0.05)
        while len(announced) < 2:
            await asyncio.sleep(0.05)
        task.cancel()

    asyncio.run(main())
    after = learner.engine.export_state()
    assert announced == [1, 2] and [h["step"] for h in learner.history] == [1, 2]
    assert any(not torch.equal(before[k], after[k]) for k in before), "two steps changed no weight"
    shared.queue.add(producer, groups(-SPEC.train.async_level - 1))  # older than the floor at step 2
    assert learner.take_batch() is None and len(shared.queue) == 0, "a stale group was kept"
