"""The launcher the demo, the benchmarks and the tests start nodes with: a node that dies is noticed at once, even
when a process it started still holds its output open (the demo waited for ever on a trainer the OOM killer had
taken, its DHT process keeping the pipe open)."""

from __future__ import annotations

import sys
import textwrap
from pathlib import Path

import pytest

from intellect_node.launch import NodeExited, NodeProcess

pytestmark = pytest.mark.integration


def test_a_node_that_dies_is_noticed_though_its_child_keeps_its_output_open(tmp_path: Path) -> None:
    script = textwrap.dedent(
        """
        import os, signal, subprocess, sys
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])  # inherits stdout
        print("READY {}", flush=True)
        os.kill(os.getpid(), signal.SIGKILL)
        """
    )
    node = NodeProcess("dies", [], tmp_path, command=[sys.executable, "-c", script])
    try:
        node.wait_ready(timeout=60)
        with pytest.raises(NodeExited, match="exited with -9"):  # not TimeoutError after 60 s: its exit
            node.wait_for_line("STEP ", timeout=60)
    finally:
        node.stop()
