"""Reasoning models' thinking, split from their answer (vLLM's `--reasoning-parser`): the text
between `<think>` and `</think>` becomes the reply's `reasoning_content` (chat) or a reasoning
item (the Responses API), the rest its content. The parsers take the text as it streams, in
pieces cut anywhere (a tag may arrive over several tokens), and never send a tag's characters
to either field: text that may be the start of a tag is held back until it is known.

- `qwen3`: Qwen3 opens the block itself (`<think>` is the first thing it writes) and writes
  none when thinking is off (`enable_thinking: false`: the template closes an empty block in
  the prompt). Output that does not begin with `<think>` is all content.
- `deepseek_r1`: DeepSeek-R1's template opens the block in the prompt, so the output begins
  in reasoning (a `<think>` the model writes anyway is dropped) and everything up to
  `</think>` is reasoning, all of it if the block never closes.
"""
from __future__ import annotations

from ..config import REASONING_PARSERS

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"


def _partial_suffix(text: str, tag: str) -> int:
    """The length of the longest end of `text` that is a proper start of `tag`."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0


class ReasoningParser:
    """One choice's text in, (reasoning, content) pieces out: `feed(text)` as it streams, then
    `finish()` for what was held back. The pieces put together are the whole reply's fields,
    so a stream and a reply cannot disagree."""

    starts_in_reasoning = False

    def __init__(self):
        self.state = "start"
        """start (nothing decided yet), reasoning, or content (the rest is all content)."""
        self.pending = ""

    def feed(self, text: str) -> tuple[str, str]:
        self.pending += text
        reasoning: list[str] = []
        content: list[str] = []
        while self.pending:
            if self.state == "start":
                head = self.pending.lstrip()
                if head.startswith(THINK_OPEN):
                    self.pending = head[len(THINK_OPEN):]
                    self.state = "reasoning"
                elif THINK_OPEN.startswith(head):       # may still become the tag
                    break
                else:
                    self.state = "reasoning" if self.starts_in_reasoning else "content"
            elif self.state == "reasoning":
                at = self.pending.find(THINK_CLOSE)
                if at < 0:
                    keep = _partial_suffix(self.pending, THINK_CLOSE)
                    reasoning.append(self.pending[:len(self.pending) - keep])
                    self.pending = self.pending[len(self.pending) - keep:]
                    break
                reasoning.append(self.pending[:at])
                self.pending = self.pending[at + len(THINK_CLOSE):]
                self.state = "content"
            else:
                content.append(self.pending)
                self.pending = ""
        return "".join(reasoning), "".join(content)

    def finish(self) -> tuple[str, str]:
        """The text still held back: a tag that never completed is text of the field it was
        in (at the start: of the field the parser starts in)."""
        rest, self.pending = self.pending, ""
        if self.state == "reasoning" or self.state == "start" and self.starts_in_reasoning:
            return rest, ""
        return "", rest


class Qwen3ReasoningParser(ReasoningParser):
    starts_in_reasoning = False


class DeepSeekR1ReasoningParser(ReasoningParser):
    starts_in_reasoning = True


def reasoning_parser(name: str) -> type[ReasoningParser]:
    """The parser class vLLM's name stands for."""
    parsers = {"qwen3": Qwen3ReasoningParser, "deepseek_r1": DeepSeekR1ReasoningParser}
    if name not in parsers:
        raise ValueError(f"reasoning_parser: must be one of {', '.join(REASONING_PARSERS)} "
                         f"(got {name!r})")
    return parsers[name]


def split_reasoning(name: str, text: str) -> tuple[str, str]:
    """A whole text's (reasoning, content), as the parser `name` splits it."""
    p = reasoning_parser(name)()
    r, c = p.feed(text)
    r2, c2 = p.finish()
    return r + r2, c + c2
