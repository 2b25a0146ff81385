"""The layout stays true: subsystems depend one way (entry points -> roles -> subsystems -> protocol, kernels).

Reads every module's imports with ``ast`` (imports inside functions included) and fails on any import against
that direction; a module past the size the style guide asks about is flagged for review (a warning).
"""

from __future__ import annotations

import ast
import shutil
import warnings
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
NODE = ROOT / "node"

SUBSYSTEMS = ("p2p", "weights", "policy", "judging", "roles")
SHARED = ("config", "runtime")
"""Top-level modules every role's process shares: a role may import them, a subsystem may not."""
ENTRY = ("cli", "demo", "doctor", "launch")
BASE = ("aio",)
"""Below every subsystem: imports nothing from node/, and anything may import it."""
ALLOWED: dict[str, set[str]] = {
    "p2p": {"p2p", *BASE},
    "policy": {"policy", *BASE},
    "weights": {"weights", "p2p", *BASE},
    "judging": {"judging", "policy", *BASE},
    "roles": {"roles", "p2p", "weights", "policy", "judging", *SHARED, *BASE},
    "config": set(),
    "runtime": {*BASE},
    "aio": set(),
    **{e: {*SUBSYSTEMS, *SHARED, *ENTRY, *BASE} for e in ENTRY},
}
"""What each part of node/ may import from node/ (besides the package's ``__version__``)."""


def _group(module: str) -> str:
    """``intellect_node.weights.store`` -> ``weights``; the package itself -> ``""``."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def _module_of(path: Path, package: str, folder: Path) -> str:
    rel = path.relative_to(folder).with_suffix("")
    parts = [p for p in rel.parts if p != "__init__"]
    return ".".join([package, *parts])


def _imports(path: Path) -> list[tuple[int, str]]:
    """(line, imported module) for every import in the file; ``from X import y`` also yields ``X.y`` so that
    ``from intellect_node import fsdp`` counts as importing that module."""
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module:
            if node.level:  # relative imports are not used in this project: resolve them anyway
                raise AssertionError(f"{path}:{node.lineno}: relative import; use the absolute intellect_* name")
            out.append((node.lineno, node.module))
            out += [(node.lineno, f"{node.module}.{alias.name}") for alias in node.names]
    return out


def _violations(root: Path = ROOT) -> list[str]:
    bad = []
    node = root / "node"
    node_modules = {_module_of(p, "intellect_node", node) for p in node.rglob("*.py")}
    for path in sorted(node.rglob("*.py")):
        group = _group(_module_of(path, "intellect_node", node))
        for line, name in _imports(path):
            if not name.startswith("intellect_node."):
                continue
            if name not in node_modules:  # ``from intellect_node import __version__`` and the like
                continue
            target = _group(name)
            if target != "" and target not in ALLOWED.get(group, set()):
                bad.append(f"node/{path.relative_to(node)}:{line}: {group or 'package'} imports {name}")
    for folder, package in ((root / "protocol", "intellect_protocol"), (root / "kernels", "intellect_kernels")):
        for path in sorted(folder.rglob("*.py")):
            for line, name in _imports(path):
                own = name == package or name.startswith(package + ".")
                if name.startswith("intellect_") and not own:
                    bad.append(f"{folder.name}/{path.relative_to(folder)}:{line}: {package} imports {name}")
    return bad


def test_imports_follow_the_layers() -> None:
    assert _violations() == []


def test_the_check_sees_a_violation(tmp_path: Path) -> None:
    """A subsystem importing a role, and protocol importing node, are reported (the check can fail)."""
    for folder in ("node", "protocol", "kernels"):
        shutil.copytree(ROOT / folder, tmp_path / folder, ignore=shutil.ignore_patterns("__pycache__"))
    assert _violations(tmp_path) == []
    probe = tmp_path / "node" / "weights" / "_layout_probe.py"
    probe.write_text("def f():\n    from intellect_node.roles import trainer\n")
    (tmp_path / "protocol" / "_layout_probe.py").write_text("import intellect_node.p2p.keys\n")
    found = _violations(tmp_path)
    assert any("_layout_probe.py:2: weights imports intellect_node.roles" in v for v in found), found
    assert any("protocol/_layout_probe.py:1: intellect_protocol imports intellect_node" in v for v in found), found


def test_top_level_holds_only_entry_points() -> None:
    modules = sorted(p.stem for p in NODE.glob("*.py"))
    assert len(modules) <= 10, modules
    assert set(modules) <= {"__init__", *SHARED, *ENTRY, *BASE}, modules
    for sub in SUBSYSTEMS:
        doc = ast.get_docstring(ast.parse((NODE / sub / "__init__.py").read_text()))
        assert doc and "May import" in doc, f"node/{sub}/__init__.py must say what it owns and may import"


REVIEW_LINES = 800
"""A module past this many lines is a question for review (does it hold two services?), not a failure: the
formatter decides layout, responsibilities decide splits (shared/STYLE.md)."""


def test_a_module_past_the_review_size_is_flagged_for_review() -> None:
    sizes = {
        str(p.relative_to(ROOT)): len(p.read_text().splitlines())
        for folder in ("node", "protocol", "kernels")
        for p in (ROOT / folder).rglob("*.py")
    }
    for name, n in sorted(sizes.items()):
        if n > REVIEW_LINES:
            warnings.warn(f"{name} has {n} lines: does it hold more than one service or idea?", stacklevel=1)


@pytest.mark.integration
def test_the_kernels_folder_does_not_hide_hugging_faces_kernels_from_code_run_at_the_root() -> None:
    """``python -m pytest`` (or any ``python -m``) run at the repository's root puts the root on ``sys.path``, where
    the ``kernels`` folder shadowed the ``kernels`` distribution that transformers 5.25 depends on: every test
    that imports the model failed to collect. Imported as ``kernels`` it hands the name to the installed one."""
    import importlib.metadata
    import subprocess
    import sys

    code = "import kernels, sys; print(kernels.__file__); from transformers import LlamaConfig"
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    try:
        importlib.metadata.version("kernels")
    except importlib.metadata.PackageNotFoundError:  # none installed (transformers < 5.25): the folder, as before
        return
    assert not Path(done.stdout.strip()).is_relative_to(ROOT), done.stdout


def test_every_package_folder_is_installed() -> None:
    """A non-editable install (the Docker image, ``pip install .``) holds only the packages pyproject.toml lists:
    a new subpackage missing there imports here (editable) and fails in the image."""
    import tomllib

    listed = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    names = {"node": "intellect_node", "protocol": "intellect_protocol", "kernels": "intellect_kernels"}
    found = {
        ".".join([names[init.relative_to(ROOT).parts[0]], *init.relative_to(ROOT).parts[1:-1]])
        for top in names
        for init in (ROOT / top).rglob("__init__.py")
    }
    assert found == listed, f"in pyproject.toml but not a package: {listed - found}; not listed: {found - listed}"
