"""A request as the engine core holds it, what it streams (TokenEvent), and where an
unfinished one stands (RequestState)."""
from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from ..telemetry import RequestMetrics
from .detokenizer import IncrementalDetokenizer
from ..core.sequence import Logprob, Sequence


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


@dataclass(eq=False)
class Request:
    """One request inside the engine core: its sequence, the prompt as given, its
    detokenizer, metrics, sampling generator (None when greedy), listener, and an event set
    when it ends."""
    seq: Sequence
    prompt: Any
    detok: IncrementalDetokenizer
    metrics: RequestMetrics
    generator: torch.Generator | None
    grammar: Any = None
    """The structured-output grammar matcher (core/structured_output.py), or None."""
    listener: Callable[[TokenEvent], None] | None = None
    done: threading.Event = field(default_factory=threading.Event)
    """Set when every choice has ended (on the first choice's Request)."""
    request_id: str = ""
    """The id the caller knows (choices after the first run as '<id>#<choice>')."""
    choice: int = 0
    choices: list["Request"] = field(default_factory=list)
    """On the first choice of an n > 1 request: all n choices, itself first. Later choices
    wait here until the first one's prompt is computed, then fork its KV blocks."""
    owner: "Request | None" = None
    """On a later choice: the first choice."""
    forked: bool = False
    unfinished: int = 1
    """On the first choice: choices still running."""
    logprobs: list[dict[int, Logprob]] | None = None
    """One dict per output token (with SamplingParams.logprobs)."""
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    """One entry per prompt token (with SamplingParams.prompt_logprobs; None for the first)."""


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
