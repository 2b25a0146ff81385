"""``intellect-node status`` (a node's state in the terminal) and ``intellect-node doctor`` (can this machine join?).

``status [URL]`` reads a node's ``/status`` (by default that of the node whose data dir is given, which writes its
URL to ``<data dir>/http.url`` when it starts) and prints it with rich when installed, as plain text otherwise.

``doctor`` checks, each with what to do when it fails: the data dir's disk, memory for the run's model, the GPU and
its driver, the generation backend, the clock against the trainer's, and, with ``--peers``/``--run-id``, whether
the p2p and HTTP ports it would use are reachable from outside (the trainer dials them back, as at join).
"""

from __future__ import annotations

import asyncio
import email.utils
import importlib.util
import json
import shutil
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

GB = 1e9


def read_status(url: str, timeout: float = 10.0) -> dict[str, Any]:
    with urllib.request.urlopen(url.rstrip("/") + "/status", timeout=timeout) as resp:
        data: dict[str, Any] = json.load(resp)
        return data


def status_url(data_dir: Path) -> str:
    path = data_dir / "http.url"
    try:
        return path.read_text().strip()
    except OSError:
        raise SystemExit(
            f"no node has started with --data-dir {data_dir} ({path} is missing): give the node's URL, "
            "e.g. intellect-node status http://127.0.0.1:8000"
        ) from None


def summary(s: dict[str, Any]) -> list[tuple[str, str]]:
    """The rows worth a glance, for any role."""
    state: dict[str, Any] = s["state"] if isinstance(s.get("state"), dict) else {}
    rows = [
        ("state", ("ok: " if state.get("ok", True) else "NOT WORKING: ") + str(state.get("doing", "?"))),
        ("role", str(s.get("role"))),
        ("node", str(s.get("node_id"))),
        ("run", f"{s.get('run_id')} epoch {s.get('epoch')}"),
        ("weights", f"version {s.get('weight_version')}"),
    ]
    reach = s.get("reachability") or {}
    if reach.get("checked"):
        rows.append(
            (
                "reachable",
                f"p2p {'yes' if reach['p2p'] else 'NO'}, http {'yes' if reach['http'] else 'NO'} "
                f"(seen from {reach['observed_ip']})",
            )
        )
    elif reach.get("detail"):
        rows.append(("reachable", f"not checked: {reach['detail']}"))
    relay = s.get("relay") or {}
    if relay.get("enabled"):
        rows.append(
            (
                "relay",
                f"home stripe {relay.get('home_stripe', 0)}, depth {relay['depth']}, parent "
                f"{relay['parent']}, {len(relay['children'])} children, {relay['slots_free']} slots "
                f"free, upload {relay.get('upload_mbps', 0)} Mbit/s measured",
            )
        )
    if s.get("role") == "trainer":
        hist = s.get("history") or []
        last = hist[-1] if hist else {}
        rows += [
            ("step", f"{s['step']}" + (f" of {s['max_steps']}" if s.get("max_steps") else "")),
            (
                "last step",
                f"reward {last.get('reward_mean', float('nan')):.3f}, accuracy "
                f"{last.get('accuracy', float('nan')):.3f}, {last.get('seconds', 0):.1f} s, staleness "
                f"{last.get('staleness_max', 0):.0f}"
                if last
                else "none yet",
            ),
            ("queue", f"{s['queue_groups']} groups queued, {s.get('judging', 0)} batches being judged"),
            (
                "validators",
                f"{len(s.get('validators_present', []))} present, {len(s['validators_missing'])} "
                f"missing; verdicts {s.get('verdicts_remote', 0)} from them, {s.get('verdicts_self', 0)} "
                "here",
            ),
            ("refused", ", ".join(f"{k} {v:g}" for k, v in s["rejected_batches_by_reason"].items()) or "none"),
            ("banned", f"{len(s['banned'])} nodes"),
        ]
    if s.get("role") == "inference":
        rows += [
            (
                "batches",
                f"{s['batches_sent']} sent, {s['batches_accepted']} accepted, "
                f"{s.get('unacknowledged', 0)} awaiting acknowledgement",
            ),
            ("refused", ", ".join(f"{k} {v}" for k, v in s["rejections"].items()) or "none"),
        ]
    if s.get("role") == "validator":
        rows.append(("judged", f"{s['judged']} batches, {s['refused']} requests refused"))
    if s.get("role") == "auditor":
        audits = s.get("audits", {})
        counts = audits.get("counts", {})
        rows.append(("audits", ", ".join(f"{k} {v}" for k, v in sorted(counts.items())) or "none yet"))
        if audits.get("last"):
            rows.append(("last audit", str(audits["last"].get("line", ""))))
    return rows


def print_rows(title: str, rows: list[tuple[str, str]]) -> None:
    try:
        from rich.console import Console
        from rich.table import Table
    except ImportError:
        width = max(len(k) for k, _ in rows)
        print(title)
        for k, v in rows:
            print(f"  {k:<{width}}  {v}")
        return
    table = Table(title=title, show_header=False)
    table.add_column(style="bold")
    table.add_column()
    for k, v in rows:
        table.add_row(k, v)
    Console().print(table)


def show_status(url: str) -> None:
    try:
        s = read_status(url)
    except (OSError, ValueError) as e:
        raise SystemExit(
            f"could not read {url}/status ({e}): is the node running, and is that its HTTP port?"
        ) from None
    print_rows(f"intellect-node at {url}", summary(s))
    state = s.get("state")
    if isinstance(state, dict) and state.get("ok") is False:
        raise SystemExit(1)  # not doing its job: the first row says why (scripts and health checks read the code)


@dataclass
class Check:
    name: str
    ok: bool
    found: str
    fix: str = ""


def _model_bytes(config: Path | None) -> tuple[str, float]:
    """The run's model and a working-memory estimate for one node (fp32 weights, twice over for activations)."""
    from intellect_node.config import load_run_config
    from intellect_node.policy.model import build_model, build_tokenizer

    run = load_run_config(config)
    tok = build_tokenizer(run.model)
    params = sum(p.numel() for p in build_model(run.model, tok).parameters())
    return run.model.name or run.model.kind, params * 4 * 2.0


def checks(data_dir: Path, config: Path | None, backend: str) -> list[Check]:
    import psutil

    out: list[Check] = []
    name, need = _model_bytes(config)
    avail = psutil.virtual_memory().available
    out.append(
        Check(
            "memory",
            avail >= need,
            f"{avail / GB:.1f} GB available, {name} needs ~{need / GB:.1f} GB",
            "close other programs, or join a run with a smaller model",
        )
    )
    data_dir.mkdir(parents=True, exist_ok=True)
    free = shutil.disk_usage(data_dir).free
    disk_need = need / 2 * 3  # the weights, kept for async_level + 1 versions
    out.append(
        Check(
            "disk",
            free >= disk_need,
            f"{free / GB:.1f} GB free under {data_dir}, ~{disk_need / GB:.1f} GB needed",
            "free space there, or give another --data-dir (--max-disk-gb caps it)",
        )
    )
    import torch

    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        driver = shutil.which("nvidia-smi") is not None
        out.append(
            Check(
                "gpu",
                True,
                f"{props.name}, {props.total_memory / GB:.0f} GB, CUDA {torch.version.cuda}"
                + ("" if driver else " (nvidia-smi not found)"),
            )
        )
    else:
        out.append(
            Check(
                "gpu",
                backend != "vllm",
                "none (CUDA not available to torch): inference runs on the CPU",
                "install the NVIDIA driver and a CUDA build of torch to use a GPU",
            )
        )
    if backend == "vllm":
        has = importlib.util.find_spec("vllm") is not None
        out.append(
            Check(
                "backend",
                has,
                "vllm installed" if has else "vllm is not installed",
                "pip install -e '.[vllm]' (GPU) or see docs/inference.md (CPU)",
            )
        )
    else:
        out.append(Check("backend", True, "transformers"))
    return out


def clock_check(url: str) -> Check:
    """The trainer's clock, from its HTTP Date header (1 s resolution; the DHT refuses peers a few seconds off)."""
    try:
        with urllib.request.urlopen(url.rstrip("/") + "/health", timeout=10) as resp:
            sent = email.utils.parsedate_to_datetime(resp.headers["Date"]).timestamp()
    except (OSError, ValueError, TypeError) as e:
        return Check("clock", False, f"could not read the trainer's clock at {url}: {e}", "check --peers")
    offset = time.time() - sent
    return Check(
        "clock",
        abs(offset) < 3.0,
        f"{offset:+.1f} s from the trainer's",
        "turn on time sync (timedatectl set-ntp true, or install chrony)",
    )


async def reach_check(
    peers: list[str], run_id: str, host: str, p2p_port: int, http_port: int, data_dir: Path
) -> list[Check]:
    """Listen on the ports a node would use and have the trainer dial them back, as at join."""
    from intellect_node.p2p.dht import Membership
    from intellect_node.p2p.http import HttpServer
    from intellect_node.p2p.keys import load_or_create
    from intellect_node.p2p.metrics import Metrics
    from intellect_node.p2p.reach import ask_dialback
    from intellect_node.p2p.transport import DELIVERY_ERRORS
    from intellect_protocol.envelope import Rejected

    identity = load_or_create(data_dir / "node.key")
    membership = Membership(identity, run_id, Metrics())
    http = HttpServer(Metrics(), lambda: {}, [])
    try:
        try:
            maddrs = await membership.start(host, p2p_port, peers)
        except SystemExit as e:  # no peer answered, a port taken: a failed check, not the end of the others
            return [Check("run", False, str(e.code), "start the trainer first, or check --peers and the ports")]
        port = await http.start(host, http_port)
        trainer = None
        for _ in range(40):
            trainer = await membership.get_trainer()
            if trainer is not None:
                break
            await asyncio.sleep(0.25)
        if trainer is None or not trainer.p2p_maddrs:
            return [Check("run", False, f"no trainer record for run {run_id}", "check --run-id and --peers")]
        out = []
        if trainer.http_url:
            out.append(clock_check(trainer.http_url))
        try:
            r = await ask_dialback(
                await membership.replicate_p2p(),
                identity,
                run_id,
                trainer.p2p_maddrs[0].rsplit("/p2p/", 1)[-1],
                maddrs,
                port,
            )
        except (*DELIVERY_ERRORS, Rejected) as e:
            return [
                *out,
                Check(
                    "reachability",
                    False,
                    f"the trainer did not check the ports: {type(e).__name__}: {e}",
                    "run doctor again in a minute (the trainer refuses checks while busy)",
                ),
            ]
        fix = (
            f"forward TCP ports {maddrs[0].split('/tcp/')[1].split('/')[0]} and {port} of your router to this "
            f"machine, then join with --host 0.0.0.0 --announce {r.observed_ip} and those --p2p-port/--http-port;"
            " without it the node still produces rollouts, but relays no weights"
        )
        out.append(
            Check(
                "p2p port",
                r.p2p_ok,
                f"reachable from outside: {'yes' if r.p2p_ok else 'no'} (seen from {r.observed_ip})",
                fix,
            )
        )
        out.append(Check("http port", r.http_ok, f"reachable from outside: {'yes' if r.http_ok else 'no'}", fix))
        return out
    finally:
        await http.close()
        await membership.close()


def run_doctor(
    data_dir: Path,
    config: Path | None,
    backend: str,
    peers: list[str],
    run_id: str | None,
    host: str,
    p2p_port: int,
    http_port: int,
) -> int:
    results = checks(data_dir, config, backend)
    if peers and run_id:
        results += asyncio.run(reach_check(peers, run_id, host, p2p_port, http_port, data_dir))
    else:
        results.append(Check("reachability", True, "not checked: give --peers and --run-id of the run to join"))
    rows = [
        (c.name, ("ok   " if c.ok else "FAIL ") + c.found + ("" if c.ok or not c.fix else f"; fix: {c.fix}"))
        for c in results
    ]
    print_rows("intellect-node doctor", rows)
    return 0 if all(c.ok for c in results) else 1
