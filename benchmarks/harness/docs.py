"""Benchmark tables into the docs: a page marks each table's place with ``<!-- NAME:begin -->`` and
``<!-- NAME:end -->``, and ``--write-doc PAGE`` replaces what lies between (chaos.py, fuzz.py)."""

from __future__ import annotations

from pathlib import Path


def write_doc(path: Path, text: str, marker: str) -> None:
    doc = path.read_text()
    begin, end = f"<!-- {marker}:begin -->", f"<!-- {marker}:end -->"
    if begin not in doc or end not in doc:
        raise SystemExit(f"{path} has no {begin} ... {end} block to replace")
    head, rest = doc.split(begin, 1)
    _, tail = rest.split(end, 1)
    path.write_text(f"{head}{begin}\n{text}\n{end}{tail}")
