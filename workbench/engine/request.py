"""A request as the engine holds it (made by make_request), its n > 1 group (ParentRequest),
where the engine finds it (RequestRegistry), what it streams (TokenEvent), and where an
unfinished one stands (RequestState).

Two ids, never mixed: `Request.request_id` is the caller's (what TokenEvents, aborts by the
caller and RequestMetrics carry); `Request.seq_id` (its Sequence's request_id) is one
choice's, '<id>' for the first and '<id>#<i>' for the others, and is what the scheduler, the
runner and every map of a step are keyed by.

n > 1:
The first choice computes the prompt alone. Its first token is sampled once per choice from
the same logits row (`sampling_rows`); then the other choices fork its KV blocks
(Scheduler.fork, so the prompt is computed once) and run as sequences of their own, named
'<id>#<i>'. The request ends when every choice has; a first choice that ends before its
prompt is computed (an abort) ends the others with it, as they never started.
"""
from __future__ import annotations

import threading
from dataclasses import dataclass, field, replace
from typing import Any, Callable

import torch

from ..core.sampling_params import SamplingParams
from ..core.sequence import Logprob, Sequence, SequenceStatus
from ..core.structured_output import StructuredOutputManager
from ..telemetry import RequestMetrics
from .detokenizer import IncrementalDetokenizer


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
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    """With SamplingParams.prompt_logprobs: on the request's first event (choice 0), one
    entry per prompt token (None for the first)."""
    stop_reason: int | str | None = None
    """On a final event: the stop token id or stop string that ended it (Sequence.stop_reason)."""
    draft: bool = False
    """Speculative decoding: the proposer drafted this token and the target accepted it (a
    verify step's first tokens; False for every token the target chose itself)."""
    rejected: list[str] | None = None
    """Speculative decoding, on the token the target chose itself at a verify step (the one
    after its accepted drafts): the text of each draft it rejected, each decoded alone
    ([]: it accepted them all); None on every other token. What a token-stream view needs
    to draw the step; StepEvent.drafts/accepted have the ids, by step."""


@dataclass(eq=False)
class Request:
    """One sequence inside the engine: its Sequence (what the scheduler sees), the prompt as
    given, its detokenizer, metrics, sampling generator (None when greedy), grammar and
    listener. A request with n > 1 is n of these under one ParentRequest."""
    seq: Sequence
    prompt: Any
    detok: IncrementalDetokenizer
    metrics: RequestMetrics
    """The caller's record on the first choice (the others' add their token counts to it
    when the request ends)."""
    generator: torch.Generator | None
    """A seeded request's own generator, on the device; None: it draws from the engine's
    (greedy requests draw nothing)."""
    grammar: Any = None
    """The structured-output grammar matcher (core/structured_output.py), or None."""
    listener: Callable[[TokenEvent], None] | None = None
    done: threading.Event = field(default_factory=threading.Event)
    """Set when the request has ended, every choice of it (on the first choice)."""
    request_id: str = ""
    """The id the caller knows (choices after the first run as '<id>#<choice>')."""
    choice: int = 0
    parent: ParentRequest | None = None
    """The n > 1 group this is one choice of; None when n == 1."""
    logprobs: list[dict[int, Logprob]] | None = None
    """One dict per output token (with SamplingParams.logprobs)."""
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    """One entry per prompt token (with SamplingParams.prompt_logprobs; None for the first)."""

    @property
    def seq_id(self) -> str:
        """This choice's id: the scheduler's and the runner's key ('<id>#<i>' after the
        first choice)."""
        return self.seq.request_id

    @property
    def choices(self) -> list[Request]:
        """All n choices of this request, the first first (just itself when n == 1)."""
        return [self] if self.parent is None else self.parent.choices

    @property
    def first(self) -> Request:
        """The first choice: the one the caller holds (its id, metrics and `done`)."""
        return self if self.parent is None else self.parent.choices[0]


def make_request(prompt_ids: list[int], prompt: Any, params: SamplingParams, request_id: str, *,
                 tokenizer, max_model_len: int, device,
                 structured_output: StructuredOutputManager) -> Request:
    """A Request for validated token ids (the front door tokenizes and validates); with n > 1,
    the first of n choices under a ParentRequest (the others start when its prompt is
    computed). A grammar (structured output) is compiled here, once, and each choice gets a
    matcher of its own from it: a bad one raises ValueError. A seeded request gets a
    generator of its own on `device` (choice i from the request's seed + i); an unseeded one
    draws from the engine's shared generator."""
    compiled = (structured_output.compile(params.structured_outputs)
                if params.structured_outputs is not None else None)

    def choice(i: int, params: SamplingParams) -> Request:
        grammar = None if compiled is None else compiled if i == 0 else compiled.deep_copy()
        seq = Sequence(request_id if i == 0 else f"{request_id}#{i}", prompt_ids, params,
                       max_len=max_model_len)
        gen = None
        if not params.greedy and params.seed is not None:
            # Choice i draws from seed + i, as vLLM's n > 1 does (wrapped to 64 bits).
            gen = torch.Generator(device=device).manual_seed((params.seed + i) % 2**64)
        metrics = RequestMetrics(request_id, seq.arrival_time, len(prompt_ids))
        detok = IncrementalDetokenizer(tokenizer, prompt_ids, params.stop,
                                       params.skip_special_tokens,
                                       params.include_stop_str_in_output)
        return Request(seq, prompt, detok, metrics, gen, grammar, request_id=request_id,
                       choice=i, logprobs=[] if params.logprobs is not None else None)

    first = choice(0, params)
    if params.n > 1:
        # Later choices: their own seed stream; the prompt's logprobs come with the first.
        later = replace(params, prompt_logprobs=None) if params.prompt_logprobs is not None \
            else params
        ParentRequest([first] + [choice(i, later) for i in range(1, params.n)])
    if params.prompt_logprobs is not None:
        first.prompt_logprobs = [None] * len(prompt_ids)
    return first


class ParentRequest:
    __slots__ = ("choices", "forked", "num_unfinished")

    def __init__(self, choices: list[Request]):
        self.choices = choices
        """All n choices, the first (the caller's request) first."""
        self.forked = False
        """The other choices have started on the first one's blocks."""
        self.num_unfinished = len(choices)
        for c in choices:
            c.parent = self

    def started(self) -> list[Request]:
        """The choices the scheduler holds: the first, and the others once forked."""
        return self.choices if self.forked else self.choices[:1]

    def fork(self) -> list[Request]:
        """The first choice's prompt is computed: the others start now (the pipeline puts
        them on its blocks with Scheduler.fork; they stream to its listener). Returns them."""
        first, others = self.choices[0], self.choices[1:]
        self.forked = True
        for c in others:
            c.listener = first.listener
        return others

    def end(self, r: Request) -> list[Request]:
        """Choice r has ended: the choices that end with it (itself, and the unstarted ones
        when it is the first), counted off."""
        ended = [r]
        if r is self.choices[0] and not self.forked:
            for c in self.choices[1:]:
                c.seq.status, c.seq.finish_reason = SequenceStatus.FINISHED, r.seq.finish_reason
                c.listener = r.listener
                ended.append(c)
        self.num_unfinished -= len(ended)
        return ended

    @staticmethod
    def sampling_rows(reqs: list[Request]) -> tuple[list[int] | None, list[Request]]:
        """The logits rows to sample for one step's requests, and whose: a first choice whose
        others have not started samples one token per choice from its row. (None, reqs)
        when every request samples its own row once."""
        if not any(r.parent is not None and not r.parent.forked for r in reqs):
            return None, reqs
        rows, out = [], []
        for i, r in enumerate(reqs):
            for c in (r.parent.choices if r.parent is not None and not r.parent.forked else [r]):
                rows.append(i)
                out.append(c)
        return rows, out


class RequestRegistry:
    """Every request from `add` to its end, by sequence id (a first choice stays until its
    last choice ends, so an abort by the caller's id finds it): what the engine core's add,
    abort and read API, the pipeline and the output processor look requests up in. Added to
    from any thread; only the stepping thread removes, so it reads without the lock."""

    def __init__(self):
        self._requests: dict[str, Request] = {}
        self._lock = threading.Lock()

    def add(self, reqs: list[Request]) -> None:
        """Hold new requests; a request id in use (or twice in reqs) is a ValueError and adds
        none of them."""
        with self._lock:
            dup = [r.seq_id for r in reqs if r.seq_id in self._requests]
            if dup or len({r.seq_id for r in reqs}) < len(reqs):
                raise ValueError(f"request_id: {dup[0] if dup else 'duplicate'} is already in use")
            for r in reqs:
                self._requests[r.seq_id] = r

    def adopt(self, choices: list[Request]) -> None:
        """Hold the choices an n > 1 request started."""
        with self._lock:
            for c in choices:
                self._requests[c.seq_id] = c

    def let_go(self, r: Request, all_ended: bool) -> None:
        """Choice r has ended: forget it, unless it is the first and others still run (the
        first stays findable until the last ends)."""
        with self._lock:
            if r is not r.first:
                self._requests.pop(r.seq_id, None)
            if all_ended:
                self._requests.pop(r.first.seq_id, None)

    def __contains__(self, seq_id: str) -> bool:
        return seq_id in self._requests

    def get(self, seq_id: str) -> Request | None:
        return self._requests.get(seq_id)

    def requests_of(self, seq_ids: list[str]) -> list[Request]:
        """The Request of each id, in order (a step's rows)."""
        reqs = self._requests
        return [reqs[rid] for rid in seq_ids]

    def requests(self) -> list[Request]:
        """Every request held now, in arrival order."""
        with self._lock:
            return list(self._requests.values())

    def has_unfinished(self) -> bool:
        with self._lock:
            return bool(self._requests)


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
