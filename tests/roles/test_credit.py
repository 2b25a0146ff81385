"""A volunteer's credit (node/roles/credit.py): its book against a checked ledger. Each batch ends in one state (trained
with its inclusion proof checked, refused, acknowledged, lost, unanswered); batches credited to its id that it never
made name a second node on its identity; a torn line of the book is skipped; a ledger that differs from the head
the trainer's signed record named is a fork."""

from __future__ import annotations

import asyncio
import hashlib
import json
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web

import intellect_node.roles.credit as credit_module
from intellect_node.roles import trainer_ledger
from intellect_node.roles.credit import CreditBook, LedgerFork, LedgerWatch, account, agrees, read_book, render
from intellect_node.roles.trainer_ledger import LedgerLog, LedgerRoutes
from intellect_protocol.envelope import seal
from intellect_protocol.identity import Identity
from intellect_protocol.ledger import BatchCredit, LedgerError, entry_of
from intellect_protocol.messages import RolloutBatch, RolloutGroup, SubmitReply

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
    for v, i in [(0, 0), (0, 1), (1, 0), (2, 0), (3, 1), (5, 0)]:
        book.acknowledged(_digest(v, i))
    book.acknowledged(_digest(1, 1), seal(RUN, SubmitReply(ok=True, digest=_digest(1, 1))))  # kept as evidence
    refusal = SubmitReply(ok=False, reason="unassigned_task", digest=_digest(2, 1))
    book.refused(_digest(2, 1), "unassigned_task", "slot 0 is not the task assigned to this node", seal(RUN, refusal))
    forged = seal(Identity.generate(), refusal.model_copy(update={"digest": _digest(4, 1)}))  # not the run key's
    book.refused(_digest(4, 1), "unassigned_task", "", forged)
    book.trainer("http://127.0.0.1:1", 0, "", 2)
    with open(book.path, "a") as f:
        f.write('{"e": "ack", "d": "torn')  # a crash in the middle of a line
    # the ledger: versions 1..6; ours (0,0), (0,1) and (1,0) trained; (1,1), (2,0) acknowledged, never trained; (3,1)
    # acknowledged, then dropped stale (the entry of version 5 says so); a batch of ours the book never made in
    # version 4 (a twin); another producer's batches everywhere
    log = LedgerLog(tmp_path / "ledger", RUN.node_id)
    trained = {1: [(0, 0)], 2: [(0, 1), (1, 0)]}
    for version in range(1, 7):
        credits = [BatchCredit(ME, _digest(v, i), v, 4, 12) for v, i in trained.get(version, [])]
        credits += [BatchCredit(OTHER, hashlib.sha256(f"o{version}".encode()).hexdigest(), version - 1, 8, 30)]
        if version == 4:
            credits.append(BatchCredit(ME, hashlib.sha256(b"not from this data dir").hexdigest(), 3, 4, 12))
        dropped = [(ME, _digest(3, 1), "stale")] if version == 5 else []
        entry = entry_of(RUN.node_id, 0, version, version - 1, log.head.hash, 1.0, TRAIN, credits, dropped=dropped)
        log.append(seal(RUN, entry))
    sealed = log.read(0, 10)

    parsed = read_book(book.path)
    assert parsed.torn == 1 and parsed.trainer_url == "http://127.0.0.1:1" and len(parsed.batches) == 12
    credit = account(ME, RUN.node_id, parsed, sealed, parsed.async_level)
    states = {(b.version, b.index): state for b, state in credit.rows}
    assert states[(0, 0)] == states[(0, 1)] == states[(1, 0)] == "trained"
    assert states[(1, 1)] == states[(2, 0)] == "lost", "acknowledged, made on 1 or 2, and version 6 is out: too old"
    assert states[(2, 1)] == "refused" and states[(5, 0)] == "acknowledged" and states[(3, 0)] == "unanswered"
    assert states[(3, 1)] == "dropped" and credit.dropped_by_reason() == {"stale": 1}
    assert states[(4, 1)] == "refused" and credit.signed_refusals == 1, "only the run key's reply naming the batch"
    assert credit.signed_lost == 1, "the lost batch whose signed acknowledgement the book kept"
    assert credit.trained_in == {_digest(0, 0): 1, _digest(0, 1): 2, _digest(1, 0): 2}
    assert credit.twins == {4: 1}
    text = render(credit)
    assert "ANOTHER NODE USES THIS IDENTITY" in text and "versions 4" in text
    assert "dropped, by reason: stale 1" in text and "1 of the lost with the trainer's signed acknowledgement" in text
    assert "unassigned_task 2 (1 of them with the trainer's signed reply naming the batch" in text
    assert text.splitlines()[-1] == (
        f"credit node={ME} batches=12 trained=3 refused=2 dropped=1 acknowledged=1 lost=2 twin_batches=1"
    )
    # the head the trainer's signed record named: the same chain agrees, a rewritten one does not
    assert agrees(sealed, RUN.node_id, 3, log._heads[3].hash)
    assert not agrees(sealed, RUN.node_id, 3, log._heads[2].hash)
    lines = [json.loads(x) for x in book.path.read_text().splitlines()[:-1]]
    assert {x["e"] for x in lines} == {"made", "ack", "refused", "trainer"}


def _ledger(path: Path, versions: range, mine: dict[int, list[str]], salt: str = "") -> LedgerLog:
    """A trainer's ledger of ``versions``, crediting ``mine[version]`` to this node and one batch of another producer
    per version (``salt`` makes another history of the same versions)."""
    log = LedgerLog(path, RUN.node_id)
    for version in versions:
        credits = [BatchCredit(ME, d, version - 1, 4, 12) for d in mine.get(version, [])]
        credits += [BatchCredit(OTHER, hashlib.sha256(f"o{version}{salt}".encode()).hexdigest(), version - 1, 8, 30)]
        log.append(seal(RUN, entry_of(RUN.node_id, 0, version, version - 1, log.head.hash, 1.0, TRAIN, credits)))
    return log


def test_a_running_node_follows_the_ledger_in_parts_and_names_a_rewritten_history(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The dashboard's credit (``LedgerWatch``) against a real trainer's routes on loopback: only entries past the
    head it checked are fetched, a long ledger is caught up a few pages per check, the account equals
    ``intellect-node credit``'s, and a trainer that rewrites its history (other entries, fewer entries, or a head
    its signed record does not name) is a fork, with the last good figures kept."""
    monkeypatch.setattr(trainer_ledger, "RESPONSE_MAX_BYTES", 10)  # one entry a page
    monkeypatch.setattr(credit_module, "PAGES_PER_CHECK", 3)
    book = CreditBook(tmp_path, RUN.node_id)
    digests = {v: [_digest(v, 0)] for v in range(6)}
    for v in range(6):
        book.made(_batch(v, 0), _digest(v, 0))
        book.acknowledged(_digest(v, 0))
    book.refused(_digest(9, 9), "toploc", "hidden states do not match")
    honest = _ledger(tmp_path / "honest", range(1, 5), {v + 1: d for v, d in digests.items()})
    routes = LedgerRoutes(RUN.node_id, honest)
    asked: list[int] = []

    @web.middleware
    async def record(request: web.Request, handler: Any) -> web.StreamResponse:
        if request.path == "/ledger/entries":
            asked.append(int(request.query["first"]))
        return await handler(request)

    async def main() -> list[Any]:
        app = web.Application(middlewares=[record])
        app.add_routes(routes.routes())
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        url = f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"  # type: ignore[union-attr]
        watch = LedgerWatch(ME, RUN.node_id, book.path)
        out: list[Any] = []

        def check(named: tuple[int, str] = (0, "")) -> Any:
            try:
                return dict(watch.check(url, named, 2))
            except ValueError as e:  # LedgerFork and LedgerError are ValueErrors
                watch.failed(e)
                return e

        try:
            out.append(await asyncio.to_thread(check))  # 3 of 4 entries: three pages
            out.append(await asyncio.to_thread(check, (4, honest.head.hash)))  # the 4th, and the named head
            for version in (5, 6):
                credits = [BatchCredit(ME, _digest(version - 1, 0), version - 1, 4, 12)]
                entry = entry_of(RUN.node_id, 0, version, version - 1, honest.head.hash, 1.0, TRAIN, credits)
                honest.append(seal(RUN, entry))
            out.append(await asyncio.to_thread(check))  # only entries 5 and 6 are fetched
            out.append(await asyncio.to_thread(check, (2, "ab" * 32)))  # a head the chain does not have at 2
            routes.ledger = _ledger(tmp_path / "rewritten", range(1, 8), {}, salt="x")  # longer, other history
            out.append(await asyncio.to_thread(check))
            routes.ledger = _ledger(tmp_path / "short", range(1, 3), {})  # fewer entries than checked
            out.append(await asyncio.to_thread(check))
            out.append(dict(watch.summary))
        finally:
            await runner.cleanup()
        return out

    first, second, third, named_other, rewritten, shorter, summary = asyncio.run(main())
    assert first["ledger_entries"] == 3 and first["trained"] == 3 and first["error"] == ""
    assert second["ledger_entries"] == 4 and second["trained"] == 4
    assert third["ledger_entries"] == 6 and third["trained"] == 6 and third["acknowledged"] == 0
    # each entry fetched once, in order; the rewritten history's 7th entry is asked for and does not link
    assert asked == [0, 1, 2, 3, 4, 5, 6]
    whole = account(ME, RUN.node_id, read_book(book.path), honest.read(0, 10), 2)
    assert {k: third[k] for k in ("trained", "refused", "acknowledged", "lost", "unanswered")} == {
        k: whole.counts().get(k, 0) for k in ("trained", "refused", "acknowledged", "lost", "unanswered")
    }
    assert third["refused_by_reason"] == {"toploc": 1} and third["trained_rollouts"] == 6 * 4
    assert isinstance(named_other, LedgerFork) and "names a ledger of 2 entries" in str(named_other)
    assert isinstance(rewritten, LedgerError) and rewritten.reason == "fork"
    assert isinstance(shorter, LedgerFork) and "fewer than the 6" in str(shorter)
    assert summary["trained"] == 6 and summary["ledger_entries"] == 6, "the last good figures are kept"
    assert summary["error"].startswith("LedgerFork")


def test_a_busy_trainer_is_asked_again_as_it_says_and_a_refusal_is_not() -> None:
    """The credit reader's fetch (``get_bounded``) waits out 429/503 as their Retry-After says: a volunteer paging a
    long ledger meets the trainer's rate per address for public routes (node/p2p/http.py); a 404 still fails."""
    answers = [429, 503, 200]

    async def ledger(_request: web.Request) -> web.Response:
        status = answers.pop(0)
        return web.Response(status=status, body=b"{}", headers={"Retry-After": "0.2"} if status != 200 else {})

    async def missing(_request: web.Request) -> web.Response:
        return web.Response(status=404)

    async def main() -> tuple[bytes, str]:
        app = web.Application()
        app.router.add_get("/ledger", ledger)
        app.router.add_get("/gone", missing)
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        try:
            body = await asyncio.to_thread(credit_module.get_bounded, f"http://127.0.0.1:{port}/ledger")
            with pytest.raises(Exception) as refused:
                await asyncio.to_thread(credit_module.get_bounded, f"http://127.0.0.1:{port}/gone")
            return body, str(refused.value)
        finally:
            await runner.cleanup()

    body, refused = asyncio.run(main())
    assert body == b"{}" and answers == [] and "404" in refused
