"""What every test run shares: the unit layer starts no nodes, DHTs or libp2p daemons.

``python -m pytest -m 'not integration and not vllm'`` is the unit layer, meant to take well under a minute.
A test that starts a node process (``NodeProcess``), a DHT (``Membership.start``, hivemind's ``DHT``) or a
libp2p daemon (``P2P.create``) must carry the ``integration`` marker (pyproject.toml): without it the start is
refused and the test fails, saying so. The check covers these entry points in every module that the collected
test modules import; a test that imports one only inside its body, in a run where no collected module imports
it at the top, is not checked.
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable, Iterator
from typing import Any

import pytest

GUARDED = (
    ("intellect_node.launch", "NodeProcess", "__init__"),
    ("intellect_node.p2p.dht", "Membership", "start"),
    ("hivemind.dht.dht", "DHT", "__init__"),
    ("hivemind.p2p.p2p_daemon", "P2P", "create"),
)
"""(module, class, method) of each way a test starts a node, a DHT or a daemon."""

_running: list[pytest.Item] = []
_started: dict[str, list[str]] = {}
_patches = pytest.MonkeyPatch()


def _check(what: str) -> None:
    item = _running[-1] if _running else None
    if item is None or item.get_closest_marker("integration") is not None:
        return
    _started.setdefault(item.nodeid, []).append(what)
    raise RuntimeError(f"{item.nodeid} starts {what}: mark it @pytest.mark.integration (or its module: pytestmark)")


def _guard(cls: type, name: str) -> None:
    what = f"{cls.__name__}.{name}"
    raw = cls.__dict__[name]
    if isinstance(raw, classmethod):
        inner = raw.__func__

        @functools.wraps(inner)
        def guarded_classmethod(owner: type, *args: Any, **kwargs: Any) -> Any:
            _check(what)
            return inner(owner, *args, **kwargs)

        _patches.setattr(cls, name, classmethod(guarded_classmethod))
        return
    method: Callable[..., Any] = raw

    @functools.wraps(method)
    def guarded(*args: Any, **kwargs: Any) -> Any:
        _check(what)
        return method(*args, **kwargs)

    _patches.setattr(cls, name, guarded)


def pytest_collection_finish(session: pytest.Session) -> None:
    for module, cls, name in GUARDED:
        if module in sys.modules:
            _guard(getattr(sys.modules[module], cls), name)


def pytest_sessionfinish(session: pytest.Session) -> None:
    _patches.undo()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
    _running.append(item)
    try:
        yield
    finally:
        _running.pop()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Iterator[None]:
    outcome = yield
    if call.when == "call" and outcome.get_result().failed:
        _started.pop(item.nodeid, None)  # the refusal failed it already: one report is enough


@pytest.fixture(autouse=True)
def _unit_tests_start_no_nodes(request: pytest.FixtureRequest) -> Iterator[None]:
    """Fails a test without the marker that started a node even where the code under test swallowed the refusal."""
    yield
    started = _started.pop(request.node.nodeid, None)
    if started:
        pytest.fail(f"started {', '.join(started)} without the integration marker", pytrace=False)
