"""The trainer's ledger file: fsynced appends checked against the chain, a crash's torn record cut off, entries of
versions never published dropped at restart, a file that does not check refused at start; and its HTTP routes,
served by a real aiohttp server on loopback, bounded per request, checkable by a client with the run id alone."""

from __future__ import annotations

import asyncio
import hashlib
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from intellect_node.roles import trainer_ledger
from intellect_node.roles.trainer_ledger import LedgerLog, LedgerRoutes, parse_framed
from intellect_protocol.envelope import seal
from intellect_protocol.identity import Identity
from intellect_protocol.ledger import BatchCredit, LedgerError, entry_hash, entry_of, genesis, verify_chain

TRAIN = hashlib.sha256(b"train").hexdigest()


def _entry(run: Identity, epoch: int, version: int, prev: str) -> bytes:
    credit = BatchCredit("ab" * 16, hashlib.sha256(f"{epoch}/{version}".encode()).hexdigest(), version - 1, 8, 80)
    return seal(run, entry_of(run.node_id, epoch, version, version - 1, prev, 1.0e9, TRAIN, [credit]))


def _grow(log: LedgerLog, run: Identity, epoch: int, versions: range) -> list[bytes]:
    out = []
    for v in versions:
        sealed = _entry(run, epoch, v, log.head.hash)
        log.append(sealed)
        out.append(sealed)
    return out


def test_entries_survive_a_restart_and_a_torn_last_record_is_cut(tmp_path: Path) -> None:
    run = Identity.generate()
    log = LedgerLog(tmp_path, run.node_id)
    sealed = _grow(log, run, 0, range(1, 4))
    head = log.head
    assert head.length == 3 and head.hash == entry_hash(sealed[-1])
    with open(log.path, "ab") as f:  # a crash in the middle of the fourth append
        f.write(len(sealed[0]).to_bytes(4, "big") + sealed[0][:40])
    again = LedgerLog(tmp_path, run.node_id)
    assert again.head == head and again.read(0, 5) == sealed
    assert again.entry(2).version == 3 and again.entry(0).prev == genesis(run.node_id)
    _grow(again, run, 0, range(4, 5))  # and it goes on from there
    assert LedgerLog(tmp_path, run.node_id).head.length == 4


def test_entries_of_versions_never_published_are_dropped(tmp_path: Path) -> None:
    run = Identity.generate()
    log = LedgerLog(tmp_path, run.node_id)
    _grow(log, run, 0, range(1, 3))
    _grow(log, run, 7, range(1, 4))  # a new epoch
    assert log.drop_unpublished(7, published=1) == 2
    assert log.head.length == 3 and (log.head.epoch, log.head.version) == (7, 1)
    assert LedgerLog(tmp_path, run.node_id).head == log.head
    _grow(log, run, 7, range(2, 3))  # the step is done again: its new entry follows
    assert log.drop_unpublished(7, published=2) == 0


def test_an_entry_that_does_not_extend_the_chain_is_not_written(tmp_path: Path) -> None:
    run, other = Identity.generate(), Identity.generate()
    log = LedgerLog(tmp_path, run.node_id)
    _grow(log, run, 0, range(1, 3))
    size = log.path.stat().st_size
    with pytest.raises(LedgerError, match="gap"):
        log.append(_entry(run, 0, 5, log.head.hash))
    with pytest.raises(LedgerError, match="fork"):
        log.append(_entry(run, 0, 3, genesis(run.node_id)))
    with pytest.raises(LedgerError, match="wrong_signer"):
        log.append(_entry(other, 0, 3, log.head.hash))
    assert log.path.stat().st_size == size


def test_a_ledger_file_that_does_not_check_stops_the_trainer_saying_why(tmp_path: Path) -> None:
    run = Identity.generate()
    log = LedgerLog(tmp_path, run.node_id)
    _grow(log, run, 0, range(1, 4))
    data = bytearray(log.path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    log.path.write_bytes(bytes(data))
    with pytest.raises(SystemExit, match="does not check at entry 1 .*restore it from a backup"):
        LedgerLog(tmp_path, run.node_id)


def test_the_ledger_routes_serve_a_chain_a_client_checks_with_the_run_id_alone(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """GET /ledger (the head) and GET /ledger/entries (ranges, in the file's framing): what a volunteer fetches and
    checks. Bounded per request (count, bytes, at least one entry); a bad range is a 400 saying what is wrong; a
    trainer without a ledger says so (404, ``enabled: false``)."""
    run = Identity.generate()
    log = LedgerLog(tmp_path, run.node_id)
    sealed = _grow(log, run, 0, range(1, 6))
    monkeypatch.setattr(trainer_ledger, "RESPONSE_MAX_BYTES", 2 * len(sealed[0]) + 10)

    async def main() -> dict[str, Any]:
        routes = LedgerRoutes(run.node_id, log)
        app = web.Application()
        app.add_routes(routes.routes())
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        base = f"http://127.0.0.1:{port}"
        out: dict[str, Any] = {}
        try:
            async with aiohttp.ClientSession() as http:
                async with http.get(f"{base}/ledger") as r:
                    out["head"] = await r.json()
                pages: list[bytes] = []
                while len(pages) < len(sealed):
                    async with http.get(f"{base}/ledger/entries", params={"first": len(pages)}) as r:
                        got = parse_framed(await r.read())
                        assert got, "a page is never empty before the end"
                        out.setdefault("page_sizes", []).append(len(got))
                        pages += got
                out["pages"] = pages
                async with http.get(f"{base}/ledger/entries", params={"first": 1, "count": 1}) as r:
                    out["one"] = parse_framed(await r.read())
                async with http.get(f"{base}/ledger/entries", params={"first": 99}) as r:
                    out["past_end"] = (r.status, await r.read())
                for bad in ({"first": "-1"}, {"count": "0"}, {"first": "x"}):
                    async with http.get(f"{base}/ledger/entries", params=bad) as r:
                        out.setdefault("bad", []).append((r.status, await r.text()))
                routes.ledger = None
                async with http.get(f"{base}/ledger/entries") as r:
                    out["off"] = (r.status, await r.text())
                async with http.get(f"{base}/ledger") as r:
                    out["off_head"] = await r.json()
        finally:
            await runner.cleanup()
        return out

    out = asyncio.run(main())
    head = out["head"]
    assert (head["length"], head["head"], head["version"], head["enabled"]) == (5, log.head.hash, 5, True)
    assert out["pages"] == sealed and out["page_sizes"] == [2, 2, 1], "pages cut at the byte budget"
    assert verify_chain(out["pages"], run.node_id).hash == head["head"]
    assert out["one"] == [sealed[1]] and out["past_end"] == (200, b"")
    assert [status for status, _ in out["bad"]] == [400, 400, 400] and "whole numbers" in out["bad"][2][1]
    assert out["off"][0] == 404 and "no contribution ledger" in out["off"][1]
    assert out["off_head"]["enabled"] is False and out["off_head"]["head"] == genesis(run.node_id)
    with pytest.raises(ValueError, match="cut short"):
        parse_framed(b"".join(len(x).to_bytes(4, "big") + x for x in sealed)[:-3])
