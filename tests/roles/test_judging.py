"""The trainer's judging pipeline on its own (node/roles/trainer_validation.py ``Judging``): the tiny model's real
validator against a real signed checkpoint on disk, batches made by the real generator, no trainer around it.
An honest batch is judged, scored here and queued; a batch with an edited token is refused and bans its
producer, whose groups already queued are dropped; both leave nothing in flight."""

from __future__ import annotations

import asyncio
import copy
import threading
from pathlib import Path

import torch

from intellect_node.config import RunConfig
from intellect_node.judging.validator import Validator
from intellect_node.p2p.metrics import Metrics
from intellect_node.policy.model import build_model, build_tokenizer, state_dict_for_export
from intellect_node.roles.admission import Admission
from intellect_node.roles.inference import generate_batch
from intellect_node.roles.trainer_state import InFlight, Ledger, RewardCurve, Shared, TrainQueue
from intellect_node.roles.trainer_validation import Judging
from intellect_node.weights.files import write_checkpoint
from intellect_node.weights.store import WeightStore
from intellect_protocol.envelope import seal
from intellect_protocol.identity import Identity
from intellect_protocol.messages import RolloutBatch

RUN_KEY = Identity.generate()
RUN = RUN_KEY.node_id
# no online filter: the untrained model's groups are mostly all wrong, and the filter would drop them
RUN_CONFIG = RunConfig(sampling={"max_new_tokens": 8, "group_size": 4}, train={"online_filter": False})  # type: ignore[arg-type]
SPEC = RUN_CONFIG.spec(RUN, created=0.0)
TOK = build_tokenizer(SPEC.model)
MODEL = build_model(SPEC.model, TOK)


class _NoValidators:
    """The registry's one call the pipeline makes (``watch_validators``, not run here: no ``--validator``)."""

    async def validators(self, wanted: list[str]) -> list[object]:
        return []


def _judging(root: Path, shared: Shared) -> Judging:
    write_checkpoint(root, RUN_KEY, RUN, 0, state_dict_for_export(MODEL), shard_bytes=1 << 20, epoch=SPEC.epoch)
    acked: list[str] = []

    def acknowledge(batch: RolloutBatch, envelope: bytes, judges: list[str], full: bool) -> str:
        acked.append(batch.node_id)
        return f"{batch.node_id}/{batch.batch_index}"

    return Judging(
        SPEC,
        [],
        RUN_KEY,
        Metrics(),
        _NoValidators(),  # type: ignore[arg-type]
        Admission(SPEC.admission, RUN),
        WeightStore(root, RUN, SPEC.epoch),
        threading.Lock(),
        Validator(SPEC, TOK, copy.deepcopy(MODEL)),
        TOK,
        shared,
        lambda: 0,
        acknowledge,
    )


def _admit(judging: Judging, shared: Shared, producer: Identity, batch: RolloutBatch) -> None:
    """What the trainer's door does with a batch it admitted."""
    slots = [g.slot for g in batch.groups]
    shared.inflight.add((batch.node_id, batch.version, batch.batch_index), len(slots))
    judging.dispatch(batch, slots, seal(producer, batch))


async def _settled(shared: Shared) -> None:
    while len(shared.inflight):
        await asyncio.sleep(0.05)


def _edited(batch: RolloutBatch) -> RolloutBatch:
    g = batch.groups[0]
    completion = list(g.completions[0])
    completion[len(completion) // 2] = (completion[len(completion) // 2] + 1) % len(SPEC.model.vocab)
    groups = [g.model_copy(update={"completions": [completion, *g.completions[1:]]}), *batch.groups[1:]]
    return batch.model_copy(update={"groups": groups})


def test_an_honest_batch_is_scored_and_queued_and_a_cheat_bans_its_producer(tmp_path: Path) -> None:
    honest, cheat = Identity.generate(), Identity.generate()
    shared = Shared(TrainQueue(), InFlight(), RewardCurve(), Ledger(SPEC.epoch, lambda: 0))
    judging = _judging(tmp_path, shared)

    async def main() -> None:
        worker = asyncio.ensure_future(judging.validate_forever())
        try:
            torch.manual_seed(0)
            _admit(judging, shared, honest, generate_batch(SPEC, MODEL, TOK, honest.node_id, 0, 0))
            first = generate_batch(SPEC, MODEL, TOK, cheat.node_id, 0, 0)
            _admit(judging, shared, cheat, first)  # honest: its groups are queued
            await asyncio.wait_for(_settled(shared), 60)
            assert shared.queue.by_node[cheat.node_id] == len(first.groups)
            _admit(judging, shared, cheat, _edited(generate_batch(SPEC, MODEL, TOK, cheat.node_id, 0, 1)))
            await asyncio.wait_for(_settled(shared), 60)
        finally:
            worker.cancel()
            judging.close()

    asyncio.run(main())
    queued = shared.queue.groups
    assert {g.node_id for g in queued} == {honest.node_id}, "the banned producer's queued groups stay queued"
    assert len(queued) == SPEC.task.tasks_per_batch
    assert all(len(g.rewards) == SPEC.sampling.group_size for g in queued)
    assert all(0.0 <= r <= 1.0 for g in queued for r in g.rewards)
    assert cheat.node_id in shared.banned and honest.node_id not in shared.banned
    assert shared.accepted_by_node[honest.node_id] == len(queued)
    assert shared.rejected_by_node[cheat.node_id] == 1
    assert len(judging.verdicts) == 3 and not shared.inflight.groups_by_node
    assert len(shared.curve.drain()) == 2 * SPEC.task.tasks_per_batch * SPEC.sampling.group_size
