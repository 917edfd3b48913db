"""The prompt sets speculative decoding is measured on (issue 40), built from what ships with
the workbench, nothing downloaded, the same for a seed.

- grounded: a passage of 300-600 tokens (a stretch of the workbench's own source, or of its
  README and docs where the checkout has them) with an instruction to copy, edit, extract from
  or summarise it. The answer repeats much of the prompt, which is what prompt lookup (n-gram)
  proposals feed on; editing code is the classic case.
- open-ended: chat requests that ground nothing (stories, advice, explanations): proposals can
  only come from a draft model's guess of the target's words.

Each prompt is a list of chat messages (OpenAI's shape); `prompt_token_ids` renders one with
a tokenizer's chat template.
"""
from __future__ import annotations

import keyword
import random
import re
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1]
"""The workbench package: its own sources are the code passages."""
CHECKOUT = PACKAGE.parent
"""The repository, where the package runs from one (README.md and docs/ are prose passages)."""

GROUNDED_TASKS = ("copy", "edit", "extract", "summarise")

CODE_INSTRUCTIONS = {
    "copy": "Repeat the following Python code exactly as it is, without any change or comment.",
    "edit": "In the following Python code, rename `{old}` to `{new}` everywhere it appears. "
            "Answer with the whole edited code and nothing else.",
    "extract": "List every function, method and class name that the following Python code "
               "defines or calls, one per line, in the order they first appear.",
    "summarise": "Summarise what the following Python code does in three or four sentences.",
}
PROSE_INSTRUCTIONS = {
    "copy": "Repeat the following text word for word.",
    "edit": "Rewrite the following text with `{old}` replaced by `{new}` everywhere; keep "
            "everything else exactly as it is.",
    "extract": "List every name, number and technical term in the following text, one per line.",
    "summarise": "Summarise the following text in three or four sentences.",
}

TOPICS = ("a lighthouse keeper who finds a message in a bottle", "learning to cook for the "
          "first time", "a city on Mars a hundred years from now", "moving to a new country",
          "keeping a garden through a dry summer", "the first day at a new job", "a dog that "
          "cannot stop barking at the moon", "training for a first marathon", "an old library "
          "that is about to close", "friendship between two very different neighbours",
          "saving money on a small income", "a storm at sea", "learning a musical instrument "
          "as an adult", "a robot that wants to become a painter", "staying focused while "
          "working from home", "a family recipe passed down for generations", "climbing a "
          "mountain in winter", "the history of tea", "starting a small bakery",
          "what makes a good teacher", "a trip on a night train", "growing old gracefully",
          "a village festival", "choosing a first car", "the life of a honeybee",
          "living without a smartphone for a month", "a detective who is afraid of the dark",
          "how to make a hard decision", "a summer spent on a farm", "the joy of reading")
STYLES = ("Write a short story about {t}.", "Write a poem about {t}.",
          "What advice would you give someone about {t}?", "Tell me your thoughts on {t}.",
          "Describe {t} as vividly as you can.", "Write a friendly letter about {t}.",
          "What are the good and the bad sides of {t}?",
          "Explain {t} to a ten-year-old.")


@dataclass(frozen=True, slots=True)
class SpecPrompt:
    kind: str
    """'grounded' or 'open-ended'."""
    task: str
    """What it asks: 'copy', 'edit', 'extract', 'summarise' (grounded) or 'chat'."""
    messages: list[dict]
    """The chat request: one user message."""
    source: str | None = None
    """Where a grounded prompt's passage comes from (a path under the repository)."""
    passage: str | None = None


def _sources() -> list[tuple[Path, bool]]:
    """(file, is_code): the package's Python sources, then the checkout's prose, if any."""
    code = sorted(p for p in PACKAGE.rglob("*.py") if "csrc" not in p.parts)
    prose = [CHECKOUT / "README.md", *sorted((CHECKOUT / "docs").glob("*.md"))]
    return [(p, True) for p in code] + [(p, False) for p in prose if p.is_file()]


def _count(tokenizer):
    if tokenizer is None:            # about four characters a token, as English text goes
        return lambda text: max(1, len(text) // 4)
    return lambda text: len(tokenizer.encode(text, add_special_tokens=False))


def _units(text: str, is_code: bool) -> list[str]:
    """A file in pieces a passage starts and ends on, separators kept: lines of code;
    sentences and lines of prose (a Markdown paragraph is one long line)."""
    return text.splitlines(keepends=True) if is_code else \
        [u for u in re.split(r"(?<=\n)|(?<=[.!?] )", text) if u]


def _passage(units: list[str], rng: random.Random, count, lo: int, hi: int) -> str | None:
    """Whole units from a random start, lo to hi tokens of them; None where the file has too
    few tokens from there."""
    start = rng.randrange(len(units))
    want = rng.randint(lo, hi)
    taken: list[str] = []
    total = 0
    for unit in units[start:]:
        n = count(unit)
        if total + n > want:
            break
        taken.append(unit)
        total += n
    text = "".join(taken).strip("\n")
    return text if lo <= count(text) <= hi else None


def _rename(text: str, rng: random.Random) -> tuple[str, str]:
    """An identifier (or word) used several times in the passage, and a new name for it."""
    words = [w for w in re.findall(r"\b[A-Za-z_][A-Za-z0-9_]{3,}\b", text)
             if not keyword.iskeyword(w)]
    common = [w for w, c in Counter(words).most_common(8) if c >= 2] or words[:1] or ["self"]
    old = rng.choice(common)
    return old, (old + "_v2" if "_" in old or old.islower() else old + "Two")


def grounded_prompts(n: int, seed: int = 0, tokenizer=None, lo: int = 300,
                     hi: int = 600) -> list[SpecPrompt]:
    """n grounded prompts, tasks in turn (copy, edit, extract, summarise), passages of lo to
    hi tokens by `tokenizer` (None: about four characters a token)."""
    rng = random.Random(seed)
    count = _count(tokenizer)
    sources = _sources()
    texts: dict[Path, list[str]] = {}
    out: list[SpecPrompt] = []
    tries = 0
    while len(out) < n:
        tries += 1
        if tries > 200 * (n + 1):
            raise ValueError(f"grounded_prompts: found no passage of {lo}-{hi} tokens")
        # Two in three from the code (where the checkout has prose at all).
        code = rng.random() < 2 / 3
        pool = [s for s in sources if s[1] == code] or sources
        path, is_code = rng.choice(pool)
        if path not in texts:
            texts[path] = _units(path.read_text(encoding="utf-8", errors="replace"), is_code)
        if not texts[path]:
            continue
        passage = _passage(texts[path], rng, count, lo, hi)
        if passage is None:
            continue
        task = GROUNDED_TASKS[len(out) % len(GROUNDED_TASKS)]
        old, new = _rename(passage, rng)
        instruction = (CODE_INSTRUCTIONS if is_code else PROSE_INSTRUCTIONS)[task].format(
            old=old, new=new)
        fence = "```python\n{}\n```" if is_code else "\"\"\"\n{}\n\"\"\""
        content = f"{instruction}\n\n{fence.format(passage)}"
        out.append(SpecPrompt("grounded", task, [{"role": "user", "content": content}],
                              str(path.relative_to(CHECKOUT)), passage))
    return out


def open_ended_prompts(n: int, seed: int = 0) -> list[SpecPrompt]:
    """n chat requests that ground nothing, drawn from topics and styles without repeats
    (while the 240 pairs last)."""
    rng = random.Random(seed)
    pairs = [(s, t) for s in STYLES for t in TOPICS]
    rng.shuffle(pairs)
    return [SpecPrompt("open-ended", "chat",
                       [{"role": "user", "content": s.format(t=t)}])
            for s, t in (pairs[i % len(pairs)] for i in range(n))]


def spec_prompts(kind: str, n: int, seed: int = 0, tokenizer=None) -> list[SpecPrompt]:
    """The prompt set by name: 'grounded' or 'open-ended' ('open')."""
    if kind == "grounded":
        return grounded_prompts(n, seed, tokenizer)
    if kind in ("open-ended", "open"):
        return open_ended_prompts(n, seed)
    raise ValueError(f"kind: 'grounded' or 'open-ended' (got {kind!r})")


def workload(kind: str, tokenizer, n: int, seed: int = 0) -> list[list[dict]]:
    """The chat requests alone (each a list of messages), as a benchmark sends them."""
    return [p.messages for p in spec_prompts(kind, n, seed, tokenizer)]


def prompt_token_ids(tokenizer, prompt: SpecPrompt) -> list[int]:
    """The prompt as the model reads it: its messages through the tokenizer's chat template,
    the assistant's turn opened."""
    text = tokenizer.apply_chat_template(prompt.messages, add_generation_prompt=True,
                                         tokenize=False)
    return tokenizer.encode(text, add_special_tokens=False)
