"""Attention on Ascend NPUs through torch_npu's fused ops, written from their documented
signatures (see ../shared/notes/torch_npu.md in the project's notes). Not yet run on NPU
hardware: the CPU tests drive it through NpuPlatform with a fake torch_npu
(tests/fake_torch_npu.py) that follows those documented semantics, which checks our
layouts, arguments and graph protocol, not the ops themselves.

Pool layout (what the ATB ops read): per layer, K and V each
[num_blocks, block_size, num_kv_heads, head_dim], ND, bf16 or fp16.

Per step, for every layer, the KV write is `_npu_reshape_and_cache(key, value, key_cache,
value_cache, slot_indices)` with int32 slots (block * block_size + offset). The attention
follows the path vLLM-Ascend ran on the CANN release found (npu.attention_path; README's
version table):

- 'fia' (CANN 8.3.RC2 on; vLLM-Ascend v0.12.0rc1 on): every step through
  `npu_fused_infer_attention_score` in TND layout with the block tables, cumulative query
  ends and per-request KV lengths, sparse_mode=3 and vLLM-Ascend's 2048 x 2048 int8 causal
  mask, built on the host and moved once (attention_mask.py at f1f2c8f5e5, lines 55-57:
  triu(ones(2048, 2048), diagonal=1).to(int8).to(device)). One call for the decodes and one
  for the chunks, because the step's metadata keeps their tables apart.
- 'fia+pa' (CANN 8.3.RC1; vLLM-Ascend v0.11.0): the same, but a decode-only step runs eager
  `_npu_paged_attention` (attention_v1.py _forward_decode_only at v0.11.0).
- 'atb' (before CANN 8.3.RC1: torch_npu 2.5.1, 2.5.1.post1, 2.6.0; vLLM-Ascend v0.9.1 to
  v0.11.0rc0): a step of prompts with nothing cached runs `_npu_flash_attention` over the
  step's own K/V; a decode-only step `_npu_paged_attention`; any other step (chunks after a
  cached prefix, mixed steps) one `_npu_paged_attention_splitfuse` over the whole batch.
  Their masks are built per step on the host, in the model's dtype, as vLLM-Ascend's
  AttentionMaskBuilder built them (attention_mask.py at v0.10.1rc1: masked entries 1 in
  bf16 for flash attention, times -10000 for splitfuse; float32's min, -inf in fp16, for
  both in fp16), and moved with one blocking copy.
- only inside a whole-step decode graph (graph_mode 'decode', or a pa_shape_list size):
  `_npu_paged_attention(...)` over the decodes' block tables (int32 on the device) and
  context lengths (int32 on the host, as the op wants), as a task group (below).
Block size 128 (vLLM-Ascend's choice): NpuAttention's `supported_block_sizes`, which
`check_config` enforces.

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
    workspace: torch.Tensor | None = None
    """The workspace the task was last handed (at capture, then by each update that reached
    it), held while the task can run with it: a replay runs after update() has returned,
    and after a failed update the tasks it did not reach run with the one an earlier step
    gave them, which nothing else holds by then."""


def capture_lens(context_lens: torch.Tensor, table_width: int, block_size: int) -> torch.Tensor:
    """The lengths a decode graph's paged attention is captured with: vLLM-Ascend's 6144
    (SEQ_LEN_WITH_MAX_PA_WORKSPACE) where the graph's tables are that wide, else as many
    tokens as they hold: a captured task never claims more KV than its table rows address
    (graph_runner.DecodeGraphs sizes them cdiv(max_model_len, block_size) wide), so the
    workspace and tiling the capture fixes describe lengths a step can have, and a replay
    that runs with the captured arguments (a failed update, replay_graph) reads only blocks
    its tables name."""
    return torch.full_like(context_lens, min(SEQ_LEN_WITH_MAX_PA_WORKSPACE,
                                             table_width * block_size))


class DecodeGraphTasks:
    """One captured decode graph and its layers' paged-attention task groups, vLLM-Ascend's
    FULL_DECODE_ONLY mechanism (attention_v1's full_graph_pa and update_graph_params).

    Capture (NpuAttention, while `graph_tasks` is set): per layer, an ExternalEvent is
    waited on and reset on the capture stream, then the op is issued between
    graph_task_group_begin and graph_task_group_end with every length at `capture_lens`
    and the workspace queried for those. Replay (NpuPlatform.replay_graph): after replay(),
    on an update stream, the workspace is queried for the step's lengths, then each task is
    re-issued between graph_task_update_begin and graph_task_update_end with those lengths
    and that workspace and its event recorded, which lets the captured attention run. Where
    anything in the update fails, `release` records every event not yet recorded, so the
    replay runs to its end (with arguments the step then discards) instead of waiting
    forever."""

    def __init__(self, graph):
        self.graph = graph
        self.tasks: list[PagedAttentionTask] = []
        self.workspace: torch.Tensor | None = None
        """The capture-time workspace (for the longest lengths): what an update falls back
        to where this torch_npu cannot size one for the step."""
        self.recorded = 0
        """How many tasks' events this replay's update has recorded."""
        self.updating = False
        """Between a graph_task_update_begin and its _end."""

    def capture(self, ops, args: dict, context_lens: torch.Tensor) -> None:
        npu = ops.npu
        stream = npu.current_stream()
        longest = capture_lens(context_lens, args["block_table"].shape[1],
                               args["key_cache"].shape[1])
        if self.workspace is None:    # one per graph: its layers run one after another
            self.workspace = ops._npu_paged_attention_get_workspace(**args, context_lens=longest)
        event = npu.ExternalEvent()
        event.wait(stream)
        event.reset(stream)
        npu.graph_task_group_begin(stream)
        ops._npu_paged_attention(**args, context_lens=longest, workspace=self.workspace)
        self.tasks.append(PagedAttentionTask(event, npu.graph_task_group_end(stream), args,
                                             self.workspace))

    def update(self, ops, stream, context_lens: torch.Tensor) -> None:
        """Hand every task this step's host-side lengths (int32, one per graph row) and a
        workspace sized for them (one query for all layers: same shapes, same lengths)."""
        self.recorded, self.updating = 0, False
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
            for task in self.tasks:
                npu.graph_task_update_begin(stream, task.handle)
                self.updating = True
                ops._npu_paged_attention(**task.args, context_lens=context_lens,
                                         workspace=workspace)
                task.workspace = workspace
                npu.graph_task_update_end(stream)
                self.updating = False
                task.event.record(stream)
                self.recorded += 1

    def release(self, ops, stream) -> list[str]:
        """After a failed update: close an update left open and record the event of every
        task not yet updated, so the replay finishes (those tasks run with the arguments they
        last had, over blocks their tables name: capture_lens). Returns what failed on the
        way (best effort: each step is tried)."""
        npu, errors = ops.npu, []
        with npu.stream(stream):
            if self.updating:
                try:
                    npu.graph_task_update_end(stream)
                except Exception as e:
                    errors.append(f"graph_task_update_end: {e}")
                self.updating = False
            for task in self.tasks[self.recorded:]:
                try:
                    task.event.record(stream)
                except Exception as e:
                    errors.append(f"ExternalEvent.record: {e}")
            self.recorded = len(self.tasks)
        return errors


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
    atb: dict | None = None
    """The 'atb' path's one call for a step holding prefill tokens: its op's name and the
    arguments the step fixes (masks, lengths, tables), built once for every layer."""


def atb_mask(positions: torch.Tensor, width: int, dtype: torch.dtype,
             splitfuse: bool) -> torch.Tensor:
    """vLLM-Ascend's masks for the ATB prefill ops, on the host: row i masks the columns after
    positions[i]. Masked entries as its AttentionMaskBuilder made them (attention_mask.py at
    v0.10.1rc1, _generate_attn_mask and get_splitfuse_attn_mask): in fp16 float32's min
    (-inf once cast); else 1, and -10000 (get_mask_scale_factor) for splitfuse."""
    masked = torch.arange(width)[None, :] > positions[:, None]
    if dtype == torch.float16:
        value = torch.finfo(torch.float32).min
    else:
        value = -10000.0 if splitfuse else 1.0
    return torch.zeros(masked.shape, dtype=torch.float32).masked_fill(masked, value).to(dtype)


class NpuAttention(AttentionBackend):
    name = "npu"
    supported_dtypes = (torch.bfloat16, torch.float16)
    """The dtypes some path takes; an instance narrows them to its path's (npu.AttentionPath:
    TND layout takes bf16 only)."""
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

    def __init__(self, dtype, ops, path):
        super().__init__(dtype)
        self.ops = ops
        """The torch_npu module (or, in tests, something with the same functions)."""
        self.path = path
        """npu.AttentionPath: which ops run which steps on this CANN."""
        self.supported_dtypes = path.dtypes
        self._mask: torch.Tensor | None = None
        self.graph_tasks: DecodeGraphTasks | None = None
        """Set by NpuPlatform.capture_graph while it captures: decode attention is then
        recorded there as task groups."""

    def check_config(self, config, device: str) -> None:
        if self.dtype not in self.supported_dtypes and self.path.why_dtypes:
            raise ValueError(f"dtype: {str(self.dtype).replace('torch.', '')} is refused on "
                             f"this CANN's attention path ({self.path.name!r}): "
                             f"{self.path.why_dtypes}")
        super().check_config(config, device)

    def kv_cache_shape(self, num_layers, kv_heads, num_blocks, block_size, head_dim):
        """What the ATB ops read: per layer, K and V each [num_blocks, block_size,
        num_kv_heads, head_dim]."""
        return (num_layers, 2, num_blocks, block_size, kv_heads, head_dim)

    def bind(self, *args, **kwargs) -> torch.Tensor:
        pool = super().bind(*args, **kwargs)
        if self.path.chunked == "npu_fused_infer_attention_score":
            # vLLM-Ascend's form (attention_mask.py at f1f2c8f5e5, lines 55-57): int8, built
            # on the host, moved once; 1 marks a masked entry.
            self._mask = torch.triu(torch.ones(MASK_SIZE, MASK_SIZE), diagonal=1).to(
                torch.int8).to(self.device)
        return pool

    def build(self, common: CommonAttentionMetadata) -> NpuMetadata:
        """int32 slots and tables, converted on the device (the step's tensors are there
        already: no copy of our own, see executor/staging.py); decode lengths int32 on the
        host, and the chunks' bounds as lists, as the ops take them. On the 'atb' path a
        step with prefill tokens also gets its masks, built on the host and copied once."""
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
            if self.path.name == "atb":
                meta.atb = self._atb_args(common, bounds)
        return meta

    def _atb_args(self, common, bounds) -> dict:
        """The 'atb' path's call for a step with prefill tokens (vLLM-Ascend's
        _build_attn_state at v0.10.1rc1: all prompts, nothing cached -> flash attention;
        otherwise splitfuse over every request)."""
        nd = common.num_decode
        q_lens = [1] * nd + [e - s for s, e, _ in bounds]
        ctx = common.seq_lens_cpu.tolist()
        if nd == 0 and q_lens == ctx:
            width = max(ctx)
            return dict(op="_npu_flash_attention",
                        mask=atb_mask(torch.arange(width), width, self.dtype, False).to(
                            self.device),
                        seq_len=torch.tensor(q_lens, dtype=torch.int32))
        positions = torch.cat([torch.arange(c - q, c) for q, c in zip(q_lens, ctx)])
        return dict(op="_npu_paged_attention_splitfuse",
                    mask=atb_mask(positions, max(ctx), self.dtype, True).to(self.device),
                    seq_len=torch.tensor(q_lens, dtype=torch.int32),
                    context_lens=torch.tensor(ctx, dtype=torch.int32),
                    block_table=common.block_table.to(torch.int32))

    def causal_mask(self, device) -> torch.Tensor:
        """The FIA paths' 2048 x 2048 int8 mask (made by bind)."""
        return self._mask

    def forward(self, q, k, v, k_cache, v_cache, meta: NpuMetadata, scale: float) -> torch.Tensor:
        ops = self.ops
        ops._npu_reshape_and_cache(key=k.contiguous(), value=v.contiguous(), key_cache=k_cache,
                                   value_cache=v_cache, slot_indices=meta.slot_mapping)
        heads, kv_heads = q.shape[1], k_cache.shape[2]
        out = torch.empty_like(q)
        nd = meta.num_decode
        paged = dict(key_cache=k_cache, value_cache=v_cache, num_kv_heads=kv_heads,
                     num_heads=heads, scale_value=scale)
        if meta.atb is not None:                      # 'atb' path, a step with prefill tokens
            a = meta.atb
            if a["op"] == "_npu_flash_attention":
                ops._npu_flash_attention(query=q.contiguous(), key=k.contiguous(),
                                         value=v.contiguous(), mask=a["mask"],
                                         seq_len=a["seq_len"], scale_value=scale,
                                         num_heads=heads, num_kv_heads=kv_heads, out=out)
            else:
                ops._npu_paged_attention_splitfuse(
                    query=q.contiguous(), key_cache=k_cache, value_cache=v_cache,
                    block_table=a["block_table"], context_lens=a["context_lens"],
                    mask=a["mask"], seq_len=a["seq_len"], num_kv_heads=kv_heads,
                    num_heads=heads, scale_value=scale, out=out)
            return out
        if nd and self.graph_tasks is not None:       # a whole-step decode graph
            args = dict(query=q[:nd].contiguous(), **paged,
                        block_table=meta.decode_block_tables, out=out[:nd])
            self.graph_tasks.capture(ops, args, meta.decode_lens)
        elif nd and meta.q_ends is None and self.path.decode == "_npu_paged_attention":
            ops._npu_paged_attention(query=q[:nd].contiguous(), **paged,
                                     block_table=meta.decode_block_tables,
                                     context_lens=meta.decode_lens, out=out[:nd])
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
