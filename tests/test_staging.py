"""Host-to-device copies (executor/staging.py): every non-blocking copy in the package is one
of a short, justified list; the fake torch_npu reads an unpinned non-blocking copy late, so
the old pattern (a temporary copied without waiting) gives garbage there as on hardware;
and the staging buffers alternate and wait for a buffer's last copy before refilling it."""
from __future__ import annotations

import ast
from pathlib import Path

import numpy as np
import torch

import background
import fake_torch_npu
from workbench.executor.staging import StagingBuffers
from workbench.platforms.cpu import CpuPlatform

PKG = Path(__file__).resolve().parents[1] / "workbench"

NON_BLOCKING_ALLOWED = {
    ("executor/staging.py", "StagingBuffers.commit"):
        "a step's one host-to-device copy per consumer (the model's inputs, the sampler's "
        "metadata), from a persistent pinned buffer that is not refilled before the event "
        "recorded after the copy",
    ("engine/pipeline.py", "StepPipeline._copy_to_host"):
        "device to host: into a persistent pinned buffer (two alternate), and the logprobs "
        "into memory torch pins for a non-blocking device-to-host copy; both are read after "
        "the step's event",
}
"""(file, function) -> why its non_blocking=True copy cannot read a freed or refilled
source. Anything else is the pattern issue 25 removed."""


def non_blocking_calls(source: str) -> list[tuple[str, int]]:
    """(enclosing function's qualified name, line) of every call passing non_blocking=True."""
    found = []

    def visit(node, scope):
        for child in ast.iter_child_nodes(node):
            inner = scope
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                inner = f"{scope}.{child.name}" if scope else child.name
            if isinstance(child, ast.Call) and any(
                    k.arg == "non_blocking" and isinstance(k.value, ast.Constant)
                    and k.value.value is True for k in child.keywords):
                found.append((scope, child.lineno))
            visit(child, inner)

    visit(ast.parse(source), "")
    return found


def test_no_non_blocking_copy_outside_the_allow_list():
    bad, seen = [], set()
    for path in sorted(PKG.rglob("*.py")):
        rel = path.relative_to(PKG).as_posix()
        for scope, line in non_blocking_calls(path.read_text()):
            if (rel, scope) in NON_BLOCKING_ALLOWED:
                seen.add((rel, scope))
            else:
                bad.append(f"workbench/{rel}:{line} ({scope or 'module'}): non_blocking=True; "
                           "stage the copy (executor/staging.py) or justify it here")
    assert not bad, "\n".join(bad)
    assert seen == set(NON_BLOCKING_ALLOWED), "allow-list entries with nothing left to allow"


def test_the_guard_finds_the_old_pattern():
    old = ("class B:\n    def to_device(self, t):\n"
           "        return t.to(self.device, non_blocking=True)\n"
           "def f(x, dev):\n    dev.copy_(torch.tensor(x), non_blocking=True)\n")
    assert non_blocking_calls(old) == [("B.to_device", 3), ("f", 5)]


def test_the_fake_reads_an_unpinned_non_blocking_copy_late(monkeypatch):
    """The old pattern on the fake: a temporary overwritten after a non-blocking copy is read
    as it is when the copy runs (at the next sync or torch_npu op), one that was freed as
    garbage; from pinned memory the copy reads the source at the call."""
    fake = fake_torch_npu.install(monkeypatch)
    rt = fake.npu
    dev = torch.zeros(4, dtype=torch.long)
    tmp = torch.tensor([1, 2, 3, 4])
    dev.copy_(tmp, non_blocking=True)
    assert dev.tolist() == [0, 0, 0, 0]             # not copied yet
    tmp.fill_(7)                                     # the host reuses its temporary
    rt.synchronize()
    assert dev.tolist() == [7, 7, 7, 7]

    # The old AttentionBackend.to_device: a temporary that dies as the call returns.
    moved = torch.tensor([5, 6, 7]).to("cpu", non_blocking=True)
    rt.synchronize()
    assert moved.tolist() == [fake_torch_npu.HostCopies.GARBAGE] * 3
    lost = torch.tensor([0.5, 1.5]).to("cpu", torch.float32, non_blocking=True)
    event = rt.Event()
    event.record()
    event.synchronize()                              # an event waits for the copy too
    assert lost.isnan().all()

    pinned = torch.tensor([1, 2, 3, 4]).pin_memory()
    assert pinned.is_pinned() and not tmp.is_pinned() and pinned[1:].is_pinned()
    dev.copy_(pinned, non_blocking=True)
    pinned.fill_(0)
    rt.synchronize()
    assert dev.tolist() == [1, 2, 3, 4]
    assert rt.host_copies.counts == {"unpinned": 3, "pinned": 1}
    dev.copy_(torch.tensor([9, 9, 9, 9]))            # a blocking copy is just a copy
    assert dev.tolist() == [9, 9, 9, 9]


class _Event:
    def __init__(self, log):
        self.log, self.waited = log, False

    def synchronize(self):
        self.waited = True
        self.log.append("wait")


class _CopyingPlatform(CpuPlatform):
    """A CPU 'device' with memory of its own: the staging copies and records events."""
    has_device_memory = True

    def __init__(self):
        self.log, self.events = [], []

    def record_event(self):
        self.events.append(_Event(self.log))
        return self.events[-1]


def test_staging_copies_once_and_waits_before_refilling():
    p = _CopyingPlatform()
    st = StagingBuffers(p, capacity=16 * 8)     # bytes
    a, b = st.fill([3, 2])
    a[:] = [1, 2, 3]
    b[:] = [4, 5]
    (da, db), (ha, _) = st.commit()
    assert da.tolist() == [1, 2, 3] and db.tolist() == [4, 5] and len(p.events) == 1
    assert da.data_ptr() != ha.data_ptr() and db.data_ptr() % 16 == 0   # 16-byte aligned
    # The next step fills the other buffer: nothing to wait for yet; step 1's host views
    # keep their values.
    (c,) = st.fill([3])
    c[:] = [7, 8, 9]
    st.commit()
    assert p.log == [] and ha.tolist() == [1, 2, 3]
    # The step after refills step 1's buffer: only once step 1's copy is done.
    st.fill([1])
    assert p.log == ["wait"] and p.events[0].waited and not p.events[1].waited
    # A step larger than the buffers: they grow, after every copy in flight is done.
    big, = st.fill([40])
    big[:] = np.arange(40)
    (d,), _ = st.commit()
    assert st.capacity >= 40 * 8 and d.tolist() == list(range(40)) and p.events[1].waited


def test_staging_on_the_cpu_copies_nothing():
    st = StagingBuffers(CpuPlatform(), capacity=64)
    (a,) = st.fill([3])
    a[:] = [1, 2, 3]
    (d,), (h,) = st.commit()
    assert d is h and d.tolist() == [1, 2, 3] and not st.copies


CUDA_SHAPED = '''
import json
from triton_on_cpu import TritonOnCpu
from conftest import ReplayGraph
import workbench.engine.build as eb
from workbench import Engine, SamplingParams

class CudaShaped(TritonOnCpu):
    supports_graphs = runs_async = has_device_memory = True
    def graph_pool(self): return None
    def capture_graph(self, fn, pool):
        out = fn()
        return ReplayGraph(fn, out), out

# 5-41 tokens, 32 a step: chunked prefills, mixed steps, then decodes at batch 5 (padded
# to 8); under the interpreter every token costs (RoPE runs a program per token and head).
prompts = [[(7 * i + 3 * j) % 500 + 1 for j in range(5 + 9 * i)] for i in range(5)]
p = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
kw = dict(model="random:tiny-qwen3", device="cpu", dtype="float16", num_kv_blocks=96,
          block_size=16, max_num_batched_tokens=32, max_num_seqs=8)
want = [o.token_ids for o in Engine(**kw).generate(prompts, p)]
eb.get_platform = lambda name: CudaShaped()
e = Engine(**kw, graph_mode="decode", cudagraph_capture_sizes=[1, 2, 4, 8], async_scheduling=True)
got = [o.token_ids for o in e.generate(prompts, p)]
steps = e.telemetry.snapshot()[0]
print(json.dumps(dict(equal=got == want, attention=e.info().attention,
                      graphs=sum(s.graph_kind == "FULL" for s in steps),
                      copies=e.core.runner.staging.copies)))
'''


@background.job
def cuda_shaped_interpreted():
    """CUDA_SHAPED under the interpreter (a background job: tests/background.py)."""
    import json
    from triton_on_cpu import run_interpreted
    return json.loads(run_interpreted(CUDA_SHAPED).splitlines()[-1])


def test_a_cuda_shaped_engine_through_the_staging_gives_the_reference_tokens(
        cuda_shaped_interpreted):
    """What a CUDA engine runs, as far as the CPU can: Triton's attention (interpreted),
    decode graphs filled from the staged tensors, async scheduling, and a platform with
    memory of its own, so every step goes through the staging's copy; greedy tokens equal
    the plain-torch engine's."""
    res = cuda_shaped_interpreted
    assert res == dict(equal=True, attention="triton", graphs=res["graphs"], copies=True)
    assert res["graphs"] > 0


def test_the_samplers_inputs_reach_the_device_in_one_staged_copy():
    """SamplingMetadataBuilder (executor/sampling_metadata.py) stages everything the sampler
    reads from the host (columns, histories, logit_bias, min_tokens bans, a grammar's bitmask,
    the logits rows): one copy per build on a platform with memory of its own, none for an
    all-greedy plain step, and the same tokens as on the CPU, where nothing is copied."""
    from workbench.core.sampling_params import SamplingParams
    from workbench.executor.sampler import sample
    from workbench.executor.sampling_metadata import SamplingMetadataBuilder, SamplingRow
    vocab = 100
    logits = torch.randn(5, vocab, generator=torch.Generator().manual_seed(0)) * 3
    params = [SamplingParams(temperature=0.8, top_p=0.9, repetition_penalty=1.3),
              SamplingParams(temperature=0.7, top_k=5, frequency_penalty=0.5, seed=3),
              SamplingParams(temperature=0, logit_bias={7: 4.0}, min_tokens=4,
                             stop_token_ids=[2]),
              SamplingParams(temperature=1.1, min_p=0.05, logprobs=2)]
    bitmask = torch.full((2, 4), -1, dtype=torch.int32)
    bitmask[0, 0] = 0b1010                                # row 1: tokens 1, 3 and 32..99
    bitmask[1, 1:] = 0                                    # row 3: tokens 0..31

    def run(platform):
        gens = [torch.Generator().manual_seed(3)]
        rows = [SamplingRow(p, [1, 2, 3, 4, 5, 4][:3 + i], 3, gens[0] if p.seed else None)
                for i, p in enumerate(params)]
        md = SamplingMetadataBuilder(platform, vocab, {0}).build(
            rows, shared=torch.Generator().manual_seed(1), logits_rows=[4, 0, 2, 2],
            bitmask=bitmask, bitmask_rows=[1, 3])
        out = sample(logits, md)
        return out.token_ids.tolist(), out.logprobs.logprobs.tolist()

    copying = _CopyingPlatform()
    assert run(copying) == run(CpuPlatform())
    assert len(copying.events) == 1
    ids, _ = run(CpuPlatform())
    assert ids[1] in (1, 3) or ids[1] >= 32
    assert ids[3] < 32 and ids[2] not in (0, 2)
    greedy = SamplingMetadataBuilder(copying, vocab).build(
        [SamplingRow(SamplingParams(temperature=0), [1], 1)] * 3)
    assert len(copying.events) == 1 and greedy.draw is greedy.processors is None
