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
import threading
import time
from pathlib import Path
from typing import Any

import torch

from intellect_node.config import NodeConfig, RunConfig
from intellect_node.judging.validator import Gate, Validator
from intellect_node.p2p.metrics import Metrics
from intellect_node.policy.engine import Group, local_engine
from intellect_node.policy.model import build_model, build_tokenizer, state_dict_for_export
from intellect_node.roles.admission import Admission
from intellect_node.roles.inference import generate_batch
from intellect_node.roles.trainer_checkpoint import CheckpointDir, Durability
from intellect_node.roles.trainer_door import NEWCOMER_BURST, NEWCOMER_GRANT_S, Door, Newcomers
from intellect_node.roles.trainer_learner import Learner
from intellect_node.roles.trainer_state import InFlight, Ledger, Progress, RewardCurve, Shared, TrainQueue
from intellect_node.roles.trainer_validation import Judging
from intellect_node.weights.files import write_checkpoint
from intellect_node.weights.store import WeightStore
from intellect_protocol.envelope import seal
from intellect_protocol.identity import Identity
from intellect_protocol.messages import NodeRecord

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


def _shared() -> Shared:
    return Shared(TrainQueue(), InFlight(), RewardCurve(), Ledger(SPEC.epoch, lambda: 0))


def _door(root: Path, shared: Shared, registry: _Registry) -> Door:
    write_checkpoint(root, RUN_KEY, RUN, 0, state_dict_for_export(MODEL), shard_bytes=1 << 20, epoch=SPEC.epoch)
    shared.progress.published = 0
    admission = Admission(SPEC.admission, RUN)
    judging = Judging(
        SPEC,
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

    return Door(SPEC, Metrics(), registry, admission, Gate(SPEC.train.async_level), shared, judging, spool, lambda: 0)  # type: ignore[arg-type]


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


def _durability(root: Path, announced: list[int]) -> Durability:
    cfg = NodeConfig(data_dir=root, checkpoint_every=1)

    async def announce(version: int) -> None:
        announced.append(version)

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
