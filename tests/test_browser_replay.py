"""A recorded trace played back in `workbench dashboard --replay` (Voila) in Debian's Chromium
at 1440×900, with no model loaded: it plays as the page opens, with no click, tokens stream, and
the roofline panel draws every step under the device's two roofs (the prefill right of the
ridge, the decodes left of it); with --paused nothing moves until Play is pressed. Screenshots
go to $WORKBENCH_ARTIFACTS; the roofline's is the one docs/roofline.png was taken from."""
from __future__ import annotations

import contextlib
import time
from pathlib import Path

import pytest

playwright_api = pytest.importorskip("playwright.sync_api")
pytest.importorskip("voila")
psutil = pytest.importorskip("psutil")

from test_browser import ARTIFACTS, CHROMIUM, FLAGS, text_length, wait_for  # noqa: E402
from conftest import stop_tree  # noqa: E402
from test_operations import kernels_below, start_jupyter, wait_until  # noqa: E402

from workbench.trace import Trace  # noqa: E402

TRACE = Path(__file__).resolve().parents[1] / "docs" / "traces" / "smollm2-cpu.trace.json.gz"

pytestmark = pytest.mark.skipif(not Path(CHROMIUM).exists(),
                                reason="Debian's chromium is not installed (apt-get install -y chromium)")

ROOFLINE_JS = """() => {
  const gd = document.querySelector('.wb-roofline .js-plotly-plot');
  if (!gd || !gd.data) return null;
  const bw = gd.data[0], top = gd.data[1];
  if (!top.x || !bw.x) return null;
  const pts = gd.data.slice(2).flatMap(t => (t.x || []).map((x, i) => [t.name, x, t.y[i]]));
  const drawn = gd.querySelectorAll('.scatterlayer .trace .points path.point').length;
  return {ridge: top.x[0], peak: top.y[0], slope: bw.y[1] / bw.x[1], pts, drawn};
}"""


def roofline_state(page):
    return page.evaluate(ROOFLINE_JS)


PLAYS_IN_S = 4.0
"""The replays below run at the speed that plays the whole trace in about this long."""


@contextlib.contextmanager
def replay_page(tmp_path, *extra: str):
    """`workbench dashboard --replay TRACE --speed … *extra` open in Chromium, the page shown
    and no model loaded; yields (page, trace, the page's errors, the server process); everything
    is stopped after."""
    trace = Trace.load(TRACE)
    speed = max(1.0, trace.duration / PLAYS_IN_S)
    proc, base, log = start_jupyter("dashboard", tmp_path, "--replay", str(TRACE),
                                    "--speed", str(speed), *extra)
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    try:
        with playwright_api.sync_playwright() as p:
            browser = p.chromium.launch(executable_path=CHROMIUM, args=FLAGS, headless=True)
            try:
                page = browser.new_page(viewport={"width": 1440, "height": 900})
                errors: list[str] = []
                page.on("pageerror", lambda e: errors.append(str(e)))
                page.goto(base + "/", timeout=120_000)
                info = page.locator(".engine-info")
                info.wait_for(timeout=120_000)
                assert "no model loaded" in info.inner_text()
                try:
                    yield page, trace, errors, proc
                except BaseException:
                    print("page errors:", errors)     # shown with a failure's captured output
                    raise
            finally:
                browser.close()
        assert stop_tree(proc) == [], "processes outlived SIGTERM to workbench dashboard"
    finally:
        stop_tree(proc)                 # whatever failed above, nothing is left running


def test_replay_plays_on_open_with_no_model_and_draws_the_roofline(tmp_path):
    with replay_page(tmp_path) as (page, trace, errors, proc):
        # No click: the page plays as it opens (its button offers to replay from the start).
        page.get_by_role("button", name="Replay from the start").wait_for(timeout=60_000)
        wait_for(lambda: text_length(page) > 100, 60, "replayed text", page,
                 "replay-no-text.png")
        n = len(trace.frames)
        state = wait_for(lambda: (s := roofline_state(page)) and len(s["pts"]) == n
                         and s, 120, f"{n} roofline points", page, "replay-no-roofline.png")
        # Under both roofs: every point at or below min(peak, slope × intensity) (the
        # recorded run's own probe), with points on each side of the ridge.
        for name, x, y in state["pts"]:
            assert y <= 1.05 * min(state["peak"], state["slope"] * x), (name, x, y)
        left = [x for _, x, _ in state["pts"] if x < state["ridge"]]
        right = [x for _, x, _ in state["pts"] if x > state["ridge"]]
        assert left and right, state
        assert state["drawn"] == n                  # plotly drew each as a marker
        assert "8 requests" in page.locator(".wb h3", has_text="Token streams").inner_text()
        page.screenshot(path=str(ARTIFACTS / "replay-dashboard.png"), full_page=True)
        page.locator(".wb-roofline").screenshot(path=str(ARTIFACTS / "roofline.png"))
        # The kernel behind the page never loaded a model: well under smollm2's 540 MB
        # of fp32 weights above a bare kernel with torch imported.
        kernels = wait_until(lambda: kernels_below(proc.pid), 30, "the page's kernel")
        rss = max(k.memory_info().rss for k in kernels)
        assert rss < 900 * 2**20, f"kernel RSS {rss / 2**20:.0f} MiB"
        assert not errors, errors
    assert (ARTIFACTS / "roofline.png").stat().st_size > 5_000


def test_replay_paused_waits_for_play(tmp_path):
    with replay_page(tmp_path, "--paused") as (page, trace, errors, proc):
        play = page.get_by_role("button", name="Play the recording")
        play.wait_for(timeout=60_000)
        wait_for(lambda: roofline_state(page) is not None, 60, "the roofline drawn", page,
                 "replay-paused-no-roofline.png")
        # Watched for twice as long as the whole replay takes: nothing is released.
        end = time.monotonic() + 2 * PLAYS_IN_S
        while time.monotonic() < end:
            assert text_length(page) == 0 and not roofline_state(page)["pts"], \
                "a --paused replay played before Play was pressed"
            page.wait_for_timeout(200)
        play.click()
        n = len(trace.frames)
        wait_for(lambda: (s := roofline_state(page)) and len(s["pts"]) == n, 120,
                 f"{n} roofline points after Play", page, "replay-paused-no-play.png")
        assert text_length(page) > 100
        assert not errors, errors
