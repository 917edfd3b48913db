"""`workbench serve`: an OpenAI-compatible HTTP server over one background Engine.

Endpoints
    POST /v1/completions        text or token-id prompt, streamed (SSE) or not
    POST /v1/chat/completions   chat messages through the tokenizer's chat template
    GET  /v1/models             the one served model
    GET  /health                200 while the engine loop runs, 503 otherwise
    GET  /version               {"version": the workbench's} (as vLLM's /version)
    GET  /metrics               Prometheus text, vLLM's metric names

The engine steps in its own thread (`engine.start()`); every handler is an asyncio task that
reads its tokens from `engine.astream(...)`. When a client goes away, the task is cancelled,
the stream is closed and the engine aborts the request at its next step boundary, which frees
its KV blocks. Every error is answered in OpenAI's shape:
`{"error": {"message", "type", "param", "code"}}`.

Only this module (and the CLI's `serve` command, lazily) imports FastAPI, uvicorn,
sse-starlette and prometheus_client, so `import workbench` stays light.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import hmac
import json
import logging
import math
import threading
import time
import uuid
from typing import Any, AsyncIterator

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from sse_starlette import EventSourceResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from .engine import Engine
from .sampling_params import SamplingParams, StructuredOutputsParams

log = logging.getLogger("workbench.server")

MAX_BODY_BYTES = 16 * 2**20
"""Request bodies larger than this are refused (413) before any parsing."""

STREAM_HEADERS = {
    # Streams must not be held back by a reverse proxy or a cache on the way.
    "Cache-Control": "no-cache",
    "X-Accel-Buffering": "no",
}

# Histogram buckets, seconds. Wide enough for a CPU (slow) and a GPU (fast) alike.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5,
                5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0)
ITL_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5,
               5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
E2E_BUCKETS = (0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0,
               60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)

FINISH_REASONS = ("stop", "length", "abort", "error")
GREEDY_BELOW = 1e-5
"""Temperatures in (0, GREEDY_BELOW) are served greedily, as vLLM does."""


# ---- errors ---------------------------------------------------------------------------------
class APIError(Exception):
    """An error answered as OpenAI does: status code + {"error": {...}}."""

    def __init__(self, status: int, message: str, param: str | None = None,
                 type: str = "invalid_request_error", code: str | None = None,
                 headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.param = status, message, param
        self.type, self.code, self.headers = type, code, headers

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.code}}

    def response(self) -> Response:
        # ASCII-escaped JSON: a message quoting a client's text renders whatever it holds.
        return Response(json.dumps(self.body()), status_code=self.status, headers=self.headers,
                        media_type="application/json")


def _bad(param: str | None, message: str, code: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=code)


def _from_value_error(e: Exception, rename: dict[str, str] | None = None) -> APIError:
    """The engine's ValueErrors start with the field's name ("max_tokens: must be ..."); keep
    the message and report that field as `param` (renamed to the API's name where it differs)."""
    msg = str(e)
    head, sep, rest = msg.partition(":")
    param = head if sep and head.isidentifier() else None
    if param is not None and rename and param in rename:
        param = rename[param]
        msg = f"{param}:{rest}"
    return _bad(param, msg)


# ---- parameter mapping ----------------------------------------------------------------------
_UNSET = object()


def _opt(body: dict, name: str, kinds: tuple[type, ...], what: str) -> Any:
    """body[name] if present and not null, checked against `kinds` (bools are never numbers)."""
    v = body.get(name)
    if v is None:
        return _UNSET
    if isinstance(v, bool) and bool not in kinds:
        raise _bad(name, f"{name}: must be {what} (got {v!r})")
    if not isinstance(v, kinds):
        raise _bad(name, f"{name}: must be {what} (got {v!r})")
    return v


# ---- the request fields: the one place that says which exist and how each is handled --------
OURS, PART_A, NO = "supported", "supported by part A", "unsupported"
BOTH, CHAT, COMPLETION = ("chat", "completion"), ("chat",), ("completion",)

REQUEST_FIELDS: dict[str, tuple[tuple[str, ...], str, tuple]] = {
    # name: (endpoints, status, values that ask for nothing). A field not listed here, or
    # sent to an endpoint it does not belong to, is answered as OpenAI answers an unknown
    # argument. A listed field that this server does not support is refused
    # (unsupported_parameter) unless its value is null or one that asks for nothing.
    # OpenAI's fields
    "model": (BOTH, OURS, ()),
    "messages": (CHAT, OURS, ()),
    "prompt": (COMPLETION, OURS, ()),
    "stream": (BOTH, OURS, ()),
    "stream_options": (BOTH, OURS, ()),
    "max_tokens": (BOTH, OURS, ()),
    "max_completion_tokens": (CHAT, OURS, ()),
    "temperature": (BOTH, OURS, ()),
    "top_p": (BOTH, OURS, ()),
    "seed": (BOTH, OURS, ()),
    "stop": (BOTH, OURS, ()),
    "response_format": (BOTH, OURS, ()),
    "n": (BOTH, PART_A, (1,)),
    "best_of": (COMPLETION, NO, (1,)),
    "logprobs": (BOTH, PART_A, (False,)),
    "top_logprobs": (CHAT, PART_A, (0,)),
    "echo": (BOTH, PART_A, (False,)),
    "presence_penalty": (BOTH, PART_A, (0,)),
    "frequency_penalty": (BOTH, PART_A, (0,)),
    "logit_bias": (BOTH, PART_A, ({},)),
    "suffix": (COMPLETION, NO, ("",)),
    "user": (BOTH, NO, ()),
    "tools": (CHAT, NO, ([],)),
    "tool_choice": (CHAT, NO, ("none",)),
    "parallel_tool_calls": (CHAT, NO, ()),
    "functions": (CHAT, NO, ([],)),
    "function_call": (CHAT, NO, ("none",)),
    "modalities": (CHAT, NO, (["text"],)),
    "audio": (CHAT, NO, ()),
    "prediction": (CHAT, NO, ()),
    "service_tier": (CHAT, NO, ("auto", "default")),
    "web_search_options": (CHAT, NO, ()),
    "reasoning_effort": (CHAT, NO, ()),
    "verbosity": (CHAT, NO, ()),
    "store": (CHAT, NO, (False,)),
    "metadata": (CHAT, NO, ({},)),
    "prompt_cache_key": (CHAT, NO, ()),
    "safety_identifier": (CHAT, NO, ()),
    # vLLM's extra fields
    "top_k": (BOTH, OURS, ()),
    "stop_token_ids": (BOTH, OURS, ()),
    "ignore_eos": (BOTH, OURS, ()),
    "structured_outputs": (BOTH, OURS, ()),
    "guided_json": (BOTH, OURS, ()),          # vLLM's legacy names for structured_outputs
    "guided_regex": (BOTH, OURS, ()),
    "guided_choice": (BOTH, OURS, ()),
    "guided_grammar": (BOTH, OURS, ()),
    "add_special_tokens": (BOTH, OURS, ()),
    "truncate_prompt_tokens": (BOTH, OURS, ()),
    "add_generation_prompt": (CHAT, OURS, ()),
    "continue_final_message": (CHAT, OURS, ()),
    "chat_template": (CHAT, OURS, ()),
    "chat_template_kwargs": (CHAT, OURS, ()),
    "min_p": (BOTH, PART_A, (0,)),
    "repetition_penalty": (BOTH, PART_A, (1,)),
    "min_tokens": (BOTH, PART_A, (0,)),
    "prompt_logprobs": (BOTH, PART_A, ()),
    "include_stop_str_in_output": (BOTH, PART_A, (False,)),
    "skip_special_tokens": (BOTH, PART_A, (True,)),
    "use_beam_search": (BOTH, NO, (False,)),
    "length_penalty": (BOTH, NO, (1,)),
    "guided_decoding_backend": (BOTH, NO, ()),
    "guided_whitespace_pattern": (BOTH, NO, ()),
    "allowed_token_ids": (BOTH, NO, ()),
    "bad_words": (BOTH, NO, ([],)),
    "spaces_between_special_tokens": (BOTH, NO, (True,)),
    "priority": (BOTH, NO, (0,)),
    "request_id": (BOTH, NO, ()),
    "logits_processors": (BOTH, NO, ()),
    "return_tokens_as_token_ids": (BOTH, NO, (False,)),
    "return_token_ids": (BOTH, NO, (False,)),
    "cache_salt": (BOTH, NO, ()),
    "kv_transfer_params": (BOTH, NO, ()),
    "vllm_xargs": (BOTH, NO, ()),
    "documents": (CHAT, NO, ()),
    "mm_processor_kwargs": (CHAT, NO, ()),
}

GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice",
          "guided_grammar": "grammar"}
"""vLLM's legacy structured-output fields -> the structured_outputs key each stands for."""


def _asks_nothing(v: Any, neutral: tuple) -> bool:
    return v is None or any(v == n and isinstance(v, bool) == isinstance(n, bool) for n in neutral)


def check_fields(kind: str, body: dict) -> None:
    """Every field of the request is known for this endpoint, and none asks for something
    this server does not do."""
    for name, value in body.items():
        entry = REQUEST_FIELDS.get(name)
        if entry is None or kind not in entry[0]:
            raise _bad(name, f"Unrecognized request argument supplied: {name}")
        _, status, neutral = entry
        if status != OURS and not _asks_nothing(value, neutral):
            what = ("not supported by this server yet" if status == PART_A
                    else "not supported by this server")
            if name in ("tools", "tool_choice", "functions", "function_call", "parallel_tool_calls"):
                what += " (tool calling is not supported)"
            shown = repr(value) if len(repr(value)) <= 80 else repr(value)[:77] + "..."
            raise _bad(name, f"{name}: {what} (got {shown})", code="unsupported_parameter")


def structured_outputs_from(body: dict) -> tuple[StructuredOutputsParams | None, str | None]:
    """response_format, structured_outputs or vLLM's legacy guided_* fields -> the engine's
    StructuredOutputsParams and the field that asked; at most one of the ways per request."""
    asked = [n for n in ("response_format", "structured_outputs", *GUIDED) if body.get(n) is not None]
    rf = body.get("response_format")
    if rf is not None and not isinstance(rf, dict):
        raise _bad("response_format", "response_format: must be an object with a 'type'")
    if rf is not None and rf.get("type") == "text" and set(rf) == {"type"}:
        asked.remove("response_format")   # plain text: asks for nothing
    if len(asked) > 1:
        raise _bad(asked[1], f"{asked[1]}: only one of {', '.join(asked)} may be given")
    if not asked:
        return None, None
    name = asked[0]
    return _structured_outputs(body, name), name


def _structured_outputs(body: dict, name: str) -> StructuredOutputsParams:
    rf = body.get("response_format")
    try:
        if name == "response_format":
            kind = rf.get("type")
            if kind == "json_object" and set(rf) == {"type"}:
                return StructuredOutputsParams(json_object=True)
            if kind == "json_schema" and set(rf) == {"type", "json_schema"}:
                js = rf["json_schema"]
                if not isinstance(js, dict) or not isinstance(js.get("schema", {}), (dict, bool)):
                    raise _bad(name, "response_format.json_schema: must be an object with "
                                     "'name' and 'schema'")
                extra = set(js) - {"name", "schema", "strict", "description"}
                if extra:
                    raise _bad(name, f"response_format.json_schema: unknown field {sorted(extra)[0]!r}")
                # No schema: any JSON value.
                return StructuredOutputsParams(json=js.get("schema", {}))
            raise _bad(name, "response_format: must be {'type': 'text'}, {'type': 'json_object'} "
                             "or {'type': 'json_schema', 'json_schema': {...}}")
        if name == "structured_outputs":
            so = body[name]
            if not isinstance(so, dict):
                raise _bad(name, "structured_outputs: must be an object")
            unknown = set(so) - set(StructuredOutputsParams.KINDS)
            if unknown:
                raise _bad(name, f"structured_outputs: {sorted(unknown)[0]!r} is not supported "
                                 f"(known: {', '.join(StructuredOutputsParams.KINDS)})",
                           code="unsupported_parameter")
            return StructuredOutputsParams(**so)
        return StructuredOutputsParams(**{GUIDED[name]: body[name]})
    except ValueError as e:
        raise _structured_error(name, e) from None


def _structured_error(name: str, e: ValueError) -> APIError:
    """The engine names structured_outputs.<kind>; a request that used another field is told
    about the field it sent."""
    msg = str(e)
    if name != "structured_outputs" and msg.startswith("structured_outputs"):
        msg = name + msg[msg.index(":"):]
    return _bad(name, msg)


def sampling_params_from(body: dict, default_max_tokens: int | None,
                         structured_outputs: StructuredOutputsParams | None = None
                         ) -> tuple[SamplingParams, str]:
    """OpenAI request fields -> SamplingParams. Returns the params and the name of the field
    that set max_tokens (for error messages). `default_max_tokens` None means "fill the
    context" and is resolved by the caller once the prompt length is known. The fields
    themselves were checked by check_fields."""
    which = "max_tokens"
    max_tokens = body.get("max_tokens")
    if body.get("max_completion_tokens") is not None:
        which, max_tokens = "max_completion_tokens", body["max_completion_tokens"]
    if max_tokens is None:
        max_tokens = default_max_tokens if default_max_tokens is not None else 1   # resolved later

    stop = body.get("stop")
    if stop is None:
        stop = []
    elif isinstance(stop, str):
        stop = [stop]
    elif not (isinstance(stop, list) and all(isinstance(s, str) for s in stop)):
        raise _bad("stop", f"stop: must be a string or a list of strings (got {stop!r})")
    stop_ids = body.get("stop_token_ids")
    if stop_ids is None:
        stop_ids = []
    elif not (isinstance(stop_ids, list)
              and all(isinstance(t, int) and not isinstance(t, bool) for t in stop_ids)):
        raise _bad("stop_token_ids", f"stop_token_ids: must be a list of integers (got {stop_ids!r})")
    ignore_eos = _opt(body, "ignore_eos", (bool,), "true or false")

    def num(name, default):
        v = body.get(name)
        if isinstance(v, bool):   # JSON true/false is not a number here
            raise _bad(name, f"{name}: must be a number (got {v!r})")
        return default if v is None else v

    if isinstance(max_tokens, bool):
        raise _bad(which, f"{which}: must be an integer > 0 (got {max_tokens!r})")
    seed = num("seed", None)
    if isinstance(seed, int) and not -2**63 <= seed < 2**64:
        raise _bad("seed", f"seed: must fit in 64 bits (got {seed!r})")
    temperature = num("temperature", 1.0)
    if isinstance(temperature, (int, float)) and 0 < temperature < GREEDY_BELOW:
        temperature = 0.0   # as vLLM: a vanishing temperature is greedy (and cannot overflow)

    try:
        params = SamplingParams(
            max_tokens=max_tokens,
            temperature=temperature,
            top_p=num("top_p", 1.0),
            top_k=num("top_k", 0),
            seed=seed,
            stop=stop,
            stop_token_ids=stop_ids,
            ignore_eos=False if ignore_eos is _UNSET else ignore_eos,
            structured_outputs=structured_outputs,
            truncate_prompt_tokens=num("truncate_prompt_tokens", None))
    except (ValueError, TypeError) as e:
        raise _from_value_error(e, {"max_tokens": which}) from None
    for name in ("temperature", "top_p"):   # the engine accepts inf/nan-free numbers only
        v = getattr(params, name)
        if isinstance(v, float) and not math.isfinite(v):
            raise _bad(name, f"{name}: must be a finite number (got {v!r})")
    return params, which


def _max_token_bytes(tokenizer) -> int:
    """An upper bound on the UTF-8 bytes one token stands for: 4 bytes per character of the
    longest vocabulary entry (byte-level BPE spells each byte as one character; SentencePiece
    pieces are Unicode characters of at most 4 bytes each)."""
    return 4 * max(len(t) for t in tokenizer.get_vocab())


def _is_template_error(e: Exception) -> bool:
    try:
        from jinja2 import TemplateError
    except ImportError:
        return False
    return isinstance(e, TemplateError) and isinstance(getattr(e, "message", None), str)


MESSAGE_FIELDS = {"role", "content", "name", "tool_calls", "tool_call_id"}


def _chat_messages(body: dict) -> list[dict]:
    """OpenAI messages -> what chat templates read: text content, and assistant tool calls
    (their JSON arguments parsed, as templates expect a mapping) and tool results passed
    through."""
    msgs = body.get("messages")
    if msgs is None:
        raise _bad("messages", "messages: required")
    if not isinstance(msgs, list) or not msgs:
        raise _bad("messages", "messages: must be a non-empty list of {role, content} objects")
    out = []
    for i, m in enumerate(msgs):
        where = f"messages[{i}]"
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise _bad("messages", f"{where}: must be an object with a string 'role'")
        extra = sorted(set(m) - MESSAGE_FIELDS)
        if extra:
            raise _bad("messages", f"{where}.{extra[0]}: not supported by this server",
                       code="unsupported_parameter")
        content = m.get("content")
        if content is None:
            content = ""
        elif isinstance(content, list):   # content parts: only text ones
            texts = []
            for part in content:
                if not (isinstance(part, dict) and part.get("type") == "text"
                        and isinstance(part.get("text"), str)):
                    raise _bad("messages", f"{where}.content: only text parts are supported")
                texts.append(part["text"])
            content = "".join(texts)
        elif not isinstance(content, str):
            raise _bad("messages", f"{where}.content: must be a string or a list of text parts")
        role = "system" if m["role"] == "developer" else m["role"]
        msg = {"role": role, "content": content}
        for key in ("name", "tool_call_id"):
            if m.get(key) is not None:
                if not isinstance(m[key], str):
                    raise _bad("messages", f"{where}.{key}: must be a string")
                msg[key] = m[key]
        if m.get("tool_calls") is not None:
            msg["tool_calls"] = _tool_calls(m["tool_calls"], f"{where}.tool_calls")
        out.append(msg)
    return out


def _tool_calls(calls: Any, where: str) -> list[dict]:
    if not isinstance(calls, list):
        raise _bad("messages", f"{where}: must be a list")
    out = []
    for j, c in enumerate(calls):
        fn = c.get("function") if isinstance(c, dict) else None
        if not (isinstance(fn, dict) and isinstance(fn.get("name"), str)
                and isinstance(fn.get("arguments"), str)):
            raise _bad("messages", f"{where}[{j}]: must be {{'type': 'function', 'function': "
                                   "{'name': str, 'arguments': JSON text}}")
        try:
            args = json.loads(fn["arguments"])
        except ValueError:
            raise _bad("messages", f"{where}[{j}].function.arguments: not valid JSON") from None
        out.append({"id": c.get("id"), "type": c.get("type", "function"),
                    "function": {"name": fn["name"], "arguments": args}})
    return out


def _completion_prompt(body: dict) -> str | list[int]:
    p = body.get("prompt")
    if p is None:
        raise _bad("prompt", "prompt: required")
    if isinstance(p, list) and p and all(isinstance(x, (str, list)) for x in p):
        if len(p) != 1:
            raise _bad("prompt", f"prompt: only one prompt per request is supported (got {len(p)})")
        p = p[0]
    if isinstance(p, str):
        return p
    if isinstance(p, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in p):
        return p
    raise _bad("prompt", "prompt: must be a string or a list of token ids")


# ---- metrics --------------------------------------------------------------------------------
class _Hist:
    """A cumulative-bucket histogram (what Prometheus wants), fed one value at a time."""

    def __init__(self, bounds: tuple[float, ...]):
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)   # last: +Inf
        self.sum = 0.0

    def observe(self, v: float) -> None:
        self.sum += v
        for i, b in enumerate(self.bounds):
            if v <= b:
                self.counts[i] += 1
                return
        self.counts[-1] += 1

    def buckets(self) -> list[tuple[str, float]]:
        out, acc = [], 0
        for b, c in zip(self.bounds, self.counts):
            acc += c
            out.append((repr(float(b)), acc))
        out.append(("+Inf", acc + self.counts[-1]))
        return out


class EngineMetrics:
    """A prometheus_client collector over one Engine.

    Gauges are read live from the scheduler and the block manager at scrape time. Counters
    and histograms are fed from the engine's telemetry: every RequestMetrics the engine
    recorded since the last scrape (finished, stopped or aborted requests) is folded in once.
    So token counters and latencies advance when a request ends, not token by token.
    """

    def __init__(self, engine: Engine, model_name: str):
        self.engine = engine
        self.model_name = model_name
        self._lock = threading.Lock()
        self._seen = 0                                # telemetry request records folded in
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self.success = dict.fromkeys(FINISH_REASONS, 0)
        self.ttft = _Hist(TTFT_BUCKETS)
        self.itl = _Hist(ITL_BUCKETS)
        self.tpot = _Hist(ITL_BUCKETS)
        self.e2e = _Hist(E2E_BUCKETS)
        self.queue = _Hist(E2E_BUCKETS)

    def _ingest(self) -> None:
        tel = self.engine.telemetry
        new = tel.requests_since(self._seen)
        self._seen += len(new)
        for m in new:
            self.prompt_tokens += m.prompt_tokens
            self.generation_tokens += m.output_tokens
            reason = m.finish_reason or "abort"
            self.success[reason] = self.success.get(reason, 0) + 1
            if m.ttft is not None:
                self.ttft.observe(m.ttft)
            for gap in m.itl:
                self.itl.observe(gap)
            if m.tpot is not None:
                self.tpot.observe(m.tpot)
            if m.first_scheduled_time is not None:
                self.queue.observe(m.first_scheduled_time - m.arrival_time)
            if m.e2e is not None and reason in ("stop", "length"):
                self.e2e.observe(m.e2e)

    def live(self) -> dict[str, float]:
        e = self.engine
        running, waiting = e.num_running, e.num_waiting
        bm = e.block_manager
        return {"running": running, "waiting": waiting,
                "kv_usage": bm.num_used_blocks / bm.num_blocks,
                "preemptions": e.scheduler.num_preemptions,
                "prefix_queries": bm.queries * bm.block_size,
                "prefix_hits": bm.hits * bm.block_size}

    def collect(self):
        with self._lock:
            self._ingest()
            live = self.live()
            lbl, name = ["model_name"], [self.model_name]

            def gauge(metric, doc, value):
                g = GaugeMetricFamily(metric, doc, labels=lbl)
                g.add_metric(name, value)
                return g

            def counter(metric, doc, value):
                c = CounterMetricFamily(metric, doc, labels=lbl)
                c.add_metric(name, value)
                return c

            def hist(metric, doc, h: _Hist):
                f = HistogramMetricFamily(metric, doc, labels=lbl)
                f.add_metric(name, h.buckets(), h.sum)
                return f

            yield gauge("vllm:num_requests_running", "Requests in the running batch.",
                        live["running"])
            yield gauge("vllm:num_requests_waiting", "Requests waiting to be scheduled.",
                        live["waiting"])
            yield gauge("vllm:kv_cache_usage_perc",
                        "Fraction of KV-cache blocks in use by live requests (1 = full).",
                        live["kv_usage"])
            info = GaugeMetricFamily("vllm:cache_config_info", "KV cache configuration.",
                                     labels=["model_name", "block_size", "num_gpu_blocks"])
            bm = self.engine.block_manager
            info.add_metric([self.model_name, str(bm.block_size), str(bm.num_blocks)], 1)
            yield info
            yield counter("vllm:num_preemptions", "Preemptions (by recompute) since start.",
                          live["preemptions"])
            yield counter("vllm:prompt_tokens", "Prompt tokens of finished requests.",
                          self.prompt_tokens)
            yield counter("vllm:generation_tokens", "Generated tokens of finished requests.",
                          self.generation_tokens)
            yield counter("vllm:prefix_cache_queries", "Prompt tokens looked up in the prefix cache.",
                          live["prefix_queries"])
            yield counter("vllm:prefix_cache_hits", "Prompt tokens served by the prefix cache.",
                          live["prefix_hits"])
            ok = CounterMetricFamily("vllm:request_success", "Finished requests by finish reason.",
                                     labels=["model_name", "finished_reason"])
            for reason, n in self.success.items():
                ok.add_metric([self.model_name, reason], n)
            yield ok
            yield hist("vllm:time_to_first_token_seconds", "Time to first token.", self.ttft)
            yield hist("vllm:inter_token_latency_seconds", "Time between consecutive tokens.",
                       self.itl)
            yield hist("vllm:request_time_per_output_token_seconds",
                       "Mean time per output token after the first, per request.", self.tpot)
            yield hist("vllm:e2e_request_latency_seconds",
                       "Arrival to last token, requests that finished (stop or length).", self.e2e)
            yield hist("vllm:request_queue_time_seconds", "Arrival to first scheduling.",
                       self.queue)

    def render(self) -> bytes:
        registry = CollectorRegistry(auto_describe=False)
        registry.register(self)
        return generate_latest(registry)


# ---- the app --------------------------------------------------------------------------------
async def _read_json(request: Request) -> dict:
    size = request.headers.get("content-length")
    if size is not None and size.isdigit() and int(size) > MAX_BODY_BYTES:
        raise APIError(413, f"body: larger than {MAX_BODY_BYTES} bytes", code="body_too_large")
    chunks, total = [], 0
    async for chunk in request.stream():
        total += len(chunk)
        if total > MAX_BODY_BYTES:
            raise APIError(413, f"body: larger than {MAX_BODY_BYTES} bytes", code="body_too_large")
        chunks.append(chunk)
    raw = b"".join(chunks)
    try:
        body = json.loads(raw)
    except json.JSONDecodeError as e:
        raise _bad(None, f"body: not valid JSON (line {e.lineno}, column {e.colno})",
                   code="invalid_json") from None
    except UnicodeDecodeError as e:
        raise _bad(None, f"body: not valid UTF-8 (byte {e.start})", code="invalid_json") from None
    except RecursionError:
        raise _bad(None, "body: nested too deeply", code="invalid_json") from None
    if not isinstance(body, dict):
        raise _bad(None, "body: must be a JSON object", code="invalid_json")
    _check_text(body)
    return body


def _check_text(body: dict) -> None:
    """JSON may escape lone UTF-16 surrogates ("\\udfff"), which are not text: refuse them here,
    naming the field, rather than fail later in the tokenizer or in a response."""
    stack = [(k, k, v) for k, v in body.items()]
    while stack:
        param, key, value = stack.pop()
        for text in ((key, value) if isinstance(value, str) else (key,)):
            bad = next((c for c in text if "\ud800" <= c <= "\udfff"), None)
            if bad is not None:
                raise _bad(param, f"{param}: contains a lone surrogate (\\u{ord(bad):04x}), "
                                  "which is not Unicode text", code="invalid_text")
        if isinstance(value, dict):
            stack.extend((param, k, v) for k, v in value.items())
        elif isinstance(value, list):
            stack.extend((param, "", v) for v in value)


async def _wait_for_disconnect(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


class _Served:
    """One validated request, ready to run."""

    def __init__(self, kind: str, rid: str, prompt_ids: list[int], params: SamplingParams,
                 stream: bool, include_usage: bool):
        self.kind, self.rid, self.prompt_ids, self.params = kind, rid, prompt_ids, params
        self.stream, self.include_usage = stream, include_usage
        self.created = int(time.time())


def create_app(engine: Engine, model_name: str | None = None, api_key: str | None = None,
               allow_missing_model: bool = False) -> FastAPI:
    """The FastAPI app serving `engine` (started on app start-up, shut down on exit).
    `allow_missing_model`: a request without `model` gets the served one (else 400)."""
    served = model_name or engine.config.model
    metrics = EngineMetrics(engine, served)

    @contextlib.asynccontextmanager
    async def lifespan(app):
        engine.start()
        try:
            yield
        finally:
            tokenizing.shutdown(wait=False, cancel_futures=True)
            engine.shutdown()

    app = FastAPI(title="workbench", lifespan=lifespan, docs_url=None, redoc_url=None,
                  openapi_url=None)
    app.state.engine, app.state.metrics = engine, metrics

    @app.exception_handler(APIError)
    async def _api_error(request, exc: APIError):
        return exc.response()

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request, exc: StarletteHTTPException):
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
        return APIError(exc.status_code, f"{request.method} {request.url.path}: {exc.detail}",
                        code=code, headers=getattr(exc, "headers", None)).response()

    @app.exception_handler(Exception)
    async def _internal(request, exc: Exception):
        log.exception("unhandled error in %s %s", request.method, request.url.path)
        return APIError(500, "internal error (the server's log has the details)",
                        type="server_error").response()

    def check_auth(request: Request) -> None:
        if api_key is None:
            return
        header = request.headers.get("authorization", "")
        scheme, _, token = header.partition(" ")
        if scheme.lower() != "bearer" or not token:
            raise APIError(401, "Missing API key: send it as 'Authorization: Bearer <key>'.",
                           code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})
        if not hmac.compare_digest(token.strip().encode(), api_key.encode()):
            raise APIError(401, "Incorrect API key provided.", code="invalid_api_key",
                           headers={"WWW-Authenticate": "Bearer"})

    def check_model(body: dict) -> None:
        m = body.get("model")
        if m is None:
            if allow_missing_model:
                return
            raise _bad("model", "model: required (this server serves "
                                f"{served!r}; start it with --allow-missing-model to default to it)")
        if not isinstance(m, str):
            raise _bad("model", f"model: must be a string (got {m!r})")
        if m != served:
            raise APIError(404, f"The model `{m}` does not exist. This server serves `{served}`.",
                           param="model", code="model_not_found")

    def prepare(kind: str, body: dict) -> _Served:
        check_fields(kind, body)
        check_model(body)
        stream = _opt(body, "stream", (bool,), "true or false")
        stream = False if stream is _UNSET else stream
        so = body.get("stream_options")
        if so is not None and not isinstance(so, dict):
            raise _bad("stream_options", "stream_options: must be an object")
        include_usage = bool(so and so.get("include_usage"))
        if so is not None and not stream:
            raise _bad("stream_options", "stream_options: only allowed when stream is true")
        # OpenAI's defaults: 16 tokens for completions; chat fills the context.
        so, so_field = structured_outputs_from(body)
        params, which = sampling_params_from(body, 16 if kind == "completion" else None, so)
        explicit = body.get(which) is not None
        options = {"truncate_prompt_tokens": params.truncate_prompt_tokens,
                   "add_special_tokens": _opt(body, "add_special_tokens", (bool,), "true or false")}
        if kind == "chat":
            prompt, rename = _chat_messages(body), {"prompt": "messages"}
            for name, kinds, what in (("add_generation_prompt", (bool,), "true or false"),
                                      ("continue_final_message", (bool,), "true or false"),
                                      ("chat_template", (str,), "a Jinja template text"),
                                      ("chat_template_kwargs", (dict,), "an object")):
                options[name] = _opt(body, name, kinds, what)
            if (options["chat_template"] is _UNSET
                    and getattr(engine.tokenizer, "chat_template", None) is None):
                raise _bad("messages", f"messages: model {served!r} has no chat template; use "
                                       "/v1/completions", code="unsupported_model")
        else:
            prompt, rename = _completion_prompt(body), None
        options = {k: v for k, v in options.items() if v is not _UNSET and v is not None}
        if so is not None:
            try:
                engine.check_params(params)
            except ValueError as e:
                raise _structured_error(so_field, e) from None
        field = "messages" if kind == "chat" else "prompt"
        if max_text_bytes is not None:
            texts = ([json.dumps(m) for m in prompt] if kind == "chat"
                     else [prompt] if isinstance(prompt, str) else [])
            size = sum(len(t.encode()) for t in texts)
            if size > max_text_bytes:
                raise _bad(field, f"{field}: {size} bytes of text cannot fit in max_model_len "
                                  f"({engine.max_model_len} tokens; no token of this tokenizer "
                                  f"is longer than {max_token_bytes} bytes)",
                           code="context_length_exceeded")
        try:
            ids = engine.tokenize(prompt, **options)
        except ValueError as e:
            err = _from_value_error(e, rename)
            if err.param is None:   # e.g. a tokenizer without a chat template
                err = _bad(field, f"{field}: {e}")
            if "max_model_len" in err.message:
                err.code = "context_length_exceeded"
            raise err from None
        except Exception as e:
            log.warning("%s could not be tokenized: %s: %s", field, type(e).__name__, e)
            if kind == "chat" and _is_template_error(e):
                # The chat template refused the conversation with a message of its own.
                raise _bad("messages", f"messages: the chat template refused them: {e.message}") from None
            raise _bad(field, f"{field}: could not be tokenized") from None
        room = engine.max_model_len - len(ids)
        if not explicit:    # chat: fill the context; completions: 16, or what still fits
            params.max_tokens = room if kind == "chat" else min(params.max_tokens, room)
        elif params.max_tokens > room:
            raise _bad(which, f"{which}: the prompt has {len(ids)} tokens and {which} is "
                              f"{params.max_tokens}, but max_model_len is {engine.max_model_len}; "
                              f"at most {room} new tokens fit", code="context_length_exceeded")
        prefix = "chatcmpl" if kind == "chat" else "cmpl"
        return _Served(kind, f"{prefix}-{uuid.uuid4().hex}", ids, params, stream, include_usage)

    def usage(req: _Served, n_out: int) -> dict:
        n_in = len(req.prompt_ids)
        return {"prompt_tokens": n_in, "completion_tokens": n_out, "total_tokens": n_in + n_out}

    def chunk(req: _Served, text: str | None, finish: str | None, role: bool = False) -> dict:
        if req.kind == "chat":
            delta: dict = {}
            if role:
                delta["role"] = "assistant"
            if text is not None:
                delta["content"] = text
            choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
            obj = "chat.completion.chunk"
        else:
            choice = {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish}
            obj = "text_completion"
        out = {"id": req.rid, "object": obj, "created": req.created, "model": served,
               "choices": [choice]}
        if req.include_usage:
            out["usage"] = None
        return out

    def dumps(obj) -> str:
        return json.dumps(obj, ensure_ascii=False, separators=(",", ":"))

    has_tokenizer = engine.tokenizer is not None
    max_token_bytes = _max_token_bytes(engine.tokenizer) if has_tokenizer else None
    max_text_bytes = (None if max_token_bytes is None
                      else engine.max_model_len * max_token_bytes)
    # Tokenizing a long prompt takes seconds: one worker thread does it, never the event loop.
    tokenizing = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="workbench-tokenize")

    async def sse_events(req: _Served) -> AsyncIterator[str]:
        """The SSE body of one streamed request. Closing or cancelling it (a client
        disconnect) closes the engine stream, which aborts the request."""
        agen = engine.astream(req.prompt_ids, req.params, request_id=req.rid)
        n_out, finish = 0, None
        try:
            if req.kind == "chat":
                yield dumps(chunk(req, "", None, role=True))
            async for ev in agen:
                if ev.token_id is not None:
                    n_out = ev.index
                if ev.text or (ev.token_id is not None and not has_tokenizer):
                    yield dumps(chunk(req, ev.text, None))
                if ev.finished:
                    finish = ev.finish_reason
        except Exception:    # not a disconnect (that is a CancelledError): tell the client
            log.exception("stream %s failed", req.rid)
            finish = "error"
        finally:
            await agen.aclose()
        if finish == "error":
            yield dumps(APIError(500, "the engine failed while running this request",
                                 type="server_error").body())
        else:
            yield dumps(chunk(req, None if req.kind == "chat" else "", finish))
            if req.include_usage:
                yield dumps({"id": req.rid, "object": chunk(req, "", None)["object"],
                             "created": req.created, "model": served, "choices": [],
                             "usage": usage(req, n_out)})
        yield "[DONE]"

    async def run_to_end(req: _Served, request: Request) -> dict:
        """A non-streamed request; aborted if the client disconnects while it runs."""
        async def collect():
            texts, n_out, finish = [], 0, None
            async with contextlib.aclosing(engine.astream(req.prompt_ids, req.params,
                                                          request_id=req.rid)) as agen:
                async for ev in agen:
                    texts.append(ev.text)
                    if ev.token_id is not None:
                        n_out = ev.index
                    if ev.finished:
                        finish = ev.finish_reason
            return "".join(texts), n_out, finish

        work = asyncio.ensure_future(collect())
        gone = asyncio.ensure_future(_wait_for_disconnect(request))
        try:
            await asyncio.wait({work, gone}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for t in (work, gone):
                if not t.done():
                    t.cancel()
        if not work.done() or work.cancelled():
            await asyncio.wait({work})      # let the engine stream close (it aborts the request)
            raise APIError(499, "client closed the request", code="client_closed_request")
        text, n_out, finish = work.result()
        if finish == "error":
            raise APIError(500, "the engine failed while running this request", type="server_error")
        if req.kind == "chat":
            choice = {"index": 0, "message": {"role": "assistant", "content": text},
                      "logprobs": None, "finish_reason": finish}
            obj = "chat.completion"
        else:
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish}
            obj = "text_completion"
        return {"id": req.rid, "object": obj, "created": req.created, "model": served,
                "choices": [choice], "usage": usage(req, n_out)}

    async def handle(kind: str, request: Request):
        check_auth(request)
        body = await _read_json(request)
        req = await asyncio.get_running_loop().run_in_executor(tokenizing, prepare, kind, body)
        if req.stream:
            return EventSourceResponse(sse_events(req), headers=STREAM_HEADERS, sep="\n")
        return JSONResponse(await run_to_end(req, request))

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await handle("completion", request)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await handle("chat", request)

    def model_card() -> dict:
        return {"id": served, "object": "model", "created": int(engine_started), "owned_by": "workbench",
                "root": engine.config.model, "max_model_len": engine.max_model_len}

    engine_started = time.time()

    @app.get("/v1/models")
    async def models(request: Request):
        check_auth(request)
        return {"object": "list", "data": [model_card()]}

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str, request: Request):
        check_auth(request)
        if model_id != served:
            raise APIError(404, f"The model `{model_id}` does not exist.", param="model",
                           code="model_not_found")
        return model_card()

    @app.api_route("/health", methods=["GET", "HEAD"])   # load balancers probe with HEAD
    async def health():
        # is_running_in_background stays True if the step thread died; ask the thread too.
        thread = getattr(engine, "_thread", None)
        alive = thread.is_alive() if thread is not None else engine.is_running_in_background
        if not (engine.is_running_in_background and alive):
            raise APIError(503, "engine loop is not running", type="server_error",
                           code="unavailable")
        return {"status": "ok"}

    @app.get("/version")
    async def version():
        from . import __version__
        return {"version": __version__}

    @app.get("/metrics")
    async def prometheus_metrics():
        return Response(metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    return app


HEADER_TIMEOUT_S = 10.0
"""A connection that has not sent a whole request head this long after connecting (or after
its previous response) is closed: half-sent headers must not hold connections forever."""
LIMIT_CONCURRENCY = 512
"""Connections (or requests in flight) past this many are answered 503 at once."""


def _h11_with_header_timeout(header_timeout: float):
    """uvicorn's h11 protocol plus a header-read timeout, which uvicorn lacks (its keep-alive
    timer stops at the first byte, so a client that sends half a request head and waits keeps
    the connection forever)."""
    import h11
    from uvicorn.protocols.http.h11_impl import H11Protocol

    class Protocol(H11Protocol):
        _head_timer = None

        def connection_made(self, transport):
            super().connection_made(transport)
            self._arm()

        def on_response_complete(self):
            super().on_response_complete()
            self._arm()

        def connection_lost(self, exc):
            self._disarm()
            super().connection_lost(exc)

        def _arm(self):
            self._disarm()
            self._head_timer = self.loop.call_later(header_timeout, self._head_timeout)

        def _disarm(self):
            if self._head_timer is not None:
                self._head_timer.cancel()
                self._head_timer = None

        def _head_timeout(self):
            # Still no complete request head (h11 leaves IDLE once it has one).
            if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
                self.transport.close()

    return Protocol


def serve(engine: Engine, host: str = "127.0.0.1", port: int = 8000, api_key: str | None = None,
          model_name: str | None = None, log_level: str = "info",
          header_timeout: float = HEADER_TIMEOUT_S,
          limit_concurrency: int = LIMIT_CONCURRENCY, allow_missing_model: bool = False) -> None:
    """Run the server in this thread until SIGINT/SIGTERM (then the engine is shut down)."""
    import uvicorn

    app = create_app(engine, model_name, api_key, allow_missing_model)
    config = uvicorn.Config(app, host=host, port=port, log_level=log_level,
                            http=_h11_with_header_timeout(header_timeout),
                            limit_concurrency=limit_concurrency,
                            timeout_graceful_shutdown=5, timeout_keep_alive=30)
    uvicorn.Server(config).run()
