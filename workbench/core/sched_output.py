"""A step as the scheduler decided it, and a request's part of its result, as data (vLLM
v1's vllm/v1/core/sched/output.py): what the scheduler hands the model runner and what
update_from_output hands the output processor, never the scheduler's live sequences."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)
class ScheduledRequest:
    """One request's part of a step, as data: which request, how many tokens it feeds from
    which position, and whether the step samples its next token."""
    req_id: str
    num_new_tokens: int
    start: int
    """Position of the first token fed (== num_computed_tokens before the step): the tokens
    it already has in the KV cache, which its attention reads besides its new ones."""
    will_sample: bool
    """Whether this step reaches the end of the request's known tokens, so its last logits
    give the next token (a mid-prompt chunk does not)."""
    is_decode: bool
    """One new token after at least one output token (and its drafts): a decode, not a
    (re)prefill."""
    spec_token_ids: list[int] = field(default_factory=list)
    """Speculative decoding: the draft tokens fed after the decode's token (counted in
    num_new_tokens), each position's logits verifying the draft before it. A decode with
    drafts is a verify: the runner feeds it as a chunk on cached context."""


@dataclass(slots=True)
class NewRequestData:
    """A request the model runner does not hold yet (just admitted, forked, or back from a
    preemption): everything it needs to compute it (vLLM's NewRequestData)."""
    req_id: str
    token_ids: list[int]
    """Every token known so far: the prompt, then (a request resumed after a preemption, a
    forked choice) the outputs it had."""
    num_prompt_tokens: int
    block_ids: list[int]
    num_computed_tokens: int
    prompt_logprobs: int | None
    """Top prompt logprobs asked for (the runner computes logits for prompt positions)."""


@dataclass(slots=True)
class CachedRequestData:
    """A request the runner already holds: only what changed since it last ran (vLLM's
    CachedRequestData, one per request)."""
    req_id: str
    new_token_ids: list[int]
    """Tokens that became known since (the token sampled by its last step); empty for a
    step scheduled before that token reached the host (async scheduling)."""
    new_block_ids: list[int]
    num_computed_tokens: int
    block_ids_from: int | None = None
    """Where new_block_ids start in its block table when the scheduler gave blocks back
    since (rejected drafts' blocks): the runner drops its ids from there first. None: after
    all it holds."""


@dataclass(slots=True)
class SchedulerOutput:
    """One step as the scheduler decided it, in data only: the model runner keeps its own
    copy of each request's tokens and blocks and applies these changes to it, so nothing
    here is a live object of the scheduler's."""
    scheduled: list[ScheduledRequest] = field(default_factory=list)
    """The step's requests, running ones first, in scheduling order."""
    new_reqs: list[NewRequestData] = field(default_factory=list)
    cached_reqs: list[CachedRequestData] = field(default_factory=list)
    finished_req_ids: list[str] = field(default_factory=list)
    """Requests the runner held that have ended or been preempted since the last step: it
    forgets them."""
    preempted: list[str] = field(default_factory=list)
    """Requests preempted by this step (their blocks freed; they wait to be recomputed)."""
    num_cached_tokens: int = 0
    """Prompt tokens of newly admitted requests served from the prefix cache."""

    @property
    def num_prefill_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled if not s.is_decode)

    @property
    def num_decode_tokens(self) -> int:
        """Decode tokens, a verify's drafts included."""
        return sum(s.num_new_tokens for s in self.scheduled if s.is_decode)

    @property
    def num_draft_tokens(self) -> int:
        return sum(len(s.spec_token_ids) for s in self.scheduled)

    @property
    def phase(self) -> str:
        p, d = self.num_prefill_tokens, self.num_decode_tokens
        return "mixed" if p and d else "prefill" if p else "decode" if d else "idle"

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


@dataclass(slots=True)
class EngineCoreOutput:
    """One request's part of a step's result once the scheduler has taken it in (vLLM's
    EngineCoreOutput): the tokens it kept and whether the request ended by the stop rule."""
    new_token_ids: list[int]
    """The tokens appended to the request: what the step sampled for it, up to and including
    one that stops it (several where a step proposes several); none for a request that only
    scored its prompt."""
    finish_reason: str | None = None
    """'stop' (a stop token or EOS), 'length' (max_tokens or max_model_len), or None: it goes
    on. The output processor may still end it on a stop string or its grammar."""
