"""The draft-model proposer (workbench/spec_decode/draft_model.py): its proposals are the draft
model's own greedy tokens, batched or alone; it keeps each request's K/V between calls and
recomputes only after the longest prefix it still shares (its own, or a cached one of an
earlier request's); its pool gives every block back;
bad drafts are refused by name. The SmolLM2 check prints what a quantized self-draft's
proposals are worth (acceptance against the fp32 target's greedy tokens, and their cost)."""
from __future__ import annotations

import logging
import os
import random
import statistics
import time

import pytest
import torch

from workbench import Engine, SamplingParams
from workbench.spec_decode.draft_model import DraftModelProposer

TINY = "random:tiny"                 # vocab 512


def greedy(engine, prompts, n):
    p = SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)
    return [o.token_ids for o in engine.generate(prompts, p)]


def proposer(model=TINY, k=4, max_model_len=256, max_num_seqs=8, vocab=512, tokenizer=None,
             **extra):
    return DraftModelProposer({"model": model, **extra}, vocab, tokenizer, "cpu", k,
                              max_model_len, max_num_seqs)


def prompts_of(count, seed=0, lo=5, hi=60):
    rng = random.Random(seed)
    return [[rng.randrange(1, 512) for _ in range(rng.randrange(lo, hi))] for _ in range(count)]


def fed_tokens(p):
    """Record, per draft step, {request: tokens fed} (wraps the proposer's runner)."""
    steps = []
    execute = p.runner.execute

    def spy(out, *a, **kw):
        steps.append({s.req_id: s.num_new_tokens for s in out.scheduled})
        return execute(out, *a, **kw)
    p.runner.execute = spy
    return steps


@pytest.fixture(scope="module")
def tiny_engine():
    return Engine(model=TINY, device="cpu", max_model_len=256)


@pytest.fixture(scope="module")
def tiny():
    return proposer()


def test_proposals_are_the_drafts_greedy_tokens_in_a_batch_and_alone(tiny_engine, tiny):
    prompts = prompts_of(5, seed=1)
    want = greedy(tiny_engine, prompts, 12)
    steps = fed_tokens(tiny)
    batch = tiny.propose([(f"b{i}", p) for i, p in enumerate(prompts)])
    assert batch == [w[:4] for w in want]
    # One batch per draft step: the catch-up prefill of all five, then k-1 decodes of all.
    assert len(steps) == 4 and steps[0] == {f"b{i}": len(p) for i, p in enumerate(prompts)}
    assert all(s == {f"b{i}": 1 for i in range(5)} for s in steps[1:])
    assert tiny.longest_catch_up == max(map(len, prompts))     # a prefill: not a verify's cost
    alone = proposer()
    assert [alone.propose([(f"a{i}", p)])[0] for i, p in enumerate(prompts)] == batch
    # The target accepted every draft and added its own token: the draft goes on from the
    # K/V it has (only the new tokens are fed) and still proposes its greedy tokens.
    steps.clear()
    grown = [p + w[:5] for p, w in zip(prompts, want)]
    assert tiny.propose([(f"b{i}", g) for i, g in enumerate(grown)]) == [w[5:9] for w in want]
    assert steps[0] == {f"b{i}": 2 for i in range(5)}       # the last draft and the bonus
    assert tiny.longest_catch_up == 2
    for i in range(5):
        tiny.free(f"b{i}")
    assert tiny.num_free_blocks == tiny.num_usable_blocks


def test_catch_up_after_replaced_tokens_equals_a_fresh_proposer(tiny):
    prompts = prompts_of(4, seed=2, lo=20)
    first = tiny.propose([(f"r{i}", p) for i, p in enumerate(prompts)])
    # Each request changes differently: drafts rejected after the first (a replaced token),
    # none accepted, its prompt's last tokens edited, or shortened below what was computed.
    changed = [prompts[0] + [first[0][0], (first[0][1] + 1) % 512],
               prompts[1] + [(first[1][0] + 7) % 512],
               prompts[2][:-3] + [11, 12, 13],
               prompts[3][:10]]
    steps = fed_tokens(tiny)
    got = tiny.propose([(f"r{i}", c) for i, c in enumerate(changed)])
    fresh = proposer()
    assert got == [fresh.propose([(f"f{i}", c)])[0] for i, c in enumerate(changed)]
    # Only what differs from the computed tokens is fed again.
    assert steps[0] == {"r0": 1, "r1": 1, "r2": 3, "r3": 1}
    for i in range(4):
        tiny.free(f"r{i}")
    assert tiny.num_free_blocks == tiny.num_usable_blocks


def test_a_sampled_requests_drafts_are_drawn_from_the_drafts_filtered_distribution(tiny_engine):
    """A sampled request's drafts are drawn (its own generator where it is seeded, the same
    draws again from the same seed), each from the distribution kept in draft_probs: one row
    per draft, normalised, only the tokens its top-k keeps, the drawn one among them; a
    greedy request beside it still gets its greedy tokens, and no distribution."""
    from workbench.executor.sampling_metadata import SamplingRow
    prompts = prompts_of(2, seed=9)
    params = SamplingParams(temperature=0.8, top_k=20, seed=3)

    def drawn(p):
        row = SamplingRow(params, prompts[1], len(prompts[1]), torch.Generator().manual_seed(3))
        return p.propose([("g", prompts[0]), ("s", prompts[1])], [None, row],
                         torch.Generator().manual_seed(0))
    p = proposer()
    got = drawn(p)
    assert got[0] == greedy(tiny_engine, prompts[:1], 4)[0] and set(p.draft_probs) == {"s"}
    q = p.draft_probs["s"]
    assert q.shape == (4, 512) and torch.allclose(q.sum(-1), torch.ones(4))
    assert ((q > 0).sum(-1) <= 20).all() and all(q[j, t] > 0 for j, t in enumerate(got[1]))
    assert drawn(proposer()) == got
    draws = {tuple(got[1])} | {
        tuple(proposer().propose([("s", prompts[1])], [SamplingRow(
            params, prompts[1], len(prompts[1]), torch.Generator().manual_seed(s))])[0])
        for s in range(4, 12)}
    assert len(draws) > 1                       # drawn, not the argmax every time


@pytest.mark.parametrize("caching", [True, False])
def test_a_new_request_starts_on_the_cached_prefix_of_an_earlier_one(caching):
    """The draft's pool caches full blocks of a request's own tokens, as the target's does
    (where the engine caches prefixes): a later request with the same start feeds only the
    rest, and drafts what a fresh proposer does."""
    p = DraftModelProposer({"model": TINY}, 512, None, "cpu", 4, 256, 8,
                           enable_prefix_caching=caching)
    bs = p.block_manager.block_size
    doc = prompts_of(1, seed=7, lo=3 * bs + 5, hi=3 * bs + 6)[0]
    p.propose([("x", doc)])
    asked = doc[:2 * bs + 3] + [3, 4, 5]                 # the same start, another question
    steps = fed_tokens(p)
    got = p.propose([("y", asked)])
    assert got == proposer().propose([("z", asked)])
    cached = 2 * bs if caching else 0                    # the blocks full of the same tokens
    assert steps[0] == {"y": len(asked) - cached} and p.longest_catch_up == len(asked) - cached
    p.free("x")
    p.free("y")
    assert p.num_free_blocks == p.num_usable_blocks


def test_near_max_model_len_fewer_proposals_then_none(tiny):
    # max_model_len 256: a request of n tokens can grow by 256 - n, the target's own token
    # after the drafts among them.
    for n, k in ((200, 4), (252, 3), (254, 1), (255, 0), (256, 0)):
        tokens = prompts_of(1, seed=n, lo=n, hi=n + 1)[0]
        assert len(tiny.propose([("edge", tokens)])[0]) == k
        tiny.free("edge")
    assert tiny.num_free_blocks == tiny.num_usable_blocks
    # A draft with fewer positions (random:tiny's 2048) than the target's 4096: its K/V stops
    # at its last position, and past it it proposes nothing.
    short = proposer(max_model_len=4096, max_num_seqs=1)
    assert short.draft_len == 2048
    for n, k in ((2040, 4), (2046, 3), (2048, 1), (2049, 0)):
        tokens = prompts_of(1, seed=n, lo=n, hi=n + 1)[0]
        assert len(short.propose([("edge", tokens)])[0]) == k
    short.free("edge")
    assert short.num_free_blocks == short.num_usable_blocks


def test_a_failed_step_loses_no_block_and_no_request_goes_wrong(tiny):
    prompts = prompts_of(3, seed=5)
    want = proposer().propose([(str(i), p) for i, p in enumerate(prompts)])
    tiny.propose([("0", prompts[0])])
    execute, calls = tiny.runner.execute, []

    def failing(out, *a, **kw):
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("the device failed")
        return execute(out, *a, **kw)
    tiny.runner.execute = failing
    with pytest.raises(RuntimeError, match="device failed"):
        tiny.propose([(str(i), p) for i, p in enumerate(prompts)])
    tiny.runner.execute = execute
    assert tiny.num_free_blocks == tiny.num_usable_blocks
    assert tiny.propose([(str(i), p) for i, p in enumerate(prompts)]) == want
    for i in range(3):
        tiny.free(str(i))


def test_kv_pool_comes_back_full_after_random_rounds(caplog):
    """Many random rounds of propose, accept some, replace, free, with a pool too small for
    all of them: requests that do not fit get [] (said once), no block is held by two
    requests, and everything comes back."""
    p = proposer(k=3, num_kv_blocks=12, max_num_seqs=6)        # 11 blocks of 16 tokens
    rng = random.Random(3)
    live: dict[str, list[int]] = {}
    empty = 0
    with caplog.at_level(logging.WARNING, logger="workbench"):
        for rnd in range(60):
            while len(live) < 6:
                live[f"q{rnd}-{len(live)}"] = prompts_of(1, rng.randrange(10**6), 3, 40)[0]
            ids = rng.sample(sorted(live), rng.randrange(1, len(live) + 1))
            props = p.propose([(r, live[r]) for r in ids])
            for r, prop in zip(ids, props):
                empty += not prop
                keep = prop[:rng.randrange(len(prop) + 1)]
                live[r] = live[r] + keep + [rng.randrange(1, 512)]
                if rng.random() < 0.2:                 # the target replaced its last tokens
                    live[r] = live[r][:-rng.randrange(1, 4)] + [rng.randrange(1, 512)]
            held = [b for st in p._reqs.values() for b in st.block_ids]
            assert len(held) == len(set(held)) and len(held) + p.num_free_blocks == 11
            for r in list(live):
                if len(live[r]) > 120 or rng.random() < 0.15:
                    p.free(r)
                    del live[r]
    assert empty > 0, "the pool never ran out: the test does not exercise it"
    assert sum("KV pool" in r.getMessage() for r in caplog.records) == 1
    for r in live:
        p.free(r)
    assert p.num_free_blocks == p.num_usable_blocks and not p._reqs
    # Still right after all that.
    prompts = prompts_of(3, seed=9)
    assert p.propose([(str(i), q) for i, q in enumerate(prompts)]) == \
        [proposer(k=3).propose([("x", q)])[0] for q in prompts]


def test_bad_drafts_are_refused_by_name(tmp_path):
    with pytest.raises(ValueError, match=r"512 tokens.*1000"):
        proposer(vocab=1000)
    missing = str(tmp_path / "no-such-model")
    with pytest.raises(ValueError, match="cannot load the draft model.*no-such-model"):
        proposer(model=missing)
    with pytest.raises(ValueError, match="speculative_config.model"):
        DraftModelProposer({}, 512, None, "cpu", 4, 256, 8)


def test_a_config_object_and_a_torch_device_do_as_the_dict_and_the_name(tiny):
    from types import SimpleNamespace
    spec = SimpleNamespace(method="draft_model", model=TINY, dtype=None, quantization=None)
    p = DraftModelProposer(spec, 512, None, torch.device("cpu"), 4, 256, 8)
    prompts = prompts_of(2, seed=8)
    assert p.propose([("a", prompts[0]), ("b", prompts[1])]) == \
        tiny.propose([("x", prompts[0]), ("y", prompts[1])])
    for rid in "xy":
        tiny.free(rid)


def test_a_different_tokenizer_is_refused(smollm2_dir):
    from transformers import AutoTokenizer
    from workbench.spec_decode.draft_model import tokenizer_difference
    a = AutoTokenizer.from_pretrained(smollm2_dir)
    b = AutoTokenizer.from_pretrained(smollm2_dir)
    assert tokenizer_difference(a, b) is None and tokenizer_difference(a, None) is None
    b.eos_token = "<|endoftext|>" if a.eos_token != "<|endoftext|>" else "<|im_start|>"
    assert "eos_token_id" in tokenizer_difference(a, b)
    with pytest.raises(ValueError, match="different tokenizer.*eos_token_id"):
        DraftModelProposer({"model": "smollm2", "quantization": "gguf"}, 49152, b, "cpu", 4,
                           512, 4)


CHATS = ["Tell me a short story about a lighthouse keeper.",
         "What do you think makes a good friend?"]


@pytest.fixture
def one_thread():
    """One torch thread for the test: on a shared 2-core machine two threads that wait for
    each other make every step many times slower (and the figures noise)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def test_smollm2_gguf_a8_drafting_for_its_fp32_self(smollm2_dir, smollm2_tokenizer, one_thread):
    """What the engine will see from a quantized self-draft: the share of its k=4 greedy
    proposals the fp32 target keeps (greedy acceptance: the longest prefix equal to the
    target's own tokens) on open-ended chat prompts, and a propose's cost against one fp32
    decode step at batch 1, both on one thread. Printed, not asserted: figures, not a speed
    test."""
    tok = smollm2_tokenizer
    prompts = [tok.apply_chat_template([{"role": "user", "content": c}],
                                       add_generation_prompt=True, tokenize=False) for c in CHATS]
    prompts = [tok(p, add_special_tokens=False)["input_ids"] for p in prompts]
    n = 16
    target = Engine(model="smollm2", device="cpu", quantization=None, max_model_len=512,
                    max_num_seqs=4)
    want = greedy(target, prompts, n + 4)
    greedy(target, prompts[:1], 8)              # alone: its decode steps are at batch 1
    decode_s = statistics.median(s.duration for s in target.telemetry.snapshot()[0][-7:]
                                 if s.phase == "decode")
    del target
    draft = DraftModelProposer({"model": "smollm2", "quantization": "gguf-a8"}, 49152, tok,
                               "cpu", 4, 512, 4)
    assert draft.quantization == "gguf-a8"
    drafted = accepted = verify_steps = 0
    times = []
    for i, (prompt, out) in enumerate(zip(prompts, want)):
        done = 0
        while done < n:          # the verify loop, the target's tokens taken from `want`
            t0 = time.perf_counter()
            prop = draft.propose([(str(i), prompt + out[:done])])[0]
            if done:
                times.append(time.perf_counter() - t0)
            assert len(prop) == 4
            keep = 0
            while keep < len(prop) and prop[keep] == out[done + keep]:
                keep += 1
            drafted, accepted, verify_steps = drafted + len(prop), accepted + keep, \
                verify_steps + 1
            done += keep + 1
        draft.free(str(i))
    assert draft.num_free_blocks == draft.num_usable_blocks
    assert accepted > 0 and drafted == 4 * verify_steps
    propose_s = statistics.median(times)
    print(f"\nSmolLM2 gguf-a8 drafting for fp32, k=4, {len(prompts)} chat prompts: "
          f"{accepted}/{drafted} drafts accepted ({accepted / drafted:.0%}), "
          f"{(accepted + verify_steps) / verify_steps:.2f} tokens per verify step; "
          f"propose k=4 at batch 1 {propose_s * 1e3:.1f} ms (median, after the first), "
          f"one fp32 decode step at batch 1 {decode_s * 1e3:.1f} ms (median): "
          f"{propose_s / decode_s:.2f} steps ({torch.get_num_threads()} threads, load average "
          f"{os.getloadavg()[0]:.1f} on {os.cpu_count()} cores)")
