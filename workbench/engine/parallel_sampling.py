"""n > 1: one prompt, n sampled choices (vLLM's ParentRequest, here owning its children).

The first choice computes the prompt alone. Its first token is sampled once per choice from
the same logits row (`sampling_rows`); then the other choices fork its KV blocks
(Scheduler.fork, so the prompt is computed once) and run as sequences of their own, named
'<id>#<i>'. The request ends when every choice has; a first choice that ends before its
prompt is computed (an abort) ends the others with it, as they never started.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from ..core.sequence import SequenceStatus

if TYPE_CHECKING:
    from .request import Request


class ParentRequest:
    __slots__ = ("choices", "forked", "num_unfinished")

    def __init__(self, choices: list[Request]):
        self.choices = choices
        """All n choices, the first (the caller's request) first."""
        self.forked = False
        """The other choices have started on the first one's blocks."""
        self.num_unfinished = len(choices)
        for c in choices:
            c.parent = self

    def started(self) -> list[Request]:
        """The choices the scheduler holds: the first, and the others once forked."""
        return self.choices if self.forked else self.choices[:1]

    def fork(self) -> list[Request]:
        """The first choice's prompt is computed: the others start now (the pipeline puts
        them on its blocks with Scheduler.fork; they stream to its listener). Returns them."""
        first, others = self.choices[0], self.choices[1:]
        self.forked = True
        for c in others:
            c.listener = first.listener
        return others

    def end(self, r: Request) -> list[Request]:
        """Choice r has ended: the choices that end with it (itself, and the unstarted ones
        when it is the first), counted off."""
        ended = [r]
        if r is self.choices[0] and not self.forked:
            for c in self.choices[1:]:
                c.seq.status, c.seq.finish_reason = SequenceStatus.FINISHED, r.seq.finish_reason
                c.listener = r.listener
                ended.append(c)
        self.num_unfinished -= len(ended)
        return ended

    @staticmethod
    def sampling_rows(reqs: list[Request]) -> tuple[list[int] | None, list[Request]]:
        """The logits rows to sample for one step's requests, and whose: a first choice whose
        others have not started samples one token per choice from its row. (None, reqs)
        when every request samples its own row once."""
        if not any(r.parent is not None and not r.parent.forked for r in reqs):
            return None, reqs
        rows, out = [], []
        for i, r in enumerate(reqs):
            for c in (r.parent.choices if r.parent is not None and not r.parent.forked else [r]):
                rows.append(i)
                out.append(c)
        return rows, out
