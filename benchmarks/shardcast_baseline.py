#!/usr/bin/env python3
"""Baseline for benchmarks/broadcast.py: the PyPI `shardcast` 0.3.2 package, origin -> M middle nodes -> N clients.

Not a dependency of intellect-node: `pip install shardcast==0.3.2` (and `wget`, which it calls) to run it.

Every node runs as its own process (optionally behind a command prefix such as
`ip netns exec NS`).  The same file is the node wrapper (`_node` sub-command).

Timing: t0 = start of OriginServer.broadcast() (shard + blake3 + write
distribution.txt) in the origin's data dir; end = the moment the last client
has returned from ClientNode.download_version() with a blake3-verified file.

Usage (loopback):
  python benchmarks/shardcast_baseline.py --size-mb 64 --middles 1 --clients 4
  python benchmarks/shardcast_baseline.py --size-mb 64 --middles 1 --clients 4 --check-interval 1   # NOT baseline
Topology file (for network namespaces), JSON:
  {"origin":  {"ip": "10.0.0.1", "port": 8100, "prefix": ["ip","netns","exec","o"]},
   "middles": [{"ip": "10.0.0.2", "port": 8101, "prefix": [...], "upstream": ["origin"]}],
   "clients": [{"prefix": [...], "servers": ["m0"]}]}
  ("origin", "m<i>" or full "http://ip:port" may be used in upstream/servers;
   defaults: middles -> origin, clients -> all middles, or origin when M=0.)
"""

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from types import SimpleNamespace

HERE = os.path.abspath(__file__)


# --------------------------------------------------------------------------- node wrapper
def _isolate_temp_files(workdir):
    """shardcast 0.3.2 writes two fixed, machine-global temp files:
       /tmp/dummy.bin(.tmp)   in ShardDownloader._init_server_metrics (data1.bin probe)
       <site-packages>/temp_distribution.txt(.tmp) in download_distribution_file
    Concurrent processes race on them (rename/unlink -> FileNotFoundError).
    Relocate both into this node's workdir. File *location* only; no logic change."""
    import pathlib

    import shardcast.client as C

    real_path = pathlib.Path
    dummy = os.path.join(workdir, "dummy.bin")

    def _path(p, *a):
        if str(p) == "/tmp/dummy.bin":
            p = dummy
        return real_path(p, *a)

    C.Path = _path
    # download_distribution_file uses dirname(dirname(__file__)) of shardcast/client.py
    C.__file__ = os.path.join(workdir, "_pkg", "client.py")


def _write_json(path, obj):
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(obj, f)
    os.replace(tmp, path)


def node_main(argv):
    p = argparse.ArgumentParser()
    p.add_argument("role", choices=["origin", "middle", "client"])
    p.add_argument("--workdir", required=True)
    p.add_argument("--port", type=int, default=0)
    p.add_argument("--upstream", default="")  # comma list of http://ip:port
    p.add_argument("--check-interval", type=float, default=30)
    p.add_argument("--version", default="v1")
    p.add_argument("--client-poll", type=float, default=1.0)
    p.add_argument("--no-isolate", action="store_true")
    p.add_argument("--log-level", default="INFO")
    a = p.parse_args(argv)
    os.makedirs(a.workdir, exist_ok=True)
    os.chdir(a.workdir)
    import shardcast
    from shardcast.utils import logger

    logger.setLevel(a.log_level)
    if not a.no_isolate:
        _isolate_temp_files(a.workdir)
    ready = os.path.join(a.workdir, "ready.json")
    ups = [u for u in a.upstream.split(",") if u]

    if a.role == "origin":
        # same as `shardcast-origin --data-dir data --port P`
        shardcast.OriginServer(os.path.join(a.workdir, "data"), a.port)
        _write_json(ready, {"t": time.time(), "pid": os.getpid()})
        while True:
            time.sleep(3600)

    if a.role == "middle":
        # same as `shardcast-middle --upstream U --data-dir data --port P --check-interval I`
        shardcast.MiddleNode(
            upstream_servers=ups, data_dir=os.path.join(a.workdir, "data"), port=a.port, check_interval=a.check_interval
        )
        _write_json(ready, {"t": time.time(), "pid": os.getpid()})
        while True:
            time.sleep(3600)

    # client: shardcast has no client poll loop (shardcast-client is one-shot and fails
    # if the version is not listed yet), so poll list_available_versions() like a consumer would.
    client = shardcast.ClientNode(ups, os.path.join(a.workdir, "downloads"))
    _write_json(ready, {"t": time.time(), "pid": os.getpid()})
    t_seen = None
    while True:
        if a.version in client.list_available_versions():
            t_seen = time.time()
            break
        time.sleep(a.client_poll)
    out = client.download_version(a.version, os.path.join(a.workdir, "downloads", "ckpt.bin"))
    _write_json(
        os.path.join(a.workdir, "result.json"), {"ok": bool(out), "path": out, "t_seen": t_seen, "t_done": time.time()}
    )
    return 0 if out else 1


# --------------------------------------------------------------------------- driver
class Procs:
    def __init__(self):
        self.procs = []

    def start(self, name, cmd, log, env):
        f = open(log, "wb")
        pr = subprocess.Popen(
            cmd, stdout=f, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )  # own process group (wget children too)
        self.procs.append((name, pr, f))
        return pr

    def check_alive(self):
        for name, pr, _ in self.procs:
            rc = pr.poll()
            if rc is not None and (rc != 0 or name.startswith(("origin", "middle"))):
                raise RuntimeError(f"{name} exited early rc={rc} (see {name}.log)")

    def stop_all(self):
        for _, pr, _ in self.procs:
            if pr.poll() is None:
                try:
                    os.killpg(pr.pid, signal.SIGTERM)
                except ProcessLookupError:
                    pass
        deadline = time.time() + 5
        for _, pr, f in self.procs:
            try:
                pr.wait(timeout=max(0.1, deadline - time.time()))
            except subprocess.TimeoutExpired:
                try:
                    os.killpg(pr.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                pr.wait()
            f.close()
        self.procs = []


def wait_for(pred, timeout, what, procs, step=0.01):
    end = time.time() + timeout
    while time.time() < end:
        v = pred()
        if v:
            return v
        procs.check_alive()
        time.sleep(step)
    raise TimeoutError(f"timeout waiting for {what}")


def default_topology(m, n, base_port, host="127.0.0.1"):
    return {
        "origin": {"ip": host, "port": base_port, "prefix": []},
        "middles": [{"ip": host, "port": base_port + 1 + i, "prefix": []} for i in range(m)],
        "clients": [{"prefix": []} for _ in range(n)],
    }


def resolve(refs, topo):
    out = []
    for r in refs:
        if r == "origin":
            o = topo["origin"]
        elif r.startswith("m") and r[1:].isdigit():
            o = topo["middles"][int(r[1:])]
        else:
            out.append(r)
            continue
        out.append(f"http://{o['ip']}:{o['port']}")
    return ",".join(out)


def blake3_file(path):
    import blake3

    h = blake3.blake3(max_threads=blake3.blake3.AUTO)
    h.update_mmap(path)
    return h.hexdigest()


def driver(a):
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # -> finally: cleanup
    if a.topology:
        with open(a.topology) as f:
            topo = json.load(f)
    else:
        topo = default_topology(a.middles, a.clients, a.base_port)
    M, N = len(topo["middles"]), len(topo["clients"])
    root = os.path.abspath(a.workdir)
    if os.path.exists(root):
        shutil.rmtree(root)
    os.makedirs(root)
    env = dict(os.environ)
    env["SHARDCAST_SHARD_SIZE"] = str(a.shard_size)
    py = [sys.executable, HERE, "_node"]
    common = ["--log-level", a.log_level] + (["--no-isolate"] if a.no_isolate else [])
    procs = Procs()
    res = {
        "publish_delay": a.publish_delay,
        "size_mb": a.size_mb,
        "M": M,
        "N": N,
        "check_interval": a.check_interval,
        "client_poll": a.client_poll,
        "shard_size": a.shard_size,
    }
    t_start = time.time()
    try:
        # payload + data1.bin (every server is probed for data1.bin by its downstream)
        payload = os.path.join(root, "payload.bin")
        with open(payload, "wb") as f:
            for _ in range(a.size_mb):
                f.write(os.urandom(1 << 20))

        def mk_node_dir(name):
            d = os.path.join(root, name)
            os.makedirs(os.path.join(d, "data"))
            with open(os.path.join(d, "data", "data1.bin"), "wb") as f:
                f.write(os.urandom(a.probe_bytes))
            return d

        # origin
        o = topo["origin"]
        od = mk_node_dir("origin")
        procs.start(
            "origin",
            o.get("prefix", []) + py + ["origin", "--workdir", od, "--port", str(o["port"])] + common,
            os.path.join(root, "origin.log"),
            env,
        )
        wait_for(lambda: os.path.exists(os.path.join(od, "ready.json")), a.timeout, "origin", procs)

        # middles
        mdirs = []
        for i, m in enumerate(topo["middles"]):
            d = mk_node_dir(f"middle{i}")
            mdirs.append(d)
            up = resolve(m.get("upstream", ["origin"]), topo)
            procs.start(
                f"middle{i}",
                m.get("prefix", [])
                + py
                + [
                    "middle",
                    "--workdir",
                    d,
                    "--port",
                    str(m["port"]),
                    "--upstream",
                    up,
                    "--check-interval",
                    str(a.check_interval),
                ]
                + common,
                os.path.join(root, f"middle{i}.log"),
                env,
            )
        for d in mdirs:  # ready = server up AND first upstream poll done (distribution.txt exists)
            wait_for(
                lambda d=d: (
                    os.path.exists(os.path.join(d, "ready.json"))
                    and os.path.exists(os.path.join(d, "data", "distribution.txt"))
                ),
                a.timeout,
                d,
                procs,
            )
        t_mid_ready = time.time()

        # clients
        cdirs = []
        default_srv = [f"m{i}" for i in range(M)] or ["origin"]
        for i, c in enumerate(topo["clients"]):
            d = os.path.join(root, f"client{i}")
            os.makedirs(d)
            cdirs.append(d)
            procs.start(
                f"client{i}",
                c.get("prefix", [])
                + py
                + [
                    "client",
                    "--workdir",
                    d,
                    "--upstream",
                    resolve(c.get("servers", default_srv), topo),
                    "--client-poll",
                    str(a.client_poll),
                ]
                + common,
                os.path.join(root, f"client{i}.log"),
                env,
            )
        for d in cdirs:
            wait_for(lambda d=d: os.path.exists(os.path.join(d, "ready.json")), a.timeout, d, procs)
        res["setup_s"] = round(time.time() - t_start, 3)
        res["publish_after_middle_ready_s"] = round(time.time() - t_mid_ready, 3)

        if a.publish_delay > 0:  # controls the phase w.r.t. the middles' poll timer
            time.sleep(a.publish_delay)
        # publish (file ops only, identical to OriginServer.broadcast; the origin's
        # HTTP server serves whatever is in its data dir)
        from shardcast.origin_server import OriginServer
        from shardcast.utils import logger as _lg

        _lg.setLevel("WARNING")
        os.environ["SHARDCAST_SHARD_SIZE"] = str(a.shard_size)
        t0 = time.time()
        version = OriginServer.broadcast(
            SimpleNamespace(data_dir=os.path.join(od, "data"), max_distribution_folders=5), payload, a.shard_size
        )
        t_pub = time.time()
        assert version == "v1", version
        res["publish_s"] = round(t_pub - t0, 3)

        # completion detection: poll middles' shard dirs and clients' result files
        nshards = (a.size_mb * (1 << 20) + a.shard_size - 1) // a.shard_size
        mid_done, cli_done = {}, {}
        deadline = t0 + a.timeout
        while len(cli_done) < N:
            now = time.time()
            if now > deadline:
                raise TimeoutError(
                    f"broadcast not finished after {a.timeout}s "
                    f"(middles done {sorted(mid_done)}, clients done {sorted(cli_done)})"
                )
            for i, d in enumerate(mdirs):
                if i not in mid_done:
                    vd = os.path.join(d, "data", "v1")
                    if os.path.isdir(vd) and sum(1 for x in os.listdir(vd) if x.endswith(".bin")) == nshards:
                        mid_done[i] = now
            for i, d in enumerate(cdirs):
                if i in cli_done:
                    continue
                rf = os.path.join(d, "result.json")
                if os.path.exists(rf):
                    with open(rf) as f:
                        r = json.load(f)
                    if not r["ok"]:
                        raise RuntimeError(f"client{i} failed (checksum or download), see client{i}.log")
                    cli_done[i] = r
                else:
                    pr = procs.procs[1 + M + i][1]
                    if pr.poll() is not None:
                        raise RuntimeError(f"client{i} exited rc={pr.returncode} without result")
            procs.check_alive()
            time.sleep(0.01)
        t_end = max(r["t_done"] for r in cli_done.values())
        res["middle_complete_s"] = [round(mid_done[i] - t0, 3) for i in sorted(mid_done)]
        res["client_seen_s"] = [round(cli_done[i]["t_seen"] - t0, 3) for i in range(N)]
        res["client_done_s"] = [round(cli_done[i]["t_done"] - t0, 3) for i in range(N)]
        res["total_s"] = round(t_end - t0, 3)
        res["total_from_visible_s"] = round(t_end - t_pub, 3)
        # independent verification (not timed)
        want = blake3_file(payload)
        for i, d in enumerate(cdirs):
            f = os.path.join(d, "downloads", "ckpt.bin")
            assert os.path.getsize(f) == a.size_mb << 20 and blake3_file(f) == want, f"client{i} bad file"
        res["verified"] = True
        res["ok"] = True
    except BaseException as e:
        res["ok"] = False
        res["error"] = f"{type(e).__name__}: {e}"
    finally:
        procs.stop_all()
        if not a.keep:
            shutil.rmtree(root, ignore_errors=True)
    print(json.dumps(res))
    return 0 if res["ok"] else 1


def main():
    if len(sys.argv) > 1 and sys.argv[1] == "_node":
        sys.exit(node_main(sys.argv[2:]))
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size-mb", type=int, default=64)
    p.add_argument("--middles", type=int, default=1)
    p.add_argument("--clients", type=int, default=4)
    p.add_argument("--base-port", type=int, default=18100)
    p.add_argument("--topology", help="JSON topology (ips/ports/prefixes); overrides --middles/--clients/--base-port")
    p.add_argument(
        "--check-interval",
        type=float,
        default=30,
        help="middle poll interval (shardcast default 30; anything else is NOT the stock baseline)",
    )
    p.add_argument("--client-poll", type=float, default=1.0, help="client poll of list_available_versions()")
    p.add_argument("--shard-size", type=int, default=50_000_000, help="SHARDCAST_SHARD_SIZE (default 50e6)")
    p.add_argument("--probe-bytes", type=int, default=1 << 20, help="size of data1.bin served by each server")
    p.add_argument(
        "--publish-delay",
        type=float,
        default=0.0,
        help="wait this long after all nodes are ready before publishing (poll phase control)",
    )
    p.add_argument("--timeout", type=float, default=120)
    p.add_argument("--workdir", default="/tmp/shardcast-baseline-run")
    p.add_argument("--keep", action="store_true", help="keep workdir (logs) after the run")
    p.add_argument("--no-isolate", action="store_true", help="do not relocate shardcast's fixed temp files")
    p.add_argument("--log-level", default="INFO")
    sys.exit(driver(p.parse_args()))


if __name__ == "__main__":
    main()
