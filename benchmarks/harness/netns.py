"""Test hosts in Linux network namespaces: a bridge, one namespace per host, each host's upload shaped by tc.

Every namespace and link made here carries the prefix given to ``Topology`` and is removed by ``close()``,
which also runs on failure (use it as a context manager). Addresses are 10.77.<net>.0/24 inside namespaces this
code created; nothing is routed anywhere else.
"""

from __future__ import annotations

import os
import subprocess
from dataclasses import dataclass


def run(*cmd: str) -> None:
    subprocess.run(cmd, check=True, capture_output=True, text=True)


def available() -> bool:
    """Root, iproute2 and tc present, and a namespace can actually be made."""
    if os.geteuid() != 0:
        return False
    probe = f"inprobe{os.getpid()}"
    try:
        run("ip", "netns", "add", probe)
        run("ip", "netns", "del", probe)
        return True
    except (OSError, subprocess.CalledProcessError):
        return False


@dataclass
class Host:
    name: str
    ns: str
    ip: str

    @property
    def prefix(self) -> list[str]:
        return ["ip", "netns", "exec", self.ns]


class Topology:
    def __init__(self, prefix: str, hosts: int, mbit: float, net: int = 77) -> None:
        self.prefix = prefix
        self.bridge_ns = f"{prefix}br"
        self.hosts: list[Host] = []
        self._made: list[str] = []
        try:
            self._add_ns(self.bridge_ns)
            run("ip", "-n", self.bridge_ns, "link", "add", "br0", "type", "bridge")
            run("ip", "-n", self.bridge_ns, "link", "set", "br0", "up")
            for i in range(hosts):
                ns = f"{prefix}h{i}"
                self._add_ns(ns)
                inner, outer = f"{prefix}v{i}", f"{prefix}b{i}"
                run("ip", "link", "add", inner, "type", "veth", "peer", "name", outer)
                run("ip", "link", "set", inner, "netns", ns)
                run("ip", "link", "set", outer, "netns", self.bridge_ns)
                run("ip", "-n", self.bridge_ns, "link", "set", outer, "master", "br0", "up")
                ip = f"10.{net}.0.{i + 1}"
                run("ip", "-n", ns, "addr", "add", f"{ip}/24", "dev", inner)
                run("ip", "-n", ns, "link", "set", inner, "up")
                run("ip", "-n", ns, "link", "set", "lo", "up")
                # The host's upload: everything it sends leaves through this veth at `mbit`.
                run(
                    "tc",
                    "-n",
                    ns,
                    "qdisc",
                    "add",
                    "dev",
                    inner,
                    "root",
                    "tbf",
                    "rate",
                    f"{mbit}mbit",
                    "burst",
                    "256kb",
                    "latency",
                    "200ms",
                )
                self.hosts.append(Host(f"h{i}", ns, ip))
        except BaseException:
            self.close()
            raise

    def _add_ns(self, ns: str) -> None:
        subprocess.run(["ip", "netns", "del", ns], capture_output=True)  # a leftover of a killed run
        run("ip", "netns", "add", ns)
        self._made.append(ns)

    def close(self) -> None:
        for ns in reversed(self._made):  # deleting a namespace removes its veth ends and qdiscs too
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
        self._made.clear()

    def __enter__(self) -> Topology:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
