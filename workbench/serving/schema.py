"""The request bodies of /v1/completions, /v1/chat/completions and /v1/responses, declared
once as pydantic models (as vLLM declares them): the fields, their JSON types and ranges,
whether this server does what each asks for (or ignores it, warning), and which of its values
ask for nothing. The app serves them as /openapi.json (and /docs), so schema-driven tools have
something to read; protocol.py's REQUEST_FIELDS, which every request's fields are checked
against, is derived from them.

The handlers do not parse bodies through these models: they read the JSON themselves, so
that each bad field gets OpenAI's error shape with a message that names it (see protocol.py).
"""
from __future__ import annotations

from typing import Any, Union

from pydantic import BaseModel, ConfigDict, Field

SUPPORTED, UNSUPPORTED, IGNORED = "supported", "unsupported", "ignored"
"""IGNORED: accepted whatever its value and not used (it changes nothing this server
computes), but warned about as an unknown field is: named in the X-Workbench-Ignored-Fields
header and the log."""


def field(status: str = SUPPORTED, neutral: tuple = (), description: str = "", **range_) -> Any:
    """An optional field. status: whether this server does what it asks for (an unsupported
    field is refused unless its value is null or one of `neutral`, the values that ask for
    nothing); range_: pydantic's ge/gt/le/lt for the schema."""
    extra = {"x-workbench": status}
    if neutral:
        extra["x-asks-nothing"] = list(neutral)
    return Field(None, description=description or None, json_schema_extra=extra, **range_)


class _Common(BaseModel):
    """Fields both endpoints take."""
    model_config = ConfigDict(extra="forbid")
    # OpenAI's
    model: str | None = field(description="the served model's id")
    stream: bool | None = field()
    stream_options: dict[str, Any] | None = field(description="include_usage, "
                                                  "continuous_usage_stats")
    max_tokens: int | None = field(ge=0)
    temperature: float | None = field(ge=0)
    top_p: float | None = field(gt=0, le=1)
    seed: int | None = field(ge=-2 ** 63, lt=2 ** 63)
    stop: Union[str, list[str], None] = field()
    response_format: dict[str, Any] | None = field(description="text, json_object or "
                                                   "json_schema")
    n: int | None = field(neutral=(1,), ge=1, le=128)
    presence_penalty: float | None = field(neutral=(0,), ge=-2, le=2)
    frequency_penalty: float | None = field(neutral=(0,), ge=-2, le=2)
    logit_bias: dict[str, float] | None = field(neutral=({},),
                                                description="token id -> bias in [-100, 100]")
    user: str | None = field(description="the end user's id (accepted, not used)")
    # vLLM's extras
    top_k: int | None = field(ge=-1)
    stop_token_ids: list[int] | None = field()
    ignore_eos: bool | None = field()
    structured_outputs: dict[str, Any] | None = field(description="one of json, regex, "
                                                      "choice, grammar, json_object")
    guided_json: Union[dict[str, Any], str, None] = field(description="vLLM's legacy name")
    guided_regex: str | None = field()
    guided_choice: list[str] | None = field()
    guided_grammar: str | None = field()
    add_special_tokens: bool | None = field()
    truncate_prompt_tokens: int | None = field(ge=-1)
    min_p: float | None = field(neutral=(0,), ge=0, le=1)
    repetition_penalty: float | None = field(neutral=(1,), gt=0, le=100)
    min_tokens: int | None = field(neutral=(0,), ge=0)
    prompt_logprobs: int | None = field(ge=0, le=20)
    include_stop_str_in_output: bool | None = field(neutral=(False,))
    skip_special_tokens: bool | None = field(neutral=(True,))
    use_beam_search: bool | None = field(UNSUPPORTED, (False,))
    length_penalty: float | None = field(UNSUPPORTED, (1,))
    guided_decoding_backend: str | None = field(UNSUPPORTED)
    guided_whitespace_pattern: str | None = field(UNSUPPORTED)
    allowed_token_ids: list[int] | None = field(UNSUPPORTED)
    bad_words: list[str] | None = field(UNSUPPORTED, ([],))
    spaces_between_special_tokens: bool | None = field(UNSUPPORTED, (True,))
    priority: int | None = field(UNSUPPORTED, (0,))
    request_id: str | None = field(UNSUPPORTED)
    logits_processors: list[Any] | None = field(UNSUPPORTED)
    return_tokens_as_token_ids: bool | None = field(UNSUPPORTED, (False,))
    return_token_ids: bool | None = field(UNSUPPORTED, (False,))
    cache_salt: str | None = field(UNSUPPORTED)
    kv_transfer_params: dict[str, Any] | None = field(UNSUPPORTED)
    vllm_xargs: dict[str, Any] | None = field(UNSUPPORTED)


class CompletionRequest(_Common):
    """POST /v1/completions."""
    prompt: Union[str, list[int], list[str], list[list[int]], None] = field(
        description="text, token ids, or a list of either (a batch: one choice per prompt, "
                    "times n, choice index = prompt index * n + i)")
    logprobs: int | None = field(ge=0, le=20, description="alternatives per token")
    echo: bool | None = field()
    best_of: int | None = field(UNSUPPORTED, (1,))
    suffix: str | None = field(UNSUPPORTED, ("",))


class ChatCompletionRequest(_Common):
    """POST /v1/chat/completions."""
    messages: list[dict[str, Any]] | None = field(description="the conversation")
    max_completion_tokens: int | None = field(ge=0)
    logprobs: bool | None = field()
    top_logprobs: int | None = field(ge=0, le=20)
    echo: bool | None = field(UNSUPPORTED, (False,), description="vLLM's: the last message "
                              "before the reply (not done here)")
    add_generation_prompt: bool | None = field()
    continue_final_message: bool | None = field()
    chat_template: str | None = field()
    chat_template_kwargs: dict[str, Any] | None = field()
    tools: list[dict[str, Any]] | None = field(description="functions the model may call "
                                               "(at most 128)", max_length=128)
    tool_choice: Union[str, dict[str, Any], None] = field(
        description="none, auto, required, or {'type': 'function', 'function': {'name': ...}}")
    parallel_tool_calls: bool | None = field()
    functions: list[Any] | None = field(UNSUPPORTED, ([],))
    function_call: Union[str, dict[str, Any], None] = field(UNSUPPORTED, ("none",))
    modalities: list[str] | None = field(UNSUPPORTED, (["text"],))
    audio: dict[str, Any] | None = field(UNSUPPORTED)
    prediction: dict[str, Any] | None = field(UNSUPPORTED)
    service_tier: str | None = field(IGNORED, description="accepted, ignored (as vLLM)")
    web_search_options: dict[str, Any] | None = field(UNSUPPORTED)
    reasoning_effort: str | None = field(description="passed to the chat template as the "
                                         "variable reasoning_effort (as vLLM)")
    verbosity: str | None = field(IGNORED, description="accepted, ignored")
    store: bool | None = field(UNSUPPORTED, (False,))
    metadata: dict[str, Any] | None = field(description="tags (accepted, not used)")
    prompt_cache_key: str | None = field(IGNORED, description="accepted, ignored (the "
                                         "prefix cache needs no key)")
    safety_identifier: str | None = field(IGNORED, description="accepted, ignored")
    documents: list[Any] | None = field(UNSUPPORTED)
    mm_processor_kwargs: dict[str, Any] | None = field(UNSUPPORTED)


class ResponsesRequest(BaseModel):
    """POST /v1/responses (OpenAI's Responses API), run as a chat request (responses_api.py)."""
    model_config = ConfigDict(extra="forbid")
    model: str | None = field(description="the served model's id")
    input: Union[str, list[dict[str, Any]], None] = field(
        description="a text, or items: messages, function_call, function_call_output "
                    "(reasoning items sent back are accepted and not read)")
    instructions: str | None = field(description="a system message, first (not carried "
                                     "over by previous_response_id)")
    previous_response_id: str | None = field(description="continue a stored response's "
                                             "conversation")
    store: bool | None = field(description="keep the response for previous_response_id and "
                               "GET /v1/responses/{id} (default true; in memory, bounded)")
    stream: bool | None = field(description="typed server-sent events")
    max_output_tokens: int | None = field(ge=1)
    temperature: float | None = field(ge=0)
    top_p: float | None = field(gt=0, le=1)
    tools: list[dict[str, Any]] | None = field(description="function tools (at most 128); "
                                               "built-in tools are refused", max_length=128)
    tool_choice: Union[str, dict[str, Any], None] = field(
        description="none, auto, required, or {'type': 'function', 'name': ...}")
    parallel_tool_calls: bool | None = field()
    text: dict[str, Any] | None = field(description="format: text, json_object or json_schema "
                                        "(verbosity is ignored)")
    reasoning: dict[str, Any] | None = field(description="effort: passed to the chat template "
                                             "as reasoning_effort (summary is ignored)")
    metadata: dict[str, Any] | None = field(description="tags, returned with the response")
    user: str | None = field(description="the end user's id (accepted, not used)")
    safety_identifier: str | None = field(IGNORED)
    prompt_cache_key: str | None = field(IGNORED)
    prompt_cache_retention: str | None = field(IGNORED)
    service_tier: str | None = field(IGNORED)
    include: list[str] | None = field(IGNORED, description="extra output to include (none "
                                      "is produced here)")
    stream_options: dict[str, Any] | None = field(IGNORED)
    truncation: str | None = field(UNSUPPORTED, ("disabled",))
    background: bool | None = field(UNSUPPORTED, (False,))
    max_tool_calls: int | None = field(UNSUPPORTED)
    top_logprobs: int | None = field(UNSUPPORTED, (0,))
    prompt: dict[str, Any] | None = field(UNSUPPORTED, description="stored prompt templates")
    conversation: Union[str, dict[str, Any], None] = field(UNSUPPORTED)
    # vLLM's sampling extras, as on chat
    top_k: int | None = field(ge=-1)
    min_p: float | None = field(neutral=(0,), ge=0, le=1)
    repetition_penalty: float | None = field(neutral=(1,), gt=0, le=100)
    seed: int | None = field(ge=-2 ** 63, lt=2 ** 63)
    stop: Union[str, list[str], None] = field()
    ignore_eos: bool | None = field()
    logit_bias: dict[str, float] | None = field(neutral=({},),
                                                description="token id -> bias in [-100, 100]")
    chat_template_kwargs: dict[str, Any] | None = field()


class TokenizeRequest(BaseModel):
    """POST /tokenize (vLLM's): a text, or chat messages through the chat template."""
    model_config = ConfigDict(extra="forbid")
    model: str | None = field()
    prompt: str | None = field(description="a text (or give messages)")
    messages: list[dict[str, Any]] | None = field(description="a conversation, rendered as "
                                                  "/v1/chat/completions renders it")
    add_special_tokens: bool | None = field()
    add_generation_prompt: bool | None = field()
    continue_final_message: bool | None = field()
    chat_template: str | None = field()
    chat_template_kwargs: dict[str, Any] | None = field()
    tools: list[dict[str, Any]] | None = field(max_length=128)
    return_token_strs: bool | None = field(description="each token's text too")


class DetokenizeRequest(BaseModel):
    """POST /detokenize (vLLM's)."""
    model_config = ConfigDict(extra="forbid")
    model: str | None = field()
    tokens: list[int] | None = field(description="token ids (required)")


REQUESTS = {"completion": CompletionRequest, "chat": ChatCompletionRequest,
            "responses": ResponsesRequest, "tokenize": TokenizeRequest,
            "detokenize": DetokenizeRequest}
"""Each endpoint's body, by the name protocol.py gives the endpoint."""


def request_fields() -> dict[str, dict[str, tuple[str, tuple]]]:
    """endpoint -> field name -> (SUPPORTED or UNSUPPORTED, the values that ask for nothing),
    from the models (protocol.REQUEST_FIELDS). Per endpoint: one name may be supported on
    one and refused on another (`echo`)."""
    return {kind: {name: ((info.json_schema_extra or {})["x-workbench"],
                          tuple((info.json_schema_extra or {}).get("x-asks-nothing", ())))
                   for name, info in model.model_fields.items()}
            for kind, model in REQUESTS.items()}
