"""Fuzzing every decoder and handler a peer can reach, coverage-guided with atheris (libFuzzer).

    python benchmarks/fuzz.py [--runs 100000] [--targets codec,envelope,...] [--timeout 10]

Each target runs in a process of its own for ``--runs`` inputs, from seeds that are valid messages (so mutations
explore near-valid input, past the cheap checks). A *crash* is any exception a target lets through other than
the clean refusal its callers handle (``Rejected``, ``CodecError``, an answer below 500 from an HTTP route, a
``SubmitReply`` from the trainer's submit handler); a *hang* is one input running past ``--timeout`` seconds.

Targets:
- ``codec``: the bounded msgpack decoder (protocol/codec.py) on arbitrary bytes.
- ``envelope``: the strict envelope parser and signature check (protocol/envelope.py) on arbitrary bytes.
- ``schema.<kind>``: each wire message's schema on arbitrary bodies, correctly signed (the signature would
  otherwise stop nearly every mutation before the schema sees it).
- ``manifest``: manifest verification (node/weights/files.py), signed bodies.
- ``dht_record``: the DHT record validator that runs inside every DHT process (node/p2p/dht.py), and the
  readers' per-record check, on signed bodies under this run's keys.
- ``frame``: the libp2p stream frame reader (node/p2p/transport.py) on arbitrary streams.
- ``http``: every HTTP route of a relay and the node server (``/weights``, ``/relay/attach`` POST and DELETE,
  ``/relay/next``, ``/health``, ``/status``, ``/metrics``) through aiohttp's test client, with signed and
  forged auth headers.
- ``submit``: the trainer's submit handler (``Trainer.on_batch``, a tiny model) on raw frames and on batches
  signed by a registered node.
- ``invite``: invite tokens as a volunteer types them, and their redemption by the trainer's admission.

Prints one row per target, then ``fuzz targets=N inputs=... crashes=0 hangs=0``.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

SCHEMAS = (
    "RunSpec",
    "NodeRecord",
    "Manifest",
    "RolloutBatch",
    "SubmitReply",
    "Verdict",
    "Invite",
    "VersionNotice",
    "BatchAnnounce",
    "BatchAck",
    "BatchRequest",
    "DialBack",
    "Reachability",
)
TARGETS = (
    "codec",
    "envelope",
    *(f"schema.{s}" for s in SCHEMAS),
    "manifest",
    "dht_record",
    "frame",
    "http",
    "submit",
    "invite",
)


# ---- the targets (each runs in its own process, under atheris) --------------------------------------------


def _setup(target: str) -> tuple[Callable[[bytes], None], list[bytes]]:
    """The function to fuzz and its seeds. Imports happen here, inside atheris' instrumentation."""
    import asyncio

    from intellect_protocol import PROTOCOL_VERSION
    from intellect_protocol import messages as m
    from intellect_protocol.codec import Channel, CodecError, pack, unpack
    from intellect_protocol.envelope import Rejected, open_envelope, open_signed, seal
    from intellect_protocol.identity import Identity

    run_key = Identity.from_private_bytes(bytes(range(32)))
    node_key = Identity.from_private_bytes(bytes(range(1, 33)))
    run_id, node_id = run_key.node_id, node_key.node_id
    now = time.time()

    def signed(kind: str, body: bytes, key: Identity = node_key) -> bytes:
        return pack(
            {"v": PROTOCOL_VERSION, "kind": kind, "signer": key.public_key, "body": body, "sig": key.sign(kind, body)}
        )

    spec = m.RunSpec(run_id=run_id, created=now, seed=1, model=m.ModelSpec())
    record = m.NodeRecord(
        run_id=run_id,
        node_id=node_id,
        role="inference",
        updated=now,
        relay=m.RelayInfo(depth=1, slots_total=4, slots_free=2, versions=[0, 1]),
    )
    manifest = m.Manifest(
        run_id=run_id,
        version=3,
        created=now,
        total_size=10,
        shards=[m.ShardEntry(name="shard-00000.safetensors", size=10, sha256="ab" * 32)],
        checkpoint_sha256="00" * 32,
    )
    group = m.RolloutGroup(
        slot=0,
        prompt_ids=[1, 2, 3],
        completions=[[4, 5], [6]],
        logprobs=[[-0.1, -0.2], [-1.0]],
        proofs=[[b"\x00\x01"], [b"\x00\x02"]],
    )
    batch = m.RolloutBatch(run_id=run_id, node_id=node_id, version=0, batch_index=0, groups=[group])
    examples: dict[str, m.WireModel] = {
        "RunSpec": spec,
        "NodeRecord": record,
        "Manifest": manifest,
        "RolloutBatch": batch,
        "SubmitReply": m.SubmitReply(ok=False, reason="busy", next_index=3),
        "Verdict": m.Verdict(run_id=run_id, node_id=node_id, version=0, batch_index=0, batch_sha256="00" * 32, ok=True),
        "Invite": m.Invite(run_id=run_id, token_id="ab" * 8, expires=now + 3600, uses=3),
        "VersionNotice": m.VersionNotice(run_id=run_id, version=3, checkpoint_sha256="ab" * 32, issued=now),
        "BatchAnnounce": m.BatchAnnounce(
            run_id=run_id, node_id=node_id, version=0, batch_index=1, batch_sha256="cd" * 32, size=1000, issued=now
        ),
        "BatchAck": m.BatchAck(
            run_id=run_id,
            node_id=node_id,
            version=0,
            batch_index=1,
            batch_sha256="cd" * 32,
            judges=[node_id],
            issued=now,
        ),
        "BatchRequest": m.BatchRequest(run_id=run_id, batch_sha256="cd" * 32),
        "DialBack": m.DialBack(run_id=run_id, node_id=node_id, p2p_maddrs=["/ip4/10.0.0.1/tcp/4001"], http_port=80),
        "Reachability": m.Reachability(node_id=node_id, observed_ip="10.0.0.1", p2p_ok=True),
    }
    bodies = {k: pack(v.model_dump(mode="python")) for k, v in examples.items()}

    if target == "codec":

        def one(data: bytes) -> None:
            try:
                unpack(data, Channel.ROLLOUT_BATCH)
            except CodecError:
                pass

        return one, [pack(examples["RolloutBatch"].model_dump(mode="python")), pack({"a": [1, 2.5, None, b"x"]})]

    if target == "envelope":

        def one(data: bytes) -> None:
            try:
                open_envelope(data, m.RolloutBatch)
            except Rejected:
                pass

        return one, [seal(node_key, batch), seal(run_key, spec)]

    if target.startswith("schema."):
        schema = getattr(m, target.split(".", 1)[1])

        def one(data: bytes) -> None:
            try:
                open_signed(signed(schema.KIND, data), schema)
            except Rejected:
                pass

        return one, [bodies[schema.__name__]]

    if target == "manifest":
        from intellect_node.weights.files import verify_manifest

        def one(data: bytes) -> None:
            try:
                verify_manifest(signed("manifest", data, run_key), run_id, 3, 0)
            except Rejected:
                pass

        return one, [bodies["Manifest"]]

    if target == "dht_record":
        from hivemind.dht.routing import DHTID
        from hivemind.dht.validation import DHTRecord
        from hivemind.utils import get_dht_time
        from hivemind.utils.serializer import MSGPackSerializer

        from intellect_node.p2p.dht import RecordValidator, check_node_record
        from intellect_protocol.records import nodes_key, spec_key, trainer_key

        validator = RecordValidator(run_id)
        keys = [DHTID.generate(source=k(run_id)).to_bytes() for k in (nodes_key, trainer_key, spec_key)]

        def one(data: bytes) -> None:
            if not data:
                return
            kind = "run_spec" if data[0] % 3 == 2 else "node_record"
            value = signed(kind, data[1:], run_key if data[0] % 2 else node_key)
            subkey = node_id if data[0] % 5 else run_id
            rec = DHTRecord(
                key=keys[data[0] % 3],
                subkey=MSGPackSerializer.dumps(subkey),
                value=MSGPackSerializer.dumps(value),
                expiration_time=get_dht_time() + (data[0] % 7) * 60,
            )
            if not isinstance(validator.validate(rec), bool):
                raise AssertionError("the DHT validator must answer True or False")
            try:
                check_node_record(value, subkey, run_id)
            except Rejected:
                pass

        return one, [b"\x01" + bodies["NodeRecord"], b"\x02" + bodies["RunSpec"]]

    if target == "frame":
        from intellect_node.p2p.transport import read_frame_within

        async def read(data: bytes) -> None:
            reader = asyncio.StreamReader()
            reader.feed_data(data)
            reader.feed_eof()
            try:
                await read_frame_within(reader, Channel.ROLLOUT_BATCH.value)
            except (Rejected, asyncio.IncompleteReadError, TimeoutError):
                pass

        loop = asyncio.new_event_loop()
        envelope = seal(node_key, batch)
        return (lambda data: loop.run_until_complete(read(data))), [len(envelope).to_bytes(4, "big") + envelope]

    if target == "http":
        return _http_target(run_key, node_key, run_id)

    if target == "submit":
        return _submit_target(node_key, signed, bodies)

    if target == "invite":
        from intellect_node.roles.admission import Admission, mint_invite
        from intellect_protocol.admission import invite_envelope

        admission = Admission(m.AdmissionSpec(policy="invite"), run_id)
        good = mint_invite(run_key, 5, 1.0)

        def one(data: bytes) -> None:
            text = data.decode("utf-8", errors="replace")
            try:
                envelope = invite_envelope(text)
            except ValueError:
                return
            try:
                admission.redeem(node_id, envelope[: Channel.INVITE.value])
            except Rejected:
                pass

        return one, [good.encode()]
    raise SystemExit(f"unknown target {target}; choose from {', '.join(TARGETS)}")


def _http_target(run_key: object, node_key: object, run_id: str) -> tuple[Callable[[bytes], None], list[bytes]]:
    import asyncio

    import atheris
    import torch
    import yarl
    from aiohttp import web
    from aiohttp.test_utils import TestClient, TestServer

    from intellect_node.p2p.http import HttpServer
    from intellect_node.p2p.metrics import Metrics
    from intellect_node.weights.auth import CHILD_HEADER, KEY_HEADER, TOKEN_HEADER, signed_headers
    from intellect_node.weights.files import write_checkpoint
    from intellect_node.weights.relay import ShardServer
    from intellect_node.weights.store import WeightStore
    from intellect_protocol.identity import Identity

    assert isinstance(run_key, Identity) and isinstance(node_key, Identity)
    root = Path(tempfile.mkdtemp(prefix="fuzz-http-"))
    write_checkpoint(root, run_key, run_id, 0, {"w": torch.zeros(64)}, 1 << 20)
    (root / "0" / "stray.key").write_bytes(b"secret")  # never served: not in the manifest
    metrics = Metrics()
    loop = asyncio.new_event_loop()

    async def member(node: str) -> bool:
        return node == node_key.node_id

    async def build() -> TestClient:
        store = WeightStore(root, run_id, 0)
        shards = ShardServer(store, metrics, slots=2, node_id=run_id, members=member)
        http = HttpServer(metrics, lambda: {"ok": True}, shards.routes())
        app = web.Application()
        app.router.add_get("/health", http._health)
        app.router.add_get("/status", http._status_handler)
        app.router.add_get("/metrics", http._metrics_handler)
        app.add_routes(http._routes)
        client = TestClient(TestServer(app))
        await client.start_server()
        return client

    client = loop.run_until_complete(build())
    paths = [
        "/weights/0/manifest.msgpack",
        "/weights/0/shard-00000.safetensors",
        "/weights/0/stray.key",
        "/relay/attach",
        "/relay/next",
        "/health",
        "/status",
        "/metrics",
        "/weights/",
        "/",
    ]
    methods = ["GET", "POST", "DELETE", "HEAD", "PUT"]

    async def request(data: bytes) -> None:
        fdp = atheris.FuzzedDataProvider(data)
        method = methods[fdp.ConsumeIntInRange(0, len(methods) - 1)]
        path = paths[fdp.ConsumeIntInRange(0, len(paths) - 1)]
        if fdp.ConsumeBool():
            path += fdp.ConsumeUnicodeNoSurrogates(40).replace("?", "").replace("#", "")
            path = "/" + path.lstrip("/")  # "//host/..." would be another server's URL, not a path of ours
        query = {"after": fdp.ConsumeUnicodeNoSurrogates(12)} if fdp.ConsumeBool() else {}
        if fdp.ConsumeBool():  # the relay tree's stripe and home (signed with the path, as a node signs them)
            query["stripe"] = fdp.ConsumeUnicodeNoSurrogates(3)
        if fdp.ConsumeBool():
            query["home"] = fdp.ConsumeUnicodeNoSurrogates(2)
        headers: dict[str, str] = {}
        if fdp.ConsumeBool():
            target = str(yarl.URL.build(path=path, query=query)) if query else path
            headers.update(signed_headers(node_key, method, target, run_id))
        for name in (CHILD_HEADER, KEY_HEADER, TOKEN_HEADER, "Range", "X-Intellect-Auth"):
            if fdp.ConsumeBool():
                headers[name] = fdp.ConsumeUnicodeNoSurrogates(80).encode("latin-1", "ignore").decode("latin-1")
        headers = {k: v.replace("\r", "").replace("\n", "") for k, v in headers.items()}
        body = fdp.ConsumeBytes(fdp.ConsumeIntInRange(0, 256))
        try:
            resp = await asyncio.wait_for(client.request(method, path, params=query, headers=headers, data=body), 30)
        except (ValueError, TypeError):  # a request the client itself refuses to send (an invalid URL)
            return
        await resp.read()
        if resp.status >= 500 and resp.status != 503:  # 503: no free slot, a refusal; 500: an escaped exception
            raise AssertionError(f"{method} {path} answered {resp.status}")
        if path.startswith("/weights/0/stray.key") and resp.status == 200:
            raise AssertionError("a file the manifest does not name was served")

    return (lambda data: loop.run_until_complete(request(data))), [bytes(range(64)), b"\x00" * 64, b"\xff" * 64]


def _submit_target(
    node_key: object, signed: Callable[..., bytes], bodies: dict[str, bytes]
) -> tuple[Callable[[bytes], None], list[bytes]]:
    import asyncio

    from intellect_node.config import NodeConfig, load_run_config
    from intellect_node.roles.trainer import Trainer
    from intellect_node.roles.trainer_validation import PendingBatches
    from intellect_protocol import messages as m
    from intellect_protocol.codec import pack
    from intellect_protocol.envelope import seal
    from intellect_protocol.identity import Identity

    assert isinstance(node_key, Identity)
    loop = asyncio.new_event_loop()
    asyncio.set_event_loop(loop)
    data_dir = Path(tempfile.mkdtemp(prefix="fuzz-submit-"))
    run = load_run_config(Path(__file__).resolve().parent.parent / "node" / "configs" / "tiny.toml")
    trainer = Trainer(NodeConfig(data_dir=data_dir, checkpoint_every=0), run)
    node_id = node_key.node_id
    trainer.registry.records[node_id] = m.NodeRecord(
        run_id=trainer.run_id, node_id=node_id, role="inference", updated=time.time() + 10**6
    )
    trainer.progress.published = 0
    trainer.door.newcomers.admitted(node_id)  # past the newcomers' rate: every input reaches the decoder
    # a well-formed batch of the tasks assigned to this node (it passes the header and content checks)
    first = m.RolloutGroup(slot=0, prompt_ids=[1], completions=[[2]], logprobs=[[-1.0]], proofs=[[b"\x00\x01"]])
    probe = m.RolloutBatch(
        run_id=trainer.run_id, node_id=node_id, version=0, epoch=trainer.spec.epoch, batch_index=0, groups=[first]
    )
    from intellect_node.policy.model import encode_prompt

    groups = []
    for slot in range(trainer.spec.task.tasks_per_batch):
        prompt = encode_prompt(trainer.tokenizer, trainer.judging.validator.task(probe, slot).prompt)
        n = trainer.spec.sampling.group_size
        groups.append(
            m.RolloutGroup(
                slot=slot,
                prompt_ids=prompt,
                completions=[[5, 6, 7]] * n,
                logprobs=[[-1.0, -1.0, -1.0]] * n,
                proofs=[[b"\x00" * 2]] * n,
            )
        )
    good = probe.model_copy(update={"groups": groups})
    good_body = pack(good.model_dump(mode="python"))

    async def submit(data: bytes) -> None:
        trainer.shared.inflight.clear()
        trainer.judging.pending = PendingBatches()
        trainer.gate.next_index.clear()
        trainer.door.envelopes.clear()
        trainer.banned.clear()
        frame = signed("rollout_batch", data[1:]) if data[:1] != b"R" else data[1:]
        reply = await asyncio.wait_for(trainer.door.on_batch(frame, "fuzz"), 30)
        if not isinstance(reply, m.SubmitReply):
            raise AssertionError(f"on_batch answered {type(reply).__name__}")

    seeds = [b"S" + good_body, b"S" + bodies["RolloutBatch"], b"R" + seal(node_key, good)]
    return (lambda data: loop.run_until_complete(submit(data))), seeds


def run_target(target: str, runs: int, timeout: int, workdir: Path) -> None:
    """In a child process: fuzz ``target`` with atheris for ``runs`` inputs (libFuzzer prints the counts)."""
    import atheris

    with atheris.instrument_imports(include=["intellect_protocol", "intellect_node"]):
        one, seeds = _setup(target)
    corpus = workdir / "corpus"
    corpus.mkdir(parents=True, exist_ok=True)
    for i, seed in enumerate(seeds):
        (corpus / f"seed-{i}").write_bytes(seed)
    argv = [
        sys.argv[0],
        f"-runs={runs}",
        f"-timeout={timeout}",
        "-rss_limit_mb=6144",
        "-max_len=65536",
        f"-artifact_prefix={workdir}/",
        "-print_final_stats=1",
        str(corpus),
    ]
    atheris.Setup(argv, one)
    atheris.Fuzz()


# ---- the driver ----------------------------------------------------------------------------------------


def fuzz(targets: list[str], runs: int, timeout: int, out: Path) -> list[dict[str, object]]:
    rows = []
    for target in targets:
        workdir = out / target
        workdir.mkdir(parents=True, exist_ok=True)
        started = time.monotonic()
        proc = subprocess.run(
            [
                sys.executable,
                __file__,
                "--child",
                target,
                "--runs",
                str(runs),
                "--timeout",
                str(timeout),
                "--out",
                str(workdir),
            ],
            capture_output=True,
            text=True,
            env={**os.environ, "HIVEMIND_LOGLEVEL": "ERROR"},
            timeout=max(600, runs // 20 + 600),
        )
        log = proc.stdout + proc.stderr
        (workdir / "log.txt").write_text(log)
        done = re.search(r"Done (\d+) runs in", log)
        execs = re.search(r"stat::number_of_executed_units:\s*(\d+)", log)
        inputs = int(done.group(1)) if done else int(execs.group(1)) if execs else 0
        hang = "ALARM: working on the last Unit" in log or "libFuzzer: timeout" in log
        crash = not hang and (proc.returncode != 0 or "Uncaught Python exception" in log)
        rows.append(
            {
                "target": target,
                "inputs": inputs,
                "seconds": time.monotonic() - started,
                "crashes": int(crash),
                "hangs": int(hang),
                "log": str(workdir / "log.txt"),
            }
        )
        print(
            f"  {target:<20} inputs={inputs:>7} seconds={rows[-1]['seconds']:>6.1f} crashes={int(crash)} "
            f"hangs={int(hang)}",
            file=sys.stderr,
            flush=True,
        )
        if crash or hang:
            tail = "\n".join(log.splitlines()[-25:])
            print(f"--- {target}: {workdir / 'log.txt'}\n{tail}", file=sys.stderr, flush=True)
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--runs", type=int, default=100_000, help="inputs per target")
    p.add_argument("--targets", default=",".join(TARGETS))
    p.add_argument("--timeout", type=int, default=10, help="seconds one input may take before it counts as a hang")
    p.add_argument("--out", type=Path, default=None, help="where logs, corpora and crashing inputs go")
    p.add_argument("--write-doc", type=Path, help="replace the fuzz block of this file (docs/RELIABILITY.md)")
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        run_target(args.child, args.runs, args.timeout, args.out)
        return
    targets = [t for t in args.targets.split(",") if t]
    unknown = set(targets) - set(TARGETS)
    if unknown:
        raise SystemExit(f"unknown targets {sorted(unknown)}; choose from {', '.join(TARGETS)}")
    out = args.out or Path(tempfile.mkdtemp(prefix="intellect-fuzz-"))
    print(f"fuzzing {len(targets)} targets, {args.runs} inputs each (logs under {out})", file=sys.stderr)
    rows = fuzz(targets, args.runs, args.timeout, out)
    lines = ["| target | inputs | seconds | crashes | hangs |", "|---|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['target']} | {r['inputs']} | {r['seconds']:.1f} | {r['crashes']} | {r['hangs']} |")
    total = sum(int(r["inputs"]) for r in rows)  # type: ignore[call-overload]
    crashes = sum(int(r["crashes"]) for r in rows)  # type: ignore[call-overload]
    hangs = sum(int(r["hangs"]) for r in rows)  # type: ignore[call-overload]
    lines += ["", f"fuzz targets={len(rows)} inputs={total} crashes={crashes} hangs={hangs}"]
    print("\n".join(lines), flush=True)
    if args.write_doc:
        from harness.docs import write_doc

        write_doc(args.write_doc, "\n".join(lines), "fuzz")
    sys.exit(1 if crashes or hangs else 0)


if __name__ == "__main__":
    main()
