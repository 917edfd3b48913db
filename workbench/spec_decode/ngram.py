"""Prompt lookup (vLLM's 'ngram' method): draft the tokens that followed the request's own
last n tokens where they occurred before.

For each request: the longest suffix n-gram (prompt_lookup_max down to prompt_lookup_min
tokens) that also occurs earlier in its tokens (prompt and output), at its latest such
occurrence; the draft is the up to k tokens that followed it there. No model runs: it costs
one pass of numpy over the request's tokens, on the host, every step. A request that repeats
its prompt (summaries, extraction, code editing) gets long accepted runs; one whose text
grounds nothing gets no draft, and decodes as it would without speculation.
"""
from __future__ import annotations

import numpy as np


def propose_ngram(tokens: np.ndarray, k: int, n_min: int, n_max: int) -> np.ndarray:
    """The draft for one token sequence (int64 [L]): up to k tokens, maybe none."""
    L = tokens.shape[0]
    if L < n_min + 1 or k < 1:
        return tokens[:0]
    # Candidate occurrences end where the last token occurs earlier (never at L - 1 itself,
    # and always with a token after them).
    ends = np.flatnonzero(tokens[:L - 1] == tokens[L - 1])
    if ends.size == 0:
        return tokens[:0]
    # How far back each candidate matches the suffix, up to n_max.
    length = np.ones(ends.size, dtype=np.int64)
    alive = np.ones(ends.size, dtype=bool)
    for j in range(1, min(n_max, L - 1)):
        ok = alive & (ends - j >= 0)
        ok[ok] = tokens[ends[ok] - j] == tokens[L - 1 - j]
        alive = ok
        if not alive.any():
            break
        length += alive
    best = length.max()
    if best < n_min:
        return tokens[:0]
    end = ends[np.flatnonzero(length == best)[-1]]         # the latest of the longest
    return tokens[end + 1:end + 1 + k]


class NgramProposer:
    """Drafts by prompt lookup (see the module's docstring): a Proposer
    (spec_decode/__init__.py) whose drafts are picked, never drawn."""

    draws = False
    longest_catch_up = 0

    def __init__(self, num_speculative_tokens: int, prompt_lookup_min: int = 1,
                 prompt_lookup_max: int = 4):
        self.k = num_speculative_tokens
        self.n_min = prompt_lookup_min
        self.n_max = prompt_lookup_max
        self.draft_probs: dict = {}

    def propose(self, reqs: list[tuple[str, list[int]]], rows=None,
                shared=None) -> list[list[int]]:
        return [propose_ngram(np.asarray(tokens, dtype=np.int64), self.k, self.n_min,
                              self.n_max).tolist() for _, tokens in reqs]

    def free(self, req_id: str) -> None:
        """Nothing is kept per request."""
