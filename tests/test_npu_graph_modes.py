"""The NPU's graph modes as vLLM-Ascend runs them, and `workbench doctor --device npu`'s op
checks, on the real NpuPlatform over the fake torch_npu (fake_torch_npu.py).

- The default ('full', NpuPlatform.default_graph_mode) is vLLM-Ascend's PIECEWISE: every
  step, decode included, replays captured pieces with the fused infer-attention op run eager
  between them; no _npu_paged_attention runs at all.
- Whole-step decode graphs with _npu_paged_attention are opt-in (graph_mode 'decode', or
  pa_shape_list), captured with every length and the workspace at 6144 tokens
  (SEQ_LEN_WITH_MAX_PA_WORKSPACE), the workspace queried again at each update.
"""
from __future__ import annotations

import pytest
import torch

import fake_torch_npu
from conftest import random_prompts
from workbench import Engine, SamplingParams
from workbench.executor.graph_runner import DecodeGraphs
from workbench.platforms.npu_attention import (SEQ_LEN_WITH_MAX_PA_WORKSPACE,
                                                  PagedAttentionTask)

KW = dict(num_kv_blocks=24, max_num_seqs=6, max_num_batched_tokens=160)
DECODE_RUN = DecodeGraphs.run


@pytest.fixture(scope="module")
def reference(qwen3_d128):
    prompts = random_prompts(4, 5, 200, 1000, seed=7)
    params = [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True) for n in (12, 4, 9, 6)]
    ref = Engine(model=str(qwen3_d128), **KW, device="cpu", attention_backend="reference",
                 block_size=128)
    return prompts, params, [o.token_ids for o in ref.generate(prompts, params)]


def test_npu_default_is_piecewise_with_fused_attention(qwen3_d128, reference, monkeypatch):
    """On CANN 8.3.RC2 and later ('fia' path; 8.3.RC1 decodes eager through paged attention,
    test_npu_releases.py)."""
    fake = fake_torch_npu.install(monkeypatch, version="2.8.0.post2", fp32=True)
    prompts, params, want = reference
    e = Engine(model=str(qwen3_d128), device="npu", **KW)
    info = e.info()
    assert info.graph_mode == "full" and info.capture_sizes == () and info.piecewise_sizes
    assert e.core.runner.graphs is None and not e.telemetry.notices and not info.async_scheduling
    assert [o.token_ids for o in e.generate(prompts, params)] == want
    steps = e.telemetry.snapshot()[0]
    decodes = [s for s in steps if s.phase == "decode"]
    assert decodes and all(s.graph_kind == "PIECEWISE" for s in decodes)
    assert not any(s.graph_kind == "FULL" for s in steps)
    assert "paged" not in fake.calls and fake.calls["fia"]


def test_npu_pa_shape_list_opts_batch_sizes_into_paged_decode_graphs(qwen3_d128, reference,
                                                                      monkeypatch):
    """Under the default mode, only the listed batch sizes replay whole-step graphs (FULL);
    every other decode step replays piecewise, as vLLM-Ascend's pa_shape_list switches."""
    fake = fake_torch_npu.install(monkeypatch, fp32=True)
    prompts, params, want = reference
    e = Engine(model=str(qwen3_d128), device="npu", **KW, pa_shape_list=[2])
    assert e.info().graph_mode == "full" and e.info().capture_sizes == (2,)
    assert [o.token_ids for o in e.generate(prompts, params)] == want
    steps = [s for s in e.telemetry.snapshot()[0] if s.phase == "decode"]
    full = [s for s in steps if s.graph_kind == "FULL"]
    assert full and all(s.graph_size == 2 and s.num_decode_tokens <= 2 for s in full)
    assert all(s.graph_kind == "PIECEWISE" for s in steps if s.num_decode_tokens > 2)
    assert fake.calls["paged"] > 0
    with pytest.raises(ValueError, match="pa_shape_list: 7 exceeds max_num_seqs"):
        Engine(model=str(qwen3_d128), device="npu", **KW, pa_shape_list=[7])
    with pytest.raises(ValueError, match="pa_shape_list: .*graph_mode='eager' captures none"):
        Engine(model=str(qwen3_d128), device="npu", **KW, pa_shape_list=[2], graph_mode="eager")


def test_npu_decode_graphs_capture_at_the_maximum_and_requery_the_workspace(
        qwen3_d128, reference, monkeypatch):
    """vLLM-Ascend's FULL_DECODE_ONLY capture: every row's length and the workspace at 6144
    (model_runner_v1.py, SEQ_LEN_WITH_MAX_PA_WORKSPACE); its update queries the workspace
    for the step's lengths (update_graph_params since #6041/#6231)."""
    fake_torch_npu.install(monkeypatch, fp32=True)
    prompts, params, want = reference
    e = Engine(model=str(qwen3_d128), device="npu", **KW, graph_mode="decode",
               cudagraph_capture_sizes=[1, 2, 4])
    graphs = e.core.runner.graphs.graphs
    for size, g in graphs.items():
        # 6144, or what the 8-block tables of max_model_len 1024 hold (npu_attention.capture_lens)
        longest = torch.full((size,), min(SEQ_LEN_WITH_MAX_PA_WORKSPACE, 8 * 128),
                             dtype=torch.int32)
        for task in g.tasks:
            assert torch.equal(task.handle.kwargs["context_lens"], longest)
        assert g.workspace.numel() == fake_torch_npu.pa_workspace_bytes(longest)
    assert [o.token_ids for o in e.generate(prompts, params)] == want
    g = graphs[4]
    used = fake_torch_npu._strong(g.tasks[0].handle.kwargs)   # held weakly by the task
    step = g.tasks[0].workspace
    assert used["workspace"].data_ptr() == step.data_ptr() != g.workspace.data_ptr()
    assert step.numel() == fake_torch_npu.pa_workspace_bytes(used["context_lens"])


def test_npu_default_counts_as_capturing_under_launch_blocking(qwen3_d128, monkeypatch):
    fake_torch_npu.install(monkeypatch, fp32=True)
    monkeypatch.setenv("ASCEND_LAUNCH_BLOCKING", "1")
    with pytest.raises(ValueError, match=r"the device's choice, which is 'full' here"):
        Engine(model=str(qwen3_d128), device="npu", **KW)


def test_doctor_runs_one_op_of_each_kind(monkeypatch, capsys):
    from workbench.cli import main
    fake = fake_torch_npu.install(monkeypatch, fp32=False)
    assert main(["doctor", "--device", "npu"]) == 0
    out = capsys.readouterr().out
    for name in ("kv write", "decode", "chunk", "prefill", "graph", "refusals"):
        assert f"  {name:<14} ran" in out, out
    # 2.8.0 / CANN 8.3.RC1: decode through paged attention, chunk and prefill through FIA;
    # the graph: two widths, three replays each, one task update a replay
    assert fake.calls["paged"] == 1 + 6 and fake.calls["fia"] == 2
    assert "fp16 refused" in out and "head size 64 refused" in out
    assert fake.npu.syncs and not fake.npu.pending
    # a torch_npu without the graph task API: the graph check is skipped, not failed (the
    # engine runs eager there and says so)
    fake_torch_npu.install(monkeypatch, version="2.5.1.post1", fp32=False)
    assert main(["doctor", "--device", "npu"]) == 0
    out = capsys.readouterr().out
    assert "  graph          skipped: " in out and "  decode         ran" in out


@pytest.mark.parametrize("op,error,check,fix", [
    ("_npu_paged_attention", OSError("libatb.so: cannot open shared object file"),
     "decode", "nnal/atb/set_env.sh"),
    ("npu_fused_infer_attention_score", RuntimeError("aclnnFusedInferAttentionScore failed"),
     "chunk", "ascend-toolkit/set_env.sh"),
])
def test_doctor_names_the_failed_op_and_the_fix(monkeypatch, capsys, op, error, check, fix):
    from workbench.cli import main
    fake = fake_torch_npu.install(monkeypatch, fp32=False)

    def fail(*a, **kw):
        raise error
    monkeypatch.setattr(fake, op, fail)
    assert main(["doctor", "--device", "npu"]) == 1
    out = capsys.readouterr().out
    line = next(i for i, text in enumerate(out.splitlines()) if text.startswith(f"  {check}"))
    failed, fixed = out.splitlines()[line:line + 2]
    assert "FAILED" in failed and str(error) in failed and fix in fixed, out
    assert "  kv write       ran" in out


def test_doctor_explains_a_capture_the_driver_refuses(monkeypatch, capsys):
    from workbench.cli import main
    fake = fake_torch_npu.install(monkeypatch, fp32=False)
    fake.npu.max_graphs = 0
    assert main(["doctor", "--device", "npu"]) == 1
    out = capsys.readouterr().out
    assert "  graph          FAILED" in out and "error 207008" in out and "HDK" in out
    assert "  prefill        ran" in out


def test_the_fake_runs_a_replay_late(monkeypatch):
    """A replay is queued, not run: it reads its inputs when the device would have run it
    (fake_torch_npu.NpuRuntime.run_queued). A same-stream op, a stream that waited, an event
    and a host read order it; a write from another stream that did not wait lands first."""
    fake = fake_torch_npu.install(monkeypatch)
    rt, side = fake.npu, torch.npu.Stream()
    x, y = torch.ones(4), torch.zeros(4)
    g = torch.npu.NPUGraph()
    with torch.npu.graph(g):
        y.copy_(x * 2)
    g.replay()
    assert rt.pending == [g]                 # queued: nothing read yet
    with torch.npu.stream(side):             # not ordered after the replay
        x.fill_(5)
    assert y.tolist() == [10.0] * 4          # the host read runs it: it reads x as it is now
    g.replay()
    side.wait_stream(torch.npu.current_stream())
    with torch.npu.stream(side):             # ordered: the replay ran first
        x.fill_(7)
    assert y.tolist() == [10.0] * 4
    g.replay()
    x.fill_(1)                               # a same-stream op runs after it
    assert y.tolist() == [14.0] * 4
    g.replay()
    event = torch.npu.Event()
    event.record()
    assert not event.query() and rt.pending
    event.synchronize()
    assert not rt.pending and y.tolist() == [2.0] * 4
    g.replay()
    assert y.sum().item() == 8.0             # .item() is a host read too
    g.replay()
    del x                                    # freed before the replay ran
    with pytest.raises(RuntimeError, match="use after free"):
        torch.npu.synchronize()


def _misordered(monkeypatch, wait: bool):
    """A runner variant that overlaps the next step's input copy with the step it just
    replayed: after DecodeGraphs.run queues the replay, it writes the next step's positions
    (each request's next token is one further on) into the static buffer on an input stream,
    which waits for the compute stream only when `wait`."""
    state = {}

    def run(self, step, b, input_ids=None):
        logits, size = DECODE_RUN(self, step, b, input_ids)
        stream = state.setdefault("stream", torch.npu.Stream())
        if wait:
            stream.wait_stream(torch.npu.current_stream())
        with torch.npu.stream(stream):
            self.positions[:size].add_(1)
        return logits, size
    monkeypatch.setattr(DecodeGraphs, "run", run)


@pytest.fixture(scope="module")
def short(qwen3_d128):
    prompts = random_prompts(3, 5, 40, 1000, seed=5)
    params = [SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)] * 3
    ref = Engine(model=str(qwen3_d128), **KW, device="cpu", attention_backend="reference",
                 block_size=128)
    return prompts, params, [o.token_ids for o in ref.generate(prompts, params)]


@pytest.mark.parametrize("release", ["2.7.1", "2.8.0"])
def test_decode_graphs_are_ordered_as_the_device_needs(qwen3_d128, short, monkeypatch,
                                                        release):
    """The engine's decode graphs under the late replay give the reference tokens on the
    releases that capture them (2.5.1 and 2.6.0 have no task API: every step runs eager). A
    runner that writes the next step's inputs into the static buffers from another stream
    before the replay ran gets other tokens, as it would on hardware; the same writes
    ordered after the replay (wait_stream) do not."""
    prompts, params, want = short
    fake = fake_torch_npu.install(monkeypatch, version=release, fp32=True)
    e = Engine(model=str(qwen3_d128), device="npu", **KW, graph_mode="decode",
               cudagraph_capture_sizes=[1, 2, 4])

    def tokens():
        got = [o.token_ids for o in e.generate(prompts, params)]
        assert fake.npu.syncs and not fake.npu.pending
        return got

    assert tokens() == want
    assert any(s.graph_kind == "FULL" for s in e.telemetry.snapshot()[0])
    _misordered(monkeypatch, wait=False)
    assert tokens() != want
    _misordered(monkeypatch, wait=True)
    assert tokens() == want
    # The replay reads the workspace its update was handed after update() has returned:
    # each task holds it (PagedAttentionTask.workspace). Not held, the late replay reads
    # freed memory.
    monkeypatch.setattr(PagedAttentionTask, "workspace",
                        property(lambda self: None, lambda self, value: None))
    platform = e.core.platform
    platform.replay_graph(e.core.runner.graphs.graphs[2], torch.tensor([3, 5], dtype=torch.int32))
    with pytest.raises(RuntimeError, match="use after free: .*_npu_paged_attention workspace"):
        platform.synchronize()
