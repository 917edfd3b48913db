"""Widgets without a browser: what the panels hold after real generations, how many comm
messages they send (the throttle), knob validation and engine rebuilds, the Stepper.

Comm messages are counted by installing a recording comm factory in the `comm` package, the
hook ipywidgets itself calls to open every widget's channel to the frontend."""
from __future__ import annotations

import asyncio
import dataclasses
import html
import math
import re
import time

import pytest

pytest.importorskip("ipywidgets")
pytest.importorskip("plotly")
import comm  # noqa: E402
from comm.base_comm import BaseComm  # noqa: E402

from workbench import Engine, EngineConfig, SamplingParams  # noqa: E402


class RecordingComm(BaseComm):
    log: list[tuple[float, str, dict]] = []

    def publish_msg(self, msg_type, data=None, metadata=None, buffers=None, **keys):
        if msg_type == "comm_msg":
            RecordingComm.log.append((time.monotonic(), self.comm_id, data or {}))


@pytest.fixture
def comms(monkeypatch):
    RecordingComm.log = []
    monkeypatch.setattr(comm, "create_comm", lambda **kw: RecordingComm(**kw))
    return RecordingComm.log


def messages_for(log, widget, since: float = 0.0) -> list[float]:
    cid = widget.comm.comm_id
    return [t for t, c, _ in log if c == cid and t >= since]


@pytest.fixture(scope="module")
def smollm2_engine():
    e = Engine(model="smollm2", device="cpu", max_num_seqs=8, num_kv_blocks=256)
    yield e
    e.shutdown()


def test_live_panels_hold_what_the_engine_generated(smollm2_engine, comms):
    from widgets import BatchTimeline, KVBlockMap, Live, SummaryPanel, TokenStreamPanel
    e = smollm2_engine
    prompts = ["The capital of France is", "List three prime numbers:",
               [{"role": "user", "content": "Name a colour."}]]
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    expected = [o.text for o in e.generate(prompts, params)]
    first_step = e.telemetry.num_steps

    async def run():
        live = Live(e, TokenStreamPanel(), BatchTimeline(), KVBlockMap(), SummaryPanel())
        assert live.pump.running      # on the loop it was made on, like a kernel's
        rids = await live.generate(prompts, params, timeout=120)
        return live, rids

    live, rids = asyncio.run(run())
    streams, timeline, kv, summary = live.panels
    assert [streams.streams[r].text for r in rids] == expected
    assert all(streams.streams[r].status == "length" for r in rids)
    assert streams.num_requests == 3 and streams.num_finished == 3
    assert streams.num_tokens == 3 * 16
    for r in rids:
        st = streams.streams[r]
        assert st.num_tokens == 16 and 0 < st.ttft and st.tpot > 0
        assert html.escape(st.text) in streams.view.value
    steps = [s for s in e.telemetry.steps_since(first_step) if s.phase != "idle"]
    assert timeline.num_points == len(steps) and timeline.last_step == steps[-1].step
    bars = timeline.fig.data
    drawn_prefill = sum(y or 0 for y in bars[0].y) + sum(y or 0 for y in bars[2].y)
    drawn_decode = sum(y or 0 for y in bars[1].y) + sum(y or 0 for y in bars[3].y)
    assert drawn_prefill == sum(s.num_prefill_tokens for s in steps)
    assert drawn_decode == sum(s.num_decode_tokens for s in steps) == 3 * 15
    assert any("decode" in h and rids[0] in h for h in bars[1].hovertext)
    # No speculation: no token marked, no legend, no toggle, no drafted/accepted bars.
    cards = streams.view.value.split('<div class="cards">')[1]
    assert not re.search(r'class="[^"]*\b(acc|own|rej)\b', streams.view.value)
    assert "accepted draft" not in streams.view.value and cards
    assert streams.show_rejected.layout.display == "none"
    assert not bars[7].visible and not bars[8].visible and not bars[7].y
    assert summary.num_finished == 3 and summary.output_tokens == 3 * 16
    f = summary.figures()
    assert f["ttft_p50"] > 0 and f["tpot_p99"] >= f["tpot_p50"] > 0 and f["throughput"] > 0
    # Every request finished: no block is held, and their full prompt blocks stay cached.
    assert kv.num_used == 0 and kv.num_cached_free > 0
    assert "cached-free" in kv.view.value
    live.close()


def test_kv_map_marks_owners_and_shared_prefix_blocks(smollm2_engine):
    from widgets import KVBlockMap
    e = smollm2_engine
    prefix = "You are a helpful assistant. " * 12
    e.generate(prefix + "Say hi.", SamplingParams(max_tokens=1))     # cache the prefix
    a = e.add_request(prefix + "Say one.", SamplingParams(max_tokens=50, ignore_eos=True))
    b = e.add_request(prefix + "Say two.", SamplingParams(max_tokens=50, ignore_eos=True))
    e.step()
    snap = e.kv_blocks()
    kv = KVBlockMap()
    kv.show(snap)
    owners = snap.owners()
    shared = [i for i, o in enumerate(owners) if set(o) == {a, b}]
    assert shared and kv.num_shared == len(shared) and kv.num_used == len(
        set(snap.block_tables[a]) | set(snap.block_tables[b]))
    assert f"block {shared[0]} · {a}, {b} · refs 2" in kv.view.value
    renders = kv.renders
    kv.show(e.kv_blocks())            # nothing changed: nothing is sent
    assert kv.renders == renders
    e.abort(a), e.abort(b)
    e.step()


def test_throttle_bounds_messages_however_fast_tokens_come(comms):
    """A tiny random model makes thousands of tokens a second; the panels still send a
    bounded number of messages per second (one per tick at most for each view)."""
    from widgets import BatchTimeline, KVBlockMap, Live, SummaryPanel, TokenStreamPanel
    e = Engine(model="random:tiny", device="cpu", max_num_seqs=16, num_kv_blocks=512)
    hz = 20

    async def run():
        live = Live(e, TokenStreamPanel(), BatchTimeline(), KVBlockMap(), SummaryPanel(), hz=hz)
        t0 = time.monotonic()
        rounds = 0
        while time.monotonic() - t0 < 2.0 and rounds < 10:     # long enough to see a rate
            await live.generate([[7, 8, 9, 10 + i] for i in range(16)],
                                SamplingParams(max_tokens=200, ignore_eos=True), timeout=120)
            rounds += 1
        return live, t0, time.monotonic(), rounds

    live, t0, t1, rounds = asyncio.run(run())
    streams, timeline, kv, summary = live.panels
    tokens = streams.num_tokens
    elapsed = t1 - t0
    assert tokens == rounds * 16 * 200
    assert elapsed > 1.0, "too fast to measure a rate; raise max_tokens"
    assert tokens / elapsed > 5 * hz, "tokens must come faster than the tick rate for this test"
    # Ticks are paced at hz, plus one closing tick per generate call (Pump.wait shows the last
    # tokens before it returns: ten rounds in two seconds on a fast CPU), and each view sends
    # at most one message per tick.
    assert live.pump.ticks <= hz * elapsed + rounds + 3, (live.pump.ticks, elapsed, rounds)
    for view in (streams.view, summary.view, kv.view):
        sent = messages_for(comms, view, t0)
        assert len(sent) <= live.pump.ticks + 1
        # Never more than hz in any one second.
        worst = max(sum(1 for t in sent if s <= t < s + 1.0) for s in sent)
        assert worst <= hz + 1, f"{worst} messages in one second"
    # One sync per tick with new steps: one message (what changed of its data and layout).
    assert timeline.num_updates <= live.pump.ticks
    assert len(messages_for(comms, timeline.plot, t0)) <= timeline.plot.num_syncs
    # All views together: a bounded number per tick (1 each for the HTML views and the
    # figure), so far fewer messages than tokens.
    total = sum(1 for t, _, _ in comms if t >= t0)
    assert total <= 4 * live.pump.ticks + 10
    assert total < tokens / 5, f"{total} comm messages for {tokens} tokens"
    live.close()


def test_knobs_validate_and_rebuild_the_dashboard_engine(comms):
    from widgets import Dashboard
    dash = Dashboard(config=EngineConfig(model="random:tiny", device="cpu", max_num_seqs=8,
                                         num_kv_blocks=64))
    old = dash.source.engine
    knobs = dash.knobs

    # An invalid combination: the config's own error, nothing rebuilt, the old engine serves.
    knobs.set_values(max_num_seqs=16, max_num_batched_tokens=8)
    assert knobs.apply() is None
    assert knobs.failures == 1 and "max_num_batched_tokens" in knobs.last_error
    assert "The running engine was kept" in knobs.status.value
    assert dash.source.engine is old and dash.num_rebuilds == 0

    # Valid for the config, refused by the engine (no such model): same, with its message.
    knobs.set_values(max_num_batched_tokens=2048, model="random:no-such-shape")
    assert knobs.apply() is None and knobs.failures == 2
    assert "no-such-shape" in knobs.last_error and dash.source.engine is old

    async def rebuild():
        assert dash.send(1) == [] and "write each prompt as token ids" in dash.message.value
        dash.prompts.value = "1 2 3 4\n5, 6, 7"         # random weights: token-id prompts
        rids = dash.send(4, SamplingParams(max_tokens=400, ignore_eos=True))
        assert len(rids) == 4
        deadline = time.monotonic() + 60             # the old engine is serving them
        while not any(r.num_output_tokens for r in old.request_states()):
            assert time.monotonic() < deadline, "the old engine produced no token"
            await asyncio.sleep(0.02)
        knobs.set_values(model="random:tiny", block_size=32)
        new = await knobs.apply_async()      # builds in a thread while the old one serves
        assert await dash.wait(timeout=60)
        after = dash.send(2, SamplingParams(max_tokens=8, ignore_eos=True))
        assert len(after) == 2
        assert await dash.wait(timeout=60)
        return new, rids, after

    new, rids, after = asyncio.run(rebuild())
    assert new is not None and dash.source.engine is new and new.info().config.block_size == 32
    assert dash.num_rebuilds == 1 and knobs.builds == 1 and not old.is_running_in_background
    assert old.is_closed and old.core.runner.kv_cache is None      # freed at once, not by the gc
    assert "<b>32</b>" in dash.header.value and "Engine rebuilt" in knobs.status.value
    # What the Send button's sampling costs against greedy, measured on this device.
    t = knobs.sampling_params().temperature
    assert re.search(rf"sampling at temperature {t:g}</span> <b>adds [0-9.]+ ms to a step of "
                     r"\d+ requests on this machine \([0-9.]+ ms sampled, [0-9.]+ ms greedy\)"
                     r"( — measured while this machine was busy, so not the engine's figure "
                     r"\([^)]*load average [^)]*\))?</b>", html.unescape(dash.header.value)), \
        dash.header.value
    # The old engine's cards went with it (its requests were aborted, or had finished): the
    # cards hold the new engine's run only, like the stats and the timeline.
    # (ids restart with each engine: the new one's req-0 is not the old req-0)
    assert list(dash.streams.streams) == after and dash.streams.num_requests == 2
    assert all(dash.streams.streams[r].status == "length" for r in after)
    assert new.kv_blocks().block_size == 32
    dash.source.close()


def test_block_size_knob_offers_what_the_devices_attention_takes():
    """The block-size options are the device's attention backend's (platforms.block_sizes):
    every size on the CPU, only 128 on the NPU (its backend's domain, read without
    torch_npu); a size the new device does not take falls back to its choice."""
    from widgets.knobs import KnobPanel
    from workbench.platforms import block_sizes
    from workbench.platforms.npu_attention import NpuAttention
    knobs = KnobPanel(EngineConfig(model="random:tiny", device="cpu", block_size=32))
    assert knobs.block_size.options == (("device's choice", 0),
                                        *((str(b), b) for b in block_sizes("cpu")))
    assert knobs.block_size.value == 32
    knobs._device_changed({"new": "npu"})
    assert knobs.block_size.options == (("device's choice", 0), ("128", 128))
    assert knobs.block_size.label == "device's choice"          # shown, not a blank box
    assert knobs.values()["block_size"] is None and block_sizes("npu") == NpuAttention.supported_block_sizes
    knobs._device_changed({"new": "cpu"})
    knobs.block_size.value = 64
    knobs._device_changed({"new": "cuda"})
    assert knobs.block_size.value == 64


def test_dashboard_bad_prompt_shows_error_and_sends_nothing():
    from widgets import Dashboard
    dash = Dashboard(config=EngineConfig(model="random:tiny", device="cpu"))
    dash.prompts.value = "   \n  "
    assert dash.send(3) == [] and "at least one prompt" in dash.message.value
    dash.prompts.value = "hello"      # random:tiny has no tokenizer: text is refused cleanly
    assert dash.send(2) == [] and "no tokenizer" in dash.message.value
    assert dash.source.num_pending == 0 and dash.num_sent == 0
    dash.source.close()


def test_stepper_shows_chunks_decodes_and_preemption():
    from widgets import Stepper
    e = Engine(model="smollm2", device="cpu", block_size=16, num_kv_blocks=7,
               max_num_batched_tokens=32, max_num_seqs=4, enable_prefix_caching=False)
    words = e.tokenize("Explain how a paged KV cache lets an inference engine serve many "
                       "requests at once without reserving memory for the longest possible "
                       "sequence, and what happens when the pool runs out of blocks. " * 2)
    pa, pb = words[:50], words[10:50]
    st = Stepper(e)
    a = st.add(pa, max_tokens=30, ignore_eos=True)          # 50 prompt tokens
    r0 = st.step()
    assert r0.row(a).action == "chunk" and r0.row(a).num_tokens == 32 and r0.row(a).token_id is None
    assert r0.row(a).block_table == [1, 2]                 # block 0 is the null block
    r1 = st.step()
    assert r1.row(a).action == "prefill" and r1.row(a).num_tokens == 18
    assert r1.row(a).token_id is not None and r1.row(a).progress == "50/50 prompt, 1 out"
    assert repr(r1.row(a).token) in html.unescape(st.view.value)
    b = st.add(pb, max_tokens=30, ignore_eos=True)          # 40 more: 6 usable blocks, 96 tokens
    recs = st.run()
    actions = [row.action for r in recs for row in r.rows]
    assert "preempted" in actions, "6 blocks cannot hold both to the end: one is preempted"
    assert not e.has_unfinished_requests()
    # The tokens the stepper showed are the greedy tokens of each request run alone.
    got: dict[str, list[int]] = {}
    for r in [r0, r1, *recs]:
        for row in r.rows:
            if row.token_id is not None:
                got.setdefault(row.request_id, []).append(row.token_id)
    for rid, prompt in ((a, pa), (b, pb)):
        want = e.generate(prompt, SamplingParams(max_tokens=30, temperature=0,
                                                  ignore_eos=True))[0].token_ids
        assert got[rid] == want
    assert "Recent steps" in st.history_view.value and f"Step {recs[-1].step}" in st.view.value
    # The buttons drive the same calls; bad input shows the engine's error and adds nothing.
    st.prompt.value = ""
    st.add_button.click()
    assert "prompt: must not be empty" in st.message.value and not e.has_unfinished_requests()
    st.prompt.value, st.max_tokens.value = "Hello", 2
    st.add_button.click()
    st.step_button.click()
    assert st.history[-1].rows[0].action == "prefill" and st.message.value == ""
    st.run_button.click()
    assert st.history[-1].rows[0].finish_reason == "length" and not e.has_unfinished_requests()


def test_stepper_refuses_a_background_engine():
    from widgets import Stepper
    e = Engine(model="random:tiny", device="cpu").start()
    try:
        with pytest.raises(ValueError, match="not running in the background"):
            Stepper(e)
    finally:
        e.shutdown()


def test_timeline_draws_graph_steps_apart_and_keeps_a_window():
    from widgets import BatchTimeline
    from widgets.sources import Update
    from workbench.telemetry import StepEvent

    def step(i, graph):
        return StepEvent(step=i, start=0.0, duration=0.01, phase="decode", num_prefill_tokens=0,
                         num_decode_tokens=4, num_cached_tokens=0,
                         tokens_per_request={f"r{j}": 1 for j in range(4)},
                         kinds={f"r{j}": "decode" for j in range(4)}, num_running=4,
                         num_waiting=1, kv_blocks_used=3, kv_blocks_free=1, kv_blocks_cached=0,
                         num_preempted=0, preempted=[], graph=graph,
                         graph_size=4 if graph else None, graph_kind="FULL" if graph else None)

    tl = BatchTimeline(window=5)
    tl.update(Update(steps=[step(i, graph=i % 2 == 1) for i in range(8)]))
    eager, graphed = tl.fig.data[1], tl.fig.data[3]
    assert list(eager.x) == [3, 4, 5, 6, 7] and tl.num_points == 5
    assert list(eager.y) == [None, 4, None, 4, None] and list(graphed.y) == [4, None, 4, None, 4]
    assert graphed.showlegend and "graph replay @4" in graphed.hovertext[0]
    assert list(tl.fig.data[6].y) == [75.0] * 5          # KV used %
    assert tl.fig.layout.xaxis2.dtick == 1 and tl.fig.layout.xaxis2.tickmode == "linear"
    wide = BatchTimeline()
    wide.update(Update(steps=[step(i, graph=False) for i in range(40)]))
    assert wide.fig.layout.xaxis2.tickmode == "auto"      # many: plotly picks ≤ nticks



def test_apply_closes_the_old_engine(comms, monkeypatch):
    """Apply calls the old engine's close(), which frees its KV pool, graphs and weights at
    once (shutdown() alone only stops its loop)."""
    from widgets import Dashboard
    dash = Dashboard(config=EngineConfig(model="random:tiny", device="cpu", num_kv_blocks=64))
    old, closed = dash.source.engine, []
    real = Engine.close
    monkeypatch.setattr(Engine, "close", lambda self: (closed.append(id(self)), real(self))[1])
    dash.knobs.set_values(block_size=32)
    new = dash.knobs.apply()
    assert new is not None and dash.source.engine is new
    assert closed == [id(old)] and old.is_closed and not new.is_closed
    dash.source.close()


def test_apply_leaves_one_engine_in_memory(comms):
    """With the cyclic GC off, the old engine is freed once Apply has put the new one in
    place: a device never holds two engines' KV pools (at gpu_memory_utilization=0.9 the
    second would not fit)."""
    import gc
    import weakref

    from widgets import Dashboard
    dash = Dashboard(config=EngineConfig(model="random:tiny", device="cpu", num_kv_blocks=64))
    gone = weakref.ref(dash.source.engine)
    dash.knobs.set_values(block_size=32)
    gc.collect()
    gc.disable()
    try:
        assert dash.knobs.apply() is not None
        assert gone() is None, "the old engine is still referenced after Apply"
    finally:
        gc.enable()
        dash.source.close()


def test_timeline_rows_title_sparse_ticks_and_a_clean_clear():
    """Prefill and decode on their own y axes, a title, at most 10 x ticks, and clear() drops
    the old ranges (a new uirevision, autorange on) along with the steps."""
    from widgets import BatchTimeline
    from widgets.sources import Update
    from workbench.telemetry import StepEvent
    tl = BatchTimeline()
    steps = [StepEvent(step=i, start=0.0, duration=0.01, phase="prefill" if i == 0 else "decode",
                       num_prefill_tokens=300 if i == 0 else 0, num_decode_tokens=0 if i == 0 else 8,
                       num_cached_tokens=0, tokens_per_request={}, kinds={}, num_running=8,
                       num_waiting=0, kv_blocks_used=3, kv_blocks_free=1, kv_blocks_cached=0,
                       num_preempted=0, preempted=[]) for i in range(300)]
    tl.update(Update(steps=steps))
    lay = tl.fig.layout
    assert lay.title.text == "Batch timeline"
    assert tl.fig.data[0].yaxis == "y" and tl.fig.data[1].yaxis == "y2"    # prefill | decode
    assert max(tl.fig.data[1].y) == 8 and max(tl.fig.data[0].y) == 300
    assert lay.xaxis3.nticks == 10 and lay.xaxis3.tickmode == "auto" and lay.xaxis3.type == "linear"
    rev = lay.uirevision
    tl.fig.layout.xaxis3.range = (200, 299)          # as a zoom would leave it
    tl.clear()
    assert lay.uirevision != rev and lay.xaxis3.range == (0, 10) and lay.yaxis.range == (0, 1)
    assert tl.num_points == 0 and list(tl.fig.data[1].x) == []
    tl.update(Update(steps=steps[:50]))                  # the next steps autorange again
    assert lay.xaxis3.autorange is True and lay.yaxis2.autorange is True


@dataclasses.dataclass
class Logprob:        # the shape issue 12 gives TokenEvent.logprobs values
    logprob: float
    rank: int
    decoded_token: str


def test_stream_cards_shade_tokens_by_probability_and_keep_their_order():
    from widgets import TokenStreamPanel
    from widgets.sources import Update
    from workbench.engine import TokenEvent

    Event = TokenEvent
    if "logprobs" not in {f.name for f in dataclasses.fields(TokenEvent)}:
        # issue 12's field is not on this branch yet: the same event with it added
        Event = dataclasses.make_dataclass(
            "Event", [("logprobs", dict, dataclasses.field(default=None))], bases=(TokenEvent,))

    def ev(rid, tid, text, i, lps=None, **kw):
        return Event(rid, tid, text, i, float(i), logprobs=lps, **kw)

    panel = TokenStreamPanel()
    sure = {5: Logprob(math.log(0.9), 1, " the"), 6: Logprob(math.log(0.05), 2, " a")}
    unsure = {7: Logprob(math.log(0.2), 2, " cat"), 8: Logprob(math.log(0.7), 1, " dog")}
    panel.update(Update(submitted=[("a", 0.0, "p"), ("b", 0.0, "q")],
                        events=[ev("a", 5, " the", 1, sure), ev("a", 7, " cat", 2, unsure),
                                ev("b", 9, "plain", 1, finished=True, finish_reason="stop")]))
    html_ = panel.view.value
    the = re.search(r'<span class="tk" style="background: rgba\([^)]*, ([0-9.]+)\)" '
                    r'title="([^"]*)"> the</span>', html_)
    cat = re.search(r'rgba\([^)]*, ([0-9.]+)\)" title="([^"]*)"> cat</span>', html_)
    assert the and cat and float(cat.group(1)) > float(the.group(1))     # unlikelier: darker
    tip = html.unescape(cat.group(2))
    assert "p = 0.20" in tip and tip.index("' dog'  0.70") < tip.index("' cat'  0.20")
    assert '<div class="txt"><div>plain</div>' in html_                  # no logprobs: plain
    assert html_.index("<b>a</b>") < html_.index("<b>b</b>")             # b finished, stays 2nd


def test_dashboard_loads_behind_a_progress_bar_and_shows_what_runs(comms):
    """In a kernel (a running loop) the page comes first and the engine is built behind a
    live bar; Send is refused until then; the knobs then show the engine's resolved config
    (the header and the graph-mode knob agree)."""
    from widgets import Dashboard

    async def load():
        dash = Dashboard(config=EngineConfig(model="random:tiny", device="cpu",
                                             num_kv_blocks=64))
        assert not dash.ready and dash.send_button.disabled and dash.source is None
        assert dash.send(2) == [] and "still loading" in dash.message.value
        # While it loads the roofline says so (not "unknown (a remote server)").
        assert "Roofline: waiting for the engine to load." in dash.roofline.note.value
        assert "remote server" not in dash.roofline.note.value
        # The KV block box reads in words meanwhile, never blank nor a raw tuple.
        assert dash.knobs.block_size.label == "device's choice"
        shown = []
        dash.loading.layout.observe(lambda ch: shown.append(ch.new), "display")
        deadline = time.monotonic() + 120
        while not dash.ready:
            assert time.monotonic() < deadline, f"never ready: {dash.message.value}"
            await asyncio.sleep(0.02)
        return dash, shown

    dash, shown = asyncio.run(load())
    assert shown[0] is None and shown[-1] == "none"                    # shown, then hidden
    info = dash.source.engine.info()
    assert not dash.send_button.disabled
    assert dash.knobs.graph_mode.value == info.graph_mode == "eager"
    assert f"graph mode</span> <b>{info.graph_mode}</b>" in dash.header.value
    # Why the weights are in their format, with the figures (the CPU kernel is built here:
    # 'auto' measured its candidates).
    assert info.quantization_choice and "µs" in info.quantization_choice
    assert f'engine-why muted">{html.escape(info.quantization_choice)}</div>' in dash.header.value
    assert dash.knobs.block_size.value == info.block_size and not dash.notices.value
    assert "balance" in dash.roofline.note.value and "waiting" not in dash.roofline.note.value
    dash.source.close()


def test_build_progress_follows_what_the_loader_reports():
    import logging

    from widgets.progress import BuildProgress
    bar, seen = BuildProgress(), []

    def build():
        log = logging.getLogger("workbench")
        for i in range(1, 4):
            log.debug("t", extra={"progress": ("converting the model", i, 3)})
            # The bar's loop shows it within a tick: the fraction, and after the last tensor
            # the stage that follows (the bar stays below 1 until the engine is built).
            shown = (lambda: bar.bar.value >= i / 3 - 1e-9) if i < 3 else \
                (lambda: bar.last_stage.startswith("building the engine"))
            deadline = time.monotonic() + 30
            while not shown() and time.monotonic() < deadline:
                time.sleep(0.01)
            seen.append((bar.last_stage, bar.bar.value))
        return 42

    assert asyncio.run(bar.run(build, "Loading")) == 42
    assert seen[1][0] == "converting the model" and seen[1][1] >= 2 / 3 - 1e-9
    # After the last tensor the bar says what follows, and never moves back.
    assert seen[-1][0].startswith("building the engine") and seen[-1][1] >= 2 / 3 - 1e-9


def test_build_progress_names_the_stages_of_a_real_build(tmp_path):
    """What a bar listening to a real build shows, stage by stage: the weights being read
    (a safetensors checkpoint here), then the engine being built, never a stale stage."""
    import logging

    from conftest import make_tiny_checkpoint

    from widgets.progress import _Listener
    stages: list[str] = []

    class Recorder(_Listener):
        def emit(self, record):
            super().emit(record)
            if not stages or stages[-1] != self.stage:
                stages.append(self.stage)

    make_tiny_checkpoint(tmp_path, "qwen2")
    logger, rec = logging.getLogger("workbench"), Recorder()
    level = logger.level
    logger.addHandler(rec)
    logger.setLevel(logging.DEBUG)
    try:
        Engine(model=str(tmp_path), device="cpu", num_kv_blocks=16).close()
    finally:
        logger.removeHandler(rec)
        logger.setLevel(level)
    read = stages.index(f"reading the weights of {tmp_path}")
    assert stages[read + 1].startswith("building the engine"), stages


def test_sampled_replies_repeat_on_a_fresh_page_unless_unseeded(smollm2_engine, comms):
    """A page starts from the demo seed (its first Send samples the replies read before the
    prompts shipped); the Seed knob or a seed in the params moves it; seed=None draws one
    per page."""
    from widgets import Dashboard

    def seeds(dash, **params):
        got = []
        dash.source.submit = lambda prompt, p: got.append(p.seed) or f"r{len(got)}"
        dash.send(3, SamplingParams(max_tokens=4, **params))
        return got

    assert seeds(Dashboard(smollm2_engine), temperature=0.7) == [0, 1, 2]
    a, b = Dashboard(smollm2_engine, seed=None), Dashboard(smollm2_engine, seed=None)
    assert seeds(a, temperature=0.7) != seeds(b, temperature=0.7)
    c = Dashboard(smollm2_engine)
    c.knobs.seed.value = 50
    assert seeds(c, temperature=0.7) == [50, 51, 52]
    assert seeds(Dashboard(smollm2_engine, seed=7), temperature=0.7) == \
        seeds(Dashboard(smollm2_engine, seed=7), temperature=0.7) == [7, 8, 9]
    assert seeds(a, temperature=0.7, seed=100) == [103, 104, 105]    # after a's first 3
    assert seeds(a, temperature=0) == [None] * 3


def test_dashboard_shades_real_engine_tokens():
    """The dashboard asks the engine for logprobs, and the stream cards shade what the engine
    sends (not only hand-made events): each token's probability with its top candidates."""
    from widgets import Dashboard
    dash = Dashboard(config=EngineConfig(model="random:tiny", device="cpu", num_kv_blocks=64))
    dash.prompts.value = "5 6 7 8"
    rids = dash.send(2, SamplingParams(max_tokens=6, temperature=1.0, ignore_eos=True))
    assert len(rids) == 2 and asyncio.run(dash.wait(timeout=60))
    dash.pump.tick()
    for rid in rids:
        pieces = dash.streams.streams[rid].pieces
        assert len(pieces) == 6
        for p in pieces:
            assert 0 < p.prob <= 1 and len(p.alternatives) >= 5
            probs = [q for _, q in p.alternatives]
            assert probs == sorted(probs, reverse=True) and p.prob <= probs[0] + 1e-6
    dash.source.close()


def test_a_live_plot_sends_the_whole_figure_and_only_what_changed(comms):
    """The live panels' figures are LivePlots: each sync sends the kernel's figure whole
    (the data and layout that changed, in one message), so a browser view that missed an
    update, or drew late, shows the same figure as the kernel; nothing changed, nothing
    sent. Its module is small (plotly.js loads in the view, not as the module anywidget
    must load within 2 s before it handles any message), and it says when a view drew it."""
    from widgets import BatchTimeline
    from widgets.figures import when_drawn
    from widgets.sources import Update
    from workbench.telemetry import StepEvent
    step = dict(start=0.0, duration=0.01, phase="decode", num_prefill_tokens=0,
                num_decode_tokens=4, num_cached_tokens=0, tokens_per_request={"r0": 1},
                kinds={"r0": "decode"}, num_running=1, num_waiting=0, kv_blocks_used=3,
                kv_blocks_free=1, kv_blocks_cached=0, num_preempted=0, preempted=[],
                graph=False, graph_size=None, graph_kind=None)
    tl = BatchTimeline()
    plot = tl.plot
    assert len(plot._esm) < 4000 and len(plot._plotly) > 1_000_000
    n = len(comms)
    tl.update(Update(steps=[StepEvent(step=i, **step) for i in range(6)]))
    sent = [d["state"] for _, c, d in comms[n:] if c == plot.comm.comm_id]
    assert len(sent) == 1 and "traces" in sent[0]
    assert sent[0]["traces"][1]["x"] == [0, 1, 2, 3, 4, 5] == list(tl.fig.data[1].x)
    assert plot.traces[1]["y"] == [4] * 6
    assert plot.figure_layout["xaxis3"]["title"]["text"] == tl.x_title
    n = len(comms)
    plot.sync()                                           # unchanged: nothing to send
    assert [c for _, c, _ in comms[n:] if c == plot.comm.comm_id] == []
    called = []
    when_drawn([plot], lambda: called.append(1))
    assert not called
    plot.drawn = True                                     # what the browser view sets
    assert called == [1]
    when_drawn([plot], lambda: called.append(2))          # drawn already: at once
    assert called == [1, 2]


def test_stream_cards_dim_a_reasoning_models_thinking():
    """A reply that opens with a <think> block (Qwen3's): the thinking is drawn dimmed apart
    from the answer and the tags are not shown, while it streams and after; with logprobs,
    the shaded tokens of the thinking are dimmed too."""
    from widgets import TokenStreamPanel
    from widgets.sources import Update
    from workbench.engine import TokenEvent

    panel = TokenStreamPanel()
    pieces = ["<think>", "Let", " me", " see", "</think>", "\n\n", "Paris", "."]
    panel.update(Update(submitted=[("r", 0.0, "q")], events=[
        TokenEvent("r", i, t, i + 1, float(i)) for i, t in enumerate(pieces[:3])]))
    assert '<div class="txt"><div><span class="think">Let me</span></div>' in panel.view.value
    panel.update(Update(events=[TokenEvent("r", i, t, i + 1, float(i))
                                for i, t in enumerate(pieces) if i >= 3]))
    html_ = panel.view.value
    assert '<span class="think">Let me see</span>\n\nParis.</div>' in html_
    assert "think&gt;" not in html_ and "&lt;/think" not in html_

    Event = TokenEvent
    if "logprobs" not in {f.name for f in dataclasses.fields(TokenEvent)}:
        Event = dataclasses.make_dataclass(
            "Event", [("logprobs", dict, dataclasses.field(default=None))], bases=(TokenEvent,))
    shaded = TokenStreamPanel()
    events = [Event("s", i, t, i + 1, float(i), logprobs={i: Logprob(math.log(0.5), 1, t)})
              for i, t in enumerate(pieces)]
    shaded.update(Update(submitted=[("s", 0.0, "q")], events=events))
    html_ = shaded.view.value
    assert re.search(r'<span class="tk think" [^>]*> see</span>', html_)
    assert re.search(r'<span class="tk" [^>]*>Paris</span>', html_)
    assert "think&gt;" not in html_


def spec_event(rid, i, text, **kw):
    from workbench.engine import TokenEvent
    return TokenEvent(rid, i, text, i, float(i), **kw)


def test_stream_cards_mark_accepted_drafts_and_show_rejected_ones_on_demand():
    """Accepted drafts and the target's own token at a verify step are marked apart (with a
    legend once any request speculated); the rejected drafts are in that token's hover text,
    and drawn struck through before it only with the toggle on."""
    from widgets import TokenStreamPanel
    from widgets.sources import Update
    ev = spec_event
    panel = TokenStreamPanel()
    panel.update(Update(submitted=[("a", 0.0, "p"), ("b", 0.0, "q")],
                        events=[ev("a", 1, " The"), ev("b", 1, " plain"), ev("b", 2, " text")]))
    assert "accepted draft" not in panel.view.value                    # nobody speculated
    assert panel.show_rejected.layout.display == "none"
    panel.update(Update(events=[
        ev("a", 2, " quick", draft=True), ev("a", 3, " brown", draft=True),
        ev("a", 4, " cat", rejected=[" fox", " jumps"]),                # verify: 2 of 4 kept
        ev("a", 5, " sat"),                                             # a plain decode
        ev("a", 6, " on", rejected=[]), ev("a", 7, " the", draft=True),  # all kept, the bonus
        ev("a", 8, " mat", rejected=[" rug"], finished=True, finish_reason="stop")]))
    page = panel.view.value
    head, cards = page.split('<div class="cards">')
    assert 'class="acc">accepted draft' in head and 'class="rej">rejected draft' in head
    assert panel.show_rejected.layout.display == ""
    marked = re.findall(r'<span class="tk (acc|own)" title="([^"]*)">([^<]*)</span>', cards)
    assert [(k, t) for k, _, t in marked] == [("acc", " quick"), ("acc", " brown"),
                                              ("own", " cat"), ("own", " on"), ("acc", " the"),
                                              ("own", " mat")]
    tips = [html.unescape(tip) for _, tip, _ in marked]
    assert "rejected drafts: ' fox' ' jumps'" in tips[2] and "bonus token" in tips[3]
    assert "accepted draft" in tips[0]
    assert "class=\"rej\"" not in cards                              # toggle off
    text = re.sub(r"<[^>]+>", "", cards.split('<div class="txt"><div>')[1].split("</div>")[0])
    assert html.unescape(text) == " The quick brown cat sat on the mat"
    assert re.search(r"<div>\s*plain text</div>", cards)                 # b: unmarked
    panel.show_rejected.value = True                                   # redraws at once
    cards = panel.view.value.split('<div class="cards">')[1]
    assert re.findall(r'<span class="rej"[^>]*>([^<]*)</span><span class="tk own"[^>]*>'
                      r'([^<]*)</span>', cards) == [(" fox jumps", " cat"), (" rug", " mat")]
    panel.clear()
    assert panel.show_rejected.layout.display == "none"


def test_timeline_draws_drafted_against_accepted_tokens_per_verify_step():
    """A real n-gram engine's verify steps: a drafted and an accepted bar each, equal to the
    step's counts, with hover text; none drawn while no step drafted."""
    from widgets import BatchTimeline
    from widgets.sources import Update
    from workbench.telemetry import StepEvent
    p = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    prompt = [17, 42, 99, 5, 311, 12, 250, 7] * 4
    e = Engine(model="random:tiny", device="cpu", speculative_config={
        "method": "ngram", "num_speculative_tokens": 3, "adaptive": False})
    e.generate([prompt, prompt[3:]], p)
    steps = list(e.telemetry.steps)
    tl = BatchTimeline()
    tl.update(Update(steps=steps[:1]))                      # the prefill: nothing drafted yet
    drafted, accepted = tl.fig.data[7:9]
    assert not drafted.visible and not accepted.visible
    tl.update(Update(steps=steps[1:]))
    assert drafted.visible and accepted.visible and drafted.name == "drafted"
    verify = [s for s in steps if s.drafts]
    sd = e.telemetry.spec_decode
    assert verify and sd.num_accepted_tokens > 0
    by_step = {x: (d, a, h) for x, d, a, h in zip(drafted.x, drafted.y, accepted.y,
                                                  accepted.hovertext)}
    for s in steps:
        d, a, h = by_step[s.step]
        if s.drafts:
            assert (d, a) == (s.num_draft_tokens, s.num_accepted_tokens)
            assert f"{s.num_draft_tokens} drafted, {s.num_accepted_tokens} accepted" in h
            assert all(f"{rid}: {s.accepted[rid]} of {len(ds)} kept" in h
                       for rid, ds in s.drafts.items())
        else:
            assert (d, a, h) == (None, None, None)
    assert sum(filter(None, drafted.y)) == sd.num_draft_tokens
    assert sum(filter(None, accepted.y)) == sd.num_accepted_tokens
    i = list(tl.fig.data[1].x).index(verify[0].step)
    assert "speculative:" in tl.fig.data[1].hovertext[i]      # the output bar's hover too
    tl.clear()
    assert not tl.fig.data[7].visible and not tl.fig.data[7].x
    e.shutdown()


def test_knobs_make_the_speculative_config():
    """Method and k (and the draft's source) make speculative_config; the config's other
    fields stay while the method does; a bad one is the config's error, naming the field."""
    from widgets.knobs import KnobPanel
    ngram = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 2}
    knobs = KnobPanel(EngineConfig(model="random:tiny", device="cpu", speculative_config=ngram))
    assert (knobs.spec_method.value, knobs.num_speculative_tokens.value) == ("ngram", 3)
    assert knobs.spec_model.layout.display == "none"
    knobs.num_speculative_tokens.value = 5
    assert knobs.make_config().speculative_config == {**ngram, "num_speculative_tokens": 5}
    knobs.spec_method.value = "draft_model"
    assert knobs.spec_model.layout.display == ""
    with pytest.raises(ValueError, match="speculative_config.model"):
        knobs.make_config()
    knobs.spec_model.value = "random:tiny"
    assert knobs.make_config().speculative() .model == "random:tiny"
    assert knobs.make_config().speculative_config == {
        "method": "draft_model", "num_speculative_tokens": 5, "model": "random:tiny"}
    knobs.spec_method.value = "off"
    assert knobs.make_config().speculative_config is None
    assert knobs.num_speculative_tokens.layout.display == "none"
    knobs.show_config(EngineConfig(model="random:tiny", device="cpu", speculative_config={
        "method": "ngram", "num_speculative_tokens": 24}))
    assert (knobs.spec_method.value, knobs.num_speculative_tokens.value) == ("ngram", 24)
    off = KnobPanel(EngineConfig(model="random:tiny", device="cpu"))
    assert off.spec_method.value == "off" and off.values()["speculative_config"] is None


PASSAGE = ("The quick brown fox jumps over the lazy dog. A journey of a thousand miles begins "
           "with a single step. All that glitters is not gold. ")


def test_dashboard_rebuilt_with_speculation_marks_exactly_the_accepted_tokens(comms):
    """Apply with n-gram speculation: the header says so, and the stream card of a reply that
    copies its prompt marks exactly the tokens the engine's verify steps accepted (and the
    target's own after them); with the toggle, exactly the drafts they rejected, struck
    through; the timeline draws the verify steps' drafts."""
    from widgets import Dashboard
    dash = Dashboard(config=EngineConfig(model="random:tiny", device="cpu", num_kv_blocks=64))
    knobs = dash.knobs
    knobs.set_values(model="smollm2", speculative_config={"method": "ngram",
                                                          "num_speculative_tokens": 4})
    e = knobs.apply()
    assert e is not None and dash.source.engine is e, knobs.last_error
    assert e.info().config.speculative().method == "ngram"
    assert "ngram, k=4" in dash.header.value and knobs.spec_method.value == "ngram"
    dash.prompts.value, dash.chat.value = PASSAGE * 2 + "The quick", False
    first = e.telemetry.num_steps
    (rid,) = dash.send(1, SamplingParams(temperature=0, max_tokens=20, ignore_eos=True))
    assert asyncio.run(dash.wait(timeout=120))
    dash.pump.tick()
    steps = [s for s in e.telemetry.steps_since(first) if s.drafts]
    acc = sum(s.accepted[rid] for s in steps)
    assert steps and acc > 0, "nothing was accepted: the test would check nothing"
    assert any(s.accepted[rid] < len(s.drafts[rid]) for s in steps), "nothing rejected"
    decode = e.tokenizer.decode
    want_acc = [decode([t]) for s in steps for t in s.drafts[rid][:s.accepted[rid]]]
    want_rej = ["".join(decode([t]) for t in s.drafts[rid][s.accepted[rid]:])
                for s in steps if s.accepted[rid] < len(s.drafts[rid])]
    st = dash.streams.streams[rid]
    assert [p.text for p in st.pieces if p.spec == "draft"] == want_acc
    assert sum(p.spec == "own" for p in st.pieces) == len(steps)
    cards = dash.streams.view.value.split('<div class="cards">')[1]
    assert "accepted draft" in dash.streams.view.value.split('<div class="cards">')[0]
    marked = [html.unescape(t) for t in re.findall(r'class="tk acc"[^>]*>([^<]*)<', cards)]
    assert marked == want_acc
    assert len(re.findall(r'class="tk own"', cards)) == len(steps)
    assert 'class="rej"' not in cards
    dash.streams.show_rejected.value = True
    cards = dash.streams.view.value.split('<div class="cards">')[1]
    assert [html.unescape(t) for t in re.findall(r'class="rej"[^>]*>([^<]*)<', cards)] == want_rej
    assert dash.timeline.fig.data[7].visible
    assert sum(filter(None, dash.timeline.fig.data[8].y)) == acc
    dash.source.close()


def test_dashboard_command_takes_a_speculative_config(monkeypatch, capsys):
    """`workbench dashboard --speculative-config`: a bad one is refused before Voila starts;
    a good one reaches the page's engine and its knobs (through the environment)."""
    from widgets import Dashboard
    from workbench import cli
    assert cli.main(["dashboard", "--speculative-config",
                     '{"method": "nope", "num_speculative_tokens": 2}']) == 2
    assert "speculative_config.method" in capsys.readouterr().err
    assert cli.main(["dashboard", "--url", "http://127.0.0.1:1", "--speculative-config",
                     '{"method": "ngram", "num_speculative_tokens": 2}']) == 2
    assert "--speculative-config" in capsys.readouterr().err
    monkeypatch.setenv("WORKBENCH_MODEL", "random:tiny")
    monkeypatch.setenv("WORKBENCH_DEVICE", "cpu")
    monkeypatch.setenv("WORKBENCH_SPECULATIVE_CONFIG",
                       '{"method": "ngram", "num_speculative_tokens": 2}')
    dash = Dashboard.from_env()
    assert dash.source.engine.info().config.speculative().num_speculative_tokens == 2
    assert (dash.knobs.spec_method.value, dash.knobs.num_speculative_tokens.value) == ("ngram", 2)
    dash.source.close()


def test_stepper_shows_drafts_accepted_and_rejected():
    """An n-gram engine on a prompt that repeats itself: the verify steps' rows list what was
    drafted, what the target kept and cut, and the tokens are plain greedy decoding's."""
    from widgets import Stepper
    spec = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3}
    e = Engine(model="random:tiny", device="cpu", block_size=8, speculative_config=spec)
    prompt = [7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20] * 3
    p = dict(max_tokens=32, ignore_eos=True)
    st = Stepper(e)
    a = st.add(prompt, **p)
    recs = st.run()
    rows = [r.row(a) for r in recs if any(x.request_id == a for x in r.rows)]
    verifies = [x for x in rows if x.action == "verify"]
    assert verifies and all(x.drafts for x in verifies)
    for r in recs:                                   # the header's counts are its rows'
        assert r.num_draft_tokens == sum(len(x.drafts) for x in r.rows)
        assert r.num_accepted_tokens == sum(x.accepted for x in r.rows)
    for x in verifies:       # the accepted drafts are the first tokens handed out, then the target's
        assert x.token_ids[:x.accepted] == x.drafts[:x.accepted]
        assert len(x.token_ids) <= x.accepted + 1 and x.token_ids[-1] == x.token_id
    assert sum(x.accepted for x in verifies) > 0
    got = [t for x in rows for t in x.token_ids]
    plain = Engine(model="random:tiny", device="cpu", block_size=8)
    assert got == plain.generate([prompt], SamplingParams(temperature=0, **p))[0].token_ids
    m = next(m for m in e.telemetry.requests if m.request_id == a)
    assert m.num_draft_tokens == sum(len(x.drafts) for x in verifies)
    assert m.num_accepted_tokens == sum(x.accepted for x in verifies)
    # what the panel drew for a step that drafted: the counts, kept and struck-through drafts
    shown_rec = next((r for r in recs if r.row(a).rejected),                # one cut, else
                     next(r for r in recs if r.row(a).drafts))              # a verify
    st._render(shown_rec)
    shown = st.view.value
    x = shown_rec.row(a)
    assert f"drafted {len(x.drafts)}, accepted {x.accepted}, rejected {len(x.rejected)}" in shown
    assert shown.count("class='draft-rejected'") == len(x.rejected)
    assert shown.count("class='draft-accepted'") == x.accepted
    assert "accepted/drafted" in st.history_view.value
    parts = [st.kv, st.view, st.step_button, *st.kv.children]
    st.close()                                # its widgets go with it (no saved state left)
    assert st.comm is None and all(x.comm is None for x in parts)


def test_log_axes_label_decades_not_every_minor_tick():
    """Log axes are labelled at whole decades where the figures span two or more, at 1-2-5
    of each decade on a shorter range; never Plotly's row of minor labels (… 7, 8, 9)."""
    from widgets.figures import log_ticks
    wide = log_ticks([3, 40, 4000])
    assert wide["tickvals"] == [1.0, 10.0, 100.0, 1000.0, 10000.0]
    short = log_ticks([3, 8, None, 0])
    assert short["tickvals"] == [1.0, 2.0, 5.0, 10.0, 20.0, 50.0]
    assert all(round(v / 10 ** math.floor(math.log10(v))) in (1, 2, 5) for v in short["tickvals"])
    assert log_ticks([None]) == {"type": "log"}


def test_the_headers_sampling_cost_says_when_the_machine_was_busy(monkeypatch):
    """The header's "sampling adds … ms" is measured three times, interleaved, between two
    looks at the machine: on a busy machine it says so and is measured again next time; on a
    quiet one it is kept."""
    from workbench.bench import steady

    from widgets.sources import LocalSource
    e = Engine(model="random:tiny", device="cpu", num_kv_blocks=32)
    src, calls = LocalSource(e), []
    real = e.sampler_cost
    monkeypatch.setattr(e, "sampler_cost", lambda *a: calls.append(1) or real(*a))
    monkeypatch.setattr(steady, "probe_ms", lambda: 1.0)
    monkeypatch.setattr(steady, "cpu_seconds", lambda: None)    # the load average decides
    try:
        p = SamplingParams(temperature=0.7)
        monkeypatch.setattr(steady, "load_average", lambda: 9.0)
        busy = src.sampling_cost(p, 8)
        assert "measured while this machine was busy, so not the engine's figure (load " \
               "average 9.0 then 9.0" in busy and len(calls) == 3
        src.sampling_cost(p, 8)
        assert len(calls) == 6                              # not kept: measured again
        monkeypatch.setattr(steady, "load_average", lambda: 0.1)
        quiet = src.sampling_cost(p, 8)
        assert re.fullmatch(r"adds [0-9.]+ ms to a step of 8 requests on this machine "
                            r"\([0-9.]+ ms sampled, [0-9.]+ ms greedy\)", quiet), quiet
        assert src.sampling_cost(p, 8) == quiet and len(calls) == 9     # kept
    finally:
        src.close()
