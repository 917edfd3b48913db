"""Lessons that measure say what their figures show, and say so when a busy machine made them
meaningless (workbench.bench.steady): fed the figures of a run on a loaded machine, the lesson
prints the warning instead of its claim."""
from __future__ import annotations

import pytest

from workbench.bench import steady
from workbench.bench.claims import (alone_vs_batched_relations, batch_scaling_relations,
                                    batch_size_relations, kv_cache_relations,
                                    sampling_cost_relations)
from workbench.bench.offline import (latency_alone_vs_batched, recompute_vs_cache, sweep,
                                     time_per_token_by_batch)
from workbench.bench.steady import MachineCheck, Runs, interleaved, verdict

QUIET = MachineCheck(2, (0.3, 0.4), (1.00, 1.05))


def rows(decode_ms, prefill_ms, spread=1.0):
    return [dict(batch=b, decode_s_per_token=d / 1e3, prefill_s_per_token=p / 1e3,
                 decode_runs=Runs([d / 1e3, d * spread / 1e3]),
                 prefill_runs=Runs([p / 1e3, p * spread / 1e3]))
            for b, d, p in zip((1, 2, 4, 8), decode_ms, prefill_ms)]


def sentence(r, machine):
    return verdict(batch_scaling_relations(r), machine,
                   [x[k] for x in r for k in ("decode_runs", "prefill_runs")])


def test_a_quiet_run_that_shows_the_relation_states_it_with_its_figures():
    s = sentence(rows((12.0, 6.4, 3.5, 2.0), (1.1, 0.9, 0.8, 0.8)), QUIET)
    assert s.startswith("Decode's time per token falls as the batch grows: decode 12.00 ms a token")
    assert "Prefill's falls much less: 1.10 ms a token at batch 1, 0.80 ms at batch 8" in s
    assert "busy" not in s and "do not show" not in s


def test_the_busy_run_from_the_issue_gets_the_warning_not_the_claim():
    # Notebook 02 on a loaded machine: decode 88.9, 162.0, 64.6, 15.3 ms/token and prefill
    # 81.0, 12.1, 64.0, 32.6 for batches 1, 2, 4, 8, under a chart claiming the opposite.
    busy = MachineCheck(2, (6.8, 7.1), (1.0, 2.4))
    s = sentence(rows((88.9, 162.0, 64.6, 15.3), (81.0, 12.1, 64.0, 32.6)), busy)
    assert s.startswith("This machine was busy (load average 6.8 then 7.1 on 2 cores")
    assert "falls as the batch grows:" not in s
    # The same figures with a quiet-looking machine but runs that disagree: still a warning.
    s = sentence(rows((88.9, 162.0, 64.6, 15.3), (81.0, 12.1, 64.0, 32.6), spread=2.0), QUIET)
    assert "repeated runs of one point differed by up to 2.0x" in s
    # And steady runs that contradict the lesson say so, with the figures.
    s = sentence(rows((88.9, 162.0, 64.6, 15.3), (81.0, 12.1, 64.0, 32.6)), QUIET)
    assert s.startswith("The lesson says decode's time per token falls as the batch grows, but "
                        "these figures do not show it: decode 88.90 ms a token at batch 1, "
                        "162.00 ms a token at batch 2")


def test_the_machine_check_reads_load_and_the_probe(monkeypatch):
    import time
    real_probe, real_cpu = steady.probe_ms, steady.cpu_seconds
    loads, probes = iter([0.5, 3.9]), iter([1.0, 1.1])
    monkeypatch.setattr(steady, "load_average", lambda: next(loads))
    monkeypatch.setattr(steady, "probe_ms", lambda: next(probes))
    monkeypatch.setattr(steady, "cpu_seconds", lambda: None)      # no /proc/stat: the load
    result, m = steady.checked(lambda: 42)
    assert result == 42 and m.load == (0.5, 3.9) and m.probe == (1.0, 1.1) and m.others is None
    assert m.busy == (3.9 > steady.BUSY_LOAD * m.cores)
    # Where /proc/stat says what the rest of the machine ran, that decides, not the load
    # average, which counts the measurement's own threads: a lesson that kept both cores of a
    # laptop busy itself reads a load of 2 and is not "busy" for it.
    import os
    for other_s, busy in ((0.0, False), (0.18 * (os.cpu_count() or 1), True)):   # 90% of 0.2 s
        loads, probes = iter([2.0, 2.1]), iter([1.0, 1.05])
        cpu = iter([(100.0, 10.0), (100.4 + other_s, 10.4)])     # we used 0.4 s, others other_s
        monkeypatch.setattr(steady, "cpu_seconds", lambda: next(cpu))
        _, m = steady.checked(lambda: time.sleep(0.2))
        assert m.busy is busy and (m.others > steady.BUSY_OTHERS) is busy, m
        assert ("other processes used" in m.describe()) and "load average 2.0 then 2.1" in m.describe()
    assert real_cpu() is None or real_cpu()[0] > 0
    assert MachineCheck(2, (0.1, 0.1), (1.0, 1.6)).busy          # the probe slowed by 1.6x
    assert not MachineCheck(2, (0.1, 0.1), (1.0, 1.2)).busy
    assert real_probe() > 0


def test_runs_are_interleaved_and_kept():
    seen = []
    out = interleaved(["a", "b", "c"], lambda p: seen.append(p) or len(seen), repeats=3)
    assert seen == ["a", "b", "c", "c", "b", "a", "a", "b", "c"]
    assert out == [[1, 6, 7], [2, 5, 8], [3, 4, 9]]
    r = Runs([2.0, 1.0, 4.0])
    assert (r.min, r.median, r.max, r.spread) == (1.0, 2.0, 4.0, 4.0)


def test_time_per_token_by_batch_keeps_every_run():
    from workbench import Engine
    e = Engine(model="random:tiny", device="cpu", max_num_seqs=4, max_num_batched_tokens=256)
    try:
        r = time_per_token_by_batch(e, (1, 4), prompt_len=8, decode_steps=2, repeats=3)
    finally:
        e.close()
    assert [x["batch"] for x in r] == [1, 4]
    for x in r:
        assert len(x["decode_runs"].values) == 3 and len(x["prefill_runs"].values) == 3
        assert x["decode_s_per_token"] == pytest.approx(x["decode_runs"].median)


def test_notebook_03s_alone_against_batched_from_the_issue_gets_the_warning():
    # Notebook 03 on a loaded machine: one request alone at a TPOT of 1,128 ms (about 12 ms
    # on a quiet one), under a table that read as the engine's.
    table = [dict(requests=1, out_tok_s=0.9, tpot_p50_ms=1128.0),
             dict(requests=8, out_tok_s=51.0, tpot_p50_ms=150.0)]
    runs = [Runs([1128.0, 14.0]), Runs([150.0, 160.0])]
    busy = MachineCheck(2, (5.1, 5.6), (1.0, 1.9))
    s = verdict(alone_vs_batched_relations(table), busy, runs)
    assert s.startswith("This machine was busy (load average 5.1 then 5.6 on 2 cores")
    # The same runs on a machine that looked quiet: the runs disagree by 80x, still a warning.
    assert "differed by up to 80.6x" in verdict(alone_vs_batched_relations(table), QUIET, runs)
    # Steady figures: the claim, with them; and figures that contradict it, said so.
    steady_runs = [Runs([12.0, 12.4]), Runs([20.0, 20.5])]
    table[0].update(out_tok_s=80.0, tpot_p50_ms=12.0)
    table[1]["out_tok_s"] = 300.0
    assert verdict(alone_vs_batched_relations(table), QUIET, steady_runs) == (
        "8 requests at once serve more tokens a second than one alone: 300.0 against 80.0 "
        "tok/s (3.8x).")
    table[1]["out_tok_s"] = 51.0
    assert verdict(alone_vs_batched_relations(table), QUIET, steady_runs).startswith(
        "The lesson says 8 requests at once serve more tokens a second than one alone, but "
        "these figures do not show it: 51.0 against 80.0 tok/s (0.6x)")


def test_batch_size_sweep_claims_only_what_its_figures_show():
    rows = [dict(max_num_seqs=1, out_tok_s=60.0), dict(max_num_seqs=8, out_tok_s=210.0)]
    s = verdict(batch_size_relations(rows), QUIET, [Runs([60.0, 61.0]), Runs([210.0, 214.0])])
    assert s == ("Throughput climbs with the batch: 60.0 tok/s at max_num_seqs 1, 210.0 tok/s "
                 "at max_num_seqs 8 (3.5x).")
    rows[1]["out_tok_s"] = 55.0
    assert "do not show it" in verdict(batch_size_relations(rows), QUIET, [Runs([60.0])])


def test_sweep_and_the_table_interleave_their_repeats_and_keep_every_run():
    from workbench import Engine
    from workbench.bench.offline import make_workload
    wl = make_workload(2, (8, 8), (3, 3), 256, seed=0)
    seen = []
    rows = sweep({"block_size": [16, 32]}, wl, model="random:tiny",
                 engine_kwargs=dict(device="cpu", num_kv_blocks=32), repeats=3,
                 progress=lambda done, total: seen.append((done, total)))
    assert [r["block_size"] for r in rows] == [16, 32]
    assert seen == [(i, 6) for i in range(7)]        # the bar shows at 0, before a first run
    for r in rows:
        assert len(r["out_tok_s_runs"]) == 3 and r["out_tok_s"] == pytest.approx(
            sorted(r["out_tok_s_runs"])[1])
        assert r["tokens"] == 6                   # counts are the same in every run
    e = Engine(model="random:tiny", device="cpu", max_num_seqs=4, num_kv_blocks=64)
    try:
        table = latency_alone_vs_batched(e, n=4, prompt_len=8, new_tokens=4, repeats=3)
    finally:
        e.close()
    assert [r["requests"] for r in table] == [1, 4]
    assert all(len(r["tpot_p50_ms_runs"]) == 3 and len(r["out_tok_s_runs"]) == 3 for r in table)


def test_the_kv_cache_and_sampler_cost_lessons_claim_only_what_their_figures_show():
    kv = dict(with_cache_s=[0.05, 0.1, 0.15], without_cache_s=[0.05, 0.12, 0.21])
    assert verdict(kv_cache_relations(kv), QUIET, [Runs([0.15, 0.16]), Runs([0.21, 0.22])]) == (
        "Recomputing the sequence for every token takes longer than the cache: 3 tokens in "
        "0.15 s with the cache, 0.21 s recomputing (1.4x).")
    kv["without_cache_s"][-1] = 0.14                     # a slow spell in the cached run
    assert verdict(kv_cache_relations(kv), QUIET, []).startswith(
        "The lesson says recomputing the sequence for every token takes longer than the cache, "
        "but these figures do not show it: 3 tokens in 0.15 s")
    busy = MachineCheck(2, (3.9, 4.2), (1.0, 1.1), others=0.6)
    assert verdict(kv_cache_relations(kv), busy, []).startswith("This machine was busy (other "
                                                                "processes used 60%")
    greedy, sampled = {1: Runs([0.02, 0.03]), 8: Runs([0.05])}, {1: Runs([0.2]), 8: Runs([0.9])}
    assert verdict(sampling_cost_relations(greedy, sampled, "top-p"), QUIET, []) == (
        "Top-p costs a step more than greedy: 0.20 against 0.03 ms at batch 1, 0.90 against "
        "0.05 ms at batch 8.")
    sampled[8] = Runs([0.04])
    assert "do not show it" in verdict(sampling_cost_relations(greedy, sampled, "top-p"), QUIET, [])


def test_recompute_vs_cache_runs_in_rounds_and_keeps_each_rounds_total():
    from workbench import Engine
    e = Engine(model="random:tiny", device="cpu", num_kv_blocks=32)
    try:
        kv = recompute_vs_cache(e, [1, 2, 3, 4, 5], 4, repeats=3)
    finally:
        e.close()
    assert len(kv["with_cache_s"]) == len(kv["without_cache_s"]) == 4
    assert len(kv["with_cache_runs"]) == len(kv["without_cache_runs"]) == 3
    assert kv["with_cache_s"][-1] == pytest.approx(sorted(kv["with_cache_runs"])[1])
    assert kv["without_cache_s"][-1] == pytest.approx(sorted(kv["without_cache_runs"])[1])
    assert kv["tokens"] == kv["tokens_recomputed"] and len(kv["tokens"]) == 4
