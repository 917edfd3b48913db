"""Engine API: streaming (sync, threads, asyncio), abort, bad input, prefix caching, telemetry."""
from __future__ import annotations

import asyncio
import json
import threading
from dataclasses import replace

import pytest

import background
from conftest import random_prompts
from workbench import Engine, EngineConfig, SamplingParams


@pytest.fixture(scope="module")
def tiny_engine(tiny_checkpoints):
    path, _ = tiny_checkpoints["qwen3"]
    return Engine(model=str(path), device="cpu", block_size=16, num_kv_blocks=64, max_model_len=512)


@pytest.fixture(scope="module")
def smol():
    return Engine(model="smollm2", device="cpu", num_kv_blocks=128)


def prompts(n=4, lo=5, hi=40):
    return random_prompts(n, lo, hi, 1000, seed=3)


def test_first_token_streams_before_finish(tiny_engine):
    events = []
    for ev in tiny_engine.stream(prompts(1)[0], SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)):
        events.append((ev, tiny_engine.telemetry.num_steps))
    assert len(events) == 12
    assert not events[0][0].finished and events[-1][0].finished
    # Each token came out in its own step, not all at the end.
    assert [n for _, n in events] == sorted(set(n for _, n in events))
    assert events[-1][0].finish_reason == "length"


def test_interleaved_streams_in_one_thread(tiny_engine):
    """Two streams consumed in turn from one thread: each gets its own request's tokens (the
    ones it gets alone), in order, and the two requests share the engine's steps."""
    p = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    x, y = prompts(2)
    alone = [tiny_engine.generate([q], p)[0].token_ids for q in (x, y)]
    first = tiny_engine.telemetry.num_steps
    a, b = tiny_engine.stream(x, p), tiny_engine.stream(y, p)
    got_a, got_b = [], []
    for _ in range(6):
        got_a.append(next(a))
        got_b.append(next(b))
    for got, want in ((got_a, alone[0]), (got_b, alone[1])):
        assert [ev.token_id for ev in got] == want
        assert [ev.index for ev in got] == list(range(1, 7)) and got[-1].finished
        assert len({ev.request_id for ev in got}) == 1
    ra, rb = got_a[0].request_id, got_b[0].request_id
    assert ra != rb
    # A stream queues its request at its first next(): a's first step runs alone, then
    # both requests share every step until a has its 6 tokens; b's last step runs alone.
    steps = tiny_engine.telemetry.steps_since(first)
    assert [set(s.tokens_per_request) for s in steps] == [{ra}] + [{ra, rb}] * 5 + [{rb}]


def test_concurrent_streams_in_background_threads(tiny_engine):
    tiny_engine.start()
    try:
        p = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)
        arrivals: list[str] = []
        lock = threading.Lock()

        def consume(prompt):
            for ev in tiny_engine.stream(prompt, p):
                with lock:
                    arrivals.append(ev.request_id)

        threads = [threading.Thread(target=consume, args=(x,)) for x in prompts(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=120)
        assert len(arrivals) == 80
        # Interleaved: the first 20 events are not all one request's.
        assert len(set(arrivals[:20])) > 1
        # generate() also works while the loop runs.
        out = tiny_engine.generate(prompts(2), p)
        assert all(len(o.token_ids) == 20 for o in out)
    finally:
        tiny_engine.shutdown()
    assert tiny_engine.stats().kv_blocks_used == 0


def test_astream_concurrent(tiny_engine):
    p = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)

    async def main():
        seen = []

        async def one(x):
            async for ev in tiny_engine.astream(x, p):
                seen.append(ev.request_id)
        await asyncio.gather(*(one(x) for x in prompts(3)))
        return seen

    try:
        seen = asyncio.run(main())
    finally:
        tiny_engine.shutdown()
    assert len(seen) == 30 and len(set(seen[:10])) > 1


def test_abort_frees_every_block(tiny_engine):
    p = SamplingParams(max_tokens=200, temperature=0, ignore_eos=True)
    keep = tiny_engine.add_request(prompts(1)[0], SamplingParams(max_tokens=5, temperature=0))
    rid = tiny_engine.add_request(prompts(1, 100, 100)[0], p)
    for _ in range(3):
        tiny_engine.step()
    assert tiny_engine.stats().kv_blocks_used > 0
    assert tiny_engine.abort(rid)
    assert not tiny_engine.abort("no-such-request")
    while tiny_engine.has_unfinished_requests():
        tiny_engine.step()
    assert tiny_engine.stats().kv_blocks_used == 0
    reasons = {m.request_id: m.finish_reason for m in tiny_engine.telemetry.requests}
    assert reasons[rid] == "abort" and reasons[keep] in ("length", "stop")


def test_closing_a_stream_aborts_it(tiny_engine):
    gen = tiny_engine.stream(prompts(1)[0], SamplingParams(max_tokens=100, ignore_eos=True))
    next(gen)
    gen.close()
    tiny_engine.step()
    assert not tiny_engine.has_unfinished_requests()
    assert tiny_engine.stats().kv_blocks_used == 0


BAD_PARAMS = [
    (dict(max_tokens=0), "max_tokens"),
    (dict(max_tokens=-3), "max_tokens"),
    (dict(temperature=-0.1), "temperature"),
    (dict(top_p=0.0), "top_p"),
    (dict(top_p=1.5), "top_p"),
    (dict(top_k=-2), "top_k"),
]


@pytest.mark.parametrize("kw,field", BAD_PARAMS)
def test_bad_sampling_params(kw, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kw)


@pytest.mark.parametrize("kw,field", [
    (dict(block_size=24), "block_size"), (dict(block_size=4), "block_size"),
    (dict(block_size=512), "block_size"), (dict(max_num_seqs=0), "max_num_seqs"),
    (dict(max_num_batched_tokens=0), "max_num_batched_tokens"),
    (dict(preemption_mode="random"), "preemption_mode"), (dict(prefill_interval=0), "prefill_interval"),
    (dict(waiting_timeout_ms=-1), "waiting_timeout_ms"), (dict(dtype="int8"), "dtype"),
])
def test_bad_knobs(kw, field):
    with pytest.raises(ValueError, match=field):
        EngineConfig(**kw)


def test_bad_device_and_model():
    with pytest.raises(ValueError, match="device"):
        Engine(model="random:tiny", device="tpu")
    with pytest.raises(FileNotFoundError, match="Nothing is downloaded"):
        Engine(model="/no/such/checkpoint")
    with pytest.raises(ValueError, match="model"):
        Engine(model="random:no-such-shape")


def test_bad_prompts_lose_nothing(tiny_engine):
    good = tiny_engine.add_request(prompts(1)[0], SamplingParams(max_tokens=8, temperature=0))
    tiny_engine.step()
    for bad, field in [([], "prompt"), ("", "prompt"), ([1] * 600, "max_model_len"),
                       ([1, 10**9], "prompt"), ("text but no tokenizer", "tokenizer"), (3.5, "prompt")]:
        with pytest.raises(ValueError, match=field):
            tiny_engine.add_request(bad)
    with pytest.raises(ValueError, match="prompt"):   # one bad prompt in a batch queues nothing
        tiny_engine.generate([prompts(1)[0], []], SamplingParams(max_tokens=2))
    with pytest.raises(ValueError, match="request_id"):
        tiny_engine.add_request(prompts(1)[0], request_id=good)
    assert tiny_engine.stats().num_running + tiny_engine.stats().num_waiting == 1
    while tiny_engine.has_unfinished_requests():
        tiny_engine.step()
    assert [m for m in tiny_engine.telemetry.requests if m.request_id == good][0].output_tokens == 8
    assert tiny_engine.stats().kv_blocks_used == 0


def test_make_request_checks_once_and_queues_nothing_until_handed_over(tiny_engine):
    """Engine.make_request: a Request checked and tokenized, queued nowhere until add_request
    (or stream) takes it; max_tokens None is what fits after the prompt; token ids a caller
    tokenized are used as they are; a made Request carries its own params and id."""
    e = tiny_engine
    req = e.make_request(prompts(1)[0], SamplingParams(max_tokens=None, temperature=0))
    assert req.seq.params.max_tokens == e.info().max_model_len - req.seq.num_prompt_tokens
    assert not e.has_unfinished_requests()
    with pytest.raises(ValueError, match="^params:"):
        e.add_request(req, SamplingParams())
    with pytest.raises(ValueError, match="^min_tokens:.*fit after the prompt"):
        e.make_request([1] * 500, SamplingParams(max_tokens=None, min_tokens=20))
    with pytest.raises(ValueError, match="^logit_bias:.*vocabulary"):
        e.make_request([1, 2], SamplingParams(logit_bias={10**6: 1.0}))
    ids = e.tokenize([3, 4, 5, 6])
    mine = e.make_request("(not read)", SamplingParams(max_tokens=3, temperature=0),
                          "mine", prompt_token_ids=ids)
    assert [ev.token_id for ev in e.stream(mine)] == \
        e.generate([ids], SamplingParams(max_tokens=3, temperature=0))[0].token_ids
    for stop, ok in (("x", ["x"]), (None, []), (["a", "b"], ["a", "b"])):
        assert SamplingParams(stop=stop).stop == ok
    for stop in (3, [1], ["a", None]):
        with pytest.raises(ValueError, match=r"^stop: must be a string or a list of strings"):
            SamplingParams(stop=stop)
    with pytest.raises(ValueError, match=r"^stop_token_ids: must be a list of integers"):
        SamplingParams(stop_token_ids=[True])


def test_prefix_caching_prefills_only_the_new_turn(smol):
    chat = [{"role": "user", "content": "Tell me about the history of the printing press "
             "and how it changed the spread of ideas in Europe over the following centuries."}]
    p = SamplingParams(max_tokens=24, temperature=0)
    first = smol.generate(chat, p)[0]
    turn2 = chat + [{"role": "assistant", "content": first.text},
                    {"role": "user", "content": "And in Asia?"}]
    before = smol.telemetry.num_steps
    second = smol.generate(turn2, p)[0]
    steps = smol.telemetry.steps_since(before)
    prefilled = sum(s.num_prefill_tokens for s in steps)
    cached = sum(s.num_cached_tokens for s in steps)
    n = len(second.prompt_token_ids)
    assert cached >= len(first.prompt_token_ids) // 16 * 16 - 16 and cached > 0
    assert prefilled == n - cached
    assert second.metrics.cached_tokens == cached
    # Same tokens as a cache-free engine.
    fresh = Engine(model="smollm2", device="cpu", num_kv_blocks=128, enable_prefix_caching=False)
    assert fresh.generate(turn2, p)[0].token_ids == second.token_ids
    st = smol.stats()
    assert st.kv_blocks_used == 0 and st.kv_blocks_cached > 0 and st.prefix_cache_hits > 0


def test_stop_strings_and_token_ids(smol):
    p = SamplingParams(max_tokens=40, temperature=0)
    base = smol.generate("The capital of France is", p)[0]
    assert " Paris" in base.text
    cut = smol.generate("The capital of France is", SamplingParams(max_tokens=40, temperature=0, stop=["Paris"]))[0]
    assert cut.finish_reason == "stop" and cut.text == base.text[:base.text.index("Paris")]
    tid = base.token_ids[2]
    st = smol.generate("The capital of France is",
                       SamplingParams(max_tokens=40, temperature=0, stop_token_ids=[tid]))[0]
    assert st.token_ids == base.token_ids[:3] and st.finish_reason == "stop"
    # Streamed text of the stop-string run adds up to the final text.
    streamed = "".join(ev.text for ev in smol.stream(
        "The capital of France is", SamplingParams(max_tokens=40, temperature=0, stop=["Paris"])))
    assert streamed == cut.text


def test_incremental_text_with_multibyte_characters(smol):
    p = SamplingParams(max_tokens=30, temperature=0, ignore_eos=True)
    prompt = "Répète exactement: 日本語のテキスト 🚀🎉 naïve café"
    events = list(smol.stream(prompt, p))
    text = "".join(ev.text for ev in events)
    ids = [ev.token_id for ev in events]
    # A reply cut off inside a character ends before it rather than with U+FFFD.
    assert text == smol.tokenizer.decode(ids, skip_special_tokens=True).rstrip("\ufffd")
    assert "\ufffd" not in text and len(text) > 10
    # Direct check on a token sequence that splits characters across tokens.
    from workbench.engine.detokenizer import IncrementalDetokenizer
    ids = smol.tokenizer.encode("日本語 🚀 émoji")
    d = IncrementalDetokenizer(smol.tokenizer, [], [])
    pieces = []
    for t in ids:
        d.add(t)
        pieces.append(d.take(final=False))
    pieces.append(d.take(final=True))
    assert "".join(pieces) == "日本語 🚀 émoji"
    assert all("\ufffd" not in x for x in pieces)


def test_sampling_seeded_and_bounded(tiny_engine):
    x = prompts(1)[0]
    p = SamplingParams(max_tokens=16, temperature=1.0, top_k=20, top_p=0.9, seed=123, ignore_eos=True)
    a = tiny_engine.generate([x], p)[0].token_ids
    # Same seed, other requests alongside: same tokens.
    outs = tiny_engine.generate([x] + prompts(3), [p] + [SamplingParams(max_tokens=16, temperature=1.0)] * 3)
    assert outs[0].token_ids == a
    b = tiny_engine.generate([x], SamplingParams(max_tokens=16, temperature=1.0, seed=124, ignore_eos=True))[0]
    assert b.token_ids != a
    # top_k=1 is greedy.
    g = tiny_engine.generate([x], SamplingParams(max_tokens=16, temperature=0, ignore_eos=True))[0]
    k1 = tiny_engine.generate([x], SamplingParams(max_tokens=16, temperature=0.7, top_k=1, seed=5, ignore_eos=True))[0]
    assert k1.token_ids == g.token_ids


@background.job
def unseeded_runs():
    """The same unseeded requests in two processes whose str hashes are salted differently,
    at once (a background job: tests/background.py)."""
    import os
    import subprocess
    import sys
    code = ("from workbench import Engine, SamplingParams\n"
            "e = Engine(model='random:tiny', device='cpu', seed=7)\n"
            "p = SamplingParams(max_tokens=12, temperature=1.0, ignore_eos=True)\n"
            "print([o.token_ids for o in e.generate([[5, 6, 7], [8, 9]], p)])\n")
    procs = [background.spawn([sys.executable, "-c", code], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True,
                              env={**os.environ, "PYTHONHASHSEED": str(salt)})
             for salt in (1, 2)]
    runs = []
    for p in procs:
        out, err = p.communicate(timeout=600)
        runs.append(subprocess.CompletedProcess(p.args, p.returncode, out, err))
    return runs


def test_unseeded_sampling_repeats_across_processes(unseeded_runs):
    """Requests without a seed draw from one generator the engine seeds with
    EngineConfig.seed: the same numbers in every run with the same requests in the same order,
    whatever PYTHONHASHSEED salts str hashes with."""
    runs = unseeded_runs
    assert all(r.returncode == 0 for r in runs), runs[0].stderr[-2000:]
    assert runs[0].stdout == runs[1].stdout and runs[0].stdout.startswith("[[")


def test_top_p_keeps_the_nucleus_only():
    import torch
    from workbench.executor.sampler import sample
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    p = SamplingParams(temperature=1.0, top_p=0.7)
    g = torch.Generator().manual_seed(0)
    drawn = {sample(logits, _md([_row(p, gen=g)], 4)).token_ids.item() for _ in range(300)}
    assert drawn == {0, 1}
    p = SamplingParams(temperature=1.0, top_k=3)
    drawn = {sample(logits, _md([_row(p, gen=g)], 4)).token_ids.item() for _ in range(300)}
    assert drawn == {0, 1, 2}
    p = SamplingParams(temperature=1.0, min_p=0.35)     # 0.15 and 0.05 < 0.35 * 0.5
    drawn = {sample(logits, _md([_row(p, gen=g)], 4)).token_ids.item() for _ in range(300)}
    assert drawn == {0, 1}


def _row(params, prompt=(1,), output=(), gen=None):
    """One sampling row: a request with this prompt that has generated `output`."""
    from workbench.executor.sampling_metadata import SamplingRow
    return SamplingRow(params, [*prompt, *output], len(prompt), gen)


def _md(rows, vocab, **kw):
    from workbench.executor.sampling_metadata import sampling_metadata
    return sampling_metadata(rows, vocab, **kw)


def test_telemetry_records_steps_requests_and_memory(tiny_engine, tmp_path):
    tiny_engine.telemetry.clear()
    outs = tiny_engine.generate(prompts(4), SamplingParams(max_tokens=10, temperature=0, ignore_eos=True))
    steps, reqs = tiny_engine.telemetry.snapshot()
    assert steps[0].phase == "prefill" and steps[-1].phase == "decode"
    assert sum(s.num_decode_tokens for s in steps) + 4 == sum(len(o.token_ids) for o in outs)
    # 64 blocks, one of them the null block: neither used nor free.
    assert all(s.duration > 0 and s.kv_blocks_used + s.kv_blocks_free == 63 for s in steps)
    assert not any(s.graph for s in steps)
    m = outs[0].metrics
    assert m.ttft > 0 and m.tpot > 0 and len(m.itl) == 9 and m.e2e >= m.ttft
    assert m.prompt_tokens == len(outs[0].prompt_token_ids) and m.output_tokens == 10
    assert {r.request_id for r in reqs} == {o.request_id for o in outs}
    mem = tiny_engine.telemetry.memory
    # The pool is num_kv_blocks blocks, its null block included.
    assert mem.weights_bytes > 0 and mem.kv_cache_bytes == 64 * mem.kv_bytes_per_block
    data = json.loads(tiny_engine.telemetry.to_json(str(tmp_path / "t.json")))
    assert len(data["steps"]) == len(steps) and data["requests"][0]["ttft"] > 0
    assert json.loads((tmp_path / "t.json").read_text()) == data


def test_max_model_len_caps_generation(tiny_checkpoints):
    path, _ = tiny_checkpoints["qwen2"]
    e = Engine(model=str(path), device="cpu", num_kv_blocks=16, max_model_len=64)
    out = e.generate([list(range(5, 55))], SamplingParams(max_tokens=100, temperature=0, ignore_eos=True))[0]
    assert len(out.token_ids) == 14 and out.finish_reason == "length"
    with pytest.raises(ValueError, match="max_model_len"):
        Engine(model=str(path), device="cpu", num_kv_blocks=2, max_model_len=64)


def test_random_model_shapes():
    e = Engine(model="random:tiny", device="cpu", num_kv_blocks=16)
    out = e.generate([[1, 2, 3]], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))[0]
    assert len(out.token_ids) == 4
    e2 = Engine(model="random:tiny", device="cpu", num_kv_blocks=16)
    assert e2.generate([[1, 2, 3]], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))[0].token_ids == out.token_ids


def test_a_raising_listener_loses_only_its_request(tiny_engine):
    def boom(ev):
        raise RuntimeError("consumer went away")

    tiny_engine.start()
    try:
        bad = tiny_engine.add_request(prompts(1)[0], SamplingParams(max_tokens=50, ignore_eos=True),
                                      listener=boom)
        good = tiny_engine.generate(prompts(2), SamplingParams(max_tokens=30, temperature=0, ignore_eos=True))
        assert all(len(o.token_ids) == 30 for o in good)
        assert tiny_engine.is_running_in_background
    finally:
        tiny_engine.shutdown()
    reasons = {m.request_id: m.finish_reason for m in tiny_engine.telemetry.requests}
    assert reasons[bad] == "abort"
    assert tiny_engine.stats().kv_blocks_used == 0


def test_tiny_temperature_is_greedy_and_safe(tiny_engine):
    x = prompts(1)[0]
    g = tiny_engine.generate([x], SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))[0]
    t = tiny_engine.generate([x], SamplingParams(max_tokens=8, temperature=1e-40, ignore_eos=True))[0]
    assert t.token_ids == g.token_ids and t.finish_reason == "length"
    import torch
    from workbench.executor.sampler import sample
    logits = torch.tensor([[1e3, -1e3, 5.0]])
    assert sample(logits, _md([_row(SamplingParams(temperature=1e-4),
                                    gen=torch.Generator().manual_seed(0))], 3)
                  ).token_ids.tolist() == [0]


@pytest.mark.parametrize("kw,field", [
    (dict(stop=5), "stop"), (dict(stop_token_ids=5), "stop_token_ids"), (dict(seed=2**64), "seed"),
    (dict(temperature=True), "temperature"), (dict(ignore_eos="yes"), "ignore_eos"),
    (dict(max_tokens=True), "max_tokens"), (dict(temperature=float("nan")), "temperature"),
    (dict(n=0), "n"), (dict(logprobs=21), "logprobs"), (dict(prompt_logprobs=-1), "prompt_logprobs"),
    (dict(presence_penalty=2.5), "presence_penalty"), (dict(frequency_penalty="1"), "frequency_penalty"),
    (dict(repetition_penalty=0), "repetition_penalty"), (dict(min_p=1.5), "min_p"),
    (dict(logit_bias={5: 101}), "logit_bias"), (dict(logit_bias={"x": 1}), "logit_bias"),
    (dict(min_tokens=5, max_tokens=2), "min_tokens"), (dict(max_tokens=0), "max_tokens"),
    (dict(max_tokens=0, prompt_logprobs=1, n=2), "n"), (dict(skip_special_tokens=1), "skip_special_tokens"),
    (dict(include_stop_str_in_output=None), "include_stop_str_in_output"),
])
def test_more_bad_sampling_params(kw, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kw)


def test_requests_since_counts_records(tiny_engine):
    n = tiny_engine.telemetry.num_requests
    tiny_engine.generate(prompts(3), SamplingParams(max_tokens=2, temperature=0))
    assert len(tiny_engine.telemetry.requests_since(n)) == 3
    assert tiny_engine.telemetry.requests_since(n + 3) == []


def test_close_and_drop_free_the_engine_without_the_garbage_collector(tiny_checkpoints):
    """close() frees the KV pool, graphs and weights at once; an engine dropped without
    close() is freed by reference counting alone (no cycles hold it)."""
    import gc
    import weakref
    Engine(model=str(tiny_checkpoints["qwen3"][0]), device="cpu", num_kv_blocks=16)   # one-time import state
    gc.collect()
    gc.disable()
    try:
        p = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
        e = Engine(model=str(tiny_checkpoints["qwen3"][0]), device="cpu", num_kv_blocks=32)
        e.start()
        e.generate(prompts(2), p)
        rid = e.add_request(prompts(1)[0], SamplingParams(max_tokens=10_000, ignore_eos=True))
        pool, weights = weakref.ref(e.core.runner.kv_cache), weakref.ref(e.core.model.embed_tokens.weight)
        e.close()
        assert pool() is None and weights() is None
        assert {m.request_id: m.finish_reason for m in e.telemetry.requests}[rid] == "abort"
        with pytest.raises(RuntimeError, match="closed"):
            e.generate(prompts(1), p)
        e.close()                                                   # idempotent
        for background in (False, True):
            e = Engine(model=str(tiny_checkpoints["qwen3"][0]), device="cpu", num_kv_blocks=32)
            if background:
                e.start()
            e.generate(prompts(2), p)
            e.shutdown()
            engine, pool = weakref.ref(e), weakref.ref(e.core.runner.kv_cache)
            del e
            assert engine() is None and pool() is None, background
    finally:
        gc.enable()


def test_the_first_engine_of_a_process_is_freed_with_the_gc_off():
    """The first engine of a fresh process (whose build imports transformers and what it
    pulls in for the first time) is freed by reference counting alone once closed and
    dropped, with the cyclic GC off from the start; so is one dropped without close()."""
    import subprocess
    import sys
    code = ("import gc, weakref\n"
            "gc.disable()\n"
            "from workbench import Engine, SamplingParams\n"
            "p = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)\n"
            "e = Engine(model='random:tiny', device='cpu', num_kv_blocks=16)\n"
            "e.generate([[1, 2, 3]], p)\n"
            "first = weakref.ref(e)\n"
            "e.close()\n"
            "del e\n"
            "e = Engine(model='random:tiny', device='cpu', num_kv_blocks=16)\n"
            "e.generate([[1, 2, 3]], p)\n"
            "second = weakref.ref(e)\n"
            "del e\n"
            "print(first() is None, second() is None, gc.isenabled())\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.split() == ["True", "True", "False"], r.stdout


def test_default_graph_mode_is_the_devices_choice_and_says_nothing():
    """No graph capture on the CPU: the default runs eager without a notice; asking for
    'decode' by name still says that it runs eager."""
    e = Engine(model="random:tiny", device="cpu", num_kv_blocks=16)
    assert e.info().config.graph_mode == "eager" == e.info().graph_mode and e.telemetry.notices == []
    asked = Engine(model="random:tiny", device="cpu", num_kv_blocks=16, graph_mode="decode")
    assert asked.info().graph_mode == "eager" and "graph_mode='decode' asked for" in asked.telemetry.notices[0]


# ---- logprobs, n, penalties (issue 12) ---------------------------------------------------------
def _hf_logprobs(model, ids: list[int]) -> "torch.Tensor":
    import torch
    with torch.inference_mode():
        return torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), -1)


def _check_against_hf(hf, out, k_out, k_prompt):
    """Each sampled and prompt token's logprob, rank and top-k equal HF's log_softmax."""
    ids = out.prompt_token_ids + out.token_ids
    ref = _hf_logprobs(hf, ids)
    n_prompt = len(out.prompt_token_ids)
    assert len(out.outputs[0].logprobs) == len(out.token_ids) > 0
    assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == n_prompt
    got = list(zip(range(1, n_prompt), out.prompt_logprobs[1:], [k_prompt] * n_prompt))
    got += list(zip(range(n_prompt, len(ids)), out.outputs[0].logprobs, [k_out] * len(ids)))
    for pos, lps, k in got:
        row, tok = ref[pos - 1], ids[pos]
        assert abs(lps[tok].logprob - row[tok].item()) < 1e-4
        assert lps[tok].rank == int((row > row[tok]).sum()) + 1
        top = row.topk(k)
        top_ids = [t for t in lps if lps[t].rank <= k]
        assert set(top_ids) <= set(top.indices.tolist()) and len(lps) in (k, k + 1)
        for t in top_ids:
            assert abs(lps[t].logprob - row[t].item()) < 1e-4


@pytest.mark.parametrize("which", ["qwen3", "smollm2"])
def test_logprobs_equal_hf(which, request, tiny_checkpoints):
    """Generated and prompt logprobs are HF's log_softmax (raw: before temperature and
    penalties), for a random Qwen3 and the embedded Llama (SmolLM2), in fp32 on the CPU."""
    if which == "qwen3":
        engine, hf = request.getfixturevalue("tiny_engine"), tiny_checkpoints["qwen3"][1]
        prompt = prompts(1)[0]
    else:
        engine, hf = request.getfixturevalue("smol"), request.getfixturevalue("hf_smollm2")
        prompt = "The quick brown fox jumps over the lazy dog because"
    outs = engine.generate([prompt] * 2, [
        SamplingParams(max_tokens=5, temperature=0, ignore_eos=True, logprobs=5, prompt_logprobs=3),
        SamplingParams(max_tokens=5, temperature=0.8, seed=7, ignore_eos=True, logprobs=2,
                       prompt_logprobs=0, repetition_penalty=1.3, presence_penalty=0.5)])
    for out, k, pk in zip(outs, (5, 2), (3, 0)):
        _check_against_hf(hf, out, k, pk)
    assert engine.stats().kv_blocks_used == 0


def test_logprobs_stream_and_prompt_scoring_only(tiny_engine):
    x = prompts(1)[0]
    events = list(tiny_engine.stream(x, SamplingParams(max_tokens=4, temperature=0, ignore_eos=True,
                                                       logprobs=1)))
    assert all(ev.token_id in ev.logprobs and len(ev.logprobs) in (1, 2) for ev in events)
    # max_tokens=0: the prompt is scored, nothing is generated (lm-eval's loglikelihood).
    out = tiny_engine.generate([x], SamplingParams(max_tokens=0, prompt_logprobs=0))[0]
    assert out.token_ids == [] and out.finish_reason == "length"
    assert [list(d) for d in out.prompt_logprobs[1:]] == [[t] for t in x[1:]]
    assert tiny_engine.stats().kv_blocks_used == 0


def test_n_forks_the_prompt_blocks(tiny_engine):
    """n=4 on a 300-token prompt: the prompt is computed once, its 18 full blocks are shared
    by all four choices (reference count 4), each choice recomputes only the partial last
    block; greedy choices equal each other."""
    x = random_prompts(1, 300, 300, 1000, seed=11)[0]
    tiny_engine.telemetry.clear()
    rid = tiny_engine.add_request(x, SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, n=4))
    tiny_engine.step()                   # the prompt (one prefill), then the fork
    snap = tiny_engine.kv_blocks()
    assert sorted(snap.block_tables) == [rid, f"{rid}#1", f"{rid}#2", f"{rid}#3"]
    shared = snap.block_tables[rid][:18]
    assert all(snap.block_tables[c][:18] == shared for c in snap.block_tables)
    assert [snap.ref_counts[b] for b in shared] == [4] * 18
    tiny_engine.step()                   # the three later choices compute their tails
    assert tiny_engine.stats().kv_blocks_used == 18 + 4      # not 4 * 19
    while tiny_engine.has_unfinished_requests():
        tiny_engine.step()
    steps, _ = tiny_engine.telemetry.snapshot()
    # 300 prompt tokens once, plus each later choice's tail: 300 - 288 + its first token.
    assert sum(s.num_prefill_tokens for s in steps) == 300 + 3 * 13
    assert tiny_engine.stats().kv_blocks_used == 0


def test_n_choices_generate_and_stream(tiny_engine):
    x = prompts(1)[0]
    greedy = tiny_engine.generate([x], SamplingParams(max_tokens=5, temperature=0, ignore_eos=True))[0]
    out = tiny_engine.generate([x], SamplingParams(max_tokens=5, temperature=0, ignore_eos=True, n=3,
                                                   logprobs=0))[0]
    assert [o.index for o in out.outputs] == [0, 1, 2]
    assert all(o.token_ids == greedy.token_ids and o.finish_reason == "length" for o in out.outputs)
    assert out.token_ids == greedy.token_ids and all(len(o.logprobs) == 5 for o in out.outputs)
    # Random choices: each its own seed stream, the same in every run.
    p = SamplingParams(max_tokens=8, temperature=1.0, seed=3, ignore_eos=True, n=3, stop_token_ids=[7])
    a = [o.token_ids for o in tiny_engine.generate([x], p)[0].outputs]
    b = {}
    for ev in tiny_engine.stream(x, p):
        b.setdefault(ev.choice, []).extend([ev.token_id] if ev.token_id is not None else [])
    assert [b[i] for i in range(3)] == a and len({tuple(t) for t in a}) == 3
    # An abort ends every choice.
    rid = tiny_engine.add_request(x, SamplingParams(max_tokens=50, ignore_eos=True, n=2))
    tiny_engine.step(), tiny_engine.step()
    assert tiny_engine.abort(rid)
    tiny_engine.step()
    assert not tiny_engine.has_unfinished_requests() and tiny_engine.stats().kv_blocks_used == 0


def test_penalty_processors_match_their_definitions():
    """vLLM's definitions on a hand-made row: repetition over prompt + output, frequency per
    occurrence in the output, presence once; logit_bias added; min_tokens bans stops."""
    import torch
    from workbench.executor.sampler import apply_processors
    logits = torch.tensor([[2.0, -1.0, 3.0, 0.5, 1.0]])
    p = SamplingParams(repetition_penalty=2.0, frequency_penalty=0.5, presence_penalty=0.25,
                       logit_bias={4: 1.5}, min_tokens=5, stop_token_ids=[0])
    out = apply_processors(logits, _md([_row(p, prompt=[1], output=[2, 2, 3])], 5,
                                       eos_token_ids={3}).processors)
    # 0: banned (stop id, 3 < min_tokens); 1: prompt -> -1 * 2; 2: 3/2 - 2*0.5 - 0.25;
    # 3: EOS, banned; 4: +1.5.
    want = torch.tensor([[float("-inf"), -2.0, 0.25, float("-inf"), 2.5]])
    assert torch.equal(out, want)
    none = SamplingParams(repetition_penalty=1.0, frequency_penalty=0.0, presence_penalty=0.0)
    assert _md([_row(none, [1], [2, 2, 3])], 5, eos_token_ids={3}).processors is None


def test_penalties_change_a_repeating_output(smol):
    """On a prompt that repeats, the model keeps repeating; the repetition penalty (which
    counts the prompt) stops it, frequency and presence penalties (output only) keep tokens
    from recurring in the output; 0 penalties equal none; logit_bias, min_tokens and
    include_stop_str_in_output do what they say. One batch for all variants."""
    from collections import Counter
    prompt = "one two three one two three one two three one two three one two three"
    base = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
    t = smol.tokenize(" banana")[-1]
    variants = [{}, dict(presence_penalty=0.0, frequency_penalty=0.0, repetition_penalty=1.0),
                dict(repetition_penalty=3.0), dict(frequency_penalty=2.0), dict(presence_penalty=2.0),
                dict(logit_bias={t: 100}, max_tokens=3),
                dict(logit_bias={t: 100}, stop_token_ids=[t], min_tokens=2),
                dict(stop=["three"]), dict(stop=["three"], include_stop_str_in_output=True)]
    plain, zero, rep, freq, pres, bias, mint, cut, kept = smol.generate(
        [prompt] * len(variants), [replace(base, **kw) for kw in variants])
    assert zero.token_ids == plain.token_ids
    most = max(Counter(plain.token_ids).values())
    assert most >= 4                                        # the model keeps repeating
    seen = set(smol.tokenize(prompt))
    assert "one two three" not in rep.text
    assert sum(t in seen for t in rep.token_ids) < sum(t in seen for t in plain.token_ids)
    for out in (freq, pres):
        assert max(Counter(out.token_ids).values()) < most, out.text
    # logit_bias forces a token; min_tokens holds back a stop token until then.
    assert bias.token_ids == [t] * 3
    assert mint.token_ids[-1] == t and len(mint.token_ids) == 3 and mint.finish_reason == "stop"
    # include_stop_str_in_output keeps the stop string at the end of the text.
    assert cut.finish_reason == kept.finish_reason == "stop" and kept.text == cut.text + "three"


def test_prompt_logprobs_across_chunks_and_cached_prefixes(tiny_checkpoints):
    """A prompt prefilled in chunks is scored at every position, and a request whose prefix
    is cached still gets the logprobs of all its prompt tokens (it skips the prefix cache)."""
    path, hf = tiny_checkpoints["qwen3"]
    e = Engine(model=str(path), device="cpu", block_size=16, num_kv_blocks=64, max_model_len=512,
               max_num_batched_tokens=32, max_num_seqs=4, enable_chunked_prefill=True)
    x = random_prompts(1, 100, 100, 1000, seed=5)[0]
    p = SamplingParams(max_tokens=0, prompt_logprobs=1)
    first, again = e.generate([x], p)[0], e.generate([x], p)[0]
    ref = _hf_logprobs(hf, x)
    for out in (first, again):
        got = [d[t].logprob for d, t in zip(out.prompt_logprobs[1:], x[1:])]
        want = [ref[i - 1, x[i]].item() for i in range(1, len(x))]
        assert max(abs(a - b) for a, b in zip(got, want)) < 1e-4
    assert e.generate([[7]], p)[0].prompt_logprobs == [None]     # one token: nothing to score
