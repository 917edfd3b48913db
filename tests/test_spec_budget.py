"""Speculative decoding turns itself down where it loses (issue 40: "at 32 concurrent
requests no configuration below 0.95x of plain: turn speculation down where it loses, and say
how"): each step drafts only as many tokens as pay for the rows they add, by the step costs
the engine measured (StepCosts) and the acceptance of recent verifies (DraftOdds)."""
from __future__ import annotations

from types import SimpleNamespace

import pytest

from workbench import Engine, SamplingParams
from workbench.core.sequence import SequenceStatus
from workbench.engine.speculative import Curve, DraftOdds, SpecDecoding, StepCosts


def estimate(table: dict[int, float], rows: int) -> float | None:
    return Curve(table).at(rows)


def test_estimate_reads_interpolates_and_extrapolates_the_measured_costs():
    t = {1: 20.0, 5: 40.0, 16: 80.0}
    assert estimate({}, 3) is None
    assert estimate(t, 5) == 40.0
    assert estimate(t, 3) == pytest.approx(30.0)             # on the line from 1 to 5
    assert estimate(t, 10) == pytest.approx(40 + 40 * 5 / 11)
    # past the largest: the slope from it to the count nearest half of it (5, not 1)
    assert estimate(t, 32) == pytest.approx(80 + (80 - 40) / 11 * 16)
    assert estimate({8: 50.0}, 40) == 50.0                  # one count: tried, then measured
    assert estimate({8: 50.0, 16: 40.0}, 32) == 40.0        # never cheaper with more rows


def test_step_costs_skip_the_first_keep_the_least_and_forget_old_ones():
    c = StepCosts()
    c.observe(5, 9.0)                                        # the first step: one-off costs
    assert c.table() == {}
    c.observe(5, 3.0)
    c.observe(5, 2.0)
    c.observe(5, 4.0)
    assert c.table() == {5: 2.0}
    for _ in range(StepCosts.HORIZON + 1):
        c.observe(1, 1.0)
    assert c.table() == {1: 1.0}


def budget(plain: dict[int, float], verify: dict[int, float], decoding: int,
           values: list[list[float]]) -> list[int]:
    spec = SpecDecoding(proposer=None, num_speculative_tokens=4, scheduler=None)
    for kind, table in ((False, plain), (True, verify)):
        spec.observe(1, kind, 99.0)                  # each kind's first step: not counted
        for rows, seconds in table.items():
            spec.observe(rows, kind, seconds)
    return spec.budget(decoding, values)


def test_the_budget_drafts_where_rows_are_cheap_and_not_where_they_cost_a_decode():
    likely = [0.9, 0.8, 0.7, 0.6]
    # no plain step measured yet: none (two plain steps measure it); no verify: every draft
    assert budget({}, {}, 1, [likely]) == [0]
    assert budget({1: 10.0}, {}, 1, [likely]) == [4]
    # a GPU at batch 1 (graph_mode 'full'): the weights bound the step, more rows are free
    assert budget({1: 10.0}, {5: 10.5}, 1, [likely]) == [4]
    # ... and where a verify runs eager while a decode replays its graph: never worth it
    assert budget({1: 2.5}, {5: 20.0}, 1, [likely]) == [0]
    # this CPU at batch 1 (SmolLM2 gguf, ms): a verify of 5 rows costs 2.2 decodes; drafts
    # likely to be kept still pay, unlikely ones do not
    cpu = {1: 21.4, 2: 31.2, 3: 38.0, 4: 42.1, 5: 48.5}
    assert budget(cpu, cpu, 1, [likely]) == [4]
    assert budget(cpu, cpu, 1, [[0.3, 0.1, 0.03, 0.01]]) == [0]
    # where each row costs what a decode row does (arithmetic-bound), no draft pays
    bound = {16: 83.2, 24: 124.8, 32: 166.4}
    assert budget(bound, bound, 32, [likely] * 32) == [0] * 32
    # this CPU at batch 32 (4.5 ms a row against 5.2 a token): only a nearly sure draft would,
    # and one that gains less than MARGIN (4 %, within a busy moment's noise) does not
    big = {16: 94.0, 24: 130.0, 32: 166.0}
    assert budget(big, big, 32, [[0.8, 0.6, 0.5, 0.4]] * 32) == [0] * 32
    assert budget(big, big, 32, [[0.95, 0.6]] * 32) == [0] * 32
    assert budget(big, big, 32, [[0.99, 0.6]] * 32) == [1] * 32
    # in between the most valuable drafts go first: the likelier request's
    mid = {8: 60.0, 9: 61.0, 10: 62.0, 12: 90.0, 16: 120.0}
    assert budget(mid, mid, 8, [[0.9, 0.8], [0.2, 0.1]]) == [2, 0]
    # a draft model (SmolLM2's gguf-a8 blocks for its fp32 self, a Zen 5, ms) where only
    # the verify of all 4 drafts has been measured: fewer drafts are priced on the line from
    # a plain step (a verify of none) to it, each draft a pass of the draft model more. (Flat
    # at the 4-draft cost, one draft looked like a loss and the budget never drafted.) Two
    # pay most by that line...
    assert budget({1: 11.8}, {5: 38.6}, 1, [[0.86, 0.75, 0.65, 0.57]]) == [2]
    # ... and once verifies of fewer drafts are measured, their figures decide
    assert budget({1: 11.8}, {3: 25.0, 5: 28.0}, 1, [[0.86, 0.75, 0.65, 0.57]]) == [4]
    assert budget({1: 11.8}, {5: 38.6}, 1, [[0.5, 0.25, 0.12, 0.06]]) == [0]   # unlikely ones
    # Measured figures are noisy: prompt lookup at batch 1 on a Zen 5 (ms), where a 2- and a
    # 3-row verify were each measured in a slow moment. As measured, one draft looks like a
    # loss bad enough to stop the search, and the lookup never drafted again (a grounded run
    # at 1.01x); a count dearer than a larger one now takes its figure, and three pay.
    # A draft model after a batch of 32 (ms, a Zen 5): one draft costs its pass and a
    # catch-up, four not much more; a loss at one draft must not end the search there.
    assert budget({1: 16.2}, {2: 40.1, 4: 50.4, 5: 49.7, 160: 19477.8}, 1,
                  [[0.95, 0.92, 0.89, 0.87]]) == [4]
    noisy = {2: 11.76, 3: 19.66, 4: 10.93, 5: 14.67}
    assert budget({1: 6.14}, noisy, 1, [[0.5, 0.25, 0.125, 0.0625]]) == [3]
    assert estimate(noisy, 2) == estimate(noisy, 3) == 10.93


def test_a_verify_whose_draft_caught_up_a_prefill_is_not_priced():
    """A draft model's first call for a new request feeds its whole prompt: that step's cost
    is a prefill's, not a verify's of its rows, and stays out of the step costs."""
    seq = SimpleNamespace(status=SequenceStatus.RUNNING, num_output_tokens=1,
                          num_computed_tokens=99, num_tokens=100, request_id="a",
                          params=SimpleNamespace(max_tokens=1000), token_ids=list(range(100)),
                          spec_token_ids=[])
    sched = SimpleNamespace(requests={"a": None}, running=[seq], max_model_len=4096)
    draft = SimpleNamespace(propose=lambda reqs, rows, shared: [[1, 2, 3, 4] for _ in reqs],
                            free=lambda rid: None, longest_catch_up=2, draws=False,
                            draft_probs={})
    spec = SpecDecoding(draft, 4, sched, adaptive=False)
    for catch_up, rows, seconds in ((2, 5, 0.9), (100, 160, 19.5), (2, 5, 0.05)):
        draft.longest_catch_up = catch_up
        spec.propose()
        assert seq.spec_token_ids == [1, 2, 3, 4]
        spec.observe(rows, True, seconds)        # (the first verify is never counted)
    assert spec.costs[True].table() == {5: 0.05}


def test_draft_odds_learn_a_requests_first_draft_and_the_runs_after_it_and_fade():
    o = DraftOdds()
    assert o.values("a", 3) == pytest.approx([0.5, 0.25, 0.125])
    for _ in range(6):
        o.verified("a", 4, 4)                                # copies: every draft kept
        o.verified("b", 4, 0)                                # misses
    va, vb = o.values("a", 4), o.values("b", 4)
    assert va[0] > 0.8 and va[3] > 0.6 and vb[0] < 0.35
    assert all(x > y for x, y in zip(va, va[1:]))
    for _ in range(300):             # drafting stopped: back to what the proposer earned,
        o.step(["a", "b"])           # here as many firsts kept as missed
    assert o.values("b", 1)[0] == pytest.approx(0.5, abs=0.01)
    o.forget("a")
    assert "a" not in o.own
    # Each request's own runs after a kept first draft count, with the engine's: a sampled
    # request keeps a greedy draft's later tokens far less often than a greedy one beside it.
    o = DraftOdds()
    for _ in range(8):
        o.verified("greedy", 4, 4)
        o.verified("sampled", 4, 1)
    g, s = o.values("greedy", 3), o.values("sampled", 3)
    assert g[1] / g[0] > 0.8 and s[1] / s[0] < 0.5
    # A proposer kept nine times in ten (a draft model of the target's own family): after a
    # pause (a large batch, where no draft paid), a new request starts from those odds, not
    # from a half (where a draft model's verify does not pay, so it never drafted again).
    o = DraftOdds()
    for i in range(40):
        o.verified(f"r{i % 4}", 4, 3 if i % 10 else 0)
    for _ in range(300):
        o.step([])
    first, second = o.values("new", 2)
    # firsts: 36 kept of 40 (and the prior's half of 2); then: 2 of 3 after a kept first
    assert first == pytest.approx(37 / 42, abs=0.02)
    assert second == pytest.approx(37 / 42 * 73 / 110, abs=0.02)
    # A few early misses (a grounded reply's first words, before prompt lookup copies):
    # after the pause, a half again, not the 0.4 those verifies earned, at which no draft
    # paid and the lookup never drafted again in a whole grounded run.
    o = DraftOdds()
    for n in (0, 0, 1):
        o.verified("r", 4, n)
    for _ in range(300):
        o.step([])
    assert o.values("next", 1)[0] == pytest.approx(0.5, abs=0.01)


def modelled(device: str, adaptive: bool | None = True, accepted: int = 20) -> Engine:
    """A modelled engine (adaptive None: no speculation)."""
    spec = None if adaptive is None else {
        "method": "ngram", "num_speculative_tokens": 4, "adaptive": adaptive,
        "acceptance": {"num_draft_tokens": 100, "num_accepted_tokens": accepted,
                       "source": "a test's figure"}}
    return Engine(model="random:qwen3-0.6b", device=device, num_kv_blocks=4096,
                  max_num_seqs=128, speculative_config=spec)


def output_rate(e: Engine, batch: int, max_tokens: int) -> tuple[float, int]:
    """Output tokens per modelled second of a batch of prompts that repeat themselves, and
    the draft tokens verified."""
    prompts = [[(7 * i + j) % 300 + 1 for j in range(12)] * 3 for i in range(batch)]
    try:
        outs = e.generate(prompts, SamplingParams(max_tokens=max_tokens, temperature=0,
                                                  ignore_eos=True))
        assert all(len(o.token_ids) == max_tokens for o in outs)
        seconds = sum(s.duration for s in e.telemetry.steps if s.phase != "idle")
        return batch * max_tokens / seconds, e.telemetry.spec_decode.num_draft_tokens
    finally:
        e.close()


def test_where_verifies_cost_more_than_they_keep_the_budget_stops_drafting():
    """A modelled A100 at batch 64 with a proposer whose drafts are kept a fifth of the time
    (its clock: each step's cost by the cost model; a verify runs eager, a decode replays its
    graph and, with async scheduling, overlaps the host's work): drafting k for every request
    runs at less than half a plain engine's speed; the adaptive budget measures what its
    verifies cost, stops drafting, runs the decodes ahead again, and stays within 5 % of
    plain (the few verifies that measured)."""
    plain, _ = output_rate(modelled("model:a100", adaptive=None), 64, 400)
    fixed, many = output_rate(modelled("model:a100", adaptive=False), 64, 400)
    e = modelled("model:a100")
    assert any("async scheduling runs only while the budget drafts nothing" in n
               for n in e.telemetry.notices), e.telemetry.notices
    adaptive, few = output_rate(e, 64, 400)
    assert fixed < 0.5 * plain, (fixed, plain)
    assert adaptive >= 0.95 * plain, (adaptive, plain)
    assert 0 < few < many / 20, (few, many)
    assert any(s.scheduled_ahead for s in e.telemetry.steps)
