"""The batched sampler (executor/sampler.py): what it draws is the filtered distribution,
computed here independently in float64, for every filter and their combinations, over the
candidate path, the full-sort fallback and the whole-vocabulary draw; a seeded row depends on
nothing but its own logits and seed; the async pipeline runs sampled, seeded, penalised,
stop-string and logprob requests ahead and gives the synchronous engine's tokens and text."""
from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch

from conftest import random_prompts
from workbench import Engine, SamplingParams
from workbench.executor import sampler
from workbench.executor.sampler import sample
from workbench.executor.sampling_metadata import SamplingRow, sampling_metadata

DRAWS = 40_000


def reference(logits: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """vLLM's order in float64: temperature, min-p and top-k (ties at the k-th value kept),
    then top-p on what they keep (the smallest prefix reaching top_p of its mass)."""
    probs = torch.softmax(logits.double() / p.temperature, -1)
    if 0 < p.top_k < probs.numel():
        probs = torch.where(probs >= probs.topk(p.top_k).values[-1], probs, 0.0)
    if p.min_p > 0:
        probs = torch.where(probs >= p.min_p * probs.max(), probs, 0.0)
    if p.top_p < 1:
        s, order = probs.sort(descending=True)
        s = torch.where(s.cumsum(0) - s >= p.top_p * s.sum(), 0.0, s)
        probs = torch.zeros_like(probs).scatter_(0, order, s)
    return probs / probs.sum()


def chi_square_fits(counts: torch.Tensor, probs: torch.Tensor) -> tuple[bool, str]:
    """Counts drawn from probs? No draw outside the support, and Pearson's statistic within
    df + 6 sd (cells expecting under 5 draws pooled): a false alarm is rarer than 1e-6, and
    the filter mutations below are far outside it."""
    n = int(counts.sum())
    if bool((counts[probs == 0] > 0).any()):
        return False, f"{int(counts[probs == 0].sum())} draws outside the kept set"
    expected = probs * n
    big = expected >= 5
    obs = torch.cat([counts[big].double(), counts[~big].double().sum()[None]])
    exp = torch.cat([expected[big], expected[~big].sum()[None]])
    keep = exp > 0
    stat = float(((obs[keep] - exp[keep]) ** 2 / exp[keep]).sum())
    df = max(int(keep.sum()) - 1, 1)
    return stat <= df + 6 * math.sqrt(2 * df), f"chi2 {stat:.1f} for df {df}"


def metadata(logits: torch.Tensor, params: list[SamplingParams], generators=None, **kw):
    """The step's SamplingMetadata for rows of these params (prompt [1], no output)."""
    gens = generators or [None] * len(params)
    return sampling_metadata([SamplingRow(p, [1], 1, g) for p, g in zip(params, gens)],
                             logits.shape[-1], **kw)


def draw_counts(logits: torch.Tensor, p: SamplingParams, seed: int = 0) -> torch.Tensor:
    """DRAWS draws of one row's distribution, as one batch of DRAWS rows (the batched path)."""
    rows = logits[None].expand(DRAWS, -1).contiguous()
    ids = sample(rows, metadata(rows, [p] * DRAWS,
                                shared=torch.Generator().manual_seed(seed))).token_ids
    return torch.bincount(ids, minlength=logits.numel())


def peaked(vocab: int, seed: int, scale: float = 2.5) -> torch.Tensor:
    return torch.randn(vocab, generator=torch.Generator().manual_seed(seed)) * scale


FILTERS = [dict(temperature=0.7), dict(temperature=1.3), dict(top_k=7), dict(top_p=0.8),
           dict(min_p=0.08), dict(temperature=0.6, top_k=20, top_p=0.95),
           dict(temperature=0.8, top_p=0.7, min_p=0.05), dict(top_k=30, min_p=0.02),
           dict(temperature=1.5, top_k=12, top_p=0.6, min_p=0.1)]


@pytest.mark.parametrize("kw", FILTERS, ids=lambda kw: ",".join(f"{k}={v}" for k, v in kw.items()))
def test_draws_follow_the_filtered_distribution(kw):
    logits = peaked(60, seed=len(kw) * 7 + int(100 * kw.get("top_p", 0)))
    p = SamplingParams(**{"temperature": 1.0, **kw})
    ok, why = chi_square_fits(draw_counts(logits, p), reference(logits, p))
    assert ok, why


def small_candidates(monkeypatch) -> list[int]:
    """CANDIDATES (64, 512), and the widths of every topk taken from now on (the widest
    says which path a draw or a verify's distribution took)."""
    monkeypatch.setattr(sampler, "CANDIDATES", (64, 512))
    widths = []
    real_topk = torch.Tensor.topk
    monkeypatch.setattr(torch.Tensor, "topk", lambda self, k, *a, **kw: (
        widths.append(k), real_topk(self, k, *a, **kw))[1])
    return widths


@pytest.mark.parametrize("kw,widest,why", [
    (dict(top_p=0.5, temperature=0.3), 64, "nucleus (4 tokens) within the first candidates"),
    (dict(top_p=0.95, temperature=0.3), 512, "nucleus (176) within the second candidates"),
    (dict(top_p=0.99, temperature=0.3), 3000, "nucleus (536) past every candidate: full sort"),
    (dict(top_k=400, top_p=0.95, temperature=0.3), 400, "top-k past the first: its own k"),
    (dict(top_k=1000, top_p=0.999, temperature=1.5), 1000, "top-k past every candidate"),
    (dict(top_k=300, temperature=1.5), 300, "top-k alone: its own k at once"),
    (dict(temperature=0.9, min_p=0.001), None, "no top-k/top-p: the whole vocabulary"),
])
def test_a_large_vocabulary_takes_every_path_exactly(kw, widest, why, monkeypatch):
    """3000 tokens, CANDIDATES (64, 512): each path of _draw_truncated (and the
    whole-vocabulary draw) against the float64 reference; each case takes the path it
    names (the widest topk the draw looked among is recorded)."""
    widths = small_candidates(monkeypatch)
    logits = peaked(3000, seed=11, scale=1.0)
    p = SamplingParams(**{"temperature": 1.0, **kw})
    counts = draw_counts(logits, p)
    assert max(widths, default=None) == widest, (why, widths)
    monkeypatch.undo()
    ok, msg = chi_square_fits(counts, reference(logits, p))
    assert ok, (why, msg)


@pytest.mark.parametrize("kw,widest,why", [
    (dict(top_p=0.5, temperature=0.3), 64, "nucleus within the first candidates"),
    (dict(top_p=0.95, temperature=0.3), 512, "nucleus within the second candidates"),
    (dict(top_p=0.99, temperature=0.3), 3000, "nucleus past every candidate: full sort"),
    (dict(top_k=1000, top_p=0.999, temperature=1.5), 1000, "top-k past every candidate"),
    (dict(top_k=300, temperature=1.5), 300, "top-k alone: its own k at once"),
])
def test_verify_distributions_look_among_the_candidates_exactly(kw, widest, why, monkeypatch):
    """What a verify step's drafts are accepted against (target_probs, one dense row per
    position): looked for among the candidates as a draw looks, not by sorting the whole
    vocabulary for every row (10 ms a verify step of SmolLM2 on a Zen 5), and equal to the
    float64 reference on every path."""
    widths = small_candidates(monkeypatch)
    logits = peaked(3000, seed=11, scale=1.0)
    p = SamplingParams(**{"temperature": 1.0, **kw})
    rows = logits[None].expand(3, -1).contiguous()
    probs = sampler.target_probs(rows, metadata(rows, [p] * 3)).probs
    assert max(widths) == widest, (why, widths)
    for row in probs:
        assert torch.allclose(row.double(), reference(logits, p), atol=1e-6), why


CHOSEN = dict(temperature=0.7, top_k=15, top_p=0.8, min_p=0.25)   # keeps 5 of the 60
"""A row where min-p, top-p and temperature each change what is kept."""


@pytest.mark.parametrize("mutation,kw", [
    ("top_p_before_top_k", dict(temperature=1.0, top_k=15, top_p=0.7, min_p=0.1)),  # 8 kept
    ("top_p_too_wide", CHOSEN), ("no_min_p", CHOSEN), ("temperature_ignored", CHOSEN)])
def test_the_distribution_check_fails_a_mutated_filter(mutation, kw, monkeypatch):
    """The check above has teeth: draws from a sampler with one filter broken fail it."""
    logits = peaked(60, seed=4, scale=1.0)
    p = SamplingParams(**kw)
    want = reference(logits, p)
    if mutation == "top_p_before_top_k":        # the nucleus of the whole, then the top 15
        wrong = reference(logits, replace(p, top_k=0))
        in_top = torch.zeros(60, dtype=torch.bool).scatter_(0, logits.topk(15).indices, True)
        wrong = torch.where(in_top, wrong, 0.0)
        counts = torch.bincount(torch.multinomial(wrong.float(), DRAWS, replacement=True,
                                                  generator=torch.Generator().manual_seed(0)),
                                minlength=60)
    else:
        real = sampler._draw_truncated
        if mutation == "top_p_too_wide":         # keeps tokens past the nucleus
            def broken(logits, f, u):
                wider = [min(1.0, x + 0.12) for x in f.top_p]
                return real(logits, replace(f, top_p=wider, top_p_t=torch.tensor(wider)), u)
        elif mutation == "no_min_p":
            def broken(logits, f, u):
                return real(logits, replace(f, min_p=None), u)
        else:
            def broken(logits, f, u):
                return real(logits, replace(f, temperature=torch.ones_like(f.temperature)), u)
        monkeypatch.setattr(sampler, "_draw_truncated", broken)
        counts = draw_counts(logits, p)
    ok, why = chi_square_fits(counts, want)
    assert not ok, f"{mutation} passed the check ({why})"


@pytest.mark.parametrize("kw", [dict(top_p=0.9), dict(temperature=0.6, top_k=20, top_p=0.95),
                                dict(top_k=50, min_p=0.05), dict(temperature=0.8)])
def test_the_accelerator_path_reads_nothing_on_the_host(kw, monkeypatch):
    """What runs where host reads are not free (a GPU or NPU): the same distributions, with
    no value read back to the host mid-sample (any .tolist(), .item() or bool() of a tensor
    raises here), so a sampled step can be launched ahead."""
    monkeypatch.setattr(sampler, "host_reads_are_free", lambda device: False)
    logits = peaked(3000, seed=11, scale=1.0)
    p = SamplingParams(**{"temperature": 1.0, **kw})
    rows = logits[None].expand(2000, -1).contiguous()
    md = metadata(rows, [p] * 2000, shared=torch.Generator().manual_seed(0))

    def no_host(*a, **k):
        raise AssertionError("the sampler read a device value on the host")
    with monkeypatch.context() as m:
        for name in ("tolist", "item", "__bool__"):
            m.setattr(torch.Tensor, name, no_host)
        ids = sample(rows, md).token_ids
    ok, msg = chi_square_fits(torch.bincount(ids, minlength=3000), reference(logits, p))
    assert ok, msg


def test_greedy_and_sampled_rows_share_a_batch():
    """Greedy rows take the argmax, sampled rows their draws, in one call; top_k=1 is greedy."""
    logits = torch.stack([peaked(50, seed=i) for i in range(6)])
    ps = [SamplingParams(temperature=0), SamplingParams(temperature=0.8),
          SamplingParams(temperature=0.9, top_k=1), SamplingParams(temperature=0),
          SamplingParams(temperature=1.0, top_p=0.5), SamplingParams(temperature=1e-6)]
    ids = sample(logits, metadata(logits, ps, shared=torch.Generator().manual_seed(0))
                 ).token_ids.tolist()
    best = logits.argmax(-1).tolist()
    assert [ids[i] for i in (0, 2, 3, 5)] == [best[i] for i in (0, 2, 3, 5)]
    assert reference(logits[4], ps[4])[ids[4]] > 0


def test_a_seeded_row_depends_only_on_its_own_logits_and_seed():
    """Row 0 (seeded) draws the same token whatever rows share its call: alone, among 31
    unseeded rows of other filters, and placed last."""
    logits = peaked(400, seed=5, scale=1.0)
    p = SamplingParams(temperature=1.0, top_p=0.9, top_k=50, seed=1)
    others = [SamplingParams(temperature=t, top_p=tp, top_k=k) for t, tp, k in
              [(0.7, 0.9, 0), (1.0, 1.0, 0), (0.5, 0.95, 20), (0.0, 1.0, 0)] * 8][:31]
    rows = torch.stack([peaked(400, seed=100 + i) for i in range(31)])

    stream_alone, stream_batch, stream_last = [], [], []
    ga, gb, gc = (torch.Generator().manual_seed(1) for _ in range(3))
    for step in range(30):
        stream_alone.append(sample(logits[None], metadata(logits, [p], [ga])).token_ids.item())
        stream_batch.append(sample(torch.cat([logits[None], rows]), metadata(
            logits, [p, *others], [gb] + [None] * 31,
            shared=torch.Generator().manual_seed(step))).token_ids[0].item())
        stream_last.append(sample(torch.cat([rows, logits[None]]), metadata(
            logits, [*others, p], [None] * 31 + [gc],
            shared=torch.Generator().manual_seed(step + 50))).token_ids[-1].item())
    assert stream_alone == stream_batch == stream_last
    assert len(set(stream_alone)) > 3                  # it does sample


@pytest.fixture(scope="module")
def tiny(tiny_checkpoints):
    path, _ = tiny_checkpoints["qwen3"]
    return Engine(model=str(path), device="cpu", block_size=16, num_kv_blocks=256,
                  max_num_seqs=32, max_model_len=512)


def test_a_seeded_request_alone_and_among_31_unseeded_gives_the_same_tokens(tiny):
    x = random_prompts(1, 20, 20, 1000, seed=1)[0]
    p = SamplingParams(max_tokens=24, temperature=0.9, top_p=0.9, seed=77, ignore_eos=True)
    alone = tiny.generate([x], p)[0].token_ids
    crowd = random_prompts(31, 5, 60, 1000, seed=2)
    mixed = [SamplingParams(max_tokens=n, temperature=0.7, top_p=0.9, ignore_eos=True)
             for n in range(10, 41)]
    outs = tiny.generate([*crowd[:15], x, *crowd[15:]], [*mixed[:15], p, *mixed[15:]])
    assert outs[15].token_ids == alone
    assert tiny.generate([x], p)[0].token_ids == alone              # a second run
    assert len(set(alone)) > 3


def _run(engine, prompts, params):
    outs = engine.generate(prompts, params)
    return [(o.token_ids, o.text, o.finish_reason,
             None if o.outputs[0].logprobs is None else
             [{t: round(lp.logprob, 4) for t, lp in d.items()} for d in o.outputs[0].logprobs])
            for o in outs]


def test_async_scheduling_runs_sampled_penalised_and_stop_string_requests_ahead(
        replaying_platform):
    """Sampled with a seed, penalised (repetition, frequency, presence, min_tokens), stop
    strings (straddling tokens, in the first token, kept with include_stop_str_in_output),
    logprobs: with async scheduling on (the CPU stand-in for a graph) they run ahead, and give
    the synchronous engine's tokens, text, finish reasons and logprobs."""
    kw = dict(model="smollm2", device="cpu", num_kv_blocks=160, max_num_seqs=8,
              cudagraph_capture_sizes=[1, 2, 4, 8])
    ahead, sync = Engine(**kw, async_scheduling=True), Engine(**kw, async_scheduling=False)
    texts = ["The capital of France is", "Once upon a time, in a small village,",
             "List three prime numbers:", "def fibonacci(n):", "Hi", "The sea is",
             "ha ha ha ha ha ha ha ha ha ha ha ha ha ha"]
    prompts = [sync.tokenizer.encode(t) for t in texts]
    greedy = sync.generate(prompts, SamplingParams(max_tokens=24, temperature=0, ignore_eos=True))
    ha = greedy[6].token_ids
    assert ha.count(ha[0]) >= 12                                # " ha" again and again
    tok = sync.tokenizer
    # A stop string across the boundary of output tokens 5 and 6, one inside the first token.
    a, b = tok.decode(greedy[0].token_ids[4:5]), tok.decode(greedy[0].token_ids[5:6])
    straddle = a[-2:] + b[:1] if len(a) >= 2 and b else a + b
    first = tok.decode(greedy[1].token_ids[:1]).strip() or tok.decode(greedy[1].token_ids[:1])
    params = [
        SamplingParams(max_tokens=24, temperature=0, stop=[straddle]),
        SamplingParams(max_tokens=24, temperature=0, stop=[first], include_stop_str_in_output=True),
        SamplingParams(max_tokens=24, temperature=0.8, top_p=0.9, seed=11, ignore_eos=True),
        SamplingParams(max_tokens=24, temperature=0.7, top_k=20, seed=12, ignore_eos=True,
                       repetition_penalty=1.3, frequency_penalty=0.5, presence_penalty=0.4),
        SamplingParams(max_tokens=24, temperature=0.9, seed=13, logprobs=3, min_tokens=20),
        SamplingParams(max_tokens=24, temperature=0, logprobs=2, presence_penalty=1.0,
                       logit_bias={tok.encode(" the")[0]: -100}, ignore_eos=True),
        # Greedy repeats " ha" until the frequency penalty (which must count the token still
        # in flight) outweighs it: a step late, the output differs.
        SamplingParams(max_tokens=16, temperature=0, frequency_penalty=0.3, ignore_eos=True),
    ]
    want = _run(sync, prompts, params)
    first_step = ahead.telemetry.num_steps
    got = _run(ahead, prompts, params)
    assert got == want
    assert straddle in greedy[0].text and not want[0][1].endswith(straddle)
    assert want[0][2] == "stop" and want[1][2] == "stop" and want[1][1].endswith(first)
    assert want[6][0][0] == ha[0] and want[6][0] != ha[:16]
    steps = ahead.telemetry.steps_since(first_step)
    assert sum(s.scheduled_ahead for s in steps) >= 10 and not any(s.held_back for s in steps)
    assert ahead.stats().kv_blocks_used == 0


def test_a_grammar_holds_the_step_back_and_telemetry_says_so(replaying_platform):
    pytest.importorskip("llguidance")
    from workbench.core.sampling_params import StructuredOutputsParams
    e = Engine(model="smollm2", device="cpu", num_kv_blocks=64, max_num_seqs=4,
               cudagraph_capture_sizes=[1, 2, 4], async_scheduling=True)
    p = SamplingParams(max_tokens=12, temperature=0,
                       structured_outputs=StructuredOutputsParams(regex="[a-z]{3,8} yes"))
    first_step = e.telemetry.num_steps
    outs = e.generate(["Say something", "Hi"], [p, SamplingParams(max_tokens=12, temperature=0,
                                                                  ignore_eos=True)])
    steps = e.telemetry.steps_since(first_step)
    held = [s.held_back for s in steps if s.held_back]
    assert held and all(h == {outs[0].request_id: "grammar"} for h in held)
    assert not any(s.scheduled_ahead for s in steps if outs[0].request_id in s.tokens_per_request)


def test_a_request_sampled_at_several_positions_is_rows_of_the_metadata():
    """What speculative decoding (issue 40) will verify with: one request given as a row per
    position, each reading its own logits row with its history up to that position. A seeded
    request's positions draw from its generator in row order, so three positions in one
    call, among other rows, give the tokens of three calls one position at a time; the
    penalties see each position's own history."""
    logits = torch.stack([peaked(300, seed=40 + i, scale=1.0) for i in range(6)])
    p = SamplingParams(temperature=0.9, top_p=0.95, frequency_penalty=0.7, seed=8)
    prompt, drafts = [5, 6, 7], [11, 12]
    g = torch.Generator().manual_seed(8)
    alone = []
    for j in range(3):                                  # one position per call, in order
        row = SamplingRow(p, prompt + drafts[:j], len(prompt), g)
        alone.append(sample(logits, sampling_metadata([row], 300, logits_rows=[1 + j]))
                     .token_ids.item())
    g = torch.Generator().manual_seed(8)
    other = SamplingParams(temperature=0.8)
    rows = [SamplingRow(other, [1], 1)] + [SamplingRow(p, prompt + drafts[:j], len(prompt), g)
                                           for j in range(3)] + [SamplingRow(other, [2], 1)]
    together = sample(logits, sampling_metadata(rows, 300, logits_rows=[0, 1, 2, 3, 5],
                                                shared=torch.Generator().manual_seed(0)))
    assert together.token_ids[1:4].tolist() == alone
    # Each position's history is its own: the draft before position 1 is penalised there only.
    q = SamplingParams(temperature=0, logit_bias={11: 8.0}, repetition_penalty=10.0)
    rows = [SamplingRow(q, prompt + drafts[:j], len(prompt)) for j in range(2)]
    ids = sample(logits, sampling_metadata(rows, 300, logits_rows=[1, 1])).token_ids.tolist()
    assert ids[0] == 11 and ids[1] != 11


@pytest.mark.parametrize("kw", [dict(logit_bias={7: 100.0}), dict(min_tokens=3, stop_token_ids=[7])])
def test_logit_processors_without_penalties(kw):
    """logit_bias or min_tokens alone (no penalty in the step): the processors run, and no
    penalty step is made up for them."""
    logits = torch.zeros(2, 50)
    logits[:, 7] = 5.0
    rows = [SamplingRow(SamplingParams(temperature=0, **kw), [1, 2], 2),
            SamplingRow(SamplingParams(temperature=0), [1, 2], 2)]
    ids = sample(logits, sampling_metadata(rows, 50)).token_ids.tolist()
    assert ids[1] == 7
    assert ids[0] == (7 if "logit_bias" in kw else 0)
