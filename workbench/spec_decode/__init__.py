"""Speculative decoding's proposers (vLLM's package name): what drafts each request's next
tokens for the target model to verify in one step (issue 40).

A proposer is any object with `propose(reqs) -> drafts` (reqs: (request id, every token the
request has, the newest last); drafts: up to k token ids each, picked, so the draft
distribution q is one-hot) and `free(req_id)` (the request ended or was preempted). One
that draws a sampled request's drafts (the draft model) also takes each request's
SamplingRow and a shared generator, `propose(reqs, rows, shared)`, and keeps the
distributions it drew from in `draft_probs` (request id -> [drafts, vocab]) for the
rejection sampler.
`make_proposer` builds the one a SpeculativeConfig names. The scheduler makes room for the
drafts, the runner feeds them as a chunk, the rejection sampler (executor/rejection_sampler.py)
keeps what the target agrees with.
"""
from __future__ import annotations

from ..config import SpeculativeConfig
from .ngram import NgramProposer


def make_proposer(spec: SpeculativeConfig, *, target_vocab_size: int, target_tokenizer=None,
                  device=None, max_model_len: int = 4096, max_num_seqs: int = 64,
                  enable_prefix_caching: bool = True):
    """The proposer spec names (draft_model: workbench/spec_decode/draft_model.py)."""
    if spec.method == "ngram":
        return NgramProposer(spec.num_speculative_tokens, spec.prompt_lookup_min,
                             spec.prompt_lookup_max)
    from .draft_model import DraftModelProposer
    return DraftModelProposer(spec, target_vocab_size, target_tokenizer, device,
                              spec.num_speculative_tokens, max_model_len, max_num_seqs,
                              enable_prefix_caching)
