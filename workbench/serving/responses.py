"""Responses out: what a validated request (`ServedRequest`) has produced, choice by choice,
in OpenAI's shapes: streamed chunks, whole replies, usage and logprobs (with vLLM's
additions: stop_reason, prompt_logprobs, continuous usage). No engine and no transport here:
handler.py feeds engine events in, app.py sends the dicts out."""
from __future__ import annotations

import json
import time
from typing import TYPE_CHECKING, Callable

from ..core.sampling_params import SamplingParams
from .reasoning import ReasoningParser
from .tool_parsers import ToolCallParser, assemble, valid_calls
from .tools import ToolChoice

if TYPE_CHECKING:
    from ..engine.request import Request

LOGPROB_FLOOR = -9999.0
"""What a -inf logprob (a token the grammar or a bias rules out) is sent as: JSON has no
infinity, and vLLM sends this."""


def _lp(x: float) -> float:
    return x if x > LOGPROB_FLOOR else LOGPROB_FLOOR


def dumps(obj) -> str:
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":"))


class ServedRequest:
    """One validated request, ready to run: one engine request per prompt (a batched
    completion has several), each with n choices; choice index = prompt index * n + i."""

    def __init__(self, kind: str, rid: str, requests: list["Request"], params: SamplingParams,
                 stream: bool, include_usage: bool, continuous_usage: bool,
                 echoes: list[str | None], vllm_prompt_logprobs: bool,
                 tools: ToolChoice | None, ignored: list[str],
                 reasoning: type[ReasoningParser] | None = None):
        self.kind, self.rid, self.params = kind, rid, params
        self.requests = requests
        """One engine request per prompt, made (checked, tokenized, its grammar compiled) and
        not yet queued: Engine.astream queues each."""
        self.prompts = [r.seq.prompt_token_ids for r in requests]
        """Each prompt's token ids."""
        self.stream, self.include_usage = stream, include_usage
        self.continuous_usage = continuous_usage
        """stream_options.continuous_usage_stats: usage (so far) on every chunk."""
        self.echoes = echoes
        """Completions with echo: each prompt's text, returned before its output."""
        self.vllm_prompt_logprobs = vllm_prompt_logprobs
        """The body asked for vLLM's `prompt_logprobs` field by name."""
        self.tools = tools
        self.reasoning = reasoning
        """Chat with --reasoning-parser: the parser that splits thinking from the answer."""
        self.ignored = ignored
        """Fields (and message keys) the request sent that this server does not know."""
        self.created = int(time.time())
        self.object = "chat.completion" if kind == "chat" else "text_completion"

    def choices(self) -> list["Choice"]:
        n = self.params.n
        return [Choice(i // n, self.tools.parser() if self.tools is not None else None,
                       self.reasoning() if self.reasoning is not None else None)
                for i in range(len(self.prompts) * n)]


class Choice:
    """What one choice has produced so far."""

    def __init__(self, prompt: int, parser: ToolCallParser | None,
                 reasoner: ReasoningParser | None = None):
        self.prompt = prompt
        """Which of the request's prompts it answers."""
        self.texts: list[str] = []
        self.n_out = 0
        self.finish: str | None = None
        self.stop_reason: int | str | None = None
        self.logprobs: list = []
        """(token id, {id: Logprob}) per output token, when asked."""
        self.offset = 0
        """Characters returned so far (completions' text_offset)."""
        self.reasoner = reasoner
        """With a reasoning parser: splits the thinking off first."""
        self.parser = parser
        """With tools: turns the answer into content and tool_call deltas."""
        self.reasoning: list[str] = []
        self.n_reasoning = 0
        """Pieces of text fed (tokens) while thinking."""
        self.answer: list[str] = []
        """The text after the reasoning split (what the tool parser reads)."""
        self.content: list[str] = []
        self.tool_deltas: list[dict] = []

    def parse(self, text: str, final: bool) -> tuple[str, str, list[dict]]:
        """The reasoning, content and tool_call deltas of new text (without a reasoning
        parser or tools: "", the text itself, [])."""
        reasoning = ""
        if self.reasoner is not None:
            before = self.reasoner.state
            reasoning, text = self.reasoner.feed(text)
            if "reasoning" in (before, self.reasoner.state):
                self.n_reasoning += 1   # a token of the thinking (its tags included)
            if final:
                more_r, more_t = self.reasoner.finish()
                reasoning, text = reasoning + more_r, text + more_t
            self.reasoning.append(reasoning)
        self.answer.append(text)
        content, deltas = text, []
        if self.parser is not None:
            content, deltas = self.parser.feed(text)
            if final:
                more, rest = self.parser.finish()
                content, deltas = content + more, deltas + rest
        self.content.append(content)
        self.tool_deltas += deltas
        return reasoning, content, deltas


class ResponseWriter:
    """OpenAI's response objects for the served model; `token_text` spells one token (the
    tokenizer's, or `token_id:N` for a model without one)."""

    def __init__(self, served: str, token_text: Callable[[int], str]):
        self.served = served
        self.token_text = token_text

    def usage(self, req: ServedRequest, n_out: int, choices: list["Choice"] = ()) -> dict:
        """With a reasoning parser, OpenAI's completion_tokens_details.reasoning_tokens too."""
        n_in = sum(len(x) for x in req.prompts)
        out = {"prompt_tokens": n_in, "completion_tokens": n_out, "total_tokens": n_in + n_out}
        if req.reasoning is not None:
            out["completion_tokens_details"] = {
                "reasoning_tokens": sum(c.n_reasoning for c in choices)}
        return out

    def logprobs(self, req: ServedRequest, c: Choice, entries: list,
                 prompt_lps=None) -> dict | None:
        """The choice's `logprobs` for `entries` (output tokens), with the echoed prompt's
        tokens first when there are prompt logprobs to show."""
        if req.params.logprobs is None:
            return None
        if req.kind == "chat":
            return {"content": chat_logprobs(entries, self.token_text, req.params.logprobs)}
        if prompt_lps is not None and req.echoes[c.prompt] is not None:
            entries = list(zip(req.prompts[c.prompt], prompt_lps)) + entries
        out, c.offset = completion_logprobs(entries, self.token_text, c.offset)
        return out

    def chunk(self, req: ServedRequest, text: str | None, finish: str | None, role: bool = False,
              index: int = 0, logprobs: dict | None = None, tool_calls: list | None = None,
              stop_reason: int | str | None = None, n_out: int | None = None,
              reasoning: str = "") -> dict:
        """One streamed chunk of one choice (`n_out`: the request's tokens so far, for
        continuous usage; `reasoning`: thinking, as vLLM's `reasoning_content` delta)."""
        if req.kind == "chat":
            delta: dict = {}
            if role:
                delta["role"] = "assistant"
            if reasoning:
                delta["reasoning_content"] = reasoning
            if text is not None and (text or not (tool_calls or reasoning)):
                delta["content"] = text
            if tool_calls:
                delta["tool_calls"] = tool_calls
            choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish}
        else:
            choice = {"index": index, "text": text or "", "logprobs": logprobs,
                      "finish_reason": finish}
        choice["stop_reason"] = stop_reason
        out = {"id": req.rid, "object": req.object + ".chunk" if req.kind == "chat" else req.object,
               "created": req.created, "model": self.served, "choices": [choice]}
        if req.continuous_usage and n_out is not None:
            out["usage"] = self.usage(req, n_out)
        elif req.include_usage:
            out["usage"] = None
        return out

    def usage_chunk(self, req: ServedRequest, choices: list["Choice"]) -> dict:
        """The stream's last chunk with include_usage: no choices, the request's usage."""
        chunk = self.chunk(req, "", None)
        return {**chunk, "choices": [],
                "usage": self.usage(req, sum(c.n_out for c in choices), choices)}

    def finish_reason(self, req: ServedRequest, c: Choice, engine_reason: str | None) -> str | None:
        return (req.tools.finish_reason(engine_reason, bool(c.tool_deltas))
                if req.tools is not None else engine_reason)

    def chat_message(self, req: ServedRequest, c: Choice) -> tuple[dict, str | None]:
        """The reply's message and finish_reason: with tools, the calls the parser found
        (a call cut short, whose arguments do not parse, is given back as text); with a
        reasoning parser, the thinking as `reasoning_content` (vLLM's)."""
        message: dict = {"role": "assistant"}
        if req.reasoning is not None:
            message["reasoning_content"] = "".join(c.reasoning) or None
        if req.tools is None:
            return {**message, "content": "".join(c.content)}, c.finish
        calls = assemble(c.tool_deltas)
        content = "".join(c.content)
        if not valid_calls(calls):
            calls, content = [], "".join(c.answer)
        message.update(content=content if content or not calls else None, tool_calls=calls)
        return message, req.tools.finish_reason(c.finish, bool(calls))

    def reply(self, req: ServedRequest, choices: list[Choice], prompt_lps: list) -> dict:
        """The whole (non-streamed) reply."""
        out = []
        for i, c in enumerate(choices):
            lp = self.logprobs(req, c, c.logprobs, prompt_lps[c.prompt])
            if req.kind == "chat":
                message, finish = self.chat_message(req, c)
                out.append({"index": i, "message": message, "logprobs": lp,
                            "finish_reason": finish, "stop_reason": c.stop_reason})
            else:
                out.append({"index": i, "text": (req.echoes[c.prompt] or "") + "".join(c.texts),
                            "logprobs": lp, "finish_reason": c.finish,
                            "stop_reason": c.stop_reason})
                if req.vllm_prompt_logprobs:
                    out[-1]["prompt_logprobs"] = vllm_prompt_logprobs(prompt_lps[c.prompt])
        resp = {"id": req.rid, "object": req.object, "created": req.created, "model": self.served,
                "choices": out, "usage": self.usage(req, sum(c.n_out for c in choices), choices)}
        if req.kind == "chat" and req.vllm_prompt_logprobs:
            resp["prompt_logprobs"] = vllm_prompt_logprobs(prompt_lps[0])
        return resp


# ---- logprobs in OpenAI's shapes ------------------------------------------------------------
def completion_logprobs(entries, token_text, offset: int = 0) -> tuple[dict, int]:
    """Completions' `logprobs` object for (token id, {id: Logprob} | None) entries: tokens,
    token_logprobs, top_logprobs (the token and its top alternatives, by text) and
    text_offset (counted from `offset`). Returns it and the offset after the last token."""
    out: dict = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for tid, lps in entries:
        text = token_text(tid)
        out["tokens"].append(text)
        out["text_offset"].append(offset)
        offset += len(text)
        if lps is None:         # the first prompt token has no context
            out["token_logprobs"].append(None)
            out["top_logprobs"].append(None)
            continue
        out["token_logprobs"].append(_lp(lps[tid].logprob))
        top: dict[str, float] = {}
        for t, lp in sorted(lps.items(), key=lambda kv: -kv[1].logprob):
            top.setdefault(token_text(t), _lp(lp.logprob))
        out["top_logprobs"].append(top)
    return out, offset


def chat_logprobs(entries, token_text, k: int) -> list[dict]:
    """Chat's `logprobs.content`: per token its text, logprob, UTF-8 bytes and the top k."""
    def item(t, lp):
        text = token_text(t)
        return {"token": text, "logprob": _lp(lp.logprob), "bytes": list(text.encode())}
    content = []
    for tid, lps in entries:
        top = sorted(((t, lp) for t, lp in lps.items() if lp.rank is not None and lp.rank <= k),
                     key=lambda kv: kv[1].rank)
        content.append({**item(tid, lps[tid]), "top_logprobs": [item(t, lp) for t, lp in top]})
    return content


def vllm_prompt_logprobs(plp) -> list[dict | None]:
    """vLLM's `prompt_logprobs` field: per prompt token {id: {logprob, rank, decoded_token}}."""
    return [None if d is None else {str(t): {"logprob": _lp(lp.logprob), "rank": lp.rank,
                                             "decoded_token": lp.decoded_token}
                                    for t, lp in d.items()} for d in plp]
