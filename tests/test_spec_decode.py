"""Speculative decoding without a model (issue 40): the config's refusals, the n-gram
proposer, the scheduler's KV accounting under random acceptance, and the rejection sampler's
output distribution against the target's filtered distribution computed in float64, for
one-hot drafts and drafts drawn from a draft's own distribution (with mutated acceptance rules
shown to fail the same bound)."""
from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from workbench.config import EngineConfig, SpeculativeConfig
from workbench.core.block_manager import BlockManager
from workbench.core.sampling_params import SamplingParams
from workbench.core.scheduler import Scheduler
from workbench.core.sequence import Sequence
from workbench.executor import rejection_sampler as rs
from workbench.executor.runner import CachedRequests
from workbench.executor.sampling_metadata import SamplingRow, sampling_metadata
from workbench.spec_decode import make_proposer
from workbench.spec_decode.ngram import NgramProposer, propose_ngram


# ---- configuration ---------------------------------------------------------------------------
@pytest.mark.parametrize("bad, field", [
    ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens"),
    ({"method": "ngram"}, "num_speculative_tokens"),
    ({"method": "medusa", "num_speculative_tokens": 2}, "method"),
    ({"method": "ngram", "num_speculative_tokens": 2, "disable_by_batch_size": 0},
     "disable_by_batch_size"),
    ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 4,
      "prompt_lookup_max": 2}, "prompt_lookup_min"),
    ({"method": "draft_model", "num_speculative_tokens": 2}, "model"),
    ({"method": "draft_model", "model": "random:tiny", "num_speculative_tokens": 2,
      "quantization": "q3"}, "quantization"),
    ({"method": "ngram", "num_speculative_tokens": 2, "adaptive": "yes"}, "adaptive"),
    ("ngram", "speculative_config"),
])
def test_bad_speculative_configs_are_refused_naming_the_field(bad, field):
    with pytest.raises(ValueError, match=rf"speculative_config\.?{field if field != 'speculative_config' else ''}"):
        EngineConfig(speculative_config=bad)


def test_speculative_config_typed_and_unknown_fields_warned(caplog):
    with caplog.at_level("WARNING", logger="workbench"):
        c = EngineConfig(speculative_config={"method": "ngram", "num_speculative_tokens": 3,
                                             "prompt_lookup_max": 5, "frobnicate": 1})
    assert c.speculative() == SpeculativeConfig("ngram", 3, 1, 5)
    assert EngineConfig(speculative_config={"method": "ngram", "num_speculative_tokens": 3,
                                            "disable_by_batch_size": 8}
                        ).speculative().disable_by_batch_size == 8
    assert "frobnicate" in caplog.text
    assert EngineConfig().speculative() is None


def test_cli_takes_speculative_config_on_engine_commands():
    from workbench.cli import build_parser
    p = build_parser()
    for cmd in (["generate", "hi"], ["bench"], ["serve"], ["tune", "--ttft-ms", "1", "--tpot-ms", "1"]):
        a = p.parse_args([*cmd, "--speculative-config",
                          '{"method": "ngram", "num_speculative_tokens": 4}'])
        assert a.speculative_config == {"method": "ngram", "num_speculative_tokens": 4}
    with pytest.raises(SystemExit):
        p.parse_args(["generate", "hi", "--speculative-config", "{nope"])


# ---- the n-gram proposer ----------------------------------------------------------------------
def test_ngram_proposes_what_followed_the_longest_latest_suffix_match():
    t = lambda *x: np.array(x, dtype=np.int64)  # noqa: E731
    assert propose_ngram(t(1, 2, 3, 4, 5, 1, 2, 3), 3, 1, 4).tolist() == [4, 5, 1]
    # "2 3" occurs twice before: the latest occurrence wins among equally long matches
    assert propose_ngram(t(1, 2, 3, 9, 9, 2, 3, 7, 7, 2, 3), 3, 1, 4).tolist() == [7, 7, 2]
    # the longer match (5 2 3) beats the later, shorter one (2 3)
    assert propose_ngram(t(5, 2, 3, 8, 1, 2, 3, 6, 5, 2, 3), 2, 1, 4).tolist() == [8, 1]
    # below prompt_lookup_min: nothing
    assert propose_ngram(t(5, 1, 2, 3, 4, 1, 2, 3), 2, 4, 4).tolist() == []
    assert propose_ngram(t(5, 1, 2, 3, 4, 1, 2, 3), 2, 3, 4).tolist() == [4, 1]
    # no earlier occurrence of the last token, or too short
    assert propose_ngram(t(1, 2, 3), 3, 1, 4).tolist() == []
    assert propose_ngram(t(7), 3, 1, 4).tolist() == []
    # the draft stops at the end of the tokens
    assert propose_ngram(t(4, 4), 3, 1, 4).tolist() == [4]


def test_ngram_matches_a_brute_force_reference():
    rng = np.random.default_rng(0)
    for _ in range(300):
        toks = rng.integers(0, 4, size=rng.integers(1, 40))
        k, lo = int(rng.integers(1, 5)), int(rng.integers(1, 3))
        hi = lo + int(rng.integers(0, 3))
        want = []
        for n in range(min(hi, len(toks) - 1), lo - 1, -1):
            suffix = list(toks[len(toks) - n:])
            ends = [e for e in range(n - 1, len(toks) - 1) if list(toks[e - n + 1:e + 1]) == suffix]
            if ends:
                want = list(toks[ends[-1] + 1:ends[-1] + 1 + k])
                break
        assert propose_ngram(toks, k, lo, hi).tolist() == want, (toks, k, lo, hi)


def test_proposer_duck_type_and_draft_model_not_yet():
    p = make_proposer(SpeculativeConfig("ngram", 2), target_vocab_size=100)
    assert isinstance(p, NgramProposer)
    assert p.propose([("a", [1, 2, 1]), ("b", [3])]) == [[2, 1], []]
    p.free("a")


# ---- the scheduler's KV accounting --------------------------------------------------------------
def check_pool(bm: BlockManager, sched: Scheduler) -> None:
    """Every held block's ref count is the number of tables holding it; free + used = usable;
    a block registered in the prefix cache holds exactly its sequence's tokens there."""
    refs = [0] * bm.num_blocks
    for seq in sched.requests.values():
        for b in seq.block_table:
            refs[b] += 1
        assert len(seq.block_hashes) * bm.block_size <= seq.num_computed_tokens
        assert len(seq.block_table) >= bm.blocks_needed(seq.num_computed_tokens)
        for i, _ in enumerate(seq.block_hashes):
            blk = bm.blocks[seq.block_table[i]]
            assert blk.token_ids == tuple(seq.token_ids[i * bm.block_size:(i + 1) * bm.block_size])
    assert [b.ref_count for b in bm.blocks] == refs
    assert bm.num_free_blocks + sum(r > 0 for r in refs) == bm.num_usable_blocks


@pytest.mark.parametrize("prefix_caching", [True, False])
def test_random_acceptance_keeps_the_block_pool_whole(prefix_caching):
    rng = random.Random(1)
    cfg = EngineConfig(max_num_seqs=6, max_num_batched_tokens=48,
                       enable_prefix_caching=prefix_caching)
    bm = BlockManager(25, 4, prefix_caching)          # small: preemptions happen
    sched = Scheduler(cfg, bm, max_model_len=120, eos_token_ids={0})
    runner = CachedRequests()
    shared = [rng.randrange(1, 9) for _ in range(9)]   # a common prefix: cache hits
    n_req, verified, gave_back = 0, 0, 0
    for _ in range(3000):
        if rng.random() < 0.3:
            prompt = shared[:rng.randrange(0, 9)] + [rng.randrange(1, 9) for _ in range(rng.randrange(1, 12))]
            sched.add(Sequence(f"r{n_req}", prompt, SamplingParams(max_tokens=rng.randrange(1, 80),
                                                                   stop_token_ids=[9])))
            n_req += 1
        for seq in sched.running:       # random drafts for those that decode next
            if seq.num_output_tokens and seq.num_computed_tokens == seq.num_tokens - 1:
                seq.spec_token_ids = [rng.randrange(1, 9) for _ in range(rng.randrange(0, 6))]
        out = sched.schedule(now=0)
        if out.is_empty:
            continue
        runner.update_from(out)
        held = sum(len(s.block_table) for s in sched.requests.values())
        sched.update_after_step(out)
        seqs, toks = [], []
        for s in out.scheduled:
            # the runner's copy of each table is the scheduler's
            assert runner[s.req_id].block_ids == sched.requests[s.req_id].block_table
            if not s.will_sample:
                continue
            a = rng.randrange(0, len(s.spec_token_ids) + 1)
            verified += bool(s.spec_token_ids)
            seqs.append(sched.requests[s.req_id])
            toks.append(s.spec_token_ids[:a] + [rng.randrange(0, 40)])
        sched.update_from_output(seqs, toks)
        gave_back += held > sum(len(s.block_table) for s in sched.requests.values())
        for s in list(sched.running):   # now and then an abort
            if rng.random() < 0.01:
                sched.finish(s, "abort")
        check_pool(bm, sched)
    for s in list(sched.requests.values()):
        sched.finish(s, "abort")
    assert n_req > 800 and verified > 1000 and gave_back > 100 and sched.num_preemptions > 0
    assert bm.num_free_blocks == bm.num_usable_blocks
    assert all(b.ref_count == 0 for b in bm.blocks)


def test_drafts_count_in_the_budget_and_never_preempt():
    cfg = EngineConfig(max_num_seqs=4, max_num_batched_tokens=6)
    bm = BlockManager(4, 4)                  # 3 usable blocks
    sched = Scheduler(cfg, bm, max_model_len=64)
    a = Sequence("a", [1, 2, 3], SamplingParams(max_tokens=20))
    sched.add(a)
    out = sched.schedule(now=0)
    sched.update_after_step(out)
    sched.update_from_output([a], [[4]])
    a.spec_token_ids = [5, 6, 7, 8, 9, 10, 11]
    out = sched.schedule(now=0)
    (row,) = out.scheduled
    assert row.is_decode and row.spec_token_ids == [5, 6, 7, 8, 9] and row.num_new_tokens == 6
    assert out.num_decode_tokens == 6 and out.num_draft_tokens == 5 and out.phase == "decode"
    sched.update_after_step(out)
    assert a.num_computed_tokens == 4            # the drafts' K/V is not counted yet
    sched.update_from_output([a], [[5, 6, 42]])  # two accepted, then the target's own
    assert a.token_ids[-3:] == [5, 6, 42] and a.num_computed_tokens == 6
    assert len(a.block_table) == 2               # the block of the rejected drafts went back
    # a pool too small for the drafts: a plain decode, nobody preempted
    b = Sequence("b", [7, 7], SamplingParams(max_tokens=20))
    sched.add(b)
    out = sched.schedule(now=0)
    assert [s.num_new_tokens for s in out.scheduled] == [1, 2]
    sched.update_after_step(out)
    sched.update_from_output([a, b], [[8], [9]])
    assert bm.num_free_blocks == 0
    a.spec_token_ids = [1, 2, 3, 4]
    out = sched.schedule(now=0)
    assert [s.spec_token_ids for s in out.scheduled] == [[], []] and not out.preempted
    assert a.spec_token_ids == []


# ---- the rejection sampler: exact, against float64 ---------------------------------------------
V = 16
PARAMS = dict(temperature=0.8, top_k=9, top_p=0.9, min_p=0.02, repetition_penalty=1.3,
              frequency_penalty=0.3, presence_penalty=0.2, logit_bias={3: 1.5}, seed=None)


def reference(logits: torch.Tensor, p: SamplingParams, prompt, output) -> np.ndarray:
    """The target's distribution after every filter, in float64, written from the
    definitions (vLLM's): logit_bias, repetition (prompt and output tokens), frequency and
    presence (output tokens), temperature, min-p, top-k, then top-p over what they keep."""
    x = logits.double().numpy().copy()
    for t, b in (p.logit_bias or {}).items():
        x[t] += b
    for t in set(prompt) | set(output):
        x[t] = x[t] / p.repetition_penalty if x[t] > 0 else x[t] * p.repetition_penalty
    for t in set(output):
        x[t] -= p.frequency_penalty * output.count(t) + p.presence_penalty
    q = np.exp((x - x.max()) / p.temperature)
    q /= q.sum()
    q[q < p.min_p * q.max()] = 0
    order = np.argsort(-q, kind="stable")
    q[order[p.top_k:]] = 0
    mass, before, keep = q.sum(), 0.0, np.zeros(V, bool)
    for t in order:
        if q[t] == 0 or before >= p.top_p * mass:
            break
        keep[t] = True
        before += q[t]
    q[~keep] = 0
    return q / q.sum()


def verify_many(n: int, logits: torch.Tensor, params: SamplingParams, prompt, output, draft,
                seed: int = 0):
    """n requests alike, each drafting `draft` then verified over 2 positions, in one batch."""
    rows, spans = [], []
    for i in range(n):
        spans.append((2 * i, 2))
        rows += [SamplingRow(params, prompt + output, len(prompt)),
                 SamplingRow(params, prompt + output + [draft], len(prompt))]
    md = sampling_metadata(rows, V)
    big = logits.repeat(n, 1)
    gen = torch.Generator().manual_seed(seed)
    tokens, _, _ = rs.rejection_sample(big, md, spans, [[draft]] * n, [False] * n, [None] * n, gen)
    return tokens


def tv(counts: np.ndarray, p: np.ndarray) -> float:
    return 0.5 * np.abs(counts / counts.sum() - p).sum()


@pytest.fixture(scope="module")
def case():
    torch.manual_seed(3)
    logits = torch.randn(2, V) * 2
    params = SamplingParams(**PARAMS)
    prompt, output = [1, 2, 3, 1], [5, 2]
    p0 = reference(logits[0], params, prompt, output)
    draft = int(np.argsort(-p0)[1])      # a likely token, not the likeliest
    p1 = reference(logits[1], params, prompt, output + [draft])
    assert 0.1 < p0[draft] < 0.6 and not np.allclose(p0, p1)
    return logits, params, prompt, output, draft, p0, p1


N = 20000
BOUND = 0.02
"""TV distance allowed between N draws' frequencies and the target (~0.005 expected over
about eight tokens; the mutated rules below miss by 0.15 and more)."""


def first_and_bonus(tokens, draft):
    first = np.bincount([t[0] for t in tokens], minlength=V)
    bonus = np.bincount([t[1] for t in tokens if len(t) == 2], minlength=V)
    return first, bonus


def test_rejection_sampling_keeps_the_targets_distribution(case):
    logits, params, prompt, output, draft, p0, p1 = case
    tokens = verify_many(N, logits, params, prompt, output, draft)
    first, bonus = first_and_bonus(tokens, draft)
    assert tv(first, p0) < BOUND, (first / N, p0)
    # accepted at the rate p0(draft), and then the bonus token follows p1 (history + draft)
    assert abs(first[draft] / N - p0[draft]) < 0.015
    assert all(len(t) == 2 for t in tokens if t[0] == draft)
    assert tv(bonus, p1) < 2 * BOUND, (bonus / bonus.sum(), p1)


@pytest.mark.parametrize("mutation", ["always_accept", "residual_keeps_the_draft"])
def test_a_wrong_acceptance_rule_fails_the_same_bound(case, monkeypatch, mutation):
    logits, params, prompt, output, draft, p0, _ = case
    if mutation == "always_accept":
        monkeypatch.setattr(rs, "accept", lambda u, px, qx: torch.ones_like(px, dtype=torch.bool))
    else:
        monkeypatch.setattr(rs, "residual", lambda probs, rows, drafts, q_rows, q: probs)
    first, _ = first_and_bonus(verify_many(N, logits, params, prompt, output, draft), draft)
    assert tv(first, p0) > 4 * BOUND


def verify_drawn(n: int, logits: torch.Tensor, params: SamplingParams, prompt, output,
                 q: np.ndarray, seed: int = 0):
    """n requests alike, each drafting a token drawn from q (a draft model's own
    distribution, passed as draft_probs), verified over 2 positions, in one batch."""
    drafts = np.random.default_rng(seed).choice(V, size=n, p=q).tolist()
    rows, spans = [], []
    for i, d in enumerate(drafts):
        spans.append((2 * i, 2))
        rows += [SamplingRow(params, prompt + output, len(prompt)),
                 SamplingRow(params, prompt + output + [d], len(prompt))]
    md = sampling_metadata(rows, V)
    gen = torch.Generator().manual_seed(seed)
    qt = torch.tensor(q, dtype=torch.float32)[None]
    tokens, _, acc = rs.rejection_sample(logits.repeat(n, 1), md, spans, [[d] for d in drafts],
                                         [False] * n, [None] * n, gen, [qt] * n)
    return tokens, acc


@pytest.fixture(scope="module")
def draft_q(case):
    """A draft's distribution near the target's and not it: p0 at a higher temperature,
    with mass on tokens the target's filters drop."""
    *_, p0, _ = case
    q = (p0 + 0.02) ** 0.6
    return q / q.sum()


def test_drafts_drawn_from_the_drafts_distribution_keep_the_targets(case, draft_q):
    """A sampled request's drafts drawn from the draft model's q: each kept with probability
    min(1, p/q), the rejected ones replaced from max(p - q, 0): the first token still follows
    p0, and drafts stay at the rate sum(min(p, q)) (not p(x): a one-hot q's)."""
    logits, params, prompt, output, draft, p0, _ = case
    tokens, acc = verify_drawn(N, logits, params, prompt, output, draft_q)
    first, _ = first_and_bonus(tokens, draft)
    assert tv(first, p0) < BOUND, (first / N, p0)
    assert abs(sum(acc) / N - np.minimum(p0, draft_q).sum()) < 0.015


@pytest.mark.parametrize("mutation", ["one_hot_acceptance", "residual_without_q"])
def test_a_rule_that_ignores_the_drafts_distribution_fails(case, draft_q, monkeypatch,
                                                           mutation):
    logits, params, prompt, output, draft, p0, _ = case
    if mutation == "one_hot_acceptance":
        monkeypatch.setattr(rs, "accept", lambda u, px, qx: u < px)
    else:
        one_hot = rs.residual
        monkeypatch.setattr(rs, "residual", lambda probs, rows, drafts, q_rows, q:
                            one_hot(probs, rows, drafts, q_rows[:0], q[:0]))
    first, _ = first_and_bonus(verify_drawn(N, logits, params, prompt, output, draft_q)[0],
                               draft)
    assert tv(first, p0) > 4 * BOUND


def test_greedy_verification_is_the_longest_matching_prefix_and_the_argmax():
    torch.manual_seed(0)
    logits = torch.randn(4, V)
    am = logits.argmax(-1).tolist()
    greedy = SamplingParams(temperature=0)
    md = sampling_metadata([SamplingRow(greedy, [1], 1)] * 4, V)
    for drafts, want in [(am[:3], am[:4]), ([am[0], (am[1] + 1) % V, am[2]], am[:2]),
                         ([(am[0] + 1) % V, am[1], am[2]], am[:1])]:
        tokens, _, acc = rs.rejection_sample(logits, md, [(0, 4)], [drafts], [True], [None])
        assert tokens == [want] and acc == [len(want) - 1]


def test_seeded_requests_draw_the_same_whatever_shares_the_batch(case):
    logits, _, prompt, output, draft, _, _ = case
    seeded = SamplingParams(temperature=1.0, seed=5)
    plain = SamplingParams(temperature=1.0)

    def run(others: int) -> list[int]:
        rows, spans, drafts, gens = [], [], [], []
        for i in range(others + 1):
            p = seeded if i == others else plain
            spans.append((2 * i, 2))
            rows += [SamplingRow(p, prompt, len(prompt)), SamplingRow(p, prompt + [draft], len(prompt))]
            drafts.append([draft])
            gens.append(torch.Generator().manual_seed(5) if i == others else None)
        md = sampling_metadata(rows, V)
        tokens, _, _ = rs.rejection_sample(logits.repeat(others + 1, 1), md, spans, drafts,
                                           [False] * (others + 1), gens,
                                           torch.Generator().manual_seed(others))
        return tokens[-1]
    assert run(0) == run(3) == run(7)


def test_a_mixed_verify_gives_each_request_what_it_gets_alone(case, draft_q):
    """Greedy requests among seeded sampled ones, with picked and drawn (q) drafts, in one
    verify: each keeps what it keeps verified alone (greedy requests' rows get no dense row,
    so the sampled ones' rows are found among the drawn rows alone)."""
    logits, params, prompt, output, draft, _, _ = case
    greedy, seeded = SamplingParams(temperature=0), SamplingParams(**{**PARAMS, "seed": 5})
    qt = torch.tensor(draft_q, dtype=torch.float32)[None]
    reqs = [(greedy, None), (seeded, None), (greedy, None), (seeded, qt)]

    def run(which: list[int]) -> dict[int, tuple]:
        rows, spans, drafts, gens, qs = [], [], [], [], []
        for i in which:
            p, q = reqs[i]
            spans.append((len(rows), 2))
            rows += [SamplingRow(p, prompt + output, len(prompt)),
                     SamplingRow(p, prompt + output + [draft], len(prompt))]
            drafts.append([draft])
            gens.append(None if p.greedy else torch.Generator().manual_seed(5 + i))
            qs.append(q)
        tokens, _, acc = rs.rejection_sample(
            logits.repeat(len(which), 1), sampling_metadata(rows, V), spans, drafts,
            [reqs[i][0].greedy for i in which], gens, torch.Generator().manual_seed(0), qs)
        return dict(zip(which, zip(map(tuple, tokens), acc)))
    alone = {i: run([i])[i] for i in range(4)}
    assert run([0, 1, 2, 3]) == alone and run([3, 2, 1, 0]) == alone
