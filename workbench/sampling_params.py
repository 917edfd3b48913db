"""SamplingParams: how one request picks its tokens and when it stops (vLLM's names)."""
from __future__ import annotations

from dataclasses import dataclass, field


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
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        self.validate()

    def validate(self) -> None:
        def bad(name, why):
            raise ValueError(f"{name}: {why} (got {getattr(self, name)!r})")

        if isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, int) or self.max_tokens <= 0:
            bad("max_tokens", "must be an integer > 0")
        if not isinstance(self.temperature, (int, float)) or not self.temperature >= 0:
            bad("temperature", "must be >= 0")
        if not isinstance(self.top_k, int) or self.top_k < -1:
            bad("top_k", "must be an integer >= 0 (0 or -1 disables it)")
        if not isinstance(self.top_p, (int, float)) or not 0 < self.top_p <= 1:
            bad("top_p", "must be in (0, 1]")
        if self.seed is not None and not isinstance(self.seed, int):
            bad("seed", "must be an integer or None")
        if not all(isinstance(s, str) and s for s in self.stop):
            bad("stop", "must be non-empty strings")
        if not all(isinstance(t, int) and t >= 0 for t in self.stop_token_ids):
            bad("stop_token_ids", "must be non-negative integers")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0
