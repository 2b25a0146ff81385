"""The dashboard in a real headless browser, against a running swarm (run by hand; not part of CI).

Starts a trainer and an inference node on loopback (the tiny run), opens each node's ``/`` in headless Chromium
driven by Selenium, and checks that the page loads without a console error, that the trainer's page shows its
step advancing by itself (the page refreshes from /status), and that the inference node's page shows its
rollouts. Saves a screenshot of the trainer's page to docs/dashboard.png. Prints one summary line:
    browser pages=2 console_errors=0 step_before=... step_after=... screenshot=docs/dashboard.png

Needs ``apt-get install chromium chromium-driver`` and ``pip install selenium``.

    python scripts/browser_check.py [--out docs/dashboard.png]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

from selenium import webdriver
from selenium.webdriver.chrome.service import Service
from selenium.webdriver.common.by import By

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from intellect_node.launch import NodeProcess, join_argv  # noqa: E402


def browser() -> webdriver.Chrome:
    options = webdriver.ChromeOptions()
    options.binary_location = "/usr/bin/chromium"
    for arg in ("--headless=new", "--no-sandbox", "--disable-gpu", "--window-size=1400,1250"):
        options.add_argument(arg)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    return webdriver.Chrome(service=Service("/usr/bin/chromedriver"), options=options)


def step_shown(driver: webdriver.Chrome) -> int:
    return int(driver.find_element(By.ID, "step").text)


def wait_for(predicate, timeout: float, what: str):  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            value = predicate()
            if value:
                return value
        except Exception:  # the element is not rendered yet
            pass
        time.sleep(0.5)
    raise SystemExit(f"timed out waiting for {what}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=ROOT / "docs" / "dashboard.png")
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="browser-check-"))
    nodes: list[NodeProcess] = []
    driver = None
    try:
        trainer = NodeProcess(
            "trainer", ["bootstrap", "--data-dir", str(work / "t"), "--max-steps", "400"], work / "logs"
        )
        nodes.append(trainer)
        ready = trainer.wait_ready(timeout=120)
        worker = NodeProcess("inference", join_argv("inference", ready, work / "i"), work / "logs")
        nodes.append(worker)
        worker_ready = worker.wait_ready(timeout=120)
        trainer.wait_for_line("STEP 3 ", timeout=300)

        driver = browser()
        errors: list[str] = []
        driver.get(ready["status_url"] + "/")
        before = wait_for(lambda: step_shown(driver) or None, 30, "the trainer's step on the page")
        after = wait_for(lambda: (s := step_shown(driver)) > before and s, 60, "the page's step to advance")
        wait_for(lambda: "accuracy" in driver.page_source and "polyline" in driver.page_source, 30, "the curves")
        time.sleep(3)  # a few refreshes more, for the screenshot's curves
        args.out.parent.mkdir(parents=True, exist_ok=True)
        driver.save_screenshot(str(args.out))
        errors += [e["message"] for e in driver.get_log("browser") if e["level"] == "SEVERE"]

        driver.get(worker_ready["status_url"] + "/")
        wait_for(lambda: "batches made" in driver.page_source, 30, "the inference node's rollouts")
        time.sleep(3)
        errors += [e["message"] for e in driver.get_log("browser") if e["level"] == "SEVERE"]
        for e in errors:
            print("console error:", e)
        print(
            f"browser pages=2 console_errors={len(errors)} step_before={before} step_after={after} "
            f"screenshot={args.out.relative_to(ROOT) if args.out.is_relative_to(ROOT) else args.out}"
        )
        if errors:
            raise SystemExit(1)
    finally:
        if driver is not None:
            driver.quit()
        for node in reversed(nodes):
            node.stop()


if __name__ == "__main__":
    main()
