"""A short fuzzing run in CI: every target of benchmarks/fuzz.py (decoders, schemas, DHT validation, stream frames,
HTTP routes, the trainer's submit handler) for a few hundred coverage-guided inputs each; none may crash or hang.
The full run (100,000 inputs per target) is the benchmark: ``python benchmarks/fuzz.py``."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

FUZZ = Path(__file__).resolve().parent.parent / "benchmarks" / "fuzz.py"


def test_every_decoder_and_handler_a_peer_reaches_survives_a_short_fuzzing_run(tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, str(FUZZ), "--runs", "400", "--out", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    summary = proc.stdout.strip().splitlines()[-1] if proc.stdout.strip() else ""
    assert proc.returncode == 0, proc.stdout + proc.stderr[-4000:]
    assert summary.startswith("fuzz targets=21 ") and summary.endswith(" crashes=0 hangs=0"), summary
    inputs = int(summary.split("inputs=")[1].split()[0])
    assert inputs >= 15 * 400, summary
