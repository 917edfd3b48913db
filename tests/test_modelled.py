"""The modelled device (issue 26 item 2): the real scheduler over modelled step times.

- It makes the scheduling decisions the real engine makes on the same requests (which
  requests ran in which step, with how many tokens; chunks, prefix-cache hits, preemptions).
- Its clock is the cost model's: each step's recorded duration is its modelled time, so
  TTFT and TPOT are modelled; requests may arrive later on that clock (open-loop replay).
- Profiles: unknown ones are refused naming the field; uncalibrated ones say so in info().
- The fits: the CPU fit recovers known coefficients, and the replay of a step sequence (the
  H200 fit's) gives the figures the modelled engine itself records.
"""
from __future__ import annotations

import json
import math
import random
from dataclasses import replace

import pytest

from workbench import Engine, SamplingParams
from workbench.modelled.cost import step_time
from workbench.modelled.fit import CPU_PARAMS, StepTrace, fit_cpu_steps
from workbench.modelled.profiles import Coefficients, get_profile, profile_names
from workbench.telemetry import percentile

KNOBS = dict(model="random:tiny", block_size=16, num_kv_blocks=12, max_num_seqs=4,
             max_num_batched_tokens=48, max_model_len=160, enable_prefix_caching=True)


def workload(vocab: int) -> list[tuple[str, list[int], int]]:
    """Prompts that chunk (> 48 tokens), share a prefix (cache hits) and together outgrow
    11 usable blocks (preemption)."""
    r = random.Random(3)
    shared = [r.randrange(10, vocab) for _ in range(32)]
    out = []
    for i, n in enumerate((70, 20, 40, 12, 55, 30)):
        body = [r.randrange(10, vocab) for _ in range(n)]
        out.append((f"r{i}", (shared + body) if i % 2 else body, 24 + 4 * i))
    return out


def step_sequence(e: Engine) -> list[tuple]:
    for rid, prompt, n in workload(e.info().vocab_size):
        e.add_request(prompt, SamplingParams(max_tokens=n, temperature=0, ignore_eos=True), rid)
    while e.has_unfinished_requests():
        e.step()
    return [(s.phase, s.tokens_per_request, s.kinds, s.num_cached_tokens, s.preempted,
             sorted(s.finished)) for s in e.telemetry.snapshot()[0] if s.phase != "idle"]


@pytest.mark.parametrize("profile", ["h200", "a100"])
def test_the_modelled_device_schedules_as_the_real_engine(profile):
    real = Engine(device="cpu", graph_mode="eager", **KNOBS)
    modelled = Engine(device=f"model:{profile}", graph_mode="eager", dtype="float32", **KNOBS)
    try:
        want, got = step_sequence(real), step_sequence(modelled)
    finally:
        real.close(), modelled.close()
    assert any(p for *_, p, _ in want), "the workload preempts"
    assert any(c for _, _, _, c, _, _ in want), "the workload hits the prefix cache"
    assert any("chunk" in k.values() for _, _, k, *_ in want), "the workload chunks"
    assert got == want


def closed_loop_sequence(e: Engine, c: int) -> list[tuple]:
    """c requests in flight, each replaced as its end is handed out (a closed-loop client),
    until ten have run; the steps' (phase, tokens per request, kinds, finished, scheduled
    ahead)."""
    r = random.Random(4)
    vocab = e.info().vocab_size
    work = [([r.randrange(10, vocab) for _ in range(r.randint(4, 40))], n)
            for n in (9, 3, 14, 6, 11, 2, 8, 13, 5, 7)]
    pending, inflight = list(range(len(work))), set()
    while pending or inflight:
        while pending and len(inflight) < c:
            i = pending.pop(0)
            prompt, n = work[i]
            inflight.add(e.add_request(prompt, SamplingParams(max_tokens=n, temperature=0,
                                                              ignore_eos=True), f"r{i}"))
        for ev in e.step():
            if ev.finished:
                inflight.discard(ev.request_id)
    e.core.finish_in_flight()
    return [(s.phase, s.tokens_per_request, s.kinds, sorted(s.finished), s.scheduled_ahead)
            for s in e.telemetry.snapshot()[0] if s.phase != "idle"]


def test_the_modelled_device_runs_ahead_as_the_real_engine(replaying_platform):
    """With async scheduling, the real engine keeps a replayed decode step in flight and
    schedules the next from it, so a request that ends frees its place a step later and the
    client's next request is admitted a step later. The modelled device does the same, step
    for step, in a closed loop that keeps replacing requests (the H200's concurrency-64
    TTFT was 47 % off while it did not); and without async scheduling it does not."""
    kw = dict(model="random:tiny", block_size=16, num_kv_blocks=200, max_num_seqs=4,
              max_model_len=160, graph_mode="decode", cudagraph_capture_sizes=[1, 2, 4])
    real = Engine(device="cpu", async_scheduling=True, **kw)
    modelled = Engine(device="model:h200", dtype="float32", async_scheduling=True, **kw)
    sync = Engine(device="model:h200", dtype="float32", async_scheduling=False, **kw)
    try:
        assert real.info().async_scheduling and modelled.info().async_scheduling
        want, got = closed_loop_sequence(real, 3), closed_loop_sequence(modelled, 3)
        got_sync = closed_loop_sequence(sync, 3)
    finally:
        real.close(), modelled.close(), sync.close()
    assert sum(ahead for *_, ahead in want) >= 10, "the real engine ran ahead"
    assert got == want
    assert [s[:4] for s in got_sync] != [s[:4] for s in want]
    assert not any(ahead for *_, ahead in got_sync)


def test_unknown_profile_is_refused_naming_the_field():
    with pytest.raises(ValueError, match=r"^device: unknown modelled device profile 'nope'"):
        Engine(model="random:tiny", device="model:nope")
    with pytest.raises(ValueError, match="^device:"):
        Engine(model="random:tiny", device="model:")


def test_uncalibrated_profiles_say_so():
    e = Engine(model="random:tiny", device="model:910b", num_kv_blocks=64)
    try:
        m = e.info().modelled
        assert m["profile"] == "910b" and m["calibrated"] is False and m["error"] == {}
        assert "uncalibrated" in m["source"] and "(modelled)" in e.info().device_name
        assert any("UNCALIBRATED" in n for n in e.telemetry.notices)
        assert e.info().graph_mode == "full" and e.info().block_size == 128   # an NPU's rules
    finally:
        e.close()
    h = get_profile("h200")
    assert h.calibrated and not get_profile("h100").calibrated
    assert set(profile_names()) == {"cpu", "h200", "h100", "a100", "910b", "910c"}


def test_times_are_the_cost_models():
    """TTFT and TPOT of a lone request are its steps' modelled times, on the engine's virtual
    clock (the run itself takes host time only)."""
    e = Engine(model="random:qwen3-0.6b", device="model:h100", max_num_seqs=8,
               max_num_batched_tokens=512, max_model_len=1024, num_kv_blocks=65)
    try:
        assert e.clock.virtual and e.info().graph_mode == "decode"
        out = e.generate([list(range(10, 138))], SamplingParams(max_tokens=5, ignore_eos=True))
        m = out[0].metrics
        steps = [s for s in e.telemetry.snapshot()[0] if s.phase != "idle"]
        prof, info = get_profile("h100"), e.info()
        want = [step_time(prof, info, s.tokens_per_request, s.context_lens, s.kinds,
                          s.graph_kind, info.async_scheduling).seconds for s in steps]
        # Durations are differences of clock readings (host seconds since boot plus virtual
        # time): at a few days of uptime each reading's rounding is ~1e-11 s, 1e-8 of a 1.5 ms
        # step. 1e-6 still tells any other cost apart.
        assert [s.duration for s in steps] == pytest.approx(want, rel=1e-6)
        assert steps[0].phase == "prefill" and not steps[0].graph
        assert all(s.graph_kind == "FULL" for s in steps[1:])
        assert m.ttft == pytest.approx(want[0], rel=1e-6)
        assert m.tpot == pytest.approx(sum(want[1:]) / 4, rel=1e-6)
        assert want[0] > want[1] > 0          # a 128-token prefill costs more than a decode
    finally:
        e.close()


def test_requests_arrive_on_the_virtual_clock():
    e = Engine(model="random:tiny", device="model:h200", max_num_seqs=4, num_kv_blocks=64)
    try:
        t0 = e.clock.now()
        p = SamplingParams(max_tokens=3, ignore_eos=True)
        a = e.add_request([5] * 20, p, "a", arrival_time=t0 + 2.0)
        b = e.add_request([6] * 20, p, "b", arrival_time=t0 + 5.0)
        assert e.request_states()[0].status == "queued"
        while e.has_unfinished_requests():
            e.step()
        ms = {m.request_id: m for m in e.telemetry.requests}
        assert ms[a].arrival_time == t0 + 2.0 and ms[b].arrival_time == t0 + 5.0
        assert ms[a].first_scheduled_time == pytest.approx(t0 + 2.0)
        assert ms[b].first_scheduled_time == pytest.approx(t0 + 5.0)
        assert 0 < ms[a].ttft < 0.1 and ms[a].finished_time < t0 + 5.0
        with pytest.raises(ValueError, match="^arrival_time"):
            e.add_request([5] * 4, p, arrival_time=math.nan)
    finally:
        e.close()


def test_modelled_requests_refuse_what_needs_logits_and_draw_uniformly():
    e = Engine(model="random:tiny", device="model:h200", num_kv_blocks=32)
    try:
        with pytest.raises(ValueError, match="^prompt_logprobs: a modelled device"):
            e.add_request([5, 6, 7], SamplingParams(max_tokens=2, prompt_logprobs=1))
        out = e.generate([[5, 6, 7]], SamplingParams(max_tokens=3, logprobs=2, ignore_eos=True))
        lp = out[0].outputs[0].logprobs
        assert len(lp) == 3 and all(len(d) >= 1 for d in lp)
        uniform = -math.log(e.info().vocab_size - 1)       # random:tiny has one EOS id
        assert all(v.logprob == pytest.approx(uniform) for d in lp for v in d.values())
        with pytest.raises(ValueError, match="^device: a modelled device runs no model"):
            e.core.prompt_logits([5, 6, 7])
        assert e.device_roofs().peak_flops == e.info().modelled["peak_flops"]
        out = e.generate([[5, 6, 7]] * 2, SamplingParams(max_tokens=4, n=2, ignore_eos=True))
        assert all(len(c.token_ids) == 4 for o in out for c in o.outputs)
        assert not e.has_unfinished_requests()
    finally:
        e.close()


def test_cpu_fit_recovers_known_coefficients():
    """Steps timed by the CPU's cost form with known coefficients: the fit gets every one of
    them back, and no coefficient it does not fit moves off 0."""
    from workbench.telemetry import StepEvent
    e = Engine(model="random:smollm2-135m", device="model:a100", num_kv_blocks=65,
               max_model_len=1024)
    info = e.info()
    e.close()
    zero = Coefficients(**{f: 0.0 for f in Coefficients.__dataclass_fields__})
    known = replace(zero, weight_scale=0.28, matmul_scale=0.3, attention_scale=1.7,
                    rows_log2=0.013)
    assert set(CPU_PARAMS) == {k for k, v in known.as_dict().items() if v}
    peak, bw = 2e11, 2e10
    prof = get_profile("a100").__class__("x", "x", "cpu", peak, bw, None, "float32", known,
                                         True, "test")
    r = random.Random(1)
    steps = []
    for i in range(40):
        n = 1 if i % 5 == 0 else r.randint(1, 12)        # some batch-1 decodes
        tok = {f"q{j}": (1 if i % 5 == 0 or r.random() < 0.7 else r.randint(2, 300))
               for j in range(n)}
        ctx = {k: r.randint(0, 800) for k in tok}
        kinds = {k: "decode" if v == 1 else "prefill" for k, v in tok.items()}
        d = step_time(prof, info, tok, ctx, kinds, None, False).seconds
        steps.append(StepEvent(i, 0.0, d, "mixed", 0, 0, 0, tok, kinds, 0, 0, 0, 0, 0, 0, [],
                               context_lens=ctx))
    k, fit = fit_cpu_steps(steps, info, peak, bw)
    assert fit["max_rel_err"] < 1e-6
    for name, v in known.as_dict().items():
        assert getattr(k, name) == pytest.approx(v, rel=1e-4, abs=1e-12), name


def test_cpu_calibration_fits_the_real_engine_and_caches_it(tmp_path, monkeypatch):
    """model:cpu on a machine with no profile yet: the real CPU engine runs every phase of the
    calibration workload, the fit moves only the CPU form's coefficients, the profile is
    cached, and the next model:cpu engine reads it rather than calibrating again."""
    from workbench.engine import calibrate
    from workbench.modelled import cpu_cache
    path = tmp_path / "cpu-profile.json"
    monkeypatch.setattr(cpu_cache, "cpu_profile_path", lambda config, dtype: path)
    knobs = dict(model="random:tiny", device="model:cpu", num_kv_blocks=64)
    e = Engine(**knobs)
    m = e.info().modelled
    e.close()
    d = json.loads(path.read_text())
    assert m["profile"] == "cpu" and m["calibrated"] and m["source"] == d["source"]
    phases = calibrate.cpu_calibration_workload(16, 1000, 2048)
    batch1_steps = phases[0][0][1] - 1
    decode_steps = sum(n - 1 for _, n in phases[1])          # the batch-2 phase's decodes
    assert d["fit"]["steps"] >= batch1_steps + decode_steps + len(phases), d["fit"]
    assert f"fitted to {d['fit']['steps']} steps of the real CPU engine" in d["source"]
    k = Coefficients.from_dict(d["coefficients"])
    assert {n for n, v in k.as_dict().items() if v} <= set(CPU_PARAMS), k
    assert k.weight_scale > 0 and k.matmul_scale + k.rows_log2 > 0, k
    stamp = path.stat().st_mtime_ns
    e = Engine(**knobs)
    assert e.info().modelled["source"] == d["source"]
    e.close()
    assert path.stat().st_mtime_ns == stamp


def test_replayed_step_sequence_gives_the_engines_own_figures():
    """The H200 fit's shortcut: a workload's step sequence, replayed with the coefficients,
    gives the TTFT, TPOT and throughput the modelled engine records running it."""
    e = Engine(model="random:tiny", device="model:h200", max_num_seqs=8,
               max_num_batched_tokens=256, num_kv_blocks=128)
    try:
        r = random.Random(0)
        prompts = [[r.randrange(10, 500) for _ in range(r.randint(20, 200))] for _ in range(12)]
        e.generate(prompts, SamplingParams(max_tokens=16, ignore_eos=True))
        steps, recs = e.telemetry.snapshot()
        m = e.info().modelled
        trace = StepTrace(steps, recs, e.info(), m["peak_flops"], m["bandwidth"],
                          e.info().async_scheduling)
        got = trace.figures(Coefficients.from_dict(m["coefficients"]))
        ttft = [x.ttft for x in recs]
        tpot = [x.tpot for x in recs]
        span = max(x.finished_time for x in recs) - min(x.arrival_time for x in recs)
        assert got["ttft_p50_ms"] == pytest.approx(percentile(ttft, 50) * 1e3, rel=1e-6)
        assert got["ttft_p99_ms"] == pytest.approx(percentile(ttft, 99) * 1e3, rel=1e-6)
        assert got["tpot_p50_ms"] == pytest.approx(percentile(tpot, 50) * 1e3, rel=1e-6)
        assert got["out_tok_s"] == pytest.approx(12 * 16 / span, rel=1e-6)
        doubled = trace.figures(Coefficients.from_dict(
            {k: 2 * v for k, v in m["coefficients"].items()}))
        assert doubled["seconds"] == pytest.approx(2 * got["seconds"], rel=1e-6)
    finally:
        e.close()


def test_panels_render_a_modelled_engine_and_say_so():
    pytest.importorskip("ipywidgets")
    pytest.importorskip("plotly")
    import asyncio
    from widgets import (BatchTimeline, KVBlockMap, Live, RooflinePanel, Stepper, SummaryPanel,
                         TokenStreamPanel)
    e = Engine(model="random:tiny", device="model:a100", max_num_seqs=4, num_kv_blocks=64)
    params = SamplingParams(max_tokens=6, ignore_eos=True)

    async def run():
        live = Live(e, TokenStreamPanel(), BatchTimeline(), KVBlockMap(), SummaryPanel())
        rids = await live.generate([[5] * 20, [7] * 30], params, timeout=60)
        return live, rids
    try:
        live, rids = asyncio.run(run())
        streams, timeline, kv, summary = live.panels
        assert all(streams.streams[r].num_tokens == 6 for r in rids)
        assert "MODELLED on NVIDIA A100" in streams.view.value and "uncalibrated" in streams.view.value
        assert "MODELLED" in timeline.fig.layout.title.text
        assert "MODELLED" in summary.view.value and summary.figures()["ttft_p50"] > 0
        assert summary.num_finished == 2 and timeline.num_points > 0
        live.close()
        roof = RooflinePanel(e.info(), e.device_roofs())
        roof.add_steps(e.telemetry.snapshot()[0])
        assert roof.points and "MODELLED" in roof.note.value and "modelled" in roof.note.value
    finally:
        e.shutdown()
        e.close()
    from widgets.knobs import KnobPanel
    from workbench import EngineConfig
    knobs = KnobPanel(EngineConfig(model="random:tiny", device="model:h200", block_size=64))
    assert knobs.device.value == "model:h200" and knobs.block_size.value == 64
    assert {"model:cpu", "model:910c"} <= set(knobs.device.options)
    e = Engine(model="random:tiny", device="model:h200", max_num_seqs=4, num_kv_blocks=64)
    try:
        st = Stepper(e)
        a = st.add([5] * 20, max_tokens=3, ignore_eos=True)
        recs = st.run()
        assert recs[-1].rows[0].finish_reason == "length" and st.modelled.startswith("MODELLED")
        assert any(r.row(a).action == "prefill" for r in recs)
    finally:
        e.close()
