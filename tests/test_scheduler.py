"""Scheduler policy, unit-tested with no model: budgets, chunking, FIFO, preemption, knobs."""
from __future__ import annotations

import random

import pytest

from workbench.core.block_manager import BlockManager
from workbench.config import EngineConfig
from workbench.core.sampling_params import SamplingParams
from workbench.core.scheduler import Scheduler
from workbench.core.sequence import Sequence


def make(num_blocks=64, block_size=16, **kw):
    """A scheduler over a pool of num_blocks usable blocks (and the null block)."""
    cfg = EngineConfig(**kw)   # the block size lives in the block manager
    bm = BlockManager(num_blocks + 1, block_size, cfg.enable_prefix_caching)
    return Scheduler(cfg, bm, max_model_len=4096), bm


def add(s, rid, n, arrival=0.0, max_tokens=100):
    seq = Sequence(rid, list(range(1000 * len(s.waiting) + 1, 1000 * len(s.waiting) + 1 + n)),
                   SamplingParams(max_tokens=max_tokens), arrival_time=arrival)
    s.add(seq)
    return seq


def run_step(s, out, token=7):
    """What the engine does after the model: advance, then take in a token where sampled
    (the scheduler appends it and finishes what stops)."""
    s.update_after_step(out)
    seqs = [s.requests[x.req_id] for x in out.scheduled if x.will_sample]
    return s.update_from_output(seqs, [[token]] * len(seqs))


def test_prefill_then_decode():
    s, _ = make()
    a = add(s, "a", 20)
    out = s.schedule(now=0)
    assert out.phase == "prefill" and out.scheduled[0].num_new_tokens == 20
    run_step(s, out)
    out = s.schedule(now=0)
    assert out.phase == "decode" and out.num_decode_tokens == 1
    assert a.num_computed_tokens == 20


def test_token_budget_chunks_long_prompt_and_mixes_with_decode():
    s, _ = make(max_num_batched_tokens=64, max_num_seqs=4)
    a = add(s, "a", 10)
    run_step(s, s.schedule(now=0))                 # a prefilled
    add(s, "b", 150)
    out = s.schedule(now=0)
    assert out.phase == "mixed"
    assert [x.num_new_tokens for x in out.scheduled] == [1, 63]
    run_step(s, out)
    out = s.schedule(now=0)
    assert [x.num_new_tokens for x in out.scheduled] == [1, 63]
    assert not out.scheduled[1].will_sample           # b's prompt is not done yet
    run_step(s, out)
    out = s.schedule(now=0)
    assert [x.num_new_tokens for x in out.scheduled] == [1, 24] and out.scheduled[1].will_sample
    assert a.num_computed_tokens == 12


def test_no_chunking_waits_for_budget():
    s, _ = make(max_num_batched_tokens=64, max_num_seqs=4, enable_chunked_prefill=False)
    add(s, "a", 50)
    add(s, "b", 30)
    out = s.schedule(now=0)
    assert [x.req_id for x in out.scheduled] == ["a"]   # b would overflow the step


def test_max_num_seqs_caps_running():
    s, _ = make(max_num_seqs=2)
    for i in range(5):
        add(s, f"r{i}", 8)
    out = s.schedule(now=0)
    assert len(out.scheduled) == 2 and len(s.waiting) == 3


def test_fifo_head_blocks_the_queue():
    s, bm = make(num_blocks=4, block_size=16)
    add(s, "big", 100)          # needs 7 blocks: never fits while the pool has 4
    add(s, "small", 5)
    out = s.schedule(now=0)
    assert out.is_empty and [q.request_id for q in s.waiting] == ["big", "small"]
    assert bm.num_used_blocks == 0


@pytest.mark.parametrize("mode,victim", [("newest", "c"), ("oldest", "a"), ("largest", "b")])
def test_preemption_policy(mode, victim):
    # Pool of 4 blocks of 4: a (4 tokens) takes 1, b (6) takes 2, c (3) takes 1. At the first
    # decode a needs a second block and none is free: the policy picks who gives way.
    s, bm = make(num_blocks=4, block_size=4, preemption_mode=mode)
    add(s, "a", 4)
    add(s, "b", 6)
    add(s, "c", 3)
    run_step(s, s.schedule(now=0))
    assert bm.num_free_blocks == 0
    out = s.schedule(now=0)
    assert out.preempted == [victim]
    v = s.requests[victim]
    assert v.num_computed_tokens == 0 and v.block_table == [] and v.num_preemptions == 1
    assert s.waiting[0] is v                       # back at the head of the queue
    assert victim not in [x.req_id for x in out.scheduled]


@pytest.mark.parametrize("prefix", [False, True])
def test_preempted_request_is_recomputed_with_its_output(prefix):
    s, bm = make(num_blocks=3, block_size=4, enable_prefix_caching=prefix)
    a = add(s, "a", 4)
    b = add(s, "b", 4)
    for _ in range(12):
        out = s.schedule(now=0)
        run_step(s, out)
        if s.num_preemptions:
            break
    assert s.num_preemptions == 1
    victim = b
    assert victim.status.value == "waiting" and victim.num_output_tokens >= 1
    s.finish(a, "length")
    out = s.schedule(now=0)
    (x,) = out.scheduled
    # Recompute covers prompt + generated tokens; with prefix caching its full first block
    # (freed as cached at preemption) is reused.
    cached = 4 if prefix else 0
    assert x.req_id == victim.request_id and x.start == cached and x.will_sample
    assert x.num_new_tokens == victim.num_tokens - cached
    s.finish(victim, "length")
    assert bm.num_used_blocks == 0


def test_prefill_interval_protects_decode():
    s, _ = make(prefill_interval=3, max_num_seqs=8)
    add(s, "a", 8)
    run_step(s, s.schedule(now=0))
    phases = []
    for i in range(7):
        add(s, f"n{i}", 8)
        out = s.schedule(now=0)
        phases.append(out.phase)
        run_step(s, out)
    assert phases[:6] == ["decode", "decode", "mixed", "decode", "decode", "mixed"]


def test_waiting_timeout_holds_a_small_batch():
    s, _ = make(waiting_timeout_ms=50, max_num_seqs=4)
    add(s, "a", 8, arrival=0.0)
    assert s.schedule(now=0.01).is_empty
    assert s.next_wakeup(now=0.01) == pytest.approx(0.04)
    assert len(s.schedule(now=0.06).scheduled) == 1
    s2, _ = make(waiting_timeout_ms=50, max_num_seqs=2)
    add(s2, "a", 8, arrival=0.0)
    add(s2, "b", 8, arrival=0.0)
    assert len(s2.schedule(now=0.001).scheduled) == 2     # batch already full: no waiting


def test_random_workload_accounting_balances():
    """Finish, abort and preempt at random; blocks must all come back."""
    rng = random.Random(0)
    s, bm = make(num_blocks=24, block_size=8, max_num_batched_tokens=64, max_num_seqs=6)
    live = {}
    for i in range(40):
        live[f"r{i}"] = add(s, f"r{i}", rng.randint(1, 60), max_tokens=rng.randint(1, 30))
    for _ in range(2000):
        if not s.has_unfinished():
            break
        out = s.schedule(now=0)
        run_step(s, out)
        if rng.random() < 0.05 and s.running:
            s.finish(rng.choice(s.running), "abort")
        if rng.random() < 0.05 and s.waiting:
            s.finish(rng.choice(list(s.waiting)), "abort")
        assert bm.num_used_blocks == sum(
            1 for b in bm.blocks if b.ref_count > 0)
    assert not s.has_unfinished()
    assert s.num_preemptions > 0
    st = bm.stats()
    assert st.used == 0 and st.free == 24


def test_prefix_hits_counted_once_per_admission():
    s, bm = make(num_blocks=6, block_size=4)
    a = Sequence("a", list(range(100, 109)), SamplingParams())
    s.add(a)
    run_step(s, s.schedule(now=0))
    s.finish(a, "length")                        # its two full blocks stay cached
    hog = Sequence("hog", list(range(200, 212)), SamplingParams())
    s.add(hog)                                   # takes three of the four plain blocks
    run_step(s, s.schedule(now=0))
    b = Sequence("b", list(range(100, 108)) + [5, 5, 5, 5, 5], SamplingParams())
    s.add(b)
    for _ in range(3):                           # b waits: no room for its new tokens
        out = s.schedule(now=0)
        assert "b" not in [x.req_id for x in out.scheduled]
        run_step(s, out)
    assert bm.hits == 0
    s.finish(hog, "abort")
    out = s.schedule(now=0)
    assert [x.req_id for x in out.scheduled] == ["b"] and out.num_cached_tokens == 8
    assert (bm.hits, bm.queries) == (2, 2 + 2 + 3)   # a, hog and b each looked up once


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_the_runner_follows_each_request_from_the_changes_alone(seed):
    """The scheduler's output says only what changed (vLLM's new and cached request data);
    a runner that applies those changes to its own copy (CachedRequests) holds, at every
    step, exactly each scheduled request's tokens, blocks and computed count, through
    preemption, prefix hits, aborts, forked choices and steps scheduled ahead of their
    tokens (async scheduling). A change left out of the output fails this."""
    from workbench.executor.runner import CachedRequests
    rng = random.Random(seed)
    s, bm = make(num_blocks=20, block_size=4, max_num_batched_tokens=32, max_num_seqs=5)
    batch = CachedRequests()
    shared = list(range(500, 508))
    for i in range(24):
        prompt = (shared if i % 3 == 0 else []) + [rng.randrange(10, 400)
                                                   for _ in range(rng.randint(1, 20))]
        s.add(Sequence(f"r{i}", prompt, SamplingParams(max_tokens=rng.randint(1, 12))))

    def check(out, ahead=False):
        batch.update_from(out)
        if not ahead:   # (ahead of its tokens, requests that ended since are told next time)
            assert set(batch) <= {seq.request_id for seq in s.running}      # nothing stale
        for x in out.scheduled:
            seq, mine = s.requests[x.req_id], batch[x.req_id]
            assert mine.token_ids == seq.token_ids and mine.block_ids == seq.block_table
            assert mine.num_computed_tokens == x.start == seq.num_computed_tokens

    def sample(out):
        seqs = [seq for x in out.scheduled
                if x.will_sample and (seq := s.requests.get(x.req_id)) is not None]
        s.update_from_output(seqs, [[rng.randrange(10, 400)] for _ in seqs])

    forks = 0
    for _ in range(400):
        if not s.has_unfinished():
            break
        out = s.schedule(now=0)
        check(out)
        s.update_after_step(out)
        nxt = None
        if out.scheduled and all(x.is_decode for x in out.scheduled) and rng.random() < 0.5:
            nxt = s.schedule_next_decode(out, lambda seq: True)
            if nxt is not None:        # launched before out's tokens reach the host
                check(nxt[1], ahead=True)
        sample(out)
        if nxt is not None:
            s.update_after_step(nxt[1])
            sample(nxt[1])
        if rng.random() < 0.05 and s.running:
            s.finish(rng.choice(s.running), "abort")
        if rng.random() < 0.1 and s.running and forks < 4:
            parent = rng.choice(s.running)
            if parent.num_computed_tokens >= parent.num_prompt_tokens:
                forks += 1
                child = Sequence(f"{parent.request_id}#{forks}", list(parent.prompt_token_ids),
                                 parent.params)
                child.token_ids = list(parent.token_ids[:parent.num_prompt_tokens + 1])
                s.fork(parent, child)
    assert not s.has_unfinished() and s.num_preemptions > 0 and forks > 0
    out = s.schedule(now=0)
    assert out.is_empty


def test_the_stop_rule_finishes_requests_in_one_place():
    """update_from_output appends each row's tokens and ends a request at the first token
    that stops it (a stop token, EOS, max_tokens, max_model_len), dropping the rest of its
    row; a request that ended while its step was in flight takes nothing."""
    cfg = EngineConfig()
    bm = BlockManager(65, 16, cfg.enable_prefix_caching)
    s = Scheduler(cfg, bm, max_model_len=40, eos_token_ids={2})
    seqs = {
        "eos": Sequence("eos", [5] * 4, SamplingParams(max_tokens=9)),
        "ignore": Sequence("ignore", [5] * 4, SamplingParams(max_tokens=9, ignore_eos=True)),
        "stop_id": Sequence("stop_id", [5] * 4, SamplingParams(max_tokens=9, stop_token_ids=[8])),
        "len": Sequence("len", [5] * 4, SamplingParams(max_tokens=2)),
        "model_len": Sequence("model_len", [5] * 38, SamplingParams(max_tokens=9)),
        "gone": Sequence("gone", [5] * 4, SamplingParams(max_tokens=9)),
    }
    for q in seqs.values():
        s.add(q)
    out = s.schedule(now=0)
    s.update_after_step(out)
    s.finish(seqs["gone"], "abort")
    rows = [seqs[x.req_id] for x in out.scheduled]
    sampled = {"eos": [3, 2, 4], "ignore": [2, 2, 4], "stop_id": [8, 9], "len": [3, 4, 5],
               "model_len": [3, 4, 5], "gone": [3]}
    res = dict(zip([q.request_id for q in rows],
                   s.update_from_output(rows, [sampled[q.request_id] for q in rows])))
    assert res["gone"] is None and seqs["gone"].finish_reason == "abort"
    got = {k: (v.new_token_ids, v.finish_reason) for k, v in res.items() if v is not None}
    assert got == {"eos": ([3, 2], "stop"), "ignore": ([2, 2, 4], None),
                   "stop_id": ([8], "stop"), "len": ([3, 4], "length"),
                   "model_len": ([3, 4], "length")}
    assert seqs["stop_id"].stop_reason == 8 and seqs["eos"].stop_reason is None
    assert seqs["eos"].output_token_ids == [3, 2] and seqs["ignore"].num_output_tokens == 3
    assert [q.request_id for q in s.running] == ["ignore"]
    assert bm.num_used_blocks == len(seqs["ignore"].block_table)
    # A later verdict on an ended request (a stop string in its last token's text) changes
    # its reason and nothing else.
    s.finish(seqs["len"], "stop")
    assert seqs["len"].finish_reason == "stop" and bm.num_used_blocks == 1
