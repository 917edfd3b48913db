"""The goodput tuner (workbench.tune): the search on a made-up objective with a known optimum,
failing trials, goodput as DistServe counts it, bad input, the workload driver on a real
engine, the `workbench tune` command on random:tiny, and the TunePanel."""
from __future__ import annotations

import json
import math
import statistics
from pathlib import Path

import pytest

from workbench import Engine, EngineConfig
from workbench.tune import (SLO, Measurement, RequestRecord, RunResult, Space, TuneResult,
                            Workload, run_workload, successive_halving, vllm_flags)
from workbench.tune.search import plan

ROOT = Path(__file__).resolve().parents[1]
TRACE = ROOT / "docs" / "traces" / "smollm2-cpu.trace.json.gz"

SPACE = {"max_num_seqs": (1, 2, 4, 8, 16, 32), "block_size": (16, 32, 64),
         "prefill_interval": (1, 2, 4)}
BEST = {"max_num_seqs": 8, "block_size": 32, "prefill_interval": 2}


def made_up(knobs: dict, budget: int) -> Measurement:
    """A goodput that peaks at BEST, measured more finely at larger budgets (a small budget
    blurs it by a deterministic wobble that shrinks as the budget grows)."""
    d = (abs(math.log2(knobs["max_num_seqs"] / 8)) + abs(math.log2(knobs["block_size"] / 32))
         + abs(knobs["prefill_interval"] - 2))
    wobble = 0.4 * math.sin(7 * knobs["max_num_seqs"] + knobs["block_size"]) / budget
    g = 10.0 / (1.0 + d) + wobble
    return Measurement(goodput=g, attainment=1.0, throughput=g, ttft_ms=100 * (1 + d),
                       tpot_ms=10 * (1 + d), meets_slo=True)


def result_of(outcome, space: Space) -> TuneResult:
    return TuneResult(outcome, Workload(num_requests=9, concurrency=2),
                      SLO(ttft_ms=500, tpot_ms=50), space, EngineConfig(device="cpu"), "made up")


def test_successive_halving_finds_a_known_optimum():
    space = Space(SPACE)
    assert space.size == 54
    points = space.sample(54, EngineConfig(), seed=3, include_defaults=False)
    assert len(points) == 54 and BEST in points
    out = successive_halving(points, made_up, n_trials=80, eta=3, max_budget=27)
    assert out.plan == [54, 18, 6, 2] and out.budgets == [1, 3, 9, 27]
    assert len(out.trials) == 80 < 54 * 2               # not the whole grid at every budget
    assert out.best().knobs == BEST and out.best().rung == 3
    for rung in (1, 2, 3):       # each rung ran only configurations the rung before kept
        assert {tuple(t.knobs.values()) for t in out.trials if t.rung == rung} <= {
            tuple(t.knobs.values()) for t in out.trials if t.rung == rung - 1}
    # random points from a larger space: the best of them, found with few trials
    sample = space.sample(10, EngineConfig(), seed=0, include_defaults=False)
    out = successive_halving(sample, made_up, n_trials=14, eta=3, max_budget=9)
    best_possible = max(sample, key=lambda k: made_up(k, 10**9).goodput)
    assert out.best().knobs == best_possible


def test_plan_fits_the_trials():
    assert plan(8, 3) == [6, 2]
    assert plan(30, 3) == [21, 7, 2]
    assert plan(1, 3) == [1]
    assert sum(plan(100, 2)) <= 100


def test_a_failing_trial_is_recorded_and_the_search_goes_on():
    def refuses_64(knobs, budget):
        if knobs["block_size"] == 64:
            raise RuntimeError("the device refuses block_size 64")
        return made_up(knobs, budget)

    seen = []
    space = Space(SPACE)
    out = successive_halving(space.sample(54, EngineConfig(), include_defaults=False),
                             refuses_64, n_trials=80, max_budget=27,
                             progress=lambda t, done, total: seen.append((t.number, done, total)))
    failed = [t for t in out.trials if not t.ok]
    assert len(failed) == 18 and all(t.rung == 0 for t in failed)
    assert all(t.error == "RuntimeError: the device refuses block_size 64" for t in failed)
    assert out.best().knobs == BEST
    assert seen[-1] == (len(out.trials), len(out.trials), 80) and len(seen) == len(out.trials)
    # A trial's number is what progress counted it as ("trial 3/80" is trial 3 in the table).
    assert all(number == done for number, done, _ in seen)
    result = result_of(out, space)
    assert "failed: RuntimeError" in result.format()
    assert result.to_dict()["trials"][0]["knobs"]


def test_stop_keeps_what_was_measured():
    calls = []
    out = successive_halving(Space(SPACE).sample(54, EngineConfig(), include_defaults=False),
                             lambda k, b: calls.append(k) or made_up(k, b), n_trials=80,
                             max_budget=27, should_stop=lambda: len(calls) >= 5)
    assert out.stopped and len(out.trials) == 5 and out.best() is not None


def test_goodput_counts_requests_within_the_slo():
    slo = SLO(ttft_ms=100, tpot_ms=20)
    recs = [RequestRecord(10, 5, ttft=0.05, tpot=0.010, e2e=0.1, finished=True),   # served
            RequestRecord(10, 5, ttft=0.20, tpot=0.010, e2e=0.3, finished=True),   # late first
            RequestRecord(10, 5, ttft=0.05, tpot=0.030, e2e=0.2, finished=True),   # slow tokens
            RequestRecord(10, 5, ttft=0.09, tpot=0.019, e2e=0.2, finished=True),   # served
            RequestRecord(10, 5)]                                                  # cut off
    m = slo.measure(RunResult(recs, duration=2.0))
    assert m.num_served == 2 and m.goodput == pytest.approx(1.0) and m.attainment == 0.4
    assert m.throughput == pytest.approx(2.0)
    assert m.ttft_ms == math.inf and not m.meets_slo         # the unfinished one is p99
    m = slo.measure(RunResult(recs[:1] + recs[3:4], duration=1.0))
    assert m.meets_slo and m.goodput == pytest.approx(2.0) and m.ttft_ms < 100
    assert not SLO(ttft_ms=100, tpot_ms=20, e2e_ms=150).measure(
        RunResult(recs[:1] + recs[3:4], 1.0)).meets_slo      # the second's E2E is 200 ms


@pytest.mark.parametrize("make,field", [
    (lambda: SLO(ttft_ms=0, tpot_ms=50), "ttft_ms"),
    (lambda: SLO(ttft_ms=100, tpot_ms=0), "tpot_ms"),
    (lambda: SLO(ttft_ms=100, tpot_ms=50, e2e_ms=-1), "e2e_ms"),
    (lambda: Workload(request_rate=0), "request_rate"),
    (lambda: Workload(concurrency=0), "concurrency"),
    (lambda: Workload(), "request_rate, concurrency"),
    (lambda: Workload(concurrency=2, num_requests=0), "num_requests"),
    (lambda: Workload(concurrency=2, prompt_len=(9, 3)), "prompt_len"),
    (lambda: Space({}), "space: is empty"),
    (lambda: Space({"max_num_seqs": []}), "space: 'max_num_seqs' has no values"),
    (lambda: Space({"blok_size": [16]}), "space: 'blok_size' is not an EngineConfig field"),
    (lambda: Space({"block_size": [24]}), "block_size"),
    (lambda: Space({"device": ["cpu"]}), "space: 'device'"),
    (lambda: Space.parse(["max_num_seqs="]), "max_num_seqs"),
    (lambda: plan(0, 3), "n_trials"),
])
def test_bad_input_names_the_field(make, field):
    with pytest.raises(ValueError, match=field.replace("(", r"\(")):
        make()


def test_space_domains_come_from_the_engine():
    from workbench.config import PREEMPTION_MODES
    from workbench.platforms import block_sizes
    s = Space.default("cpu")
    assert s.knobs["block_size"] == block_sizes("cpu")
    assert s.knobs["graph_mode"] == ("eager",)            # the CPU captures no graphs
    assert s.knobs["preemption_mode"] == PREEMPTION_MODES
    assert EngineConfig().max_num_seqs in s.knobs["max_num_seqs"]
    pts = s.sample(12, EngineConfig(device="cpu"), seed=1)
    assert pts[0] == s.defaults(EngineConfig(device="cpu"))          # the defaults first
    assert len({json.dumps(p, sort_keys=True) for p in pts}) == 12
    assert all(p["max_num_batched_tokens"] >= p["max_num_seqs"] for p in pts)
    # a first rung of six (the defaults, then five drawn) tries every value of a knob that
    # has five, whatever the seed (a Latin hypercube, not independent draws)
    cpu = Space.default("cpu", knobs=("max_num_seqs", "max_num_batched_tokens",
                                      "prefill_interval", "enable_chunked_prefill", "block_size"))
    assert len(cpu.knobs["max_num_seqs"]) == 5 and cpu.size > 4 * 6
    for seed in range(20):
        drawn = cpu.sample(6, EngineConfig(device="cpu"), seed=seed)[1:]
        assert {p["max_num_seqs"] for p in drawn} == set(cpu.knobs["max_num_seqs"]), seed
    assert Space.parse(["max_num_seqs=4,8", "graph_mode=eager", "block_size"], "cpu").knobs == {
        "max_num_seqs": (4, 8), "graph_mode": ("eager",), "block_size": block_sizes("cpu")}


def test_the_space_gains_speculative_method_and_k(tmp_path, capsys):
    """speculative_config is a knob (issue 40): off or prompt lookup with k = 2, 4, 8 by
    default, any method's dicts when given (the CLI splits a value list at the commas outside
    a dict), exported as vLLM's --speculative-config; `workbench tune` runs the trials."""
    s = Space.default("cpu")
    dom = s.knobs["speculative_config"]
    assert dom[0] is None and [(d["method"], d["num_speculative_tokens"]) for d in dom[1:]] == [
        ("ngram", 2), ("ngram", 4), ("ngram", 8)]
    assert Space.default("model:h200").knobs["speculative_config"] == (None,)
    pts = s.sample(12, EngineConfig(device="cpu"), seed=0)
    assert pts[0]["speculative_config"] is None                 # the default: off
    assert {json.dumps(p["speculative_config"]) for p in pts} == {json.dumps(d) for d in dom}
    draft = {"method": "draft_model", "model": "random:tiny", "num_speculative_tokens": 3}
    parsed = Space.parse(['speculative_config=None,{"method": "ngram", "num_speculative_tokens": 4,'
                          ' "prompt_lookup_max": 3},' + json.dumps(draft) + ",None"], "cpu")
    assert parsed.knobs["speculative_config"] == (
        None, {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3}, draft)
    with pytest.raises(ValueError, match="speculative_config.*num_speculative_tokens"):
        Space({"speculative_config": [{"method": "ngram", "num_speculative_tokens": 0}]})
    with pytest.raises(ValueError, match="speculative_config.*method"):
        Space.parse(['speculative_config={"method": "eagle9", "num_speculative_tokens": 2}'], "cpu")
    f = vllm_flags({"speculative_config": {"method": "ngram", "num_speculative_tokens": 4}})
    assert f.flags == ["--speculative-config", '{"method": "ngram", "num_speculative_tokens": 4}']
    assert not f.unmapped and vllm_flags({"speculative_config": None}).flags == []
    from workbench.cli import main
    out = tmp_path / "tune.json"
    rc = main(["tune", "--model", "random:tiny", "--device", "cpu", "--num-kv-blocks", "128",
               "--concurrency", "2", "--num-requests", "4", "--input-len", "16:24",
               "--output-len", "24:24", "--ttft-ms", "5000", "--tpot-ms", "1000",
               "--knob", 'speculative_config=None,{"method": "ngram", "num_speculative_tokens": 2},'
                         '{"method": "ngram", "num_speculative_tokens": 4}',
               "--trials", "3", "--eta", "3", "--trial-timeout", "60", "--output", str(out)])
    assert rc == 0, capsys.readouterr().err
    d = json.loads(out.read_text())
    tried = [t["knobs"]["speculative_config"] for t in d["trials"]]
    assert None in tried and {"method": "ngram", "num_speculative_tokens": 4} in tried
    assert all(t["error"] is None and t["measurement"]["goodput"] > 0 for t in d["trials"])
    win = d["winner"]["knobs"]["speculative_config"]
    assert ("--speculative-config" in d["vllm_serve"]) == (win is not None)


def test_workload_arrivals_and_trace_lengths():
    wl = Workload(num_requests=2000, request_rate=4.0, seed=5)
    reqs = wl.requests()
    gaps = [b.arrival - a.arrival for a, b in zip(reqs, reqs[1:])]
    assert statistics.mean(gaps) == pytest.approx(0.25, rel=0.08)
    assert statistics.pstdev(gaps) == pytest.approx(0.25, rel=0.1)   # exponential: sd = mean
    assert wl.requests() == reqs and Workload(num_requests=3, concurrency=1).requests()[0].arrival is None
    pre = Workload(num_requests=3, concurrency=1, shared_prefix_len=16, prompt_len=(4, 4))
    ps = pre.prompts(1000)
    assert all(len(p) == 20 and p[:16] == ps[0][:16] for p in ps)
    tw = Workload.from_trace(TRACE, concurrency=2)
    from workbench.trace import Trace
    want = [(m.prompt_tokens, m.output_tokens) for m in Trace.load(TRACE).requests]
    assert [(q.prompt_len, q.output_len) for q in tw.requests()] == want


def test_the_driver_measures_from_the_scheduled_arrival():
    wl = Workload(num_requests=6, request_rate=50.0, prompt_len=(8, 24), output_len=(3, 6))
    with Engine(model="random:tiny", device="cpu", num_kv_blocks=64) as engine:
        run = run_workload(engine, wl)
        ours = {r.request_id: r for r in engine.telemetry.requests}
        assert run.num_finished == 6 and not run.timed_out
        first = ours["tune-0"].arrival_time
        for i, (rec, q) in enumerate(zip(run.records, wl.requests())):
            m = ours[f"tune-{i}"]
            assert m.output_tokens == rec.output_len                 # EOS ignored
            assert rec.ttft == m.ttft and rec.tpot == m.tpot
            # arrivals are the scheduled ones, not when the loop got round to adding them
            assert m.arrival_time - first == pytest.approx(q.arrival, abs=1e-9)
        with pytest.raises(ValueError, match="max_model_len"):
            run_workload(engine, Workload(num_requests=1, concurrency=1,
                                          prompt_len=(5000, 5000)))
        cut = run_workload(engine, Workload(num_requests=40, concurrency=2, output_len=(200, 200),
                                            prompt_len=(8, 8)), time_limit=0.3)
        assert cut.timed_out and cut.num_finished < 40 and not engine.has_unfinished_requests()


def test_vllm_flags_and_what_has_none():
    f = vllm_flags({"max_num_seqs": 16, "graph_mode": "decode", "enable_prefix_caching": False,
                    "prefill_interval": 4, "waiting_timeout_ms": 0.0,
                    "preemption_mode": "largest"}, "cuda")
    assert f.flags[:2] == ["--max-num-seqs", "16"]
    assert '{"cudagraph_mode": "FULL_DECODE_ONLY"}' in f.flags
    assert "--no-enable-prefix-caching" in f.flags
    assert set(f.unmapped) == {"prefill_interval", "preemption_mode"}   # 0 ms wait is vLLM's
    assert "vllm serve m --max-num-seqs 16" in f.command("m")
    npu = vllm_flags({"graph_mode": "full"}, "npu")
    assert npu.ascend and '{"cudagraph_mode": "PIECEWISE"}' in npu.flags
    assert vllm_flags({"graph_mode": "eager"}).flags == ["--enforce-eager"]


def test_cli_tunes_random_tiny(tmp_path, capsys):
    from workbench.cli import main
    out = tmp_path / "tune.json"
    rc = main(["tune", "--model", "random:tiny", "--device", "cpu", "--num-kv-blocks", "128",
               "--max-num-batched-tokens", "32", "--max-num-seqs", "4", "--concurrency", "2", "--num-requests", "6",
               "--input-len", "20:40", "--output-len", "2:4", "--ttft-ms", "5000",
               "--tpot-ms", "1000", "--knob", "max_num_seqs=1,4",
               "--knob", "enable_chunked_prefill=True,False", "--trials", "4", "--eta", "2",
               "--trial-timeout", "60", "--output", str(out)])
    text = capsys.readouterr()
    assert rc == 0, text.err
    d = json.loads(out.read_text())
    assert len(d["trials"]) == 3 and d["winner"] is not None
    # chunked prefill off: prompts over the 32-token step budget are refused, and the
    # search goes on
    failed = [t for t in d["trials"] if t["error"]]
    assert failed and all(t["knobs"]["enable_chunked_prefill"] is False for t in failed)
    assert "max_model_len" in failed[0]["error"]
    assert d["winner"]["knobs"]["enable_chunked_prefill"] is True
    assert d["vllm_serve"].startswith("vllm serve random:tiny --max-num-seqs")
    assert "winner: trial" in text.out and "[3/3]" in text.err
    assert main(["tune", "--model", "random:tiny", "--device", "cpu", "--concurrency", "1",
                 "--ttft-ms", "0", "--tpot-ms", "10"]) == 2
    assert "ttft_ms" in capsys.readouterr().err


def test_tune_panel_renders_the_frontier_and_the_winner():
    pytest.importorskip("ipywidgets")
    pytest.importorskip("plotly")
    from widgets.tune import TunePanel, tune_figure
    space = Space(SPACE)
    out = successive_halving(space.sample(54, EngineConfig(), include_defaults=False),
                             made_up, n_trials=80, max_budget=27)
    result = result_of(out, space)
    panel = TunePanel(result)
    fig = panel.fig
    assert len(fig.data) == 8                       # per latency: ok, missed, frontier, winner
    win = fig.data[3]
    assert list(win.y) == [result.winner.measurement.throughput] and "trial" in win.hovertext[0]
    front = result.pareto("ttft_ms")
    assert list(fig.data[2].y) == [t.measurement.throughput for t in front]
    assert result.winner in front
    assert len(fig.layout.shapes) == 2                             # the SLO limits
    assert "Winner: trial" in panel.view.value and "vllm serve" in panel.view.value
    assert panel.run_button.disabled                               # nothing to run from
    panel.on_trial(out.trials[0], 1, 80)
    assert panel.progress.value == 1 and panel.progress.max == 80
    panel.stop_button.disabled = False
    panel.stop_button.click()
    assert panel.stop_event.is_set() and panel.stop_button.disabled
    assert len(tune_figure(result).data) == 8
    assert fig.layout.title.text.startswith("measured on")
    result.modelled = {"profile": "h100", "calibrated": False}
    assert "MODELLED" in tune_figure(result).layout.title.text
    assert "uncalibrated" in tune_figure(result).layout.title.text
    result.modelled = {"profile": "h200", "calibrated": True, "error": {"max_abs_pct": 47.5}}
    assert "measured error up to 48 %" in tune_figure(result).layout.title.text


def test_tune_panel_runs_a_tune():
    pytest.importorskip("ipywidgets")
    from widgets.tune import TunePanel
    panel = TunePanel(base=EngineConfig(model="random:tiny", device="cpu", num_kv_blocks=64,
                                        max_num_seqs=4, max_num_batched_tokens=64),
                      workload=Workload(num_requests=4, concurrency=2, prompt_len=(8, 16),
                                        output_len=(2, 3)),
                      space=Space({"max_num_seqs": (1, 4)}), n_trials=2, warmup=False)
    assert not panel.run_button.disabled
    panel.ttft.value, panel.rate.value = 60_000, 0.0           # closed loop, as given
    result = panel.run()
    assert result.slo.ttft_ms == 60_000 and result.workload.concurrency == 2
    assert len(result.trials) == 2 and panel.progress.value == 2
    assert "Winner: trial" in panel.view.value and len(panel.fig.data[3].y) == 1
    panel.ttft.value = 0
    with pytest.raises(ValueError, match="ttft_ms"):
        panel.settings()


def test_tune_on_a_modelled_device_runs_on_its_virtual_clock(tmp_path):
    """On model:h200 the run goes by modelled time: a workload of several modelled seconds
    takes a fraction of that on the wall, the arrivals keep their schedule on the virtual
    clock, and the answer says it is modelled (and whether the profile is calibrated)."""
    import time
    from workbench.cli import main
    wl = Workload(num_requests=30, request_rate=2.0, prompt_len=(64, 256), output_len=(16, 64))
    with Engine(model="random:qwen3-0.6b", device="model:h200") as engine:
        t0 = time.perf_counter()
        run = run_workload(engine, wl)
        wall = time.perf_counter() - t0
        first = min(m.arrival_time for m in engine.telemetry.requests)
        arrivals = sorted(m.arrival_time - first for m in engine.telemetry.requests)
    assert run.num_finished == 30 and run.modelled["profile"] == "h200"
    assert arrivals == pytest.approx([q.arrival for q in wl.requests()], abs=1e-9)
    assert run.duration >= wl.requests()[-1].arrival > 10.0              # modelled seconds
    assert wall < run.duration / 3                                      # not waited out
    out = tmp_path / "t.json"
    assert main(["tune", "--model", "random:qwen3-0.6b", "--device", "model:h200",
                 "--request-rate", "20", "--num-requests", "9", "--ttft-ms", "200",
                 "--tpot-ms", "20", "--knob", "graph_mode", "--knob", "max_num_seqs=8,64",
                 "--trials", "4", "--output", str(out)]) == 0
    d = json.loads(out.read_text())
    assert "(modelled)" in d["device"] and d["modelled"]["profile"] == "h200"
    assert any(n.startswith("modelled device: NVIDIA H200") for n in d["notes"])
    assert {t["knobs"]["graph_mode"] for t in d["trials"]} <= {"eager", "decode", "full", None}
    assert Space.default("model:h200").knobs["graph_mode"] == ("eager", "decode", "full")
    assert Space.default("model:cpu").knobs["graph_mode"] == ("eager",)
