"""ModelRunner: owns the model and the KV pool, turns a scheduled step into tensors, runs it."""
from __future__ import annotations

import logging
import time

import torch

from .graphs import default_capture_sizes, default_piecewise_sizes
from ..utils import cdiv
from .attention import AttentionMetadata, PrefillSpan, block_table_array, pool_rows, slot
from ..core.scheduler import ScheduledSeq, SchedulerOutput
from ..telemetry import FULL, PIECEWISE

log = logging.getLogger("workbench")


class ModelRunner:
    def __init__(self, model, num_blocks: int, block_size: int, platform,
                 attention_backend: str = "auto"):
        self.model = model
        self.platform = platform
        self.device = platform.device
        self.block_size = block_size
        self.num_blocks = num_blocks
        """Blocks the block manager hands out (the pool holds one more: scratch)."""
        p = next(model.parameters())
        self.dtype = p.dtype
        # One allocation for the whole pool; layer i uses kv_cache[i][0] (K) and [i][1] (V).
        # The last block is scratch, never handed out: padded rows of a replayed decode graph
        # write their K/V there.
        self.scratch_block = num_blocks
        shape = platform.kv_cache_shape(model.num_layers, model.num_kv_heads, num_blocks + 1,
                                        block_size, model.head_dim)
        self.kv_cache = torch.zeros(shape, dtype=self.dtype, device=self.device)
        self.layer_caches = [(layer[0], layer[1]) for layer in self.kv_cache]   # views, made once
        auto = attention_backend == "auto"
        self.backend = platform.attention_backend(self.dtype) if auto else None
        self.decode_kernel = platform.decode_attention_kernel(self.dtype) if auto else None
        self.write_kernel = platform.kv_write_kernel(self.dtype) if auto else None
        self.prefill_kernel = (platform.prefill_attention_kernel(self.dtype)
                               if auto and self.backend is None else None)
        if self.backend is None and len(shape) != 6:
            raise ValueError("attention_backend: this device's KV layout needs its own attention "
                             "backend; 'reference' is not available here")
        self.graphs = None
        """DecodeGraphs, once captured."""
        self.piecewise = None
        """PiecewiseGraphs, once captured (graph_mode 'full')."""
        self._graph_pool = None

    def release(self) -> None:
        """Drop the KV pool, the captured graphs (and their memory pool) and the model."""
        self.graphs = self.piecewise = self._graph_pool = None
        self.kv_cache = self.layer_caches = None
        self.model = None

    @property
    def graph_pool(self):
        """The one memory pool every captured graph of this runner shares."""
        if self._graph_pool is None:
            self._graph_pool = self.platform.graph_pool()
        return self._graph_pool

    @property
    def can_capture_decode(self) -> bool:
        """Whole decode steps can be captured: the platform's fused paged attention (a
        decode kernel, or a backend that supports capture) reads the pool in place."""
        return self.decode_kernel is not None or getattr(self.backend, "supports_graphs", False)

    def capture_decode_graphs(self, sizes: list[int], max_model_len: int, progress=None) -> None:
        """Capture the decode forward at each batch size (see graph_runner.py)."""
        from .graph_runner import DecodeGraphs
        if not self.can_capture_decode:
            raise ValueError("graph_mode: capturing decode graphs needs the platform's fused "
                             "paged attention (attention_backend='auto')")
        max_blocks = cdiv(max_model_len, self.block_size)
        self.graphs = DecodeGraphs(self.model, self.layer_caches, self.platform, sizes,
                                   max_blocks, self.scratch_block, self.block_size,
                                   kernel=self.decode_kernel, backend=self.backend,
                                   write_kernel=self.write_kernel)
        self.graphs.capture(self.graph_pool, progress)

    def capture_piecewise_graphs(self, sizes: list[int], progress=None) -> None:
        """Capture every step but attention at each token bucket (see graph_runner.py)."""
        from .graph_runner import PiecewiseGraphs
        self.piecewise = PiecewiseGraphs(self.model, self.layer_caches, self.platform, sizes)
        self.piecewise.capture(self.graph_pool, progress)

    def capture_graphs(self, config, max_model_len: int) -> tuple[str, list[int], list[int], list[str]]:
        """Capture what config.graph_mode asks for, where this runner can; the one place that
        decides it. Returns the mode as run, the decode batch sizes and piecewise token
        buckets captured, and notices saying what runs differently from what was asked."""
        decode = self.can_capture_decode
        asked = config.graph_mode
        if asked is None:     # the device's choice: decode graphs where they can be captured
            asked = "decode" if self.platform.supports_graphs and decode else "eager"
        if asked == "eager":
            return "eager", [], [], []
        why = None
        if not self.platform.supports_graphs:
            why = f"graph capture is not available on {self.platform.name} in this build"
        elif not decode and asked == "decode":
            why = ("capture needs the platform's fused paged attention, and this engine "
                   "uses the plain-torch path (attention_backend or dtype)")
        if why is not None:
            return "eager", [], [], [f"graph_mode={asked!r} asked for, but {why}: every step "
                                     "runs eager (StepEvent.graph stays False)"]
        decode_sizes = ((config.cudagraph_capture_sizes
                         or default_capture_sizes(config.max_num_seqs)) if decode else [])
        piecewise = (default_piecewise_sizes(config.max_num_batched_tokens)
                     if asked == "full" else [])
        total = len(decode_sizes) + len(piecewise) * (self.model.num_layers + 1)
        t0 = time.perf_counter()
        from tqdm.auto import tqdm
        with tqdm(total=total, desc="capturing graphs", unit="graph", leave=False) as bar:
            tick = lambda done, total: bar.update(1)   # noqa: E731
            if decode_sizes:
                self.capture_decode_graphs(decode_sizes, max_model_len, tick)
            if piecewise:
                self.capture_piecewise_graphs(piecewise, tick)
        log.info("captured %d graphs in %.1f s: decode batch sizes %s, piecewise token "
                 "buckets %s", total, time.perf_counter() - t0, decode_sizes, piecewise)
        notices = []
        if asked == "full" and not decode:
            notices.append("graph_mode='full': decode steps replay piecewise graphs with "
                           "attention eager; whole decode-step graphs need the platform's "
                           "fused paged attention (attention_backend or dtype)")
        return asked, decode_sizes, piecewise, notices

    @property
    def attention_backend(self) -> str:
        return "fused" if (self.decode_kernel or self.backend) is not None else "reference"

    @property
    def kv_cache_bytes(self) -> int:
        """The whole pool, the scratch block included."""
        return self.kv_cache.numel() * self.kv_cache.element_size()

    def prepare(self, out: SchedulerOutput):
        """Flatten the step: decodes first, then prefill chunks. Returns model inputs, the
        attention metadata and, in logits order, the scheduled sequences that sample."""
        bs = self.block_size
        dev = self.device
        to = (lambda t: t.to(dev, non_blocking=True)) if dev.type != "cpu" else (lambda t: t)
        decodes = [s for s in out.scheduled if s.is_decode]
        prefills = [s for s in out.scheduled if not s.is_decode]
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        logits_rows: list[int] = []
        sampling: list[ScheduledSeq] = []
        prompt_rows: list[int] = []
        prompt_spans: list[tuple[ScheduledSeq, int, int]] = []

        for s in decodes:
            p = s.start
            input_ids.append(s.seq.token_ids[p])
            positions.append(p)
            slots.append(slot(s.seq.block_table, p, bs))
            logits_rows.append(len(logits_rows))
            sampling.append(s)
        decode_rows = decode_bias = scratch = tables = lens = None
        kv_heads = self.model.num_kv_heads
        if decodes:
            max_blocks = max(len(s.seq.block_table) for s in decodes)
            tables = block_table_array([s.seq.block_table for s in decodes], max_blocks, 0)
            lens = torch.tensor([s.start + 1 for s in decodes])
            if self.decode_kernel is None and self.backend is None:
                decode_rows = pool_rows(tables, kv_heads, self.num_blocks + 1)
                pad = torch.arange(max_blocks * bs)[None, :] >= lens[:, None]
                decode_bias = torch.zeros(pad.shape, dtype=self.dtype).masked_fill_(pad, float("-inf"))
                decode_bias = to(decode_bias.unsqueeze(1).repeat(kv_heads, 1, 1))
                row = bs * self.model.head_dim
                scratch = tuple(torch.empty(len(decode_rows), row, dtype=self.dtype, device=dev)
                                for _ in range(2))
                decode_rows = to(decode_rows)
                tables = lens = None
            elif self.backend is not None:    # backends take int32 (lengths stay on the host)
                tables, lens = to(tables.int()), lens.int()
            else:
                tables, lens = to(tables), to(lens)

        spans = []
        for s in prefills:
            q_start, n = len(input_ids), s.num_new_tokens
            input_ids += s.seq.token_ids[s.start:s.start + n]
            positions += range(s.start, s.start + n)
            slots += [slot(s.seq.block_table, p, bs) for p in range(s.start, s.start + n)]
            rows = mask = None
            if s.start > 0 and self.backend is None and self.prefill_kernel is None:
                ctx = s.start + n
                block_ids = torch.tensor(s.seq.block_table[:cdiv(ctx, bs)], dtype=torch.long)
                rows = pool_rows(block_ids, kv_heads, self.num_blocks + 1)
                q_pos = torch.arange(s.start, ctx)
                mask = torch.arange(ctx)[None, :] <= q_pos[:, None]
                rows, mask = to(rows), to(mask)
            spans.append(PrefillSpan(q_start, q_start + n, s.start, rows, mask))
            if s.samples:
                logits_rows.append(q_start + n - 1)
                sampling.append(s)
            # Prompt logprobs: the logits at each fed position whose next token is a prompt
            # token, in rows after the sampling rows.
            last = s.seq.num_prompt_tokens - 1
            if s.seq.params.prompt_logprobs is not None and s.start < last:
                count = min(s.start + n, last) - s.start
                prompt_spans.append((s, s.start, count))
                prompt_rows += range(q_start, q_start + count)

        plan = None
        if prefills and self.prefill_kernel is not None:
            m = self.model
            plan = self.prefill_kernel.plan(
                [s.num_new_tokens for s in prefills], [s.start + s.num_new_tokens for s in prefills],
                [s.seq.block_table for s in prefills], m.layers[0].self_attn.num_heads,
                m.num_kv_heads, dev)
        meta = AttentionMetadata(
            slot_mapping=to(torch.tensor(slots, dtype=torch.long)),
            num_decode=len(decodes),
            decode_rows=decode_rows,
            decode_bias=decode_bias,
            prefills=spans,
            decode_scratch=scratch,
            decode_kernel=self.decode_kernel if decodes else None,
            write_kernel=self.write_kernel,
            decode_block_tables=tables,
            decode_lens=lens,
            backend=self.backend,
            prefill_block_tables=([s.seq.block_table for s in prefills]
                                  if self.backend is not None else None),
            prefill_kernel=self.prefill_kernel if plan is not None else None,
            prefill_plan=plan,
        )
        if self.backend is not None:
            self.backend.prepare(meta)
        inputs = (to(torch.tensor(input_ids, dtype=torch.long)),
                  to(torch.tensor(positions, dtype=torch.long)),
                  to(torch.tensor(logits_rows + prompt_rows, dtype=torch.long)))
        return inputs, meta, sampling, prompt_spans

    def _replay_decode(self, out: SchedulerOutput, input_ids: torch.Tensor | None = None):
        """A pure decode step on a captured graph, or None to run it eager. input_ids: the
        step's ids already on the device (async scheduling), else read from the sequences."""
        g = self.graphs
        if g is None or not out.scheduled or not all(s.is_decode for s in out.scheduled) \
                or g.size_for(len(out.scheduled)) is None:
            return None
        bs = self.block_size
        seqs = [(s.seq, s.start) for s in out.scheduled]
        ids = [q.token_ids[p] for q, p in seqs] if input_ids is None else input_ids
        logits, size = g.run(ids, [p for _, p in seqs],
                             [slot(q.block_table, p, bs) for q, p in seqs],
                             [q.block_table for q, _ in seqs], [p + 1 for _, p in seqs])
        return logits, list(out.scheduled), (FULL, size), []

    @torch.inference_mode()
    def execute(self, out: SchedulerOutput, input_ids: torch.Tensor | None = None
                ) -> tuple[torch.Tensor, list[ScheduledSeq], tuple[str, int] | None, list]:
        """Run one step; returns fp32 logits [len(sampling) + prompt rows, vocab], the
        sampling rows, how graphs ran it: (FULL, batch size) for a replayed decode graph,
        (PIECEWISE, token bucket), or None when the step ran eager, and the prompt-logprob
        spans (scheduled seq, first position, count) whose rows follow the sampling rows.
        input_ids: a decode step's ids on the device, for a step scheduled before its tokens
        reached the host."""
        replayed = self._replay_decode(out, input_ids)
        if replayed is not None:
            return replayed
        assert input_ids is None, "device-side ids need a decode graph (async scheduling)"
        (input_ids, positions, logits_indices), meta, sampling, spans = self.prepare(out)
        pw = self.piecewise
        if pw is not None and pw.size_for(input_ids.shape[0]) is not None:
            logits, size = pw.run(input_ids, positions, meta, logits_indices)
            return logits, sampling, (PIECEWISE, size), spans
        logits = self.model(input_ids, positions, self.layer_caches, meta, logits_indices)
        return logits, sampling, None, spans
