"""The engine core: requests in, one step at a time, tokens out (vLLM v1's EngineCore).

It owns the scheduler, the KV block pool, the model runner and the telemetry. `add` and
`abort` go through an inbox under a short lock, so they never wait for a forward pass; the
step (or the step loop, `run_loop`, on the front's background thread) picks them up at the
start of the next step. Tokenizing, streams and `generate` live in the front door
(`workbench.engine.Engine`).

With async scheduling (on by default on CUDA), a `step()` may launch the next decode step
before handing out the tokens of the one it finishes: its events are that earlier step's,
and the step still in flight is handed out by the next call (or by `close`).
"""
from __future__ import annotations

import json
import logging
import threading
import time
import zlib
from dataclasses import dataclass, replace
from typing import Any

import torch

from ..config import EngineConfig
from ..executor.kv_sizing import kv_bytes_per_block, num_kv_blocks
from ..executor.models import build_model, load_checkpoint, model_digest
from ..executor.runner import ModelRunner
from ..executor.sampler import LogprobsTensors, apply_token_bitmask, compute_logprobs, sample
from ..platforms import get_platform
from ..roofline import DeviceRoofs, probe_roofs
from ..telemetry import FULL, EngineInfo, EngineStats, MemoryStats, RequestMetrics, StepEvent, Telemetry
from .block_manager import BlockManager, KVBlockSnapshot
from .detokenizer import IncrementalDetokenizer
from .request import Request, RequestState, TokenEvent
from .sampling_params import SamplingParams
from .scheduler import Scheduler
from .sequence import Logprob, Sequence, SequenceStatus
from .structured_output import StructuredOutputManager

log = logging.getLogger("workbench")

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
DEFAULT_MAX_MODEL_LEN = 8192


@dataclass(slots=True)
class _InFlight:
    """A launched step whose sampled ids are still on their way to the host."""
    sched: Any
    reqs: list[Request]
    token_ids: torch.Tensor
    """[rows] on the device, in the step's sampling order (the next step's input ids)."""
    host_ids: torch.Tensor
    """Where they land on the host, once `ready` has passed."""
    host_logprobs: LogprobsTensors | None
    """The rows' logprobs (when a row asked), also copied to the host without waiting."""
    ready: Any
    graph: tuple[str, int]
    t0: float
    ahead: bool
    """Scheduled before the step before it had handed out its tokens."""



def _model_shape(model, hf_config) -> dict:
    """The shape figures EngineInfo carries (what FLOP and byte counts of a step need)."""
    layers = sum(p.numel() for p in model.layers.parameters())
    head = (model.embed_tokens.weight if model.lm_head is None else model.lm_head.weight).numel()
    elem = next(model.parameters()).element_size()
    return dict(num_layer_params=layers, hidden_size=hf_config.hidden_size, intermediate_size=hf_config.intermediate_size,
                num_attention_heads=hf_config.num_attention_heads,
                num_kv_heads=model.num_kv_heads, head_dim=model.head_dim,
                weight_bytes=(layers + head) * elem,
                kv_bytes_per_token=2 * model.num_layers * model.num_kv_heads * model.head_dim * elem)


class EngineCore:
    def __init__(self, config: EngineConfig):
        self.platform = get_platform(config.device)
        dtype = self.platform.default_dtype if config.dtype == "auto" else DTYPES[config.dtype]
        self.attn_backend = self.platform.attention_backend(dtype, config.attention_backend)
        """The device's AttentionBackend: KV layout, block sizes and dtypes, attention."""
        if config.block_size is None:
            config = replace(config, block_size=self.attn_backend.default_block_size)
        self.config = config
        """The knobs as run (block_size and graph_mode resolved for the device)."""
        self.platform.check_config(config)
        self.attn_backend.check_config(config, self.platform.name)

        ckpt = load_checkpoint(config.model)
        self.hf_config = ckpt.hf_config
        self.tokenizer = ckpt.tokenizer
        self.model_path = ckpt.path
        model_limit = getattr(ckpt.hf_config, "max_position_embeddings", DEFAULT_MAX_MODEL_LEN)
        if config.max_model_len is not None and config.max_model_len > model_limit:
            raise ValueError(f"max_model_len: the model supports at most {model_limit} positions "
                             f"(got {config.max_model_len})")
        max_model_len = config.max_model_len or min(model_limit, DEFAULT_MAX_MODEL_LEN)

        self.platform.empty_cache()       # what dropped engines left cached counts as free
        self.platform.reset_peak_memory()
        ops = self.platform.model_ops(dtype) if config.attention_backend == "auto" else None
        self.model = build_model(ckpt, dtype, self.platform.device, max_model_len, config.seed,
                                 ops)
        del ckpt
        self.platform.check_model(self.model)
        self.model.ops.prepare(self.model, self.platform)
        self.platform.empty_cache()      # what measuring kernels cached is not in use
        bs = config.block_size
        num_blocks = num_kv_blocks(config, self.platform, self.model, self.hf_config, dtype)
        self.block_manager = BlockManager(num_blocks, bs, config.enable_prefix_caching)
        # A request must fit in the pool (and in one step when prompts are not chunked).
        pool = self.block_manager.num_usable_blocks * bs
        limit = pool if config.enable_chunked_prefill else min(pool, config.max_num_batched_tokens)
        if max_model_len > limit:
            if config.max_model_len is not None:
                what = ("num_kv_blocks (one block is the reserved null block)" if limit == pool
                        else "max_num_batched_tokens")
                raise ValueError(f"max_model_len: {max_model_len} tokens do not fit; {what} "
                                 f"allows {limit} (raise it or lower max_model_len)")
            max_model_len = limit
        self.max_model_len = max_model_len

        self.scheduler = Scheduler(config, self.block_manager, max_model_len)
        self.runner = ModelRunner(self.model, num_blocks, bs, self.platform, self.attn_backend)
        self.telemetry = Telemetry(config.max_step_events, config.max_request_records)
        weights = sum(p.numel() * p.element_size() for p in self.model.parameters())
        self.telemetry.memory = MemoryStats(weights, self.runner.kv_cache_bytes,
                                            self.platform.peak_memory_bytes(),
                                            kv_bytes_per_block(self.model, bs, dtype), num_blocks)
        self.eos_token_ids = self._eos_ids()
        self.notices: list[str] = self.telemetry.notices
        """Things the user asked for that this engine does differently, in words for a UI
        (the same list is exported with the telemetry)."""
        self.graph_mode, self.capture_sizes, self.piecewise_sizes, notices = \
            self.runner.capture_graphs(config, max_model_len)
        if config.graph_mode is None:        # the device's choice, now made
            config = self.config = replace(config, graph_mode=self.graph_mode)
        for text in notices:
            self.notices.append(text)
            log.info(text)
        self.vocab_size = self.hf_config.vocab_size
        self.structured_output = StructuredOutputManager(self.tokenizer, self.vocab_size)
        self._info = EngineInfo(
            model=config.model, model_path=str(self.model_path) if self.model_path else None,
            device=self.platform.name, device_name=self.platform.device_name(),
            dtype=str(dtype).replace("torch.", ""),
            max_model_len=max_model_len, block_size=bs, num_kv_blocks=num_blocks,
            kv_bytes_per_block=self.telemetry.memory.kv_bytes_per_block,
            graph_mode=self.graph_mode, capture_sizes=tuple(self.capture_sizes),
            piecewise_sizes=tuple(self.piecewise_sizes),
            attention=self.attn_backend.name, ops=self.model.ops.name,
            async_scheduling=False, vocab_size=self.vocab_size,
            num_params=sum(p.numel() for p in self.model.parameters()),
            num_layers=self.model.num_layers, **_model_shape(self.model, self.hf_config),
            config=config)

        self._requests: dict[str, Request] = {}
        self._inbox: list[Request] = []
        self._aborts: list[str] = []
        self._lock = threading.Lock()            # guards _inbox, _aborts, _requests
        self._step_lock = threading.Lock()       # one step at a time
        self._wake = threading.Condition(self._lock)
        self._looping = False
        """True while run_loop steps on another thread."""
        self._kv_wanted = False
        self._kv_last: KVBlockSnapshot | None = None
        self._token_texts: dict[int, str] = {}
        """Each token's text on its own (for Logprob.decoded_token)."""
        self._closed = False
        self._async = (config.async_scheduling if config.async_scheduling is not None
                       else self.platform.runs_async) and self.runner.graphs is not None
        """Async scheduling (see _step): needs decode graphs (the next step's ids are fed on
        the device) and pays off where the device runs behind the host."""
        self._info = replace(self._info, async_scheduling=self._async)
        self._inflight: _InFlight | None = None
        self._host_ids = ([self.platform.host_buffer(config.max_num_seqs, torch.long)
                           for _ in range(2)] if self._async else [])
        self._host_flip = 0

    # ---- the public read API --------------------------------------------------------------
    def info(self) -> EngineInfo:
        return self._info

    def stats(self) -> EngineStats:
        b = self.block_manager.stats()
        with self._lock:
            queued = len(self._inbox)
        return EngineStats(len(self.scheduler.running), len(self.scheduler.waiting) + queued,
                           b.num_blocks, b.used, b.free, b.cached, self.scheduler.num_preemptions,
                           b.hits, b.queries, self.telemetry.num_steps,
                           self.telemetry.num_requests)

    def prompt_logits(self, prompt_ids: list[int]):
        """The logits at a prompt's last position from one real prefill step, for numerics
        checks against a reference (benchmarks/gpu.py, npu.py). Only while idle; the request
        is aborted afterwards, so nothing else changes."""
        with self._step_lock:
            if self._requests or self._inflight is not None:
                raise RuntimeError("prompt_logits: the engine has requests; run it when idle")
            req = self.make_request(list(prompt_ids), prompt_ids, SamplingParams(max_tokens=1),
                                    "prompt-logits")
            self.add([req])
            self._drain_inbox()
            logits = self.runner.execute(self.scheduler.schedule())[0][0].float()
        self.abort(req.seq.request_id)
        return logits

    def device_roofs(self, refresh: bool = False) -> DeviceRoofs:
        return probe_roofs(self.platform, next(self.model.parameters()).dtype, refresh)

    def model_sha256(self) -> str | None:
        return model_digest(self.config.model, self.model_path)

    def reset_prefix_cache(self) -> None:
        """Forget every cached prefix block (the blocks stay in the pool, free)."""
        with self._step_lock:
            self.block_manager.reset_prefix_cache()

    def _eos_ids(self) -> set[int]:
        """EOS ids from the config, the tokenizer and generation_config.json, together."""
        found = [getattr(self.hf_config, "eos_token_id", None),
                 getattr(self.tokenizer, "eos_token_id", None)]
        gen = self.model_path / "generation_config.json" if self.model_path else None
        if gen is not None and gen.is_file():
            found.append(json.loads(gen.read_text()).get("eos_token_id"))
        ids: set[int] = set()
        for v in found:
            ids.update([v] if isinstance(v, int) else [x for x in (v or []) if isinstance(x, int)])
        return ids


    # ---- requests -------------------------------------------------------------------------
    def make_request(self, prompt_ids: list[int], prompt: Any, params: SamplingParams,
                     request_id: str) -> Request:
        """A Request for validated token ids (the front door tokenizes and validates); with
        n > 1 it carries its other choices, which start when its prompt is computed. A
        grammar (structured output) is compiled here, one matcher per choice: a bad one
        raises ValueError."""
        first = self._make_choice(prompt_ids, prompt, params, request_id, 0)
        if params.n > 1:
            # Later choices: their own seed stream; the prompt's logprobs come with the first.
            later = replace(params, prompt_logprobs=None)
            first.choices = [first] + [self._make_choice(prompt_ids, prompt, later, request_id, i)
                                       for i in range(1, params.n)]
            for c in first.choices[1:]:
                c.owner = first
            first.unfinished = params.n
        if params.prompt_logprobs is not None:
            first.prompt_logprobs = [None] * len(prompt_ids)
        return first

    def _make_choice(self, prompt_ids: list[int], prompt: Any, params: SamplingParams,
                     request_id: str, choice: int) -> Request:
        grammar = (self.structured_output.compile(params.structured_outputs)
                   if params.structured_outputs is not None else None)
        seq = Sequence(request_id if choice == 0 else f"{request_id}#{choice}", prompt_ids,
                       params, max_len=self.max_model_len)
        gen = None
        if not params.greedy:
            # A stable default (str hashes are salted per process): the same engine seed and
            # request id sample the same tokens in every run.
            seed = (params.seed if params.seed is not None
                    else zlib.crc32(f"{self.config.seed}:{request_id}".encode()))
            if choice:
                seed = zlib.crc32(f"{seed}:{choice}".encode())
            gen = torch.Generator().manual_seed(seed)
        metrics = RequestMetrics(request_id, seq.arrival_time, len(prompt_ids))
        detok = IncrementalDetokenizer(self.tokenizer, prompt_ids, params.stop,
                                       params.skip_special_tokens,
                                       params.include_stop_str_in_output)
        return Request(seq, prompt, detok, metrics, gen, grammar, request_id=request_id,
                       choice=choice, logprobs=[] if params.logprobs is not None else None)

    def add(self, reqs: list[Request]) -> None:
        self.check_open()
        with self._lock:
            dup = [r.seq.request_id for r in reqs if r.seq.request_id in self._requests]
            if dup or len({r.seq.request_id for r in reqs}) < len(reqs):
                raise ValueError(f"request_id: {dup[0] if dup else 'duplicate'} is already in use")
            for r in reqs:
                r.seq.arrival_time = r.metrics.arrival_time = time.monotonic()
                self._requests[r.seq.request_id] = r
            self._inbox.extend(reqs)
            self._wake.notify_all()


    def abort(self, request_id: str) -> bool:
        """Stop a request and free its blocks at the next step boundary. False if unknown."""
        with self._lock:
            if request_id not in self._requests:
                return False
            self._aborts.append(request_id)
            self._wake.notify_all()
        if not self._looping and not self._step_lock.locked():
            with self._step_lock:
                self._drain_inbox()
        return True


    def has_unfinished_requests(self) -> bool:
        with self._lock:
            return bool(self._requests)


    @property
    def num_requests(self) -> int:
        return len(self._requests)

    # ---- one step -------------------------------------------------------------------------
    def _drain_inbox(self) -> None:
        with self._lock:
            new, self._inbox = self._inbox, []
            aborts, self._aborts = self._aborts, []
        for r in new:
            self.scheduler.add(r.seq)
        for rid in aborts:
            r = self._requests.get(rid)
            if r is None:
                continue
            for c in r.choices or [r]:
                if not c.seq.is_finished and (c is r or c.forked):
                    self.scheduler.finish(c.seq, "abort")
                    self._finish(c, time.monotonic())


    def step(self) -> list[TokenEvent]:
        """Run one scheduler step: admit, run the model, sample, deliver. Returns the events."""
        self.check_open()
        with self._step_lock:
            return self._step()


    def _step(self, speculate: bool = True) -> list[TokenEvent]:
        """One step's worth of work; returns the events of the step whose tokens it handled.

        Synchronously: schedule, run, sample, hand out the tokens. With async scheduling
        (vLLM's name), a decode step that replayed a graph keeps its sampled ids on the
        device and stays in flight; the next call schedules and launches the step after it
        from those ids (Scheduler.schedule_next_decode) before waiting for them, so the
        host's bookkeeping for step N runs while the device computes step N+1."""
        self._drain_inbox()
        inflight, self._inflight = self._inflight, None
        if inflight is None:
            t0 = time.monotonic()
            sched = self.scheduler.schedule(t0)
            for seq in sched.preempted:
                self._requests[seq.request_id].metrics.num_preemptions += 1
            if sched.is_empty:
                return self._record_step(sched, [], [], None, None, t0)
            for s in sched.scheduled:
                m = self._requests[s.seq.request_id].metrics
                if m.first_scheduled_time is None:
                    m.first_scheduled_time = t0
                    m.cached_tokens = s.seq.num_cached_tokens
            logits, sampling, graph, spans = self.runner.execute(sched)
            reqs = [self._requests[s.seq.request_id] for s in sampling]
            if not (self._async and graph is not None and graph[0] == FULL
                    and all(self._may_run_ahead(r) for r in reqs)):
                if spans:
                    self._add_prompt_logprobs(spans, logits[len(sampling):])
                rows, reqs = self._sampling_rows(reqs)
                if rows is not None:
                    logits = logits.index_select(0, torch.tensor(rows, device=logits.device))
                out = self._sample(logits[:len(reqs)], reqs)
                self.scheduler.update_after_step(sched)
                lp = out.logprobs.to_host() if out.logprobs is not None else None
                return self._record_step(sched, reqs, out.token_ids.tolist(), lp, graph, t0)
            inflight = self._in_flight(sched, logits, reqs, graph, t0, ahead=False)
        # Step N is in flight: advance its sequences, launch N+1 from its device-side ids,
        # then wait for N's ids and hand them out.
        self.scheduler.update_after_step(inflight.sched)
        if speculate and not self._inbox and not self._aborts:
            nxt = self.scheduler.schedule_next_decode(
                inflight.sched, lambda seq: self._may_run_ahead(self._requests[seq.request_id]))
            if nxt is not None:
                t1 = time.monotonic()
                rows, nsched = nxt
                ids = inflight.token_ids
                if rows != list(range(len(rows))) or len(rows) != ids.shape[0]:
                    ids = ids.index_select(0, torch.tensor(rows).to(ids.device, non_blocking=True))
                # No larger than the step before it, so a captured size holds it.
                logits, sampling, graph, _ = self.runner.execute(nsched, input_ids=ids)
                self._inflight = self._in_flight(
                    nsched, logits, [self._requests[s.seq.request_id] for s in sampling],
                    graph, t1, ahead=True)
        inflight.ready.synchronize()
        tokens = inflight.host_ids.tolist()
        return self._record_step(inflight.sched, inflight.reqs, tokens, inflight.host_logprobs,
                                 inflight.graph, inflight.t0, inflight.ahead)

    def _sample(self, logits: torch.Tensor, reqs: list[Request]):
        """Pick each row's token (and its logprobs, when asked); rows with a grammar are
        masked first, all in one bitmask (so, as in vLLM, their logprobs are the masked
        distribution's)."""
        rows = [i for i, r in enumerate(reqs) if r.grammar is not None]
        if rows:
            bitmask = self.structured_output.grammar_bitmask([reqs[i].grammar for i in rows])
            logits = apply_token_bitmask(logits, bitmask, rows)
        return sample(logits, [r.seq for r in reqs], [r.generator for r in reqs],
                      self.eos_token_ids)

    def _may_run_ahead(self, r: Request) -> bool:
        """Whether a request's next step may be launched before its token is known: greedy
        (the id is picked on the device), no stop strings (they need the text), no grammar
        (its mask for the next step depends on this step's token), no logits processors
        (penalties need the token history on the host). Logprobs may: they are computed on
        the device and copied back with the ids."""
        p = r.seq.params
        return (r.generator is None and not p.stop and r.grammar is None
                and not p.needs_processing)

    def _in_flight(self, sched, logits, reqs, graph, t0, ahead: bool) -> "_InFlight":
        """Greedy ids picked on the device and copied to a pinned host buffer without
        waiting; two buffers alternate, so the one being filled is never the one read."""
        ids = logits.argmax(dim=-1)
        self._host_flip ^= 1
        host = self._host_ids[self._host_flip][:ids.shape[0]]
        host.copy_(ids, non_blocking=True)
        k = max((r.seq.params.logprobs for r in reqs if r.seq.params.logprobs is not None),
                default=None)
        # (a non-blocking copy from the device lands in pinned memory)
        lp = None if k is None else compute_logprobs(logits, ids, k).to_host(non_blocking=True)
        return _InFlight(sched, reqs, ids, host, lp, self.platform.record_event(), graph, t0,
                         ahead)

    def _sampling_rows(self, reqs: list[Request]) -> tuple[list[int] | None, list[Request]]:
        """A request with n > 1 samples its first token once per choice, from the same
        logits row: the rows to sample (None: one per request, as they are) and whose."""
        if not any(r.choices and not r.forked for r in reqs):
            return None, reqs
        rows, out = [], []
        for i, r in enumerate(reqs):
            for c in (r.choices if r.choices and not r.forked else [r]):
                rows.append(i)
                out.append(c)
        return rows, out

    def _fork(self, r: Request) -> None:
        """The first choice's prompt is computed: start the other choices on its blocks."""
        r.forked = True
        with self._lock:
            for c in r.choices[1:]:
                self._requests[c.seq.request_id] = c
        for c in r.choices[1:]:
            c.listener = r.listener
            c.forked = True
            self.scheduler.fork(r.seq, c.seq)

    def _decode_token(self, token_id: int) -> str | None:
        if self.tokenizer is None:
            return None
        text = self._token_texts.get(token_id)
        if text is None:
            text = self._token_texts[token_id] = self.tokenizer.decode([token_id])
        return text

    def _add_prompt_logprobs(self, spans, logits: torch.Tensor) -> None:
        """Logprobs of prompt tokens from the rows of a prefill (see ModelRunner.prepare):
        the row at position p scores prompt token p + 1. One batched pass for the step."""
        targets = [t for s, first, count in spans
                   for t in s.seq.prompt_token_ids[first + 1:first + 1 + count]]
        k = max(s.seq.params.prompt_logprobs for s, _, _ in spans)
        lp = compute_logprobs(logits, torch.tensor(targets, device=logits.device), k).to_host()
        row = 0
        for s, first, count in spans:
            r = self._requests[s.seq.request_id]
            if r.prompt_logprobs is not None:
                for p in range(first + 1, first + 1 + count):
                    if r.prompt_logprobs[p] is None:    # (a recompute scores it again)
                        r.prompt_logprobs[p] = lp.row(row + p - first - 1,
                                                      s.seq.params.prompt_logprobs,
                                                      self._decode_token)
            row += count

    def _record_step(self, sched, reqs, tokens, logprobs: LogprobsTensors | None, graph, t0,
                     ahead: bool = False) -> list[TokenEvent]:
        """Hand out one step's tokens and record the step. A request that ended while its
        step was in flight (aborted, or finished by the step before) drops its token."""
        events: list[TokenEvent] = []
        finished: list[str] = []
        now = time.monotonic()
        for i, (r, tok) in enumerate(zip(reqs, tokens)):
            if r.seq.is_finished:
                continue
            if r.seq.params.max_tokens == 0:    # prompt scoring only: no token
                self.scheduler.finish(r.seq, "length")
                self._finish(r, now)
                finished.append(r.seq.request_id)
                continue
            if r.choices and not r.forked:
                self._fork(r)
            lp = None
            if r.logprobs is not None:
                lp = logprobs.row(i, r.seq.params.logprobs, self._decode_token)
                r.logprobs.append(lp)
            ev = self._append_token(r, tok, now, lp)
            events.append(ev)
            if ev.finished:
                finished.append(r.seq.request_id)
        bstats = self.block_manager.stats()
        self.telemetry.add_step(StepEvent(
            step=self.telemetry.num_steps, start=t0, duration=time.monotonic() - t0,
            phase=sched.phase, num_prefill_tokens=sched.num_prefill_tokens,
            num_decode_tokens=sched.num_decode_tokens, num_cached_tokens=sched.num_cached_tokens,
            tokens_per_request={s.seq.request_id: s.num_new_tokens for s in sched.scheduled},
            kinds={s.seq.request_id: "decode" if s.is_decode else "prefill" if s.samples
                   else "chunk" for s in sched.scheduled},
            num_running=len(self.scheduler.running), num_waiting=len(self.scheduler.waiting),
            kv_blocks_used=bstats.used, kv_blocks_free=bstats.free, kv_blocks_cached=bstats.cached,
            num_preempted=len(sched.preempted), preempted=[s.request_id for s in sched.preempted],
            graph=graph is not None, graph_kind=graph and graph[0],
            graph_size=graph and graph[1], finished=finished, scheduled_ahead=ahead,
            context_lens={s.seq.request_id: s.start for s in sched.scheduled}))
        if self._kv_wanted:
            self._kv_wanted = False
            self._kv_last = self._kv_snapshot()
        return events


    def finish_in_flight(self) -> None:
        """Hand out the step still in flight, launching nothing after it."""
        if self._inflight is not None:
            with self._step_lock:
                if self._inflight is not None:
                    self._step(speculate=False)


    def _append_token(self, r: Request, tok: int, now: float,
                      logprobs: dict[int, Logprob] | None = None) -> TokenEvent:
        seq, p, m = r.seq, r.seq.params, r.metrics
        seq.token_ids.append(tok)
        m.output_tokens += 1
        m.token_times.append(now)
        if m.first_token_time is None:
            m.first_token_time = now
        reason = None
        if tok in p.stop_token_ids or (not p.ignore_eos and tok in self.eos_token_ids):
            reason = "stop"
            if p.include_stop_str_in_output:
                r.detok.add(tok)
        elif r.detok.add(tok) is not None:
            reason = "stop"
        elif r.grammar is not None and not r.grammar.consume_token(tok):
            log.error("%s: the grammar refused token %d: %s", seq.request_id, tok,
                      r.grammar.get_error())
            reason = "error"
        elif r.grammar is not None and r.grammar.is_stopped():
            reason = "stop"      # the grammar is complete and allows nothing more
        elif seq.num_output_tokens >= p.max_tokens or seq.num_tokens >= self.max_model_len:
            reason = "length"
        if reason is not None:
            self.scheduler.finish(seq, reason)
        ev = TokenEvent(r.request_id, tok, r.detok.take(final=reason is not None),
                        seq.num_output_tokens, now, reason is not None, reason, logprobs,
                        r.choice, r.prompt_logprobs if seq.num_output_tokens == 1 else None)
        if reason is not None:
            self._finish(r, now, deliver=False)
        self._deliver(r, ev)
        owner = r.owner or r
        if reason is not None and owner.unfinished == 0:
            owner.done.set()
        return ev

    def _deliver(self, r: Request, ev: TokenEvent) -> None:
        """Hand an event to the request's listener. A listener that raises (say, its asyncio
        loop has closed) loses its request, never the engine or the other requests."""
        if r.listener is None:
            return
        try:
            r.listener(ev)
        except Exception:
            log.exception("listener of %s raised; aborting that request", r.seq.request_id)
            r.listener = None
            if not ev.finished:
                self.abort(r.request_id)


    def _finish(self, r: Request, now: float, deliver: bool = True) -> None:
        """Book-keeping for a choice that ended (finished, stopped or aborted); the request
        is recorded when its last choice ends. Choices that never started (the first one
        ended before its prompt was computed) end with it."""
        owner = r.owner or r
        ended = [r]
        if r is owner and r.choices and not r.forked:
            for c in r.choices[1:]:
                c.seq.status, c.seq.finish_reason = SequenceStatus.FINISHED, r.seq.finish_reason
                c.listener = r.listener
                ended.append(c)
        owner.unfinished -= len(ended)
        with self._lock:   # the first choice stays findable (abort) until the last ends
            if r is not owner:
                self._requests.pop(r.seq.request_id, None)
            if owner.unfinished == 0:
                self._requests.pop(owner.seq.request_id, None)
        if owner.unfinished == 0:
            m = owner.metrics
            m.finished_time = now
            m.finish_reason = owner.seq.finish_reason
            m.num_preemptions = sum(c.seq.num_preemptions for c in owner.choices or [owner])
            m.output_tokens = sum(c.seq.num_output_tokens for c in owner.choices or [owner])
            self.telemetry.add_request(m)
        if deliver:   # an abort: tell the listener, with any text still held back
            for c in ended:
                self._deliver(c, TokenEvent(
                    c.request_id, None, c.detok.take(final=True), c.seq.num_output_tokens, now,
                    True, c.seq.finish_reason, None, c.choice,
                    c.prompt_logprobs if c.seq.num_output_tokens == 0 else None))
            if owner.unfinished == 0:
                owner.done.set()

    # ---- looking inside (for block maps and steppers) --------------------------------------
    def _kv_snapshot(self) -> KVBlockSnapshot:
        with self._lock:
            reqs = list(self._requests.values())
        tables = {r.seq.request_id: list(r.seq.block_table) for r in reqs if r.seq.block_table}
        return self.block_manager.snapshot(tables, self.telemetry.num_steps - 1)


    def kv_blocks(self) -> KVBlockSnapshot | None:
        """The KV pool block by block. Never waits for a forward pass: while a step runs in
        the background it returns the snapshot taken at the end of the previous step it was
        asked for (None the first time) and asks for a fresh one at the end of this step."""
        if self._step_lock.acquire(blocking=False):
            try:
                return self._kv_snapshot()
            finally:
                self._step_lock.release()
        self._kv_wanted = True
        return self._kv_last


    def request_states(self) -> list[RequestState]:
        """Every unfinished request, in arrival order (waits for a running step to end)."""
        with self._step_lock:
            with self._lock:
                reqs = list(self._requests.values())
                queued = {id(r) for r in self._inbox}
            reqs = [r for r in reqs if not r.seq.is_finished]
            return [RequestState(r.seq.request_id,
                                 "queued" if id(r) in queued else r.seq.status.value,
                                 r.seq.num_prompt_tokens, r.seq.num_output_tokens,
                                 r.seq.num_computed_tokens, r.seq.num_cached_tokens,
                                 r.seq.num_preemptions, list(r.seq.block_table), r.detok.text)
                    for r in reqs]


    # ---- the step loop --------------------------------------------------------------------
    def run_loop(self, stop: threading.Event) -> None:
        """Step until `stop` is set, sleeping while there is nothing to do (the front door's
        background thread runs this)."""
        self._looping = True
        try:
            self._run_loop(stop)
        finally:
            self._looping = False

    def _run_loop(self, stop: threading.Event) -> None:
        while not stop.is_set():
            with self._lock:
                idle = (not self._inbox and not self._aborts and self._inflight is None
                        and not self.scheduler.has_unfinished())
                if idle:
                    self._wake.wait(timeout=0.5)
                    continue
            try:
                with self._step_lock:
                    self._step()
                if self.telemetry.steps[-1].phase == "idle" and not self._inbox:
                    # Nothing ran (a held-back batch): sleep until it may be admitted.
                    wait = self.scheduler.next_wakeup()
                    with self._lock:
                        self._wake.wait(timeout=min(wait if wait is not None else 0.01, 0.05))
            except Exception:   # keep serving: fail the requests of the broken step only
                log.exception("engine step failed; aborting its requests")
                self._inflight = None
                for seq in list(self.scheduler.running):
                    r = self._requests.get(seq.request_id)
                    self.scheduler.finish(seq, "error")
                    if r is not None:
                        self._finish(r, time.monotonic())

    # ---- release ----------------------------------------------------------------------------
    @property
    def is_closed(self) -> bool:
        return self._closed

    def check_open(self) -> None:
        if self._closed:
            raise RuntimeError("engine: closed (close() freed its KV pool and weights); "
                               "build a new Engine")


    def close(self) -> None:
        """Abort every request, hand out a step still in flight, and free the KV pool,
        captured graphs and weights now. Idempotent."""
        if self._closed:
            return
        self.finish_in_flight()
        self.abort_all()
        with self._step_lock:
            self._closed = True
            self.runner.release()
            self.model = None
        self.platform.empty_cache()

    def abort_all(self) -> None:
        """Abort every request, queued ones included, now."""
        for rid in list(self._requests):
            self.abort(rid)
        with self._step_lock:
            self._drain_inbox()

    def wake(self) -> None:
        """Wake a sleeping run_loop (to notice its stop event)."""
        with self._lock:
            self._wake.notify_all()
