"""Engine: the public API. add_request / step / abort / generate / stream / astream.

Two ways to drive it:
- in the caller's thread: `step()` runs one scheduler step; `generate` and `stream` call it
  until their requests finish (other requests in the engine advance too);
- in the background: `start()` runs the step loop in a daemon thread, and any number of
  callers (widgets, server handlers, asyncio tasks) add requests and stream at once.
Requests enter through an inbox under a short lock, so adding or aborting never waits for a
forward pass; the step loop picks them up at the start of the next step.

With async scheduling (on by default on CUDA), a `step()` may launch the next decode step
before handing out the tokens of the one it finishes: its events are that earlier step's,
and the step still in flight is handed out by the next call (or by `shutdown`/`close`).
"""
from __future__ import annotations

import asyncio
import itertools
import json
import logging
import queue
import threading
import time
import zlib
from dataclasses import dataclass, field, replace
from typing import Any, AsyncIterator, Callable, Iterator

import torch

from .block_manager import BlockManager, KVBlockSnapshot
from .config import EngineConfig
from .graphs import default_capture_sizes, default_piecewise_sizes
from .detokenizer import IncrementalDetokenizer
from .models import build_model, load_checkpoint
from .platforms import get_platform
from .runner import ModelRunner
from .sampler import LogprobsTensors, compute_logprobs, sample
from .sampling_params import SamplingParams
from .scheduler import Scheduler
from .sequence import Logprob, Sequence, SequenceStatus
from .telemetry import MemoryStats, RequestMetrics, StepEvent, Telemetry

log = logging.getLogger("workbench")

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
DEFAULT_MAX_MODEL_LEN = 8192


@dataclass(slots=True)
class TokenEvent:
    """One new token of one request, as streamed."""
    request_id: str
    token_id: int | None
    """None on a final event that carries no new token (an abort, or a stop-string flush)."""
    text: str
    """Text that became final with this token (may be '' while a character is incomplete)."""
    index: int
    """Number of output tokens so far."""
    time: float
    finished: bool = False
    """This choice has ended (a request with n > 1 ends when all its choices have)."""
    finish_reason: str | None = None
    logprobs: dict[int, Logprob] | None = None
    """With SamplingParams.logprobs: the token's logprob and the top-k alternatives'."""
    choice: int = 0
    """Which of the request's n sequences this token belongs to."""


@dataclass
class CompletionOutput:
    """One of a request's n choices."""
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None
    logprobs: list[dict[int, Logprob]] | None = None
    """One dict per output token (with SamplingParams.logprobs)."""


@dataclass
class RequestOutput:
    request_id: str
    prompt: Any
    prompt_token_ids: list[int]
    token_ids: list[int]
    """The first choice's (as text and finish_reason are); `outputs` holds all n."""
    text: str
    finished: bool
    finish_reason: str | None
    metrics: RequestMetrics
    outputs: list[CompletionOutput] = field(default_factory=list)
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    """With SamplingParams.prompt_logprobs: one entry per prompt token (None for the first,
    which has no context)."""


@dataclass(eq=False)
class _Request:
    seq: Sequence
    prompt: Any
    detok: IncrementalDetokenizer
    metrics: RequestMetrics
    generator: torch.Generator | None
    listener: Callable[[TokenEvent], None] | None = None
    done: threading.Event = field(default_factory=threading.Event)
    """Set when every choice has ended (on the first choice's _Request)."""
    request_id: str = ""
    """The id the caller knows (choices after the first run as '<id>#<choice>')."""
    choice: int = 0
    choices: list["_Request"] = field(default_factory=list)
    """On the first choice: all n choices, itself first. Later choices wait here until the
    first one's prompt is computed, then fork its KV blocks."""
    owner: "_Request | None" = None
    """On a later choice: the first choice."""
    forked: bool = False
    unfinished: int = 1
    """On the first choice: choices still running."""
    logprobs: list[dict[int, Logprob]] | None = None
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None


@dataclass(slots=True)
class _InFlight:
    """A launched step whose sampled ids are still on their way to the host."""
    sched: Any
    reqs: list[_Request]
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


@dataclass
class RequestState:
    """Where one unfinished request stands (see Engine.request_states)."""
    request_id: str
    status: str
    """'queued' (not yet seen by the scheduler), 'waiting' or 'running'."""
    num_prompt_tokens: int
    num_output_tokens: int
    num_computed_tokens: int
    """Tokens whose K/V are in the cache."""
    num_cached_tokens: int
    """Prompt tokens served by the prefix cache at its last admission."""
    num_preemptions: int
    block_table: list[int]
    text: str


Prompt = Any   # str | list[dict] (chat messages) | list[int] (token ids)


class Engine:
    def __init__(self, config: EngineConfig | None = None, **overrides):
        config = replace(config, **overrides) if config is not None else EngineConfig(**overrides)
        self.platform = get_platform(config.device)
        if config.block_size is None:
            config = replace(config, block_size=self.platform.default_block_size)
        if config.graph_mode is None:
            config = replace(config, graph_mode="decode" if self.platform.supports_graphs
                             else "eager")
        self.config = config
        """The knobs as run (block_size resolved for the device)."""
        self.platform.check_config(config)
        dtype = self.platform.default_dtype if config.dtype == "auto" else DTYPES[config.dtype]

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
        self.model = build_model(ckpt, dtype, self.platform.device, max_model_len, config.seed)
        del ckpt
        self.platform.check_model(self.model)
        if config.attention_backend == "auto":
            self.model.ops = self.platform.model_ops(dtype)
        bs = config.block_size
        per_block = ModelRunner.kv_bytes_per_block(self.model, bs, dtype)
        num_blocks = config.num_kv_blocks or max(1, int(self._kv_budget(dtype) // per_block) - 1)
        # A request must fit in the pool (and in one step when prompts are not chunked).
        limit = num_blocks * bs
        if not config.enable_chunked_prefill:
            limit = min(limit, config.max_num_batched_tokens)
        if max_model_len > limit:
            if config.max_model_len is not None:
                what = ("num_kv_blocks" if limit == num_blocks * bs else "max_num_batched_tokens")
                raise ValueError(f"max_model_len: {max_model_len} tokens do not fit; {what} "
                                 f"allows {limit} (raise it or lower max_model_len)")
            max_model_len = limit
        self.max_model_len = max_model_len

        self.block_manager = BlockManager(num_blocks, bs, config.enable_prefix_caching)
        self.scheduler = Scheduler(config, self.block_manager, max_model_len)
        self.runner = ModelRunner(self.model, num_blocks, bs, self.platform, config.attention_backend)
        self.telemetry = Telemetry(config.max_step_events, config.max_request_records)
        weights = sum(p.numel() * p.element_size() for p in self.model.parameters())
        self.telemetry.memory = MemoryStats(weights, self.runner.kv_cache_bytes,
                                            self.platform.peak_memory_bytes(), per_block, num_blocks)
        self.eos_token_ids = self._eos_ids()
        self.notices: list[str] = self.telemetry.notices
        """Things the user asked for that this engine does differently, in words for a UI
        (the same list is exported with the telemetry)."""
        self.graph_mode = config.graph_mode
        self.capture_sizes = (config.cudagraph_capture_sizes
                              or default_capture_sizes(config.max_num_seqs))
        self.piecewise_sizes: list[int] = []
        """Token buckets captured piecewise (graph_mode 'full'); see graphs.py."""
        self.vocab_size = self.hf_config.vocab_size
        self._setup_graphs()

        self._requests: dict[str, _Request] = {}
        self._inbox: list[_Request] = []
        self._aborts: list[str] = []
        self._lock = threading.Lock()            # guards _inbox, _aborts, _requests
        self._step_lock = threading.Lock()       # one step at a time
        self._wake = threading.Condition(self._lock)
        self._ids = itertools.count()
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._kv_wanted = False
        self._kv_last: KVBlockSnapshot | None = None
        self._token_texts: dict[int, str] = {}
        """Each token's text on its own (for Logprob.decoded_token)."""
        self._closed = False
        self._async = (config.async_scheduling if config.async_scheduling is not None
                       else self.platform.runs_async) and self.runner.graphs is not None
        """Async scheduling (see _step): needs decode graphs (the next step's ids are fed on
        the device) and pays off where the device runs behind the host."""
        self._inflight: _InFlight | None = None
        self._host_ids = ([self.platform.host_buffer(config.max_num_seqs, torch.long)
                           for _ in range(2)] if self._async else [])
        self._host_flip = 0

    # ---- set-up helpers -------------------------------------------------------------------
    def _kv_budget(self, dtype: torch.dtype) -> float:
        """Bytes for the KV pool: kv_cache_memory_gb if given; else, where the device reports
        its memory, gpu_memory_utilization of it minus what is in use (weights) and an
        activation reserve; else (the CPU) 1 GiB."""
        c = self.config
        if c.kv_cache_memory_gb is not None:
            return c.kv_cache_memory_gb * 2**30
        info = self.platform.memory_info()
        if info is None:
            return 2**30
        free, total = info
        budget = c.gpu_memory_utilization * total - (total - free) - self._activation_reserve(dtype)
        if budget <= 0:
            raise ValueError(f"gpu_memory_utilization: {c.gpu_memory_utilization} of "
                             f"{total / 2**30:.1f} GiB leaves no room for a KV pool after the "
                             f"weights ({(total - free) / 2**30:.1f} GiB in use); raise it or "
                             "set num_kv_blocks")
        return budget

    def _activation_reserve(self, dtype: torch.dtype) -> int:
        """A generous estimate of one step's peak activations: the widest tensors (MLP,
        QKV, logits) of max_num_batched_tokens tokens, a few of each alive at once, plus
        graph-pool headroom."""
        cfg, c = self.hf_config, self.config
        width = 2 * cfg.intermediate_size + 3 * cfg.hidden_size
        elem = torch.empty((), dtype=dtype).element_size()
        tokens = c.max_num_batched_tokens
        logits = max(c.max_num_seqs, 1) * cfg.vocab_size * 4 * 2
        return int(4 * tokens * width * elem + logits + 512 * 2**20)

    # ---- set-up helpers (graphs) -----------------------------------------------------------
    def _notice(self, text: str) -> None:
        self.notices.append(text)
        log.info(text)

    def _setup_graphs(self) -> None:
        """Capture what graph_mode asks for where the platform can; otherwise say what runs
        eager and why (Engine.notices)."""
        asked = self.config.graph_mode
        if asked == "eager":
            return
        why = None
        decode = self.runner.can_capture_decode
        if not self.platform.supports_graphs:
            why = f"graph capture is not available on {self.platform.name} in this build"
        elif not decode and asked == "decode":
            why = ("capture needs the platform's fused paged attention, and this engine "
                   "uses the plain-torch path (attention_backend or dtype)")
        if why is not None:
            self.graph_mode = "eager"
            self._notice(f"graph_mode={asked!r} asked for, but {why}: every step runs eager "
                         "(StepEvent.graph stays False)")
            return
        from tqdm.auto import tqdm
        decode_sizes = self.capture_sizes if decode else []
        if asked == "full":
            self.piecewise_sizes = default_piecewise_sizes(self.config.max_num_batched_tokens)
        total = len(decode_sizes) + len(self.piecewise_sizes) * (self.model.num_layers + 1)
        t0 = time.perf_counter()
        with tqdm(total=total, desc="capturing graphs", unit="graph", leave=False) as bar:
            tick = lambda done, total: bar.update(1)   # noqa: E731
            if decode_sizes:
                self.runner.capture_decode_graphs(decode_sizes, self.max_model_len, tick)
            if self.piecewise_sizes:
                self.runner.capture_piecewise_graphs(self.piecewise_sizes, tick)
        log.info("captured %d graphs in %.1f s: decode batch sizes %s, piecewise token "
                 "buckets %s", total, time.perf_counter() - t0, decode_sizes,
                 self.piecewise_sizes)
        if asked == "full" and not decode:
            self._notice("graph_mode='full': decode steps replay piecewise graphs with "
                         "attention eager; whole decode-step graphs need the platform's "
                         "fused paged attention (attention_backend or dtype)")

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
    def tokenize(self, prompt: Prompt) -> list[int]:
        """Text, chat messages (through the chat template) or token ids -> token ids."""
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("prompt: must not be empty")
            ids = self._need_tokenizer().encode(prompt)
        elif isinstance(prompt, (list, tuple)) and prompt and isinstance(prompt[0], dict):
            tok = self._need_tokenizer()
            for m in prompt:
                if not isinstance(m, dict) or "role" not in m or "content" not in m:
                    raise ValueError("prompt: chat messages must be dicts with 'role' and 'content'")
            text = tok.apply_chat_template(list(prompt), tokenize=False, add_generation_prompt=True)
            ids = tok.encode(text, add_special_tokens=False)
        elif isinstance(prompt, (list, tuple)):
            ids = list(prompt)
            if not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
                raise ValueError("prompt: a list prompt must hold token ids (ints) or chat messages")
            bad = [t for t in ids if not 0 <= t < self.vocab_size]
            if bad:
                raise ValueError(f"prompt: token id {bad[0]} is outside the vocabulary "
                                 f"[0, {self.vocab_size})")
        else:
            raise ValueError(f"prompt: must be text, chat messages or token ids "
                             f"(got {type(prompt).__name__})")
        if not ids:
            raise ValueError("prompt: must not be empty")
        if len(ids) >= self.max_model_len:
            raise ValueError(f"prompt: {len(ids)} tokens, but max_model_len is "
                             f"{self.max_model_len} (prompt + at least one new token must fit)")
        return ids

    def _need_tokenizer(self):
        if self.tokenizer is None:
            raise ValueError(f"prompt: model {self.config.model!r} has no tokenizer; "
                             "pass token ids instead of text")
        return self.tokenizer

    def _make_request(self, prompt: Prompt, params: SamplingParams | None,
                      request_id: str | None) -> _Request:
        params = params if params is not None else SamplingParams()
        if not isinstance(params, SamplingParams):
            raise ValueError(f"params: must be SamplingParams (got {type(params).__name__})")
        params.validate()
        ids = self.tokenize(prompt)
        if params.max_tokens == 0 and len(ids) < 2:
            raise ValueError("max_tokens: 0 scores the prompt, which needs at least 2 tokens")
        rid = request_id if request_id is not None else f"req-{next(self._ids)}"
        first = self._make_choice(prompt, ids, params, rid, 0)
        if params.n > 1:
            # Later choices: their own seed stream; the prompt's logprobs come with the first.
            later = replace(params, prompt_logprobs=None)
            first.choices = [first] + [self._make_choice(prompt, ids, later, rid, i)
                                       for i in range(1, params.n)]
            for c in first.choices[1:]:
                c.owner = first
            first.unfinished = params.n
        if params.prompt_logprobs is not None:
            first.prompt_logprobs = [None] * len(ids)
        return first

    def _make_choice(self, prompt, ids: list[int], params: SamplingParams, rid: str,
                     choice: int) -> _Request:
        seq_id = rid if choice == 0 else f"{rid}#{choice}"
        seq = Sequence(seq_id, ids, params, max_len=self.max_model_len)
        gen = None
        if not params.greedy:
            # A stable default (str hashes are salted per process): the same engine seed and
            # request id sample the same tokens in every run.
            seed = (params.seed if params.seed is not None
                    else zlib.crc32(f"{self.config.seed}:{rid}".encode()))
            if choice:
                seed = zlib.crc32(f"{seed}:{choice}".encode())
            gen = torch.Generator().manual_seed(seed)
        metrics = RequestMetrics(rid, seq.arrival_time, len(ids))
        detok = IncrementalDetokenizer(self.tokenizer, ids, params.stop,
                                       params.skip_special_tokens,
                                       params.include_stop_str_in_output)
        return _Request(seq, prompt, detok, metrics, gen, request_id=rid, choice=choice,
                        logprobs=[] if params.logprobs is not None else None)

    def _submit(self, reqs: list[_Request]) -> None:
        self._check_open()
        with self._lock:
            dup = [r.seq.request_id for r in reqs if r.seq.request_id in self._requests]
            if dup or len({r.seq.request_id for r in reqs}) < len(reqs):
                raise ValueError(f"request_id: {dup[0] if dup else 'duplicate'} is already in use")
            for r in reqs:
                r.seq.arrival_time = r.metrics.arrival_time = time.monotonic()
                self._requests[r.seq.request_id] = r
            self._inbox.extend(reqs)
            self._wake.notify_all()

    def add_request(self, prompt: Prompt, params: SamplingParams | None = None,
                    request_id: str | None = None,
                    listener: Callable[[TokenEvent], None] | None = None) -> str:
        """Queue one request; returns its id. Bad input raises ValueError and adds nothing.
        `listener`, if given, is called with every TokenEvent (from the stepping thread)."""
        req = self._make_request(prompt, params, request_id)
        req.listener = listener
        self._submit([req])
        return req.seq.request_id

    def abort(self, request_id: str) -> bool:
        """Stop a request and free its blocks at the next step boundary. False if unknown."""
        with self._lock:
            if request_id not in self._requests:
                return False
            self._aborts.append(request_id)
            self._wake.notify_all()
        if self._thread is None and not self._step_lock.locked():
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
        self._check_open()
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
            if not (self._async and graph is not None and graph[0] == "full"
                    and all(self._may_run_ahead(r) for r in reqs)):
                if spans:
                    self._add_prompt_logprobs(spans, logits[len(sampling):])
                rows, reqs = self._sampling_rows(reqs)
                if rows is not None:
                    logits = logits.index_select(0, torch.tensor(rows, device=logits.device))
                out = sample(logits[:len(reqs)], [r.seq for r in reqs],
                             [r.generator for r in reqs], self.eos_token_ids)
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

    def _may_run_ahead(self, r: _Request) -> bool:
        """Whether a request's next step may be launched before its token is known: greedy
        (the id is picked on the device), no stop strings (they need the text), no logits
        processors (penalties need the token history on the host). Logprobs may: they are
        computed on the device and copied back with the ids."""
        p = r.seq.params
        return r.generator is None and not p.stop and not p.needs_processing

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

    def _sampling_rows(self, reqs: list[_Request]) -> tuple[list[int] | None, list[_Request]]:
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

    def _fork(self, r: _Request) -> None:
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

    def _logprob_dict(self, lp: LogprobsTensors, row: int, k: int) -> dict[int, Logprob]:
        """Row `row` of host logprob tensors as {token id: Logprob}: column 0 (the chosen
        token) first, then the top k."""
        ids = lp.token_ids[row, :k + 1].tolist()
        vals = lp.logprobs[row, :k + 1].tolist()
        out = {ids[0]: Logprob(vals[0], int(lp.ranks[row]), self._decode_token(ids[0]))}
        for rank, (t, v) in enumerate(zip(ids[1:], vals[1:]), start=1):
            if t not in out:
                out[t] = Logprob(v, rank, self._decode_token(t))
        return out

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
                        r.prompt_logprobs[p] = self._logprob_dict(
                            lp, row + p - first - 1, s.seq.params.prompt_logprobs)
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
                lp = self._logprob_dict(logprobs, i, r.seq.params.logprobs)
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
            graph_size=graph and graph[1], finished=finished, scheduled_ahead=ahead))
        if self._kv_wanted:
            self._kv_wanted = False
            self._kv_last = self._kv_snapshot()
        return events

    def _finish_in_flight(self) -> None:
        """Hand out the step still in flight, launching nothing after it."""
        if self._inflight is not None:
            with self._step_lock:
                if self._inflight is not None:
                    self._step(speculate=False)

    def _append_token(self, r: _Request, tok: int, now: float,
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
        elif seq.num_output_tokens >= p.max_tokens or seq.num_tokens >= self.max_model_len:
            reason = "length"
        if reason is not None:
            self.scheduler.finish(seq, reason)
        ev = TokenEvent(r.request_id, tok, r.detok.take(final=reason is not None),
                        seq.num_output_tokens, now, reason is not None, reason, logprobs,
                        r.choice)
        if reason is not None:
            self._finish(r, now, deliver=False)
        self._deliver(r, ev)
        owner = r.owner or r
        if reason is not None and owner.unfinished == 0:
            owner.done.set()
        return ev

    def _deliver(self, r: _Request, ev: TokenEvent) -> None:
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

    def _finish(self, r: _Request, now: float, deliver: bool = True) -> None:
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
                self._deliver(c, TokenEvent(c.request_id, None, c.detok.take(final=True),
                                            c.seq.num_output_tokens, now, True,
                                            c.seq.finish_reason, None, c.choice))
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

    # ---- driving it to completion ---------------------------------------------------------
    def _prepare_batch(self, prompts, params) -> list[_Request]:
        if isinstance(prompts, str) or (isinstance(prompts, (list, tuple)) and prompts
                                        and isinstance(prompts[0], (int, dict))):
            prompts = [prompts]
        if not isinstance(prompts, (list, tuple)) or not prompts:
            raise ValueError("prompts: must be a prompt or a non-empty list of prompts")
        if params is None or isinstance(params, SamplingParams):
            params = [params] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"params: {len(params)} SamplingParams for {len(prompts)} prompts")
        return [self._make_request(p, sp, None) for p, sp in zip(prompts, params)]

    def generate(self, prompts, params: SamplingParams | list[SamplingParams] | None = None,
                 progress: Callable[[int, int], None] | None = None) -> list[RequestOutput]:
        """Run a batch to completion; outputs in prompt order. Every prompt is validated before
        any is queued, so one bad prompt raises ValueError and queues nothing."""
        reqs = self._prepare_batch(prompts, params)
        self._submit(reqs)
        if self._thread is not None:
            for r in reqs:
                r.done.wait()
        else:
            done = 0
            while not all(r.done.is_set() for r in reqs):
                self.step()
            if not self.has_unfinished_requests():
                self._finish_in_flight()        # a run-ahead step of requests that ended
                if progress is not None:
                    now_done = sum(r.done.is_set() for r in reqs)
                    if now_done != done:
                        done = now_done
                        progress(done, len(reqs))
        return [self._output(r) for r in reqs]

    def _output(self, r: _Request) -> RequestOutput:
        s = r.seq
        outs = [CompletionOutput(c.choice, c.detok.text, c.seq.output_token_ids,
                                 c.seq.finish_reason, c.logprobs) for c in r.choices or [r]]
        return RequestOutput(s.request_id, r.prompt, s.prompt_token_ids, s.output_token_ids,
                             r.detok.text, s.is_finished, s.finish_reason, r.metrics, outs,
                             r.prompt_logprobs)

    def stream(self, prompt: Prompt, params: SamplingParams | None = None,
               request_id: str | None = None) -> Iterator[TokenEvent]:
        """Yield each TokenEvent of one request as soon as its token exists.

        Several streams may be consumed at once, from several threads (background mode) or
        interleaved in one thread (each `next` steps the engine until its own token arrives).
        Closing the generator early aborts the request.
        """
        q: queue.SimpleQueue[TokenEvent] = queue.SimpleQueue()
        rid = self.add_request(prompt, params, request_id, listener=q.put)
        left = params.n if params is not None else 1
        finished = False
        try:
            while not finished:
                if self._thread is None:
                    while q.empty():
                        self.step()
                ev = q.get()
                left -= ev.finished
                finished = left == 0
                yield ev
        finally:
            if not finished:
                self.abort(rid)

    async def astream(self, prompt: Prompt, params: SamplingParams | None = None,
                      request_id: str | None = None) -> AsyncIterator[TokenEvent]:
        """asyncio version of `stream`; starts the background loop if it is not running.
        Cancelling the consumer (e.g. a client disconnect) aborts the request."""
        self.start()
        loop = asyncio.get_running_loop()
        q: asyncio.Queue[TokenEvent] = asyncio.Queue()
        rid = self.add_request(prompt, params, request_id,
                               listener=lambda ev: loop.call_soon_threadsafe(q.put_nowait, ev))
        left = params.n if params is not None else 1
        finished = False
        try:
            while not finished:
                ev = await q.get()
                left -= ev.finished
                finished = left == 0
                yield ev
        finally:
            if not finished:
                self.abort(rid)

    # ---- background mode ------------------------------------------------------------------
    @property
    def is_running_in_background(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    @property
    def num_running(self) -> int:
        """Requests in the running batch."""
        return len(self.scheduler.running)

    @property
    def num_waiting(self) -> int:
        """Requests queued: in the scheduler's queue or not yet picked up by the step loop."""
        return len(self.scheduler.waiting) + len(self._inbox)

    def start(self) -> "Engine":
        """Step in a daemon thread until `shutdown()`. Idempotent."""
        self._check_open()
        if self._thread is None:
            self._stop.clear()
            self._thread = threading.Thread(target=self._loop, name="workbench-engine", daemon=True)
            self._thread.start()
        return self

    def shutdown(self, abort_all: bool = True) -> None:
        """Stop the background loop (aborting what is left, unless told not to). The engine
        keeps its memory and can be started again; `close()` frees it."""
        thread = self._thread
        if thread is None:
            return
        self._stop.set()
        with self._lock:
            self._wake.notify_all()
        thread.join()
        self._thread = None
        self._finish_in_flight()
        if abort_all:
            for rid in list(self._requests):
                self.abort(rid)
            with self._step_lock:
                self._drain_inbox()

    def _loop(self) -> None:
        while not self._stop.is_set():
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

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("engine: closed (close() freed its KV pool and weights); "
                               "build a new Engine")

    def close(self) -> None:
        """Stop the loop, abort every request, and free the KV pool, captured graphs and
        weights now, without waiting for the garbage collector (a rebuild on a GPU needs
        the memory back at once). Idempotent; the engine refuses work afterwards. Its
        config, telemetry and notices stay readable. Dropping the last reference to an
        engine frees the same memory (the engine holds no reference cycles)."""
        if self._closed:
            return
        self.shutdown()
        self._finish_in_flight()
        with self._step_lock:
            for rid in list(self._requests):
                self.abort(rid)
            self._drain_inbox()
            self._closed = True
            self.runner.release()
            self.model = None
        self.platform.empty_cache()

    def __enter__(self) -> "Engine":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
