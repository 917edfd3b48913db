"""A bounded, seeded, property-based fuzz of `workbench serve` (issue 27): valid bodies of the
endpoints (completions, chat, the Responses API, tokenize), streamed and not, with one to three fields replaced by hostile values (wrong types,
numbers past their type, bare NaN/Infinity, lone surrogates, deep nesting, unknown fields),
with an API key and without. No 5xx, no exception text in any body, ordinary requests
running alongside all finish, and /health answers after."""
from __future__ import annotations

import json
import sys
import threading

import pytest

hypothesis = pytest.importorskip("hypothesis")
httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")

from hypothesis import HealthCheck, given, settings, strategies as st  # noqa: E402

from conftest import start_server, stop_tree  # noqa: E402

KEY = "sk-fuzz"
EXAMPLES = 70
"""Per endpoint and server (8 combinations): about 560 hostile requests a run."""

NUMBERS = st.one_of(
    st.integers(min_value=2 ** 31, max_value=2 ** 80), st.integers(min_value=-2 ** 80, max_value=-1),
    st.floats(min_value=1e6, max_value=1e300), st.floats(min_value=-1e300, max_value=-1e-300),
    st.sampled_from([0, 1, -1, 0.5, 2 ** 63, 2 ** 64 + 1, 10 ** 400, 1e-320]))
HOSTILE = st.one_of(
    NUMBERS, st.none(), st.booleans(), st.text(max_size=12),
    st.sampled_from(["", "\udfff", "a\ud800b", "NaN", "Infinity", [], {}, [1, "x"], {"a": [1]},
                     [[[[[]]]]], {"role": "user"}, [{"role": "nobody", "content": 3}],
                     "RAW:NaN", "RAW:Infinity", "RAW:-Infinity", "DEEP",
                     # shaped like what the tool and batch fields take, broken inside
                     [{"type": "function", "function": {"name": "f", "parameters": {
                         "type": "object", "properties": {"x": {"type": "integer"}}}}}],
                     [{"type": "function", "function": {"name": "f", "parameters": {
                         "type": "object", "properties": {"x": {"type": "nonsense"}}}}}],
                     [{"type": "function", "function": {"name": "\udfff"}}],
                     {"type": "function", "function": {"name": "f"}}, "required", "auto",
                     ["Hello", [1, 2]], [[1, 2], [10 ** 30]], ["a"] * 2000,
                     # shaped like the Responses API's items, tools and formats, broken inside
                     [{"type": "function", "name": "f", "parameters": {
                         "type": "object", "properties": {"x": {"type": "integer"}}}}],
                     [{"type": "web_search"}], {"type": "function", "name": "nope"},
                     [{"type": "function_call", "call_id": "c", "name": "f", "arguments": "{"}],
                     [{"type": "function_call_output", "call_id": "c", "output": 3}],
                     [{"role": "user", "content": [{"type": "input_text", "text": "\udfff"}]}],
                     [{"role": "user", "content": [{"type": "input_image"}]}],
                     [{"type": "reasoning", "summary": []}, {"role": "assistant", "content": 1}],
                     {"format": {"type": "json_schema", "name": "x", "schema": {"type": "nope"}}},
                     {"format": {"type": "json_schema", "schema": {"type": "object"},
                                 "strict": True}}, {"format": "text"}, {"effort": 5},
                     "resp_" + "0" * 32]),
    st.lists(st.integers(min_value=-2 ** 70, max_value=2 ** 70), max_size=4),
    st.dictionaries(st.text(max_size=4), st.integers(), max_size=2))

COMPLETION = {"prompt": "Hello", "max_tokens": 2, "temperature": 0.7}
CHAT = {"messages": [{"role": "user", "content": "Hello"}], "max_tokens": 2}
RESPONSES = {"input": "Hello", "max_output_tokens": 2}
FIELDS = {
    "/v1/completions": ["prompt", "max_tokens", "temperature", "top_p", "top_k", "min_p", "n",
                        "seed", "stop", "stop_token_ids", "logprobs", "echo", "logit_bias",
                        "presence_penalty", "frequency_penalty", "repetition_penalty",
                        "min_tokens", "stream_options", "ignore_eos", "prompt_logprobs",
                        "truncate_prompt_tokens", "structured_outputs", "user", "an_unknown"],
    "/tokenize": ["prompt", "messages", "tools", "add_special_tokens", "return_token_strs",
                  "chat_template", "add_generation_prompt", "an_unknown"],
    "/v1/responses": ["input", "instructions", "max_output_tokens", "temperature", "top_p",
                      "tools", "tool_choice", "parallel_tool_calls", "text", "reasoning",
                      "previous_response_id", "store", "include", "truncation", "background",
                      "metadata", "service_tier", "logit_bias", "seed", "an_unknown"],
    "/v1/chat/completions": ["messages", "max_tokens", "max_completion_tokens", "temperature",
                             "top_p", "top_k", "n", "seed", "stop", "logprobs", "top_logprobs",
                             "logit_bias", "response_format", "min_tokens", "stream_options",
                             "chat_template_kwargs", "add_generation_prompt", "user",
                             "tools", "tool_choice", "parallel_tool_calls", "an_unknown"],
}


def encode(body: dict) -> str:
    """JSON text, with the RAW: markers written as bare tokens and DEEP as 5,000-deep
    nesting (what json.dumps will not write)."""
    text = json.dumps(body)
    for token in ("NaN", "Infinity", "-Infinity"):
        text = text.replace(f'"RAW:{token}"', token)
    return text.replace('"DEEP"', "[" * 5000 + "]" * 5000)


@pytest.fixture(scope="module", params=["api-key", "no-key"])
def served(request, smollm2_dir, tmp_path_factory):
    key = KEY if request.param == "api-key" else None
    log = tmp_path_factory.mktemp("fuzz") / "server.log"
    proc, url = start_server([sys.executable, "-m", "workbench.cli", "serve", "--device", "cpu",
                              "--model", "smollm2", "--num-kv-blocks", "256",
                              "--max-model-len", "512", "--log-level", "warning",
                              *(["--api-key", key] if key else [])], log, what="workbench serve")
    yield url, ({"Authorization": f"Bearer {key}"} if key else {}), log
    assert stop_tree(proc) == [], "processes outlived the fuzzed server"


def _ordinary_alongside(url, headers, results):
    body = {"model": "smollm2", "prompt": "Once upon a time", "max_tokens": 24,
            "temperature": 0.7, "ignore_eos": True, "stream": True}
    with httpx.Client(base_url=url, headers=headers, timeout=600) as c:
        for _ in range(3):
            with c.stream("POST", "/v1/completions", json=body) as r:
                text = "".join(r.iter_text())
            results.append((r.status_code, text.count('"text"'), text.rstrip().endswith("[DONE]")))


@pytest.mark.parametrize("endpoint", list(FIELDS))
def test_hostile_bodies_get_4xx_and_the_server_serves_on(served, endpoint):
    url, headers, log = served
    base = {"/v1/completions": COMPLETION, "/v1/chat/completions": CHAT,
            "/tokenize": {"prompt": "Hello"}, "/v1/responses": RESPONSES}[endpoint]
    seen = {"4xx": 0, "2xx": 0}
    ordinary: list = []
    alongside = threading.Thread(target=_ordinary_alongside, args=(url, headers, ordinary))
    alongside.start()
    client = httpx.Client(base_url=url, headers=headers, timeout=120)

    @settings(max_examples=EXAMPLES, deadline=None, derandomize=True, database=None,
              suppress_health_check=list(HealthCheck))
    @given(changes=st.dictionaries(st.sampled_from(FIELDS[endpoint]), HOSTILE, min_size=1,
                                   max_size=3),
           stream=st.booleans())
    def one(changes, stream):
        body = {"model": "smollm2", **base, **changes, "stream": stream}
        r = client.post(endpoint, content=encode(body), headers={"content-type": "application/json"})
        text = r.text
        assert r.status_code < 500, (changes, r.status_code, text[:500])
        assert "Traceback" not in text and "Exception" not in text, (changes, text[:500])
        if r.status_code >= 400:
            err = r.json()["error"]
            assert err["message"] and err["type"], (changes, text[:300])
            seen["4xx"] += 1
        else:
            seen["2xx"] += 1

    try:
        one()
    finally:
        client.close()
        alongside.join(timeout=600)
    assert seen["4xx"] > EXAMPLES // 2, seen           # the fuzz does reach the checks
    assert ordinary and all(code == 200 and n >= 24 and done for code, n, done in ordinary), \
        ordinary
    assert httpx.get(url + "/health", timeout=10).status_code == 200
    assert "Traceback" not in log.read_text(errors="replace"), log.read_text()[-3000:]
