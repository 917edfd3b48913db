"""Sequence: one request's tokens, KV blocks and progress as the scheduler sees them."""
from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from .sampling_params import SamplingParams


@dataclass(slots=True)
class Logprob:
    """One token's log-probability at one position (vLLM's name and fields)."""
    logprob: float
    rank: int | None = None
    """Its rank in that position's distribution (1 = the most likely)."""
    decoded_token: str | None = None


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(slots=True, eq=False)
class Sequence:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival_time: float = field(default_factory=time.monotonic)
    max_len: int | None = None
    """Prompt + output may not grow past this (the engine's max_model_len)."""

    token_ids: list[int] = field(init=False)
    """Prompt followed by every output token so far."""
    num_computed_tokens: int = 0
    """Tokens whose K/V are in the cache (cached prefix included)."""
    num_cached_tokens: int = 0
    """Of those, how many came from the prefix cache at the last admission."""
    block_table: list[int] = field(default_factory=list)
    block_hashes: list[int] = field(default_factory=list)
    """Chained hash of each full block in block_table that is registered in the prefix cache."""
    prefix_hashes: list[int] = field(default_factory=list)
    """Chained hash of each full block of token_ids looked up so far (BlockManager.match_prefix
    fills it): a request that waits for room is not hashed again at every step."""
    status: SequenceStatus = SequenceStatus.WAITING
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    """What stopped it, as vLLM reports it: the stop token id from stop_token_ids, or the
    stop string matched; None for EOS, a length limit or an abort."""
    spec_token_ids: list[int] = field(default_factory=list)
    """Draft tokens proposed for its next step (speculative decoding): not its tokens yet,
    the step verifies them; the scheduler clears them once scheduled or preempted."""
    num_preemptions: int = 0
    arrival_index: int = 0
    """Order of arrival; FIFO and preemption policies compare it."""

    def __post_init__(self) -> None:
        self.token_ids = list(self.prompt_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - len(self.prompt_token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[len(self.prompt_token_ids):]

    @property
    def num_uncomputed_tokens(self) -> int:
        return len(self.token_ids) - self.num_computed_tokens

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED
