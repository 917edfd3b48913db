"""SamplingParams: how one request picks its tokens and when it stops (vLLM's names)."""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from ..config import field_checker

SAMPLING_EPS = 1e-5
"""Temperatures below this are treated as greedy (as vLLM does): dividing logits by a
vanishing temperature overflows."""


@dataclass
class StructuredOutputsParams:
    """Constrain a request's output to a grammar (vLLM's names). Exactly one of the fields is
    set. The grammar is compiled when the request is added (Engine.add_request), so a schema,
    regex or grammar the grammar engine refuses is a ValueError naming the field then."""
    json: dict | str | None = None
    """A JSON schema (a dict or its JSON text); the output is one JSON value it accepts."""
    regex: str | None = None
    choice: list[str] | None = None
    """The output is exactly one of these strings."""
    grammar: str | None = None
    """A Lark grammar (llguidance's dialect; a start rule `start`), or GBNF (`root ::= ...`)."""
    json_object: bool | None = None
    """Any JSON object (OpenAI's response_format {"type": "json_object"})."""

    def __post_init__(self) -> None:
        set_ = [k for k in self.KINDS if getattr(self, k) not in (None, False)]
        if len(set_) != 1:
            raise ValueError("structured_outputs: set exactly one of json, regex, choice, grammar, "
                             f"json_object (got {', '.join(set_) or 'none'})")
        kind = set_[0]
        v = getattr(self, kind)
        where = f"structured_outputs.{kind}"
        if kind == "json":
            if isinstance(v, str):
                try:
                    v = json.loads(v)
                except ValueError as e:
                    raise ValueError(f"{where}: not valid JSON ({e})") from None
            if not isinstance(v, (dict, bool)):
                raise ValueError(f"{where}: must be a JSON schema object (got {type(v).__name__})")
            self.json = v
        elif kind in ("regex", "grammar"):
            if not isinstance(v, str) or not v:
                raise ValueError(f"{where}: must be a non-empty string (got {v!r})")
        elif kind == "choice":
            if (not isinstance(v, (list, tuple)) or not v
                    or not all(isinstance(c, str) and c for c in v)):
                raise ValueError(f"{where}: must be a non-empty list of non-empty strings "
                                 f"(got {v!r})")
            self.choice = list(v)
        elif v is not True:
            raise ValueError(f"{where}: must be true (got {v!r})")

    KINDS = ("json", "regex", "choice", "grammar", "json_object")

    @property
    def kind(self) -> str:
        return next(k for k in self.KINDS if getattr(self, k) not in (None, False))

    @property
    def value(self) -> Any:
        return getattr(self, self.kind)


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
    structured_outputs: StructuredOutputsParams | None = None
    """Constrain the output to a JSON schema, a regex, a choice or a grammar."""
    truncate_prompt_tokens: int | None = None
    """Keep only the prompt's last k tokens (-1: as many as max_model_len allows)."""

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
        bad = field_checker(self)

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
        tpt = self.truncate_prompt_tokens
        if tpt is not None and (not is_int(tpt) or not (tpt >= 1 or tpt == -1)):
            bad("truncate_prompt_tokens", "must be an integer >= 1, or -1 (max_model_len)")
        if not isinstance(self.structured_outputs, (StructuredOutputsParams, type(None))):
            bad("structured_outputs", "must be StructuredOutputsParams or None")

    @property
    def greedy(self) -> bool:
        return self.temperature < SAMPLING_EPS
