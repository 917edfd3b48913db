"""Speculative decoding's proposers (vLLM's package name): what drafts each request's next
tokens for the target model to verify in one step (issue 40).

A proposer is a `Proposer` (below): prompt lookup (ngram.py) picks its drafts, so their
distribution q is one-hot; the draft model (draft_model.py) draws a sampled request's drafts
and says from what. `make_proposer` builds the one a SpeculativeConfig names. The scheduler makes room for the
drafts, the runner feeds them as a chunk, the rejection sampler (executor/rejection_sampler.py)
keeps what the target agrees with.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

from ..config import SpeculativeConfig
from .ngram import NgramProposer

if TYPE_CHECKING:
    import torch

    from ..executor.sampling_metadata import SamplingRow


class Proposer(Protocol):
    """What SpecDecoding (engine/speculative.py) asks of a proposer."""

    draws: bool
    """propose() draws a sampled request's drafts from a distribution (wants its rows)."""
    draft_probs: dict[str, "torch.Tensor"]
    """The last propose()'s drawn drafts' distributions, request id -> [drafts, vocab]
    fp32, for the rejection sampler; a request not in it had picked (one-hot) drafts."""
    longest_catch_up: int
    """The most tokens the last propose() fed one request through a model before drafting
    (0 without a model): more than about k + 1 was a prefill, not a verify's cost."""

    def propose(self, reqs: list[tuple[str, list[int]]],
                rows: "list[SamplingRow | None] | None" = None,
                shared: "torch.Generator | None" = None) -> list[list[int]]:
        """Up to k drafts for each (request id, every token it has, the newest last).
        rows[i]: request i's sampling where it is sampled and `draws` (else None, or no
        rows: picked drafts); shared: what rows without a generator of their own draw from."""

    def free(self, req_id: str) -> None:
        """Forget a request (it ended or was preempted)."""


def make_proposer(spec: SpeculativeConfig, *, target_vocab_size: int, target_tokenizer=None,
                  device=None, max_model_len: int = 4096, max_num_seqs: int = 64,
                  enable_prefix_caching: bool = True) -> Proposer:
    """The proposer spec names (draft_model: workbench/spec_decode/draft_model.py)."""
    if spec.method == "ngram":
        return NgramProposer(spec.num_speculative_tokens, spec.prompt_lookup_min,
                             spec.prompt_lookup_max)
    from .draft_model import DraftModelProposer
    return DraftModelProposer(spec, target_vocab_size, target_tokenizer, device,
                              spec.num_speculative_tokens, max_model_len, max_num_seqs,
                              enable_prefix_caching)
