"""Structured output: requests' grammars and the step's token bitmask (vLLM's
StructuredOutputManager, with llguidance as the grammar engine).

llguidance was chosen by measurement (docs/benchmarks.md, benchmarks/structured_output.py):
with the smollm2 tokenizer it compiles a JSON schema in about a millisecond and fills a
16-row bitmask in 0.7 ms a step, against xgrammar's 3.4 ms and outlines-core's 1.3 ms
(outlines-core also takes 25-150 ms to compile each schema), and its wheel has no
dependencies. It is imported when the first request with a grammar arrives; its torch helpers
(which torch.compile their mask kernel on first use, 2.6 s) are not used: the sampler applies
the mask itself (sampler.apply_token_bitmask).

A grammar is a matcher object per request: it is compiled when the request is added (so a
bad schema is a ValueError before anything is queued), fills its row of the bitmask before
each sampling step, and consumes each token the request gets. The mask for step N+1 depends on
the token of step N, so these requests never run ahead (engine/pipeline.py's
may_run_ahead).
"""
from __future__ import annotations

import json
import threading
from collections import OrderedDict
from typing import Any

import torch

from .sampling_params import StructuredOutputsParams

CACHE_SIZE = 64
"""Compiled grammars kept (least recently used out): a request checked by the server and then
added compiles once, and clients that send the same schema again do not wait for it."""

JSON_OPTIONS = {"whitespace_flexible": False}
"""Compact JSON (no free-form whitespace between tokens): a sampling model cannot wander off
into spaces and newlines until max_tokens, and the output is what json.dumps would write."""


class StructuredOutputManager:
    """Compiles grammars for one tokenizer and fills the step's bitmask for all constrained
    rows at once (llguidance computes the rows in parallel, in native threads)."""

    def __init__(self, tokenizer: Any, vocab_size: int):
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.words = (vocab_size + 31) // 32
        """int32 words per bitmask row: bit j of word w allows token 32 * w + j."""
        self._lock = threading.Lock()
        self._lltok = None
        self._executor = None
        self._bitmask = torch.empty(0, self.words, dtype=torch.int32)
        self._cache: OrderedDict[tuple[str, str], Any] = OrderedDict()

    def _llguidance(self):
        try:
            import llguidance
            import llguidance.hf
        except ImportError:
            raise ValueError("structured_outputs: needs the llguidance package "
                             "(pip install 'workbench[structured]')") from None
        with self._lock:
            if self._lltok is None:
                if self.tokenizer is None:
                    raise ValueError("structured_outputs: this model has no tokenizer")
                self._lltok = llguidance.hf.from_tokenizer(self.tokenizer, n_vocab=self.vocab_size)
                self._executor = llguidance.LLExecutor(num_threads=2)
            return llguidance, self._lltok

    def compile(self, so: StructuredOutputsParams):
        """A fresh matcher for one request; ValueError naming the field if the grammar engine
        refuses the schema, regex or grammar."""
        llg, lltok = self._llguidance()
        kind, value = so.kind, so.value
        key = (kind, json.dumps(value, sort_keys=True))
        with self._lock:
            if key in self._cache:
                self._cache.move_to_end(key)
                return self._cache[key].deep_copy()   # a fresh matcher at the grammar's start
        matcher = self._compile(llg, lltok, kind, value)
        with self._lock:
            self._cache[key] = matcher
            if len(self._cache) > CACHE_SIZE:
                self._cache.popitem(last=False)
        return matcher.deep_copy()

    @staticmethod
    def _compile(llg, lltok, kind: str, value: Any):
        where = f"structured_outputs.{kind}"
        try:
            if kind == "json":
                grammar = llg.LLMatcher.grammar_from_json_schema(value, defaults=JSON_OPTIONS)
            elif kind == "json_object":
                grammar = llg.LLMatcher.grammar_from_json_schema({"type": "object"},
                                                                 defaults=JSON_OPTIONS)
            elif kind == "regex":
                # \d means the ASCII digits, as users expect (Rust's default is any Unicode digit).
                grammar = llg.LLMatcher.grammar_from_regex(llg.regex_to_lark(value, "d"))
            elif kind == "choice":
                grammar = llg.LLMatcher.grammar_from_lark(
                    "start: " + " | ".join(json.dumps(c) for c in value))
            else:
                grammar = llg.grammar_from("grammar", value)   # Lark, or GBNF converted to it
        except ValueError as e:
            raise ValueError(f"{where}: {e}") from None
        matcher = llg.LLMatcher(lltok, grammar, log_level=0)
        if matcher.is_error():
            raise ValueError(f"{where}: {matcher.get_error()}")
        return matcher

    def grammar_bitmask(self, matchers: list) -> torch.Tensor:
        """[len(matchers), words] int32 on the host: the tokens each matcher allows next,
        filled in one call for all rows. The buffer is reused; read it before the next call."""
        n = len(matchers)
        if self._bitmask.shape[0] < n:
            self._bitmask = torch.empty(max(n, 2 * self._bitmask.shape[0]), self.words,
                                        dtype=torch.int32)
        out = self._bitmask[:n]
        self._executor.unsafe_compute_mask_ptr([(m, i) for i, m in enumerate(matchers)],
                                               out.data_ptr(), self.words * 4, n)
        return out
