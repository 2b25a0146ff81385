"""A volunteer's credit (node/roles/credit.py): its book against a checked ledger. Each batch ends in one state (trained
with its inclusion proof checked, refused, acknowledged, lost, unanswered); batches credited to its id that it never
made name a second node on its identity; a torn line of the book is skipped; a ledger that differs from the head
the trainer's signed record named is a fork."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from intellect_node.roles.credit import CreditBook, account, agrees, read_book, render
from intellect_node.roles.trainer_ledger import LedgerLog
from intellect_protocol.envelope import seal
from intellect_protocol.identity import Identity
from intellect_protocol.ledger import BatchCredit, entry_of
from intellect_protocol.messages import RolloutBatch, RolloutGroup

RUN = Identity.generate()
ME = Identity.generate().node_id
OTHER = Identity.generate().node_id
TRAIN = hashlib.sha256(b"train").hexdigest()


def _batch(version: int, index: int) -> RolloutBatch:
    group = RolloutGroup(slot=0, prompt_ids=[1, 2], completions=[[3, 4, 5]] * 4, logprobs=[[-0.1] * 3] * 4)
    return RolloutBatch(run_id=RUN.node_id, node_id=ME, version=version, batch_index=index, groups=[group])


def _digest(version: int, index: int) -> str:
    return hashlib.sha256(f"{version}/{index}".encode()).hexdigest()


def test_each_batch_of_the_book_gets_its_state_and_a_twin_is_named(tmp_path: Path) -> None:
    book = CreditBook(tmp_path, RUN.node_id)
    made = {(v, i): _batch(v, i) for v in range(0, 6) for i in range(2)}
    for (v, i), batch in made.items():
        book.made(batch, _digest(v, i))
    for v, i in [(0, 0), (0, 1), (1, 0), (1, 1), (2, 0), (5, 0)]:
        book.acknowledged(_digest(v, i))
    book.refused(_digest(2, 1), "unassigned_task", "slot 0 is not the task assigned to this node")
    book.trainer("http://127.0.0.1:1", 0, "", 2)
    with open(book.path, "a") as f:
        f.write('{"e": "ack", "d": "torn')  # a crash in the middle of a line
    # the ledger: versions 1..6; ours (0,0), (0,1) and (1,0) trained; (1,1), (2,0) acknowledged, never trained; a
    # batch of ours the book never made in version 4 (a twin); another producer's batches everywhere
    log = LedgerLog(tmp_path / "ledger", RUN.node_id)
    trained = {1: [(0, 0)], 2: [(0, 1), (1, 0)]}
    for version in range(1, 7):
        credits = [BatchCredit(ME, _digest(v, i), v, 4, 12) for v, i in trained.get(version, [])]
        credits += [BatchCredit(OTHER, hashlib.sha256(f"o{version}".encode()).hexdigest(), version - 1, 8, 30)]
        if version == 4:
            credits.append(BatchCredit(ME, hashlib.sha256(b"not from this data dir").hexdigest(), 3, 4, 12))
        entry = entry_of(RUN.node_id, 0, version, version - 1, log.head.hash, 1.0, TRAIN, credits)
        log.append(seal(RUN, entry))
    sealed = log.read(0, 10)

    parsed = read_book(book.path)
    assert parsed.torn == 1 and parsed.trainer_url == "http://127.0.0.1:1" and len(parsed.batches) == 12
    credit = account(ME, RUN.node_id, parsed, sealed, parsed.async_level)
    states = {(b.version, b.index): state for b, state in credit.rows}
    assert states[(0, 0)] == states[(0, 1)] == states[(1, 0)] == "trained"
    assert states[(1, 1)] == states[(2, 0)] == "lost", "acknowledged, made on 1 or 2, and version 6 is out: too old"
    assert states[(2, 1)] == "refused" and states[(5, 0)] == "acknowledged" and states[(3, 0)] == "unanswered"
    assert credit.trained_in == {_digest(0, 0): 1, _digest(0, 1): 2, _digest(1, 0): 2}
    assert credit.twins == {4: 1}
    text = render(credit)
    assert "ANOTHER NODE USES THIS IDENTITY" in text and "versions 4" in text and "unassigned_task 1" in text
    assert text.splitlines()[-1] == (
        f"credit node={ME} batches=12 trained=3 refused=1 acknowledged=1 lost=2 twin_batches=1"
    )
    # the head the trainer's signed record named: the same chain agrees, a rewritten one does not
    assert agrees(sealed, RUN.node_id, 3, log._heads[3].hash)
    assert not agrees(sealed, RUN.node_id, 3, log._heads[2].hash)
    lines = [json.loads(x) for x in book.path.read_text().splitlines()[:-1]]
    assert {x["e"] for x in lines} == {"made", "ack", "refused", "trainer"}
