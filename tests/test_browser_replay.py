"""A recorded trace played back in `workbench dashboard --replay` (Voila) in Debian's Chromium
at 1440×900, with no model loaded: press Play, tokens stream, and the roofline panel draws the steps under
the device's two roofs (the prefill right of the ridge, the decodes left of it). Screenshots
go to $WORKBENCH_ARTIFACTS; the roofline's is the one docs/roofline.png was taken from."""
from __future__ import annotations

from pathlib import Path

import pytest

playwright_api = pytest.importorskip("playwright.sync_api")
pytest.importorskip("voila")
psutil = pytest.importorskip("psutil")

from test_browser import ARTIFACTS, CHROMIUM, FLAGS, text_length, wait_for  # noqa: E402
from test_operations import kernels_below, kill_all, start_jupyter, wait_until  # noqa: E402

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


def test_replay_plays_with_no_model_and_draws_the_roofline(tmp_path):
    trace = Trace.load(TRACE)
    speed = max(1.0, trace.duration / 4)                   # the whole run in about 4 s
    proc, base, log = start_jupyter("dashboard", tmp_path, "--replay", str(TRACE),
                                    "--speed", str(speed))
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
                page.get_by_role("button", name="Play the recording").click()
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
            finally:
                browser.close()
        tree = [psutil.Process(proc.pid), *psutil.Process(proc.pid).children(recursive=True)]
        proc.terminate()
        proc.wait(60)
        _, alive = psutil.wait_procs(tree, timeout=10)
        assert not alive, f"left running: {[q.pid for q in alive]}"
    finally:
        kill_all(locals().get("tree") or [psutil.Process(proc.pid)])
    assert (ARTIFACTS / "roofline.png").stat().st_size > 5_000
