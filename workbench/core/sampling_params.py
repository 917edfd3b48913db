"""SamplingParams: how one request picks its tokens and when it stops (vLLM's names)."""
from __future__ import annotations

from dataclasses import dataclass, field

SAMPLING_EPS = 1e-5
"""Temperatures below this are treated as greedy (as vLLM does): dividing logits by a
vanishing temperature overflows."""


@dataclass
class SamplingParams:
    max_tokens: int = 128
    temperature: float = 1.0
    """0 is greedy."""
    top_k: int = 0
    """0 (or -1) keeps every token."""
    top_p: float = 1.0
    seed: int | None = None
    """Per-request seed: the same seed and prompt give the same tokens, whatever else runs."""
    stop: list[str] = field(default_factory=list)
    """Strings that end the output; the stop string itself is not returned."""
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if self.stop is None:
            self.stop = []
        if self.stop_token_ids is None:
            self.stop_token_ids = []
        if not isinstance(self.stop, (list, tuple)):
            raise ValueError(f"stop: must be a string or a list of strings (got {self.stop!r})")
        if not isinstance(self.stop_token_ids, (list, tuple)):
            raise ValueError(f"stop_token_ids: must be a list of token ids (got {self.stop_token_ids!r})")
        self.stop = list(self.stop)
        self.stop_token_ids = list(self.stop_token_ids)
        self.validate()

    def validate(self) -> None:
        def bad(name, why):
            raise ValueError(f"{name}: {why} (got {getattr(self, name)!r})")

        def is_int(v):
            return isinstance(v, int) and not isinstance(v, bool)

        def is_num(v):
            return isinstance(v, (int, float)) and not isinstance(v, bool)

        if not is_int(self.max_tokens) or self.max_tokens <= 0:
            bad("max_tokens", "must be an integer > 0")
        if not is_num(self.temperature) or not self.temperature >= 0 or self.temperature == float("inf"):
            bad("temperature", "must be a finite number >= 0")
        if not is_int(self.top_k) or self.top_k < -1:
            bad("top_k", "must be an integer >= 0 (0 or -1 disables it)")
        if not is_num(self.top_p) or not 0 < self.top_p <= 1:
            bad("top_p", "must be in (0, 1]")
        if self.seed is not None and (not is_int(self.seed) or not -2**63 <= self.seed < 2**63):
            bad("seed", "must be a 64-bit integer or None")
        if not all(isinstance(s, str) and s for s in self.stop):
            bad("stop", "must be non-empty strings")
        if not all(is_int(t) and t >= 0 for t in self.stop_token_ids):
            bad("stop_token_ids", "must be non-negative integers")
        if not isinstance(self.ignore_eos, bool):
            bad("ignore_eos", "must be true or false")

    @property
    def greedy(self) -> bool:
        return self.temperature < SAMPLING_EPS
