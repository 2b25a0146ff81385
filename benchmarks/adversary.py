"""Red team: a real swarm, and one attacker at a time trying to take over, freeze or poison it.

    sudo python benchmarks/adversary.py [--window 60] [--attacks sybil_flood,submission_flood] [--netns off]

The swarm: a trainer (tiny model, async level 16 so that cheaters' batches reach the validator rather than going
stale; no online filter and a learning rate that leaves the policy where it starts, so that a step's work stays the
same without an attack), a validator it trusts, two honest inference nodes and a relay, as separate processes in a
network namespace of their own; the attacker in another, across a veth (as root; ``--netns off``: on loopback, from
127.0.0.2). Its training rate (trainer steps per second) is measured in a window without attack, then during each
attack, each followed by another attack-free window (an attack's share is against the mean of the attack-free
windows on either side of it: on two shared cores the attack-free rate drifts by a fifth over a run); the attacker
is this process, with real keys, a real hivemind DHT peer, libp2p streams and HTTP, playing each class of attack the
project's review found, the cheating producers benchmarks/toploc_detect.py knows, a sybil flood and a submission
flood, and the classes of the second review (docs/threat-model.md): DHT answers that never expire, invite redemption
floods, squatted origin slots and stripe roots, a jailed program filling /dev/shm, announcement floods, digest
echoes, strangers' signed slot requests, acknowledgements on demand, dial-backs to silent ports and auditors'
downloads. For each:
whether the attack achieved its aim (key read, bad data accepted, duplicate trained, node crashed, swarm frozen,
...), the honest training rate during it as a share of the attack-free rate, and what it cost: the CPU seconds the
swarm's processes spent beyond what their honest steps explain (at the CPU per step of the attack-free windows
around it), per CPU second of the attacker's own processes (the attacker runs at the lowest priority on the same two
cores, but while it prepares an attack). A node of the swarm that crashed, or an honest node the trainer banned, is
a failure of its own. A table, then one line:

    adversary attacks=N held=N bad_accepted=0 crashes=0 honest_rate_min=0.xx
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import math
import os
import resource
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable, Collection
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import psutil
import torch
from aiohttp import web
from hivemind.dht import DHT
from hivemind.dht.protocol import DHTProtocol
from hivemind.dht.storage import DictionaryDHTValue
from hivemind.p2p import P2P, P2PContext, PeerID
from hivemind.proto import dht_pb2
from hivemind.utils import get_dht_time
from hivemind.utils.serializer import MSGPackSerializer

from intellect_kernels.toploc import proof_bytes
from intellect_node.config import load_run_config
from intellect_node.judging.validator import expected_proofs
from intellect_node.judging.verifiers import run_code_tests
from intellect_node.launch import NodeProcess
from intellect_node.p2p.batches import batch_protocol
from intellect_node.p2p.dht import Membership
from intellect_node.p2p.gossip import Gossip
from intellect_node.p2p.metrics import Metrics
from intellect_node.p2p.reach import ask_dialback
from intellect_node.p2p.transport import DELIVERY_ERRORS, MAX_READING, submit, submit_protocol
from intellect_node.policy.model import build_model, build_tokenizer, encode_prompt, load_weights
from intellect_node.roles.credit import get_bounded
from intellect_node.roles.inference import generate_batch
from intellect_node.roles.invites import call_redeem
from intellect_node.roles.trainer_audit import PER_KEY_PER_HOUR
from intellect_node.weights.auth import signed_headers
from intellect_node.weights.files import load_checkpoint, verify_manifest
from intellect_node.weights.stripes import DEFAULT_STRIPES
from intellect_protocol.envelope import Rejected, open_signed, seal
from intellect_protocol.identity import Identity
from intellect_protocol.messages import (
    BatchAck,
    BatchAnnounce,
    Invite,
    NodeRecord,
    RelayInfo,
    RolloutBatch,
    RolloutGroup,
    RunSpec,
    SubmitReply,
)
from intellect_protocol.records import CLOCK_SKEW_S, NODE_TTL_S, nodes_key
from intellect_protocol.tasks import assigned_task

from harness import netns

ATTACKER_IP = "127.0.0.2"
"""The attacker's own address: every connection it makes comes from here, as from another machine (limits that
count the remote address meet the attacker, not the honest nodes). In its own network namespace (the default as
root, ``Namespaces``) it is 10.78.0.2, across a veth from the swarm's namespace; otherwise 127.0.0.2 on loopback."""
SWARM_HOST = "127.0.0.1"
"""The address every node of the swarm listens on and announces (10.78.0.1 in the swarm's namespace)."""
SWARM_PREFIX: list[str] = []
"""What the swarm's node processes are started under (``netns_prefix(<the swarm's namespace>)``)."""


def set_priority(nice: int, exclude: Collection[int] = ()) -> None:
    """This process and every process it started (but those in ``exclude``: the swarm's), each of their threads (a
    nice value is a thread's on Linux, and a new thread takes its creator's), and their sessions' scheduling groups,
    at ``nice``. The groups matter: with the kernel's autogroups (sched_autogroup_enabled) a nice value counts only
    within a session, and every node runs in a session of its own, so a niced attacker's daemons took a session's
    full share from the swarm (a dial-back flood's fresh libp2p daemons: ~7 CPU-s of 30 s)."""
    me = psutil.Process()
    try:
        procs = [me, *(p for p in me.children(recursive=True) if p.pid not in exclude)]
    except psutil.Error:
        procs = [me]
    for proc in procs:
        try:
            for thread in proc.threads():
                os.setpriority(os.PRIO_PROCESS, thread.id, nice)
        except (psutil.Error, OSError):  # ended meanwhile
            pass
        try:
            Path(f"/proc/{proc.pid}/autogroup").write_text(str(nice))
        except OSError:  # no autogroups: the nice values above are enough
            pass


def _tree(pid: int) -> list[psutil.Process]:
    try:
        root = psutil.Process(pid)
        return [root, *root.children(recursive=True)]
    except psutil.Error:
        return []


def netns_prefix(ns: str) -> list[str]:
    """Run a command in the network namespace ``ns`` and nothing else: ``ip netns exec`` would also mount a sysfs
    of its own over /sys, and with it the cgroups the jail needs would be gone."""
    return ["nsenter", f"--net=/var/run/netns/{ns}"]


class Namespaces:
    """Two network namespaces joined by a veth pair: the swarm's (10.78.0.1) and the attacker's (10.78.0.2), the
    position of an attacker on another machine. Made by the outer process, which runs the benchmark inside the
    attacker's namespace and removes both (and whatever still runs in them) when it ends, also on failure."""

    def __init__(self) -> None:
        tag = f"inadv{os.getpid() % 100000}"
        self.swarm, self.attacker = f"{tag}s", f"{tag}a"
        self.made: list[str] = []

    def __enter__(self) -> Namespaces:
        try:
            for ns in (self.swarm, self.attacker):
                netns.run("ip", "netns", "add", ns)
                self.made.append(ns)
                netns.run("ip", "-n", ns, "link", "set", "lo", "up")
            veth_s, veth_a = f"{self.swarm}v", f"{self.attacker}v"
            netns.run("ip", "link", "add", veth_s, "type", "veth", "peer", "name", veth_a)
            for ns, dev, ip in ((self.swarm, veth_s, "10.78.0.1"), (self.attacker, veth_a, "10.78.0.2")):
                netns.run("ip", "link", "set", dev, "netns", ns)
                netns.run("ip", "-n", ns, "addr", "add", f"{ip}/24", "dev", dev)
                netns.run("ip", "-n", ns, "link", "set", dev, "up")
        except BaseException:
            self.__exit__()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        for ns in self.made:
            pids = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True).stdout.split()
            for pid in pids:
                try:
                    os.kill(int(pid), 9)
                except (OSError, ValueError):
                    pass
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
        self.made.clear()


def attacker_session() -> aiohttp.ClientSession:
    return aiohttp.ClientSession(connector=aiohttp.TCPConnector(local_addr=(ATTACKER_IP, 0)))


SETTINGS = [
    "--set",
    "train.async_level=16",
    "--set",
    "train.online_filter=false",
    "--set",
    "train.lr=1e-9",
]
"""What the benchmark measures is the swarm's work under attack, so the work must stay the same without one. Async
level 16: cheaters' batches reach the validator instead of going stale on the way. No online filter: with it the
tiny run starves itself after ~150 steps (its groups turn all-equal). A learning rate that leaves the policy where
it starts (every step still computes, publishes and is judged): a policy that learns changes the length of its
completions, and with them the cost of a step (the attack-free rate fell from 4.3 to 3.0 steps/s within two
minutes of a run with lr 1e-3)."""


@dataclass
class Outcome:
    name: str
    aim: str
    achieved: bool
    detail: str
    bad_accepted: int = 0
    rate: float = 0.0
    control: float = 0.0
    """The attack-free rate around it (steps/s): the mean of the windows just before and just after."""
    swarm_cpu: float = 0.0
    """CPU seconds the swarm's processes (nodes, their DHT processes and daemons) used during the attack."""
    attacker_cpu: float = 0.0
    """CPU seconds the attacker (this process and the peers, daemons, servers and jailed programs it started, those
    that ended included) used."""
    extra_cpu: float = 0.0
    """The CPU seconds our nodes spent on the attack: per node, its use during the attack beyond both what its pace
    in time and what its pace per training step in the attack-free windows around it explain (CPU-s per second
    times the window; CPU-s per step times the steps made), summed over the nodes that used more (a node starved
    meanwhile does not offset one that did the attack's work). Both, because inference nodes generate at their own
    pace whatever the trainer's rate (per step alone, 42 refused requests showed 6 CPU-s spread over nodes they
    never reached while the trainer slowed) and the trainer's work follows its steps (per second alone, a window
    with more steps showed 3.8 CPU-s of the trainer's for 26 refused requests). Per-node noise of a 30 s window
    puts ~1 CPU-s here without any attack."""
    steps: int = 0
    """Training steps made during the window."""
    seconds: float = 0.0
    """The window's length (an attack may run past its end)."""
    by_node: dict[str, float] = field(default_factory=dict)
    """``swarm_cpu`` by node (each with its DHT process and daemons); after the attack-free windows around it are
    known, each node's use beyond its attack-free pace."""

    @property
    def cost_ratio(self) -> float:
        """Work the attack cost us per unit of the attacker's own (extra CPU-s per attacker CPU-s)."""
        return self.extra_cpu / max(self.attacker_cpu, 0.05)


class Swarm:
    def __init__(self, root: Path) -> None:
        self.root = root
        self.logs = root / "logs"
        self.nodes: dict[str, NodeProcess] = {}
        self.ready: dict[str, dict[str, Any]] = {}
        self.up_at: dict[str, float] = {}
        """When each node printed its readiness line (monotonic)."""
        self.client: DHT | None = None
        self.published: tuple[float, int] = (-math.inf, -1)
        """When ``published`` last read the trainer's newest version, and what it read."""
        self.run = load_run_config(None, SETTINGS[1::2])
        self.tok = build_tokenizer(self.run.model)

    def start(self, name: str, argv: list[str]) -> dict[str, Any]:
        node = NodeProcess(name, [*argv, "--host", SWARM_HOST], self.logs, prefix=SWARM_PREFIX)
        self.nodes[name] = node
        self.ready[name] = node.wait_ready(timeout=120)
        self.up_at[name] = time.monotonic()
        return self.ready[name]

    def leave(self, name: str) -> None:
        """Stop the newcomer ``name`` once its attack is judged: each attack meets the swarm the run started with
        (three relays that joined and stayed took ~20% of a core from every later window, and the attack-free
        rate fell from 4.0 to 2.1 steps/s over one run)."""
        self.nodes[name].stop()

    def join(self, name: str, role: str) -> dict[str, Any]:
        t = self.ready["trainer"]
        return self.start(
            name,
            [
                "join",
                "--role",
                role,
                "--peers",
                t["p2p_maddrs"][0],
                "--run-id",
                t["run_id"],
                "--data-dir",
                str(self.root / name),
            ],
        )

    @property
    def run_id(self) -> str:
        return str(self.ready["trainer"]["run_id"])

    @property
    def trainer_url(self) -> str:
        return str(self.ready["trainer"]["status_url"])

    @property
    def trainer_peer(self) -> str:
        return str(self.ready["trainer"]["p2p_maddrs"][0]).rsplit("/p2p/", 1)[1]

    @property
    def epoch(self) -> int:
        """The run epoch the trainer started (batches of another one are refused as wrong_epoch)."""
        if not hasattr(self, "_epoch"):
            self._epoch = int(self.status()["epoch"])
        return self._epoch

    def status(self, name: str = "trainer") -> dict[str, Any]:
        # waits out a 429: in its own namespace the harness asks from the attacker's address, whose share of the
        # public routes' rate an attack may have used (node/p2p/http.py)
        data: dict[str, Any] = json.loads(get_bounded(self.ready[name]["status_url"] + "/status"))
        return data

    def processes(self) -> tuple[dict[int, psutil.Process], set[int]]:
        """The swarm's processes (each node with its DHT process and daemons), and the pids of the nodes that
        joined during an attack (honest newcomers: their start is not work an attack made)."""
        swarm_procs: dict[int, psutil.Process] = {}
        joined: set[int] = set()
        for name, node in self.nodes.items():
            procs = _tree(node.proc.pid)
            if name.startswith("newcomer"):
                joined.update(p.pid for p in procs)
            else:
                swarm_procs.update((p.pid, p) for p in procs)
        return swarm_procs, joined

    def cpu(self) -> tuple[float, float, dict[str, float]]:
        """CPU seconds used so far by the swarm's processes (not the nodes that join during an attack) and by the
        attacker (this process and the peers, daemons, servers and programs it started, the ended ones included
        once reaped). A swarm process that ended is not counted."""

        def used(procs: list[psutil.Process]) -> float:
            total = 0.0
            for proc in procs:
                try:
                    t = proc.cpu_times()
                    total += t.user + t.system
                except psutil.Error:
                    pass
            return total

        swarm_procs, joined = self.processes()
        attacker = [p for p in _tree(os.getpid()) if p.pid not in swarm_procs and p.pid not in joined]
        # and the attacker's children that ended (its fresh peers' daemons, jailed programs): reaped, so counted here
        ended = resource.getrusage(resource.RUSAGE_CHILDREN)
        by_node = {  # a node whose process ended is left out (it is missing from the window, not idle in it)
            name: used(_tree(node.proc.pid))
            for name, node in self.nodes.items()
            if not name.startswith("newcomer") and node.proc.poll() is None
        }
        return used(list(swarm_procs.values())), used(attacker) + ended.ru_utime + ended.ru_stime, by_node

    def attacker_priority(self, nice: int) -> None:
        """The attacker's processes (not the swarm's, nor the newcomers') at ``nice``."""
        swarm_procs, joined = self.processes()
        set_priority(nice, exclude=set(swarm_procs) | joined)

    def crashed(self) -> list[str]:
        return [name for name, node in self.nodes.items() if node.proc.poll() is not None]

    def register(self, identity: Identity, role: str = "inference", **fields: Any) -> None:
        assert self.client is not None
        record = NodeRecord(run_id=self.run_id, node_id=identity.node_id, role=role, updated=time.time(), **fields)
        self.client.store(
            nodes_key(self.run_id), seal(identity, record), get_dht_time() + NODE_TTL_S, subkey=identity.node_id
        )

    def fake_batch(self, identity: Identity, version: int, index: int) -> RolloutBatch:
        """Well-formed, the node's assigned tasks with the right answers, made-up proofs: passes the door."""
        run, eos = self.run, int(self.tok.eos_token_id)
        groups = []
        for slot in range(run.task.tasks_per_batch):
            task = assigned_task(run.seed, identity.node_id, version, index, slot, run.task.max_operand)
            answer = list(self.tok.encode(task.answer, add_special_tokens=False)) + [eos]
            proofs = [bytes(proof_bytes(run.verify.topk))] * expected_proofs(len(answer), run.verify.decode_batch)
            groups.append(
                RolloutGroup(
                    slot=slot,
                    prompt_ids=encode_prompt(self.tok, task.prompt),
                    completions=[answer] * run.sampling.group_size,
                    logprobs=[[-0.1] * len(answer)] * run.sampling.group_size,
                    proofs=[proofs] * run.sampling.group_size,
                )
            )
        return RolloutBatch(
            run_id=self.run_id,
            node_id=identity.node_id,
            version=version,
            batch_index=index,
            epoch=self.epoch,
            groups=groups,
        )

    def close(self) -> None:
        if self.client is not None:
            self.client.shutdown()
        for node in reversed(list(self.nodes.values())):
            node.stop()


def steps(swarm: Swarm) -> int:
    return int(swarm.status()["step"])


PUBLISHED_TTL_S = 0.5
"""How long a read of the newest version serves the floods (async level 16: a batch half a second behind is still
fresh): read at each batch they asked /status faster than the public routes' rate allows, and the harness's waits
on 429 would have slowed the flood itself."""


def published(swarm: Swarm) -> int:
    """The newest version the trainer has published (a batch of a newer one is refused as from the future)."""
    if time.monotonic() - swarm.published[0] > PUBLISHED_TTL_S:
        swarm.published = (time.monotonic(), int(swarm.status()["weight_version"]))
    return swarm.published[1]


async def measure(
    swarm: Swarm,
    window: float,
    attack: Callable[[float], Awaitable[Outcome]],
    prepare: Callable[[], Awaitable[None]] | None = None,
) -> Outcome:
    """Run ``attack`` for ``window`` seconds while counting the trainer's steps (after ``prepare``, not counted and
    at normal priority: making keys, registering them, starting peers and generating batches is the attacker's own
    time; what it starts there plays at the lowest priority in the window)."""
    if prepare is not None:
        swarm.attacker_priority(0)
        try:
            await prepare()
        finally:
            swarm.attacker_priority(19)
    before = await asyncio.to_thread(steps, swarm)
    cpu_before = swarm.cpu()
    started = time.monotonic()
    outcome = await attack(started + window)
    left = started + window - time.monotonic()
    if left > 0:
        await asyncio.sleep(left)
    cpu_after = swarm.cpu()
    outcome.swarm_cpu = cpu_after[0] - cpu_before[0]
    outcome.attacker_cpu = max(0.0, cpu_after[1] - cpu_before[1])
    # a node started within the window used all its CPU-s in it; one that ended is missing from it (``charge``)
    outcome.by_node = {n: cpu_after[2][n] - cpu_before[2].get(n, 0.0) for n in cpu_after[2]}
    outcome.steps = await asyncio.to_thread(steps, swarm) - before
    outcome.seconds = time.monotonic() - started
    outcome.rate = outcome.steps / outcome.seconds
    return outcome


def charge(outcome: Outcome, before_it: Outcome, after: Outcome) -> Outcome:
    """Set ``outcome``'s ``by_node`` (from the CPU-s each node used) and ``extra_cpu`` against the attack-free
    windows ``before_it`` and ``after`` (``Outcome.extra_cpu``)."""
    by_node = {}
    for n, used in outcome.by_node.items():
        around = [w for w in (before_it, after) if n in w.by_node]  # a node absent from one is paced by the other
        if not around:  # in neither: all it used is the attack's
            by_node[n] = used
            continue
        calm = sum(w.by_node[n] for w in around)  # its CPU-s in the windows it was in
        by_time = used - calm / max(sum(w.seconds for w in around), 1e-9) * outcome.seconds
        calm_steps = sum(w.steps for w in around)
        # without a step around it there is no pace per step: the pace in time alone
        by_steps = used - calm / calm_steps * outcome.steps if calm_steps else by_time
        by_node[n] = min(by_time, by_steps)
    outcome.by_node = by_node
    outcome.extra_cpu = sum(max(0.0, x) for x in by_node.values())
    return outcome


async def idle(swarm: Swarm, until: float) -> Outcome:
    await asyncio.sleep(max(0.0, until - time.monotonic()))
    return Outcome("none", "", False, "")


# ---- the attacks --------------------------------------------------------------------------------------------


async def key_theft(swarm: Swarm, until: float) -> Outcome:
    """A code reward's program copies the trainer's key into a published version folder, then asks for it."""
    data = swarm.root / "trainer"
    version = sorted(int(p.name) for p in (data / "weights" / swarm.run_id).iterdir() if p.name.isdigit())[-1]
    target = data / "weights" / swarm.run_id / str(version) / "k"
    program = f"import shutil\nshutil.copy({str(data / 'node.key')!r}, {str(target)!r})\nprint('copied')\n"
    copied = await asyncio.to_thread(run_code_tests, program, (("", "copied"),), 10.0, 256) > 0
    async with attacker_session() as session:
        async with session.get(f"{swarm.trainer_url}/weights/{version}/node.key") as r1:
            served = r1.status == 200
    achieved = copied or target.exists() or served
    return Outcome(
        "code reward steals the run key",
        "key read",
        achieved,
        f"copy {'ran' if copied else 'failed in the jail'}, GET key {'200' if served else 'refused'}",
    )


async def dht_poison(swarm: Swarm, until: float) -> Outcome:
    """A record that passes store-time checks and turns stale while kept: it used to hide every node's record."""
    attacker = Identity.generate()
    now = time.time()
    edge = now - NODE_TTL_S - CLOCK_SKEW_S + 2.0
    record = NodeRecord(run_id=swarm.run_id, node_id=attacker.node_id, role="inference", updated=edge)
    assert swarm.client is not None
    stored = swarm.client.store(
        nodes_key(swarm.run_id), seal(attacker, record), now + NODE_TTL_S + CLOCK_SKEW_S, subkey=attacker.node_id
    )
    before = {n: swarm.status(n)["rejections"].get("unknown_signer", 0) for n in ("honest-0", "honest-1")}
    await asyncio.sleep(max(0.0, until - time.monotonic()))
    after = {n: swarm.status(n)["rejections"].get("unknown_signer", 0) for n in ("honest-0", "honest-1")}
    refused = sum(after.values()) - sum(before.values())
    return Outcome(
        "one DHT record poisons the nodes key",
        "swarm frozen",
        bool(stored) or refused > 0,
        f"store {'accepted' if stored else 'refused'}; honest batches refused as unknown: {refused}",
    )


async def relay_squat(swarm: Swarm, until: float) -> Outcome:
    """Made-up node ids fill the origin's slots, strangers' DELETEs evict the real child, 503s leak children."""
    relay_id = swarm.ready["relay"]["node_id"]
    granted = leaked = sent = 0
    async with attacker_session() as session:
        while time.monotonic() < until:
            stranger = Identity.generate()
            for method, headers in (
                ("POST", {"X-Intellect-Node": stranger.node_id}),
                ("POST", signed_headers(stranger, "POST", "/relay/attach", swarm.run_id)),
                ("DELETE", {"X-Intellect-Node": relay_id}),
                (
                    "DELETE",
                    {**signed_headers(stranger, "DELETE", "/relay/attach", swarm.run_id), "X-Intellect-Node": relay_id},
                ),
            ):
                async with session.request(method, f"{swarm.trainer_url}/relay/attach", headers=headers) as r:
                    body = await r.text()
                    sent += 1
                    granted += r.status in (200, 204) and method == "POST"
                    leaked += relay_id in body
            await asyncio.sleep(0.02)
    return Outcome(
        "relay slots taken by made-up ids",
        "swarm frozen",
        granted > 0 or leaked > 0,
        f"{sent} requests: {granted} slots granted, {leaked} answers naming a child",
    )


PEER_START_S = 90.0
"""How long the attacker's libp2p daemon may take to start (hivemind's default is 15 s; at the lowest priority on
two busy cores a start can take longer, and a start that fails ends the run)."""


async def fresh_peer(swarm: Swarm) -> P2P:
    """A libp2p peer of the attacker's own for one attack (peer ids cost it nothing; a penalty earned by one
    attack must not hide the next)."""
    maddrs = swarm.ready["trainer"]["p2p_maddrs"][:1]
    return await P2P.create(
        initial_peers=maddrs, host_maddrs=[f"/ip4/{ATTACKER_IP}/tcp/0"], startup_timeout=PEER_START_S
    )


async def warm_up(swarm: Swarm, key: Identity) -> None:
    """Register ``key`` and have the trainer look it up (an out-of-order batch it refuses), so what follows meets
    a trainer that knows the key."""
    swarm.register(key)
    assert swarm.client is not None
    p2p = await fresh_peer(swarm)
    try:
        for _ in range(40):
            early = seal(key, swarm.fake_batch(key, published(swarm), 9))
            reply = await submit(p2p, swarm.trainer_peer, swarm.run_id, early, swarm.run_id)
            if reply.reason != "unknown_signer":
                return
            await asyncio.sleep(0.5)
    finally:
        await p2p.shutdown()


DUPLICATE_SENDER = Identity.generate()


async def duplicate_streams(swarm: Swarm, until: float) -> Outcome:
    """One signed batch on 16 streams at once, from 8 libp2p peers."""
    sender = DUPLICATE_SENDER
    peers = [await fresh_peer(swarm) for _ in range(8)]
    data = seal(sender, swarm.fake_batch(sender, published(swarm), 0))  # the newest version, once the peers are up
    try:
        answers = await asyncio.gather(
            *(submit(p, swarm.trainer_peer, swarm.run_id, data, swarm.run_id) for p in peers for _ in range(2)),
            return_exceptions=True,
        )
    finally:
        for p in peers:
            await p.shutdown()
    oks = sum(isinstance(a, SubmitReply) and a.ok for a in answers)
    reasons = sorted({a.reason for a in answers if isinstance(a, SubmitReply) and not a.ok})
    return Outcome(
        "one batch on 16 streams at once",
        "duplicate trained",
        oks > 1,
        f"{oks} of 16 copies admitted; the others: {reasons}",
    )


async def stalled_streams(swarm: Swarm, until: float) -> Outcome:
    """Submit streams held open without a byte, reopened as the trainer cuts them, from 4 peers."""
    peers = [await fresh_peer(swarm) for _ in range(4)]
    opened = 0
    held: list[Any] = []
    try:
        while time.monotonic() < until:
            for p in peers:
                try:
                    held.append(
                        await p.call_binary_stream_handler(
                            PeerID.from_base58(swarm.trainer_peer), submit_protocol(swarm.run_id)
                        )
                    )
                    opened += 1
                except Exception:
                    pass
            held = held[-64:]
            await asyncio.sleep(0.5)
    finally:
        for _, _, writer in held:
            writer.close()
        for p in peers:
            await p.shutdown()
    return Outcome("stalled submit streams", "swarm frozen", False, f"{opened} streams opened and left silent")


async def envelope_bomb(swarm: Swarm, until: float) -> Outcome:
    """4 MiB frames of nested empty maps (~300 MB and 0.4 s on the event loop each, when decoded whole)."""
    bomb = b"\xdd" + (4 << 20).to_bytes(4, "big") + b"\x80" * (4 << 20)
    assert swarm.client is not None
    p2p = await fresh_peer(swarm)
    sent = 0
    try:
        while time.monotonic() < until:
            try:
                await asyncio.wait_for(submit(p2p, swarm.trainer_peer, swarm.run_id, bomb, swarm.run_id), 30)
            except Exception:
                pass
            sent += 1
    finally:
        await p2p.shutdown()
    rss = _rss_mb(swarm.nodes["trainer"].proc.pid)
    return Outcome(
        "nested-map envelope bombs",
        "node crashed",
        "trainer" in swarm.crashed(),
        f"{sent} frames of 4 MiB; trainer RSS {rss:.0f} MB after",
    )


SYBILS = [Identity.generate() for _ in range(200)]


async def register_all(swarm: Swarm, keys: list[Identity]) -> None:
    for key in keys:
        await asyncio.to_thread(swarm.register, key)


async def sybil_flood(swarm: Swarm, until: float, keys: int = 200) -> Outcome:
    """Hundreds of fresh keys, each registered and sending a batch that passes the door (made-up proofs)."""
    sybils = SYBILS[:keys]
    assert swarm.client is not None
    p2p = await fresh_peer(swarm)
    replies: list[str] = []
    try:

        async def one(s: Identity) -> None:
            try:
                reply = await submit(
                    p2p,
                    swarm.trainer_peer,
                    swarm.run_id,
                    seal(s, swarm.fake_batch(s, published(swarm), 0)),
                    swarm.run_id,
                )
                replies.append("ok" if reply.ok else reply.reason)
            except DELIVERY_ERRORS:
                replies.append("network")

        for start in range(0, keys, 20):
            if time.monotonic() > until:
                break
            await asyncio.gather(*(one(s) for s in sybils[start : start + 20]))
    finally:
        await p2p.shutdown()
    await asyncio.sleep(max(0.0, until - time.monotonic()))
    accepted = swarm.status()["accepted_groups_by_node"]
    bad = sum(accepted.get(s.node_id, 0) for s in sybils)
    counts = {r: replies.count(r) for r in sorted(set(replies))}
    return Outcome(f"sybil flood ({keys} fresh keys)", "bad data accepted", bad > 0, f"replies {counts}", bad)


FLOODER = Identity.generate()


async def submission_flood(swarm: Swarm, until: float) -> Outcome:
    """One registered key sending batches as fast as it can, the next index each time."""
    flooder = FLOODER
    assert swarm.client is not None
    p2p = await fresh_peer(swarm)
    index = sent = 0
    reasons: dict[str, int] = {}
    try:
        while time.monotonic() < until:
            try:
                reply = await submit(
                    p2p,
                    swarm.trainer_peer,
                    swarm.run_id,
                    seal(flooder, swarm.fake_batch(flooder, published(swarm), index)),
                    swarm.run_id,
                )
            except DELIVERY_ERRORS:
                continue
            sent += 1
            index += reply.ok
            reasons[reply.reason or "ok"] = reasons.get(reply.reason or "ok", 0) + 1
    finally:
        await p2p.shutdown()
    bad = swarm.status()["accepted_groups_by_node"].get(flooder.node_id, 0)
    return Outcome("submission flood (one key)", "bad data accepted", bad > 0, f"{sent} sent: {reasons}", bad)


CHEATS = ("greedy", "temperature 0.7", "perturbed weights", "edited token", "made-up proofs")
CHEATERS = {name: Identity.generate() for name in CHEATS}


class Cheaters:
    """toploc_detect's cheating producers, each a registered key generating on the newest weights just before it
    sends. ``prepare`` registers the keys and starts the attacker's peer; the attack runs at normal priority: it is
    bad data, not load (five batches), and at the lowest priority on two busy cores the attacker took ~20 s to make
    and deliver them, by when they were stale. A cheat that happens to draw the honest tokens is honest data, and
    not sent."""

    def __init__(self, swarm: Swarm) -> None:
        self.swarm = swarm
        self.p2p: P2P | None = None

    async def prepare(self) -> None:
        await register_all(self.swarm, list(CHEATERS.values()))
        self.p2p = await fresh_peer(self.swarm)

    def _generate(self, name: str) -> RolloutBatch | None:
        """The cheat ``name`` on the newest version, or None when it drew the honest tokens."""
        swarm, key = self.swarm, CHEATERS[name]
        spec = RunSpec.model_validate({**swarm.run.spec(swarm.run_id).model_dump(), "epoch": swarm.epoch})
        model = build_model(swarm.run.model, swarm.tok)
        version = swarm.status()["weight_version"]
        folder = swarm.root / "trainer" / "weights" / swarm.run_id / str(version)
        manifest = verify_manifest((folder / "manifest.msgpack").read_bytes(), swarm.run_id, version)
        load_weights(model, load_checkpoint(folder, manifest))
        honest = generate_batch(spec, model, swarm.tok, key.node_id, version, 0)
        if name == "greedy":
            batch = generate_batch(spec, model, swarm.tok, key.node_id, version, 0, greedy=True)
        elif name == "temperature 0.7":
            batch = generate_batch(spec, model, swarm.tok, key.node_id, version, 0, draw_temperature=0.7)
        elif name == "perturbed weights":
            with torch.no_grad():
                for p in model.parameters():
                    p.mul_(1 + 0.01 * torch.randn_like(p))
            batch = generate_batch(spec, model, swarm.tok, key.node_id, version, 0)
        elif name == "edited token":
            batch = _edited(honest)
        else:
            return swarm.fake_batch(key, version, 0)
        same = [g.completions for g in batch.groups] == [g.completions for g in honest.groups]
        return None if same else batch

    async def attack(self, until: float) -> Outcome:
        swarm, p2p = self.swarm, self.p2p
        assert p2p is not None
        sent: list[Identity] = []
        replies: dict[str, str] = {}
        swarm.attacker_priority(0)
        try:
            for name in CHEATS:
                key = CHEATERS[name]
                batch = await asyncio.to_thread(self._generate, name)
                if batch is None:
                    replies[name] = "drew the honest tokens: not sent"
                    continue
                data = seal(key, batch)
                for _ in range(20):  # as a producer does: "busy" decides nothing, the same batch goes again
                    reply = await submit(p2p, swarm.trainer_peer, swarm.run_id, data, swarm.run_id)
                    if reply.reason not in ("busy", "unknown_signer"):
                        break
                    await asyncio.sleep(0.25)
                replies[name] = "admitted" if reply.ok else reply.reason
                sent.append(key)
        finally:
            swarm.attacker_priority(19)
            await p2p.shutdown()
        await asyncio.sleep(max(0.0, until - time.monotonic()))
        status = swarm.status()
        bad = sum(status["accepted_groups_by_node"].get(k.node_id, 0) for k in sent)
        banned = sum(k.node_id in status["banned"] for k in sent)
        return Outcome(
            f"cheating producers ({len(sent)} kinds sent)",
            "bad data accepted",
            bad > 0,
            f"{banned}/{len(sent)} banned; at the door {replies}",
            bad,
        )


def _edited(batch: RolloutBatch) -> RolloutBatch:
    g = batch.groups[0]
    c = list(g.completions[0])
    c[len(c) // 2] = (c[len(c) // 2] + 1) % 10 + 3
    return batch.model_copy(
        update={"groups": [g.model_copy(update={"completions": [c, *g.completions[1:]]}), *batch.groups[1:]]}
    )


NEWCOMER_S = 30.0
"""How long a node that joins during an attack has, once it is up, to hold a version."""


async def newcomer_version(swarm: Swarm, name: str, until: float) -> int:
    """The version the newcomer ``name`` holds by ``until`` or within NEWCOMER_S of being up (-1: none)."""
    deadline = max(until, swarm.up_at[name] + NEWCOMER_S)
    got = -1
    while time.monotonic() < deadline:
        got = swarm.status(name)["weight_version"]
        if got >= 0:
            break
        await asyncio.sleep(0.5)
    return int(got)


class HostileParent:
    """A registered relay claiming depth 0 and a huge upload grants slots, then trickles shards (``trickle``) or
    answers keep-alives with a 5,000-entry path (``path``); a relay that joins now chooses it first. ``prepare``
    puts the liar up and starts the newcomer (a process start is no work of the attack's, and on two cores it would
    weigh on the honest rate); the attack is the newcomer's first version under that parent."""

    def __init__(self, swarm: Swarm, mode: str) -> None:
        self.swarm, self.mode = swarm, mode
        self.liar = Identity.generate()
        self.granted: list[bool] = []
        self.name = f"newcomer-{mode}"
        self.runner: web.AppRunner | None = None

    async def attach(self, request: web.Request) -> web.Response:
        path = [self.swarm.run_id, self.liar.node_id]
        if self.mode == "path" and self.granted:
            path = [self.swarm.run_id] + [self.liar.node_id] * 5000
        self.granted.append(True)
        return web.json_response({"depth": 1, "path": path, "token": "t"})

    @staticmethod
    async def trickle(request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse()
        resp.content_length = 1 << 20
        await resp.prepare(request)
        for _ in range(1000):
            await resp.write(b"\0")
            await asyncio.sleep(1.0)
        return resp

    @staticmethod
    async def no_news(request: web.Request) -> web.Response:
        return web.Response(status=204)

    async def prepare(self) -> None:
        app = web.Application()
        app.router.add_post("/relay/attach", self.attach)
        app.router.add_get("/relay/next", self.no_news)
        app.router.add_get("/weights/{version}/{name}", self.trickle)
        self.runner = web.AppRunner(app)
        await self.runner.setup()
        site = web.TCPSite(self.runner, ATTACKER_IP, 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        versions = list(range(10_000, 10_064))
        relay = RelayInfo(depth=0, slots_total=64, slots_free=64, upload_bps=1e12, versions=versions)
        self.swarm.register(self.liar, role="relay", http_url=f"http://{ATTACKER_IP}:{port}", relay=relay)
        await asyncio.to_thread(self.swarm.join, self.name, "relay")

    async def attack(self, until: float) -> Outcome:
        try:
            got = await newcomer_version(self.swarm, self.name, until)
        finally:
            assert self.runner is not None
            await self.runner.cleanup()
        crashed = self.name in self.swarm.crashed()
        await asyncio.to_thread(self.swarm.leave, self.name)
        return Outcome(
            f"hostile parent ({'5,000-node path' if self.mode == 'path' else 'trickles shards'})",
            "node crashed" if crashed else "newcomer shut out",
            crashed or got < 0,
            f"the new relay {'crashed' if crashed else f'holds version {got}'}",
        )


# ---- round two: the classes of the second review (issue 34) -------------------------------------------------


class _LiarDHT(DHT):
    """A DHT peer whose every find answer is an empty dictionary that never expires (routing answers kept)."""

    def run(self) -> None:
        honest = DHTProtocol.rpc_find

        async def rpc_find(
            protocol: DHTProtocol, request: dht_pb2.FindRequest, context: P2PContext
        ) -> dht_pb2.FindResponse:
            response = await honest(protocol, request, context)
            for item in response.results:
                item.type = dht_pb2.FOUND_DICTIONARY
                item.value = MSGPackSerializer.dumps(DictionaryDHTValue())
                item.expiration_time = float("inf")
            return response

        DHTProtocol.rpc_find = rpc_find  # type: ignore[method-assign]
        super().run()


async def dht_liar(swarm: Swarm, until: float) -> Outcome:
    """A DHT peer answers every read of the run's keys with an empty answer that never expires; a key registered
    after it joined must still be found by the trainer."""
    liar = await asyncio.to_thread(
        _LiarDHT,
        initial_peers=swarm.ready["trainer"]["p2p_maddrs"][:1],
        start=True,
        host_maddrs=[f"/ip4/{ATTACKER_IP}/tcp/0"],
    )
    late = Identity.generate()
    p2p = await fresh_peer(swarm)
    replies: list[str] = []
    try:
        await asyncio.sleep(min(5.0, max(0.0, until - time.monotonic() - 15)))  # readers meet the liar first
        swarm.register(late)
        while time.monotonic() < until:
            early = seal(late, swarm.fake_batch(late, published(swarm), 9))
            reply = await submit(p2p, swarm.trainer_peer, swarm.run_id, early, swarm.run_id)
            replies.append(reply.reason or "ok")
            if reply.reason != "unknown_signer":
                break
            await asyncio.sleep(1.0)
    finally:
        await p2p.shutdown()
        await asyncio.to_thread(liar.shutdown)
    found = bool(replies) and replies[-1] != "unknown_signer"
    return Outcome(
        "DHT answers that never expire",
        "swarm frozen",
        not found,
        f"a key registered during it: {'found' if found else 'never found'} by the trainer "
        f"after {len(replies)} batch(es) ({replies[-1] if replies else 'none sent'})",
    )


async def gossip_peer(swarm: Swarm, key: Identity) -> tuple[Membership, P2P, Gossip]:
    """A DHT peer of ours with gossip (the attacker's; any key can run one)."""
    membership = Membership(key, swarm.run_id, Metrics())
    await membership.start(ATTACKER_IP, 0, swarm.ready["trainer"]["p2p_maddrs"][:1])
    p2p = await membership.replicate_p2p()
    return membership, p2p, Gossip(p2p, swarm.run_id, Metrics())


Play = Callable[[Swarm, float, Identity, P2P, Gossip], Awaitable[Outcome]]


class FromPeer:
    """An attack played from a DHT peer with gossip of the attacker's own, under a fresh key (registered as a
    volunteer when ``register``). ``prepare`` starts the peer (and runs ``also``): a peer's start is the attacker's
    own time, and at the lowest priority on two busy cores it can take longer than hivemind allows."""

    def __init__(
        self, swarm: Swarm, play: Play, register: bool, also: Callable[[], Awaitable[None]] | None = None
    ) -> None:
        self.swarm, self.play, self.register, self.also = swarm, play, register, also
        self.key = Identity.generate()
        self.peer: tuple[Membership, P2P, Gossip] | None = None

    async def prepare(self) -> None:
        if self.also is not None:
            await self.also()
        self.peer = await gossip_peer(self.swarm, self.key)
        if self.register:  # last: its record lives NODE_TTL_S, and the window must fall within them
            await asyncio.to_thread(self.swarm.register, self.key)

    async def attack(self, until: float) -> Outcome:
        assert self.peer is not None
        membership, p2p, gossip = self.peer
        try:
            return await self.play(self.swarm, until, self.key, p2p, gossip)
        finally:
            await gossip.close()
            await membership.close()


async def _announce(gossip: Gossip, swarm: Swarm, key: Identity, digest: str, size: int) -> None:
    a = BatchAnnounce(
        run_id=swarm.run_id,
        epoch=swarm.epoch,
        node_id=key.node_id,
        version=0,
        batch_index=0,
        batch_sha256=digest,
        size=size,
        issued=time.time(),
    )
    try:
        await gossip.publish("rollouts", seal(key, a))
    except (OSError, TimeoutError):
        pass


async def redeem_flood(swarm: Swarm, until: float) -> Outcome:
    """Fresh keys from 4 peers redeem forged and garbage invites as fast as the trainer answers."""
    peers = [await fresh_peer(swarm) for _ in range(4)]
    counts: dict[str, int] = {}

    async def one(p2p: P2P) -> None:
        while time.monotonic() < until:
            key = Identity.generate()
            forged = seal(key, Invite(run_id=swarm.run_id, token_id="0" * 16, expires=time.time() + 60, uses=9))
            try:
                reply = await call_redeem(p2p, key, swarm.run_id, swarm.trainer_peer, forged)
                counts[reply.reason or "ok"] = counts.get(reply.reason or "ok", 0) + 1
            except DELIVERY_ERRORS:
                counts["network"] = counts.get("network", 0) + 1
                await asyncio.sleep(0.1)

    try:
        await asyncio.gather(*(one(p) for p in peers))
    finally:
        for p in peers:
            await p.shutdown()
    return Outcome("invite redemption flood", "node crashed", "trainer" in swarm.crashed(), f"replies {counts}")


class OriginSquat:
    """Registered keys that never produce attach to the origin in every stripe and keep their slots with
    keep-alives; a relay that joins meanwhile must still get every version. ``prepare`` registers the squatters,
    lets them take the slots and starts the newcomer (its process start is not the attack's work); the attack is
    the squatters holding on while the newcomer gets its first version."""

    def __init__(self, swarm: Swarm, keys: int = 8) -> None:
        self.swarm, self.keys = swarm, keys
        self.squatters = [Identity.generate() for _ in range(keys)]
        self.granted = self.refused = 0
        self.name = "newcomer-squat"
        self.session: aiohttp.ClientSession | None = None
        self.holder: asyncio.Future[None] | None = None

    period = 2.0
    """Seconds between the squatters' rounds of asking (well within a slot's silence allowed)."""

    def asks(self) -> list[tuple[Identity, int]]:
        """Each round's slot requests: every key in every stripe (the origin's, unless --stripes says otherwise;
        the benchmark's trainer: the default)."""
        return [(key, stripe) for key in self.squatters for stripe in range(DEFAULT_STRIPES)]

    def register(self, i: int, key: Identity) -> None:
        self.swarm.register(key, "relay")

    async def hold(self) -> None:
        assert self.session is not None
        while True:
            for key, stripe in self.asks():
                path = f"/relay/attach?stripe={stripe}"
                headers = signed_headers(key, "POST", path, self.swarm.run_id)
                try:
                    async with self.session.post(self.swarm.trainer_url + path, headers=headers) as r:
                        await r.read()
                        self.granted += r.status == 200
                        self.refused += r.status != 200
                except aiohttp.ClientError:
                    pass
            await asyncio.sleep(self.period)

    async def prepare(self) -> None:
        for i, key in enumerate(self.squatters):
            await asyncio.to_thread(self.register, i, key)
        self.session = attacker_session()
        self.holder = asyncio.ensure_future(self.hold())
        await asyncio.sleep(3.0)
        await asyncio.to_thread(self.swarm.join, self.name, "relay")

    async def attack(self, until: float) -> Outcome:
        try:
            got = await newcomer_version(self.swarm, self.name, until)
            await asyncio.sleep(max(0.0, until - time.monotonic()))  # the squatters hold on for the whole window
        finally:
            assert self.holder is not None and self.session is not None
            self.holder.cancel()
            await asyncio.gather(self.holder, return_exceptions=True)
            await self.session.close()
        await asyncio.to_thread(self.swarm.leave, self.name)
        return Outcome(
            f"origin slots squatted ({self.keys} registered keys)",
            "newcomer shut out",
            got < 0,
            f"{self.granted} attaches granted, {self.refused} refused; the new relay holds version {got}",
        )


class RootSquat(OriginSquat):
    """The origin's root rule turned against it: keys whose records say they are at home in a stripe (with an address
    where nothing answers) take turns asking the origin for their stripe's slot, which the rule gives a node at home
    in a stripe with no root there, earned leaves' slots included (relay.ShardServer._make_room). Aim: the honest
    nodes shut out of the origin's slots, sent to roots that serve nothing; a relay that joins meanwhile must still
    get every version, and the honest rate hold. Four keys per stripe (the rule roots a stripe once in
    ROOT_RETRY_S whoever asks)."""

    period = 1.0

    def __init__(self, swarm: Swarm, per_stripe: int = 4) -> None:
        super().__init__(swarm, keys=per_stripe * DEFAULT_STRIPES)
        self.name = "newcomer-rootsquat"

    def home(self, i: int) -> int:
        return i % DEFAULT_STRIPES

    def asks(self) -> list[tuple[Identity, int]]:
        return [(key, self.home(i)) for i, key in enumerate(self.squatters)]

    def register(self, i: int, key: Identity) -> None:
        relay = RelayInfo(
            depth=1, parent=self.swarm.run_id, slots_total=4, slots_free=0, stripe=self.home(i), stripes=DEFAULT_STRIPES
        )
        url = f"http://{ATTACKER_IP}:9"  # the discard port: nothing answers there
        self.swarm.register(key, "relay", http_url=url, relay=relay)

    async def attack(self, until: float) -> Outcome:
        outcome = await super().attack(until)
        outcome.name = f"stripe roots squatted ({self.keys} keys claiming a home)"
        return outcome


async def jail_shm(swarm: Swarm, until: float) -> Outcome:
    """A code reward's program fills /dev/shm (and /dev, /tmp): memory the jail's limits did not count."""
    program = (
        "import os\n"
        "total = 0\n"
        "for d in ('/dev/shm', '/dev', '/tmp', '/'):\n"
        "    try:\n"
        "        with open(os.path.join(d, 'fill'), 'wb') as f:\n"
        "            for _ in range(512):\n"
        "                f.write(b'x' * (1 << 20)); f.flush(); total += 1 << 20\n"
        "    except OSError:\n"
        "        pass\n"
        "print('filled' if total > 256 * (1 << 20) else 'bounded')\n"
    )
    try:
        filled = await asyncio.to_thread(run_code_tests, program, (("", "filled"),), 30.0, 256) > 0
        detail = "over 256 MiB written outside the memory limit" if filled else "every writable mount was bounded"
    except Exception as e:  # the jail refused to run without a memory limit that counts tmpfs
        filled, detail = False, f"refused: {str(e)[:80]}"
    return Outcome("code reward fills /dev/shm", "memory exhausted", filled, detail)


class _Staller:
    """The attacker's batch server: takes every fetch and never answers; counts them."""

    def __init__(self) -> None:
        self.asked = 0
        self.open_now = 0
        self.peak = 0
        self.release = asyncio.Event()

    async def __call__(self, _info: Any, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.asked += 1
        self.open_now += 1
        self.peak = max(self.peak, self.open_now)
        try:
            await self.release.wait()
        finally:
            self.open_now -= 1
            writer.close()


async def announce_flood(swarm: Swarm, until: float, _key: Identity, p2p: P2P, gossip: Gossip) -> Outcome:
    """200 registered keys each announce a 16 MiB batch they never serve: one pull (and buffer) per key?"""
    staller = _Staller()
    await p2p.add_binary_stream_handler(batch_protocol(swarm.run_id), staller)
    rss_before = _rss_mb(swarm.nodes["trainer"].proc.pid)
    rss_peak = rss_before
    try:
        rounds = 0
        while time.monotonic() < until:
            for i, key in enumerate(SYBILS):
                await _announce(gossip, swarm, key, f"{rounds:032x}{i:032x}", 16 << 20)
                await asyncio.sleep(0.06)  # within gossip's rate per peer
                rss_peak = max(rss_peak, _rss_mb(swarm.nodes["trainer"].proc.pid)) if i % 20 == 0 else rss_peak
                if time.monotonic() > until:
                    break
            rounds += 1
    finally:
        staller.release.set()
    return Outcome(
        "announcements for 200 keys, never served",
        "memory exhausted",
        staller.peak > MAX_READING,
        f"{staller.asked} fetches, at most {staller.peak} at once; trainer RSS {rss_before:.0f} -> {rss_peak:.0f} MB",
    )


async def announce_quiet(swarm: Swarm, until: float, _key: Identity, p2p: P2P, gossip: Gossip) -> Outcome:
    """A probe, not an attack: the announcement flood's peer and its 200 registered keys, sending nothing (what the
    registrations and the attacker's peer cost on their own)."""
    await asyncio.sleep(max(0.0, until - time.monotonic()))
    return Outcome("the flood's peer and 200 registrations, silent", "none (a probe)", False, "nothing sent")


async def announce_one_key(swarm: Swarm, until: float, key: Identity, p2p: P2P, gossip: Gossip) -> Outcome:
    """A probe, not an attack: announcements as often as the flood's, under one registered key (what the
    announcements cost without 200 registrations behind them)."""
    staller = _Staller()
    await p2p.add_binary_stream_handler(batch_protocol(swarm.run_id), staller)
    sent = 0
    try:
        while time.monotonic() < until:
            await _announce(gossip, swarm, key, f"{sent:064x}", 16 << 20)
            sent += 1
            await asyncio.sleep(0.06)
    finally:
        staller.release.set()
    return Outcome("one key announces as often", "none (a probe)", False, f"{sent} sent, {staller.asked} fetches")


async def digest_echo(swarm: Swarm, until: float, echo: Identity, p2p: P2P, gossip: Gossip) -> Outcome:
    """A registered key re-announces every digest it hears as its own and serves none: validators that fetch
    from it stall past the verdict wait, and the trainer judges the batches itself."""
    staller = _Staller()
    await p2p.add_binary_stream_handler(batch_protocol(swarm.run_id), staller)
    echoed = 0

    async def heard(data: bytes, peer: str) -> None:
        nonlocal echoed
        try:
            a = open_signed(data, BatchAnnounce).message
        except Exception:
            return
        if a.node_id != echo.node_id:
            echoed += 1
            await _announce(gossip, swarm, echo, a.batch_sha256, a.size)

    before = _metric(swarm.trainer_url, "node_trainer_validation_fallbacks_total")
    try:
        gossip.subscribe("rollouts", heard)
        await asyncio.sleep(max(0.0, until - time.monotonic()))
    finally:
        staller.release.set()
    fallbacks = _metric(swarm.trainer_url, "node_trainer_validation_fallbacks_total") - before
    return Outcome(
        "a key echoes every digest",
        "validators bypassed",
        fallbacks > 2,
        f"{echoed} digests echoed, {staller.asked} fetches reached it; trainer fallbacks {fallbacks:.0f}",
    )


async def nonce_flood(swarm: Swarm, until: float) -> Outcome:
    """Strangers' correctly signed slot requests as fast as the origin answers: every nonce was kept before the
    membership check, and past 100,000 of them each request copied the table on the loop that serves shards."""
    sent = 0
    statuses: dict[int, int] = {}
    first: list[float] = []
    last: list[float] = []
    started = time.monotonic()
    async with attacker_session() as session:
        while time.monotonic() < until:
            key = Identity.generate()
            headers = signed_headers(key, "POST", "/relay/attach?stripe=0", swarm.run_id)
            t0 = time.monotonic()
            try:
                async with session.post(swarm.trainer_url + "/relay/attach?stripe=0", headers=headers) as r:
                    await r.read()
                    statuses[r.status] = statuses.get(r.status, 0) + 1
            except aiohttp.ClientError:
                continue
            sent += 1
            took = time.monotonic() - t0
            (first if t0 - started < 5 else last).append(took)
    p50 = lambda xs: sorted(xs)[len(xs) // 2] if xs else 0.0  # noqa: E731
    slower = p50(last) / max(p50(first), 1e-6)
    return Outcome(
        "strangers' signed slot requests",
        "swarm frozen",
        slower > 10,
        f"{sent} sent {statuses}; answers {slower:.1f}x as slow at the end",
    )


async def reack(swarm: Swarm, until: float, key: Identity, _p2p: P2P, gossip: Gossip) -> Outcome:
    """A registered key announces the digests of other nodes' admitted batches: the trainer signed and broadcast
    a new acknowledgement for each, for anyone who asked."""
    asked: dict[str, float] = {}
    repeats = 0
    acks = 0

    async def heard(data: bytes, peer: str) -> None:
        nonlocal repeats, acks
        try:
            ack = open_signed(data, BatchAck).message
        except Exception:
            return
        acks += 1
        if ack.batch_sha256 in asked:
            repeats += 1
        elif ack.node_id != key.node_id:
            asked[ack.batch_sha256] = time.monotonic()

    gossip.subscribe("verdicts", heard)
    while time.monotonic() < until:
        for digest, at in list(asked.items())[-16:]:
            if time.monotonic() - at > 2.5:
                await _announce(gossip, swarm, key, digest, 1024)
        await asyncio.sleep(1.0)
    return Outcome(
        "acknowledgements on demand",
        "trainer signs for strangers",
        repeats > 0,
        f"{len(asked)} digests re-announced, {repeats} acknowledged again ({acks} acks heard)",
    )


class DialbackFlood:
    """Fresh peer ids ask the trainer to dial back silent ports, as many at once as it lets them. ``prepare``
    starts the attacker's peers (a peer id costs it a daemon start: at the lowest priority on two busy cores eight
    at once outlasted hivemind's start timeout); the attack asks from 8 at a time, each peer once a round."""

    PEERS = 24

    def __init__(self, swarm: Swarm) -> None:
        self.swarm = swarm
        self.peers: list[P2P] = []

    async def prepare(self) -> None:
        for start in range(0, self.PEERS, 8):
            self.peers += await asyncio.gather(*(fresh_peer(self.swarm) for _ in range(start, start + 8)))

    async def attack(self, until: float) -> Outcome:
        swarm = self.swarm
        silent = [socket.socket() for _ in range(4)]
        for sock in silent:  # accepts connections in the kernel's backlog, never answers a byte
            sock.bind((ATTACKER_IP, 0))
            sock.listen(1024)
        ports = [sock.getsockname()[1] for sock in silent]
        counts: dict[str, int] = {}
        slowest = 0.0

        async def one(p2p: P2P) -> None:
            nonlocal slowest
            key = Identity.generate()
            maddrs = [f"/ip4/{ATTACKER_IP}/tcp/{port}/p2p/{p2p.peer_id.to_base58()}" for port in ports]
            t0 = time.monotonic()
            try:
                await ask_dialback(p2p, key, swarm.run_id, swarm.trainer_peer, maddrs, ports[0])
                outcome = "answered"
            except Rejected as e:
                outcome = e.reason
            except DELIVERY_ERRORS:
                outcome = "network"
            slowest = max(slowest, time.monotonic() - t0)
            counts[outcome] = counts.get(outcome, 0) + 1

        try:
            rounds = 0
            while time.monotonic() < until - 5:  # a round takes at most the trainer's deadline per request
                at = rounds * 8 % len(self.peers)
                await asyncio.gather(*(one(p2p) for p2p in self.peers[at : at + 8]))
                rounds += 1
        finally:
            for sock in silent:
                sock.close()
            await asyncio.gather(*(p2p.shutdown() for p2p in self.peers), return_exceptions=True)
            self.peers = []
        return Outcome(
            "dial-backs to silent ports",
            "swarm frozen",
            slowest > 30,
            f"{sum(counts.values())} asked from {self.PEERS} peer ids: {counts}; slowest answer {slowest:.1f} s",
        )


REGISTRY_WAIT_S = 30.0
"""The longest an attack waits for the trainer's registry to read the records it placed."""


class AuditFlood:
    """Keys registered as auditors ask for the trainer's checkpoints as fast as it answers, strangers' signed requests
    and unsigned index requests beside them (the /audit routes, node/roles/trainer_audit.py): each download is a
    checkpoint streamed from the trainer's disk. Aim: more served than the routes' limit per key
    (``PER_KEY_PER_HOUR``), or training slowed by serving them (the honest rate). ``SERVING`` at once is the
    server's (tests/roles/test_audit.py): from here a download whose bytes all sit in socket buffers looks
    unfinished."""

    def __init__(self, swarm: Swarm, keys: int = 16, strangers: int = 4) -> None:
        self.swarm = swarm
        self.auditors = [Identity.generate() for _ in range(keys)]
        self.strangers = [Identity.generate() for _ in range(strangers)]
        self.statuses: dict[int, int] = {}
        self.bytes = 0

    async def prepare(self) -> None:
        known = (await asyncio.to_thread(self.swarm.status))["peers"]
        for key in self.auditors:
            await asyncio.to_thread(self.swarm.register, key, "auditor")
        # the trainer's registry reads the nodes key every few seconds: wait until it counts the auditors' records
        # (its /status "peers"), at most REGISTRY_WAIT_S (records of an earlier attack expiring can hide some)
        deadline = time.monotonic() + REGISTRY_WAIT_S
        while time.monotonic() < deadline:
            if (await asyncio.to_thread(self.swarm.status))["peers"] >= known + len(self.auditors):
                break
            await asyncio.sleep(0.5)

    async def one(self, session: aiohttp.ClientSession, key: Identity | None, until: float) -> None:
        while time.monotonic() < until:
            try:
                async with session.get(self.swarm.trainer_url + "/audit") as r:
                    steps = (await r.json())["checkpoints"] if r.status == 200 else []
                    self.statuses[r.status] = self.statuses.get(r.status, 0) + 1
                if key is None or not steps:
                    continue
                path = f"/audit/checkpoint/{steps[-1]}"
                headers = signed_headers(key, "GET", path, self.swarm.run_id)
                async with session.get(self.swarm.trainer_url + path, headers=headers) as r:
                    self.statuses[r.status] = self.statuses.get(r.status, 0) + 1
                    if r.status != 200:
                        await asyncio.sleep(0.2)
                        continue
                    async for chunk in r.content.iter_chunked(1 << 16):
                        self.bytes += len(chunk)
            except (aiohttp.ClientError, ValueError, KeyError, TypeError):
                await asyncio.sleep(0.2)

    async def attack(self, until: float) -> Outcome:
        url = self.swarm.trainer_url
        served = lambda: _metric(url, 'node_audit_downloads_total{outcome="checkpoint"}')  # noqa: E731
        before = await asyncio.to_thread(served)
        async with attacker_session() as session:
            keys: list[Identity | None] = [*self.auditors, *self.strangers, None, None]
            await asyncio.gather(*(self.one(session, key, until) for key in keys))
        done = await asyncio.to_thread(served) - before
        allowed = len(self.auditors) * PER_KEY_PER_HOUR
        return Outcome(
            f"audit downloads ({len(self.auditors)} auditor keys, {len(self.strangers)} strangers)",
            "limits exceeded",
            done > allowed,
            f"{done:.0f} checkpoints served (the keys' limit: {allowed} an hour), {self.bytes / 1e6:.0f} MB read; "
            f"answers {dict(sorted(self.statuses.items()))}",
        )


def _metric(url: str, name: str) -> float:
    text = get_bounded(url + "/metrics").decode()
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith(name + " ") or line.startswith(name + "{")
    )


PROBES = ("announce_quiet", "announce_one_key")
"""Plays that are not attacks, run only when named in --attacks: what the announcement flood's parts cost apart."""
ATTACKS = (
    "key_theft",
    "dht_poison",
    "relay_squat",
    "duplicate_streams",
    "stalled_streams",
    "envelope_bomb",
    "sybil_flood",
    "submission_flood",
    "cheaters",
    "hostile_parent_trickle",
    "hostile_parent_path",
    "dht_liar",
    "redeem_flood",
    "origin_squat",
    "root_squat",
    "jail_shm",
    "announce_flood",
    "digest_echo",
    "nonce_flood",
    "reack",
    "dialback_flood",
    "audit_flood",
)


def _rss_mb(pid: int) -> float:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return 0.0


async def main_async(args: argparse.Namespace, root: Path) -> list[Outcome]:
    swarm = Swarm(root)
    try:
        validator_id = subprocess.run(
            [sys.executable, "-m", "intellect_node.cli", "id", "--data-dir", str(root / "validator")],
            capture_output=True,
            text=True,
            check=True,
            timeout=60,
        ).stdout.strip()
        swarm.start(
            "trainer", ["bootstrap", "--data-dir", str(root / "trainer"), "--validator", validator_id, *SETTINGS]
        )
        swarm.join("validator", "validator")
        for i in range(2):
            swarm.join(f"honest-{i}", "inference")
        swarm.join("relay", "relay")
        while steps(swarm) < 5:
            await asyncio.sleep(0.5)
        swarm.client = DHT(
            initial_peers=swarm.ready["trainer"]["p2p_maddrs"][:1],
            start=True,
            host_maddrs=[f"/ip4/{ATTACKER_IP}/tcp/0"],
        )
        # The attacker gets what CPU the swarm leaves (on a real deployment it is another machine): this process
        # and what it started (its DHT peer and libp2p daemons) at the lowest priority, but while it prepares an
        # attack (outside the measured windows: a peer started at the lowest priority on two busy cores can take
        # longer than hivemind's start allows).
        swarm.attacker_priority(19)
        await asyncio.sleep(args.window)  # settled: every node has loaded a few versions, the attacker's DHT joined
        control = await measure(swarm, args.window, lambda until: idle(swarm, until))
        print(f"attack-free rate: {control.rate:.2f} steps/s", flush=True)
        trickler, pather = HostileParent(swarm, "trickle"), HostileParent(swarm, "path")
        squat, cheats, dialback = OriginSquat(swarm), Cheaters(swarm), DialbackFlood(swarm)
        rooter = RootSquat(swarm)
        auditing = AuditFlood(swarm)
        flood = FromPeer(swarm, announce_flood, register=False, also=lambda: register_all(swarm, SYBILS))
        echo, reacker = FromPeer(swarm, digest_echo, register=True), FromPeer(swarm, reack, register=True)
        Attack = Callable[[float], Awaitable[Outcome]]
        Prepare = Callable[[], Awaitable[None]] | None
        attacks: dict[str, tuple[Prepare, Attack]] = {
            "key_theft": (None, lambda u: key_theft(swarm, u)),
            "dht_poison": (None, lambda u: dht_poison(swarm, u)),
            "relay_squat": (None, lambda u: relay_squat(swarm, u)),
            "duplicate_streams": (lambda: warm_up(swarm, DUPLICATE_SENDER), lambda u: duplicate_streams(swarm, u)),
            "stalled_streams": (None, lambda u: stalled_streams(swarm, u)),
            "envelope_bomb": (None, lambda u: envelope_bomb(swarm, u)),
            "sybil_flood": (lambda: register_all(swarm, SYBILS), lambda u: sybil_flood(swarm, u)),
            "submission_flood": (lambda: warm_up(swarm, FLOODER), lambda u: submission_flood(swarm, u)),
            "cheaters": (cheats.prepare, cheats.attack),
            "hostile_parent_trickle": (trickler.prepare, trickler.attack),
            "hostile_parent_path": (pather.prepare, pather.attack),
            "dht_liar": (None, lambda u: dht_liar(swarm, u)),
            "redeem_flood": (None, lambda u: redeem_flood(swarm, u)),
            "origin_squat": (squat.prepare, squat.attack),
            "root_squat": (rooter.prepare, rooter.attack),
            "jail_shm": (None, lambda u: jail_shm(swarm, u)),
            "announce_flood": (flood.prepare, flood.attack),
            "digest_echo": (echo.prepare, echo.attack),
            "nonce_flood": (None, lambda u: nonce_flood(swarm, u)),
            "reack": (reacker.prepare, reacker.attack),
            "dialback_flood": (dialback.prepare, dialback.attack),
            "audit_flood": (auditing.prepare, auditing.attack),
        }
        assert set(attacks) == set(ATTACKS)
        quiet = FromPeer(swarm, announce_quiet, register=False, also=lambda: register_all(swarm, SYBILS))
        one_key = FromPeer(swarm, announce_one_key, register=True)
        attacks["announce_quiet"] = (quiet.prepare, quiet.attack)
        attacks["announce_one_key"] = (one_key.prepare, one_key.attack)
        outcomes = []
        controls = [control]
        for name in args.attacks or list(ATTACKS):
            prepare, attack = attacks[name]
            outcome = await measure(swarm, args.window, attack, prepare)
            outcomes.append(outcome)
            # an attack-free window after each attack: each attack is judged against the windows on either side
            # of it (on two shared cores the attack-free rate drifts by a fifth over a run)
            after = await measure(swarm, args.window, lambda until: idle(swarm, until))
            controls.append(after)
            before_it = controls[-2]
            baseline = (before_it.rate + after.rate) / 2
            outcome.control = baseline
            outcome.rate /= max(baseline, 1e-9)
            charge(outcome, before_it, after)
            by_node = ", ".join(f"{n} {x:+.1f}" for n, x in sorted(outcome.by_node.items(), key=lambda kv: -kv[1]))
            print(
                f"  {outcome.name}: {'ACHIEVED' if outcome.achieved else 'held'} rate={outcome.rate:.2f} "
                f"(attack-free around it {baseline:.2f} steps/s) cost={outcome.cost_ratio:.2f} "
                f"({outcome.extra_cpu:.1f} of our CPU-s [{by_node}], {outcome.attacker_cpu:.1f} of the "
                f"attacker's) {outcome.detail}",
                flush=True,
            )
        # the noise floor of "our extra CPU-s": each attack-free window between two others, charged as if attacked
        floor = sorted(
            charge(dataclasses.replace(c), controls[i - 1], controls[i + 1]).extra_cpu
            for i, c in enumerate(controls[1:-1], start=1)
        )
        # and of the honest rate: each attack-free window's rate as a share of its neighbours' mean
        rates = sorted(
            c.rate / max((controls[i - 1].rate + controls[i + 1].rate) / 2, 1e-9)
            for i, c in enumerate(controls[1:-1], start=1)
        )
        if floor:
            print(
                f"attack-free windows charged against their neighbours as if attacked ({len(floor)}): our extra "
                f"CPU-s median {floor[len(floor) // 2]:.1f}, max {floor[-1]:.1f}; honest rate median "
                f"{rates[len(rates) // 2]:.2f}, min {rates[0]:.2f}, max {rates[-1]:.2f} (the noise floor)",
                flush=True,
            )
        crashes = [n for n in swarm.crashed() if not n.startswith("newcomer")]
        if crashes:
            outcomes.append(Outcome("any attack", "node crashed", True, f"crashed: {crashes}"))
        # an honest node banned is a failure whatever caused it (an attack, or the validator's own numerics)
        banned = swarm.status()["banned"]
        wronged = {n: banned[r["node_id"]] for n, r in swarm.ready.items() if r["node_id"] in banned}
        if wronged:
            outcomes.append(Outcome("any attack", "honest node banned", True, f"banned: {wronged}"))
        return outcomes
    finally:
        swarm.close()


def new_workdir() -> Path:
    shm = Path("/dev/shm")
    return Path(tempfile.mkdtemp(prefix="intellect-adversary-", dir=shm if shm.is_dir() else None))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--window",
        type=float,
        default=60.0,
        help="seconds each attack (and each control) lasts (60: ~47 minutes in all; at 30 an attack-free window's "
        "rate strayed from its neighbours' by a quarter on this machine)",
    )
    p.add_argument(
        "--workdir",
        type=Path,
        help="keep the swarm's files and logs here (default: a new folder on /dev/shm where it exists: every node "
        "writes each version and the trainer fsyncs every accepted batch, and a disk's latency is not what the "
        "attacks aim at)",
    )
    p.add_argument(
        "--attacks",
        type=lambda v: [a for a in v.split(",") if a],
        default=[],
        help="only these attacks, comma-separated (default: all); e.g. sybil_flood,submission_flood",
    )
    p.add_argument(
        "--netns",
        choices=("auto", "on", "off"),
        default="auto",
        help="the attacker in its own network namespace, across a veth from the swarm's (auto: when root and "
        "namespaces can be made); off: the attacker at 127.0.0.2 on loopback",
    )
    p.add_argument("--inside", metavar="SWARM_NS", help=argparse.SUPPRESS)  # run by the outer process, in netns
    args = p.parse_args()
    unknown = set(args.attacks) - set(ATTACKS) - set(PROBES)
    if unknown:
        p.error(f"unknown attack(s) {sorted(unknown)}; choose from {', '.join(ATTACKS + PROBES)}")
    global ATTACKER_IP, SWARM_HOST
    if args.inside:
        ATTACKER_IP, SWARM_HOST = "10.78.0.2", "10.78.0.1"
        SWARM_PREFIX[:] = netns_prefix(args.inside)
    elif args.netns == "on" or (args.netns == "auto" and netns.available()):
        # SIGTERM ends this process through the context below, which removes the namespaces and what runs in them
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
        root = args.workdir or new_workdir()
        inner = ["--window", str(args.window), "--workdir", str(root), "--attacks", ",".join(args.attacks)]
        with Namespaces() as ns:
            argv = [sys.executable, os.path.abspath(__file__), *inner, "--inside", ns.swarm]
            return subprocess.run([*netns_prefix(ns.attacker), *argv]).returncode
    root = args.workdir or new_workdir()
    outcomes = asyncio.run(main_async(args, root))
    print(
        "\n| attack | its aim | achieved | honest rate | attack-free around it, steps/s | our extra CPU-s | "
        "attacker CPU-s | cost to us per attacker CPU-s | what happened |\n|---|---|---|---|---|---|---|---|---|"
    )
    for o in outcomes:
        print(
            f"| {o.name} | {o.aim} | {'YES' if o.achieved else 'no'} | {o.rate:.2f} | {o.control:.2f} | "
            f"{o.extra_cpu:.1f} | {o.attacker_cpu:.1f} | {o.cost_ratio:.2f} | {o.detail} |"
        )
    held = sum(not o.achieved for o in outcomes)
    bad = sum(o.bad_accepted for o in outcomes)
    crashes = sum(o.aim == "node crashed" and o.achieved for o in outcomes)
    rate_min = min((o.rate for o in outcomes if o.name != "any attack"), default=0.0)
    print(f"logs: {root / 'logs'}")
    print(
        f"adversary attacks={len(outcomes)} held={held} bad_accepted={bad} crashes={crashes} "
        f"honest_rate_min={rate_min:.2f}"
    )
    return 0 if held == len(outcomes) else 1


if __name__ == "__main__":
    sys.exit(main())
