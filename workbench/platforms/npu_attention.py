"""Attention on Ascend NPUs through torch_npu's fused ops, written from their documented
signatures (see ../shared/notes/torch_npu.md in the project's notes). Not yet run on NPU
hardware: the CPU tests drive it through NpuPlatform with a fake torch_npu
(tests/fake_torch_npu.py) that follows those documented semantics, which checks our
layouts, arguments and graph protocol, not the ops themselves.

Pool layout (what the ATB ops read): per layer, K and V each
[num_blocks, block_size, num_kv_heads, head_dim], ND, bf16 or fp16.

Per step, for every layer:
- KV write: `_npu_reshape_and_cache(key, value, key_cache, value_cache, slot_indices)`, int32
  slots (block * block_size + offset);
- decodes and prefill chunks alike: `npu_fused_infer_attention_score` in TND layout with the
  block tables, cumulative query ends and per-request KV lengths, sparse_mode=3 (causal
  aligned to the end of each request's KV, which is what a chunk after a cached prefix
  needs, and no mask at all for a query of one token) and the 2048 x 2048 mask that mode
  expects. This is how vLLM-Ascend runs eager and piecewise steps (attention_v1.py
  forward_fused_infer_attention since b4bf01ead169, PR #4531; at 182b75ea84ff a decode-only
  batch passes query ends 1, 2, ..., n, as `_fused` gets them here); it issues one call over the
  whole batch, this backend one for the decodes and one for the chunks, because the step's
  metadata keeps their tables apart;
- only inside a whole-step decode graph (graph_mode 'decode', or a pa_shape_list size):
  `_npu_paged_attention(...)` over the decodes' block tables (int32 on the device) and
  context lengths (int32 on the host, as the op wants), as a task group (below).
FIA's paged prefill wants block_size 128 (vLLM-Ascend's choice): NpuAttention's
`supported_block_sizes`, which `check_config` enforces.

Inside a decode graph the paged attention is a task group (DecodeGraphTasks): its host-side
lengths are baked into the graph at capture, and each replay re-issues it with the step's.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .attention import AttentionBackend, AttentionMetadata, CommonAttentionMetadata

BLOCK_SIZE = 128
MASK_SIZE = 2048
SEQ_LEN_WITH_MAX_PA_WORKSPACE = 6144
"""Context length at which _npu_paged_attention_get_workspace returns the largest workspace
(vLLM-Ascend's constant, PR #5833). vLLM-Ascend captures its paged-attention graphs with every
row at this length (model_runner_v1.py's dummy run while capturing) and the workspace queried
for it, so the captured task is laid out for the longest case, not for capture-time lengths
of 1; its update then asks for the workspace again with the step's lengths (attention/utils.py
and attention_v1.py update_graph_params since PRs #6041/#6231). DecodeGraphTasks does both."""


@dataclass(slots=True)
class PagedAttentionTask:
    event: object
    """The torch.npu.ExternalEvent the captured attention waits on until its update lands."""
    handle: object
    """What graph_task_group_end returned: names the task for graph_task_update_begin."""
    args: dict
    """The op's arguments but context_lens and workspace: the captured tensors, reused as
    they are by every update (a graph's addresses are fixed)."""


class DecodeGraphTasks:
    """One captured decode graph and its layers' paged-attention task groups, vLLM-Ascend's
    FULL_DECODE_ONLY mechanism (attention_v1's full_graph_pa and update_graph_params).

    Capture (NpuAttention, while `graph_tasks` is set): per layer, an ExternalEvent is
    waited on and reset on the capture stream, then the op is issued between
    graph_task_group_begin and graph_task_group_end with every length at
    SEQ_LEN_WITH_MAX_PA_WORKSPACE and the workspace queried for those. Replay
    (NpuPlatform.replay_graph): after replay(), on an update stream, the workspace is queried
    for the step's lengths, then each task is re-issued between graph_task_update_begin and
    graph_task_update_end with those lengths and that workspace and its event recorded,
    which lets the captured attention run."""

    def __init__(self, graph):
        self.graph = graph
        self.tasks: list[PagedAttentionTask] = []
        self.workspace: torch.Tensor | None = None
        """The capture-time workspace (for the longest lengths): what an update falls back
        to where this torch_npu cannot size one for the step."""
        self.step_workspace: torch.Tensor | None = None
        """The last update's workspace, held until the next update: the replayed kernels
        read it after update() has returned."""

    def capture(self, ops, args: dict, context_lens: torch.Tensor) -> None:
        npu = ops.npu
        stream = npu.current_stream()
        longest = torch.full_like(context_lens, SEQ_LEN_WITH_MAX_PA_WORKSPACE)
        if self.workspace is None:    # one per graph: its layers run one after another
            self.workspace = ops._npu_paged_attention_get_workspace(**args, context_lens=longest)
        event = npu.ExternalEvent()
        event.wait(stream)
        event.reset(stream)
        npu.graph_task_group_begin(stream)
        ops._npu_paged_attention(**args, context_lens=longest, workspace=self.workspace)
        self.tasks.append(PagedAttentionTask(event, npu.graph_task_group_end(stream), args))

    def update(self, ops, stream, context_lens: torch.Tensor) -> None:
        """Hand every task this step's host-side lengths (int32, one per graph row) and a
        workspace sized for them (one query for all layers: same shapes, same lengths)."""
        rows = self.tasks[0].args["query"].shape[0]
        if context_lens.dtype != torch.int32 or context_lens.shape != (rows,):
            raise ValueError(f"context_lens: need int32 [{rows}] for this graph "
                             f"(got {context_lens.dtype} {tuple(context_lens.shape)})")
        npu = ops.npu
        query = getattr(ops, "_npu_paged_attention_get_workspace", None)
        with npu.stream(stream):
            workspace = self.workspace
            if query is not None:
                workspace = query(**self.tasks[0].args, context_lens=context_lens)
            self.step_workspace = workspace
            for task in self.tasks:
                npu.graph_task_update_begin(stream, task.handle)
                ops._npu_paged_attention(**task.args, context_lens=context_lens,
                                         workspace=workspace)
                npu.graph_task_update_end(stream)
                task.event.record(stream)


@dataclass(slots=True)
class NpuMetadata(AttentionMetadata):
    decode_block_tables: torch.Tensor | None = None
    """[num_decode, width] int32 on the device."""
    decode_lens: torch.Tensor | None = None
    """[num_decode] int32 on the host, as _npu_paged_attention reads them."""
    prefill_block_tables: torch.Tensor | None = None
    """[chunks, width] int32 on the device."""
    q_ends: list[int] | None = None
    """Cumulative query ends of the prefill chunks (TND's actual_seq_lengths)."""
    kv_lens: list[int] | None = None
    """Each chunk's cached prefix + its tokens (actual_seq_lengths_kv)."""


class NpuAttention(AttentionBackend):
    name = "npu"
    supported_dtypes = (torch.bfloat16, torch.float16)
    supported_block_sizes = (BLOCK_SIZE,)
    """FIA's paged prefill pages in blocks of 128 (vLLM-Ascend's choice)."""
    default_block_size = BLOCK_SIZE
    supports_decode_graphs = True
    """Decode steps can be captured whole (graph_runner.DecodeGraphs; opt-in on the NPU, see
    NpuPlatform.default_graph_mode): the KV write and paged attention read static buffers,
    and the host-side context lengths reach each replay through task updates
    (DecodeGraphTasks, NpuPlatform.replay_graph)."""
    index_dtype = torch.int32
    lens_on_host = True

    def __init__(self, dtype, ops):
        super().__init__(dtype)
        self.ops = ops
        """The torch_npu module (or, in tests, something with the same functions)."""
        self._mask: torch.Tensor | None = None
        self.graph_tasks: DecodeGraphTasks | None = None
        """Set by NpuPlatform.capture_graph while it captures: decode attention is then
        recorded there as task groups."""

    def kv_cache_shape(self, num_layers, kv_heads, num_blocks, block_size, head_dim):
        """What the ATB ops read: per layer, K and V each [num_blocks, block_size,
        num_kv_heads, head_dim]."""
        return (num_layers, 2, num_blocks, block_size, kv_heads, head_dim)

    def build(self, common: CommonAttentionMetadata) -> NpuMetadata:
        """int32 slots and tables, converted on the device (the step's tensors are there
        already: no copy of our own, see executor/staging.py); decode lengths int32 on the
        host, and the chunks' bounds as lists, as the ops take them."""
        nd = common.num_decode
        meta = NpuMetadata(self, common.slot_mapping.to(torch.int32), nd)
        if nd:
            meta.decode_block_tables = common.block_table[:nd].to(torch.int32)
            meta.decode_lens = common.seq_lens_cpu[:nd].to(torch.int32)
        if common.num_reqs > nd:
            meta.prefill_block_tables = common.block_table[nd:].to(torch.int32)
            bounds = common.prefill_bounds()
            meta.q_ends = [e for _, e, _ in bounds]
            meta.kv_lens = [ctx for _, _, ctx in bounds]
        return meta

    def causal_mask(self, device) -> torch.Tensor:
        if self._mask is None or self._mask.device != device:
            self._mask = torch.triu(torch.ones(MASK_SIZE, MASK_SIZE, dtype=torch.bool,
                                               device=device), diagonal=1)
        return self._mask

    def forward(self, q, k, v, k_cache, v_cache, meta: NpuMetadata, scale: float) -> torch.Tensor:
        ops = self.ops
        ops._npu_reshape_and_cache(key=k.contiguous(), value=v.contiguous(), key_cache=k_cache,
                                   value_cache=v_cache, slot_indices=meta.slot_mapping)
        heads, kv_heads = q.shape[1], k_cache.shape[2]
        out = torch.empty_like(q)
        nd = meta.num_decode
        if nd and self.graph_tasks is not None:       # a whole-step decode graph
            args = dict(query=q[:nd].contiguous(), key_cache=k_cache, value_cache=v_cache,
                        num_kv_heads=kv_heads, num_heads=heads, scale_value=scale,
                        block_table=meta.decode_block_tables, out=out[:nd])
            self.graph_tasks.capture(ops, args, meta.decode_lens)
        elif nd:
            out[:nd] = self._fused(q[:nd], k_cache, v_cache, list(range(1, nd + 1)),
                                   meta.decode_lens.tolist(), meta.decode_block_tables, scale)
        if meta.q_ends is not None:
            out[nd:] = self._fused(q[nd:], k_cache, v_cache, meta.q_ends, meta.kv_lens,
                                   meta.prefill_block_tables, scale)
        return out

    def _fused(self, q, k_cache, v_cache, q_ends: list[int], kv_lens: list[int], tables,
               scale: float) -> torch.Tensor:
        """npu_fused_infer_attention_score over the pool, TND: q [T, heads, D] for requests
        ending at the cumulative q_ends, each over its kv_lens tokens through its table row."""
        num_blocks, block_size, kv_heads, d = k_cache.shape
        o, _ = self.ops.npu_fused_infer_attention_score(
            q.contiguous(), k_cache.view(num_blocks, block_size, kv_heads * d),
            v_cache.view(num_blocks, block_size, kv_heads * d),
            atten_mask=self.causal_mask(q.device), actual_seq_lengths=q_ends,
            actual_seq_lengths_kv=kv_lens, block_table=tables, num_heads=q.shape[1],
            scale=scale, input_layout="TND", num_key_value_heads=kv_heads, sparse_mode=3,
            block_size=block_size)
        return o
