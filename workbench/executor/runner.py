"""ModelRunner: owns the model and the KV pool, turns a scheduled step into tensors, runs it."""
from __future__ import annotations

import logging
import time

import torch

from .graphs import default_capture_sizes, default_piecewise_sizes
from ..utils import cdiv
from ..platforms.attention import (CommonAttentionMetadata, PrefillSpan, block_table_array,
                                   slot)
from ..core.block_manager import NULL_BLOCK
from ..core.scheduler import ScheduledSeq, SchedulerOutput
from ..telemetry import FULL, PIECEWISE

log = logging.getLogger("workbench")


class ModelRunner:
    def __init__(self, model, num_blocks: int, block_size: int, platform, backend):
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

    def capture_graphs(self, config, max_model_len: int) -> tuple[str, list[int], list[int], list[str]]:
        """Capture what config.graph_mode asks for, where this runner can; the one place that
        decides it. Returns the mode as run, the decode batch sizes and piecewise token
        buckets captured, and notices saying what runs differently from what was asked."""
        decode = self.can_capture_decode
        asked = config.graph_mode
        if asked is None:     # the platform's choice (Platform.default_graph_mode)
            asked = self.platform.default_graph_mode if self.platform.supports_graphs else "eager"
            if asked == "decode" and not decode:
                asked = "eager"
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
        decode_sizes = self.platform.decode_graph_sizes(config, asked) if decode else []
        if decode_sizes is None:
            decode_sizes = (config.cudagraph_capture_sizes
                            or default_capture_sizes(config.max_num_seqs))
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
    def kv_cache_bytes(self) -> int:
        """The whole pool, the null block included."""
        return self.kv_cache.numel() * self.kv_cache.element_size()

    def prepare(self, out: SchedulerOutput):
        """Flatten the step: decodes first, then prefill chunks. Returns model inputs, the
        backend's attention metadata and, in logits order, the scheduled sequences that
        sample, and the prompt-logprob spans."""
        bs = self.block_size
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
        common = CommonAttentionMetadata(None, len(decodes))
        if decodes:
            tables = [s.seq.block_table for s in decodes]
            common.decode_block_tables = block_table_array(tables, max(map(len, tables)),
                                                           NULL_BLOCK)
            common.decode_lens = torch.tensor([s.start + 1 for s in decodes])

        for s in prefills:
            q_start, n = len(input_ids), s.num_new_tokens
            input_ids += s.seq.token_ids[s.start:s.start + n]
            positions += range(s.start, s.start + n)
            slots += [slot(s.seq.block_table, p, bs) for p in range(s.start, s.start + n)]
            common.prefills.append(PrefillSpan(q_start, q_start + n, s.start, s.seq.block_table))
            if s.will_sample:
                logits_rows.append(q_start + n - 1)
                sampling.append(s)
            # Prompt logprobs: the logits at each fed position whose next token is a prompt
            # token, in rows after the sampling rows.
            last = s.seq.num_prompt_tokens - 1
            if s.seq.params.prompt_logprobs is not None and s.start < last:
                count = min(s.start + n, last) - s.start
                prompt_spans.append((s, s.start, count))
                prompt_rows += range(q_start, q_start + count)

        to = self.backend.to_device
        common.slot_mapping = to(torch.tensor(slots, dtype=torch.long))
        meta = self.backend.build(common)
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
