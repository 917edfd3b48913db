"""Engine: the front door. tokenize / make_request / add_request / step / abort / generate /
stream / astream.

A request comes in through `make_request` (called by add_request, stream and astream with a
prompt, or by a caller such as the server that tokenized the prompt itself): its params
checked against this engine, its prompt tokenized and its grammar compiled, once each.

Two ways to drive it:
- in the caller's thread: `step()` runs one engine-core step; `generate` and `stream` call it
  until their requests finish (other requests in the engine advance too);
- in the background: `start()` runs the core's step loop in a daemon thread, and any number
  of callers (widgets, server handlers, asyncio tasks) add requests and stream at once.

Everything that observes an engine reads its public read API: `info()` (what it is, the
knobs as run in `info().config`), `stats()` (where it stands), `kv_blocks()`,
`request_states()` and `telemetry` (`telemetry.notices`: what runs differently from what was
asked). Those, and the request operations `step`, `abort`, `has_unfinished_requests` and
`reset_prefix_cache`, are the engine core's own methods (`workbench.engine.core`, which
documents them), handed out as they are.
"""
from __future__ import annotations

import asyncio
import contextlib
import copy
import itertools
import queue
import threading
from dataclasses import dataclass, field, replace
from typing import Any, AsyncIterator, Callable, Iterator

from ..config import EngineConfig
from ..core.block_manager import KVBlockSnapshot
from ..core.clock import Clock
from .calibrate import calibrate_cpu, needs_calibration
from .core import EngineCore
from .input_processor import InputProcessor, Prompt
from .request import Request, RequestState, TokenEvent
from ..core.sampling_params import SamplingParams
from ..core.sequence import Logprob
from ..roofline import DeviceRoofs
from ..telemetry import EngineInfo, EngineStats, RequestMetrics, Telemetry

__all__ = ["Engine", "RequestOutput", "CompletionOutput"]

@dataclass
class CompletionOutput:
    """One of a request's n choices."""
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None
    logprobs: list[dict[int, Logprob]] | None = None
    """One dict per output token (with SamplingParams.logprobs)."""
    stop_reason: int | str | None = None
    """The stop token id or stop string that ended it; None otherwise (vLLM's)."""


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

    @classmethod
    def of(cls, r: Request) -> "RequestOutput":
        s = r.seq
        outs = [CompletionOutput(c.choice, c.detok.text, c.seq.output_token_ids,
                                 c.seq.finish_reason, c.logprobs, c.seq.stop_reason)
                for c in r.choices]
        return cls(s.request_id, r.prompt, s.prompt_token_ids, s.output_token_ids, r.detok.text,
                   s.is_finished, s.finish_reason, r.metrics, outs, r.prompt_logprobs)


class Engine:
    def __init__(self, config: EngineConfig | None = None, **overrides):
        config = replace(config, **overrides) if config is not None else EngineConfig(**overrides)
        if needs_calibration(config):     # model:cpu: fitted to this machine first (cached)
            calibrate_cpu(config)
        core = self.core = EngineCore(config)
        # The public read API and the request operations are the core's own (core.py says
        # what each does); the front door hands them out as they are, not re-wrapped.
        self.telemetry: Telemetry = core.telemetry
        """Every step's and request's record; `telemetry.notices`: what this engine does
        differently from what was asked, in words for a UI."""
        self.clock: Clock = core.clock
        """Where this engine's timestamps come from (core/clock.py): the wall's on a real
        device, modelled time on a modelled one (`clock.virtual`)."""
        self.tokenizer = core.tokenizer
        """The model's Hugging Face tokenizer (None for random weights)."""
        self.info: Callable[[], EngineInfo] = core.info
        self.stats: Callable[[], EngineStats] = core.stats
        self.kv_blocks: Callable[[], KVBlockSnapshot | None] = core.kv_blocks
        self.request_states: Callable[[], list[RequestState]] = core.request_states
        self.has_unfinished_requests: Callable[[], bool] = core.has_unfinished_requests
        self.device_roofs: Callable[..., DeviceRoofs] = core.device_roofs
        self.model_sha256: Callable[[], str | None] = core.model_sha256
        self.sampler_cost: Callable[..., dict] = core.sampler_cost
        self.reset_prefix_cache: Callable[[], None] = core.reset_prefix_cache
        self.abort: Callable[[str], bool] = core.abort
        self.step: Callable[[], list[TokenEvent]] = core.step
        self.inputs = InputProcessor(core.tokenizer, core.vocab_size, core.max_model_len,
                                     core.config.model)
        """Prompts to token ids (tokenizer, chat template, checks)."""
        self._ids = itertools.count()
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()

    def default_sampling_params(self) -> SamplingParams:
        """What a request without SamplingParams runs with (vLLM's
        get_default_sampling_params): SamplingParams' defaults, overridden by the model's
        generation_config.json where EngineConfig.generation_config is 'auto'
        (info().generation_defaults)."""
        return SamplingParams(**self.core.info().generation_defaults)

    # ---- requests -------------------------------------------------------------------------
    def tokenize(self, prompt: Prompt, **controls) -> list[int]:
        """Text, chat messages (through the chat template) or token ids -> token ids; the
        chat-template controls and truncation are input_processor.InputProcessor's (a
        truncate_prompt_tokens as a SamplingParams holds it: checked there)."""
        return self.inputs(prompt, **controls)

    def make_request(self, prompt: Prompt, params: SamplingParams | None = None,
                     request_id: str | None = None, *,
                     prompt_token_ids: list[int] | None = None) -> Request:
        """A request ready to queue, queued nowhere (vLLM's InputProcessor.process_inputs):
        the params checked against this engine (their token ids in the vocabulary, what this
        device runs), the prompt tokenized (truncated by params.truncate_prompt_tokens) and
        the grammar compiled, each once; a refusal is a ValueError naming the field. The
        params' own values were checked when they were made (SamplingParams.validate).
        `prompt_token_ids`: what `tokenize` made of `prompt` (a caller that tokenizes first,
        as the server does to size max_tokens), used as they are. params.max_tokens None: as
        many as fit after the prompt. Hand the Request to add_request, stream or astream."""
        params = params if params is not None else self.default_sampling_params()
        if not isinstance(params, SamplingParams):
            raise ValueError(f"params: must be SamplingParams (got {type(params).__name__})")
        vocab = self.core.vocab_size
        bad = [t for t in params.logit_bias or () if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"logit_bias: token id {bad[0]} is outside the vocabulary [0, {vocab})")
        ids = (prompt_token_ids if prompt_token_ids is not None
               else self.tokenize(prompt, truncate_prompt_tokens=params.truncate_prompt_tokens))
        if params.max_tokens is None:       # as many as fit (vLLM's None)
            params = copy.copy(params)
            params.max_tokens = self.core.max_model_len - len(ids)
            if params.min_tokens > params.max_tokens:
                raise ValueError(f"min_tokens: {params.min_tokens}, but at most "
                                 f"{params.max_tokens} new tokens fit after the prompt")
        rid = request_id if request_id is not None else f"req-{next(self._ids)}"
        return self.core.make_request(ids, prompt, params, rid)

    def _made(self, prompt: Prompt | Request, params: SamplingParams | None,
              request_id: str | None) -> Request:
        if not isinstance(prompt, Request):
            return self.make_request(prompt, params, request_id)
        if params is not None or request_id is not None:
            raise ValueError("params: a Request from make_request carries its params and id")
        return prompt

    def add_request(self, prompt: Prompt | Request, params: SamplingParams | None = None,
                    request_id: str | None = None,
                    listener: Callable[[TokenEvent], None] | None = None,
                    arrival_time: float | None = None) -> str:
        """Queue one request (a prompt, or a Request from make_request); returns its id. Bad
        input raises ValueError and adds nothing.
        `listener`, if given, is called with every TokenEvent (from the stepping thread).
        `arrival_time`: when it arrives, on `self.clock` (`engine.clock.now() + 0.5`: half a
        second from now); None: now. Until then the scheduler does not see it; a modelled
        engine's clock jumps to it when nothing else is left to run, so an open-loop
        (Poisson) workload can be queued whole and replayed in modelled time."""
        req = self._made(prompt, params, request_id)
        req.listener = listener
        self.core.add([req], arrival_time)
        return req.seq.request_id

    # ---- driving it to completion ---------------------------------------------------------
    def generate(self, prompts, params: SamplingParams | list[SamplingParams] | None = None,
                 progress: Callable[[int, int], None] | None = None) -> list[RequestOutput]:
        """Run a batch to completion; outputs in prompt order. Every prompt is validated before
        any is queued, so one bad prompt raises ValueError and queues nothing."""
        if isinstance(prompts, str) or (isinstance(prompts, (list, tuple)) and prompts
                                        and isinstance(prompts[0], (int, dict))):
            prompts = [prompts]
        if not isinstance(prompts, (list, tuple)) or not prompts:
            raise ValueError("prompts: must be a prompt or a non-empty list of prompts")
        if params is None or isinstance(params, SamplingParams):
            params = [params] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"params: {len(params)} SamplingParams for {len(prompts)} prompts")
        reqs = [self.make_request(p, sp) for p, sp in zip(prompts, params)]
        self.core.add(reqs)
        done = 0
        while not all(r.done.is_set() for r in reqs):
            if self.is_running_in_background:
                next(r for r in reqs if not r.done.is_set()).done.wait()
            else:
                self.step()
            if progress is not None and (now := sum(r.done.is_set() for r in reqs)) != done:
                done = now
                progress(done, len(reqs))
        if not self.is_running_in_background and not self.has_unfinished_requests():
            self.core.finish_in_flight()       # a run-ahead step of requests that ended
        return [RequestOutput.of(r) for r in reqs]

    @contextlib.contextmanager
    def _following(self, prompt, params, request_id, put: Callable[[TokenEvent], None]):
        """One request's stream, for `stream` and `astream` alike: queued with `put` as its
        listener; aborted if its consumer stops before the last event (of its last choice)."""
        req = self._made(prompt, params, request_id)
        rid = self.add_request(req, listener=put)
        seen = {"finished": False, "left": len(req.choices)}

        def saw(ev: TokenEvent) -> TokenEvent:
            seen["left"] -= ev.finished
            seen["finished"] = seen["left"] == 0
            return ev
        try:
            yield saw, (lambda: seen["finished"])
        finally:
            if not seen["finished"]:
                self.abort(rid)

    def stream(self, prompt: Prompt | Request, params: SamplingParams | None = None,
               request_id: str | None = None) -> Iterator[TokenEvent]:
        """Yield each TokenEvent of one request as soon as its token exists.

        Several streams may be consumed at once, from several threads (background mode) or
        interleaved in one thread (each `next` steps the engine until its own token arrives).
        Closing the generator early aborts the request.
        """
        q: queue.SimpleQueue[TokenEvent] = queue.SimpleQueue()
        with self._following(prompt, params, request_id, q.put) as (saw, finished):
            while not finished():
                if self._thread is None:
                    while q.empty():
                        self.step()
                yield saw(q.get())

    async def astream(self, prompt: Prompt | Request, params: SamplingParams | None = None,
                      request_id: str | None = None) -> AsyncIterator[TokenEvent]:
        """asyncio version of `stream`; starts the background loop if it is not running.
        Cancelling the consumer (e.g. a client disconnect) aborts the request."""
        self.start()
        loop = asyncio.get_running_loop()
        q: asyncio.Queue[TokenEvent] = asyncio.Queue()
        put = lambda ev: loop.call_soon_threadsafe(q.put_nowait, ev)   # noqa: E731
        with self._following(prompt, params, request_id, put) as (saw, finished):
            while not finished():
                yield saw(await q.get())

    # ---- background mode ------------------------------------------------------------------
    @property
    def is_running_in_background(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def start(self) -> "Engine":
        """Step in a daemon thread until `shutdown()`. Idempotent."""
        self.core.check_open()
        if self._thread is None:
            self._stop.clear()
            self._thread = threading.Thread(target=self.core.run_loop, args=(self._stop,),
                                            name="workbench-engine", daemon=True)
            self._thread.start()
        return self

    def shutdown(self, abort_all: bool = True) -> None:
        """Stop the background loop (aborting what is left, unless told not to). The engine
        keeps its memory and can be started again; `close()` frees it."""
        thread = self._thread
        if thread is None:
            return
        self._stop.set()
        self.core.wake()
        thread.join()
        self._thread = None
        self.core.finish_in_flight()
        if abort_all:
            self.core.abort_all()

    # ---- release ----------------------------------------------------------------------------
    @property
    def is_closed(self) -> bool:
        return self.core.is_closed

    def close(self) -> None:
        """Stop the loop, abort every request, and free the KV pool, captured graphs and
        weights now, without waiting for the garbage collector (a rebuild on a GPU needs
        the memory back at once). Idempotent; the engine refuses work afterwards. Its
        info(), telemetry and its notices stay readable. Dropping the last reference to an
        engine frees the same memory (the engine holds no reference cycles)."""
        self.shutdown()
        self.core.close()

    def __enter__(self) -> "Engine":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
