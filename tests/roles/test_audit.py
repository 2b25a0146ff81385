"""Issue 39 item 3: a step replayed from the trainer's checkpoint, its ledger entry and the producers' signed
batches lands on the weights it published, and a trainer that trained on other data, skipped a batch or changed a
hyper-parameter is caught. A real trainer, inference node and auditor (processes, loopback) make the run; the
auditor replays steps over the network while it runs. The dishonest trainers are played by publishing, under the
run key, the weights such a trainer would have made from the same checkpoint, and serving them over real HTTP."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import time
import urllib.request
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import torch
from aiohttp import web

from intellect_node.launch import NodeProcess, join_argv
from intellect_node.p2p.http import HttpServer, Tarpit
from intellect_node.p2p.keys import load_or_create
from intellect_node.p2p.metrics import Metrics
from intellect_node.policy.engine import Group
from intellect_node.roles import auditor_node, trainer_audit
from intellect_node.roles.audit import (
    AUDIT_TOLERANCE,
    AuditError,
    AuditResult,
    _checkpoint,
    replay,
    step_inputs,
    step_weights,
)
from intellect_node.roles.auditor_node import RemoteAudit
from intellect_node.roles.credit import LedgerFork
from intellect_node.roles.trainer_audit import PER_KEY_PER_HOUR, SERVING, AuditRoutes
from intellect_node.roles.trainer_checkpoint import CheckpointDir
from intellect_node.roles.trainer_ledger import LedgerLog, LedgerRoutes
from intellect_node.weights.auth import signed_headers
from intellect_node.weights.files import sha256_file, write_checkpoint
from intellect_node.weights.store import WeightStore
from intellect_protocol.envelope import seal
from intellect_protocol.identity import Identity
from intellect_protocol.ledger import leaf_hash, merkle_root, train_hash
from intellect_protocol.messages import RunSpec
from tests.helpers.wait import until

pytestmark = pytest.mark.integration

STEPS = 3


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """A trainer's data dir after STEPS steps with one inference node (checkpoint every step, the default)."""
    root = tmp_path_factory.mktemp("audit")
    nodes: list[NodeProcess] = []
    try:
        trainer = NodeProcess(
            "trainer", ["bootstrap", "--data-dir", str(root / "trainer"), "--max-steps", str(STEPS)], root / "logs"
        )
        nodes.append(trainer)
        ready = trainer.wait_ready(timeout=120)
        worker = NodeProcess("inference", join_argv("inference", ready, root / "inference"), root / "logs")
        nodes.append(worker)
        auditor = NodeProcess(
            "auditor", join_argv("auditor", ready, root / "auditor", "--audit-every-s", "1"), root / "logs"
        )
        nodes.append(auditor)
        worker.wait_ready(timeout=120)
        auditor.wait_ready(timeout=120)
        trainer.wait_for_line(f"STEP {STEPS} ", timeout=300)

        def published() -> bool:  # the last version's entry and weights are written after its STEP line
            with urllib.request.urlopen(ready["status_url"] + "/status", timeout=10) as resp:
                status = json.load(resp)
            return bool(status["weight_version"] == STEPS and status["ledger"]["length"] == STEPS)

        asyncio.run(until(published, f"version {STEPS} published with its entry", timeout=60, every=0.2))
        auditor.wait_for_line(f"AUDIT audit version={STEPS} ", timeout=120)  # the auditor's replay over the network
    finally:
        for node in reversed(nodes):
            node.stop()
    yield root / "trainer"


def _forge(
    trainer_dir: Path,
    to: Path,
    change: Callable[[RunSpec, list[Group]], tuple[RunSpec, list[Group]]],
    consistent: bool = True,
    tamper: Callable[[dict[str, torch.Tensor]], None] = lambda tensors: None,
) -> Path:
    """A copy of the trainer's data dir whose newest version holds what a trainer that made ``change`` to the
    step's inputs would have published (signed by the run key, as the real trainer would), with a re-signed entry
    naming those weights (``consistent``) or the honest entry left as it was."""
    shutil.copytree(trainer_dir, to)
    inputs = step_inputs(to)
    spec, groups = change(inputs.spec, inputs.groups)
    _, tensors = step_weights(inputs, spec, groups)
    tamper(tensors)
    weights = to / "weights" / inputs.run_id
    entry = inputs.entry
    shutil.rmtree(weights / str(entry.version))
    manifest = write_checkpoint(weights, inputs.run, inputs.run_id, entry.version, tensors, 1 << 30, epoch=entry.epoch)
    if consistent:
        ledger = LedgerLog(to / "ledger", inputs.run_id)
        ledger.drop_unpublished(entry.epoch, entry.version - 1)
        forged = entry.model_copy(update={"weights": manifest.checkpoint_sha256, "prev": ledger.head.hash})
        ledger.append(seal(inputs.run, forged))
    return to


def test_an_honest_step_replays_to_the_published_weights(trained: Path) -> None:
    once = replay(trained)
    assert once.verdict == "honest" and once.version == STEPS and once.groups > 0 and once.update_max > 0
    again = replay(trained, threads=2)  # another process's replay, another thread count
    assert again.verdict == "honest"
    assert max(once.max_abs_diff, again.max_abs_diff) <= AUDIT_TOLERANCE * once.update_max
    with pytest.raises(AuditError, match="not_held"):  # the trainer keeps its last two checkpoints
        replay(trained, version=1)
    with pytest.raises(AuditError, match="no_entry"):
        replay(trained, version=STEPS + 5)


def test_a_trainer_that_trained_on_other_data_is_caught(trained: Path, tmp_path: Path) -> None:
    def other_data(spec: RunSpec, groups: list[Group]) -> tuple[RunSpec, list[Group]]:
        g, other = groups[0], groups[-1]  # the first group's completions swapped for another's, rewards reversed
        swapped = Group(g.node_id, g.version, g.prompt_ids, other.completions, other.logprobs, other.rewards[::-1])
        return spec, [swapped, *groups[1:]]

    result = replay(_forge(trained, tmp_path / "t", other_data))
    assert result.verdict == "caught" and result.reason == "weights", result.line()


def test_a_trainer_that_skipped_a_batch_is_caught(trained: Path, tmp_path: Path) -> None:
    def skipped(spec: RunSpec, groups: list[Group]) -> tuple[RunSpec, list[Group]]:
        first = groups[0].digest
        kept = [g for g in groups if g.digest != first]
        assert kept, "the step trained on one batch only: nothing to skip"
        return spec, kept

    result = replay(_forge(trained, tmp_path / "t", skipped))
    assert result.verdict == "caught" and result.reason == "weights", result.line()


def test_a_trainer_that_changed_a_hyper_parameter_is_caught(trained: Path, tmp_path: Path) -> None:
    def hotter(spec: RunSpec, groups: list[Group]) -> tuple[RunSpec, list[Group]]:
        return spec.model_copy(update={"train": spec.train.model_copy(update={"lr": spec.train.lr * 3})}), groups

    result = replay(_forge(trained, tmp_path / "t", hotter))
    assert result.verdict == "caught" and result.reason == "weights", result.line()


def test_weights_other_than_the_entry_names_are_caught(trained: Path, tmp_path: Path) -> None:
    """Issue 39 item 4: a manifest that does not match its entry (the weights published are not the ones the
    entry names) is a finding before any replay."""
    result = replay(_forge(trained, tmp_path / "t", lambda spec, groups: (spec, groups[1:]), consistent=False))
    assert result.verdict == "caught" and result.reason == "manifest", result.line()


def test_an_entry_that_names_other_training_settings_is_caught(trained: Path, tmp_path: Path) -> None:
    """The entry is the trainer's signed word; one whose settings hash is not the run's is a finding itself."""
    to = tmp_path / "t"
    shutil.copytree(trained, to)
    run = load_or_create(to / "node.key")
    ledger = LedgerLog(to / "ledger", run.node_id)
    last = ledger.entry(len(ledger) - 1)
    state = _checkpoint(CheckpointDir(to / "checkpoints" / run.node_id), last.parent)
    train = RunSpec.model_validate_json(str(state["spec"])).train
    ledger.drop_unpublished(last.epoch, last.version - 1)  # the entry rewritten, re-signed, chained again
    other = last.model_copy(
        update={"train": train_hash(train.model_copy(update={"lr": train.lr * 3})), "prev": ledger.head.hash}
    )
    ledger.append(seal(run, other))
    result = replay(to)
    assert result.verdict == "caught" and result.reason == "train_settings", result.line()


# ---- over the network: the auditor role (node/roles/auditor_node.py) against the trainer's /audit routes ----------


def test_the_auditor_node_replayed_the_running_trainers_step(trained: Path) -> None:
    lines = [
        line for line in (trained.parent / "logs" / "auditor.out").read_text().splitlines() if line[:6] == "AUDIT "
    ]
    assert lines and all("verdict=honest" in line for line in lines), lines
    assert any(f"version={STEPS} " in line for line in lines)


@contextlib.asynccontextmanager
async def _loopback(app: web.Application) -> AsyncIterator[int]:
    """``app`` served on 127.0.0.1 for the block; yields its port."""
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    try:
        yield site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    finally:
        await runner.cleanup()


class Served:
    """A trainer's data dir served as the trainer serves it (/ledger, /audit) on loopback, and an auditor (its own
    key, its own copy of the published versions) with a RemoteAudit against it."""

    def __init__(
        self, trainer_dir: Path, auditor_dir: Path, members: set[str] | None = None, spec: RunSpec | None = None
    ) -> None:
        self.run = load_or_create(trainer_dir / "node.key")
        ledger = LedgerLog(trainer_dir / "ledger", self.run.node_id)
        self.epoch = ledger.entry(len(ledger) - 1).epoch
        self.auditor = Identity.generate()
        allowed = {self.auditor.node_id} if members is None else members

        async def member(node_id: str) -> bool:
            return node_id in allowed

        self.routes = AuditRoutes(
            self.run.node_id, lambda: self.epoch, trainer_dir / "checkpoints" / self.run.node_id, member, Metrics()
        )
        self.app = web.Application()
        self.app.add_routes([*self.routes.routes(), *LedgerRoutes(self.run.node_id, ledger).routes()])
        shutil.copytree(trainer_dir / "weights" / self.run.node_id, auditor_dir / "weights")
        store = WeightStore(auditor_dir / "weights", self.run.node_id, self.epoch)
        self.remote = RemoteAudit(self.auditor, self.run.node_id, store, auditor_dir / "audit", 1)
        self.remote.spec = spec or step_inputs(trainer_dir).spec  # the signed spec the node follows (the DHT's)
        self.url = ""

    async def __aenter__(self) -> Served:
        self.serving = _loopback(self.app)
        self.url = f"http://127.0.0.1:{await self.serving.__aenter__()}"
        self.session = aiohttp.ClientSession()
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.session.close()
        await self.serving.__aexit__(*exc)

    async def audit(self) -> AuditResult:
        return await self.remote.audit_once(self.url, None, self.session)


def test_an_auditor_replays_a_step_over_http(trained: Path, tmp_path: Path) -> None:
    async def run() -> None:
        async with Served(trained, tmp_path / "auditor") as served:
            result = await served.audit()
            assert result.verdict == "honest" and result.version == STEPS and result.groups > 0, result.line()
            with pytest.raises(AuditError, match="nothing_new"):  # the step before needs a checkpoint no longer held
                await served.audit()
            assert not (tmp_path / "auditor" / "audit").exists()  # the downloads are not left behind

    asyncio.run(run())


def test_an_auditor_catches_a_trainer_that_trained_on_other_data(trained: Path, tmp_path: Path) -> None:
    async def run() -> None:
        def other_data(spec: RunSpec, groups: list[Group]) -> tuple[RunSpec, list[Group]]:
            return spec, groups[1:]

        forged = await asyncio.to_thread(_forge, trained, tmp_path / "t", other_data)
        async with Served(forged, tmp_path / "auditor") as served:
            result = await served.audit()
        assert result.verdict == "caught" and result.reason == "weights", result.line()

    asyncio.run(run())


def test_a_starting_state_changed_after_its_entry_is_caught(trained: Path, tmp_path: Path) -> None:
    """A trainer that swaps the checkpoint a step started from (an optimizer state made to cover a dishonest step)
    after the ledger committed to it: the auditor's download does not match the entry's ``state``."""

    async def run() -> None:
        to = tmp_path / "t"
        shutil.copytree(trained, to)
        run = load_or_create(to / "node.key")
        path = to / "checkpoints" / run.node_id / f"step-{STEPS - 1:08d}.pt"
        state = torch.load(path, map_location="cpu", weights_only=True)
        moments = [t for t in _tensors(state["engine"]) if t.is_floating_point() and t.numel() > 1]
        moments[-1].mul_(2.0)
        torch.save(state, path)
        async with Served(to, tmp_path / "auditor", spec=step_inputs(trained).spec) as served:
            result = await served.audit()
        assert result.verdict == "caught" and result.reason == "state", result.line()
        local = replay(to)  # the same check on the trainer's own disk
        assert local.verdict == "caught" and local.reason == "state", local.line()

    asyncio.run(run())


def _tensors(tree: object) -> Iterator[torch.Tensor]:
    if isinstance(tree, torch.Tensor):
        yield tree
    elif isinstance(tree, dict):
        for value in tree.values():
            yield from _tensors(value)
    elif isinstance(tree, list | tuple):
        for value in tree:
            yield from _tensors(value)


def test_audit_downloads_are_for_signed_members_within_their_allowance(trained: Path, tmp_path: Path) -> None:
    """Who may download what a step started from: not a stranger, not an unsigned request, a member at most
    PER_KEY_PER_HOUR times an hour and one download at a time; a checkpoint no longer held is a clear 404."""

    async def run() -> None:
        async with Served(trained, tmp_path / "auditor") as served:
            path = f"/audit/spool/{STEPS - 1}"
            async with served.session.get(served.url + path) as resp:
                assert resp.status == 401
            stranger = Identity.generate()
            headers = signed_headers(stranger, "GET", path, served.run.node_id)
            async with served.session.get(served.url + path, headers=headers) as resp:
                assert resp.status == 403
            download = served.remote.download
            with pytest.raises(AuditError, match="not_held"):
                await download(served.session, served.url, "/audit/checkpoint/1", tmp_path / "c", 1 << 30)
            with pytest.raises(AuditError, match="too_large"):  # the auditor's own bound on what it takes
                await download(served.session, served.url, f"/audit/checkpoint/{STEPS}", tmp_path / "c", 1000)
            for _ in range(PER_KEY_PER_HOUR - 2):  # each request above counted against the key's allowance too
                await download(served.session, served.url, path, tmp_path / "s", 1 << 30)
            with pytest.raises(AuditError, match="http_429"):
                await download(served.session, served.url, path, tmp_path / "s", 1 << 30)
            served.routes._serving.add("busy-1")
            served.routes._serving.add("busy-2")  # SERVING downloads running: the next one waits
            async with served.session.get(served.url + "/audit") as resp:
                assert (await resp.json())["checkpoints"] == [STEPS - 1, STEPS]
            with pytest.raises(web.HTTPServiceUnavailable):
                served.routes._admit(Identity.generate().node_id)
            assert SERVING == 2

    asyncio.run(run())


def test_an_auditor_refused_for_its_address_rate_waits_and_its_download_completes(
    trained: Path, tmp_path: Path
) -> None:
    """Behind one address with other clients (a NAT, Docker's proxy) an auditor can find the public routes' rate
    spent: the 429 saying ``rate`` is waited out as its Retry-After says, and the download completes (its key's own
    limits are not waited out: the test above)."""
    served = Served(trained, tmp_path / "auditor")
    metrics = Metrics()
    path = f"/audit/spool/{STEPS - 1}"

    async def run() -> str:
        http = HttpServer(metrics, lambda: {"role": "trainer"}, served.routes.routes(), rate=1.0, burst=1)
        http.tarpit = Tarpit(hold_s=0.1)
        port = await http.start("127.0.0.1", 0)
        url = f"http://127.0.0.1:{port}"
        try:
            async with aiohttp.ClientSession() as session:
                async with session.get(url + "/audit") as resp:  # another client took the address's one request
                    assert resp.status == 200
                return await served.remote.download(session, url, path, tmp_path / "s", 1 << 30)
        finally:
            await http.close()

    digest = asyncio.run(run())
    assert digest == sha256_file(trained / "checkpoints" / served.run.node_id / f"spool-{STEPS - 1:08d}.bin")
    assert metrics.counter("node_http_refused_total", "rate") >= 1


def test_a_ledger_other_than_the_trainers_record_names_is_a_fork(trained: Path, tmp_path: Path) -> None:
    async def run() -> None:
        async with Served(trained, tmp_path / "auditor") as served:
            chain = served.remote.chain
            with pytest.raises(LedgerFork, match="signed record"):
                await chain.catch_up(served.session, served.url, (STEPS, "0" * 64))
            assert chain.head.length == STEPS  # what checked is kept

    asyncio.run(run())


def test_an_optimizer_state_made_up_after_a_step_is_caught(trained: Path, tmp_path: Path) -> None:
    """A trainer whose checkpoint after a step holds optimizer moments the step did not make (ready to cover a
    later dishonest step), committed in the entry as if honest: the weights replay, the state does not."""
    to = tmp_path / "t"
    shutil.copytree(trained, to)
    run = load_or_create(to / "node.key")
    path = to / "checkpoints" / run.node_id / f"step-{STEPS:08d}.pt"
    state = torch.load(path, map_location="cpu", weights_only=True)
    moments = state["engine"]["optimizer"]["state"]
    first = next(iter(moments.values()))
    first["exp_avg_sq"].mul_(1.5)
    torch.save(state, path)
    ledger = LedgerLog(to / "ledger", run.node_id)
    last = ledger.entry(len(ledger) - 1)
    ledger.drop_unpublished(last.epoch, last.version - 1)  # the entry re-signed, committing to the made-up state
    ledger.append(seal(run, last.model_copy(update={"state": sha256_file(path), "prev": ledger.head.hash})))
    honest = replay(trained)
    assert honest.verdict == "honest" and honest.state_diff == 0.0, honest.line()
    result = replay(to)
    assert result.verdict == "caught" and result.reason == "state_after", result.line()
    assert result.max_abs_diff <= AUDIT_TOLERANCE * result.update_max  # the weights alone would have passed


def test_a_reader_slower_than_the_floor_is_cut_off_and_frees_its_slot(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A member that asks for a checkpoint and then reads nothing (holding one of the SERVING slots for ever, were
    it allowed) is cut off once the download overruns its size at MIN_RATE_BPS plus GRACE_S, counted as too_slow."""
    monkeypatch.setattr(trainer_audit, "GRACE_S", 1.0)
    monkeypatch.setattr(trainer_audit, "MIN_RATE_BPS", 10**12)
    root = tmp_path / "checkpoints"
    root.mkdir()
    (root / "step-00000007.pt").write_bytes(os.urandom(64 << 20))  # more than the socket buffers take
    run, member = Identity.generate(), Identity.generate()

    async def allowed(node_id: str) -> bool:
        return node_id == member.node_id

    metrics = Metrics()
    routes = AuditRoutes(run.node_id, lambda: 1, root, allowed, metrics)

    async def scenario() -> None:
        app = web.Application()
        app.add_routes(routes.routes())
        async with _loopback(app) as port:
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            path = "/audit/checkpoint/7"
            headers = "".join(f"{k}: {v}\r\n" for k, v in signed_headers(member, "GET", path, run.node_id).items())
            writer.write(f"GET {path} HTTP/1.1\r\nHost: x\r\n{headers}\r\n".encode())
            await writer.drain()
            await until(lambda: member.node_id in routes._serving, "the download to start", timeout=10)
            await until(lambda: not routes._serving, "the slow reader to be cut off", timeout=30)
            assert 'node_audit_downloads_total{outcome="too_slow"} 1.0' in metrics.render()
            writer.close()

    asyncio.run(scenario())


def test_a_nan_in_the_published_weights_is_caught(trained: Path, tmp_path: Path) -> None:
    """A NaN compares as neither larger nor smaller than anything: without its own check it would hide any change
    the trainer made to the rest of its tensor."""

    def poisoned(tensors: dict[str, torch.Tensor]) -> None:
        name = sorted(tensors)[-1]
        tensors[name] = tensors[name].clone()
        tensors[name].view(-1)[0] = float("nan")
        tensors[name].view(-1)[1:] += 1.0  # what the NaN would hide

    forged = _forge(trained, tmp_path / "t", lambda spec, groups: (spec, groups), tamper=poisoned)
    result = replay(forged)
    assert result.verdict == "caught" and result.reason == "not_finite", result.line()


def test_a_checkpoint_naming_another_run_spec_is_caught_over_http(trained: Path, tmp_path: Path) -> None:
    """The auditor replays with the run spec the run key signed (the task, seed and model never come from the
    trainer's file); a checkpoint whose spec is another is a finding."""

    async def run() -> None:
        async with Served(trained, tmp_path / "auditor") as served:
            assert served.remote.spec is not None
            served.remote.spec = served.remote.spec.model_copy(update={"seed": served.remote.spec.seed + 1})
            result = await served.audit()
            assert result.verdict == "caught" and result.reason == "spec", result.line()
            with pytest.raises(AuditError, match="nothing_new"):  # a finding is final for that version
                await served.audit()

    asyncio.run(run())


def _resign(to: Path, changes: dict[int, dict[str, object]]) -> None:
    """The ledger of ``to`` from the first changed version on, re-signed by the run key with ``changes`` (by
    version: fields to replace), each entry chained to the one before."""
    run = load_or_create(to / "node.key")
    ledger = LedgerLog(to / "ledger", run.node_id)
    entries = [ledger.entry(i) for i in range(len(ledger))]
    first = min(changes)
    ledger.drop_unpublished(entries[-1].epoch, first - 1)
    for entry in entries:
        if entry.version < first:
            continue
        update = {**changes.get(entry.version, {}), "prev": ledger.head.hash}
        ledger.append(seal(run, entry.model_copy(update=update)))


def test_an_entry_whose_credits_its_groups_do_not_add_up_to_is_caught(trained: Path, tmp_path: Path) -> None:
    """Crediting a batch with more tokens than the step trained of it (or a colluder's batch the step never used)."""
    to = tmp_path / "t"
    shutil.copytree(trained, to)
    last = step_inputs(to).entry
    tokens = [last.tokens[0] + 100, *last.tokens[1:]]
    credits = [replace(c, tokens=t) for c, t in zip(last.credits(), tokens, strict=True)]
    _resign(to, {last.version: {"tokens": tokens, "root": merkle_root([leaf_hash(c) for c in credits]).hex()}})
    result = replay(to)
    assert result.verdict == "caught" and result.reason == "credits", result.line()


def test_optimizer_settings_changed_in_the_checkpoint_are_caught(trained: Path, tmp_path: Path) -> None:
    """Weight decay, betas or eps come from the checkpoint when it is loaded: a trainer that changed them there (and
    committed to that file) would replay as honest were they not checked against the run spec."""
    to = tmp_path / "t"
    shutil.copytree(trained, to)
    run = load_or_create(to / "node.key")
    path = to / "checkpoints" / run.node_id / f"step-{STEPS - 1:08d}.pt"
    state = torch.load(path, map_location="cpu", weights_only=True)
    for group in state["engine"]["optimizer"]["param_groups"]:
        group["weight_decay"] = 0.5
    torch.save(state, path)
    _resign(to, {STEPS - 1: {"state": sha256_file(path)}})
    result = replay(to)
    assert result.verdict == "caught" and result.reason == "optimizer_settings", result.line()


def test_a_trainer_that_trickles_its_ledger_cannot_hold_the_auditor(monkeypatch: pytest.MonkeyPatch) -> None:
    """A hostile trainer answers the ledger a byte at a time, each in time for a per-read timeout: the auditor's
    whole read has a deadline (FETCH_S), and the round ends with a timeout it counts."""
    monkeypatch.setattr(auditor_node, "FETCH_S", 1.0)

    async def trickle(request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse()
        await response.prepare(request)
        for _ in range(100):
            await response.write(b" ")
            await asyncio.sleep(0.2)
        return response

    async def scenario() -> None:
        app = web.Application()
        app.router.add_get("/ledger", trickle)
        async with _loopback(app) as port, aiohttp.ClientSession() as session:
            started = time.monotonic()
            with pytest.raises(TimeoutError):
                await auditor_node.fetch(session, f"http://127.0.0.1:{port}/ledger")
            assert time.monotonic() - started < 10

    asyncio.run(scenario())
