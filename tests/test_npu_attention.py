"""The real NpuPlatform (attention backend, fused ops, decode graphs, chip and head-size
checks, `workbench doctor`), driven on the CPU by the fake torch_npu in fake_torch_npu.py.

No Ascend hardware is reachable from here, and torch_npu cannot be installed without CANN.
The fake computes what the ops' docs say and models what real hardware would do to us (see
its docstring): graphs that bake host values in, task updates and their ordering, the
paged-attention workspace, releases whose auto_dispatch_capture records no paged attention,
head sizes and chips the ops refuse. These tests check our side against that model; they
cannot check the ops or NPUGraph themselves.
"""
from __future__ import annotations

import pytest
import torch

import fake_torch_npu
from conftest import make_tiny_checkpoint, random_prompts
from workbench import Engine, SamplingParams
from workbench.platforms.npu_attention import DecodeGraphTasks

KW = dict(num_kv_blocks=24, max_num_seqs=6, max_num_batched_tokens=160,
          enable_prefix_caching=True)


@pytest.fixture(scope="module")
def reference_tokens(qwen3_d128):
    """Greedy tokens of the CPU's plain-torch path, computed once, for the prompts below."""
    cache = {}

    def get(prompts, params):
        key = (tuple(map(tuple, prompts)), tuple(p.max_tokens for p in params))
        if key not in cache:
            ref = Engine(model=str(qwen3_d128), **KW, device="cpu",
                         attention_backend="reference", block_size=128)
            cache[key] = [o.token_ids for o in ref.generate(prompts, params)]
        return cache[key]
    return get


def _params(*ns):
    return [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True) for n in ns]


def test_npu_backend_tokens_equal_the_reference(qwen3_d128, reference_tokens, monkeypatch):
    fake = fake_torch_npu.install(monkeypatch, fp32=True)
    prompts = random_prompts(5, 5, 300, 1000, seed=4)
    prompts.append(prompts[2][:260] + [7, 8, 9])            # a cached prefix, then a chunk
    params = _params(20, 20, 20, 20, 20, 20)
    npu = Engine(model=str(qwen3_d128), device="npu", **KW, graph_mode="eager")
    assert npu.core.platform.name == "npu" and npu.info().config.block_size == 128
    attn = npu.core.model.layers[0].self_attn
    # NpuAttention.kv_cache_shape: [layers, K/V, blocks (the null block among them),
    # block_size, kv_heads, D]
    assert npu.info().attention == "npu"
    assert tuple(npu.core.runner.kv_cache.shape) == (3, 2, 24, 128, attn.num_kv_heads, 128)
    got = [o.token_ids for o in npu.generate(prompts[:5], params[:5])]
    got += [o.token_ids for o in npu.generate(prompts[5:], params[5:])]
    want = reference_tokens(prompts[:5], params[:5]) + reference_tokens(prompts[5:], params[5:])
    assert got == want
    steps = npu.telemetry.snapshot()[0]
    assert any(s.phase == "mixed" for s in steps) and any(s.num_cached_tokens for s in steps)
    # torch_npu 2.8.0 pairs with CANN 8.3.RC1: chunks and mixed steps through the fused
    # infer-attention op, decode-only steps through eager paged attention, as vLLM-Ascend
    # v0.11.0 ran them (npu.FIA_PA_PATH; test_npu_releases.py covers every release)
    assert set(fake.calls) == {"cache", "fia", "paged", "rms_norm", "add_rms_norm", "swiglu"}
    # Every step's inputs went through the pinned staging: one copy a step, none from
    # pageable memory (which the fake reads late, as the copy engine would).
    copies = fake.npu.host_copies.counts
    assert copies["unpinned"] == 0 and copies["pinned"] >= len(steps)
    assert npu.core.runner.staging.copies
    with pytest.raises(ValueError, match="block_size"):
        Engine(model=str(qwen3_d128), device="npu", **KW, block_size=16)


@pytest.mark.parametrize("release,mode", [("2.8.0", "decode"), ("2.9.0.post4", "full")])
def test_npu_decode_graphs_hand_every_replay_its_lengths(qwen3_d128, reference_tokens,
                                                         monkeypatch, release, mode):
    """Decode graphs on the real platform. 2.8.0's auto_dispatch_capture records no paged
    attention (NPUGraph.update would change nothing, and every replay would attend over the
    capture-time length of 1), so the lengths go through task-group updates, which the fake
    lets run only in vLLM-Ascend's order, with a workspace big enough for every step's
    lengths. Whole decode graphs are opt-in on the NPU: 'decode' by name (at
    cudagraph_capture_sizes), or pa_shape_list under 'full', which adds piecewise graphs
    around the fused prefill."""
    fake = fake_torch_npu.install(monkeypatch, version=release, fp32=True)
    sizes = dict(cudagraph_capture_sizes=[1, 2, 4, 6]) if mode == "decode" else \
        dict(pa_shape_list=[1, 2, 4, 6])
    npu = Engine(model=str(qwen3_d128), device="npu", **KW, graph_mode=mode, **sizes)
    assert npu.info().graph_mode == mode and not npu.telemetry.notices
    prompts = random_prompts(5, 5, 300, 1000, seed=4)
    params = _params(20, 3, 11, 14, 7)
    got = [o.token_ids for o in npu.generate(prompts, params)]
    assert got == reference_tokens(prompts, params)
    assert all(kw == {"auto_dispatch_capture": False} for kw in fake.npu.capture_kwargs)
    graphs = npu.core.runner.graphs.graphs
    assert all(isinstance(g, DecodeGraphTasks) and len(g.tasks) == 3 for g in graphs.values())
    steps = npu.telemetry.snapshot()[0]
    full = [s for s in steps if s.graph_kind == "FULL"]
    assert full and all(s.phase == "decode" for s in full)
    assert {s.graph_size for s in full} >= {4, 2, 1} and any(s.graph_size > s.num_decode_tokens
                                                             for s in full)
    assert sum(g.graph.replays for g in graphs.values()) == len(full)
    piecewise = [s for s in steps if s.graph_kind == "PIECEWISE"]
    assert bool(npu.info().piecewise_sizes) == (mode == "full")
    assert all(s.num_prefill_tokens for s in piecewise) and (mode == "full" or not piecewise)
    assert fake.npu.host_copies.counts["unpinned"] == 0


def test_the_fake_catches_staging_from_pageable_memory(qwen3_d128, reference_tokens,
                                                       monkeypatch):
    """The proof that the staging's pinning matters, and that the fake would see it go: with
    NpuPlatform.pinned made a no-op, the step's one copy comes from pageable memory, which
    the fake (like torch_npu) reads only when the host next synchronizes or an NPU op runs;
    the embedding and the metadata's int32 conversions have by then read the device buffer
    as the step before left it: the tokens go wrong, or a stale block id is out of range."""
    from workbench.platforms.npu import NpuPlatform
    fake = fake_torch_npu.install(monkeypatch, fp32=True)
    monkeypatch.setattr(NpuPlatform, "pinned", lambda self, t: t)
    npu = Engine(model=str(qwen3_d128), device="npu", **KW, graph_mode="eager")
    prompts = random_prompts(3, 5, 100, 1000, seed=5)
    params = _params(8, 8, 8)
    try:
        got = [o.token_ids for o in npu.generate(prompts, params)]
    except (IndexError, RuntimeError):      # a stale block id, out of range
        got = None
    assert fake.npu.host_copies.counts["unpinned"] > 0
    assert got != reference_tokens(prompts, params)


def test_npu_graph_update_order_does_not_rest_on_the_sampler(qwen3_d128, monkeypatch):
    """replay_graph synchronizes itself: two replays back to back, with nothing reading
    their output in between, are fine; the orders the fake refuses would be wrong on
    hardware (an update landing in the previous replay, or a replay that waits forever)."""
    fake_torch_npu.install(monkeypatch, fp32=True)
    npu = Engine(model=str(qwen3_d128), device="npu", **KW, graph_mode="decode",
                 cudagraph_capture_sizes=[2])
    platform, g = npu.core.platform, npu.core.runner.graphs.graphs[2]
    lens = torch.tensor([1, 1], dtype=torch.int32)
    platform.replay_graph(g, lens)
    platform.replay_graph(g, lens)
    npu.core.platform.synchronize()
    stream = torch.npu.Stream()
    platform.replay_graph(g, lens)        # replayed, not synchronized: ...
    g.graph.replay = lambda: None         # ... then the old order: update, replay, no sync
    with pytest.raises(RuntimeError, match="never synchronized"):
        g.update(platform.torch_npu, stream, lens)
    del g.graph.replay
    npu.core.platform.synchronize()                   # the queued replay runs to its end
    with pytest.raises(RuntimeError, match="not waiting in a replay"):
        g.update(platform.torch_npu, stream, lens)    # an update with no replay waiting
    g.graph.replay()                                  # a replay nobody updates
    with pytest.raises(RuntimeError, match="hangs"):
        npu.core.platform.synchronize()
    with pytest.raises(RuntimeError, match="context lengths"):
        platform.replay_graph(g)


def test_fake_models_a_release_whose_auto_dispatch_misses_paged_attention(monkeypatch):
    """The fake's side of the first point: with auto_dispatch_capture, update() reaches the
    paged attention on 2.9.0.post4 and silently misses it on 2.8.0."""
    results = {}
    for release in ("2.8.0", "2.9.0.post4"):
        fake = fake_torch_npu.install(monkeypatch, version=release, fp32=True)
        torch.manual_seed(0)
        k_cache, v_cache = torch.randn(2, 2, 128, 1, 128).unbind(0)
        q, out = torch.randn(1, 2, 128), torch.zeros(1, 2, 128)
        table = torch.tensor([[0, 1]], dtype=torch.int32)
        args = dict(query=q, key_cache=k_cache, value_cache=v_cache, num_kv_heads=1,
                    num_heads=2, scale_value=0.1, block_table=table, out=out)
        g = torch.npu.NPUGraph()
        with torch.npu.graph(g, auto_dispatch_capture=True):
            fake._npu_paged_attention(**args, context_lens=torch.tensor([1], dtype=torch.int32),
                                      workspace=torch.empty(1 << 16, dtype=torch.uint8))
        g.update(cpu_update_input=[{"context_lens": torch.tensor([200], dtype=torch.int32)}])
        g.replay()
        results[release] = out.clone()
    want = torch.zeros(1, 2, 128)
    fake._npu_paged_attention(**{**args, "out": want},
                              context_lens=torch.tensor([200], dtype=torch.int32))
    assert torch.allclose(results["2.9.0.post4"], want)
    assert not torch.allclose(results["2.8.0"], want)


def test_npu_refuses_head_sizes_the_chip_does_not_take(tiny_checkpoints, tmp_path, monkeypatch):
    """Checked at engine build, naming the size: the fused prefill would otherwise fail at
    the first prompt with error 561002."""
    fake_torch_npu.install(monkeypatch, fp32=True)
    path, _ = tiny_checkpoints["qwen3"]                        # head size 48
    with pytest.raises(ValueError, match="head size 48 .* takes 128"):
        Engine(model=str(path), device="npu", **KW)
    make_tiny_checkpoint(tmp_path, "qwen3", head_dim=64)
    with pytest.raises(ValueError, match="head size 64 .*CANN 8.3.RC1"):
        Engine(model=str(tmp_path), device="npu", **KW)
    # 64 as well from CANN 8.3.RC2 on, as vLLM-Ascend runs it (npu.HEAD_SIZE_64_FROM)
    for release, cann in (("2.8.0", "8.3.RC2"), ("2.8.0.post2", None), ("2.9.0.post4", None)):
        fake_torch_npu.install(monkeypatch, version=release, cann=cann, fp32=True)
        e = Engine(model=str(tmp_path), device="npu", **KW)
        assert len(e.generate([[5, 6, 7]], SamplingParams(max_tokens=3))[0].token_ids) == 3
        assert e.core.platform.report.head_sizes == (64, 128)
    from workbench.platforms.npu import supported_head_sizes
    # before 8.3.RC1 the ATB path (vLLM-Ascend ran head size 64 there), 8.3.RC1's TND 128
    # only (test_npu_releases.py)
    for cann, sizes in (("8.2.RC1", (64, 128)), ("8.3.RC1", (128,)), ("8.3.RC1.alpha002", (128,)),
                        ("8.3.RC2", (64, 128)), ("8.5.0", (64, 128)), ("9.0.T102", (64, 128)),
                        ("9.1.0", (64, 128)), (None, (64, 128)), ("unknown", (64, 128))):
        assert supported_head_sizes(cann) == sizes, cann


@pytest.mark.parametrize("soc,chip", [(202, "310P"), (260, "950"), (100, "unknown")])
def test_npu_refuses_chips_it_was_not_written_for(qwen3_d128, monkeypatch, soc, chip):
    fake_torch_npu.install(monkeypatch, soc=soc, fp32=True)
    with pytest.raises(ValueError, match=f"soc_version {soc} is an Ascend {chip} chip"):
        Engine(model=str(qwen3_d128), device="npu", **KW)


def test_npu_graphs_need_the_workspace_api(qwen3_d128, monkeypatch):
    """2.5.1.post1 has no workspace for _npu_paged_attention: graph modes run eager, said so."""
    fake_torch_npu.install(monkeypatch, version="2.5.1.post1", fp32=True)
    e = Engine(model=str(qwen3_d128), device="npu", **KW, graph_mode="decode")
    assert e.info().graph_mode == "eager" and "not available on npu" in e.telemetry.notices[0]
    assert not e.core.platform.supports_graphs and "_npu_paged_attention_get_workspace" in \
        e.core.platform.report.graph_update


def test_doctor_reports_and_refuses(monkeypatch, capsys):
    from workbench.cli import main
    fake_torch_npu.install(monkeypatch, version="2.8.0", fp32=True)
    assert main(["doctor", "--device", "npu"]) == 0
    out = capsys.readouterr().out
    for text in ("2.8.0", "8.3.RC1", "Ascend910B3", "soc_version 223 (A2)", "head sizes     128",
                 "task groups", "auto_dispatch_capture", "usable"):
        assert text in out, text
    fake_torch_npu.install(monkeypatch, version="2.5.1.post1", soc=202, fp32=True)
    assert main(["doctor", "--device", "npu"]) == 1
    out = capsys.readouterr().out
    assert "REFUSED" in out and "310P" in out and "decode graphs  no" in out
    monkeypatch.delitem(__import__("sys").modules, "torch_npu")
    assert main(["doctor", "--device", "npu"]) == 2             # not installed: the hint


def test_npu_config_rules(qwen3_d128, monkeypatch):
    """The NPU backend's knob domains, enforced at build, before any weights load."""
    fake_torch_npu.install(monkeypatch, fp32=False)
    kw = dict(model=str(qwen3_d128), device="npu", **KW)
    with pytest.raises(ValueError, match="dtype: float32 is refused .*bfloat16 only"):
        Engine(**kw, dtype="float32")
    with pytest.raises(ValueError, match="attention_backend"):
        Engine(**kw, attention_backend="reference")
    with pytest.raises(ValueError, match="block_size: npu's attention pages KV in blocks of 128"):
        Engine(**kw, block_size=64)
    assert Engine(**kw, graph_mode="eager").info().config.block_size == 128


def test_npu_refuses_graphs_under_launch_blocking(qwen3_d128, monkeypatch):
    """ASCEND_LAUNCH_BLOCKING=1 makes every launch synchronous, which graph capture does not
    work with (vLLM-Ascend refuses the pair too): refused at build, before any weights load,
    naming graph_mode; the device's default counts, since it would capture; eager runs."""
    fake_torch_npu.install(monkeypatch, fp32=True)
    kw = dict(model=str(qwen3_d128), device="npu", **KW)
    monkeypatch.setenv("ASCEND_LAUNCH_BLOCKING", "1")
    for mode in ("decode", "full", None):
        with pytest.raises(ValueError, match=r"graph_mode: .*ASCEND_LAUNCH_BLOCKING=1.*"
                                             r"graph_mode='eager'"):
            Engine(**kw, graph_mode=mode)
    e = Engine(**kw, graph_mode="eager")
    assert e.info().graph_mode == "eager" and not e.core.runner.graphs
    assert len(e.generate([[5, 6, 7]], SamplingParams(max_tokens=3))[0].token_ids) == 3
    fake_torch_npu.install(monkeypatch, version="2.5.1.post1", fp32=True)    # no graphs: default is eager
    assert Engine(**kw).info().graph_mode == "eager"
    monkeypatch.setenv("ASCEND_LAUNCH_BLOCKING", "0")
    fake_torch_npu.install(monkeypatch, fp32=True)
    assert Engine(**kw, graph_mode="decode", cudagraph_capture_sizes=[1]).info().graph_mode \
        == "decode"


@pytest.mark.parametrize("mode,limit", [("decode", 3), ("full", 6)])
def test_npu_capture_out_of_stream_resources_names_the_fix(qwen3_d128, monkeypatch, mode,
                                                           limit):
    """A capture the driver has no stream resources for (error 207008; 'Alloc sq cq fail' on
    an HDK before 25.5.1) fails the build with what to change, the driver's error chained;
    any other capture failure passes through as it was. With 'full' the budget runs out in
    the piecewise captures, after the 4 decode graphs."""
    fake = fake_torch_npu.install(monkeypatch, fp32=True)
    fake.npu.max_graphs = limit
    kw = dict(model=str(qwen3_d128), device="npu", **KW, graph_mode=mode,
              cudagraph_capture_sizes=[1, 2, 4, 6])
    with pytest.raises(RuntimeError, match=rf"after {limit} graphs with error 207008.*"
                                           r"cudagraph_capture_sizes.*graph_mode='eager'") as e:
        Engine(**kw)
    assert "Stream resources are insufficient" in str(e.value.__cause__)
    fake.npu.captured, fake.npu.capture_error = 0, fake_torch_npu.OLD_HDK_SQ_CQ
    with pytest.raises(RuntimeError, match=r"Alloc sq cq fail.*HDK \(driver\) to 25\.5\.1 or "
                                           r"later.*cudagraph_capture_sizes"):
        Engine(**kw)
    fake.npu.captured, fake.npu.capture_error = 0, "fake NPU: some other capture failure"
    with pytest.raises(RuntimeError, match="^fake NPU: some other capture failure$"):
        Engine(**kw)
    fake.npu.captured, fake.npu.max_graphs = 0, None
    assert Engine(**kw).info().graph_mode == mode


def test_npu_benchmark_script_runs_small(monkeypatch, capsys):
    """benchmarks/npu.py end to end at toy sizes, in bf16 under the fake's op rules, with HF's
    reference on the CPU: one JSON line per part, the doctor's first, and every part ok (graph
    modes give eager's tokens, logits within bf16's error, the doctor's ops all ran)."""
    import importlib.util
    import json
    from pathlib import Path
    # HF's Qwen3 first, while torch_npu is absent: with the fake present, transformers would
    # take its NPU integrations (npu_fusion_attention), which the fake does not model.
    import transformers.models.qwen3.modeling_qwen3  # noqa: F401
    fake_torch_npu.install(monkeypatch, fp32=False)
    path = Path(__file__).resolve().parents[1] / "benchmarks" / "npu.py"
    spec = importlib.util.spec_from_file_location("npu_bench", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    monkeypatch.setattr(bench, "REF_DEVICE", "cpu")
    code = bench.main(["--small", "--parts", "correctness,b1,w1,w1full"])
    out = capsys.readouterr().out
    lines = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    assert [r["part"] for r in lines] == ["doctor", "correctness", "b1", "w1", "w1full"], out
    assert code == 0 and all(r["ok"] for r in lines), out[-4000:]
    r = {line["part"]: line for line in lines}
    assert r["doctor"]["chip"] == "A2" and all(c["ran"] for c in r["doctor"]["ops"])
    modes = r["correctness"]["modes"]
    assert modes["full"]["graph_mode_run"] == "full" and modes["full"]["piecewise_steps"] > 0
    assert modes["full"]["full_steps"] == 0 and modes["decode"]["full_steps"] > 0
    assert r["b1"]["decode"]["graph_mode_run"] == "decode" and r["b1"]["eager_over_full"] > 0
    assert r["w1"]["full_steps"] > 0 and r["w1full"]["piecewise_steps"] > 0
    assert "# send back the 5 JSON lines above" in out


def test_npu_benchmark_reports_a_failing_part_and_carries_on(monkeypatch, capsys):
    """A part that raises still prints its one line (ok false, the error), and the next
    parts run; a failed doctor op makes the doctor's line not ok."""
    import importlib.util
    import json
    from pathlib import Path
    fake = fake_torch_npu.install(monkeypatch, fp32=False)

    def broken(*a, **kw):
        raise RuntimeError("aclnnFusedInferAttentionScore failed")
    monkeypatch.setattr(fake, "npu_fused_infer_attention_score", broken)
    path = Path(__file__).resolve().parents[1] / "benchmarks" / "npu.py"
    spec = importlib.util.spec_from_file_location("npu_bench_fail", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    assert bench.main(["--small", "--parts", "w1"]) == 1
    lines = [json.loads(x) for x in capsys.readouterr().out.splitlines() if x.startswith("{")]
    doctor, w1 = lines
    assert not doctor["ok"] and doctor["ops"][2]["name"] == "chunk"
    assert "ascend-toolkit/set_env.sh" in doctor["ops"][2]["fix"]
    assert not w1["ok"] and "aclnnFusedInferAttentionScore failed" in w1["error"]


@pytest.mark.parametrize("release,verify_op", [("2.6.0", "splitfuse"), ("2.8.0", "fia"),
                                               ("2.8.0.post2", "fia")])
def test_npu_verify_steps_keep_the_reference_tokens(qwen3_d128, reference_tokens, monkeypatch,
                                                    release, verify_op):
    """Speculative decoding on each release's path (issue 40): a verify step's rows reach
    attention as chunks on cached context (ATB's splitfuse before CANN 8.3, the fused
    infer-attention op after), never as decodes; greedy tokens equal the CPU reference's
    with every n-gram draft verified, and the pool is whole after."""
    fake = fake_torch_npu.install(monkeypatch, version=release, fp32=True)
    seen: list[list[int]] = []                 # each call's query tokens, request by request
    op = "_" + ("splitfuse" if verify_op == "splitfuse" else "fia")
    real = getattr(fake, op)

    def spy(*a, **kw):
        if op == "_splitfuse":
            seen.append(kw["seq_len"].tolist())
        else:
            ends = [int(e) for e in kw["actual_seq_lengths"]]
            seen.append([e - s for s, e in zip([0, *ends], ends)])
        return real(*a, **kw)
    monkeypatch.setattr(fake, op, spy)
    npu = Engine(model=str(qwen3_d128), device="npu", **KW, graph_mode="eager",
                 speculative_config={"method": "ngram", "num_speculative_tokens": 3,
                                     "adaptive": False})
    prompts = [p * 3 for p in random_prompts(3, 5, 40, 1000, seed=6)]   # drafts to find
    params = _params(16, 12, 16)
    got = [o.token_ids for o in npu.generate(prompts, params)]
    assert got == reference_tokens(prompts, params)
    steps = npu.telemetry.snapshot()[0]
    verifies = [s for s in steps if s.num_draft_tokens and not s.num_prefill_tokens]
    assert verifies and npu.telemetry.spec_decode.num_draft_tokens > 0
    # every layer of every verify step ran the op on a request of 2 to k + 1 query tokens
    layers = npu.info().num_layers
    assert sum(any(2 <= n <= 4 for n in lens) for lens in seen) >= layers * len(verifies)
    assert npu.stats().kv_blocks_used == 0
