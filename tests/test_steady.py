"""Lessons that measure say what their figures show, and say so when a busy machine made them
meaningless (workbench.bench.steady): fed the figures of a run on a loaded machine, the lesson
prints the warning instead of its claim."""
from __future__ import annotations

import pytest

from workbench.bench import steady
from workbench.bench.offline import batch_scaling_relations, time_per_token_by_batch
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
    real_probe = steady.probe_ms
    loads, probes = iter([0.5, 3.9]), iter([1.0, 1.1])
    monkeypatch.setattr(steady, "load_average", lambda: next(loads))
    monkeypatch.setattr(steady, "probe_ms", lambda: next(probes))
    result, m = steady.checked(lambda: 42)
    assert result == 42 and m.load == (0.5, 3.9) and m.probe == (1.0, 1.1)
    assert m.busy == (3.9 > steady.BUSY_LOAD * m.cores)
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
