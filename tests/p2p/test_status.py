"""``/status``: public, polled by dashboards and benchmarks, and it carries the trainer's whole step history."""

from __future__ import annotations

import asyncio
import json
import shutil
import subprocess
import time

import aiohttp
import pytest
from aiohttp import web

from intellect_node.p2p.http import (
    DASHBOARD,
    PUBLIC_RATE_PER_ADDRESS,
    EncodedList,
    HttpServer,
    Tarpit,
    encode_status,
    source_of,
)
from intellect_node.p2p.metrics import Metrics


def test_status_with_an_encoded_history_is_the_same_json() -> None:
    history = EncodedList([{"step": 1, "loss": 0.5}])
    history.append({"step": 2, "loss": float("0.25"), "note": 'quote " and \\ backslash'})
    empty = EncodedList()
    for status in ({"role": "trainer", "history": history, "step": 2}, {"history": history}, {"history": empty}):
        assert json.loads(encode_status(status)) == json.loads(json.dumps(status))
    history[0] = {"step": 0}  # changed in place (not by append): encoded again, never served stale
    assert json.loads(encode_status({"history": history}))["history"][0] == {"step": 0}


def test_status_served_over_http_grows_with_each_step() -> None:
    history = EncodedList()
    state = {"role": "trainer", "step": 0}

    async def main() -> list[dict[str, object]]:
        http = HttpServer(Metrics(), lambda: {**state, "history": history})
        port = await http.start("127.0.0.1", 0)
        seen = []
        try:
            async with aiohttp.ClientSession() as session:
                for step in range(1, 4):
                    history.append({"step": step})
                    state["step"] = step
                    async with session.get(f"http://127.0.0.1:{port}/status") as r:
                        assert r.status == 200 and r.content_type == "application/json"
                        seen.append(await r.json())
        finally:
            await http.close()
        return seen

    seen = asyncio.run(main())
    assert [s["step"] for s in seen] == [1, 2, 3]
    assert seen[-1]["history"] == [{"step": 1}, {"step": 2}, {"step": 3}]


def test_a_client_that_holds_the_history_asks_only_for_what_came_after() -> None:
    """``/status?since=N`` carries the history from entry N on (the dashboard asks every 2 s, and a long run's
    history is megabytes), says which part it is, and refuses a ``since`` that is not a count."""
    history = EncodedList({"step": i} for i in range(1, 6))

    async def main() -> tuple[list[dict[str, object]], int]:
        http = HttpServer(Metrics(), lambda: {"role": "trainer", "step": 5, "history": history})
        port = await http.start("127.0.0.1", 0)
        try:
            async with aiohttp.ClientSession() as session:
                answers = []
                for query in ("", "?since=0", "?since=3", "?since=99"):
                    async with session.get(f"http://127.0.0.1:{port}/status{query}") as r:
                        assert r.status == 200
                        answers.append(await r.json())
                async with session.get(f"http://127.0.0.1:{port}/status?since=-1") as r:
                    bad = r.status
        finally:
            await http.close()
        return answers, bad

    (whole, since0, since3, past), bad = asyncio.run(main())
    assert whole["history"] == since0["history"] == [{"step": i} for i in range(1, 6)] and "history_from" not in whole
    assert (since3["history"], since3["history_from"], since3["history_len"]) == ([{"step": 4}, {"step": 5}], 3, 5)
    assert (past["history"], past["history_from"], past["history_len"]) == ([], 5, 5)
    assert since3["step"] == 5 and since3["started"] == whole["started"] > 0
    assert bad == 400


@pytest.mark.skipif(shutil.which("node") is None, reason="needs Node.js to run the dashboard's script")
def test_the_dashboard_keeps_the_history_it_read_and_reads_it_whole_after_a_restart() -> None:
    """The page's ``withHistory`` (run in Node.js as the page has it): appends each answer's tail to what it kept,
    and starts over when the node restarted (a new ``started``) or the history shrank."""
    page = DASHBOARD.decode()
    code = page[page.index("let kept = ") : page.index("async function refresh()")]
    run = subprocess.run(["node", "-e", code + DASHBOARD_CASES], capture_output=True, text=True, timeout=30)
    assert run.returncode == 0, run.stderr
    assert json.loads(run.stdout) == [
        [2, [1, 2]],
        [3, [1, 2, 3]],
        [3, [1, 2, 3]],
        [0, []],
        [4, [1, 2, 3, 4]],
        [2, [1, 2]],
        [2, []],
        [0, [1]],
        1,  # after the restart, read whole at once rather than at the next refresh
    ]


DASHBOARD_CASES = """
let reread = 0;
const refresh = () => { reread += 1; };
const setTimeout = (f) => f();
const out = [];
const ask = (s) => { const r = withHistory(s); out.push([kept.history.length, (r.history || []).map((h) => h.step)]); };
ask({started: 1, history: [{step: 1}, {step: 2}], history_from: 0, history_len: 2});
ask({started: 1, history: [{step: 3}], history_from: 2, history_len: 3});
ask({started: 1, history: [], history_from: 3, history_len: 3});
ask({started: 2, history: [{step: 4}], history_from: 3, history_len: 4});  // restarted: read whole next time
ask({started: 2, history: [{step: 1}, {step: 2}, {step: 3}, {step: 4}], history_from: 0, history_len: 4});
ask({started: 2, history: [], history_from: 2, history_len: 2});  // shrank (resumed from an older step)
ask({role: "relay"});
ask({started: 3, history: [{step: 1}]});  // a history sent whole (no history_from): shown as it is
out.push(reread);
console.log(JSON.stringify(out));
"""
"""What the page's ``withHistory`` is given in turn (a stand-in ``refresh`` counts the reads it asks for at once)."""


def test_a_client_polling_the_public_routes_in_a_loop_is_refused_past_its_rate_and_others_are_not() -> None:
    """A stranger asking /status (the trainer's whole history: megabytes in a long run) or a role's public listing as
    fast as the node answers gets 429 past PUBLIC_RATE_PER_ADDRESS a second, counted, before any work; another
    address is still answered, and routes paced on their own (/weights, /relay) are not limited here."""
    built, took = [0], [0.0]

    def status() -> dict[str, object]:
        built[0] += 1
        return {"role": "trainer", "history": EncodedList([{"step": i} for i in range(1000)])}

    async def shard(_request: web.Request) -> web.Response:
        return web.Response(body=b"x")

    async def main() -> tuple[dict[int, int], dict[int, int], int, int, int]:
        metrics = Metrics()
        http = HttpServer(metrics, status, [web.get("/weights/{v}/{name}", shard)])
        port = await http.start("127.0.0.1", 0)
        statuses: dict[int, int] = {}
        shards: dict[int, int] = {}
        try:
            async with aiohttp.ClientSession() as session:
                started = time.monotonic()
                for _ in range(int(6 * PUBLIC_RATE_PER_ADDRESS)):  # a burst well past twice the rate
                    async with session.get(f"http://127.0.0.1:{port}/status") as r:
                        statuses[r.status] = statuses.get(r.status, 0) + 1
                        if r.status == 429:
                            assert r.headers["Retry-After"] == "1" and (await r.json())["error"] == "rate"
                took[0] = time.monotonic() - started
                async with session.get(f"http://127.0.0.1:{port}/health") as r:  # never limited: a node looks alive
                    health = r.status
                for _ in range(int(4 * PUBLIC_RATE_PER_ADDRESS)):
                    async with session.get(f"http://127.0.0.1:{port}/weights/1/a") as r:
                        shards[r.status] = shards.get(r.status, 0) + 1
            other_address = aiohttp.TCPConnector(local_addr=("127.0.0.2", 0))
            async with aiohttp.ClientSession(connector=other_address) as elsewhere:
                async with elsewhere.get(f"http://127.0.0.1:{port}/health") as r:
                    other = r.status
        finally:
            await http.close()
        return statuses, shards, other, int(metrics.counter("node_http_refused_total", "rate")), health

    statuses, shards, other, refused, health = asyncio.run(main())
    assert statuses.get(429, 0) >= 1, statuses
    allowed = 2 * PUBLIC_RATE_PER_ADDRESS + PUBLIC_RATE_PER_ADDRESS * took[0] + 1  # the burst, and what refilled
    assert built[0] == statuses[200] <= allowed, "a refused request must build nothing"
    assert (refused, shards, other, health) == (statuses[429], {200: int(4 * PUBLIC_RATE_PER_ADDRESS)}, 200, 200)
    # an IPv6 client rotating through its /64 shares one bucket; an IPv4 client of a dual-stack socket is itself
    assert source_of("2001:db8::1") == source_of("2001:db8::ffff:1") != source_of("2001:db8:0:1::1")
    assert source_of("::ffff:10.0.0.1") == "10.0.0.1" and source_of(None) == "?"


def test_a_refusal_for_the_rate_is_held_before_it_goes_out() -> None:
    """An HTTP/1.1 connection carries one request at a time: held, a refusal stalls its connection, so a flood gets
    about one request per connection per hold instead of refusals as fast as it asks."""
    hold = 0.3

    async def main() -> list[tuple[int, float, str]]:
        http = HttpServer(Metrics(), lambda: {"role": "trainer"}, rate=0.001, burst=1)  # one request, then none
        http.tarpit = Tarpit(hold_s=hold)
        port = await http.start("127.0.0.1", 0)
        answers = []
        try:
            async with aiohttp.ClientSession() as session:
                for _ in range(3):
                    started = time.monotonic()
                    async with session.get(f"http://127.0.0.1:{port}/status") as r:
                        answers.append((r.status, time.monotonic() - started, r.headers.get("Connection", "")))
        finally:
            await http.close()
        return answers

    (ok, *refused) = asyncio.run(main())
    assert ok[0] == 200 and [a[0] for a in refused] == [429, 429]
    assert all(took >= hold and connection.lower() != "close" for _, took, connection in refused), refused


def test_past_the_held_bound_a_refusal_goes_out_at_once_and_closes_its_connection() -> None:
    """Held answers are bounded per address and in all: past either, a flood's refusal is not held but closes its
    connection, so each further request costs its sender a new connection; another address still has its share."""

    async def main() -> tuple[list[str], list[str], int]:
        http = HttpServer(Metrics(), lambda: {"role": "trainer"}, rate=0.001, burst=1)
        http.tarpit = Tarpit(hold_s=60.0, per_source=2, total=3)  # held until the server closes
        port = await http.start("127.0.0.1", 0)
        url = f"http://127.0.0.1:{port}/status"

        async def ask(session: aiohttp.ClientSession) -> str:
            async with session.get(url) as r:
                assert r.status == 429
                return "close" if r.headers.get("Connection", "").lower() == "close" else "held"

        async def until_holding(n: int) -> None:
            while http.tarpit.holding < n:
                await asyncio.sleep(0.01)

        async with (
            aiohttp.ClientSession() as here,
            aiohttp.ClientSession(connector=aiohttp.TCPConnector(local_addr=("127.0.0.2", 0))) as there,
        ):
            try:
                for session in (here, there):
                    async with session.get(url) as r:  # each address's one allowed request
                        assert r.status == 200
                held = [asyncio.create_task(ask(here)) for _ in range(2)]
                await until_holding(2)
                past_address = [await ask(here) for _ in range(2)]  # this address has two held
                held.append(asyncio.create_task(ask(there)))
                await until_holding(3)
                past_total = [await ask(there), await ask(here)]  # three held in all
                still_held = sum(not t.done() for t in held)
            finally:
                await http.close()
                await asyncio.gather(*held, return_exceptions=True)
        return past_address, past_total, still_held

    past_address, past_total, still_held = asyncio.run(main())
    assert past_address == ["close", "close"] and past_total == ["close", "close"]
    assert still_held == 3


def test_the_dashboard_is_one_self_contained_page_that_may_talk_to_its_node_only() -> None:
    """Works offline (nothing loaded from elsewhere: no CDN, no build step), and the browser is told so (CSP)."""

    async def main() -> tuple[int, str, str, str]:
        http = HttpServer(Metrics(), lambda: {"role": "relay"})
        port = await http.start("127.0.0.1", 0)
        try:
            async with aiohttp.ClientSession() as session:
                async with session.get(f"http://127.0.0.1:{port}/") as r:
                    return r.status, r.content_type, r.headers.get("Content-Security-Policy", ""), await r.text()
        finally:
            await http.close()

    status, ctype, csp, page = asyncio.run(main())
    assert status == 200 and ctype == "text/html"
    assert "default-src 'none'" in csp and "connect-src 'self'" in csp
    assert "http://" not in page and "https://" not in page and "src=" not in page  # no external script or image
    assert '<link rel="icon" href="data:,">' in page  # no favicon request (a 404 in every browser's console)
    assert "fetch(`status?since=" in page and "setInterval(refresh" in page  # it refreshes itself from its own node
    assert "esc(" in page  # peer-controlled strings (ids, reasons) are escaped before they are shown


def test_every_metric_the_code_names_says_what_it_counts_and_labels_are_named_for_what_they_hold() -> None:
    """A scrape's HELP line is what an operator reads on a dashboard: never the metric's name again (26 of 57 were,
    found in review). Every metric named in node/ gets a help where it is counted or in ``metrics.HELP``."""
    import re
    from pathlib import Path

    from intellect_node.p2p.metrics import HELP, LABEL_NAMES

    root = Path(__file__).resolve().parents[2] / "node"
    named: dict[str, bool] = {}
    for path in root.rglob("*.py"):
        for m in re.finditer(r'\.(?:inc|set|observe)\(\s*"(node_[a-z0-9_]+)"(.*?)\)\n', path.read_text(), re.S):
            named[m.group(1)] = named.get(m.group(1), False) or "help=" in m.group(2)
    assert len(named) > 80  # the scan finds them
    assert sorted(n for n, helped in named.items() if not helped and n not in HELP) == []
    assert set(HELP) <= set(named) and set(LABEL_NAMES) <= set(named)  # no help for a metric that is gone

    metrics = Metrics()
    metrics.inc("node_dht_stores_total", label="nodes")
    metrics.inc("node_relay_requests_refused_total", label="no_slot")
    metrics.inc("node_trainer_steps_total")
    text = metrics.render()
    assert 'node_dht_stores_total{key="nodes"} 1.0' in text
    assert 'node_relay_requests_refused_total{reason="no_slot"} 1.0' in text
    assert "# HELP node_trainer_steps_total training steps taken by this process" in text
