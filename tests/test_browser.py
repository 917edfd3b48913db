"""The dashboard in a real browser: `workbench dashboard` (Voila) opened in Debian's Chromium
through playwright. Send concurrent requests, watch text stream and the timeline fill, change
the block size, apply, and see the rebuilt engine report it. Screenshots are kept in
$WORKBENCH_ARTIFACTS (default: artifacts/ in the repository)."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

playwright_api = pytest.importorskip("playwright.sync_api")
pytest.importorskip("voila")
httpx = pytest.importorskip("httpx")

from test_operations import wait_until  # noqa: E402
from test_server import free_port, stop_process  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
         "--disable-component-update", "--disable-sync", "--no-first-run"]
ARTIFACTS = Path(os.environ.get("WORKBENCH_ARTIFACTS", ROOT / "artifacts"))

pytestmark = pytest.mark.skipif(not Path(CHROMIUM).exists(),
                                reason="Debian's chromium is not installed (apt-get install -y chromium)")


@pytest.fixture
def dashboard(smollm2_dir, tmp_path):
    port = free_port()
    log_path = tmp_path / "dashboard.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen([sys.executable, "-m", "workbench.cli", "dashboard", "--device",
                                 "cpu", "--port", str(port)], cwd=ROOT, stdout=log,
                                stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}/"
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            if httpx.get(url + "api/status", timeout=2.0).status_code < 500:
                break
        except httpx.HTTPError:
            time.sleep(0.25)
    else:
        stop_process(proc)
        pytest.fail(f"voila did not come up:\n{log_path.read_text(errors='replace')[-3000:]}")
    yield url, log_path
    stop_process(proc)


def text_length(page) -> int:
    return page.evaluate("() => [...document.querySelectorAll('.wb .card .txt')]"
                         ".reduce((n, e) => n + e.innerText.length, 0)")


def bar_points(page) -> int:
    return page.evaluate("() => document.querySelectorAll('.js-plotly-plot .barlayer .point').length")


def wait_for(predicate, timeout: float, what: str, page, shot: str):
    def screenshot() -> str:
        page.screenshot(path=str(ARTIFACTS / shot), full_page=True)
        return f"; screenshot in {ARTIFACTS / shot}"
    return wait_until(predicate, timeout, what, detail=screenshot)


def test_dashboard_streams_and_rebuilds_in_chromium(dashboard):
    url, log_path = dashboard
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    with playwright_api.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=FLAGS, headless=True)
        try:
            page = browser.new_page(viewport={"width": 1500, "height": 1200})
            errors: list[str] = []
            page.on("pageerror", lambda e: errors.append(str(e)))
            page.goto(url, timeout=240_000)
            send = page.get_by_role("button", name="Send")
            send.wait_for(timeout=240_000)          # the notebook ran: the engine is built
            info = page.locator(".engine-info")
            assert "block size 16" in info.inner_text()

            send.click()                            # 8 requests, cycling through 8 prompts
            # Text grows while the requests stream, and the timeline gets bars.
            first = wait_for(lambda: text_length(page), 120, "streamed text", page, "no-text.png")
            wait_for(lambda: text_length(page) > first + 40, 120, "the text to grow", page,
                     "no-growth.png")
            wait_for(lambda: bar_points(page) >= 3, 60, "timeline bars", page, "no-bars.png")
            streams = page.locator(".wb h3", has_text="Token streams").inner_text()
            assert "8 requests" in streams
            page.screenshot(path=str(ARTIFACTS / "dashboard-streaming.png"), full_page=True)

            # Change the block size and apply: the header reports the rebuilt engine.
            page.locator(".widget-dropdown", has=page.locator("label", has_text="block_size")) \
                .locator("select").select_option("32")
            page.get_by_role("button", name="Apply (rebuild engine)").click()
            wait_for(lambda: "block size 32" in info.inner_text(), 180, "the rebuilt engine",
                     page, "no-rebuild.png")
            assert "Engine rebuilt" in page.locator(".wb .ok").inner_text()
            # The new engine serves: send again and see text arrive.
            page.get_by_role("button", name="Clear panels").click()
            send.click()
            wait_for(lambda: text_length(page) > 40, 120, "text from the new engine", page,
                     "no-text-after-rebuild.png")
            page.screenshot(path=str(ARTIFACTS / "dashboard-rebuilt.png"), full_page=True)
            assert not errors, errors
        finally:
            browser.close()
    assert (ARTIFACTS / "dashboard-rebuilt.png").stat().st_size > 10_000
