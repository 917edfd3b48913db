"""The dashboard in a real browser: `workbench dashboard` (Voila) opened in Debian's Chromium
through playwright. Send concurrent requests, watch text stream and the timeline fill, change
the block size, apply, and see the rebuilt engine report it. Screenshots are kept in
$WORKBENCH_ARTIFACTS (default: artifacts/ in the repository)."""
from __future__ import annotations

import os
import re
import shutil
import sys
from pathlib import Path

import pytest

playwright_api = pytest.importorskip("playwright.sync_api")
pytest.importorskip("voila")
httpx = pytest.importorskip("httpx")

from test_operations import wait_until  # noqa: E402
from conftest import start_server, stop_tree  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
         "--disable-component-update", "--disable-sync", "--no-first-run"]
ARTIFACTS = Path(os.environ.get("WORKBENCH_ARTIFACTS", ROOT / "artifacts"))

pytestmark = pytest.mark.skipif(not Path(CHROMIUM).exists(),
                                reason="Debian's chromium is not installed (apt-get install -y chromium)")


@pytest.fixture
def dashboard(smollm2_dir, tmp_path):
    log_path = tmp_path / "dashboard.log"
    proc, url = start_server([sys.executable, "-m", "workbench.cli", "dashboard", "--device",
                              "cpu"], log_path, ready="/api/status", ok=lambda code: code < 500,
                             timeout=60, what="voila")
    url += "/"
    yield url, log_path
    assert stop_tree(proc) == [], "processes outlived SIGTERM to workbench dashboard"


@pytest.fixture(scope="module")
def tiny_chat_model(smollm2_dir, tmp_path_factory):
    """A 2-layer random llama with SmolLM2's tokenizer: a step takes milliseconds, so the
    page can be driven through hundreds of steps in seconds."""
    from conftest import make_tiny_checkpoint
    path = tmp_path_factory.mktemp("tiny-chat")
    make_tiny_checkpoint(path, "llama3", num_hidden_layers=2, vocab_size=49152)
    for f in smollm2_dir.iterdir():
        if f.name.startswith(("tokenizer", "chat_template", "special_tokens")):
            shutil.copy(f, path / f.name)
    return path


def text_length(page) -> int:
    return page.evaluate("() => [...document.querySelectorAll('.wb .card .txt')]"
                         ".reduce((n, e) => n + e.innerText.length, 0)")


def timeline(page):
    return page.locator(".js-plotly-plot", has_text="Batch timeline")


def bar_points(page) -> int:
    return timeline(page).locator(".barlayer .point").count()


def x_ticks(page) -> list[float]:
    """The timeline's x tick labels, as numbers."""
    labels = timeline(page).evaluate(
        "p => [...p.querySelectorAll('.xaxislayer-above text')].map(t => t.textContent)")
    return [float(t.replace(",", "").replace("\u2212", "-")) for t in labels if t.strip()]


AT_A_GLANCE = """() => {
    const plot = [...document.querySelectorAll('.js-plotly-plot')]
        .find(p => p.textContent.includes('Batch timeline'));
    const cards = document.querySelectorAll('.wb .card');
    const parts = {timeline: plot, 'KV map': document.querySelector('.wb .kv'),
                   'last card': cards[cards.length - 1]};
    return Object.fromEntries(Object.entries(parts).map(([k, e]) => {
        if (!e) return [k, null];
        const r = e.getBoundingClientRect();
        return [k, {x: r.x, y: r.y, right: r.right, bottom: r.bottom}];
    }));
}"""


def outside_viewport(page, size) -> dict:
    """The at-a-glance parts (timeline, KV map, last stream card) not wholly inside the
    viewport, with their boxes. Measured in one script turn: a widget re-rendering between
    a locator's lookup and its measurement (the KV map redraws each tick) reads as absent."""
    boxes = page.evaluate(AT_A_GLANCE)
    return {k: b for k, b in boxes.items()
            if b is None or b["x"] < 0 or b["y"] < 0 or b["right"] > size["width"]
            or b["bottom"] > size["height"]}


def cut_footers(page) -> list[str]:
    """The stream cards' footer figures that do not show whole: cut inside their span, or
    running past their card's right edge."""
    return page.evaluate("""() => [...document.querySelectorAll('.wb .card .st span')]
        .filter(s => s.scrollWidth > s.clientWidth + 1 || s.getBoundingClientRect().right
                     > s.closest('.card').getBoundingClientRect().right + 1)
        .map(s => s.innerText)""")


def streams_header(page) -> dict:
    """The "Token streams" header's text, whether it is cut, and its height, measured in one
    script turn (the panel rewrites it every tick)."""
    return page.evaluate("""() => {
        const h = [...document.querySelectorAll('.wb h3')]
            .find(e => e.textContent.includes('Token streams'));
        return {text: h.innerText, cut: h.scrollWidth > h.clientWidth + 1,
                height: h.getBoundingClientRect().height};
    }""")


def knob(page, label: str):
    """The widget whose description is `label` (the whole of it: "Model" is not "Draft
    model")."""
    whole = re.compile(rf"^\s*{re.escape(label)}\s*$")
    return page.locator(".widget-inline-hbox", has=page.locator("label", has_text=whole))


def wait_for(predicate, timeout: float, what: str, page, shot: str):
    def screenshot() -> str:
        page.screenshot(path=str(ARTIFACTS / shot), full_page=True)
        shown = page.locator(".wb .error").all_inner_texts()      # e.g. a panel that failed
        return f"; screenshot in {ARTIFACTS / shot}" + (f"; the page says: {shown}" if shown else "")
    return wait_until(predicate, timeout, what, detail=screenshot)


def test_dashboard_at_a_glance_streams_and_rebuilds_in_chromium(dashboard, tiny_chat_model):
    """At 1440×900: streams, the timeline and the KV map visible together while 8 requests
    stream; Apply (to a tiny model, with n-gram speculation picked in its knobs) clears the
    old axes; 300+ steps keep ≤ 20 x labels; no page error, and no request leaves 127.0.0.1."""
    url, log_path = dashboard
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    size = {"width": 1440, "height": 900}
    with playwright_api.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=FLAGS, headless=True)
        try:
            page = browser.new_page(viewport=size)
            errors: list[str] = []
            urls: list[str] = []
            console: list[str] = []
            page.on("pageerror", lambda e: errors.append(str(e)))
            page.on("console", lambda m: console.append(f"{m.type}: {m.text}")
                    if m.type in ("warning", "error") else None)
            page.on("request", lambda r: urls.append(r.url))
            page.goto(url, timeout=240_000)
            send = page.get_by_role("button", name="Send")
            send.wait_for(timeout=240_000)          # the notebook ran; the engine loads
            wait_for(send.is_enabled, 240, "the engine to load", page, "no-engine.png")
            info = page.locator(".engine-info")
            assert "block size 16" in info.inner_text() and "graph mode eager" in info.inner_text()
            # Under it, why the weights are in their format, with the figures that decided it.
            why = page.locator(".engine-why").inner_text()
            assert "quantization 'auto'" in why and "µs" in why, why
            assert not page.locator(".wb .notice").count()      # a default CPU start: no banner
            assert "eager" in knob(page, "Graph capture").locator("select") \
                .input_value()
            # The block-size options read as sizes, the device's choice first, one selected.
            block = knob(page, "KV block (tokens)").locator("select")
            labels = [x.replace("\xa0", " ") for x in block.locator("option").all_inner_texts()]
            assert labels[0] == "device's choice" and all(x.isdigit() for x in labels[1:]), labels
            assert block.evaluate("s => s.options[s.selectedIndex].text") == "16"

            send.click()                            # 8 requests, cycling through 8 prompts
            first = wait_for(lambda: text_length(page), 120, "streamed text", page, "no-text.png")
            wait_for(lambda: text_length(page) > first + 40, 120, "the text to grow", page,
                     "no-growth.png")
            wait_for(lambda: bar_points(page) >= 3, 60, "timeline bars", page, "no-bars.png")
            head = streams_header(page)
            assert "8 requests" in head["text"]
            assert not head["cut"] and head["height"] < 30, f"streams header cut or wrapped: {head}"
            cut = cut_footers(page)
            assert not cut, f"card footers cut at 1440x900: {cut}"
            # No figure's legend over its title (the roofline's, the timeline's…).
            boxes = page.evaluate("""() => [...document.querySelectorAll('.js-plotly-plot')]
                .map(p => [p.querySelector('.gtitle'), p.querySelector('.legend')])
                .filter(([t, l]) => t && l && t.textContent && l.getBoundingClientRect().height)
                .map(([t, l]) => [t.textContent, t.getBoundingClientRect().toJSON(),
                                  l.getBoundingClientRect().toJSON()])""")
            assert boxes, "no figure with both a title and a legend drawn"
            over = [t for t, a, b in boxes if a["bottom"] > b["top"] + 1 and b["bottom"] > a["top"] + 1
                    and a["right"] > b["left"] + 1 and b["right"] > a["left"] + 1]
            assert not over, f"legend over the title of {over}"
            hidden = outside_viewport(page, size)
            if hidden:
                page.screenshot(path=str(ARTIFACTS / "outside.png"))
            assert not hidden, f"outside the 1440×900 view: {hidden} (see outside.png)"
            wait_for(lambda: max(x_ticks(page), default=0) >= 12, 120, "a dozen steps", page,
                     "no-steps.png")
            page.screenshot(path=str(ARTIFACTS / "dashboard-streaming.png"))   # docs/dashboard.png
            old_ticks = x_ticks(page)
            page.get_by_role("button", name="Abort all").click()

            # A refused knob: the error shows right under Apply, inside the view.
            budget = knob(page, "Step budget (tokens)").locator("input")
            budget.fill("1")
            budget.press("Enter")
            apply = page.get_by_role("button", name="Apply (rebuild engine)")
            apply.click()
            refusal = page.locator(".wb .error", has_text="Not applied")
            refusal.wait_for(timeout=30_000)
            err, btn = refusal.bounding_box(), apply.bounding_box()
            assert 0 <= err["y"] and err["y"] + err["height"] <= size["height"], err
            assert 0 <= err["y"] - (btn["y"] + btn["height"]) < 24, (err, btn)
            page.screenshot(path=str(ARTIFACTS / "dashboard-refused.png"))
            budget.fill("2048")
            budget.press("Enter")

            # Apply a tiny model with 32-token blocks and n-gram speculation (its k shows
            # once a method is picked): the header reports both, and the timeline starts
            # over with fresh axes (no old step numbers left).
            knob(page, "Model").locator("input").fill(str(tiny_chat_model))
            knob(page, "KV block (tokens)").locator("select").select_option("32")
            k = knob(page, "Drafts per step (k)")
            assert not k.is_visible()
            knob(page, "Speculative decoding").locator("select").select_option(
                label="n-gram (prompt lookup)")
            k.wait_for(state="visible", timeout=10_000)
            page.get_by_role("button", name="Apply (rebuild engine)").click()
            wait_for(lambda: "block size 32" in info.inner_text(), 180, "the rebuilt engine",
                     page, "no-rebuild.png")
            assert "speculative ngram, k=4" in info.inner_text()
            assert "Engine rebuilt" in page.locator(".wb .ok").inner_text()
            # The old engine's stream cards went with it, like its stats and timeline.
            wait_for(lambda: page.locator(".wb .card").count() == 0, 10, "the old cards to go",
                     page, "old-cards.png")
            assert "0 requests" in streams_header(page)["text"]
            wait_for(lambda: bar_points(page) == 0 and max(x_ticks(page), default=0) <= 10, 10,
                     "the old axes to go", page, "old-axes.png")
            assert max(old_ticks) >= 12

            # Hundreds of steps: the x axis keeps a handful of labels.
            readout = knob(page, "Max output (tokens)").locator(".widget-readout")
            readout.fill("400")
            readout.press("Enter")
            page.get_by_role("button", name="Clear").click()
            send.click()
            wait_for(lambda: max(x_ticks(page), default=0) >= 300, 300, "300 steps", page,
                     "no-300-steps.png")
            assert len(x_ticks(page)) <= 20, x_ticks(page)
            # After Apply the footers hold the new engine's longer figures (400 tokens,
            # speculation's accepted counts): still whole.
            cut = cut_footers(page)
            assert not cut, f"card footers cut at 1440x900 after Apply: {cut}"
            page.screenshot(path=str(ARTIFACTS / "dashboard-300-steps.png"))
            page.get_by_role("button", name="Abort all").click()
            assert not errors, errors
            # A clean console: no "Unsatisfied version" from widget front ends built against
            # other JupyterLab packages than Voila's (pyproject.toml holds them in line).
            assert not console, console
            outside = {u for u in urls if not u.startswith((url, "blob:" + url, "data:"))}
            assert not outside, f"requests beyond {url}: {sorted(outside)}"
        finally:
            browser.close()
    assert (ARTIFACTS / "dashboard-300-steps.png").stat().st_size > 10_000
