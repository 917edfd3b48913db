"""What the fake torch_npu refuses where hardware would (fake_torch_npu.py: OP_DTYPES, the
range checks, capture that runs nothing, task updates that keep their task, blocking copies
during capture), each shown catching the code that breaks it; and bf16 end to end, one model
per architecture, against the CPU reference in bf16.

Before these rules the fake ran the ATB and FIA ops in fp32 (which they do not take),
silently read fewer blocks than a KV length needs when a table was too narrow, clipped no
slot or block id to the pool, accepted a task update of another shape, and let a capture copy
host data synchronously; every test here would have passed against the wrong code.
"""
from __future__ import annotations

import pytest
import torch

import fake_torch_npu
from conftest import make_tiny_checkpoint, random_prompts
from workbench import Engine, SamplingParams
from workbench.platforms.npu_attention import DecodeGraphTasks, NpuAttention

KW = dict(num_kv_blocks=24, max_num_seqs=6, max_num_batched_tokens=160)
SHAPES = {"qwen3": dict(head_dim=128),        # head size 128 in each, which every CANN takes
          "qwen2": dict(hidden_size=256, num_attention_heads=2, num_key_value_heads=1),
          "llama3": dict(hidden_size=256, num_attention_heads=2, num_key_value_heads=1)}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    out = {}
    for kind, shape in SHAPES.items():
        out[kind] = tmp_path_factory.mktemp(f"{kind}_d128")
        make_tiny_checkpoint(out[kind], kind, **shape)
    return out


def _greedy(e, prompts, n):
    params = SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)
    return [o.token_ids for o in e.generate(prompts, params)]


@pytest.mark.parametrize("kind", sorted(SHAPES))
def test_bf16_greedy_tokens_match_the_cpu_reference(checkpoints, monkeypatch, kind):
    """bf16 throughout, with the ops' own dtype rules. The graph modes give eager's tokens
    exactly (same ops, same dtype); against the CPU's bf16 reference, which rounds in other
    places (fused norms, attention), greedy tokens agree up to a near-tie: the first token
    of every prompt, and at each prompt's first difference the NPU's token is not worse than
    the reference's by more than 4% of the largest logit, judged by fp32 (the same model
    without bf16's rounding, recomputed by a prefill). Two bf16 runs cannot judge each other:
    on these random models bf16's logits are 8-17% (relative L2) from fp32's, the bf16 and
    fp32 references part within 1-8 tokens, and on a Sapphire Rapids VM the bf16
    reference's own prefill preferred the NPU's token by 10% of the largest logit at a
    point where its decode step had chosen the other."""
    path, prompts = str(checkpoints[kind]), random_prompts(4, 5, 300, 1000, seed=3)
    ref = Engine(model=path, **KW, device="cpu", dtype="bfloat16", attention_backend="reference",
                 block_size=128)
    want = _greedy(ref, prompts, 16)
    judge = Engine(model=path, **KW, device="cpu", dtype="float32", attention_backend="reference",
                   block_size=128)
    fake_torch_npu.install(monkeypatch, fp32=False)
    runs = {}
    for mode in ("eager", None, "decode"):
        e = Engine(model=path, device="npu", **KW, graph_mode=mode)
        assert e.info().dtype == "bfloat16"
        runs[mode] = _greedy(e, prompts, 16)
    assert runs[None] == runs["eager"] == runs["decode"]
    for got, wanted, prompt in zip(runs["eager"], want, prompts):
        assert got[0] == wanted[0]
        i = next((i for i, (a, b) in enumerate(zip(got, wanted)) if a != b), None)
        if i is None:
            continue
        fp32 = judge.core.prompt_logits(prompt + wanted[:i]).float()
        worse_by = float(fp32[wanted[i]] - fp32[got[i]])
        assert worse_by <= 0.04 * float(fp32.abs().max()), (i, worse_by)


def test_fake_refuses_fp32_where_the_ops_do(checkpoints, monkeypatch):
    """The fp32 mode the exact-token tests use is a licence the fake now has to be given:
    without it, an engine running the ATB/FIA ops in fp32 fails at its first step."""
    fake = fake_torch_npu.install(monkeypatch, fp32=True)
    e = Engine(model=str(checkpoints["qwen3"]), device="npu", **KW, graph_mode="eager")
    assert e.info().dtype == "float32"
    fake.fp32 = False
    with pytest.raises(TypeError, match="_npu_reshape_and_cache takes key in "
                                        "float16/bfloat16, got torch.float32"):
        _greedy(e, [[5, 6, 7]], 2)


def test_fake_op_dtype_rules(monkeypatch):
    fake = fake_torch_npu.install(monkeypatch, fp32=False)
    bf, x = torch.bfloat16, torch.randn(3, 128)
    with pytest.raises(TypeError, match="npu_rms_norm takes no x torch.float32 with gamma "
                                        "torch.bfloat16"):
        fake.npu_rms_norm(x, torch.ones(128, dtype=bf))
    fake.npu_rms_norm(x.to(bf), torch.ones(128))                    # bf16 x, fp32 gamma: fine
    with pytest.raises(TypeError, match="one dtype"):
        fake.npu_add_rms_norm(x.to(bf), x, torch.ones(128, dtype=bf))
    with pytest.raises(RuntimeError, match="non-contiguous"):
        fake.npu_swiglu(torch.randn(8, 3, dtype=bf).t())
    k_cache = torch.zeros(2, 128, 1, 128, dtype=bf)
    args = dict(query=torch.randn(1, 2, 128, dtype=bf), key_cache=k_cache, value_cache=k_cache,
                num_kv_heads=1, num_heads=2, scale_value=0.1,
                block_table=torch.tensor([[1]]), context_lens=torch.tensor([4], dtype=torch.int32),
                out=torch.empty(1, 2, 128, dtype=bf))
    with pytest.raises(TypeError, match="block_table must be int32"):
        fake._npu_paged_attention(**args)                          # int64 table
    with pytest.raises(TypeError, match="share a dtype"):
        fake._npu_paged_attention(**{**args, "block_table": args["block_table"].int(),
                                     "out": torch.empty(1, 2, 128)})
    with pytest.raises(TypeError, match="atten_mask bool/int8/uint8"):
        fake.npu_fused_infer_attention_score(
            args["query"], k_cache.view(2, 128, 128), k_cache.view(2, 128, 128),
            atten_mask=torch.zeros(2048, 2048), actual_seq_lengths=[1],
            actual_seq_lengths_kv=[4], block_table=args["block_table"].int(), num_heads=2,
            scale=0.1, input_layout="TND", num_key_value_heads=1, sparse_mode=3,
            block_size=128)


@pytest.mark.parametrize("bug,message", [
    ("table one block short", r"KV length \d+ of row \d+ needs \d+ blocks, its table has"),
    ("block ids past the pool", r"block id outside \[0, 24\)"),
    ("slots past the pool", r"slot outside the pool \[0, 3072\)"),
])
def test_range_rules_catch_bad_metadata(checkpoints, monkeypatch, bug, message):
    """A builder that drops a table column, shifts block ids or slots past the pool: the old
    fake read fewer blocks (a shorter context, silently) or indexed out of the pool, where
    hardware reads another request's KV or faults; now each fails at the op."""
    fake_torch_npu.install(monkeypatch, fp32=True)
    build = NpuAttention.build

    def broken(self, common):
        meta = build(self, common)
        if bug == "table one block short" and meta.prefill_block_tables is not None:
            meta.prefill_block_tables = meta.prefill_block_tables[:, :-1]
        elif bug == "block ids past the pool" and meta.decode_block_tables is not None:
            meta.decode_block_tables = meta.decode_block_tables + 24
        elif bug == "slots past the pool":
            meta.slot_mapping = meta.slot_mapping + 24 * 128
        return meta
    monkeypatch.setattr(NpuAttention, "build", broken)
    e = Engine(model=str(checkpoints["qwen3"]), device="npu", **KW, graph_mode="eager")
    with pytest.raises(RuntimeError, match=message):
        _greedy(e, random_prompts(2, 150, 200, 1000, seed=1), 3)


def test_blocking_copy_of_host_data_during_capture_is_107030(checkpoints, monkeypatch):
    """A capture that copies host values into a static buffer synchronously (here a decode
    graph that resets its positions from a Python list inside the capture) fails as the
    runtime does, naming 107030; copies made before capture, as DecodeGraphs.run makes them,
    are fine."""
    from workbench.executor.graph_runner import DecodeGraphs
    fake_torch_npu.install(monkeypatch, fp32=True)
    forward = DecodeGraphs._forward

    def resetting(self, size):
        self.positions[:size].copy_(torch.tensor([0] * size))
        return forward(self, size)
    monkeypatch.setattr(DecodeGraphs, "_forward", resetting)
    kw = dict(model=str(checkpoints["qwen3"]), device="npu", **KW, graph_mode="decode",
              cudagraph_capture_sizes=[1, 2])
    with pytest.raises(RuntimeError, match="host-to-device copy while capturing.*107030"):
        Engine(**kw)
    monkeypatch.setattr(DecodeGraphs, "_forward", forward)
    assert Engine(**kw).info().graph_mode == "decode"
    g = torch.npu.NPUGraph()
    buf = torch.zeros(3, dtype=torch.int32)
    with pytest.raises(RuntimeError, match="107030"):
        with torch.npu.graph(g):
            buf.add_(torch.tensor([1, 2, 3], dtype=torch.int64).to("cpu", dtype=torch.int32))


def test_task_update_must_keep_the_captured_shapes(monkeypatch):
    """A task update re-issues the captured task: a query of another shape (the same memory,
    fewer rows), another scale, or lengths for another batch are refused."""
    fake = fake_torch_npu.install(monkeypatch, fp32=False)
    bf = torch.bfloat16
    k_cache = torch.randn(2, 128, 1, 128, dtype=bf)
    q, out = torch.randn(2, 2, 128, dtype=bf), torch.zeros(2, 2, 128, dtype=bf)
    args = dict(query=q, key_cache=k_cache, value_cache=k_cache, num_kv_heads=1, num_heads=2,
                scale_value=0.1, block_table=torch.tensor([[1], [1]], dtype=torch.int32),
                out=out)
    tasks = DecodeGraphTasks(torch.npu.NPUGraph())
    with torch.npu.graph(tasks.graph):
        tasks.capture(fake, args, torch.ones(2, dtype=torch.int32))
    lens = torch.tensor([5, 9], dtype=torch.int32)
    ws = fake._npu_paged_attention_get_workspace(**args, context_lens=lens)
    stream, handle = torch.npu.Stream(), tasks.tasks[0].handle
    table = args["block_table"]
    for change, message in ((dict(query=q[:1], out=out[:1], block_table=table[:1],
                                  context_lens=lens[:1]), "moved or reshaped query"),
                            (dict(scale_value=0.2), "changes scale_value"),
                            (dict(context_lens=torch.tensor([5], dtype=torch.int32)),
                             "context_lens")):
        tasks.graph.replay()
        torch.npu.graph_task_update_begin(stream, handle)
        call = {**args, "context_lens": lens, "workspace": ws, **change}
        with pytest.raises((RuntimeError, TypeError), match=message):
            fake._npu_paged_attention(**call)
        torch.npu.updating = None
        tasks.update(fake, stream, lens)              # the right update lets the replay end
        torch.npu.synchronize()
    with pytest.raises(ValueError, match=r"need int32 \[2\]"):
        tasks.update(fake, stream, torch.tensor([5], dtype=torch.int32))
