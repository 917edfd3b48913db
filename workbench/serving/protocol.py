"""Requests in: the OpenAI protocol as `workbench serve` reads it. Bodies to SamplingParams
and prompts, field by field, and every refusal as an OpenAI-shaped error (`APIError`) that
names its field. Nothing of HTTP lives here (app.py is the transport), and nothing of the
replies (responses.py)."""
from __future__ import annotations

import json
from typing import Any

from .schema import IGNORED, SUPPORTED, UNSUPPORTED, request_fields
from ..core.sampling_params import MAX_LOGPROBS, SamplingParams, StructuredOutputsParams

MAX_BODY_BYTES = 16 * 2**20
"""Request bodies larger than this are refused (413) before any parsing."""



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


def bad_request(param: str | None, message: str, code: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=code)


def from_value_error(e: Exception, rename: dict[str, str] | None = None) -> APIError:
    """The engine's ValueErrors start with the field's name ("max_tokens: must be ..."); keep
    the message and report that field as `param` (renamed to the API's name where it differs)."""
    msg = str(e)
    head, sep, rest = msg.partition(":")
    param = head if sep and head.isidentifier() else None
    if param is not None and rename and param in rename:
        param = rename[param]
        msg = f"{param}:{rest}"
    return bad_request(param, msg)


# ---- parameter mapping ----------------------------------------------------------------------
UNSET = object()


def body_field(body: dict, name: str, kinds: tuple[type, ...], what: str) -> Any:
    """body[name] if present and not null, checked against `kinds` (bools are never numbers)."""
    v = body.get(name)
    if v is None:
        return UNSET
    if isinstance(v, bool) and bool not in kinds:
        raise bad_request(name, f"{name}: must be {what} (got {v!r})")
    if not isinstance(v, kinds):
        raise bad_request(name, f"{name}: must be {what} (got {v!r})")
    return v


# ---- the request fields: declared once, in schema.py's models ------------------------------
OURS, NO = SUPPORTED, UNSUPPORTED

REQUEST_FIELDS: dict[str, dict[str, tuple[str, tuple]]] = request_fields()
"""endpoint -> name -> (status, values that ask for nothing), from schema.py. A field not
listed for the endpoint it is sent to is answered as OpenAI answers an
unknown argument. A listed field that this server does not support is refused
(unsupported_parameter) unless its value is null or one that asks for nothing."""

def _asks_nothing(v: Any, neutral: tuple) -> bool:
    return v is None or any(v == n and isinstance(v, bool) == isinstance(n, bool) for n in neutral)


def check_fields(kind: str, body: dict, strict: bool = False) -> list[str]:
    """No field asks for something this server does not do (a 400 naming it). A field this
    endpoint does not know is taken out of `body` and its name returned, to be warned about,
    as vLLM does (clients send fields of their own); with `strict`, it is refused instead. A
    field this server knows and ignores (schema.IGNORED) is taken out and named the same way,
    strict or not."""
    unknown = []
    for name, value in body.items():
        entry = REQUEST_FIELDS[kind].get(name)
        if entry is None:
            if strict:
                raise bad_request(name, f"Unrecognized request argument supplied: {name}")
            unknown.append(name)
            continue
        status, neutral = entry
        if status == IGNORED:
            if value is not None:
                unknown.append(name)
            continue
        if status != OURS and not _asks_nothing(value, neutral):
            what = "not supported by this server"
            if name in ("functions", "function_call"):
                what += " (the legacy function calling: send tools and tool_choice)"
            shown = repr(value) if len(repr(value)) <= 80 else repr(value)[:77] + "..."
            raise bad_request(name, f"{name}: {what} (got {shown})", code="unsupported_parameter")
    for name in unknown:
        del body[name]
    return unknown


def logprobs_fields(body: dict, kind: str) -> tuple[int | None, int | None, bool]:
    """(logprobs, prompt_logprobs, echo) as the engine counts them. Completions: `logprobs`
    is the number of alternatives, and `echo` with it scores the prompt too. Chat:
    `logprobs` is a flag and `top_logprobs` the number of alternatives."""
    echo = False
    if kind == "chat":
        flag = body_field(body, "logprobs", (bool,), "true or false")
        top = body_field(body, "top_logprobs", (int,), f"an integer in [0, {MAX_LOGPROBS}]")
        if top is not UNSET and flag is not True:
            raise bad_request("top_logprobs", "top_logprobs: needs logprobs set to true")
        logprobs = (0 if top is UNSET else top) if flag is True else None
    else:
        logprobs = body_field(body, "logprobs", (int,), f"an integer in [0, {MAX_LOGPROBS}]")
        logprobs = None if logprobs is UNSET else logprobs
        echo = body_field(body, "echo", (bool,), "true or false") is True
    prompt_logprobs = body_field(body, "prompt_logprobs", (int,), f"an integer in [0, {MAX_LOGPROBS}]")
    prompt_logprobs = None if prompt_logprobs is UNSET else prompt_logprobs
    if echo and logprobs is not None and prompt_logprobs is None:
        prompt_logprobs = logprobs
    return logprobs, prompt_logprobs, echo


def sampling_params_from(body: dict, kind: str = "completion",
                         structured_outputs: StructuredOutputsParams | None = None,
                         defaults: dict | None = None) -> tuple[SamplingParams, str]:
    """OpenAI request fields (and vLLM's sampling extras) -> SamplingParams. Returns the
    params and the name of the field that sets max_tokens (for error messages). A body that
    leaves max_tokens out gets None, decided by `resolve_max_tokens` once the prompt's
    length is known. `defaults` (the engine's generation defaults, SamplingParams' names)
    fill the fields the request leaves out, as vLLM does. The fields themselves were checked
    by check_fields; value checks are SamplingParams' (a 400 naming the field)."""
    defaults = defaults or {}
    logprobs, prompt_logprobs, echo = logprobs_fields(body, kind)
    which = "max_completion_tokens" if body.get("max_completion_tokens") is not None \
        else "max_tokens"
    max_tokens = body.get(which)
    ignore_eos = body_field(body, "ignore_eos", (bool,), "true or false")

    def num(name, default):
        v = body.get(name)
        if isinstance(v, bool):   # JSON true/false is not a number here
            raise bad_request(name, f"{name}: must be a number (got {v!r})")
        return default if v is None else v

    if isinstance(max_tokens, bool):
        raise bad_request(which, f"{which}: must be an integer >= 0 (got {max_tokens!r})")
    if max_tokens == 0 and not echo:
        raise bad_request(which, f"{which}: 0 is only for scoring a prompt (echo with logprobs)")
    if max_tokens == 0 and prompt_logprobs is None:
        prompt_logprobs = 0     # echo alone: the prompt comes back, scored or not
    logit_bias = body_field(body, "logit_bias", (dict,), "an object of token id -> bias")
    extras = {name: body[name] for name in (
        "n", "presence_penalty", "frequency_penalty", "repetition_penalty", "min_p",
        "min_tokens", "include_stop_str_in_output", "skip_special_tokens")
        if body.get(name) is not None}
    for name in ("repetition_penalty", "min_p"):
        if name not in extras and name in defaults:
            extras[name] = defaults[name]
    seed = num("seed", None)
    if seed == -1 and not isinstance(seed, float):
        seed = None     # as vLLM: -1 asks for no seed
    # (A temperature below SAMPLING_EPS is greedy, and a seed must fit 64 bits: both are
    # SamplingParams' rules, checked there, as are stop's and stop_token_ids' types.)
    temperature = num("temperature", defaults.get("temperature", 1.0))

    try:
        params = SamplingParams(
            max_tokens=max_tokens,
            temperature=temperature,
            top_p=num("top_p", defaults.get("top_p", 1.0)),
            top_k=num("top_k", defaults.get("top_k", 0)),
            seed=seed,
            stop=body.get("stop"),
            stop_token_ids=body.get("stop_token_ids"),
            ignore_eos=False if ignore_eos is UNSET else ignore_eos,
            structured_outputs=structured_outputs,
            truncate_prompt_tokens=num("truncate_prompt_tokens", None),
            logprobs=logprobs, prompt_logprobs=prompt_logprobs,
            logit_bias=None if logit_bias is UNSET else logit_bias, **extras)
    except (ValueError, TypeError) as e:
        raise from_value_error(e, {"max_tokens": which, **(
            {"logprobs": "top_logprobs"} if kind == "chat" else {})}) from None
    return params, which


def resolve_max_tokens(params: SamplingParams, which: str, kind: str, cap: int | None,
                       longest: int, max_model_len: int) -> None:
    """The one place a served request's max_tokens is decided, once its longest prompt is
    known (vLLM's get_max_tokens): asked for, it must fit after the prompt; left out, it is
    OpenAI's default (16 for completions; chat fills the context) under the model's own cap
    (generation_config's max_new_tokens, `cap`), cut to what fits. Sets params.max_tokens;
    a refusal is a 400 naming the field."""
    room = max_model_len - longest
    if params.max_tokens is not None:
        if params.max_tokens > room:
            raise bad_request(which, f"{which}: the prompt has {longest} tokens and {which} is "
                              f"{params.max_tokens}, but max_model_len is {max_model_len}; "
                              f"at most {room} new tokens fit", code="context_length_exceeded")
        return
    limits = [x for x in (16 if kind == "completion" else None, cap) if x]
    default = min(limits) if limits else room
    if params.min_tokens > default:
        raise bad_request("min_tokens", "min_tokens: must be an integer in [0, max_tokens] "
                          f"(got {params.min_tokens!r})")
    params.max_tokens = min(room, default)
    if params.min_tokens > params.max_tokens:
        raise bad_request("min_tokens", f"min_tokens: {params.min_tokens}, but at most "
                          f"{params.max_tokens} new tokens fit after the prompt")


def max_token_bytes(tokenizer) -> int:
    """An upper bound on the UTF-8 bytes one token stands for: 4 bytes per character of the
    longest vocabulary entry (byte-level BPE spells each byte as one character; SentencePiece
    pieces are Unicode characters of at most 4 bytes each)."""
    return 4 * max(len(t) for t in tokenizer.get_vocab())


def is_template_error(e: Exception) -> bool:
    try:
        from jinja2 import TemplateError
    except ImportError:
        return False
    return isinstance(e, TemplateError) and isinstance(getattr(e, "message", None), str)


MESSAGE_FIELDS = {"role", "content", "name", "tool_calls", "tool_call_id"}
REPLY_FIELDS = {"refusal", "annotations", "audio", "reasoning_content", "reasoning",
                "function_call"}
"""Keys OpenAI's (and vLLM's) own replies carry, which clients send back with the
conversation: accepted and not read (audio and function_call only when null)."""


def chat_messages(body: dict, ignored: list[str] | None = None) -> list[dict]:
    """OpenAI messages -> what chat templates read: text content, and assistant tool calls
    (their JSON arguments parsed, as templates expect a mapping) and tool results passed
    through. A message key this server does not know is named in `ignored` (None: strict,
    refused)."""
    msgs = body.get("messages")
    if msgs is None:
        raise bad_request("messages", "messages: required")
    if not isinstance(msgs, list) or not msgs:
        raise bad_request("messages", "messages: must be a non-empty list of {role, content} objects")
    out = []
    for i, m in enumerate(msgs):
        where = f"messages[{i}]"
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise bad_request("messages", f"{where}: must be an object with a string 'role'")
        for key in ("audio", "function_call"):
            if m.get(key) is not None:
                raise bad_request("messages", f"{where}.{key}: not supported by this server",
                                  code="unsupported_parameter")
        extra = sorted(set(m) - MESSAGE_FIELDS - REPLY_FIELDS)
        if extra and ignored is None:
            raise bad_request("messages", f"{where}.{extra[0]}: not supported by this server",
                              code="unsupported_parameter")
        if extra:
            ignored.extend(f"{where}.{k}" for k in extra)
        content = m.get("content")
        if content is None:
            content = ""
        elif isinstance(content, list):   # content parts: only text ones
            texts = []
            for part in content:
                if not (isinstance(part, dict) and part.get("type") == "text"
                        and isinstance(part.get("text"), str)):
                    raise bad_request("messages", f"{where}.content: only text parts are supported")
                texts.append(part["text"])
            content = "".join(texts)
        elif not isinstance(content, str):
            raise bad_request("messages", f"{where}.content: must be a string or a list of text parts")
        role = "system" if m["role"] == "developer" else m["role"]
        msg = {"role": role, "content": content}
        for key in ("name", "tool_call_id"):
            if m.get(key) is not None:
                if not isinstance(m[key], str):
                    raise bad_request("messages", f"{where}.{key}: must be a string")
                msg[key] = m[key]
        if m.get("tool_calls") is not None:
            msg["tool_calls"] = _tool_calls(m["tool_calls"], f"{where}.tool_calls")
        out.append(msg)
    return out


def _tool_calls(calls: Any, where: str) -> list[dict]:
    if not isinstance(calls, list):
        raise bad_request("messages", f"{where}: must be a list")
    out = []
    for j, c in enumerate(calls):
        fn = c.get("function") if isinstance(c, dict) else None
        if not (isinstance(fn, dict) and isinstance(fn.get("name"), str)
                and isinstance(fn.get("arguments"), str)):
            raise bad_request("messages", f"{where}[{j}]: must be {{'type': 'function', 'function': "
                                   "{'name': str, 'arguments': JSON text}}")
        try:
            args = json.loads(fn["arguments"])
        except ValueError:
            raise bad_request("messages", f"{where}[{j}].function.arguments: not valid JSON") from None
        out.append({"id": c.get("id"), "type": c.get("type", "function"),
                    "function": {"name": fn["name"], "arguments": args}})
    return out


MAX_PROMPTS = 1024
"""Prompts one /v1/completions request may batch."""


def completion_prompts(body: dict) -> list[str | list[int]]:
    """`prompt` as OpenAI and vLLM take it: a text, token ids, or a list of either (a batch,
    answered one choice per prompt, times n, in order)."""
    p = body.get("prompt")
    if p is None:
        raise bad_request("prompt", "prompt: required")
    if isinstance(p, list) and p and all(isinstance(x, (str, list)) for x in p):
        if len(p) > MAX_PROMPTS:
            raise bad_request("prompt", f"prompt: at most {MAX_PROMPTS} prompts per request "
                              f"(got {len(p)})")
        prompts = p
    else:
        prompts = [p]
    for i, x in enumerate(prompts):
        if not (isinstance(x, str) or isinstance(x, list) and all(
                isinstance(t, int) and not isinstance(t, bool) for t in x)):
            where = "prompt" if len(prompts) == 1 and prompts[0] is p else f"prompt[{i}]"
            raise bad_request("prompt", f"{where}: must be a string or a list of token ids")
    return prompts


def parse_body(raw: bytes) -> dict:
    """A request body's bytes -> its JSON object, every flaw a 400: not JSON, not UTF-8,
    nested too deeply, not an object, or holding what is not text or not a JSON number."""
    try:
        body = json.loads(raw, parse_constant=NonStandardNumber)
    except json.JSONDecodeError as e:
        raise bad_request(None, f"body: not valid JSON (line {e.lineno}, column {e.colno})",
                   code="invalid_json") from None
    except UnicodeDecodeError as e:
        raise bad_request(None, f"body: not valid UTF-8 (byte {e.start})", code="invalid_json") from None
    except RecursionError:
        raise bad_request(None, "body: nested too deeply", code="invalid_json") from None
    if not isinstance(body, dict):
        raise bad_request(None, "body: must be a JSON object", code="invalid_json")
    check_text(body)
    return body


class NonStandardNumber:
    """What Python's JSON reader makes of the bare NaN, Infinity and -Infinity tokens that
    standard JSON does not have: kept as this, so check_text can refuse it naming the field."""

    def __init__(self, token: str):
        self.token = token


def check_text(body: dict) -> None:
    """JSON may escape lone UTF-16 surrogates ("\\udfff"), which are not text, and Python's
    reader takes NaN and Infinity, which are not JSON: refuse both here, naming the field,
    rather than fail later in the tokenizer, the sampler or a response."""
    stack = [(k, k, v) for k, v in body.items()]
    while stack:
        param, key, value = stack.pop()
        if isinstance(value, NonStandardNumber):
            raise bad_request(param, f"{param}: {value.token} is not a JSON number (JSON has no "
                              "NaN or Infinity)", code="invalid_json")
        for text in ((key, value) if isinstance(value, str) else (key,)):
            bad = next((c for c in text if "\ud800" <= c <= "\udfff"), None)
            if bad is not None:
                raise bad_request(param, f"{param}: contains a lone surrogate (\\u{ord(bad):04x}), "
                                  "which is not Unicode text", code="invalid_text")
        if isinstance(value, dict):
            stack.extend((param, k, v) for k, v in value.items())
        elif isinstance(value, list):
            stack.extend((param, "", v) for v in value)
