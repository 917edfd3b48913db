"""A stand-in for `torch_npu` on CPU tensors, for driving the real NpuPlatform without an NPU.

torch_npu cannot be installed here (without CANN it breaks `import torch`), so `install()`
puts this module object into `sys.modules["torch_npu"]` and its runtime at `torch.npu`.
Everything below was written from torch_npu's and op-plugin's sources and docs and from how
vLLM-Ascend calls them (see shared/notes/torch_npu.md); none of it was checked against
hardware. It takes a release (RELEASES: torch_npu 2.5.1, 2.5.1.post1, 2.6.0, 2.7.1, 2.8.0
and later, each with its CANN and the op-plugin commit read) and models:

- what that release's ops take (tnd_rules: TND head sizes, GQA and paged KV per CANN, bf16
  only; the ATB flash-attention and splitfuse ops with vLLM-Ascend's masks, checked causal;
  `out` contiguous; table widths covering the lengths, at capture too; workspace= only where
  the release has it);
- that a captured graph holds the tensors it did not allocate itself only weakly: a replay
  after one was freed fails as a use after free (the graph's pool keeps only its own);
- the first steps of torch_npu's graph context (synchronize, gc.collect, empty_cache),
  through the module attributes the platform may patch out, counted;

- the ops, computing what their docs say on CPU tensors, with the argument rules they state
  (keyword names, int32 slots/tables, host int32 context lengths, TND cumulative ends,
  sparse_mode 3 with the 2048 x 2048 mask, block_size x head size <= 128 x 128, the head
  sizes TND takes on this CANN, which chip has which op);
- graphs as traces: inside `torch.npu.graph(...)` every aten op and every fake op is
  recorded with the tensors it used (a TorchDispatchMode); replay re-executes the trace on
  those same tensors, so host values read at capture stay baked in, as on hardware;
- replays run late, as the device runs them: `replay()` only queues the graph on the current
  stream, and it reads and writes its tensors when something orders it after the call:
  `synchronize()` (device or stream); an Event recorded after it, at its `synchronize()` or
  `wait()`; another stream's `wait_stream` on its stream; any op issued later on the same
  stream, as far as the fake can see one: a fake torch_npu op, the next replay, a
  non-blocking copy, or an aten op with a tensor argument that is not a view (issued on
  install()'s thread, where a TorchDispatchMode sees them; a replay from another thread is
  refused); and a host read of a tensor that is not pinned (`.tolist()`, `.cpu()`,
  `.item()`). Nothing else runs it: an op issued on another stream that did not wait runs
  at once, before the queued replay (so a write from there into a graph's static input is
  read by that replay, and a read from there sees the outputs before it), and a tensor the
  graph reads that is freed before the replay ran is a use after free (below). Only
  replays are queued: other work on a side stream runs at the call, so the opposite
  mistake (a stream not waiting for a side stream's work) goes unseen. The fake
  cannot tell host tensors from device ones (all are CPU tensors) nor which tensors an op
  touches, so it orders every such op after the queue, a host-side op on unpinned memory
  included, where hardware would not wait: a mistake only that would show goes unseen;
- task groups: an op between graph_task_group_begin/end is a task whose arguments
  graph_task_update_begin/end can replace; an ExternalEvent waited on in the capture stops
  a replay there until the event is recorded, so a replay whose tasks are never updated
  hangs (synchronize raises, and so does an op ordered behind it);
- the ordering rules vLLM-Ascend keeps: a task update needs its graph to be waiting in a
  replay, and no earlier replay left unsynchronized (else it could land in that one: one
  that ran to its end and was not synchronized since, or a queued one whose task was
  released already, its event recorded), on a stream that is not the capture stream;
- the paged-attention workspace: its size depends on the lengths (short ones can need more
  than one), the op checks it at every execution, and inside a graph or an update a call
  without one is refused (it would allocate outside the graph's pool);
- auto_dispatch_capture: NPUGraph.update(cpu_update_input=...) replaces the host arguments
  of the ops it recorded, and on the releases that record no _npu_paged_attention it
  updates nothing and says nothing;
- what the ops refuse (OP_DTYPES and the `_check_*` methods): dtypes per op as their docs
  state them, and the ranges the ATB/aclnn docs leave to the caller (slots inside the pool,
  block ids in [0, num_blocks), KV lengths within a row's table, cumulative TND ends); fp32
  passes only where a test installs the fake with fp32=True, to compare tokens exactly;
- that capture runs nothing: an in-place op (KV write, paged attention) is checked and
  recorded, not executed, so the capture-time lengths vLLM-Ascend uses (6144, past any table
  here) are only ever read if a replay runs without its update; a blocking copy of host data
  into a tensor while capturing fails with error 107030's text (vLLM-Ascend#6002);
- a task update must match its captured task: the same op, the same scalars, the captured
  tensors at their addresses and shapes, context lengths of the captured shape; only the
  lengths and the workspace (re-queried per step, as vLLM-Ascend does) change;
- the driver's stream budget: with `torch.npu.max_graphs` set, the capture after that many
  fails as it begins, with `torch.npu.capture_error` (error 207008 by default; an HDK older
  than 25.5.1 says 'Alloc sq cq fail' instead);
- asynchronous copies (HostCopies): pinned host memory (`Tensor.pin_memory()`), and a
  `non_blocking=True` copy from an unpinned source that reads its source only later, when
  the host synchronizes or at the next torch_npu op or replay: a temporary overwritten
  meanwhile is read as it is then, one freed meanwhile as garbage, as the copy engine would
  on hardware (torch_npu queues the raw pageable pointer). A copy from pinned memory reads
  it at the call. Either is issued behind the replays queued on its stream (they run
  first). `torch.npu.Event` waits for the copies too.
"""
from __future__ import annotations

import gc
import importlib.machinery
import math
import sys
import threading
import types
import weakref
from collections import Counter
from contextlib import contextmanager

import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map

RELEASES = {
    # version: the CANN it pairs with (Ascend/pytorch README at 9e73e70, the release table),
    # the op-plugin commit its ops were read at, whether _npu_paged_attention has workspace=
    # and _npu_paged_attention_get_workspace exists (op-plugin 691bf15,
    # op_plugin/ops/atb/PagedAttentionAtb.cpp lines 91-92; absent at 480bc43 and 8abaa31),
    # whether auto_dispatch_capture records _npu_paged_attention (issue 15).
    "2.5.1": dict(cann="8.1.RC1", op_plugin="8abaa31", workspace=False, records_pa=False),
    "2.5.1.post1": dict(cann="8.2.RC1", op_plugin="480bc43", workspace=False, records_pa=False),
    "2.6.0": dict(cann="8.2.RC1", op_plugin="480bc43", workspace=False, records_pa=False),
    "2.7.1": dict(cann="8.3.RC1", op_plugin="691bf15", workspace=True, records_pa=False),
    "2.8.0": dict(cann="8.3.RC1", op_plugin="691bf15", workspace=True, records_pa=False),
    "2.8.0.post2": dict(cann="8.5.0", op_plugin=None, workspace=True, records_pa=True),
    "2.9.0.post4": dict(cann="9.0.0", op_plugin=None, workspace=True, records_pa=True),
}
LISTED = ("2.5.1", "2.6.0", "2.7.1", "2.8.0")
"""The releases issue 38 names: every one must give the CPU reference's greedy tokens."""
NO_STREAM_RESOURCE = ("capture_begin:NPUGraph.cpp NPU function error: "
                      "c10_npu::acl::AclmdlRICaptureBegin(capture_stream_, capture_mode), error "
                      "code is 207008\n[Error]: Stream resources are insufficient.")
OLD_HDK_SQ_CQ = ("capture_begin:NPUGraph.cpp NPU function error: "
                 "c10_npu::acl::AclmdlRICaptureBegin(capture_stream_, capture_mode)\n"
                 "[Error]: Alloc sq cq fail.")
SOCS = {223: "Ascend910B3", 253: "Ascend910_9392", 202: "Ascend310P3", 260: "Ascend950PR"}
HALF = (torch.float16, torch.bfloat16)
OP_DTYPES = {
    # ATB ReshapeAndCacheOperation / PagedAttentionOperation (hiascend ascendtbapi, CANN 8.2.RC1,
    # ascendtb_01_0206): query, key/value and caches float16/bf16 (int8 only when quantised);
    # block tables int32 on the device, context lengths int32 on the host.
    "_npu_reshape_and_cache": HALF,
    "_npu_paged_attention": HALF,
    # the same ATB operations behind (op-plugin 8abaa31, op_plugin/ops/atb/
    # PagedAttentionSplitfuse.cpp:58 PagedAttentionOperation with MASK_TYPE_SPEC;
    # SelfAttentionAtb.cpp:63 SelfAttentionOperation PA_ENCODER): float16/bf16, the mask
    # in the query's dtype (vLLM-Ascend's AttentionMaskBuilder at v0.10.1rc1)
    "_npu_paged_attention_splitfuse": HALF,
    "_npu_flash_attention": HALF,
    # op-plugin docs/zh/custom_APIs/torch_npu/torch_npu-npu_fused_infer_attention_score.md:
    # query float16/bfloat16, key/value those (or int8/int4 quantised), contiguous;
    # atten_mask bool/int8/uint8; block_table int32, two-dimensional.
    "npu_fused_infer_attention_score": HALF,
    # ... and in TND layout bfloat16 only (691bf15 line 224, 480bc43 line 234): _fia
    "npu_fused_infer_attention_score TND": (torch.bfloat16,),
    # op-plugin (beta)torch_npu-npu_swiglu.md, torch_npu-npu_add_rms_norm.md: float32,
    # float16 or bfloat16; swiglu's input must be contiguous; add_rms_norm's gamma has x1's
    # dtype.
    "npu_swiglu": (torch.float32, *HALF),
    "npu_add_rms_norm": (torch.float32, *HALF),
}
RMS_NORM_PAIRS = {(torch.float16, torch.float32), (torch.bfloat16, torch.float32),
                  (torch.float16, torch.float16), (torch.bfloat16, torch.bfloat16),
                  (torch.float32, torch.float32)}
"""(x, gamma) dtypes npu_rms_norm takes on Atlas A2/A3 ((beta)torch_npu-npu_rms_norm.md)."""
H2D_DURING_CAPTURE = ("fake NPU: synchronous host-to-device copy while capturing a graph: "
                      "error 107030 on hardware (vLLM-Ascend#6002, aclgraph capture); copy "
                      "into static buffers before capture, or non_blocking from pinned memory")


def _cann(cann: str) -> tuple:
    """'8.3.RC1' -> (8, 3, 0, 1); '8.5.0' -> (8, 5, 1, 0) (candidates before releases)."""
    major, minor, *rest = cann.upper().split(".")
    tail = rest[0] if rest else "RC0"
    rc = tail.startswith("RC")
    n = int("".join(ch for ch in tail if ch.isdigit()) or 0)
    return (int(major), int(minor), 0 if rc else 1, n)


def tnd_rules(cann: str) -> dict:
    """What npu_fused_infer_attention_score takes in TND layout (query D != 512, no rope) on
    this CANN, from op-plugin's doc of the op (docs/context/torch_npu-npu_fused_infer_
    attention_score.md):
    - before 8.3.RC1 (480bc43, lines 231-236; 8abaa31 has no doc): Q_D = K_D = 192, equal
      query/key/value head counts, bfloat16 only, no page attention;
    - 8.3.RC1 (691bf15, lines 221-227): also Q_D = K_D = V_D = 128, no equal-heads rule,
      bfloat16 only. The doc still lists page attention as unsupported, but vLLM-Ascend ran
      paged TND calls on exactly this CANN (f1f2c8f5e5's `startswith("8.3")` gate), so the
      fake follows the run, not that line;
    - 8.3.RC2 on: head size 64 too (vLLM-Ascend's CI runs Llama-3.2-1B through it from
      e11ff8e535b7 on the 8.3.rc2 image)."""
    c = _cann(cann)
    if c < (8, 3, 0, 1):
        return dict(head_sizes=(192,), gqa=False, paged=False)
    if c < (8, 3, 0, 2):
        return dict(head_sizes=(128, 192), gqa=True, paged=True)
    return dict(head_sizes=(64, 128, 192), gqa=True, paged=True)


def tnd_head_sizes(cann: str) -> tuple[int, ...]:
    return tnd_rules(cann)["head_sizes"]


def _check_out(op, out, shape) -> None:
    """An ATB op writes `out` in place as one dense block: a strided view would be written
    past its rows (the ATB doc leaves contiguity to the caller)."""
    if tuple(out.shape) != tuple(shape) or not out.is_contiguous():
        raise RuntimeError(f"fake NPU: {op}: out must be contiguous {tuple(shape)}, got "
                           f"{tuple(out.shape)} strides {out.stride()}")


def _check_causal(rows, offset, op, additive) -> None:
    """The mask rows of n query tokens whose first sits at position `offset`: zero up to and
    including each token's position, masked after it (additive: very negative; else nonzero,
    as vLLM-Ascend's masks are). Anything else is a mask the kernel would misread."""
    n, width = rows.shape
    future = torch.arange(width)[None, :] > (torch.arange(n)[:, None] + offset)
    masked = rows < -1000 if additive else rows != 0
    if not torch.equal(masked, future) or bool(rows[~future].any()):
        raise RuntimeError(f"fake NPU: {op}: the mask is not causal for these positions "
                           f"(rows from position {offset}, width {width})")


def _attend(q, keys, values, scale, causal=False, bias=None):
    """q [n, H, D] over keys/values [L, kvH, D]; causal aligned to the end when asked, or an
    additive [n, L] bias."""
    n, L = q.shape[0], keys.shape[0]
    mask = None
    if causal:
        mask = torch.arange(L)[None, :] <= (torch.arange(n)[:, None] + L - n)
    elif bias is not None:
        mask = bias.to(q.dtype)
    return F.scaled_dot_product_attention(q.transpose(0, 1), keys.transpose(0, 1),
                                          values.transpose(0, 1), attn_mask=mask, scale=scale,
                                          enable_gqa=True).transpose(0, 1)


def pa_workspace_bytes(context_lens: torch.Tensor) -> int:
    """What the fake paged attention needs: grows with the longest context up to 6144
    tokens, and a batch holding a very short context needs a floor that lengths of a few
    hundred do not (so a workspace sized at capture-time lengths of 1 is too small later)."""
    lens = context_lens.tolist()
    return len(lens) * max(4096 if min(lens) <= 16 else 0, 8 * min(max(lens), 6144))


def _table_row(table, i, length, bs, num_blocks, op) -> torch.Tensor:
    """The block ids row i reads for `length` tokens, refused where the op would read past
    its row or outside the pool (the ATB doc: block ids in [0, num_blocks); the caller
    guarantees them, so hardware would read another request's KV or fault)."""
    need = math.ceil(length / bs)
    if not 0 <= length or need > table.shape[1]:
        raise RuntimeError(f"fake NPU: {op}: KV length {length} of row {i} needs {need} blocks, "
                           f"its table has {table.shape[1]}")
    blocks = table[i, :need].long()
    if need and not (0 <= int(blocks.min()) and int(blocks.max()) < num_blocks):
        raise RuntimeError(f"fake NPU: {op}: block id outside [0, {num_blocks}) in row {i}: "
                           f"{blocks.tolist()}")
    return blocks


class FakeStream:
    def __init__(self, rt, name):
        self.rt, self.name = rt, name

    def wait_stream(self, other):
        """Work issued on this stream from now on runs after everything queued on `other`:
        the fake runs that now."""
        self.rt.run_queued(other)

    def synchronize(self):
        self.rt.synchronize()

    def __repr__(self):
        return f"<fake NPU stream {self.name}>"


class ExternalEvent:
    def __init__(self, rt):
        self.rt, self.signaled = rt, False

    def wait(self, stream):
        if self.rt.capturing is not None:
            self.rt.capturing.entries.append(("wait", self))

    def reset(self, stream):
        if self.rt.capturing is not None:
            self.rt.capturing.entries.append(("reset", self))
        else:
            self.signaled = False

    def record(self, stream):
        """Lets a queued replay waiting on this event go on when it runs (not now)."""
        self.signaled = True


class Entry:
    """One recorded op of a graph: an aten op or a fake torch_npu op."""
    __slots__ = ("kind", "fn", "args", "kwargs", "out", "name", "task", "record", "graph",
                 "fresh", "event")

    def __init__(self, kind, fn, args, kwargs, out=None, name=None):
        self.kind, self.fn, self.args, self.kwargs, self.name = kind, fn, args, kwargs, name
        self.set_out(out)
        self.task = False       # captured between graph_task_group_begin and _end
        self.record = False     # recorded by auto_dispatch_capture (NPUGraph.update reaches it)
        self.graph = None
        self.event = None       # a task's: the ExternalEvent waited on before it

    def set_out(self, out):
        """Which outputs a replay refreshes: those in memory of their own. An output that
        shares an input's storage (a view, an in-place result) is refreshed with it."""
        self.out = out
        inputs = {t.untyped_storage().data_ptr() for t in tree_flatten((self.args, self.kwargs))[0]
                  if isinstance(t, torch.Tensor)}
        self.fresh = [isinstance(o, torch.Tensor) and o.untyped_storage().data_ptr() not in inputs
                      for o in tree_flatten(out)[0]]

    def run(self):
        res = self.fn(*_strong(self.args), **_strong(self.kwargs))
        for o, r, fresh in zip(tree_flatten(self.out)[0], tree_flatten(res)[0], self.fresh):
            if fresh:
                o.copy_(r)

    def hold_weakly(self, made: set[int]) -> None:
        """Keep only weak references to the tensors this op read that the capture did not
        make (the graph's pool keeps what it allocated; anything else is the caller's to keep
        alive, as on hardware, where freed memory is reused and a replay reads whatever is
        there)."""
        what = self.name or str(self.fn)

        def weaken(t):
            if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in made:
                base = t if t._base is None else t._base
                if base.dtype == t.dtype:
                    return _Weak(t, base, what)
            return t
        self.args, self.kwargs = tree_map(weaken, self.args), tree_map(weaken, self.kwargs)


class _Weak:
    """A tensor a graph read at capture, held by a weak reference to its base."""
    __slots__ = ("ref", "shape", "stride", "offset", "what")

    def __init__(self, t, base, what=""):
        self.ref, self.what = weakref.ref(base), what
        self.shape, self.stride, self.offset = t.shape, t.stride(), t.storage_offset()

    def get(self) -> torch.Tensor:
        base = self.ref()
        if base is None:
            raise RuntimeError(f"fake NPU: use after free: a replay reads a tensor the graph "
                               f"was handed at capture or by a task update ({self.what}: "
                               f"{tuple(self.shape)}) that has been freed since (on hardware "
                               "its memory is reused: keep it alive while a replay can read it)")
        return base.as_strided(self.shape, self.stride, self.offset)


def _strong(tree):
    return tree_map(lambda x: x.get() if isinstance(x, _Weak) else x, tree)


class NPUGraph:
    def __init__(self, rt):
        self.rt = rt
        self.entries: list = []
        self.auto_dispatch_capture = False
        self.capture_stream = None
        self.pending = False
        self.cursor = 0
        self.group_open = False
        self.replays = 0
        self.stream = None
        """The stream its queued replay was issued on."""

    def replay(self):
        """Queue a run of the graph on the current stream; it runs later (NpuRuntime.
        run_queued says when)."""
        rt = self.rt
        if rt.thread != threading.get_ident():
            raise RuntimeError("fake NPU: a replay from another thread than install()'s: the "
                               "fake orders same-stream ops on that thread only")
        rt.host_copies.flush()
        rt.run_queued(rt.current)          # an earlier replay of this stream runs first
        if self.pending:
            raise RuntimeError("fake NPUGraph: replayed while its previous replay still waits "
                               "on an ExternalEvent (its tasks were never updated)")
        self.replays += 1
        self.cursor, self.pending, self.stream = 0, True, rt.current
        rt.pending.append(self)

    def run(self) -> bool:
        """Run the queued replay on as far as its ExternalEvents let it: whether it ended."""
        rt = self.rt
        while self.cursor < len(self.entries):
            e = self.entries[self.cursor]
            if isinstance(e, tuple):
                kind, event = e
                if kind == "wait" and not event.signaled:
                    return False
                if kind == "reset":
                    event.signaled = False
            else:
                with torch.inference_mode():
                    if e.kind == "npu":
                        with rt.op_scope():
                            e.run()
                    else:
                        e.run()
            self.cursor += 1
        self.pending = False
        rt.pending.remove(self)
        rt.unsynced = True
        return True

    def update(self, cpu_update_input):
        if not self.auto_dispatch_capture:
            raise RuntimeError("The current graph configuration does not support update, "
                               "Try to capture by setting auto_dispatch_capture=True")
        for changes in cpu_update_input:
            for e in self.entries:
                if e.kind == "npu" and e.record:
                    for key, value in changes.items():
                        if key in e.kwargs:
                            e.kwargs[key] = value.clone() if isinstance(value, torch.Tensor) \
                                else list(value)


class _RuntimeMode(TorchDispatchMode):
    """A dispatch mode that sees every aten op on behalf of the fake's runtime."""

    def __init__(self, rt):
        super().__init__()
        self.rt = rt


class _Recorder(_RuntimeMode):

    def __torch_dispatch__(self, func, types_, args=(), kwargs=None):
        kwargs = kwargs or {}
        rt = self.rt
        if rt.capturing is not None and not rt.in_op and _blocking_h2d(rt, func, args, kwargs):
            raise RuntimeError(H2D_DURING_CAPTURE)
        out = func(*args, **kwargs)
        if rt.capturing is not None and not rt.in_op:
            if func is torch.ops.aten._local_scalar_dense.default:
                raise RuntimeError("fake NPU: host read of a device value during graph capture "
                                   "(error 107030 on hardware)")
            if func is torch.ops.aten.lift_fresh.default:      # torch.tensor(<host data>)
                rt.host_made.add(out.untyped_storage().data_ptr())
            rt.capturing.entries.append(Entry("aten", func, args, kwargs, out))
        return out


class _StreamOrder(_RuntimeMode):
    """On install()'s thread, for the whole test: an aten op that reads or writes memory (any
    op with a tensor argument but views, which only make a new view of it), issued on a
    stream with replays queued, runs them first: on hardware it would run after them. An op
    issued on another stream does not (NpuRuntime.run_queued)."""

    def __torch_dispatch__(self, func, types_, args=(), kwargs=None):
        kwargs = kwargs or {}
        rt = self.rt
        if rt.pending and not rt.running and not func.is_view and rt.capturing is None \
                and any(isinstance(t, torch.Tensor) for t in tree_flatten((args, kwargs))[0]):
            rt.run_queued(rt.current, op=f"aten.{func.__name__}")
        return func(*args, **kwargs)


class _OnStack:
    """Setting `mode` pushes it on this thread's dispatch stack, setting it back to None pops
    it: so monkeypatch.setattr(holder, "mode", m) keeps it there for one test."""

    def __init__(self):
        self._mode = None

    @property
    def mode(self):
        return self._mode

    @mode.setter
    def mode(self, m):
        if m is None and self._mode is not None:
            self._mode.__exit__(None, None, None)
        elif m is not None:
            m.__enter__()
        self._mode = m


def _blocking_h2d(rt, func, args, kwargs) -> bool:
    """Whether this op, run while capturing, is a blocking copy of host data to the device.
    Here the device is the CPU, so host data is recognised by where it came from: a tensor
    made from Python values during this capture (torch.tensor(...), aten.lift_fresh), copied
    with non_blocking False into another tensor (copy_) or to the device (.to(device=...))."""
    if func is torch.ops.aten.copy_.default:
        src, blocking = args[1], not (args[2] if len(args) > 2 else kwargs.get("non_blocking"))
    elif func is torch.ops.aten._to_copy.default and "device" in kwargs:
        src, blocking = args[0], not kwargs.get("non_blocking")
    else:
        return False
    return blocking and isinstance(src, torch.Tensor) and \
        src.untyped_storage().data_ptr() in rt.host_made


class NpuRuntime(types.SimpleNamespace):
    """What torch_npu registers as torch.npu (and torch_npu.npu)."""

    def __init__(self, cann, soc):
        super().__init__()
        self.soc, self.cann = soc, cann
        self.utils = types.SimpleNamespace(get_cann_version=lambda module="CANN": cann)
        self.default_stream = FakeStream(self, "default")
        self.current = self.default_stream
        self.capturing: NPUGraph | None = None
        self.updating: Entry | None = None
        self.update_issued = False
        self.in_op = False
        self.pending: list[NPUGraph] = []
        """Replays issued and not yet run to their end, in issue order (run_queued)."""
        self.running = False
        """run_queued is running replays (their ops are the device's, not issued ones)."""
        self.thread = threading.get_ident()
        """install()'s thread, the one whose ops _StreamOrder sees."""
        self.unsynced = False
        """A replay has run to its end and the host has not synchronized since."""
        self.capture_kwargs: list[dict] = []
        self.syncs = 0
        self.capture_collects = 0
        """gc.collect() runs at a capture's start (each costs a full collection)."""
        self.capture_empty_caches = 0
        self.captured = 0
        self.max_graphs: int | None = None
        """Graphs the driver lets this process capture (None: no limit)."""
        self.capture_error = NO_STREAM_RESOURCE
        self.host_made: set[int] = set()
        """Storages of tensors made from host values during the current capture."""
        self.host_copies = HostCopies()
        self.host_copies.issue = lambda: self.run_queued(self.current, op="a non-blocking copy")

    # device, memory, streams
    def is_available(self):
        return True

    def device_count(self):
        return 1

    def get_soc_version(self):
        return self.soc

    def get_device_name(self, i=0):
        return SOCS.get(self.soc, f"Ascend-{self.soc}")

    def synchronize(self, device=None):
        self.host_copies.flush()
        self.run_queued()
        if self.pending:
            raise RuntimeError("fake NPU hangs: a replayed graph waits on an ExternalEvent that "
                               "is never recorded (a task group was not updated)")
        self.unsynced = False
        self.syncs += 1

    def run_queued(self, stream=None, op=None, only=None) -> None:
        """Run the replays queued on `stream` (on every stream: None) in the order they were
        issued, each as far as its ExternalEvents let it; a replay that stops at one holds
        back the later ones of its stream. `op`: what is issued behind them on that stream,
        which must then run after them: if one cannot end, it never would (a hang).
        `only`: just these replays (and those before them), those an event was recorded
        after."""
        if self.running or not self.pending:
            return
        self.running, blocked = True, set()
        try:
            for g in list(self.pending):
                if only is not None and g not in only:
                    continue
                if (stream is None or g.stream is stream) and g.stream not in blocked \
                        and not g.run():
                    blocked.add(g.stream)
        finally:
            self.running = False
        if blocked and op is not None:
            raise RuntimeError(f"fake NPU hangs: {op} is issued on {stream} behind a replay "
                               "that waits on an ExternalEvent nobody records (a task group "
                               "not updated)")

    def mem_get_info(self, device=None):
        return 64 * 2**30, 64 * 2**30

    def max_memory_allocated(self, device=None):
        return 0

    def reset_peak_memory_stats(self, device=None):
        pass

    def empty_cache(self):
        return True

    def Stream(self):
        return FakeStream(self, "side")

    def current_stream(self, device=None):
        return self.current

    @contextmanager
    def stream(self, s):
        prev, self.current = self.current, s
        try:
            yield
        finally:
            self.current = prev

    # graphs
    def graph_pool_handle(self):
        return object()

    def NPUGraph(self):
        return NPUGraph(self)

    def ExternalEvent(self):
        return ExternalEvent(self)

    @contextmanager
    def graph(self, g, pool=None, stream=None, auto_dispatch_capture=False):
        self.capture_kwargs.append(dict(auto_dispatch_capture=auto_dispatch_capture))
        # what torch_npu/npu/graphs.py's __enter__ does first (Ascend/pytorch 9e73e70, lines
        # 902-906), through the same module attributes, so that skipping them shows here
        self.synchronize()
        if gc.collect() is not None:           # an int, unless patched out
            self.capture_collects += 1
        if self.empty_cache():                 # True, unless patched out
            self.capture_empty_caches += 1
        if self.max_graphs is not None and self.captured >= self.max_graphs:
            raise RuntimeError(self.capture_error)
        self.captured += 1
        g.auto_dispatch_capture = auto_dispatch_capture
        g.capture_stream = stream or FakeStream(self, "capture")
        prev, self.current, self.capturing = self.current, g.capture_stream, g
        self.host_made = set()
        try:
            with _Recorder(self):
                yield
        finally:
            self.current, self.capturing = prev, None
            self.host_made = set()
            made = {o.untyped_storage().data_ptr() for e in g.entries if isinstance(e, Entry)
                    for o, fresh in zip(tree_flatten(e.out)[0], e.fresh) if fresh}
            for e in g.entries:
                if isinstance(e, Entry):
                    e.hold_weakly(made)

    def graph_task_group_begin(self, stream):
        assert self.capturing is not None and stream is self.capturing.capture_stream
        self.capturing.group_open = True

    def graph_task_group_end(self, stream):
        g = self.capturing
        assert g is not None and stream is g.capture_stream
        g.group_open = False
        handle = g.entries[-1]
        assert handle.kind == "npu" and handle.task, "an empty task group"
        waits = [e[1] for e in g.entries if isinstance(e, tuple) and e[0] == "wait"]
        handle.event = waits[-1] if waits else None
        return handle

    def graph_task_update_begin(self, stream, handle):
        g = handle.graph
        if stream is g.capture_stream or stream is self.default_stream:
            raise RuntimeError("fake NPU: task update issued on the capture/compute stream; "
                               "updates go on their own stream")
        if self.unsynced:
            raise RuntimeError("fake NPU: task update while an earlier replay was never "
                               "synchronized: it could land in that replay (vLLM-Ascend: "
                               "synchronize, replay, then update)")
        if not g.pending:
            raise RuntimeError("fake NPU: task update for a graph that is not waiting in a "
                               "replay (replay first, then update)")
        if handle.event is not None and handle.event.signaled:
            raise RuntimeError("fake NPU: task update while an earlier replay was never "
                               "synchronized: the queued replay's task was released already "
                               "(its ExternalEvent recorded), so this update could land in it")
        self.updating, self.update_issued = handle, False

    def graph_task_update_end(self, stream):
        issued, open_ = self.update_issued, self.updating is not None
        self.updating = None                   # the update scope ends either way
        assert open_ and issued, "an empty task update"

    def Event(self, enable_timing=False):
        return CopyEvent(self)

    @contextmanager
    def op_scope(self):
        prev, self.in_op = self.in_op, True
        try:
            yield
        finally:
            self.in_op = prev


class HostCopies:
    """The copy engine, for copies with non_blocking=True (on this fake every tensor is a
    CPU tensor, so host and device memory look alike: direction does not matter, pinning
    does). From a pinned source the copy happens at the call. From an unpinned one it is
    queued with a weak reference to its source and done at `flush` (the runtime flushes
    when the host synchronizes, before each torch_npu op and each replay): it then reads
    the source as it is by then, or, if the source was freed, writes garbage (GARBAGE, or
    NaN in a float destination). Until then the destination keeps what it held."""
    GARBAGE = 0x3A3A3A3A

    def __init__(self):
        self.queued: list[tuple] = []
        """(destination, weak reference to the source's base, the source's geometry)."""
        self._pinned: set[int] = set()
        self.counts = Counter()
        """Non-blocking copies seen, by source: 'pinned', 'unpinned'."""
        self.issue = lambda: None
        """Called as a queued copy is issued (the runtime runs the stream's replays first)."""

    def pin(self, t: torch.Tensor) -> torch.Tensor:
        p = t.clone()
        ptr = p.untyped_storage().data_ptr()
        self._pinned.add(ptr)
        weakref.finalize(p, self._pinned.discard, ptr)
        return p

    def is_pinned(self, t: torch.Tensor) -> bool:
        return t.untyped_storage().data_ptr() in self._pinned

    def copy(self, dst: torch.Tensor, src: torch.Tensor, copy_now) -> None:
        if self.is_pinned(src):
            self.counts["pinned"] += 1
            copy_now(dst, src)
        else:
            self.counts["unpinned"] += 1
            self.issue()         # on its stream, behind the replays queued there
            # Freed means its memory is: a view (a slice of a live buffer) may die first.
            base = src if src._base is None else src._base
            self.queued.append((dst, weakref.ref(base), src.shape, src.stride(),
                                src.storage_offset()))

    def flush(self) -> None:
        queued, self.queued = self.queued, []
        for dst, ref, shape, stride, offset in queued:
            base = ref()
            if base is None:
                dst.fill_(float("nan") if dst.is_floating_point() else self.GARBAGE)
            else:
                _ORIGINAL["copy_"](dst, base.as_strided(shape, stride, offset))


_ORIGINAL = {"copy_": torch.Tensor.copy_, "to": torch.Tensor.to}


class CopyEvent:
    """torch.npu.Event: synchronize() waits for the copies queued before it, and for the
    replays queued on its stream before it was recorded (running them); wait(stream)
    orders that stream's later work after them the same way."""

    def __init__(self, rt):
        self.rt, self.stream, self.before = rt, None, []

    def record(self, stream=None):
        self.stream = stream or self.rt.current
        self.before = [g for g in self.rt.pending if g.stream is self.stream]

    def query(self):
        return not self.rt.host_copies.queued and not any(g.pending for g in self.before)

    def synchronize(self):
        self.rt.host_copies.flush()
        self.rt.run_queued(self.stream, only=self.before)

    def wait(self, stream=None):
        self.synchronize()


def _patch_copies(monkeypatch, rt) -> None:
    """Tensor.pin_memory/is_pinned, and copy_ and to with non_blocking=True, through
    rt.host_copies (other calls go straight to torch); tolist and cpu as host reads."""
    copies = rt.host_copies
    copy_, to = _ORIGINAL["copy_"], _ORIGINAL["to"]

    def patched_copy(self, src, non_blocking=False):
        if not non_blocking:
            return copy_(self, src)
        copies.copy(self, src, copy_)
        return self

    def patched_to(self, *args, **kwargs):
        flags = [a for a in args if isinstance(a, bool)]
        if not kwargs.get("non_blocking", flags[0] if flags else False):
            return to(self, *args, **kwargs)
        moved = to(self, *args, **{**kwargs, "non_blocking": False})
        if copies.is_pinned(self):
            copies.counts["pinned"] += 1
            return moved
        out = torch.empty_like(moved)          # the destination, filled when the copy runs
        copies.copy(out, self, copy_)
        return out

    def host_read(name):
        """A host read of a device tensor (.tolist(), .cpu()) waits for the queued work of
        the current stream (a pinned tensor is host memory already: no wait)."""
        original = getattr(torch.Tensor, name)

        def read(self, *args, **kwargs):
            if not copies.is_pinned(self):
                rt.run_queued(rt.current, op=f"Tensor.{name}")
            return original(self, *args, **kwargs)
        return read

    for name in ("tolist", "cpu"):
        monkeypatch.setattr(torch.Tensor, name, host_read(name))
    monkeypatch.setattr(torch.Tensor, "pin_memory", lambda self, device=None: copies.pin(self))
    monkeypatch.setattr(torch.Tensor, "is_pinned", lambda self, device=None: copies.is_pinned(self))
    monkeypatch.setattr(torch.Tensor, "copy_", patched_copy)
    monkeypatch.setattr(torch.Tensor, "to", patched_to)


class FakeTorchNpu(types.ModuleType):
    """The torch_npu module: `npu` (the runtime) and the ops, counting executions."""

    def __init__(self, version="2.8.0", soc=223, cann=None):
        super().__init__("torch_npu")
        release = RELEASES[version]
        self.__spec__ = importlib.machinery.ModuleSpec("torch_npu", None)
        self.__version__ = version
        self.release = release
        self.npu = NpuRuntime(cann or release["cann"], soc)
        self.calls = Counter()
        self._masks_seen: set[int] = set()
        self.fp32 = False
        """Let the ATB and FIA ops take float32 too (install(fp32=True)); their docs do not."""
        if release["workspace"]:
            self._npu_paged_attention_get_workspace = self._get_workspace

    def allowed(self, op) -> tuple:
        """The dtypes `op` takes: its docs' (OP_DTYPES), plus float32 for the ATB and FIA ops
        when a test installed the fake with fp32=True (exact token comparisons)."""
        return OP_DTYPES[op] + ((torch.float32,) if self.fp32 else ())

    def _dtype(self, op, **tensors) -> None:
        allowed = self.allowed(op)
        for name, t in tensors.items():
            if t.dtype not in allowed:
                raise TypeError(f"fake NPU: {op} takes {name} in "
                                f"{'/'.join(str(d)[6:] for d in allowed)}, got {t.dtype}")

    # calling convention: checked by the caller; then captured, updated, or run now
    def _call(self, name, impl, args, kwargs, inplace=False):
        """inplace: the op writes tensors it was given and returns nothing; captured, it is
        recorded without running (a capture launches nothing on hardware)."""
        rt = self.npu
        rt.host_copies.flush()               # an op reads what was copied for it
        if rt.updating is not None:
            return self._update(name, args, kwargs)
        if rt.capturing is None and not rt.in_op:
            rt.run_queued(rt.current, op=name)   # it runs after the replays of its stream
        if rt.capturing is not None and not rt.in_op:
            g = rt.capturing
            if "context_lens" in kwargs:                  # a host tensor: baked in
                kwargs = {**kwargs, "context_lens": kwargs["context_lens"].clone()}
            e = Entry("npu", impl, args, kwargs, name=name)
            e.graph = g
            e.task, g.group_open = g.group_open, False
            e.record = g.auto_dispatch_capture and (
                name != "_npu_paged_attention" or self.release["records_pa"])
            g.entries.append(e)
            if not inplace:
                with rt.op_scope():
                    e.set_out(impl(*args, **kwargs))
            return e.out
        with rt.op_scope():
            return impl(*args, **kwargs)

    def _update(self, name, args, kwargs):
        """Re-issue a captured task with new arguments: only context_lens (same shape) and
        the workspace may change; everything else is the captured task's."""
        rt, e = self.npu, self.npu.updating
        if name != e.name or args:
            raise RuntimeError(f"fake NPU: task update re-issues {name}, captured {e.name}")
        if set(kwargs) != set(e.kwargs):
            raise RuntimeError(f"fake NPU: task update passes {sorted(kwargs)}, the captured "
                               f"task {sorted(e.kwargs)}")
        for key, value in e.kwargs.items():
            new = kwargs[key]
            if key == "workspace":
                continue          # re-queried per step; its size is checked when the task runs
            value = _strong(value)
            if key == "context_lens" or not isinstance(value, torch.Tensor):
                if key == "context_lens" and new.shape != value.shape:
                    raise RuntimeError(f"fake NPU: task update's context_lens has shape "
                                       f"{tuple(new.shape)}, the captured task "
                                       f"{tuple(value.shape)}: a task keeps its shapes")
                if key != "context_lens" and new != value:
                    raise RuntimeError(f"fake NPU: task update changes {key} ({value!r} -> "
                                       f"{new!r}): a task keeps its captured parameters")
                continue
            if not isinstance(new, torch.Tensor) or new.data_ptr() != value.data_ptr() \
                    or new.shape != value.shape:
                raise RuntimeError(f"fake NPU: task update moved or reshaped {key}: a graph's "
                                   "tensors keep their captured addresses and shapes")
        if kwargs.get("workspace") is None:
            raise RuntimeError("fake NPU: _npu_paged_attention updated without a workspace: "
                               "it would allocate one on the update stream at every step")
        # the lengths are host data the update consumes; the workspace is a device address
        # the task keeps: the caller must keep it alive until the replay has run
        ws = kwargs["workspace"]
        e.kwargs = {**e.kwargs, "context_lens": kwargs["context_lens"].clone(),
                    "workspace": _Weak(ws, ws if ws._base is None else ws._base,
                                       f"{name} workspace")}
        rt.update_issued = True

    # ---- ops -----------------------------------------------------------------------------
    def _npu_reshape_and_cache(self, key, value, key_cache, value_cache, slot_indices):
        op = "_npu_reshape_and_cache"
        self._dtype(op, key=key, value=value, key_cache=key_cache, value_cache=value_cache)
        if len({key.dtype, value.dtype, key_cache.dtype, value_cache.dtype}) > 1:
            raise TypeError(f"fake NPU: {op}: key, value and caches must share a dtype")
        if slot_indices.dtype != torch.int32 or slot_indices.shape != key.shape[:1]:
            raise TypeError(f"fake NPU: {op}: slot_indices must be int32 [{key.shape[0]}], got "
                            f"{slot_indices.dtype} {tuple(slot_indices.shape)}")
        assert key.is_contiguous() and value.is_contiguous()
        assert key.shape[1:] == key_cache.shape[2:] == value.shape[1:]
        return self._call(op, self._reshape_and_cache, (),
                          dict(key=key, value=value, key_cache=key_cache,
                               value_cache=value_cache, slot_indices=slot_indices), inplace=True)

    def _reshape_and_cache(self, key, value, key_cache, value_cache, slot_indices):
        nb, bs, kvh, d = key_cache.shape
        slots = slot_indices.long()
        if len(slots) and not (0 <= int(slots.min()) and int(slots.max()) < nb * bs):
            raise RuntimeError(f"fake NPU: _npu_reshape_and_cache slot outside the pool "
                               f"[0, {nb * bs}): {slots.tolist()}")
        key_cache.view(nb * bs, kvh, d)[slots] = key
        value_cache.view(nb * bs, kvh, d)[slots] = value
        self.calls["cache"] += 1

    def _npu_paged_attention(self, query, key_cache, value_cache, num_kv_heads, num_heads,
                             scale_value, block_table, context_lens, out, **kw):
        op = "_npu_paged_attention"
        if set(kw) - {"workspace"} or (kw and not self.release["workspace"]):
            raise TypeError(f"_npu_paged_attention() got unexpected keyword(s) {sorted(kw)} "
                            f"(torch_npu {self.__version__})")
        if kw.get("workspace") is None and (self.npu.capturing is not None):
            raise RuntimeError("fake NPU: _npu_paged_attention captured without a workspace: "
                               "each update would allocate one outside the graph's pool")
        self._dtype(op, query=query, key_cache=key_cache, value_cache=value_cache)
        if len({query.dtype, key_cache.dtype, value_cache.dtype, out.dtype}) > 1:
            raise TypeError(f"fake NPU: {op}: query, caches and out must share a dtype")
        b = query.shape[0]
        if block_table.dtype != torch.int32 or block_table.dim() != 2 \
                or block_table.shape[0] != b:
            raise TypeError(f"fake NPU: {op}: block_table must be int32 [{b}, max_blocks], got "
                            f"{block_table.dtype} {tuple(block_table.shape)}")
        if context_lens.dtype != torch.int32 or context_lens.device.type != "cpu" \
                or context_lens.shape != (b,):
            raise TypeError(f"fake NPU: {op}: context_lens must be a host int32 [{b}], got "
                            f"{context_lens.dtype} {tuple(context_lens.shape)}")
        _check_out(op, out, query.shape)
        if self.npu.capturing is not None and not self.npu.in_op:
            # the capture fixes tiling and workspace for these lengths: they must fit the
            # table rows the task will read through
            for i, length in enumerate(context_lens.tolist()):
                need = math.ceil(length / key_cache.shape[1])
                if need > block_table.shape[1]:
                    raise RuntimeError(
                        f"fake NPU: {op} captured with context length {length} for row {i}, "
                        f"{need} blocks, through a table {block_table.shape[1]} blocks wide")
        return self._call(op, self._paged_attention, (),
                          dict(query=query, key_cache=key_cache, value_cache=value_cache,
                               num_kv_heads=num_kv_heads, num_heads=num_heads,
                               scale_value=scale_value, block_table=block_table,
                               context_lens=context_lens, out=out, **kw), inplace=True)

    def _get_workspace(self, query, key_cache, value_cache, num_kv_heads, num_heads,
                       scale_value, block_table, context_lens, out):
        assert context_lens.dtype == torch.int32 and context_lens.device.type == "cpu"
        return torch.empty(pa_workspace_bytes(context_lens), dtype=torch.uint8)

    def _paged_attention(self, query, key_cache, value_cache, num_kv_heads, num_heads,
                         scale_value, block_table, context_lens, out, workspace=None):
        if self.npu.soc == 260:
            raise RuntimeError("fake NPU: _npu_paged_attention is not available on Ascend950")
        nb, bs, kvh, d = key_cache.shape
        if bs % 16 or bs * d > 128 * 128 or d > 256:
            raise RuntimeError(f"fake NPU: paged attention refuses block_size {bs} x head "
                               f"size {d}")
        assert (num_kv_heads, num_heads) == (kvh, query.shape[1])
        if workspace is not None and workspace.numel() < pa_workspace_bytes(context_lens):
            raise RuntimeError("fake NPU: paged-attention workspace too small for these "
                               "lengths (it would overrun on hardware)")
        for i, length in enumerate(context_lens.tolist()):
            blocks = _table_row(block_table, i, length, bs, nb, "_npu_paged_attention")
            if length == 0:
                out[i] = 0
                continue
            keys = key_cache[blocks].reshape(-1, kvh, d)[:length]
            values = value_cache[blocks].reshape(-1, kvh, d)[:length]
            out[i] = _attend(query[i:i + 1], keys, values, scale_value)[0]
        self.calls["paged"] += 1

    def _npu_paged_attention_splitfuse(self, query, key_cache, value_cache, block_table,
                                       context_lens, mask, seq_len, num_kv_heads, num_heads,
                                       scale_value, out):
        op = "_npu_paged_attention_splitfuse"
        self._dtype(op, query=query, key_cache=key_cache, value_cache=value_cache, mask=mask)
        if len({query.dtype, key_cache.dtype, value_cache.dtype, out.dtype, mask.dtype}) > 1:
            raise TypeError(f"fake NPU: {op}: query, caches, mask and out must share a dtype")
        b = context_lens.shape[0]
        for name, t in (("context_lens", context_lens), ("seq_len", seq_len)):
            if t.dtype != torch.int32 or t.device.type != "cpu" or t.shape != (b,):
                raise TypeError(f"fake NPU: {op}: {name} must be a host int32 [{b}], got "
                                f"{t.dtype} {tuple(t.shape)} on {t.device}")
        if block_table.dtype != torch.int32 or block_table.shape[0] != b:
            raise TypeError(f"fake NPU: {op}: block_table must be int32 [{b}, max_blocks]")
        q_lens, ctx = seq_len.tolist(), context_lens.tolist()
        if sum(q_lens) != query.shape[0] or any(q > c for q, c in zip(q_lens, ctx)):
            raise RuntimeError(f"fake NPU: {op}: seq_len {q_lens} must sum to the query's "
                               f"{query.shape[0]} tokens, each within its context {ctx}")
        if tuple(mask.shape) != (query.shape[0], max(ctx)):
            raise RuntimeError(f"fake NPU: {op}: mask must be [tokens, max context] = "
                               f"[{query.shape[0]}, {max(ctx)}], got {tuple(mask.shape)}")
        _check_out(op, out, query.shape)
        return self._call(op, self._splitfuse, (), dict(
            query=query, key_cache=key_cache, value_cache=value_cache, block_table=block_table,
            context_lens=context_lens, mask=mask, seq_len=seq_len, num_kv_heads=num_kv_heads,
            num_heads=num_heads, scale_value=scale_value, out=out), inplace=True)

    def _splitfuse(self, query, key_cache, value_cache, block_table, context_lens, mask,
                   seq_len, num_kv_heads, num_heads, scale_value, out):
        nb, bs, kvh, d = key_cache.shape
        if bs % 16 or bs * d > 128 * 128:
            raise RuntimeError(f"fake NPU: splitfuse refuses block_size {bs} x head size {d}")
        assert (num_kv_heads, num_heads) == (kvh, query.shape[1])
        start = 0
        for i, (n, length) in enumerate(zip(seq_len.tolist(), context_lens.tolist())):
            blocks = _table_row(block_table, i, length, bs, nb, "_npu_paged_attention_splitfuse")
            keys = key_cache[blocks].reshape(-1, kvh, d)[:length]
            values = value_cache[blocks].reshape(-1, kvh, d)[:length]
            rows = mask[start:start + n, :length].float()
            _check_causal(rows, length - n, "_npu_paged_attention_splitfuse", additive=True)
            out[start:start + n] = _attend(query[start:start + n], keys, values, scale_value,
                                           bias=rows)
            start += n
        self.calls["splitfuse"] += 1

    def _npu_flash_attention(self, query, key, value, mask, seq_len, scale_value, num_heads,
                             num_kv_heads, out):
        op = "_npu_flash_attention"
        self._dtype(op, query=query, key=key, value=value, mask=mask)
        if len({query.dtype, key.dtype, value.dtype, out.dtype, mask.dtype}) > 1:
            raise TypeError(f"fake NPU: {op}: query, key, value, mask and out must share a dtype")
        if seq_len.dtype != torch.int32 or seq_len.device.type != "cpu" or seq_len.dim() != 1:
            raise TypeError(f"fake NPU: {op}: seq_len must be a host int32 [batch]")
        lens = seq_len.tolist()
        if sum(lens) != query.shape[0] or key.shape[0] != query.shape[0]:
            raise RuntimeError(f"fake NPU: {op}: seq_len {lens} must sum to the tokens of "
                               f"query {query.shape[0]} and key {key.shape[0]}")
        if mask.dim() != 2 or mask.shape[0] != mask.shape[1] or mask.shape[0] < max(lens):
            raise RuntimeError(f"fake NPU: {op}: mask must be square, at least the longest "
                               f"sequence ({max(lens)}), got {tuple(mask.shape)}")
        for name, t in (("query", query), ("key", key), ("value", value)):
            if not t.is_contiguous():
                raise RuntimeError(f"fake NPU: {op} takes no non-contiguous {name}")
        _check_out(op, out, query.shape)
        return self._call(op, self._flash_attention, (), dict(
            query=query, key=key, value=value, mask=mask, seq_len=seq_len,
            scale_value=scale_value, num_heads=num_heads, num_kv_heads=num_kv_heads, out=out),
            inplace=True)

    def _flash_attention(self, query, key, value, mask, seq_len, scale_value, num_heads,
                         num_kv_heads, out):
        assert (num_heads, num_kv_heads) == (query.shape[1], key.shape[1])
        start = 0
        for n in seq_len.tolist():
            _check_causal(mask[:n, :n].float(), 0, "_npu_flash_attention", additive=False)
            out[start:start + n] = _attend(query[start:start + n], key[start:start + n],
                                           value[start:start + n], scale_value, causal=True)
            start += n
        self.calls["flash"] += 1

    def npu_fused_infer_attention_score(self, q, k, v, **kw):
        return self._call("npu_fused_infer_attention_score", self._fia, (q, k, v), kw)

    def _fia(self, q, k, v, *, atten_mask, actual_seq_lengths, actual_seq_lengths_kv,
             block_table, num_heads, scale, input_layout, num_key_value_heads, sparse_mode,
             block_size):
        op = "npu_fused_infer_attention_score"
        if self.npu.soc in range(200, 206):
            raise RuntimeError("fake NPU: npu_fused_infer_attention_score is not supported on "
                               "Ascend310P")
        assert input_layout == "TND" and sparse_mode == 3
        self._dtype(op, query=q, key=k, value=v)
        self._dtype(op + " TND", query=q)
        rules = tnd_rules(self.npu.cann)
        if k.dtype != q.dtype or v.dtype != q.dtype:
            raise TypeError(f"fake NPU: {op}: key/value {k.dtype} with query {q.dtype}")
        if not (q.is_contiguous() and k.is_contiguous() and v.is_contiguous()):
            raise RuntimeError(f"fake NPU: {op} takes no non-contiguous query/key/value")
        assert atten_mask.shape == (2048, 2048)
        if atten_mask.dtype not in (torch.bool, torch.int8, torch.uint8):
            raise TypeError(f"fake NPU: {op}: atten_mask bool/int8/uint8, got {atten_mask.dtype}")
        if id(atten_mask) not in self._masks_seen:
            if not torch.equal(atten_mask.bool(), torch.ones(2048, 2048, dtype=torch.bool).triu(1)):
                raise RuntimeError(f"fake NPU: {op}: sparse_mode 3 wants the 2048 x 2048 "
                                   "upper-triangle mask (1 = masked)")
            self._masks_seen.add(id(atten_mask))
        ends, kv_lens = actual_seq_lengths, actual_seq_lengths_kv
        assert all(isinstance(x, int) for x in ends + kv_lens)
        if not 0 < len(ends) == len(kv_lens) <= 4096 or ends[-1] != q.shape[0] or any(
                b < a for a, b in zip([0] + ends, ends)):
            raise RuntimeError(f"fake NPU: {op}: TND actual_seq_lengths must be <= 4096 "
                               f"non-decreasing cumulative ends reaching T={q.shape[0]}, with "
                               f"one KV length each (got {ends}, {kv_lens})")
        if block_table.dtype != torch.int32 or block_table.dim() != 2 \
                or block_table.shape[0] != len(ends):
            raise TypeError(f"fake NPU: {op}: block_table must be int32 [{len(ends)}, "
                            f"max_blocks], got {block_table.dtype} {tuple(block_table.shape)}")
        nb, bs, width = k.shape
        kvh = num_key_value_heads
        d = width // kvh
        cann = self.npu.cann
        if d not in rules["head_sizes"]:
            raise RuntimeError(f"fake NPU: aclnnFusedInferAttentionScore error 561002: TND "
                               f"layout with head size {d} (CANN {cann} takes "
                               f"{rules['head_sizes']})")
        if not rules["gqa"] and kvh != num_heads:
            raise RuntimeError(f"fake NPU: aclnnFusedInferAttentionScore error 561002: TND "
                               f"layout needs Q_N = K_N = V_N on CANN {cann} (got {num_heads} "
                               f"query heads, {kvh} KV heads)")
        if not rules["paged"]:
            raise RuntimeError(f"fake NPU: aclnnFusedInferAttentionScore error 561002: TND "
                               f"layout takes no page attention (block_table) on CANN {cann}")
        assert bs == block_size and num_heads == q.shape[1]
        out, start = torch.empty_like(q), 0
        for i, (end, length) in enumerate(zip(ends, kv_lens)):
            if end - start > length:
                raise RuntimeError(f"fake NPU: {op}: request {i} has {end - start} query tokens "
                                   f"and {length} KV tokens")
            blocks = _table_row(block_table, i, length, bs, nb, op)
            keys = k[blocks].reshape(-1, kvh, d)[:length]
            values = v[blocks].reshape(-1, kvh, d)[:length]
            out[start:end] = _attend(q[start:end], keys, values, scale, causal=True)
            start = end
        self.calls["fia"] += 1
        return out, torch.zeros(1)

    def npu_rms_norm(self, x, gamma, epsilon=1e-6):
        return self._call("npu_rms_norm", self._rms_norm, (x, gamma), dict(epsilon=epsilon))

    def _rms_norm(self, x, gamma, epsilon=1e-6, count=True):
        assert gamma.shape == x.shape[-1:]
        if count and (x.dtype, gamma.dtype) not in RMS_NORM_PAIRS:
            raise TypeError(f"fake NPU: npu_rms_norm takes no x {x.dtype} with gamma "
                            f"{gamma.dtype} on Atlas A2/A3")
        xf = x.float()
        rstd = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + epsilon)
        self.calls["rms_norm"] += count
        return (xf * rstd * gamma.float()).to(x.dtype), rstd

    def npu_add_rms_norm(self, x1, x2, gamma, epsilon=1e-6):
        return self._call("npu_add_rms_norm", self._add_rms_norm, (x1, x2, gamma),
                          dict(epsilon=epsilon))

    def _add_rms_norm(self, x1, x2, gamma, epsilon=1e-6):
        self._dtype("npu_add_rms_norm", x1=x1)
        if x2.dtype != x1.dtype or gamma.dtype != x1.dtype:
            raise TypeError(f"fake NPU: npu_add_rms_norm needs x1, x2 and gamma of one dtype, "
                            f"got {x1.dtype}, {x2.dtype}, {gamma.dtype}")
        s = x1 + x2
        y, rstd = self._rms_norm(s, gamma, epsilon, count=False)
        self.calls["add_rms_norm"] += 1
        return y, rstd, s

    def npu_swiglu(self, x, dim=-1):
        return self._call("npu_swiglu", self._swiglu, (x,), dict(dim=dim))

    def _swiglu(self, x, dim=-1):
        self._dtype("npu_swiglu", input=x)
        if not x.is_contiguous():
            raise RuntimeError("fake NPU: npu_swiglu takes no non-contiguous input")
        a, b = x.chunk(2, dim=dim)
        self.calls["swiglu"] += 1
        return F.silu(a) * b


def install(monkeypatch, version="2.8.0", soc=223, cann=None, fp32=False) -> FakeTorchNpu:
    """Make `import torch_npu` and `torch.npu` the fake for one test, and let the real
    NpuPlatform allocate on the CPU. By default in bf16, with the real backend's dtype rules
    and the ops' own. With fp32 (asked for by name, for exact token comparisons with the CPU
    reference path): the NPU's default dtype is float32 and every attention path and op
    takes it too, which their docs do not; every other rule still holds."""
    from dataclasses import replace

    from workbench.platforms.npu import NpuPlatform
    fake = FakeTorchNpu(version, soc, cann)
    fake.fp32 = fp32
    monkeypatch.setitem(sys.modules, "torch_npu", fake)
    monkeypatch.setattr(torch, "npu", fake.npu, raising=False)
    monkeypatch.setattr(NpuPlatform, "device", property(lambda self: torch.device("cpu")))
    _patch_copies(monkeypatch, fake.npu)
    monkeypatch.setattr(_OnStack(), "mode", _StreamOrder(fake.npu))
    if fp32:
        monkeypatch.setattr(NpuPlatform, "default_dtype", torch.float32)
        from workbench.platforms import npu_releases
        for name in ("ATB_PATH", "FIA_PA_PATH", "FIA_PATH"):
            path = getattr(npu_releases, name)
            monkeypatch.setattr(npu_releases, name,
                                replace(path, dtypes=(torch.float32, *path.dtypes)))
    return fake
