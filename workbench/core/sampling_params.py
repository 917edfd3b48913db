"""SamplingParams: how one request picks its tokens and when it stops (vLLM's names)."""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import Any

from ..config import field_checker

SAMPLING_EPS = 1e-5
"""Temperatures below this are treated as greedy (as vLLM does): dividing logits by a
vanishing temperature overflows."""
FLOAT32_MAX = 3.4028234663852886e38
"""The largest number the sampler's float32 tensors hold: a float field beyond it (or an
integer too large for any float) is refused, not converted into inf or an overflow."""
MAX_LOGPROBS = 20
"""Most alternatives per position that logprobs / prompt_logprobs may ask for (OpenAI's cap)."""


@dataclass
class StructuredOutputsParams:
    """Constrain a request's output to a grammar (vLLM's names). Exactly one of the fields is
    set. The grammar is compiled once, when the request is made (Engine.make_request, which
    add_request calls), so a schema, regex or grammar the grammar engine refuses is a
    ValueError naming the field then."""
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
    n: int = 1
    """Sequences generated from the prompt; they share its KV blocks (a fork after prefill)."""
    max_tokens: int | None = 128
    """0 only makes sense with prompt_logprobs: the prompt is scored, nothing is generated.
    None: as many as fit after the prompt in max_model_len (vLLM's; the front door decides
    it when it makes the request)."""
    min_tokens: int = 0
    """EOS and stop_token_ids cannot end the output before this many tokens."""
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
    include_stop_str_in_output: bool = False
    """Keep the stop string (or the text of the stop token) at the end of the output."""
    skip_special_tokens: bool = True
    """Leave special tokens out of the output text."""
    presence_penalty: float = 0.0
    """Subtracted from the logit of every token already in the output (-2..2)."""
    frequency_penalty: float = 0.0
    """Subtracted once per occurrence in the output (-2..2)."""
    repetition_penalty: float = 1.0
    """Logits of tokens in the prompt or output are divided by it (multiplied when negative)."""
    min_p: float = 0.0
    """Drop tokens whose probability is below min_p times the top token's."""
    logit_bias: dict[int, float] | None = None
    """Token id -> value added to its logit (-100..100) before sampling."""
    logprobs: int | None = None
    """Return each sampled token's logprob plus this many top alternatives (0..20), taken
    from the model's raw distribution (before penalties and temperature, as vLLM does)."""
    prompt_logprobs: int | None = None
    """Return the logprob of each prompt token plus this many top alternatives (0..20). Such
    a request computes its whole prompt (no prefix-cache hits: every position's logits)."""
    structured_outputs: StructuredOutputsParams | None = None
    """Constrain the output to a JSON schema, a regex, a choice or a grammar."""
    truncate_prompt_tokens: int | None = None
    """Keep only the prompt's last k tokens (-1: as many as max_model_len allows)."""

    def __post_init__(self) -> None:
        """Values as a JSON body gives them (a string or null for `stop`, string keys for
        logit_bias) made the fields' own types, then checked: a SamplingParams is checked
        once, when it is made (call validate() after changing a field)."""
        stop = self.stop if self.stop is not None else []
        stop = [stop] if isinstance(stop, str) else stop
        if not (isinstance(stop, (list, tuple)) and all(isinstance(s, str) for s in stop)):
            raise ValueError(f"stop: must be a string or a list of strings (got {self.stop!r})")
        self.stop = list(stop)
        ids = [] if self.stop_token_ids is None else self.stop_token_ids
        if not (isinstance(ids, (list, tuple))
                and all(isinstance(t, int) and not isinstance(t, bool) for t in ids)):
            raise ValueError(f"stop_token_ids: must be a list of integers (got {ids!r})")
        self.stop_token_ids = list(ids)
        if isinstance(self.logit_bias, dict):   # JSON objects have string keys
            try:
                self.logit_bias = {int(k): v for k, v in self.logit_bias.items()} or None
            except (TypeError, ValueError):
                raise ValueError(f"logit_bias: keys must be token ids (got {self.logit_bias!r})") from None
        self.validate()

    def validate(self) -> None:
        bad = field_checker(self)

        def is_int(v):       # and fits the int64 the device holds it in
            return isinstance(v, int) and not isinstance(v, bool) and -2**63 <= v < 2**63

        def is_num(v):       # a real number the device's float32 holds (no inf, no nan)
            if not isinstance(v, (int, float)) or isinstance(v, bool):
                return False
            try:
                return math.isfinite(v) and abs(float(v)) <= FLOAT32_MAX
            except OverflowError:       # an int beyond any float
                return False

        if not is_int(self.n) or not 1 <= self.n <= 128:
            bad("n", "must be an integer in [1, 128]")
        if self.max_tokens is not None and (not is_int(self.max_tokens) or self.max_tokens < 0):
            bad("max_tokens", "must be a 64-bit integer >= 0")
        if self.max_tokens == 0 and self.prompt_logprobs is None:
            bad("max_tokens", "must be > 0 (0 is only for scoring a prompt with prompt_logprobs)")
        if self.max_tokens == 0 and self.n != 1:
            bad("n", "must be 1 when max_tokens is 0")
        if not is_int(self.min_tokens) or not 0 <= self.min_tokens <= (
                self.max_tokens if self.max_tokens is not None else 2**63):
            bad("min_tokens", "must be an integer in [0, max_tokens]")
        if not is_num(self.temperature) or not self.temperature >= 0:
            bad("temperature", "must be a finite number >= 0")
        if not is_int(self.top_k) or self.top_k < -1:
            bad("top_k", "must be a 64-bit integer >= 0 (0 or -1 disables it)")
        if not is_num(self.top_p) or not 0 < self.top_p <= 1:
            bad("top_p", "must be in (0, 1]")
        if self.seed is not None and not is_int(self.seed):
            bad("seed", "must be a 64-bit integer or None")
        if not all(isinstance(s, str) and s for s in self.stop):
            bad("stop", "must be non-empty strings")
        if not all(is_int(t) and t >= 0 for t in self.stop_token_ids):
            bad("stop_token_ids", "must be non-negative 64-bit integers")
        for name in ("ignore_eos", "include_stop_str_in_output", "skip_special_tokens"):
            if not isinstance(getattr(self, name), bool):
                bad(name, "must be true or false")
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            if not is_num(v) or not -2 <= v <= 2:
                bad(name, "must be a number in [-2, 2]")
        if not is_num(self.repetition_penalty) or not 0 < self.repetition_penalty <= 100:
            bad("repetition_penalty", "must be a number in (0, 100]")
        if not is_num(self.min_p) or not 0 <= self.min_p <= 1:
            bad("min_p", "must be in [0, 1]")
        if self.logit_bias is not None:
            if not isinstance(self.logit_bias, dict) or not all(
                    is_int(k) and k >= 0 and is_num(v) and -100 <= v <= 100
                    for k, v in self.logit_bias.items()):
                bad("logit_bias", "must map token ids to numbers in [-100, 100]")
        for name in ("logprobs", "prompt_logprobs"):
            v = getattr(self, name)
            if v is not None and (not is_int(v) or not 0 <= v <= MAX_LOGPROBS):
                bad(name, f"must be an integer in [0, {MAX_LOGPROBS}] or None")
        tpt = self.truncate_prompt_tokens
        if tpt is not None and (not is_int(tpt) or not (tpt >= 1 or tpt == -1)):
            bad("truncate_prompt_tokens", "must be an integer >= 1, or -1 (max_model_len)")
        if not isinstance(self.structured_outputs, (StructuredOutputsParams, type(None))):
            bad("structured_outputs", "must be StructuredOutputsParams or None")

    @property
    def greedy(self) -> bool:
        return self.temperature < SAMPLING_EPS

    @property
    def has_penalties(self) -> bool:
        """Needs the tokens seen so far (so the sampler needs the history)."""
        return (self.presence_penalty != 0 or self.frequency_penalty != 0
                or self.repetition_penalty != 1)

    @property
    def needs_processing(self) -> bool:
        """Anything between the raw logits and temperature (a logits processor)."""
        return self.has_penalties or bool(self.logit_bias) or self.min_tokens > 0
