"""Speculative decoding in the engine (issue 40): greedy tokens equal plain decoding's with
n-gram drafts across batch sizes, block sizes, preemption, prefix caching and the async
flag (random models, and the embedded SmolLM2 on a prompt that repeats itself, where most
drafts are accepted); stops, n = 2 and logprobs cut and kept as plain decoding's; the KV pool
back to full; telemetry and Prometheus counting; what a speculative engine refuses."""
from __future__ import annotations

import random

import pytest

from workbench import Engine, SamplingParams
from workbench.core.sampling_params import StructuredOutputsParams
from workbench.spec_decode.ngram import NgramProposer

NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3,
         "adaptive": False}
"""k drafts whenever the lookup finds them (these tests are about what a verify does; the
adaptive budget, which drafts fewer where they do not pay, is test_spec_budget's)."""


def prompts(n: int, seed: int = 0) -> list[list[int]]:
    """Random prompts, some repeating a stretch of themselves (drafts that hit)."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        p = [rng.randrange(1, 512) for _ in range(rng.randrange(3, 30))]
        out.append(p * 3 if i % 2 else p)
    return out


def tokens(outs) -> list[list[list[int]]]:
    return [[c.token_ids for c in o.outputs] for o in outs]


def pool_is_whole(e: Engine) -> bool:
    st = e.stats()
    return st.kv_blocks_used == 0 and st.kv_blocks_free == st.num_kv_blocks - 1


KNOBS = [
    dict(block_size=8),
    dict(block_size=16, enable_prefix_caching=False),
    dict(block_size=8, num_kv_blocks=12, max_num_seqs=4),       # preemption by recompute
    dict(block_size=16, max_num_batched_tokens=64, async_scheduling=True),
]


@pytest.mark.parametrize("knobs", KNOBS, ids=["bs8", "bs16-no-prefix-cache", "tiny-pool",
                                              "budget64-async"])
def test_greedy_tokens_equal_plain_decodings(knobs):
    p = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    batch = prompts(6)
    plain = Engine(model="random:tiny", device="cpu", **knobs)
    spec = Engine(model="random:tiny", device="cpu", speculative_config=NGRAM, **knobs)
    adaptive = Engine(model="random:tiny", device="cpu", **knobs,
                      speculative_config={**NGRAM, "adaptive": True})
    for group in (batch[:1], batch):                        # batch 1, then 6 at once
        want = tokens(plain.generate(group, p))
        assert tokens(spec.generate(group, p)) == want
        assert tokens(adaptive.generate(group, p)) == want  # whatever the budget drafted
    assert pool_is_whole(adaptive)
    sd = spec.telemetry.spec_decode
    assert sd.num_accepted_tokens > 20 and sd.num_draft_tokens > sd.num_accepted_tokens
    assert len(spec.telemetry.steps) < len(plain.telemetry.steps)
    if knobs.get("num_kv_blocks"):
        assert spec.stats().num_preemptions > 0
    assert pool_is_whole(spec)
    # a prompt served again hits the prefix cache built by verified tokens only
    if knobs.get("enable_prefix_caching", True) and not knobs.get("num_kv_blocks"):
        again = spec.generate(batch[1:2], p)
        assert tokens(again) == tokens(plain.generate(batch[1:2], p))
        assert again[0].metrics.cached_tokens > 0


@pytest.fixture(scope="module")
def smol():
    plain = Engine(model="smollm2", device="cpu", num_kv_blocks=64)
    spec = Engine(model="smollm2", device="cpu", num_kv_blocks=64, speculative_config=NGRAM)
    return plain, spec


PASSAGE = ("The quick brown fox jumps over the lazy dog. A journey of a thousand miles begins "
           "with a single step. All that glitters is not gold. ")


def test_smollm2_copies_a_passage_with_most_drafts_accepted(smol, smollm2_dir):
    plain, spec = smol
    prompt = PASSAGE * 3 + "The quick"
    p = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True, logprobs=2)
    a, b = plain.generate(prompt, p)[0], spec.generate(prompt, p)[0]
    assert b.token_ids == a.token_ids and b.text == a.text
    m = b.metrics
    assert m.acceptance_rate > 0.5 and m.mean_tokens_per_step > 2, (m.acceptance_rate,
                                                                     m.mean_tokens_per_step)
    # the kept tokens' logprobs are plain decoding's (same distribution, another kernel path)
    for la, lb in zip(a.outputs[0].logprobs, b.outputs[0].logprobs):
        assert list(la) == list(lb)
        for t in la:
            assert lb[t].logprob == pytest.approx(la[t].logprob, abs=2e-3)
            assert lb[t].rank == la[t].rank
    assert pool_is_whole(spec)


def test_stop_string_eos_and_max_tokens_cut_inside_an_accepted_run(smol):
    plain, spec = smol
    prompt = PASSAGE * 3 + "The quick"
    ref = plain.generate(prompt, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True))[0]
    cut_inside = 0
    # a stop string at two places of the copied text
    words = ref.text.split()
    for stop in (words[2], words[6]):
        p = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, stop=[stop])
        before = spec.telemetry.num_steps
        a, b = plain.generate(prompt, p)[0], spec.generate(prompt, p)[0]
        assert (b.text, b.token_ids, b.finish_reason, b.outputs[0].stop_reason) == \
            (a.text, a.token_ids, "stop", stop)
        assert b.metrics.output_tokens == len(a.token_ids)
        cut_inside += ended_inside_a_run(spec, before, prompt_len=len(b.prompt_token_ids),
                                         out_len=len(b.token_ids))
        assert pool_is_whole(spec)
    # a stop token (EOS's rule) and max_tokens at a few lengths
    for j in (2, 3, 6, 7):
        tok = ref.token_ids[j]
        if tok not in ref.token_ids[:j]:
            p = SamplingParams(temperature=0, max_tokens=16, stop_token_ids=[tok])
            before = spec.telemetry.num_steps
            b = spec.generate(prompt, p)[0]
            assert b.token_ids == ref.token_ids[:j + 1] and b.finish_reason == "stop"
            cut_inside += ended_inside_a_run(spec, before, len(b.prompt_token_ids), j + 1)
        p = SamplingParams(temperature=0, max_tokens=j, ignore_eos=True)
        b = spec.generate(prompt, p)[0]
        assert b.token_ids == ref.token_ids[:j] and b.finish_reason == "length"
    assert cut_inside >= 2
    assert pool_is_whole(spec)


def ended_inside_a_run(e: Engine, since: int, prompt_len: int, out_len: int) -> bool:
    """Whether the request's last step verified drafts and it kept fewer tokens than that
    step accepted (+ the target's own): a stop inside an accepted run."""
    last = [s for s in e.telemetry.steps_since(since) if s.accepted][-1:]
    if not last:
        return False
    (ev,) = last
    (rid,) = ev.accepted
    before = ev.context_lens[rid] + 1 - prompt_len
    return before + ev.accepted[rid] + 1 > out_len > before


def test_n2_and_sampled_requests_run_and_seeds_stay_batch_invariant():
    e = Engine(model="random:tiny", device="cpu", block_size=8, speculative_config=NGRAM)
    plain = Engine(model="random:tiny", device="cpu", block_size=8)
    batch = prompts(5, seed=3)
    g2 = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, n=2)
    assert tokens(e.generate(batch, g2)) == tokens(plain.generate(batch, g2))
    seeded = SamplingParams(temperature=0.9, top_k=50, top_p=0.95, repetition_penalty=1.1,
                            max_tokens=30, ignore_eos=True, seed=11)
    alone = e.generate([batch[1]], seeded)[0].token_ids
    other = SamplingParams(temperature=1.0, max_tokens=30, ignore_eos=True)
    mixed = e.generate(batch, [other, seeded, other, other, other])[1].token_ids
    assert alone == mixed and len(alone) == 30
    assert e.telemetry.spec_decode.num_accepted_tokens > 0 and pool_is_whole(e)


def test_telemetry_and_prometheus_count_drafts():
    pytest.importorskip("prometheus_client")
    from workbench.serving.metrics import EngineMetrics
    e = Engine(model="random:tiny", device="cpu", speculative_config=NGRAM)
    e.generate(prompts(4, seed=5), SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))
    steps = [s for s in e.telemetry.steps if s.drafts]
    assert steps and all(s.kinds[r] == "verify" for s in steps for r in s.drafts)
    sd = e.telemetry.spec_decode
    assert sd.num_drafts == sum(len(s.drafts) for s in steps)
    assert sd.num_draft_tokens == sum(s.num_draft_tokens for s in steps)
    assert sd.num_accepted_tokens == sum(s.accepted_per_pos[0] if s.accepted_per_pos else 0
                                         for s in steps) + sum(sd.accepted_per_pos[1:])
    assert sd.accepted_per_pos == sorted(sd.accepted_per_pos, reverse=True)
    reqs = e.telemetry.requests
    assert sum(r.num_draft_tokens for r in reqs) == sd.num_draft_tokens
    assert sum(r.num_accepted_tokens for r in reqs) == sd.num_accepted_tokens
    text = EngineMetrics(e, "m").render().decode()
    assert f'vllm:spec_decode_num_drafts_total{{model_name="m"}} {float(sd.num_drafts)}' in text
    assert (f'vllm:spec_decode_num_draft_tokens_total{{model_name="m"}} '
            f'{float(sd.num_draft_tokens)}') in text
    assert (f'vllm:spec_decode_num_accepted_tokens_total{{model_name="m"}} '
            f'{float(sd.num_accepted_tokens)}') in text
    for pos in range(4):
        n = sd.accepted_per_pos[pos] if pos < len(sd.accepted_per_pos) else 0
        assert (f'vllm:spec_decode_num_accepted_tokens_per_pos_total{{model_name="m",'
                f'position="{pos}"}} {float(n)}') in text


def test_what_a_speculative_engine_refuses():
    e = Engine(model="random:tiny", device="cpu", speculative_config=NGRAM)
    with pytest.raises(ValueError, match="structured_outputs"):
        e.generate([1, 2, 3], SamplingParams(structured_outputs=StructuredOutputsParams(
            choice=["a", "b"])))
    with pytest.raises(ValueError, match="speculative_config.acceptance: required on a "
                                         "modelled device"):
        Engine(model="random:tiny", device="model:h100", speculative_config=NGRAM)
    # the engine still serves
    assert e.generate([1, 2, 3], SamplingParams(max_tokens=3, ignore_eos=True))[0].token_ids


def test_a_request_whose_drafts_miss_stops_drafting_for_a_while():
    e = Engine(model="random:tiny", device="cpu", speculative_config=NGRAM)
    plain = Engine(model="random:tiny", device="cpu")

    class Wrong(NgramProposer):   # drafts the token after the last: a random model never picks it
        def propose(self, reqs, rows=None, shared=None):
            return [[(t[-1] + 1) % 512] * 4 for _, t in reqs]
    e.core.pipeline.spec.proposer = Wrong(4)
    p = SamplingParams(temperature=0, max_tokens=60, ignore_eos=True)
    prompt = prompts(1, seed=9)[0]
    assert e.generate(prompt, p)[0].token_ids == plain.generate(prompt, p)[0].token_ids
    verifies = [s for s in e.telemetry.steps if s.drafts]
    assert e.telemetry.spec_decode.num_accepted_tokens < len(verifies) <= 6


def test_disable_by_batch_size_turns_drafting_off_for_large_batches():
    e = Engine(model="random:tiny", device="cpu",
               speculative_config={**NGRAM, "disable_by_batch_size": 3})
    p = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    e.generate(prompts(4, seed=1), p)          # four at once: no drafts while 3+ run
    assert not any(s.drafts and len(s.tokens_per_request) >= 3 for s in e.telemetry.steps)
    e.generate(prompts(2, seed=1)[1:], p)      # alone, a repeating prompt: drafts
    assert e.telemetry.spec_decode.num_drafts > 0


def test_draft_model_method_keeps_the_greedy_tokens():
    """The target drafting for itself (spec_decode/draft_model.py) keeps its greedy tokens
    and nearly every draft, and gives every block back."""
    cfg = {"method": "draft_model", "model": "random:tiny", "num_speculative_tokens": 3}
    e = Engine(model="random:tiny", device="cpu", speculative_config=cfg)
    plain = Engine(model="random:tiny", device="cpu")
    p = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    batch = prompts(3, seed=4)
    assert tokens(e.generate(batch, p)) == tokens(plain.generate(batch, p))
    sd = e.telemetry.spec_decode
    assert sd.num_draft_tokens > 0 and sd.num_accepted_tokens >= 0.9 * sd.num_draft_tokens
    assert pool_is_whole(e)


def test_a_sampled_requests_drafts_are_drawn_and_kept_as_often_as_the_draft_is_the_target():
    """For a sampled request the draft model draws its drafts from its own distribution under
    the request's filters, and the rejection sampler keeps each with min(1, p/q): the target
    drafting for itself keeps nearly all (a greedy draft would be kept at p(x) only: a
    random model at temperature 1 puts little mass on any one token)."""
    cfg = {"method": "draft_model", "model": "random:tiny", "num_speculative_tokens": 3,
           "adaptive": False}
    e = Engine(model="random:tiny", device="cpu", speculative_config=cfg)
    knobs = dict(temperature=1.0, top_p=0.95, repetition_penalty=1.1, max_tokens=24,
                 ignore_eos=True)
    p, seeded = SamplingParams(**knobs), SamplingParams(**knobs, seed=7)
    outs = e.generate(prompts(3, seed=4), [p, seeded, p])
    assert all(len(o.token_ids) == 24 for o in outs)
    sd = e.telemetry.spec_decode
    assert sd.num_draft_tokens > 0 and sd.num_accepted_tokens >= 0.9 * sd.num_draft_tokens
    assert pool_is_whole(e)
