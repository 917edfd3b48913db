"""A request as the engine core holds it, what it streams (TokenEvent), and where an
unfinished one stands (RequestState)."""
from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from ..telemetry import RequestMetrics
from .detokenizer import IncrementalDetokenizer
from .sequence import Sequence


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
    finish_reason: str | None = None


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
