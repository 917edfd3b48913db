"""Incremental detokenization: each new token's text, correct across multi-byte characters.

Decoding token by token breaks characters that span tokens (a CJK character or an emoji split
over byte tokens decodes to U+FFFD until its last byte arrives) and loses the spaces that
SentencePiece-style tokenizers attach to a word's first token. So the text of the newest
tokens is decoded together with a few tokens of context before them, and only the part past
that context is new; while it still ends in an incomplete character, it is held back.
"""
from __future__ import annotations

CONTEXT_TOKENS = 5


class IncrementalDetokenizer:
    def __init__(self, tokenizer, prompt_token_ids: list[int], stop: list[str],
                 skip_special_tokens: bool = True, include_stop_str: bool = False):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.include_stop_str = include_stop_str
        self.ids: list[int] = list(prompt_token_ids[-CONTEXT_TOKENS:])
        self.prefix_offset = 0                  # start of the context window in self.ids
        self.read_offset = len(self.ids)        # tokens before this have been turned into text
        self.text = ""                          # all output text so far (stop string cut off)
        self.stop = stop
        self.hold = max((len(s) for s in stop), default=1) - 1
        self.emitted = 0                        # chars of self.text already handed out

    def add(self, token_id: int, check_stop: bool = True) -> str | None:
        """Add one token; returns the stop string if the text now contains one (looked for
        only when `check_stop`: vLLM looks for stop strings once min_tokens are out, and  as
        it does, in the new text and the stop strings' length before it)."""
        if self.tokenizer is None:
            return None
        self.ids.append(token_id)
        decode = self.tokenizer.decode
        skip = self.skip_special_tokens
        prefix = decode(self.ids[self.prefix_offset:self.read_offset], skip_special_tokens=skip)
        full = decode(self.ids[self.prefix_offset:], skip_special_tokens=skip)
        if len(full) > len(prefix) and not full.endswith("\ufffd"):
            search_from = max(len(self.text) - self.hold, 0)
            self.text += full[len(prefix):]
            self.prefix_offset = self.read_offset
            self.read_offset = len(self.ids)
            if not check_stop:
                return None
            found = [(at, s) for s in self.stop if (at := self.text.find(s, search_from)) >= 0]
            if found:
                at, s = min(found)      # the earliest match, whichever stop string it is
                self.text = self.text[:at + len(s) if self.include_stop_str else at]
                return s
        return None

    def take(self, final: bool) -> str:
        """Text not handed out yet. Until the request ends, a tail that could still become a
        stop string is kept back."""
        end = len(self.text) if final else max(len(self.text) - self.hold, self.emitted)
        delta = self.text[self.emitted:end]
        self.emitted = end
        return delta
