"""Decode-graph capture and the CUDA attention kernel, checked on the CPU.

- The Triton paged decode kernel runs under Triton's interpreter (TRITON_INTERPRET=1, numpy
  on the CPU) against the plain-torch reference, for several head layouts and block sizes.
- The graph plumbing (static buffers, padding rows into the scratch block, replay at the
  next captured size) runs with a CPU platform whose "graph" reruns the captured function
  on its static buffers: what a CUDA graph replays, minus the launch savings. Greedy tokens
  must equal the eager engine's. (Real CUDA-graph capture is checked by benchmarks/gpu.py on
  a GPU.)
"""
from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
import torch

import background
from conftest import random_prompts
from triton_on_cpu import run_interpreted
from workbench import Engine, SamplingParams
from workbench.bench.offline import SAMPLING_WORKLOADS


def test_triton_decode_kernel_matches_the_reference_in_the_interpreter():
    pytest.importorskip("triton")
    code = textwrap.dedent('''
        import torch
        from workbench.platforms.attention import decode_attention, pool_rows
        from workbench.platforms.triton_attention import paged_decode_attention
        torch.manual_seed(0)
        worst = 0.0
        # (batch, heads, kv heads, head_dim, block_size, pool blocks)
        for B, H, kvH, D, bs, NB in [(3, 4, 2, 64, 16, 20), (2, 6, 2, 48, 8, 30),
                                     (1, 8, 8, 128, 32, 6), (4, 9, 3, 64, 64, 9)]:
            k, v = torch.randn(kvH, NB, bs, D), torch.randn(kvH, NB, bs, D)
            q = torch.randn(B, H + 2 * kvH, D)[:, :H]            # a view, as the model passes
            lens = torch.randint(1, NB * bs // B, (B,))
            perm, used = torch.randperm(NB), 0
            width = int((lens.max() + bs - 1) // bs) + 2          # tables wider than needed
            tables = torch.full((B, width), NB - 1, dtype=torch.int32)
            for i in range(B):
                nb = int((lens[i] + bs - 1) // bs)
                tables[i, :nb] = perm[used:used + nb]
                used += nb
            out = torch.full_like(q, float("nan"))               # every element must be written
            paged_decode_attention(q, k, v, tables, lens.to(torch.int32), D ** -0.5, out=out)
            pad = torch.arange(width * bs)[None, :] >= lens[:, None]
            bias = torch.zeros(pad.shape).masked_fill_(pad, float("-inf")).unsqueeze(1)
            ref = decode_attention(q, k, v, pool_rows(tables.long(), kvH, NB),
                                   bias.repeat(kvH, 1, 1), D ** -0.5)
            assert not out.isnan().any()
            worst = max(worst, float((out - ref).norm() / ref.norm()))
        print("worst", worst)
    ''')
    worst = float(run_interpreted(code).split()[-1])
    assert worst < 1e-5, worst


def same_greedy_tokens(engine, eager, longest: int, seed: int, max_tokens) -> list:
    """Run one batch (8 prompts up to `longest` tokens, the last sharing the first's cached
    prefix) on both engines; greedy tokens must be equal. Returns the engine's steps."""
    prompts = random_prompts(7, 5, longest, engine.info().vocab_size, seed=seed)
    prompts.append(prompts[0][:40] + [11, 12, 13])
    params = [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True) for n in max_tokens]
    want = [o.token_ids for o in eager.generate(prompts, params)]
    assert [o.token_ids for o in engine.generate(prompts, params)] == want
    return engine.telemetry.snapshot()[0]


def test_decode_graphs_pad_replay_and_match_eager(replaying_platform):
    kw = dict(model="random:tiny", device="cpu", block_size=16, num_kv_blocks=96, max_num_seqs=8,
              enable_prefix_caching=True)
    graphs = Engine(**kw, graph_mode="decode", cudagraph_capture_sizes=[1, 2, 4, 8])
    eager = Engine(**kw, graph_mode="eager")
    assert graphs.info().graph_mode == "decode" and not graphs.telemetry.notices
    assert sorted(graphs.core.runner.graphs.graphs) == [1, 2, 4, 8]
    steps = same_greedy_tokens(graphs, eager, 60, 3, (30, 3, 17, 9, 25, 1, 12, 20))
    replayed = [s for s in steps if s.graph]
    assert replayed and all(s.phase == "decode" for s in replayed)
    assert all(s.graph_size >= s.num_decode_tokens and s.graph_size in (1, 2, 4, 8)
               for s in replayed)
    assert {s.graph_size for s in replayed} >= {8, 4, 2, 1}     # the batch shrinks as they finish
    assert any(s.graph_size > s.num_decode_tokens for s in replayed)   # padding happened
    assert not any(s.graph for s in steps if s.num_prefill_tokens)
    assert graphs.stats().kv_blocks_used == 0


def test_decode_batches_beyond_the_largest_capture_run_eager(replaying_platform):
    e = Engine(model="random:tiny", device="cpu", max_num_seqs=8, num_kv_blocks=64,
               cudagraph_capture_sizes=[1, 2])
    e.generate(random_prompts(4, 4, 8, e.info().vocab_size), SamplingParams(max_tokens=6, ignore_eos=True))
    decodes = [s for s in e.telemetry.snapshot()[0] if s.phase == "decode"]
    assert all(s.graph == (s.num_decode_tokens <= 2) for s in decodes)
    assert any(not s.graph for s in decodes)


@pytest.mark.parametrize("backend", ["auto", "reference"])
def test_full_mode_replays_prefill_and_mixed_steps_piecewise(replaying_platform, backend):
    """graph_mode='full': decode steps replay whole graphs (with the fused kernel; with the
    plain-torch attention they go piecewise too), chunks, prefills and mixed steps replay
    piecewise at padded token buckets, and greedy tokens equal eager's."""
    kw = dict(model="random:tiny-qwen3", device="cpu", block_size=16, num_kv_blocks=128,
              max_num_seqs=8, max_num_batched_tokens=96, enable_prefix_caching=True,
              attention_backend=backend)
    full = Engine(**kw, graph_mode="full", cudagraph_capture_sizes=[1, 2, 4, 8])
    eager = Engine(**kw, graph_mode="eager")
    assert full.info().graph_mode == "full" and full.info().piecewise_sizes == (16, 32, 64, 96)
    assert sorted(full.core.runner.piecewise.graphs) == [16, 32, 64, 96]
    assert all(len(p) == full.core.model.num_layers + 1 for p in full.core.runner.piecewise.graphs.values())
    assert bool(full.telemetry.notices) == (backend == "reference")
    steps = same_greedy_tokens(full, eager, 150, 5, (12, 3, 17, 9, 25, 1, 6, 20))
    assert all(s.graph for s in steps)                        # every step fits a bucket
    pw = [s for s in steps if s.graph_kind == "PIECEWISE"]
    assert {s.phase for s in pw} >= {"prefill", "mixed"}
    assert any("chunk" in s.kinds.values() for s in pw)
    assert all(s.graph_size >= s.num_tokens and s.graph_size in (16, 32, 64, 96) for s in pw)
    assert any(s.graph_size > s.num_tokens for s in pw)       # padded
    decode_kind = "FULL" if backend == "auto" else "PIECEWISE"
    assert all(s.graph_kind == decode_kind for s in steps if s.phase == "decode")
    assert full.stats().kv_blocks_used == 0


def test_capture_needs_the_fused_kernel(replaying_platform):
    """Whole decode-step graphs need the platform's fused paged attention; piecewise graphs
    (graph_mode 'full') do not. Without the kernel the device's choice is eager, silently;
    asking for 'decode' says why it runs eager."""
    kw = dict(model="random:tiny", device="cpu", attention_backend="reference", max_num_seqs=2,
              num_kv_blocks=16, max_num_batched_tokens=64)
    default = Engine(**kw)
    assert default.info().graph_mode == "eager" == default.info().config.graph_mode
    assert default.telemetry.notices == [] and default.core.runner.graphs is None
    asked = Engine(**kw, graph_mode="decode")
    assert asked.info().graph_mode == "eager" and "fused paged attention" in asked.telemetry.notices[0]
    full = Engine(**kw, graph_mode="full")
    assert full.core.runner.graphs is None and full.info().piecewise_sizes


def test_cpu_graph_modes_say_they_run_eager():
    e = Engine(model="random:tiny", device="cpu", graph_mode="decode", num_kv_blocks=16)
    assert e.info().graph_mode == "eager" and "not available on cpu" in e.telemetry.notices[0]
    e.generate([[1, 2, 3]], SamplingParams(max_tokens=3))
    assert not any(s.graph for s in e.telemetry.snapshot()[0])
    import json
    assert json.loads(e.telemetry.to_json())["notices"] == e.telemetry.notices     # exported too


def test_stepper_shows_graph_replays(replaying_platform):
    pytest.importorskip("ipywidgets")
    from widgets import Stepper
    st = Stepper(Engine(model="random:tiny", device="cpu", max_num_seqs=4, num_kv_blocks=16,
                        cudagraph_capture_sizes=[1, 2, 4]))
    st.add([5, 6, 7], max_tokens=3)
    st.add([8, 9], max_tokens=3)
    prefill, decode = st.step(), st.step()
    assert prefill.graph_size is None and decode.graph_size == 2
    assert "graph replay @2" in st.view.value


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_decode_graphs_match_eager():
    kw = dict(model="random:tiny", device="cuda", dtype="float32", num_kv_blocks=128,
              max_num_seqs=8)
    prompts = random_prompts(6, 5, 50, 1000, seed=1)
    p = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)
    want = [o.token_ids for o in Engine(**kw, graph_mode="eager").generate(prompts, p)]
    e = Engine(**kw, graph_mode="decode")
    assert [o.token_ids for o in e.generate(prompts, p)] == want
    assert any(s.graph for s in e.telemetry.snapshot()[0])


def test_async_scheduling_gives_the_synchronous_tokens(replaying_platform):
    """Decode steps launched from the previous step's device-side ids, before the host has
    them: the same greedy tokens and finish reasons as the synchronous engine, with requests
    ending by length and by stop token mid-pipeline, an abort while a step is in flight, and
    requests arriving while others decode; then in the background loop with streams."""
    kw = dict(model="random:tiny", device="cpu", block_size=16, num_kv_blocks=200, max_num_seqs=8,
              cudagraph_capture_sizes=[1, 2, 4, 8], enable_prefix_caching=True)
    ahead, sync = Engine(**kw, async_scheduling=True), Engine(**kw, async_scheduling=False)
    prompts = random_prompts(12, 3, 40, ahead.info().vocab_size, seed=5)
    lens = [1, 30, 7, 22, 2, 15, 30, 9, 12, 3, 27, 18]
    params = [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True) for n in lens]
    want = [o.token_ids for o in sync.generate(prompts, params)]
    assert [o.token_ids for o in ahead.generate(prompts, params)] == want
    # Stop tokens: the most frequent ids end most requests early, found out a step late.
    counts = {}
    for t in (t for w in want for t in w):
        counts[t] = counts.get(t, 0) + 1
    stops = sorted(counts, key=counts.get)[-3:]
    stop_params = SamplingParams(max_tokens=30, temperature=0, stop_token_ids=stops)
    runs = []
    for e in (sync, ahead):
        first = e.telemetry.num_steps
        rids = [e.add_request(p, stop_params) for p in prompts[:6]]
        for _ in range(4):
            e.step()
        e.abort(rids[1])
        late = [e.add_request(p, stop_params) for p in prompts[6:]]   # arrive mid-decode
        while e.has_unfinished_requests():
            e.step()
        e.core.finish_in_flight()
        recs = {m.request_id: m for m in e.telemetry.requests}
        runs.append(([recs[r].finish_reason for r in rids + late],
                     [recs[r].output_tokens for r in rids + late]))
        assert e.stats().kv_blocks_used == 0
        steps = e.telemetry.steps_since(first)
    assert runs[0] == runs[1] and "stop" in runs[0][0] and runs[0][0][1] == "abort"
    assert sum(s.scheduled_ahead for s in steps) >= 5
    assert not any(s.scheduled_ahead for s in sync.telemetry.snapshot()[0])
    # Background loop, several streams at once.
    import threading
    streamed = [None] * 3

    def consume(i):
        p = SamplingParams(max_tokens=lens[1 + i], temperature=0, ignore_eos=True)
        streamed[i] = list(ahead.stream(prompts[1 + i], p))
    ahead.start()
    try:
        threads = [threading.Thread(target=consume, args=(i,)) for i in range(3)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=120)
    finally:
        ahead.shutdown()
    assert [[ev.token_id for ev in evs] for evs in streamed] == want[1:4]
    assert ahead.core.pipeline.in_flight is None and ahead.stats().kv_blocks_used == 0


@background.job
def gpu_script_small():
    """benchmarks/gpu.py --small (a background job: tests/background.py): its parts."""
    import json
    from pathlib import Path
    script = Path(__file__).resolve().parent.parent / "benchmarks" / "gpu.py"
    out = background.tmpdir("gpu")
    proc = background.spawn([sys.executable, str(script), "--small", "--out", str(out)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    _, err = proc.communicate(timeout=900)
    assert proc.returncode == 0, err[-3000:]
    return {d.pop("part"): d for d in map(json.loads, (out / "gpu.jsonl").read_text().splitlines())}


def test_gpu_script_runs_every_part_at_toy_sizes_on_the_cpu(gpu_script_small):
    """benchmarks/gpu.py --small: every part at toy sizes on the CPU, so a slip in the
    script shows here and not in a GPU call's scarce minutes. No part may fail, and the
    correctness parts must hold (on the CPU they check the CPU path)."""
    parts = gpu_script_small
    assert not [p for p in parts if p.endswith("_error")], {p: d for p, d in parts.items()
                                                            if p.endswith("_error")}
    for name in ("ceilings", "prefill", "b1_eager", "b1_decode", "b1_ratio", "w1_ours",
                 "sampled", "concurrency_1", "w1_ours_full"):
        assert name in parts, (name, sorted(parts))
    for mode in ("eager", "decode", "full"):
        assert parts[f"correctness_fp32_{mode}"]["equal"], parts[f"correctness_fp32_{mode}"]
    w1 = parts["w1_ours"]              # a warm run; the first (cold) one is kept beside it
    assert w1["cold_out_tok_s"] > 0 and w1["cold_ttft_p99_s"] > 0, w1
    for name in ("correctness_bf16_logits", "correctness_bf16_decode_b1", "release"):
        assert parts[name]["ok"], (name, parts[name])
    assert set(parts["sampled"]["w1_vs_greedy"]) == {"greedy", *SAMPLING_WORKLOADS,
                                                     "greedy_again"}
    for shape in ("b1", "w1"):        # speculative decoding's A/B: the tokens are plain's
        for arm in ("plain", "ngram", "ngram_every_draft", "draft_self"):
            assert parts[f"spec_{shape}_{arm}"]["tokens_equal"], parts[f"spec_{shape}_{arm}"]
        assert parts[f"spec_{shape}_draft_self"]["acceptance"] == 1.0      # its own weights
        assert parts[f"spec_{shape}_ngram_every_draft"]["drafted"] > 0
