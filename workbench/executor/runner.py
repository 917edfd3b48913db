"""ModelRunner: owns the model and the KV pool, turns a scheduled step into tensors, runs it."""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

import numpy as np
import torch

from .graphs import GraphPlan, plan_graphs
from .staging import StagingBuffers
from ..utils import cdiv
from ..platforms.attention import CommonAttentionMetadata
from ..core.block_manager import NULL_BLOCK
from ..core.scheduler import SchedulerOutput
from ..telemetry import FULL, PIECEWISE

log = logging.getLogger("workbench")


@dataclass(slots=True)
class CachedRequestState:
    """What the runner keeps of a request between steps (vLLM's CachedRequestState): the
    scheduler sends it whole once (NewRequestData), then only what changed."""
    token_ids: list[int]
    """The tokens known to the runner (with async scheduling the last one sampled may still
    be on the device only: a decode step scheduled ahead reads its id from there)."""
    num_prompt_tokens: int
    block_ids: list[int]
    num_computed_tokens: int
    prompt_logprobs: int | None


class CachedRequests(dict):
    """The runner's requests by id, {id: CachedRequestState} (vLLM's `GPUModelRunner.requests`;
    not a batch of tensors: each step's tensors are built from it by `prepare`): every request
    the scheduler has sent it and not yet retired, kept up to date from each step's changes."""

    def update_from(self, out: SchedulerOutput) -> None:
        """Forget the requests that are gone, take the new ones whole, extend the others by
        their new tokens and blocks (in that order: an id that ended can come back in the same
        step, a request aborted and another added under its id)."""
        for rid in out.finished_req_ids:
            self.pop(rid, None)
        for n in out.new_reqs:
            self[n.req_id] = CachedRequestState(list(n.token_ids), n.num_prompt_tokens,
                                                list(n.block_ids), n.num_computed_tokens,
                                                n.prompt_logprobs)
        for c in out.cached_reqs:
            r = self[c.req_id]
            r.token_ids += c.new_token_ids
            if c.block_ids_from is not None:     # blocks of rejected drafts given back
                del r.block_ids[c.block_ids_from:]
            r.block_ids += c.new_block_ids
            r.num_computed_tokens = c.num_computed_tokens


@dataclass(slots=True)
class StepInputs:
    """One step as the model reads it: views of the staging buffers (executor/staging.py),
    valid until the step after next is prepared."""
    input_ids: torch.Tensor | None
    """[num_tokens]; None when the step's ids are already on the device (async scheduling)."""
    input_rows: torch.Tensor | None
    """When they are: [num_reqs] which row of the device-side ids each request reads."""
    positions: torch.Tensor
    logits_indices: torch.Tensor
    """The rows whose logits are computed: the sampling rows, then the prompt-logprob rows."""
    common: CommonAttentionMetadata
    sampling: list[str]
    """In logits order: the requests that sample."""
    num_rows: list[int] | None
    """Logits rows of each of them (1; a verify's 1 + its drafts), or None: one each."""
    prompt_spans: list[tuple[str, int, int]]
    """(request id, first position, count) of the prompt-logprob rows."""
    prompt_targets: torch.Tensor
    """[prompt-logprob rows] the prompt token each of them scores (the next position's)."""


@dataclass(slots=True)
class ModelRunnerOutput:
    """One step as a runner ran it, before sampling (vLLM's ModelRunnerOutput, less the
    sampled ids: the pipeline samples): the one result of ModelRunner.execute and of the
    modelled device's runner."""
    req_ids: list[str]
    """The requests of the sampling rows, in logits order: decodes first, then the prompts
    that reach their end and the verifies (each sequence by its own id; an n > 1 choice's
    is '<id>#<i>')."""
    graph: tuple[str, int] | None
    """How graphs ran it: (FULL, batch size) for a replayed decode graph, (PIECEWISE, token
    bucket), or None when it ran eager."""
    logits: torch.Tensor | None = None
    """[len(req_ids) + prompt rows, vocab] fp32 on the device: the sampling rows, then the
    prompt-logprob rows. None on a modelled device (it computes none)."""
    prompt_spans: list[tuple[str, int, int]] = field(default_factory=list)
    """(request id, first position, count) of the prompt-logprob rows after the sampling
    rows."""
    prompt_targets: torch.Tensor | None = None
    """[prompt-logprob rows] on the device: the prompt token each of them scores."""
    input_ids: torch.Tensor | None = None
    """A step launched from ids on the device (async scheduling): each sampling row's input
    id, gathered there (the token each request sampled the step before)."""
    sampled_token_ids: list[int] | None = None
    """Token ids the runner drew itself, one per sampling row (a modelled device's random
    tokens); None where the pipeline samples from `logits`."""
    seconds: float | None = None
    """The step's modelled time (a modelled device); None on a real one."""
    num_rows: list[int] | None = None
    """Speculative decoding: the logits rows of each of req_ids (a verify has one per
    position: 1 + its drafts), in order; None: one each."""
    num_accepted: list[int] | None = None
    """Speculative decoding on a modelled device: how many drafts of each of req_ids it
    drew as accepted (0 for a row that verified none); None on a real one (the pipeline's
    rejection sampler decides)."""


class ModelRunner:
    def __init__(self, model, num_blocks: int, block_size: int, platform, backend,
                 max_num_tokens: int = 2048, max_num_seqs: int = 256,
                 max_model_len: int = 4096):
        self.model = model
        self.platform = platform
        self.device = platform.device
        self.block_size = block_size
        self.num_blocks = num_blocks
        """Blocks in the pool, the block manager's null block included."""
        self.dtype = next(model.parameters()).dtype
        self.backend = backend
        """The platform's AttentionBackend: the pool's layout, the per-step metadata, the
        attention itself, and whether decode steps can be captured."""
        attn = model.layers[0].self_attn
        self.kv_cache = backend.bind(model.num_layers, attn.num_heads, model.num_kv_heads,
                                     model.head_dim, num_blocks, block_size, self.device)
        self.layer_caches = [(layer[0], layer[1]) for layer in self.kv_cache]   # views, made once
        self.requests = CachedRequests()
        """Every request the scheduler has sent and not yet retired, as the runner keeps it."""
        self.graphs = None
        """DecodeGraphs, once captured."""
        self.piecewise = None
        """PiecewiseGraphs, once captured (graph_mode 'full')."""
        self._graph_pool = None
        max_blocks = cdiv(max_model_len, block_size)
        self.staging = StagingBuffers(
            platform, 8 * (4 * max_num_tokens + max_num_seqs * (max_blocks + 3) + 16))
        """Where every step's inputs are written on the host and copied to the device from,
        sized for the largest step the scheduler makes (it grows for a larger one)."""

    def release(self) -> None:
        """Drop the KV pool, the captured graphs (and their memory pool) and the model."""
        self.graphs = self.piecewise = self._graph_pool = None
        self.kv_cache = self.layer_caches = None
        self.model = None
        self.requests.clear()

    @property
    def graph_pool(self):
        """The one memory pool every captured graph of this runner shares."""
        if self._graph_pool is None:
            self._graph_pool = self.platform.graph_pool()
        return self._graph_pool

    @property
    def can_capture_decode(self) -> bool:
        """Whole decode steps can be captured: the backend reads the pool in place through
        static tables and lengths."""
        return self.backend.supports_decode_graphs

    def capture_decode_graphs(self, sizes: list[int], max_model_len: int, progress=None) -> None:
        """Capture the decode forward at each batch size (see graph_runner.py)."""
        from .graph_runner import DecodeGraphs
        if not self.can_capture_decode:
            raise ValueError("graph_mode: capturing decode graphs needs the platform's fused "
                             "paged attention (attention_backend='auto')")
        max_blocks = cdiv(max_model_len, self.block_size)
        self.graphs = DecodeGraphs(self.model, self.layer_caches, self.platform, self.backend,
                                   sizes, max_blocks, self.block_size)
        self.graphs.capture(self.graph_pool, progress)

    def capture_piecewise_graphs(self, sizes: list[int], progress=None) -> None:
        """Capture every step but attention at each token bucket (see graph_runner.py)."""
        from .graph_runner import PiecewiseGraphs
        self.piecewise = PiecewiseGraphs(self.model, self.layer_caches, self.platform, sizes)
        self.piecewise.capture(self.graph_pool, progress)

    def capture_graphs(self, config, max_model_len: int) -> GraphPlan:
        """Capture what config.graph_mode comes to on this runner's platform (graphs.plan_graphs,
        the one decision) and return the plan as run."""
        plan = plan_graphs(config, self.platform, self.can_capture_decode, self.model.num_layers)
        decode_sizes, piecewise = plan.decode_sizes, plan.piecewise_sizes
        if plan.mode == "eager":
            return plan
        total = len(decode_sizes) + len(piecewise) * (self.model.num_layers + 1)
        t0 = time.perf_counter()
        from tqdm.auto import tqdm
        with tqdm(total=total, desc="capturing graphs", unit="graph", leave=False) as bar:
            tick = lambda done, total: bar.update(1)   # noqa: E731
            if decode_sizes:
                self.capture_decode_graphs(decode_sizes, max_model_len, tick)
            if piecewise:
                self.capture_piecewise_graphs(piecewise, tick)
        self.platform.synchronize()     # platforms may skip it between captures
        log.info("captured %d graphs in %.1f s: decode batch sizes %s, piecewise token "
                 "buckets %s", total, time.perf_counter() - t0, decode_sizes, piecewise)
        return plan

    @property
    def kv_cache_bytes(self) -> int:
        """The whole pool, the null block included."""
        return self.kv_cache.numel() * self.kv_cache.element_size()

    def prepare(self, out: SchedulerOutput, pad_to: int | None = None,
                input_rows: list[int] | None = None) -> StepInputs:
        """Flatten the step, decodes first, then prefill chunks, into the staging buffers
        and copy them to the device once. A verify (a decode with drafts, speculative
        decoding) is an ordinary chunk on cached context among the prefill chunks, whose
        logits are computed at every position, so every attention backend (the CPU's
        kernels, Triton, the NPU's FIA) runs it as it runs a chunk. pad_to: rows to pad a pure decode step to (a
        decode graph's size), each a token 0 at position 0 whose K/V goes to the null block.
        input_rows: the ids are on the device already (async scheduling), not yet known
        here; request i's is row input_rows[i] of them (staged in the ids' place).

        Slots are computed per block, vectorised: a token at position p of request r goes
        to table[r, p // block_size] * block_size + p % block_size."""
        bs = self.block_size
        state = self.requests
        state.update_from(out)
        decodes = [s for s in out.scheduled if s.is_decode and not s.spec_token_ids]
        prefills = [s for s in out.scheduled if not s.is_decode or s.spec_token_ids]
        reqs = decodes + prefills
        n, nd = len(reqs), len(decodes)
        rows = n if pad_to is None else pad_to
        counts = np.ones(rows, dtype=np.int64)
        counts[nd:n] = [s.num_new_tokens for s in prefills]
        num_tokens = int(counts.sum())
        sampling = [s.req_id for s in decodes]
        num_rows = [1] * nd if any(s.spec_token_ids for s in prefills) else None
        logits_rows: list[int] = []
        prompt_rows: list[int] = []
        prompt_spans: list[tuple[str, int, int]] = []
        targets: list[int] = []
        q_start = nd
        for s in prefills:
            k = s.num_new_tokens
            if s.will_sample:
                m = 1 + len(s.spec_token_ids)
                logits_rows += range(q_start + k - m, q_start + k)
                sampling.append(s.req_id)
                if num_rows is not None:
                    num_rows.append(m)
            # Prompt logprobs: the logits at each fed position whose next token is a prompt
            # token, in rows after the sampling rows.
            r = state[s.req_id]
            last = r.num_prompt_tokens - 1
            if r.prompt_logprobs is not None and s.start < last:
                count = min(s.start + k, last) - s.start
                prompt_spans.append((s.req_id, s.start, count))
                prompt_rows += range(q_start, q_start + count)
                targets += r.token_ids[s.start + 1:s.start + 1 + count]
            q_start += k
        tables = [state[s.req_id].block_ids for s in reqs]
        width = max(1, max(map(len, tables), default=1))
        num_logits = nd + len(logits_rows) + len(prompt_rows)
        ids, pos, slots, logits, qsl, lens, table, prompt_targets = self.staging.fill(
            [num_tokens, num_tokens, num_tokens, num_logits, rows + 1, rows, rows * width,
             len(targets)])

        qsl[0] = 0
        np.cumsum(counts, out=qsl[1:])
        starts = np.zeros(rows, dtype=np.int64)
        starts[:n] = [s.start for s in reqs]
        np.add(starts, counts, out=lens)
        table = table.reshape(rows, width)
        table.fill(NULL_BLOCK)
        for i, t in enumerate(tables):
            table[i, :len(t)] = t
        if num_tokens == rows:                       # one token a row: a pure decode step
            row = np.arange(rows)
            pos[:] = starts
        else:
            row = np.repeat(np.arange(rows), counts)
            np.add(np.arange(num_tokens) - qsl[row], starts[row], out=pos)
        np.add(table[row, pos // bs] * bs, pos % bs, out=slots)
        if input_rows is not None:
            ids[:n] = input_rows
            ids[n:] = 0
        else:
            ids[:nd] = [state[s.req_id].token_ids[s.start] for s in decodes]
            for s, a in zip(prefills, qsl[nd:n].tolist()):
                known = s.num_new_tokens - len(s.spec_token_ids)
                ids[a:a + known] = state[s.req_id].token_ids[s.start:s.start + known]
                ids[a + known:a + s.num_new_tokens] = s.spec_token_ids
            ids[qsl[n]:] = 0
        logits[:nd] = np.arange(nd)
        logits[nd:] = logits_rows + prompt_rows
        prompt_targets[:] = targets

        (d_ids, d_pos, d_slots, d_logits, d_qsl, d_lens, d_table, d_targets), host = \
            self.staging.commit()
        common = CommonAttentionMetadata(
            query_start_loc=d_qsl, seq_lens=d_lens, block_table=d_table.view(rows, width),
            slot_mapping=d_slots, num_decode=nd if pad_to is None else rows,
            query_start_loc_cpu=host[4], seq_lens_cpu=host[5])
        on_device = input_rows is not None
        return StepInputs(None if on_device else d_ids, d_ids[:n] if on_device else None, d_pos,
                          d_logits, common, sampling, num_rows, prompt_spans, d_targets)

    def _replay_decode(self, out: SchedulerOutput, input_ids: torch.Tensor | None = None,
                       input_rows: list[int] | None = None):
        """A pure decode step on a captured graph, or None to run it eager. input_ids,
        input_rows: see execute."""
        g = self.graphs
        if g is None or not out.scheduled or not all(s.is_decode and not s.spec_token_ids
                                                     for s in out.scheduled):
            return None
        size = g.size_for(len(out.scheduled))
        if size is None:
            return None
        if input_ids is not None:
            step = self.prepare(out, pad_to=size, input_rows=input_rows)
            input_ids = input_ids.index_select(0, step.input_rows)
        else:
            step = self.prepare(out, pad_to=size)
        logits, size = g.run(step, len(out.scheduled), input_ids)
        return ModelRunnerOutput(step.sampling, (FULL, size), logits, input_ids=input_ids)

    @torch.inference_mode()
    def execute(self, out: SchedulerOutput, input_ids: torch.Tensor | None = None,
                input_rows: list[int] | None = None) -> ModelRunnerOutput:
        """Run one step (see ModelRunnerOutput). input_ids: for a decode step scheduled
        before its tokens reached the host, the step before's sampled ids on the device, of
        which request i reads row input_rows[i]."""
        replayed = self._replay_decode(out, input_ids, input_rows)
        if replayed is not None:
            return replayed
        assert input_ids is None, "device-side ids need a decode graph (async scheduling)"
        step = self.prepare(out)
        meta = self.backend.build(step.common)
        input_ids, positions, logits_indices = step.input_ids, step.positions, step.logits_indices
        sampling, spans, targets = step.sampling, step.prompt_spans, step.prompt_targets
        pw = self.piecewise
        if pw is not None and pw.size_for(input_ids.shape[0]) is not None:
            logits, size = pw.run(input_ids, positions, meta, logits_indices)
            return ModelRunnerOutput(sampling, (PIECEWISE, size), logits, spans, targets,
                                     num_rows=step.num_rows)
        logits = self.model(input_ids, positions, self.layer_caches, meta, logits_indices)
        return ModelRunnerOutput(sampling, None, logits, spans, targets,
                                 num_rows=step.num_rows)
