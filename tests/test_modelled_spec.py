"""Speculative decoding on a modelled device (issue 40, item 5: "the modelled device accounts
for verify steps with an acceptance rate measured on the workload, not assumed").

- Without a measured acceptance a modelled device refuses speculative_config, saying how to
  measure one; a real run's measurement (acceptance_of a real engine or a trace) is taken and its
  source said.
- Over many verify steps the share of drafted tokens accepted matches the measured rate
  within an Azuma-Hoeffding bound (a rule that ignores the draft's length falls outside it);
  draws are seeded; telemetry, request metrics and Prometheus count as on a real device; the
  KV pool is whole at the end.
- From the cost model: a verify at batch 1 on a weight-bound device costs more than a decode
  and less than k + 1 of them (its weight reads are a decode's, its matmuls k + 1 times);
  at batch 64 its matmuls outgrow the weights (its linear layers' bound 1.7 times a decode's
  on a modelled H200 for a Qwen3-0.6B shape).
"""
from __future__ import annotations

import math
import random

import pytest

from workbench import Engine, SamplingParams
from workbench.modelled import acceptance_of, get_profile, step_time
from workbench.telemetry import FULL, PIECEWISE

K = 4
NGRAM = {"method": "ngram", "num_speculative_tokens": K, "prompt_lookup_max": 3,
         "adaptive": False}
"""k drafts whenever the lookup finds them: these tests model what a verify does and costs
(the budget that drafts fewer where they do not pay is test_spec_budget's)."""


def grounded_prompts(n: int, seed: int = 0) -> list[list[int]]:
    """Random prompts that repeat a stretch of themselves: n-gram drafts hit on a real model."""
    rng = random.Random(seed)
    return [[rng.randrange(1, 512) for _ in range(20)] * 3 for _ in range(n)]


def open_prompts(n: int, seed: int = 0) -> list[list[int]]:
    """Random prompts that repeat nothing: the lookup finds fewer drafts."""
    rng = random.Random(seed)
    return [[rng.randrange(1, 512) for _ in range(40)] for _ in range(n)]


@pytest.fixture(scope="module")
def measured() -> dict:
    """The acceptance a real CPU engine measures for NGRAM on a workload of grounded and
    open prompts."""
    e = Engine(model="random:tiny", device="cpu", speculative_config=NGRAM)
    try:
        e.generate(grounded_prompts(4) + open_prompts(4),
                   SamplingParams(max_tokens=32, temperature=0, ignore_eos=True))
        return acceptance_of(e)
    finally:
        e.close()


def pool_is_whole(e: Engine) -> bool:
    st = e.stats()
    return st.kv_blocks_used == 0 and st.kv_blocks_free == st.num_kv_blocks - 1


def test_a_modelled_device_refuses_speculation_without_a_measured_rate():
    with pytest.raises(ValueError) as err:
        Engine(model="random:tiny", device="model:h200", speculative_config=NGRAM)
    msg = str(err.value)
    assert msg.startswith("speculative_config.acceptance: required on a modelled device")
    assert "run its prompts on a real engine with the same speculative_config" in msg
    assert "workbench.modelled.acceptance_of(that engine)" in msg
    assert "acceptance_of(Trace.load(path))" in msg
    with pytest.raises(ValueError, match="speculative_config.acceptance.num_accepted_tokens"):
        Engine(model="random:tiny", device="model:h200", speculative_config={
            **NGRAM, "acceptance": {"num_draft_tokens": 10, "num_accepted_tokens": 11,
                                    "source": "x"}})
    with pytest.raises(ValueError, match="speculative_config.acceptance.source"):
        Engine(model="random:tiny", device="model:h200", speculative_config={
            **NGRAM, "acceptance": {"num_draft_tokens": 10, "num_accepted_tokens": 5}})
    with pytest.raises(ValueError, match="speculative_config.method: a modelled device runs "
                                         "only 'ngram'"):
        Engine(model="random:tiny", device="model:h200", speculative_config={
            "method": "draft_model", "model": "random:tiny", "num_speculative_tokens": 2,
            "acceptance": {"num_draft_tokens": 10, "num_accepted_tokens": 5, "source": "x"}})


def test_the_measurement_is_a_real_runs_and_says_where_it_came_from(measured):
    assert measured["num_draft_tokens"] > 0
    assert 0 < measured["num_accepted_tokens"] <= measured["num_draft_tokens"]
    assert 0 < measured["num_drafted"] < measured["num_asked"], "some lookups find nothing"
    assert measured["num_drafts"] == measured["num_drafted"]
    assert measured["source"].startswith("a real run of 8 requests: random:tiny on ")
    assert "method=ngram" in measured["source"]
    e = Engine(model="random:tiny", device="model:h200", num_kv_blocks=64,
               speculative_config={**NGRAM, "acceptance": measured})
    try:
        rate = measured["num_accepted_tokens"] / measured["num_draft_tokens"]
        notice = [n for n in e.telemetry.notices if "accepted at the rate measured" in n]
        assert notice and f"{rate:.3f}" in notice[0] and measured["source"] in notice[0]
        share = measured["num_drafted"] / measured["num_asked"]
        assert f"made for {share:.3f} of the requests asked (measured" in notice[0]
        with pytest.raises(ValueError, match="modelled device"):
            acceptance_of(e)            # a modelled run measures nothing
    finally:
        e.close()


def test_a_recorded_traces_steps_give_the_same_measurement(tmp_path):
    from workbench.trace import Trace, record
    e = Engine(model="random:tiny", device="cpu", num_kv_blocks=64, speculative_config=NGRAM)
    try:
        trace = record(e, grounded_prompts(2, seed=1),
                       SamplingParams(max_tokens=24, temperature=0, ignore_eos=True), roofs=False)
        want = acceptance_of(e)
    finally:
        e.close()
    got = acceptance_of(Trace.load(trace.save(tmp_path / "spec.trace.json.gz")))
    assert want["num_draft_tokens"] > 0
    keys = ("num_draft_tokens", "num_accepted_tokens", "num_drafts")
    assert [got[k] for k in keys] == [want[k] for k in keys]
    assert "num_asked" in want and "num_asked" not in got, "a trace's steps do not say"
    assert got["source"].startswith("a recorded trace of 2 requests: random:tiny on ")
    m = Engine(model="random:tiny", device="model:h200", num_kv_blocks=64,
               speculative_config={**NGRAM, "acceptance": got})
    try:
        assert any("made for every request asked (how often the proposer found a draft was "
                   "not measured)" in n for n in m.telemetry.notices)
    finally:
        m.close()


def run_modelled(acceptance: dict, seed: int = 0, n: int = 64, max_tokens: int = 400,
                 **knobs) -> Engine:
    knobs = {"num_kv_blocks": 1 + n * 30, "max_model_len": 480, **knobs}
    e = Engine(model="random:tiny", device="model:h200", seed=seed, block_size=16,
               speculative_config={**NGRAM, "acceptance": acceptance}, **knobs)
    e.generate([[1, 2, 3, 4, 5]] * n, SamplingParams(max_tokens=max_tokens, ignore_eos=True))
    return e


def test_verify_steps_accept_at_the_measured_rate_and_count_as_on_a_real_device(measured):
    pytest.importorskip("prometheus_client")
    from workbench.serving.metrics import EngineMetrics
    alpha = measured["num_accepted_tokens"] / measured["num_draft_tokens"]
    e = run_modelled(measured)
    try:
        steps = [s for s in e.telemetry.steps if s.drafts]
        assert steps and all(s.kinds[r] == "verify" for s in steps for r in s.drafts)
        assert all(not s.graph for s in steps), "a verify is never a captured decode graph"
        # The accepted share against the measured rate. Given its length d_i, verify i's
        # accepted count is drawn afresh in [0, d_i] with mean alpha * d_i, so the sum of
        # (accepted_i - alpha d_i) is a martingale with bounded steps and, by
        # Azuma-Hoeffding, exceeds t with probability <= 2 exp(-2 t^2 / sum d_i^2):
        # t below is that bound at probability 1e-6.
        d = [len(x) for s in steps for x in s.drafts.values()]
        a = [n for s in steps for n in s.accepted.values()]
        log_p = math.log(2 / 1e-6)
        bound = math.sqrt(log_p * sum(x * x for x in d) / 2) / sum(d)
        got = sum(a) / sum(d)
        assert abs(got - alpha) <= bound, (got, alpha, bound)
        # the bound is tight enough to fail a rule that accepts each position at alpha
        # whatever the draft's length (expected share: sum over drafts of a + .. + a^d_i)
        naive = sum(alpha ** j for x in d for j in range(1, x + 1)) / sum(d)
        assert abs(naive - alpha) > 2 * bound, (naive, alpha, bound)
        assert bound < 0.05, f"too few drafts ({sum(d)}) for a useful bound"
        # how often and how long the drafts are: the measured share of requests asked that
        # got one (each ask a fresh draw: Hoeffding), and mean length (each in [lo, lo + 1])
        sd = e.telemetry.spec_decode
        share = measured["num_drafted"] / measured["num_asked"]
        assert sd.num_asked > 1000
        assert abs(sd.num_drafted / sd.num_asked - share) <= math.sqrt(log_p / 2 / sd.num_asked)
        length = measured["num_draft_tokens"] / measured["num_drafts"]
        assert abs(sum(d) / len(d) - length) <= math.sqrt(log_p / 2 / len(d))
        # telemetry, request records and Prometheus count the modelled verifies
        assert sd.num_drafts == len(d) and sd.num_draft_tokens == sum(d)
        assert sd.num_accepted_tokens == sum(a) and sd.accepted_per_pos[0] == sum(n > 0 for n in a)
        reqs = list(e.telemetry.requests)
        assert len(reqs) == 64 and all(r.output_tokens == 400 for r in reqs)
        assert sum(r.num_draft_tokens for r in reqs) == sd.num_draft_tokens
        assert sum(r.num_accepted_tokens for r in reqs) == sd.num_accepted_tokens
        assert all(r.acceptance_rate is not None and r.mean_tokens_per_step > 1 for r in reqs)
        text = EngineMetrics(e, "m").render().decode()
        assert (f'vllm:spec_decode_num_accepted_tokens_total{{model_name="m"}} '
                f'{float(sd.num_accepted_tokens)}') in text
        assert pool_is_whole(e)
    finally:
        e.close()


def test_modelled_acceptance_draws_are_seeded():
    acc = {"num_draft_tokens": 100, "num_accepted_tokens": 60, "source": "a test's figure"}

    def run(seed):
        e = run_modelled(acc, seed=seed, n=4, max_tokens=60)
        try:
            return ([s.accepted for s in e.telemetry.steps if s.drafts],
                    [s.duration for s in e.telemetry.steps])
        finally:
            e.close()
    first = run(0)
    assert first == run(0) and first[0] != run(1)[0]


def test_an_all_rejecting_rate_still_gives_the_pool_back_and_decodes_between():
    acc = {"num_draft_tokens": 50, "num_accepted_tokens": 0, "source": "a test's figure"}
    e = run_modelled(acc, n=6, max_tokens=80, max_num_seqs=4, num_kv_blocks=12,
                     max_model_len=160)
    try:
        sd = e.telemetry.spec_decode
        assert sd.num_draft_tokens > 0 and sd.num_accepted_tokens == 0
        kinds = [k for s in e.telemetry.steps for k in s.kinds.values()]
        assert "decode" in kinds, "after a miss a request pauses its drafts (SpecDecoding)"
        assert e.stats().num_preemptions > 0 and pool_is_whole(e)
        assert all(r.output_tokens == 80 for r in e.telemetry.requests)
    finally:
        e.close()


def test_a_verify_costs_more_than_a_decode_and_less_than_k_plus_1_at_batch_1():
    """From the cost model (no clock): on a modelled H200 with graph_mode 'full' (a decode
    replays its graph, a verify its token bucket piecewise, as the real runner runs them),
    a Qwen3-0.6B-shaped batch-1 step reads the weights once either way."""
    acc = {"num_draft_tokens": 100, "num_accepted_tokens": 60, "source": "a test's figure"}
    e = Engine(model="random:qwen3-0.6b", device="model:h200", graph_mode="full",
               num_kv_blocks=64, speculative_config={**NGRAM, "acceptance": acc})
    try:
        info, prof = e.info(), get_profile("h200")
        drafts = list(range(1, K + 1))

        def times(batch):
            ids = [f"r{i}" for i in range(batch)]
            ctx = {r: 512 for r in ids}
            dec = step_time(prof, info, {r: 1 for r in ids}, ctx, {r: "decode" for r in ids},
                            FULL, False)
            ver = step_time(prof, info, {r: 1 + K for r in ids}, ctx,
                            {r: "verify" for r in ids}, PIECEWISE, False,
                            {r: drafts for r in ids})
            return dec, ver
        dec, ver = times(1)
        assert dec.seconds < ver.seconds < (K + 1) * dec.seconds, (dec, ver)
        assert ver.linear == dec.linear, "batch 1: the weights bound both, read once"
        dec64, ver64 = times(64)
        assert ver64.linear > 1.5 * dec64.linear, "batch 64: a verify's matmuls pass the weights"
        # the engine's own verify steps at batch 1 take that (the virtual clock)
        e.generate([[1, 2, 3]], SamplingParams(max_tokens=120, ignore_eos=True))
        steps = [s for s in e.telemetry.steps if s.phase != "idle"]
        vs = [s.duration for s in steps if "verify" in s.kinds.values()]
        ds = [s.duration for s in steps if list(s.kinds.values()) == ["decode"]]
        assert vs and ds and all(s.graph_kind == PIECEWISE for s in steps if s.drafts)
        assert max(ds) < min(vs) and max(vs) < (K + 1) * min(ds)
    finally:
        e.close()


def test_n2_logprobs_and_stops_with_modelled_verifies():
    """Several kept tokens a step: each gets its logprobs row, n = 2 choices verify apart, a
    stop token ends a request inside a verify's kept run, and the pool comes back whole."""
    acc = {"num_draft_tokens": 100, "num_accepted_tokens": 70, "source": "a test's figure"}
    e = Engine(model="random:tiny", device="model:h200", num_kv_blocks=64, block_size=16,
               speculative_config={**NGRAM, "acceptance": acc})
    try:
        outs = e.generate([[1, 2, 3], [4, 5, 6, 7]],
                          SamplingParams(max_tokens=40, ignore_eos=True, n=2, logprobs=2))
        choices = [c for o in outs for c in o.outputs]
        assert len(choices) == 4
        assert all(len(c.token_ids) == len(c.logprobs) == 40 for c in choices)
        assert e.telemetry.spec_decode.num_accepted_tokens > 0
        stops = set(range(100, 140))          # about one token in thirteen of random:tiny's
        outs = e.generate([[1, 2, 3]] * 16, SamplingParams(max_tokens=200, ignore_eos=True,
                                                           stop_token_ids=sorted(stops)))
        assert all(o.outputs[0].finish_reason == "stop" and o.outputs[0].token_ids[-1] in stops
                   and not stops & set(o.outputs[0].token_ids[:-1]) for o in outs)
        # the tokens each request was handed by its steps (a verify: its accepted drafts and
        # its own token) against those it kept: more where a stop cut a kept run
        offered = {o.request_id: 0 for o in outs}
        for s in e.telemetry.steps:
            for rid, kind in s.kinds.items():
                if rid in offered and kind != "chunk":
                    offered[rid] += 1 + s.accepted.get(rid, 0)
        assert any(offered[o.request_id] > len(o.outputs[0].token_ids) for o in outs)
        assert pool_is_whole(e)
    finally:
        e.close()
