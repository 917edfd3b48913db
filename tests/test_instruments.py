"""Issue 13's instruments without a browser: record a run and replay it with no model (the
Stepper and the dashboard), the roofline panel over real steps, the A/B API on a tiny engine,
and the Stepper's top-5 candidates from token events built by hand."""
from __future__ import annotations

import asyncio
import math
import time
from types import SimpleNamespace

import pytest

pytest.importorskip("ipywidgets")
pytest.importorskip("plotly")

from workbench import Engine, SamplingParams  # noqa: E402
from workbench.bench.offline import AB_METRICS, ab_run, make_workload  # noqa: E402
from workbench.engine import TokenEvent  # noqa: E402
from workbench.trace import Trace, TraceError, record  # noqa: E402

TINY = dict(model="random:tiny", device="cpu", num_kv_blocks=64, block_size=16)


@pytest.fixture(scope="module")
def tiny_trace(tmp_path_factory):
    e = Engine(**TINY)
    try:
        trace = record(e, [[5, 6, 7, 8] * 10, [9, 10, 11], [12] * 20],
                       SamplingParams(max_tokens=6, ignore_eos=True))
    finally:
        e.close()
    return trace.save(tmp_path_factory.mktemp("trace") / "tiny.trace.json.gz")


def no_engine(monkeypatch):
    """Make building an engine (or loading a checkpoint) fail, to prove a replay needs none."""
    def refuse(*a, **k):
        raise AssertionError("a replay built an engine")
    monkeypatch.setattr(Engine, "__init__", refuse)


def test_record_keeps_every_step_token_and_finished_request(tiny_trace):
    t = Trace.load(tiny_trace)
    assert t.info.model == "random:tiny" and t.info.num_layers > 0 and t.roofs.balance > 0
    assert t.frames[0].step.phase == "prefill" and t.frames[0].step.context_lens
    tokens = [ev for f in t.frames for ev in f.tokens if ev.token_id is not None]
    assert len(tokens) == 3 * 6
    assert sorted(m.output_tokens for m in t.requests) == [6, 6, 6]
    assert all(f.kv is not None for f in t.frames)
    assert t.frames[0].kv.block_tables and not t.frames[-1].states      # all done at the end
    assert 0 <= t.frames[0].time < t.frames[-1].time == pytest.approx(t.duration)


def test_a_trace_counts_from_its_own_start():
    """Steps from 0 and requests req-0, req-1, … whatever the engine ran before (the shipped
    trace is recorded after a calibration on the same engine)."""
    e = Engine(**TINY)
    try:
        e.generate([[1, 2, 3], [4, 5]], SamplingParams(max_tokens=3, ignore_eos=True))
        t = record(e, [[5, 6, 7], [8, 9]], SamplingParams(max_tokens=3, ignore_eos=True))
    finally:
        e.close()
    assert [f.step.step for f in t.frames] == list(range(len(t.frames)))
    assert list(t.prompts) == ["req-0", "req-1"]
    assert sorted(r.request_id for r in t.requests) == ["req-0", "req-1"]
    assert {tok.request_id for f in t.frames for tok in f.tokens} == {"req-0", "req-1"}
    assert t.frames[-1].kv.step == t.frames[-1].step.step
    assert 0 <= t.frames[0].step.start < t.duration


def test_stepper_replays_with_no_model(tiny_trace, monkeypatch):
    from widgets import Stepper
    no_engine(monkeypatch)
    s = Stepper.replay(tiny_trace)
    first = s.step()
    assert first.phase == "prefill" and {r.action for r in first.rows} == {"prefill"}
    assert all(r.block_table for r in first.rows) and "KV" in s.view.value
    assert s.kv.num_used > 0                               # the recorded pool after step 0
    with pytest.raises(ValueError, match="cannot add"):
        s.add("more")
    t = Trace.load(tiny_trace)
    speed = 4.0
    t0 = time.monotonic()
    rest = s.run(speed=speed)
    waited = time.monotonic() - t0
    # Played at the recorded pace / speed: from step 1's start to the last step's end.
    assert waited >= (t.duration - t.frames[1].step.start) / speed * 0.9
    assert len(rest) == len(t.frames) - 1 and not s.has_more()
    assert {(r.action, r.finish_reason) for r in rest[-1].rows} == {("decode", "length")}
    s._guard(s.step)                                        # what the Step button does
    assert "replay is over" in s.message.value


def test_dashboard_replays_the_shipped_trace_with_no_model(monkeypatch):
    from widgets import Dashboard
    from widgets.replay import SHIPPED_TRACE
    no_engine(monkeypatch)
    d = Dashboard(replay=SHIPPED_TRACE, speed=1000, autoplay=False)   # 1000× real time, paused
    assert d.replay_button.description == "Play the recording"
    d._view_count = 1                                      # a browser shows it: still paused
    assert not d.source.playing
    d.pump.tick()
    assert d.streams.num_requests == 0                     # nothing before Play
    d.replay_button.click()
    t = Trace.load(SHIPPED_TRACE)
    tick_until(d, lambda: d.summary.num_finished == 8 and d.timeline.num_points == len(t.frames))
    assert "no model loaded" in d.header.value
    assert d.streams.num_requests == len(t.prompts) == 8
    assert d.timeline.num_points == len(t.frames) and d.roofline.num_points == len(t.frames)
    assert d.summary.num_finished == 8
    assert d.send() == [] and "takes no new requests" in d.message.value
    assert d.send_button.disabled and d.knobs.apply_button.disabled
    d.restart_replay()                                     # again from the start
    assert d.streams.num_requests == 0
    tick_until(d, lambda: d.streams.num_requests == 8)
    d.pump.stop()


def tick_until(d, done, timeout: float = 30.0) -> None:
    """Tick the dashboard's pump until `done()` (bounded): a replay plays on its own thread."""
    deadline = time.monotonic() + timeout
    while True:
        d.pump.tick()
        if done():
            return
        assert time.monotonic() < deadline, "the replay did not get there in time"
        time.sleep(0.02)


def drawn(plot) -> None:
    """What a browser view sends once it has drawn a LivePlot."""
    plot.drawn = True


def test_replay_plays_when_a_browser_has_drawn_it(tiny_trace, monkeypatch):
    """The default (`workbench dashboard --replay`): nothing is released while no browser
    has drawn the page's figures (a short recording would be over before anyone saw it),
    and all of it once they are drawn, without a click; a second view does not start
    it again."""
    from widgets import Dashboard
    no_engine(monkeypatch)
    d = Dashboard(replay=tiny_trace, speed=1000)
    assert d.replay_button.description == "Replay from the start"
    d.pump.tick()
    assert not d.source.playing and d.streams.num_requests == 0
    d._view_count = 1                      # what the browser sets when it displays the page
    drawn(d.timeline.plot)
    assert not d.source.playing            # the roofline is not drawn yet
    drawn(d.roofline.plot)
    assert d.source.playing
    t = Trace.load(tiny_trace)
    deadline = time.monotonic() + 30
    while not d.source.done and time.monotonic() < deadline:
        d.pump.tick()
        time.sleep(0.01)
    d.pump.tick()
    assert d.timeline.num_points == len(t.frames) and d.summary.num_finished == len(t.prompts)
    d._view_count = 2                      # another view of the same page: no restart
    drawn(d.roofline.plot)
    d.pump.tick()
    assert d.timeline.num_points == len(t.frames)
    d.pump.stop()


def test_replay_plays_anyway_when_a_figure_never_draws(tiny_trace, monkeypatch):
    """A frontend without plotly never reports its figures: the text still plays, a short
    while after the page first shows."""
    import widgets.dashboard as dashboard
    no_engine(monkeypatch)
    monkeypatch.setattr(dashboard, "PLAY_ANYWAY_S", 0.05)

    async def show_and_wait():
        d = dashboard.Dashboard(replay=tiny_trace, speed=1000)
        await asyncio.sleep(0.1)           # twice the wait: no timer is armed before a view
        before = d.source.playing          # not shown yet: nothing starts on its own
        d._view_count = 1
        deadline = time.monotonic() + 30
        while not d.source.playing and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        d.pump.stop()
        return before, d.source.playing

    assert asyncio.run(show_and_wait()) == (False, True)


def test_a_panel_that_fails_does_not_starve_the_others(tiny_trace, monkeypatch):
    """One panel raising in its update is named in the page's error log; the panels after it
    still get every step."""
    from widgets import Dashboard
    no_engine(monkeypatch)

    class Broken:
        def update(self, u):
            if u.steps:
                raise RuntimeError("drawing went wrong")

    d = Dashboard(replay=tiny_trace, speed=1000, autoplay=False)
    d.pump.panels.insert(0, Broken())
    d.replay_button.click()
    t = Trace.load(tiny_trace)
    tick_until(d, lambda: d.source.done)
    d.pump.tick()
    assert d.roofline.num_points == d.timeline.num_points == len(t.frames)
    assert "drawing went wrong" in d.errors.value and "Broken" in d.errors.value
    d.pump.stop()


def test_replay_rejects_bad_files_and_cli_says_why(tmp_path, capsys):
    from widgets import Dashboard
    from workbench.cli import main
    foreign = tmp_path / "telemetry.json"
    foreign.write_text('{"steps": []}')
    with pytest.raises(TraceError, match="not a workbench trace"):
        Dashboard(replay=foreign)
    assert main(["dashboard", "--replay", str(foreign)]) == 2
    assert "not a workbench trace" in capsys.readouterr().err
    assert main(["dashboard", "--replay", str(foreign), "--url", "http://x"]) == 2
    assert "takes no --url" in capsys.readouterr().err
    assert main(["dashboard", "--paused"]) == 2
    assert "--paused: only with --replay" in capsys.readouterr().err


def test_roofline_panel_places_decode_left_of_prefill(tiny_trace):
    from widgets import RooflinePanel
    t = Trace.load(tiny_trace)
    p = RooflinePanel(t.info, t.roofs)
    p.add_steps([f.step for f in t.frames])
    data = {tr.name: tr for tr in p.fig.data}
    prefill, decode = data["prefill"], data["decode"]
    assert len(prefill.x) == 1 and len(decode.x) == len(t.frames) - 1
    assert max(decode.x) < prefill.x[0]                  # decode reads more per FLOP
    assert "step 0 · prefill" in prefill.hovertext[0] and "batch 3 requests" in prefill.hovertext[0]
    bw, compute = p.fig.data[0], p.fig.data[1]
    assert bw.x[1] == compute.x[0] == pytest.approx(t.roofs.balance)   # the ridge
    assert compute.y[0] == t.roofs.peak_flops and "balance" in p.note.value


def test_ab_run_on_a_tiny_engine():
    from widgets.ab import ABPanel, parse_knobs
    wl = make_workload(6, (28, 31), (6, 8), vocab=200, seed=1)   # all cross a block edge
    r = ab_run({"block_size": 16, "num_kv_blocks": 64}, {"block_size": 32, "num_kv_blocks": 4},
               wl, model="random:tiny", engine_kwargs={"device": "cpu", "max_num_seqs": 6})
    assert r.a["tokens"] == r.b["tokens"] == wl.output_tokens       # the same request set
    assert r.a["preemptions"] == 0 and r.b["preemptions"] > 0       # 4 blocks of 32 are tight
    assert r.b["kv_peak"] > r.a["kv_peak"]
    d = r.deltas()
    assert set(d) == set(AB_METRICS)
    assert d["preemptions"]["delta"] == r.b["preemptions"] and d["preemptions"]["relative"] is None
    html = ABPanel(r).view.value
    assert "one after the other" in html and "block_size=32" in html and "worse" in html
    with pytest.raises(ValueError, match="not EngineConfig knobs: blok_size"):
        ab_run({"blok_size": 16}, {}, wl, model="random:tiny")
    assert parse_knobs('block_size = 32\n# note\ngraph_mode = eager\nx = "a b"') == {
        "block_size": 32, "graph_mode": "eager", "x": "a b"}
    with pytest.raises(ValueError, match="B, line 1"):
        parse_knobs("block_size 32", "B")


def test_stepper_shows_top_candidates_from_logprobs():
    from widgets.stepper import RequestRow, Stepper, top_candidates
    lp = SimpleNamespace
    ev = TokenEvent("req-0", 7, " blue", 1, 0.0)
    assert top_candidates(ev) == []                       # no logprobs asked: nothing shown
    ev = SimpleNamespace(logprobs={
        7: lp(logprob=math.log(0.62), rank=1, decoded_token=" blue"),
        9: lp(logprob=math.log(0.2), rank=2, decoded_token=" red"),
        **{100 + i: lp(logprob=math.log(0.01), rank=3 + i, decoded_token=f"t{i}")
           for i in range(5)}})
    cands = top_candidates(ev)
    assert [c[0] for c in cands] == [" blue", " red", "t0", "t1", "t2"]
    assert cands[0][1] == pytest.approx(0.62)
    html = Stepper._row(RequestRow("req-0", "decode", 1, 7, " blue", [0], "3/3 prompt, 1 out",
                                   candidates=cands))
    assert "62%" in html and "&#x27; red&#x27; 20%" in html


def test_live_dashboard_plots_each_step_on_the_roofline():
    import asyncio

    from widgets import Dashboard
    from workbench import EngineConfig
    dash = Dashboard(config=EngineConfig(**TINY, max_num_seqs=8))
    assert "balance" in dash.roofline.note.value            # the device was probed (cached)

    async def go():          # token ids: random:tiny has no tokenizer for the prompt box
        for i in range(4):
            dash.source.submit([5 + i] * (8 + 8 * i), SamplingParams(max_tokens=6,
                                                                     ignore_eos=True))
        assert await dash.wait(timeout=60)
    asyncio.run(go())
    steps = [s for s in dash.source.engine.telemetry.steps if s.tokens_per_request]
    assert dash.roofline.num_points == len(steps) >= 6
    phases = {tr.name: len(tr.x) for tr in dash.roofline.fig.data[2:]}
    assert phases["decode"] >= 5 and phases["prefill"] + phases["mixed"] >= 1
    dash.source.close()
    dash.source.engine.close()
