"""The Ascend path on each torch_npu / CANN release people run (issue 38), on the real
NpuPlatform over the fake torch_npu, which takes a release and enforces what op-plugin's docs
of that release state (fake_torch_npu.RELEASES, tnd_rules).

- every listed release (2.5.1 / CANN 8.1.RC1, 2.6.0 / 8.2.RC1, 2.7.1 and 2.8.0 / 8.3.RC1) and
  a later one gives the CPU reference's greedy tokens, each through the path vLLM-Ascend ran
  there (npu.attention_path): before 8.3.RC1 the ATB ops (flash attention, splitfuse, paged
  attention), on 8.3.RC1 the fused infer-attention op with decode-only steps on eager paged
  attention, from 8.3.RC2 the fused op for every step;
- fp16 is refused at build where TND layout would run it (bf16 only), taken where ATB runs;
- decode graphs are captured with lengths their tables hold;
- the fused op's mask is vLLM-Ascend's int8 2048 x 2048, made on the host;
- a failed task update fails its step and leaves no replay waiting: the engine serves on;
- captures after the first skip gc / empty_cache / synchronize, buckets start at 1 token, and
  the graph count stays within the stream budget.
Each was seen failing against the code before this change (see the commit message).
"""
from __future__ import annotations

import pytest
import torch

import fake_torch_npu
from conftest import make_tiny_checkpoint, random_prompts
from workbench import Engine, SamplingParams

KW = dict(num_kv_blocks=24, max_num_seqs=4, max_num_batched_tokens=96,
          enable_prefix_caching=True)
PATHS = {   # release -> (ops that must run, ops that must not)
    "2.5.1": ({"flash", "splitfuse", "paged"}, {"fia"}),
    "2.6.0": ({"flash", "splitfuse", "paged"}, {"fia"}),
    "2.7.1": ({"fia", "paged"}, {"flash", "splitfuse"}),
    "2.8.0": ({"fia", "paged"}, {"flash", "splitfuse"}),
    "2.8.0.post2": ({"fia"}, {"flash", "splitfuse", "paged"}),
}


def _params(*ns):
    return [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True) for n in ns]


@pytest.fixture(scope="module")
def workload(qwen3_d128):
    """Prompts that make every kind of step: a first step of prompts only (nothing cached),
    chunks of a 150-token prompt (budget 96), mixed steps, decode-only steps, and a prompt
    sharing a cached 128-token prefix."""
    prompts = random_prompts(3, 5, 40, 1000, seed=11) + random_prompts(1, 150, 150, 1000, seed=12)
    params = _params(6, 9, 4, 7)
    later = [prompts[3][:130] + [5, 6, 7]]
    ref = Engine(model=str(qwen3_d128), **KW, device="cpu", attention_backend="reference",
                 block_size=128)
    want = [o.token_ids for o in ref.generate(prompts, params)]
    want += [o.token_ids for o in ref.generate(later, _params(5))]
    return prompts, params, later, want


@pytest.mark.parametrize("release", list(PATHS))
def test_greedy_tokens_equal_the_reference_under_every_release(qwen3_d128, workload,
                                                                monkeypatch, release):
    fake = fake_torch_npu.install(monkeypatch, version=release, fp32=True)
    prompts, params, later, want = workload
    e = Engine(model=str(qwen3_d128), device="npu", **KW)
    got = [o.token_ids for o in e.generate(prompts, params)]
    got += [o.token_ids for o in e.generate(later, _params(5))]
    assert got == want
    ran, never = PATHS[release]
    assert ran <= set(fake.calls) and not never & set(fake.calls), dict(fake.calls)
    steps = e.telemetry.snapshot()[0]
    assert {"prefill", "decode", "mixed"} <= {s.phase for s in steps}
    assert any(s.num_cached_tokens for s in steps)
    path = e.core.platform.report.attention
    assert path.startswith({"2.5.1": "atb", "2.6.0": "atb"}.get(
        release, "fia+pa" if release in ("2.7.1", "2.8.0") else "fia:"))


def test_the_fake_refuses_todays_tnd_call_before_cann_8_3(monkeypatch):
    """What op-plugin 480bc43's doc says TND takes on the 2.5.1.post1 / 2.6.0 line: head size
    192 only, equal head counts, no block table; and bf16 only on every release."""
    fake = fake_torch_npu.install(monkeypatch, version="2.6.0")
    q = torch.zeros(3, 4, 128, dtype=torch.bfloat16)
    cache = torch.zeros(2, 128, 2 * 128, dtype=torch.bfloat16)
    mask = torch.ones(2048, 2048).triu(1).to(torch.int8)
    kw = dict(atten_mask=mask, actual_seq_lengths=[3], actual_seq_lengths_kv=[3],
              block_table=torch.zeros(1, 1, dtype=torch.int32), num_heads=4, scale=0.1,
              input_layout="TND", num_key_value_heads=2, sparse_mode=3, block_size=128)
    with pytest.raises(RuntimeError, match=r"head size 128 \(CANN 8.2.RC1 takes \(192,\)\)"):
        fake.npu_fused_infer_attention_score(q, cache, cache, **kw)
    fake = fake_torch_npu.install(monkeypatch, version="2.8.0")
    fake.npu_fused_infer_attention_score(q, cache, cache, **kw)
    with pytest.raises(TypeError, match="TND takes query in bfloat16"):
        fake.npu_fused_infer_attention_score(q.half(), cache.half(), cache.half(), **kw)
    with pytest.raises(RuntimeError, match="out must be contiguous"):
        fake._npu_paged_attention(
            query=q[:2], key_cache=cache.view(2, 128, 2, 128), value_cache=cache.view(
                2, 128, 2, 128), num_kv_heads=2, num_heads=4, scale_value=0.1,
            block_table=torch.zeros(2, 1, dtype=torch.int32),
            context_lens=torch.ones(2, dtype=torch.int32), out=q[:4:2])
    fake = fake_torch_npu.install(monkeypatch, version="2.6.0")
    with pytest.raises(TypeError, match="unexpected keyword"):
        fake._npu_paged_attention(
            query=q[:2], key_cache=cache.view(2, 128, 2, 128), value_cache=cache.view(
                2, 128, 2, 128), num_kv_heads=2, num_heads=4, scale_value=0.1,
            block_table=torch.zeros(2, 1, dtype=torch.int32),
            context_lens=torch.ones(2, dtype=torch.int32), out=q[:2].clone(),
            workspace=torch.empty(1 << 16, dtype=torch.uint8))


def test_fp16_refused_where_tnd_runs_it_taken_where_atb_does(qwen3_d128, monkeypatch):
    """TND takes bfloat16 only (op-plugin 691bf15 doc, line 224): refused at build naming
    the reason, not at the first prefill; the ATB path of releases before CANN 8.3.RC1
    takes fp16."""
    for release in ("2.7.1", "2.8.0", "2.8.0.post2"):
        fake_torch_npu.install(monkeypatch, version=release)
        with pytest.raises(ValueError, match=r"dtype: float16 .*bfloat16 only.*"
                                             r"dtype='bfloat16'"):
            Engine(model=str(qwen3_d128), device="npu", **KW, dtype="float16")
    fake = fake_torch_npu.install(monkeypatch, version="2.6.0")
    e = Engine(model=str(qwen3_d128), device="npu", **KW, dtype="float16")
    out = e.generate(random_prompts(2, 5, 30, 1000, seed=2), _params(3, 3))
    assert [len(o.token_ids) for o in out] == [3, 3] and fake.calls["flash"]


def test_head_size_64_by_release(tmp_path, monkeypatch):
    """64: on the ATB path (vLLM-Ascend ran Qwen2.5-0.5B there) and from CANN 8.3.RC2; not
    on 8.3.RC1, whose TND takes 128 (and 192) only, naming the release needed."""
    make_tiny_checkpoint(tmp_path, "qwen3", head_dim=64)
    fake_torch_npu.install(monkeypatch, version="2.8.0")
    with pytest.raises(ValueError, match=r"head size 64 .*CANN 8.3.RC1.*needs CANN 8.3.RC2"):
        Engine(model=str(tmp_path), device="npu", **KW)
    for release, cann in (("2.6.0", None), ("2.8.0", "8.3.RC2"), ("2.8.0.post2", None)):
        fake_torch_npu.install(monkeypatch, version=release, cann=cann)
        e = Engine(model=str(tmp_path), device="npu", **KW, graph_mode="eager")
        assert len(e.generate([[5, 6, 7]], _params(3))[0].token_ids) == 3


def test_decode_graphs_capture_lengths_their_tables_hold(qwen3_d128, monkeypatch):
    """max_model_len 1024: tables 8 blocks wide, so the capture claims 1024 tokens, not
    vLLM-Ascend's 6144 (48 blocks), which the fake refuses as past the table."""
    fake_torch_npu.install(monkeypatch, version="2.8.0", fp32=True)
    e = Engine(model=str(qwen3_d128), device="npu", **KW, graph_mode="decode",
               cudagraph_capture_sizes=[1, 2])
    graphs = e.core.runner.graphs
    assert graphs.tables.shape[1] == 8
    for size, g in graphs.graphs.items():
        for task in g.tasks:
            assert task.handle.kwargs["context_lens"].tolist() == [1024] * size


def test_fused_mask_is_vllm_ascends_int8_made_on_the_host(qwen3_d128, monkeypatch):
    fake_torch_npu.install(monkeypatch, version="2.8.0.post2", fp32=True)
    made_on = []
    triu = torch.triu

    def spy(t, *a, **kw):
        made_on.append(t.device.type)
        return triu(t, *a, **kw)
    monkeypatch.setattr(torch, "triu", spy)
    e = Engine(model=str(qwen3_d128), device="npu", **KW, graph_mode="eager")
    mask = e.core.runner.backend.causal_mask(None)
    assert mask.dtype == torch.int8 and mask.shape == (2048, 2048) and made_on == ["cpu"]
    assert torch.equal(mask, torch.ones(2048, 2048, dtype=torch.int8).triu(1))


def test_a_failed_task_update_fails_its_step_not_the_engine(qwen3_d128, monkeypatch):
    """An exception between replay and the task update: the step raises, every captured
    attention's event is recorded (no replay left waiting: the fake's synchronize would say
    it hangs), and the next steps replay the same graph correctly. The failure comes at a
    later replay than the first, so the tasks it did not reach still name the workspace the
    step before handed them, which must outlive the new query (else: use after free)."""
    fake = fake_torch_npu.install(monkeypatch, version="2.8.0", fp32=True)
    ref = Engine(model=str(qwen3_d128), **KW, device="cpu", attention_backend="reference",
                 block_size=128)
    prompts = random_prompts(2, 5, 30, 1000, seed=9)
    want = [o.token_ids for o in ref.generate(prompts, _params(6, 6))]
    e = Engine(model=str(qwen3_d128), device="npu", **KW, graph_mode="decode",
               cudagraph_capture_sizes=[1, 2])
    platform, g = e.core.platform, e.core.runner.graphs.graphs[2]
    real = fake.npu.graph_task_update_begin
    calls = []

    def flaky(stream, handle):
        calls.append(1)
        if len(calls) == len(g.tasks) + 2:    # the second layer's update of the second replay
            raise RuntimeError("aclmdlRIUpdateTask failed")
        return real(stream, handle)
    monkeypatch.setattr(fake.npu, "graph_task_update_begin", flaky)
    platform.replay_graph(g, torch.tensor([3, 4], dtype=torch.int32))
    with pytest.raises(RuntimeError) as failed:
        platform.replay_graph(g, torch.tensor([5, 7], dtype=torch.int32))
    platform.synchronize()                       # nothing waits (else: "fake NPU hangs")
    assert not fake.npu.pending
    assert "task update after replay failed (RuntimeError: aclmdlRIUpdateTask failed)" in \
        str(failed.value)
    assert [o.token_ids for o in e.generate(prompts, _params(6, 6))] == want


def test_capture_cost_and_graph_budget(qwen3_d128, monkeypatch):
    """Only the first capture runs gc.collect() / empty_cache (vLLM-Ascend's acl_graph.py);
    piecewise buckets are vLLM's capture sizes from 1 token (up to 2 * max_num_seqs: 24
    here); a budget of graphs thins them uniformly, first and last kept."""
    from workbench.platforms import npu
    kw = {**KW, "max_num_seqs": 12}
    fake = fake_torch_npu.install(monkeypatch, version="2.8.0", fp32=True)
    e = Engine(model=str(qwen3_d128), device="npu", **kw)
    assert e.info().piecewise_sizes == (1, 2, 4, 8, 16, 24)
    assert fake.npu.captured == 6 * 4          # a graph per layer and bucket, and the last piece
    assert fake.npu.capture_collects == 1 and fake.npu.capture_empty_caches == 1
    e.generate([[5, 6, 7]], _params(4))
    steps = e.telemetry.snapshot()[0]
    assert any(s.phase == "decode" and s.graph_size == 1 for s in steps)
    monkeypatch.setattr(npu, "MAX_GRAPHS", 14)
    fake = fake_torch_npu.install(monkeypatch, version="2.8.0", fp32=True)
    e = Engine(model=str(qwen3_d128), device="npu", **kw)
    assert e.info().piecewise_sizes == (1, 4, 24) and fake.npu.captured == 12


def test_doctor_report_file(monkeypatch, tmp_path, capsys):
    """`--report FILE`: versions, the path, every check's outcome and the refusals, as JSON;
    on 2.6.0 the ATB path's calls are what the checks ran."""
    import json

    from workbench.cli import main
    fake = fake_torch_npu.install(monkeypatch, version="2.6.0")
    path = tmp_path / "doctor.json"
    assert main(["doctor", "--device", "npu", "--report", str(path)]) == 0
    r = json.loads(path.read_text())
    assert r["ok"] and r["versions"]["torch_npu"] == "2.6.0" and r["cann"] == "8.2.RC1"
    assert r["versions"]["soc_version"] == 223 and r["attention"].startswith("atb:")
    ops = {c["name"]: c for c in r["ops"]}
    assert [n for n in ops] == ["kv write", "decode", "chunk", "prefill", "graph", "refusals"]
    assert all(ops[n]["ran"] for n in ("kv write", "decode", "chunk", "prefill"))
    assert ops["graph"]["skipped"] and ops["refusals"]["detail"] == \
        "fp16 taken; head size 64 taken"
    assert fake.calls["flash"] == 1 and fake.calls["splitfuse"] == 1 and fake.calls["paged"] == 1
    assert "written to" in capsys.readouterr().out


def test_the_fake_holds_what_a_graph_did_not_allocate_weakly(monkeypatch):
    """A graph keeps the memory it allocated in its pool, not the tensors it only read: one
    freed after capture makes the replay fail as a use after free; kept, it replays."""
    fake_torch_npu.install(monkeypatch)
    x, y = torch.ones(4), torch.zeros(4)
    g = torch.npu.NPUGraph()
    with torch.npu.graph(g):
        y.copy_(x * 2)
    x.fill_(3)
    g.replay()
    torch.npu.synchronize()
    assert y.tolist() == [6.0] * 4
    del x
    with pytest.raises(RuntimeError, match="use after free"):
        g.replay()
        torch.npu.synchronize()
