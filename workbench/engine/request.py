"""A request as the engine holds it (made by make_request), what it streams (TokenEvent),
and where an unfinished one stands (RequestState)."""
from __future__ import annotations

import threading
from dataclasses import dataclass, field, replace
from typing import Any, Callable

import torch

from ..core.sampling_params import SamplingParams
from ..core.sequence import Logprob, Sequence
from ..core.structured_output import StructuredOutputManager
from ..telemetry import RequestMetrics
from .detokenizer import IncrementalDetokenizer
from .parallel_sampling import ParentRequest


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
    computed). A grammar (structured output) is compiled here, one matcher per choice: a bad
    one raises ValueError. A seeded request gets a generator of its own on `device` (choice
    i from the request's seed + i); an unseeded one draws from the
    engine's shared generator."""
    def choice(i: int, params: SamplingParams) -> Request:
        grammar = (structured_output.compile(params.structured_outputs)
                   if params.structured_outputs is not None else None)
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
        later = replace(params, prompt_logprobs=None)
        ParentRequest([first] + [choice(i, later) for i in range(1, params.n)])
    if params.prompt_logprobs is not None:
        first.prompt_logprobs = [None] * len(prompt_ids)
    return first


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
