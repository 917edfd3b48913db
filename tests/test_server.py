"""`workbench serve`, tested as a client sees it: a real server subprocess on 127.0.0.1, the
official openai SDK, raw HTTP, a real nginx in front, and the remote source."""
from __future__ import annotations

import asyncio
import json
import math
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

import conftest

httpx = pytest.importorskip("httpx")
openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
pytest.importorskip("sse_starlette")
pytest.importorskip("prometheus_client")

from workbench.bench.serving import bench_async  # noqa: E402
from workbench.serving.client import RemoteEngine, RemoteError, sse_data  # noqa: E402
from workbench.serving.prometheus import parse_prometheus, summarize_metrics  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
KEY = "sk-test-0123456789"
AUTH = {"Authorization": f"Bearer {KEY}"}
MODEL = "smollm2"
MAX_MODEL_LEN = 1024


def start_server(extra: list[str], log_path: Path, timeout: float = 180.0):
    """`workbench serve` on the CPU (conftest.start_server: a free loopback port, bounded wait
    for /health). Returns (proc, url)."""
    return conftest.start_server([sys.executable, "-m", "workbench.cli", "serve", "--device",
                                  "cpu", "--log-level", "warning", *extra], log_path,
                                 timeout=timeout, what="workbench serve")


def stop_process(proc, sig=signal.SIGTERM, timeout: float = 20.0) -> None:
    """Stop a server started above, its process group and all; fail if anything outlived it."""
    assert conftest.stop_tree(proc, timeout, sig) == [], "processes outlived the server's stop"


LOGS: dict[str, Path] = {}
"""Each module server's log, by its URL."""


@pytest.fixture(scope="module")
def server(smollm2_dir, tmp_path_factory):
    log_path = tmp_path_factory.mktemp("serve") / "server.log"
    proc, url = start_server(["--model", MODEL, "--api-key", KEY, "--num-kv-blocks", "512",
                              "--max-model-len", str(MAX_MODEL_LEN)], log_path)
    LOGS[url] = log_path
    yield url
    stop_process(proc)


def scrape(url: str) -> dict:
    r = httpx.get(url + "/metrics", timeout=10.0)
    assert r.status_code == 200
    return summarize_metrics(parse_prometheus(r.text))


def wait_idle(url: str, timeout: float = 30.0) -> dict:
    """Poll /metrics (bounded) until nothing runs, waits or holds KV blocks."""
    deadline = time.monotonic() + timeout
    while True:
        m = scrape(url)
        if (m["num_requests_running"], m["num_requests_waiting"], m["kv_cache_usage_perc"]) == (0, 0, 0):
            return m
        if time.monotonic() > deadline:
            gauges = {k: v for k, v in m.items() if k not in ("histograms", "samples")}
            pytest.fail(f"server not idle after {timeout} s: {gauges}")
        time.sleep(0.1)


# ---- the official SDK -----------------------------------------------------------------------
def test_openai_sdk_completions_and_chat(server, smollm2_tokenizer):
    client = openai.OpenAI(base_url=server + "/v1", api_key=KEY, max_retries=0, timeout=120)
    assert [m.id for m in client.models.list().data] == [MODEL]

    # Completions, not streamed, then streamed with usage: the same greedy text.
    prompt = "The capital of France is"
    c = client.completions.create(model=MODEL, prompt=prompt, max_tokens=8, temperature=0,
                                  extra_body={"ignore_eos": True})
    text = c.choices[0].text
    assert text and c.choices[0].finish_reason == "length"
    assert c.usage.completion_tokens == 8
    assert c.usage.prompt_tokens == len(smollm2_tokenizer.encode(prompt))
    assert c.usage.total_tokens == c.usage.prompt_tokens + 8

    chunks = list(client.completions.create(model=MODEL, prompt=prompt, max_tokens=8, temperature=0,
                                            extra_body={"ignore_eos": True}, stream=True,
                                            stream_options={"include_usage": True}))
    assert "".join(ch.choices[0].text for ch in chunks if ch.choices) == text
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] == "length"
    assert len([ch for ch in chunks if ch.choices and ch.choices[0].text]) >= 4   # token by token
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 8
    assert all(ch.usage is None for ch in chunks[:-1])

    # Stop strings: cut the same text at a word in its middle.
    words = text.split()
    if len(words) >= 3:
        stop = " " + words[2]
        cut = client.completions.create(model=MODEL, prompt=prompt, max_tokens=8, temperature=0,
                                        stop=[stop, "\u2603"], extra_body={"ignore_eos": True})
        assert cut.choices[0].finish_reason == "stop"
        assert cut.choices[0].text == text[:text.index(stop)]

    # A seed makes sampling repeatable.
    a, b = (client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=10,
                                      temperature=1.0, top_p=0.95, seed=1234,
                                      extra_body={"top_k": 50, "ignore_eos": True}).choices[0].text
            for _ in range(2))
    assert a == b and a

    # Chat goes through the chat template.
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    r = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=12, temperature=0)
    answer = r.choices[0].message.content
    assert "Paris" in answer and r.choices[0].message.role == "assistant"
    templated = smollm2_tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    expected_prompt = len(smollm2_tokenizer.encode(templated, add_special_tokens=False))
    assert r.usage.prompt_tokens == expected_prompt
    assert 0 < r.usage.completion_tokens <= 12

    chunks = list(client.chat.completions.create(model=MODEL, messages=messages, max_tokens=12,
                                                 temperature=0, stream=True,
                                                 stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices) == answer
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] == r.choices[0].finish_reason
    assert chunks[-1].usage.prompt_tokens == expected_prompt
    assert chunks[-1].usage.completion_tokens == r.usage.completion_tokens

    # max_completion_tokens (the newer name) wins over max_tokens.
    r = client.chat.completions.create(model=MODEL, messages=messages, max_completion_tokens=3,
                                       max_tokens=50, extra_body={"ignore_eos": True})
    assert r.usage.completion_tokens == 3 and r.choices[0].finish_reason == "length"


def test_stream_headers_and_done(server):
    body = {"model": MODEL, "prompt": "Hello", "max_tokens": 4, "stream": True}
    with httpx.stream("POST", server + "/v1/completions", json=body, headers=AUTH, timeout=60) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        assert r.headers["cache-control"] == "no-cache"
        assert r.headers["x-accel-buffering"] == "no"
        data = list(sse_data(r.iter_lines()))
    assert data[-1] == "[DONE]"
    assert all(isinstance(json.loads(d), dict) for d in data[:-1])


def test_metrics_exposition_uses_vllm_names(server):
    r = httpx.get(server + "/metrics", timeout=10)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    text = r.text
    for gauge in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc"):
        assert f"# TYPE vllm:{gauge} gauge" in text
        assert re.search(rf'^vllm:{gauge}{{model_name="{MODEL}"}} \S+$', text, re.M), gauge
    for counter in ("num_preemptions_total", "prompt_tokens_total", "generation_tokens_total"):
        assert re.search(rf'^vllm:{counter}{{model_name="{MODEL}"}} \S+$', text, re.M), counter
    for reason in ("stop", "length", "abort"):
        assert f'vllm:request_success_total{{finished_reason="{reason}",model_name="{MODEL}"}}' in text
    for hist in ("time_to_first_token_seconds", "inter_token_latency_seconds",
                 "e2e_request_latency_seconds"):
        assert f"# TYPE vllm:{hist} histogram" in text
        assert f'vllm:{hist}_bucket{{le="+Inf",model_name="{MODEL}"}}' in text
        assert f'vllm:{hist}_count{{model_name="{MODEL}"}}' in text


# ---- bad input ------------------------------------------------------------------------------
BAD = [
    # (path, json body or raw bytes, status, param)
    ("/v1/completions", b"{not json", 400, None),
    ("/v1/completions", b"[1, 2]", 400, None),
    ("/v1/completions", {"model": "gpt-17", "prompt": "hi"}, 404, "model"),
    ("/v1/chat/completions", {"model": "gpt-17", "messages": [{"role": "user", "content": "x"}]}, 404, "model"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 0}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": "ten"}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 10 * MAX_MODEL_LEN}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": "hi", "temperature": -1}, 400, "temperature"),
    ("/v1/completions", {"prompt": "hi", "temperature": "hot"}, 400, "temperature"),
    ("/v1/completions", {"prompt": "hi", "top_p": 0}, 400, "top_p"),
    ("/v1/completions", {"prompt": "hi", "top_p": 1.5}, 400, "top_p"),
    ("/v1/completions", {"prompt": "hi", "top_k": -5}, 400, "top_k"),
    ("/v1/completions", {"prompt": "hi", "seed": "abc"}, 400, "seed"),
    ("/v1/completions", {"prompt": "hi", "seed": 2**70}, 400, "seed"),
    ("/v1/completions", {"prompt": "hi", "stop": 5}, 400, "stop"),
    ("/v1/completions", {"prompt": "hi", "stop": [""]}, 400, "stop"),
    ("/v1/completions", {"prompt": "hi", "n": 0}, 400, "n"),
    ("/v1/completions", {"prompt": "hi", "n": 2, "best_of": 3}, 400, "best_of"),
    ("/v1/completions", {"prompt": "hi", "presence_penalty": 3}, 400, "presence_penalty"),
    ("/v1/completions", {"prompt": "hi", "repetition_penalty": 0}, 400, "repetition_penalty"),
    ("/v1/completions", {"prompt": "hi", "min_p": 2}, 400, "min_p"),
    ("/v1/completions", {"prompt": "hi", "logit_bias": {"x": 1}}, 400, "logit_bias"),
    ("/v1/completions", {"prompt": "hi", "logit_bias": [1]}, 400, "logit_bias"),
    ("/v1/completions", {"prompt": "hi", "min_tokens": 99}, 400, "min_tokens"),
    ("/v1/completions", {"prompt": "hi", "echo": "yes"}, 400, "echo"),
    ("/v1/completions", {"prompt": "hi", "skip_special_tokens": "no"}, 400, "skip_special_tokens"),
    ("/v1/completions", {"prompt": "hi", "ignore_eos": "yes"}, 400, "ignore_eos"),
    ("/v1/completions", {"prompt": "hi", "stream": "yes"}, 400, "stream"),
    ("/v1/completions", {"prompt": "hi", "stream_options": {"include_usage": True}}, 400, "stream_options"),
    ("/v1/completions", {"prompt": "hi", "logprobs": 21}, 400, "logprobs"),
    ("/v1/completions", {"prompt": "hi", "logprobs": True}, 400, "logprobs"),
    ("/v1/completions", {"prompt": ""}, 400, "prompt"),
    ("/v1/completions", {"max_tokens": 4}, 400, "prompt"),
    ("/v1/completions", {"prompt": []}, 400, "prompt"),
    ("/v1/completions", {"prompt": ["a", 5]}, 400, "prompt"),
    ("/v1/completions", {"prompt": ["a", [1, "x"]]}, 400, "prompt"),
    ("/v1/completions", {"prompt": ["a"] * 1025}, 400, "prompt"),
    ("/v1/completions", {"prompt": ["hi", "word " * (MAX_MODEL_LEN + 50)]}, 400, "prompt"),
    ("/v1/completions", {"prompt": "hi", "prompt_logprobs": 1, "stream": True}, 400, "prompt_logprobs"),
    ("/v1/completions", {"prompt": "hi", "logit_bias": {"49152": 5}}, 400, "logit_bias"),
    ("/v1/completions", {"prompt": "hi", "logit_bias": {"-1": 5}}, 400, "logit_bias"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "min_tokens": 5000},
     400, "min_tokens"),
    ("/v1/completions", {"prompt": [10**9]}, 400, "prompt"),
    ("/v1/completions", {"prompt": {"text": "hi"}}, 400, "prompt"),
    ("/v1/completions", {"prompt": "word " * (MAX_MODEL_LEN + 50)}, 400, "prompt"),
    ("/v1/completions", {"prompt": "word " * (MAX_MODEL_LEN + 50), "stream": True}, 400, "prompt"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 0, "stream": True}, 400, "max_tokens"),
    ("/v1/chat/completions", {"messages": []}, 400, "messages"),
    ("/v1/chat/completions", {}, 400, "messages"),
    ("/v1/chat/completions", {"messages": [{"content": "no role"}]}, 400, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": 5}]}, 400, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x " * (MAX_MODEL_LEN + 50)}]},
     400, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                              "max_completion_tokens": -1}, 400, "max_completion_tokens"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "top_p": True},
     400, "top_p"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "top_logprobs": 2},
     400, "top_logprobs"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "logprobs": True,
                              "top_logprobs": 21}, 400, "top_logprobs"),
]


def assert_openai_error(r, status: int, param=None):
    assert r.status_code == status, (r.status_code, r.text)
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert isinstance(err["message"], str) and err["message"]
    assert err["param"] == param, err
    return err


def test_bad_input_answers_openai_errors_and_server_keeps_serving(server):
    before = wait_idle(server)
    with httpx.Client(base_url=server, timeout=60) as c:
        # Authentication.
        body = {"model": MODEL, "prompt": "hi", "max_tokens": 2}
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}):
            err = assert_openai_error(c.post("/v1/completions", json=body, headers=headers), 401)
            assert err["code"] == "invalid_api_key"
        assert_openai_error(c.get("/v1/models"), 401)
        assert c.get("/health").status_code == 200          # unauthenticated by design
        assert c.get("/metrics").status_code == 200

        for path, payload, status, param in BAD:
            if isinstance(payload, bytes):
                r = c.post(path, content=payload, headers={**AUTH, "Content-Type": "application/json"})
            else:
                r = c.post(path, json={"model": MODEL, **payload} if "model" not in payload else payload,
                           headers=AUTH)
            err = assert_openai_error(r, status, param)
            if param is not None and status == 400:
                assert err["message"].startswith(param), err
            assert err["type"] == "invalid_request_error"
        err = assert_openai_error(c.post("/v1/completions", json={"model": MODEL, "prompt": "word " * 2000},
                                         headers=AUTH),
                                  400, "prompt")
        assert err["code"] == "context_length_exceeded"

        # Unknown routes and methods answer in the same shape.
        assert_openai_error(c.get("/v1/nothing", headers=AUTH), 404)
        assert_openai_error(c.get("/v1/completions", headers=AUTH), 405)

        # Still serving, and nothing was queued by the refused requests.
        r = c.post("/v1/completions", json={"model": MODEL, "prompt": "Hello", "max_tokens": 3,
                                            "ignore_eos": True}, headers=AUTH)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3
    after = wait_idle(server)
    done = lambda m: sum(m["request_success_total"].values())   # noqa: E731
    assert done(after) - done(before) == 1


# ---- the field rule: nothing accepted and ignored ------------------------------------------
HI = [{"role": "user", "content": "hi"}]
# Every field issue 12 found ignored, with a value that asks for something.
# (tools, tool_choice and parallel_tool_calls are served now: tests/test_tool_calling.py; user
# and metadata ask for nothing that changes what is computed; service_tier, verbosity,
# prompt_cache_key and safety_identifier are accepted and warned about, and reasoning_effort
# reaches the chat template: tests/test_responses.py.)
UNSUPPORTED = [
    ("function_call", "auto"), ("functions", [{"name": "f"}]), ("modalities", ["audio"]),
    ("audio", {"voice": "alloy"}), ("prediction", {"type": "content", "content": "x"}),
    ("web_search_options", {}), ("store", True), ("use_beam_search", True), ("length_penalty", 0.5), ("echo", True),
    ("guided_decoding_backend", "xgrammar"),
]
# Supported ones are parsed: a bad value is a 400 that names the field.
PARSED = [
    ("repetition_penalty", 0), ("min_p", 1.5), ("prompt_logprobs", 21),
    ("include_stop_str_in_output", "yes"), ("skip_special_tokens", "no"),
    ("presence_penalty", 2.5), ("logit_bias", {"x": 1}), ("min_tokens", 3), ("n", 0),
    ("logprobs", 3), ("top_logprobs", 2),
    ("guided_json", {"type": "nonsense"}), ("guided_choice", []), ("guided_regex", "(("),
    ("guided_grammar", "start: nowhere"), ("structured_outputs", {"regex": "(("}),
    ("structured_outputs", {"json": {"type": "object"}, "regex": "a"}),
    ("response_format", {"type": "json_schema", "json_schema": {"name": "x",
                                                                "schema": {"type": "nonsense"}}}),
    ("response_format", {"type": "xml"}), ("add_generation_prompt", "yes"),
    ("continue_final_message", True),           # with add_generation_prompt (default true)
    ("chat_template", "{% if %}"), ("chat_template_kwargs", {"tokenize": True}),
    ("truncate_prompt_tokens", 0), ("add_special_tokens", "no"),
]


@pytest.mark.parametrize("name,value,kind", [(n, v, "unsupported_parameter") for n, v in UNSUPPORTED]
                         + [(n, v, None) for n, v in PARSED])
def test_no_field_is_accepted_and_ignored(server, name, value, kind):
    body = {"model": MODEL, "messages": HI, "max_tokens": 2, name: value}
    err = assert_openai_error(httpx.post(server + "/v1/chat/completions", json=body, headers=AUTH,
                                         timeout=60), 400, name)
    assert err["code"] == kind and err["message"].startswith(name), err


def test_one_name_is_judged_by_the_endpoint_it_is_sent_to():
    """`echo` is completions' own field (the prompt before the text) and a refused one on chat
    (vLLM's echo of the last message): the table is per endpoint, not per name."""
    from workbench.serving.protocol import APIError, check_fields
    assert check_fields("completion", {"prompt": "x", "echo": True}) == []
    assert check_fields("chat", {"messages": HI, "echo": False}) == []
    with pytest.raises(APIError) as e:
        check_fields("chat", {"messages": HI, "echo": True})
    assert e.value.param == "echo" and e.value.code == "unsupported_parameter"


UNKNOWN = [
    ("/v1/chat/completions", {"messages": HI, "temprature": 0}, ["temprature"]),
    ("/v1/completions", {"prompt": "hi", "messages": HI}, ["messages"]),
    ("/v1/completions", {"prompt": "hi", "max_completion_tokens": 1}, ["max_completion_tokens"]),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi", "x_trace": "t1"}],
                              "client_tag": {"a": 1}}, ["client_tag", "messages[0].x_trace"]),
]


def test_unknown_fields_are_ignored_warned_and_named(server):
    """As vLLM: a field this server does not know gets 200, one warning line in the log and
    its name in a response header; a field it knows but does not use and OpenAI's own reply
    keys (user, metadata, store false, refusal/annotations/audio null) are simply accepted."""
    with httpx.Client(base_url=server, headers=AUTH, timeout=60) as c:
        for path, body, names in UNKNOWN:
            body = {"model": MODEL, "max_tokens": 2, **body}
            r = c.post(path, json=body)
            assert r.status_code == 200, r.text
            assert r.headers["x-workbench-ignored-fields"] == ", ".join(names)
            with c.stream("POST", path, json={**body, "stream": True}) as s:
                assert s.status_code == 200 and s.headers["x-workbench-ignored-fields"] == ", ".join(names)
                assert list(sse_data(s.iter_lines()))[-1] == "[DONE]"
        # The ignored one really is ignored: max_completion_tokens does not set a completion's length.
        r = c.post("/v1/completions", json={"model": MODEL, "prompt": "Once", "max_tokens": 3,
                                            "ignore_eos": True, "max_completion_tokens": 9})
        assert r.json()["usage"]["completion_tokens"] == 3
        log = LOGS[server].read_text()
        assert "/v1/chat/completions: ignored fields this server does not know: client_tag, " \
               "messages[0].x_trace" in log
        err = assert_openai_error(c.post("/v1/completions", json={"prompt": "hi"}), 400, "model")
        assert "--allow-missing-model" in err["message"]
        # Asking for nothing is fine: nulls and neutral values of unsupported fields, and the
        # keys OpenAI's replies carry, sent back in the conversation.
        replayed = [*HI, {"role": "assistant", "content": "Hello!", "refusal": None,
                          "annotations": [], "audio": None, "function_call": None,
                          "tool_calls": None}, {"role": "user", "content": "Again"}]
        r = c.post("/v1/chat/completions", json={
            "model": MODEL, "messages": replayed, "max_tokens": 1, "n": 1, "tools": [],
            "store": False, "user": "u-1", "metadata": {"k": "v"},
            "response_format": {"type": "text"}})
        assert r.status_code == 200, r.text
        assert "x-workbench-ignored-fields" not in r.headers


def test_strict_fields_and_a_server_chat_template(smollm2_dir, tmp_path):
    """--strict-fields gives back today's 400s for unknown fields (and message keys);
    --chat-template FILE renders every chat request that sends no template of its own."""
    template = tmp_path / "template.jinja"
    template.write_text("{% for m in messages %}[{{ m.role }}] {{ m.content }}\n{% endfor %}[assistant]")
    proc, url = start_server(["--model", MODEL, "--max-model-len", "512", "--num-kv-blocks", "64",
                              "--allow-missing-model", "--strict-fields",
                              "--chat-template", str(template)], tmp_path / "server.log")
    try:
        with httpx.Client(base_url=url, timeout=60) as c:
            for path, body, names in UNKNOWN:
                err = assert_openai_error(c.post(path, json={"max_tokens": 2, **body}), 400,
                                          names[0] if not names[0].startswith("messages") else "messages")
                assert "Unrecognized request argument supplied" in err["message"] or \
                    "not supported by this server" in err["message"]
            r = c.post("/tokenize", json={"messages": HI})
            text = c.post("/detokenize", json={"tokens": r.json()["tokens"]}).json()["prompt"]
            assert text == "[user] hi\n[assistant]"
            r = c.post("/v1/chat/completions", json={"messages": HI, "max_tokens": 2})
            assert r.status_code == 200, r.text
            tokens = c.post("/tokenize", json={"messages": HI}).json()["tokens"]
            assert r.json()["usage"]["prompt_tokens"] == len(tokens)
    finally:
        stop_process(proc)


def test_structured_output_over_http(server):
    """response_format json_schema (sampled, several seeds), vLLM's guided_regex and
    guided_choice, and structured_outputs, all in flight at once."""
    jsonschema = pytest.importorskip("jsonschema")
    schema = {"type": "object", "properties": {"city": {"enum": ["Paris", "Rome", "Oslo"]},
                                               "population": {"type": "integer", "minimum": 0}},
              "required": ["city", "population"], "additionalProperties": False}
    ask = [{"role": "user", "content": "A city and its population, as JSON."}]
    rf = {"type": "json_schema", "json_schema": {"name": "city", "schema": schema, "strict": True}}
    bodies = [{"messages": ask, "response_format": rf, "seed": s, "temperature": 1.0} for s in range(3)]
    bodies += [{"messages": HI, "guided_regex": r"[A-Z][a-z]{2,6}!", "temperature": 1.0, "seed": 1},
               {"prompt": "Pick one:", "guided_choice": ["left", "right"], "temperature": 1.0, "seed": 2},
               {"prompt": "A number:", "structured_outputs": {"regex": "[0-9]{5}"}, "temperature": 0}]

    async def run():
        async with httpx.AsyncClient(base_url=server, headers=AUTH, timeout=300) as c:
            return await asyncio.gather(*(
                c.post("/v1/chat/completions" if "messages" in b else "/v1/completions",
                       json={"model": MODEL, "max_tokens": 40, **b}) for b in bodies))

    outs = []
    for r in asyncio.run(run()):
        assert r.status_code == 200, r.text
        ch = r.json()["choices"][0]
        outs.append(ch["message"]["content"] if "message" in ch else ch["text"])
    for text in outs[:3]:
        jsonschema.validate(json.loads(text), schema)
    assert re.fullmatch(r"[A-Z][a-z]{2,6}!", outs[3]) and outs[4] in ("left", "right")
    assert re.fullmatch(r"[0-9]{5}", outs[5])


def test_chat_template_controls_over_http(server, smollm2_tokenizer):
    """The prompt the server builds is the tokenizer's own apply_chat_template, with the
    controls passed; tool calls and results in the conversation reach SmolLM2's template
    (which has no tools) as the fallback's <tool_call> and <tool_response> turns."""
    from workbench.serving.tools import fallback_messages
    tok = smollm2_tokenizer
    call = {"id": "call_1", "type": "function",
            "function": {"name": "weather", "arguments": '{"city": "Paris"}'}}
    tools_chat = [{"role": "user", "content": "Weather in Paris?"},
                  {"role": "assistant", "content": None, "tool_calls": [call]},
                  {"role": "tool", "tool_call_id": "call_1", "content": "18 C"}]
    as_template = [tools_chat[0], {"role": "assistant", "content": "", "tool_calls": [
        {**call, "function": {"name": "weather", "arguments": {"city": "Paris"}}}]}, tools_chat[2]]
    partial = HI + [{"role": "assistant", "content": "Hello! How"}]
    cases = [({"messages": partial, "add_generation_prompt": False, "continue_final_message": True},
              partial, dict(add_generation_prompt=False, continue_final_message=True)),
             ({"messages": HI, "add_generation_prompt": False}, HI, dict(add_generation_prompt=False)),
             ({"messages": tools_chat}, fallback_messages(as_template, []),
              dict(add_generation_prompt=True))]
    counts = set()
    with httpx.Client(base_url=server, headers=AUTH, timeout=120) as c:
        for body, messages, kw in cases:
            r = c.post("/v1/chat/completions", json={"model": MODEL, "max_tokens": 1, **body})
            assert r.status_code == 200, r.text
            want = tok.encode(tok.apply_chat_template(messages, tokenize=False, **kw),
                              add_special_tokens=False)
            assert r.json()["usage"]["prompt_tokens"] == len(want)
            counts.add(len(want))
        r = c.post("/v1/completions", json={"model": MODEL, "prompt": "one two three four five",
                                            "truncate_prompt_tokens": 2, "max_tokens": 1})
        assert r.json()["usage"]["prompt_tokens"] == 2
        err = assert_openai_error(c.post("/v1/chat/completions", json={
            "model": MODEL, "max_tokens": 1, "messages": [{"role": "user", "content": "x",
                                                         "audio": {"id": "a"}}]}), 400, "messages")
        assert err["code"] == "unsupported_parameter" and "audio" in err["message"]
    assert len(counts) == 3


# ---- load and faults ------------------------------------------------------------------------
N_STREAMS = 64


async def _storm(url: str) -> list[dict]:
    limits = httpx.Limits(max_connections=N_STREAMS + 8, max_keepalive_connections=N_STREAMS)
    async with httpx.AsyncClient(base_url=url, headers=AUTH, timeout=120, limits=limits) as client:

        async def one(i: int) -> dict:
            leaves = i % 4 == 0                       # a quarter hang up mid-stream
            max_tokens = 200 if leaves else 16 + 8 * (i % 2)
            chat = i % 2 == 1
            body = {"model": MODEL, "max_tokens": max_tokens, "ignore_eos": True, "stream": True,
                    "stream_options": {"include_usage": True}, "temperature": 0.8, "seed": i}
            text = f"Request {i}: tell me something about the number {i}."
            if chat:
                body["messages"] = [{"role": "user", "content": text}]
            else:
                body["prompt"] = text
            out = {"i": i, "leaves": leaves, "max_tokens": max_tokens, "chunks": [], "done": False,
                   "usage": None, "finish": None}
            path = "/v1/chat/completions" if chat else "/v1/completions"
            async with client.stream("POST", path, json=body) as r:
                out["status"] = r.status_code
                async for line in r.aiter_lines():
                    if not line.startswith("data:"):
                        continue
                    data = line[5:].strip()
                    if data == "[DONE]":
                        out["done"] = True
                        break
                    obj = json.loads(data)
                    if obj.get("usage"):
                        out["usage"] = obj["usage"]
                    for ch in obj["choices"]:
                        piece = ch["delta"].get("content") if chat else ch["text"]
                        if piece:
                            out["chunks"].append(piece)
                        out["finish"] = ch["finish_reason"] or out["finish"]
                    if leaves and len(out["chunks"]) >= 2:
                        break                          # leaving the block closes the connection
            return out

        return await asyncio.gather(*(one(i) for i in range(N_STREAMS)))


def test_concurrent_streams_with_disconnects(server):
    before = wait_idle(server)
    t0 = time.monotonic()
    results = asyncio.run(asyncio.wait_for(_storm(server), timeout=150))
    storm_s = time.monotonic() - t0

    stayed = [r for r in results if not r["leaves"]]
    left = [r for r in results if r["leaves"]]
    assert len(stayed) == 48 and len(left) == 16
    for r in stayed:                                   # untouched by the others' hang-ups
        assert r["status"] == 200 and r["done"], r
        assert r["finish"] == "length", r
        assert r["usage"]["completion_tokens"] == r["max_tokens"], r
        assert "".join(r["chunks"]), r
    for r in left:
        assert r["status"] == 200 and len(r["chunks"]) >= 2 and not r["done"]

    after = wait_idle(server, timeout=30)              # aborts free every KV block
    assert after["num_requests_running"] == 0 and after["kv_cache_usage_perc"] == 0.0
    delta = {k: after["request_success_total"].get(k, 0) - before["request_success_total"].get(k, 0)
             for k in ("stop", "length", "abort", "error")}
    assert delta == {"stop": 0, "length": 48, "abort": 16, "error": 0}, delta
    completed_tokens = sum(r["max_tokens"] for r in stayed)
    gen = after["generation_tokens_total"] - before["generation_tokens_total"]
    # Each aborted request stopped long before its 200 tokens: the abort landed at once.
    assert completed_tokens < gen < completed_tokens + 16 * 60, (gen, completed_tokens)
    ttft = after["histograms"]["time_to_first_token_seconds"]["count"] - \
        before["histograms"]["time_to_first_token_seconds"]["count"]
    e2e = after["histograms"]["e2e_request_latency_seconds"]["count"] - \
        before["histograms"]["e2e_request_latency_seconds"]["count"]
    assert (ttft, e2e) == (64, 48)
    assert after["prompt_tokens_total"] > before["prompt_tokens_total"]
    print(f"\n64 streams (16 hung up) in {storm_s:.1f} s")

    # And the server still answers.
    r = httpx.post(server + "/v1/completions", json={"model": MODEL, "prompt": "Still there?",
                                                     "max_tokens": 4, "ignore_eos": True},
                   headers=AUTH, timeout=60)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4


def test_non_streamed_request_aborts_when_client_leaves(server):
    before = wait_idle(server)
    body = {"model": MODEL, "prompt": "Write a very long story.", "max_tokens": 900, "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server + "/v1/completions", json=body, headers=AUTH, timeout=1.0)
    after = wait_idle(server, timeout=10)
    assert after["request_success_total"]["abort"] - before["request_success_total"]["abort"] == 1


# ---- behind nginx ---------------------------------------------------------------------------
NGINX = shutil.which("nginx") or "/usr/sbin/nginx"


def nginx_config(upstream_port: int, listen_port: int, prefix: Path) -> Path:
    """docs/nginx-workbench.conf with its two addresses replaced, inside a minimal main
    config that keeps every file under `prefix`."""
    site = (ROOT / "docs" / "nginx-workbench.conf").read_text()
    site, n1 = re.subn(r"server 127\.0\.0\.1:8000;", f"server 127.0.0.1:{upstream_port};", site)
    site, n2 = re.subn(r"listen 8080;", f"listen 127.0.0.1:{listen_port};", site)
    assert (n1, n2) == (1, 1), "docs/nginx-workbench.conf changed: update this test"
    (prefix / "workbench.conf").write_text(site)
    temp = "\n".join(f"  {k}_temp_path {prefix / k};" for k in
                     ("client_body", "proxy", "fastcgi", "uwsgi", "scgi"))
    user = "user root;\n" if os.geteuid() == 0 else ""
    main = (f"{user}worker_processes 1;\ndaemon off;\npid {prefix / 'nginx.pid'};\n"
            f"error_log {prefix / 'error.log'} warn;\nevents {{ worker_connections 256; }}\n"
            f"http {{\n  access_log off;\n{temp}\n  include {prefix / 'workbench.conf'};\n}}\n")
    conf = prefix / "nginx.conf"
    conf.write_text(main)
    return conf


@pytest.fixture
def nginx(server, tmp_path):
    if not os.path.exists(NGINX):
        pytest.skip("nginx is not installed (apt-get install nginx): the proxy test needs "
                    "/usr/sbin/nginx")
    def command(port: int) -> list[str]:
        conf = nginx_config(int(server.rsplit(":", 1)[1]), port, tmp_path)
        check = subprocess.run([NGINX, "-t", "-p", str(tmp_path), "-c", str(conf), "-e",
                                str(tmp_path / "error.log")], capture_output=True, text=True,
                               timeout=30)
        assert check.returncode == 0, check.stderr
        return [NGINX, "-p", str(tmp_path), "-c", str(conf), "-e", str(tmp_path / "error.log")]

    proc, url = conftest.start_server(command, tmp_path / "error.log", timeout=15, what="nginx")
    try:
        yield url
    finally:
        stop_process(proc, signal.SIGQUIT, timeout=10)


def test_stream_through_nginx_arrives_token_by_token(server, nginx):
    body = {"model": MODEL, "prompt": "Tell me a story about a lighthouse keeper.",
            "max_tokens": 48, "ignore_eos": True, "temperature": 0, "stream": True}
    arrivals: list[float] = []
    t0 = time.monotonic()
    with httpx.stream("POST", nginx + "/v1/completions", json=body, headers=AUTH, timeout=60) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        assert r.headers["cache-control"] == "no-cache"
        for data in sse_data(r.iter_lines()):
            if data == "[DONE]":
                break
            if json.loads(data)["choices"][0]["text"]:
                arrivals.append(time.monotonic())
    end = time.monotonic()
    assert len(arrivals) >= 40
    # Spread over the generation, not one lump at the end: the first chunk arrives early, and
    # the chunks keep arriving in separate reads.
    assert arrivals[-1] - arrivals[0] > 0.5 * (end - t0), (arrivals[0] - t0, arrivals[-1] - t0, end - t0)
    gaps = [b - a for a, b in zip(arrivals, arrivals[1:])]
    assert sum(g > 0.002 for g in gaps) > 0.5 * len(gaps)

    # A client that hangs up at the proxy aborts the request upstream too.
    before = wait_idle(server)
    body["max_tokens"] = 400
    with httpx.stream("POST", nginx + "/v1/completions", json=body, headers=AUTH, timeout=60) as r:
        n = 0
        for data in sse_data(r.iter_lines()):
            n += 1
            if n >= 3:
                break
    after = wait_idle(server, timeout=10)
    assert after["request_success_total"]["abort"] - before["request_success_total"]["abort"] == 1


# ---- the remote source ----------------------------------------------------------------------
def test_parse_prometheus():
    text = ('# HELP x help\n# TYPE x gauge\nx{model_name="a\\"b",engine="0"} 3.5\n'
            'vllm:request_success_total{finished_reason="stop"} 2\n'
            'vllm:request_success_total{finished_reason="abort"} 1.0 1700000000\nbad line here\n')
    s = parse_prometheus(text)
    assert s["x"] == [({"model_name": 'a"b', "engine": "0"}, 3.5)]
    assert summarize_metrics(s)["request_success_total"] == {"stop": 2.0, "abort": 1.0}


def test_remote_engine_streams_and_reads_metrics(server):
    wait_idle(server)
    with RemoteEngine(server + "/v1", api_key=KEY) as remote:
        assert remote.health() and remote.models() == [MODEL]

        events = list(remote.stream("The capital of France is", max_tokens=12, temperature=0,
                                    ignore_eos=True))
        last = events[-1]
        st = last.stats
        assert last.finished and last.finish_reason == "length" and st is not None
        assert st.completion_tokens == 12 and st.prompt_tokens > 0
        assert st.text == "".join(e.text for e in events[:-1]) and st.text
        assert st.num_chunks == len(events) - 1 and len(st.itl) == st.num_chunks - 1
        assert 0 < st.ttft <= st.e2e and st.tpot > 0
        times = [e.since_start for e in events]
        assert times == sorted(times) and events[0].since_start == pytest.approx(st.ttft)

        chat = remote.generate("What is the capital of France?", max_tokens=12, chat=True)
        assert "Paris" in chat.text

        m = remote.poll_metrics()
        assert m["num_requests_running"] == 0 and m["kv_cache_usage_perc"] == 0
        assert m["generation_tokens_total"] >= 12 and m["request_success_total"]["length"] >= 1
        assert m["histograms"]["time_to_first_token_seconds"]["count"] >= 2

        # Live state while a stream runs; closing the iterator aborts the request.
        it = remote.stream("Write a long poem.", max_tokens=500, ignore_eos=True)
        next(it)
        live = remote.poll_metrics()
        assert live["num_requests_running"] == 1 and live["kv_cache_usage_perc"] > 0
        it.close()
        after = wait_idle(server, timeout=10)
        assert after["request_success_total"]["abort"] == m["request_success_total"].get("abort", 0) + 1

        with pytest.raises(RemoteError) as e:
            list(remote.stream("hi", max_tokens=0))
        assert e.value.status == 400 and e.value.param == "max_tokens"
    with RemoteEngine(server, api_key="wrong", model=MODEL) as bad:
        with pytest.raises(RemoteError) as e:
            list(bad.stream("hi", max_tokens=2))
        assert e.value.status == 401


def test_remote_bench(server):
    wait_idle(server)
    report = asyncio.run(bench_async(server, num_requests=6, concurrency=3, input_words=(4, 12),
                                     output_len=(4, 8), api_key=KEY,
                                     metrics_interval=0.05))
    assert report["completed"] == 6 and report["failed"] == 0
    assert 24 <= report["total_output_tokens"] <= 48
    assert report["output_throughput"] > 0 and report["ttft_s"]["p50"] > 0
    assert report["server_peaks"]["num_requests_running"] >= 1
    # Poisson arrivals at 4 requests/s: 6 requests take at least the seeded arrival spread.
    spaced = asyncio.run(bench_async(server, num_requests=6, concurrency=6, input_words=(4, 8),
                                     output_len=(2, 2), api_key=KEY, request_rate=4.0, seed=1))
    assert spaced["completed"] == 6 and spaced["workload"]["request_rate"] == 4.0
    assert spaced["duration_s"] >= spaced["arrival_span_s"] > 0
    # The same through the command line, with its JSON report.
    out = Path(os.environ.get("PYTEST_TMP", "/tmp")) / f"serving-{os.getpid()}.json"
    r = subprocess.run([sys.executable, "-m", "workbench.cli", "bench", "--url", server,
                        "--api-key", KEY, "--num-requests", "3", "--concurrency", "2",
                        "--input-words", "4:8", "--output-len", "3:3", "--output", str(out)],
                       cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    assert json.loads(out.read_text())["completed"] == 3 and "ttft" in r.stdout
    out.unlink()


def test_remote_source_feeds_token_panel_and_timeline(server):
    """The widgets take a live server in place of the in-process engine: streams from its
    SSE, the timeline from its /metrics (one point per poll)."""
    pytest.importorskip("ipywidgets")
    pytest.importorskip("plotly")
    from widgets import (BatchTimeline, Dashboard, KVBlockMap, Live, RemoteSource, SummaryPanel,
                         TokenStreamPanel)
    from workbench import SamplingParams
    wait_idle(server)
    before = scrape(server)["generation_tokens_total"]

    async def run():
        source = RemoteSource(server, api_key=KEY, metrics_interval=0.1)
        live = Live(source, TokenStreamPanel(), BatchTimeline(), KVBlockMap(), SummaryPanel())
        rids = await live.generate(["Tell me about the sea."] * 3 + ["Name a colour."],
                                   SamplingParams(max_tokens=40, temperature=0.8, ignore_eos=True),
                                   timeout=120)
        # Wait (bounded) until the polls have counted every token and seen the server idle.
        timeline, deadline = live.panels[1], time.monotonic() + 30
        while not (sum(p.num_decode_tokens for p in timeline.points) >= 4 * 40
                   and timeline.points and timeline.points[-1].num_running == 0):
            assert time.monotonic() < deadline, "the /metrics polls never saw the batch end"
            await asyncio.sleep(0.05)
            live.pump.tick()
        bad = source.submit("word " * 1500, SamplingParams(max_tokens=4))   # too long: a 400
        await live.pump.wait(timeout=30)
        live.close()
        return live, rids, bad

    live, rids, bad = asyncio.run(run())
    streams, timeline, kv, summary = live.panels
    assert timeline.resolution == "poll" and "/metrics poll" in timeline.x_title
    for rid in rids:
        st = streams.streams[rid]
        assert st.status == "length" and st.num_tokens == 40 and st.text and st.ttft > 0
    assert streams.streams[bad].status == "error" and not streams.streams[bad].text
    assert "400" in live.errors.value and "prompt" in live.errors.value
    pts = list(timeline.points)
    assert len(pts) >= 3 and max(p.num_running for p in pts) >= 1
    assert max(p.kv_usage for p in pts) > 0 and pts[-1].num_running == 0
    # The counters' baseline is read before the first request: the points hold every token.
    drawn = sum(p.num_decode_tokens for p in pts)
    assert drawn == 4 * 40 == scrape(server)["generation_tokens_total"] - before
    assert summary.num_finished == 4 and summary.figures()["ttft_p50"] > 0
    assert "does not publish its block table" in kv.view.value

    async def dash():
        d = Dashboard(url=server, api_key=KEY)
        d.prompts.value = "Say one word."
        d.send(2, SamplingParams(max_tokens=6, temperature=0))
        ok = await d.wait(timeout=60)
        d.source.close()
        return d, ok

    d, ok = asyncio.run(dash())
    assert ok and d.streams.num_finished == 2 and d.knobs.apply_button.disabled
    assert "remote server" in d.header.value and MODEL in d.header.value


# ---- logprobs, echo, n (issue 12) -------------------------------------------------------------
def _hf_rows(hf, ids):
    import torch
    with torch.inference_mode():
        return torch.log_softmax(hf(torch.tensor([ids])).logits[0].float(), -1)


def test_completions_logprobs_echo_and_n(server, hf_smollm2, smollm2_tokenizer):
    """echo + logprobs with max_tokens 0 scores the prompt (HF's log_softmax within 1e-4);
    n choices each have their index, finish_reason and logprobs, streamed and not."""
    prompt = "The capital of France is Paris, and the capital of Italy is"
    ids = smollm2_tokenizer.encode(prompt)
    ref = _hf_rows(hf_smollm2, ids)
    with httpx.Client(base_url=server, timeout=120, headers=AUTH) as c:
        r = c.post("/v1/completions", json={"model": MODEL, "prompt": prompt, "max_tokens": 0,
                                            "echo": True, "logprobs": 1})
        assert r.status_code == 200, r.text
        (ch,) = r.json()["choices"]
        lp = ch["logprobs"]
        assert ch["text"] == prompt and r.json()["usage"]["completion_tokens"] == 0
        assert "".join(lp["tokens"]) == prompt and len(lp["tokens"]) == len(ids)
        assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
        for p in range(1, len(ids)):
            assert abs(lp["token_logprobs"][p] - ref[p - 1, ids[p]].item()) < 1e-4
            assert abs(max(lp["top_logprobs"][p].values()) - ref[p - 1].max().item()) < 1e-4
        assert lp["text_offset"] == [len("".join(lp["tokens"][:i])) for i in range(len(ids))]

        body = {"model": MODEL, "prompt": prompt, "max_tokens": 4, "temperature": 0, "n": 3,
                "logprobs": 2, "ignore_eos": True}
        r = c.post("/v1/completions", json=body)
        assert r.status_code == 200, r.text
        chs = r.json()["choices"]
        assert [x["index"] for x in chs] == [0, 1, 2] and len({x["text"] for x in chs}) == 1
        assert all(x["finish_reason"] == "length" and len(x["logprobs"]["tokens"]) == 4 for x in chs)
        assert all(len(top) in (2, 3) for x in chs for top in x["logprobs"]["top_logprobs"])
        assert r.json()["usage"]["completion_tokens"] == 12
        # Streamed: every chunk names its choice; each choice ends with its own finish_reason.
        with c.stream("POST", "/v1/completions", json={**body, "stream": True}) as s:
            events = [json.loads(d) for d in sse_data(s.iter_lines()) if d != "[DONE]"]
        texts, finishes = {}, {}
        for e in events:
            (x,) = e["choices"]
            texts[x["index"]] = texts.get(x["index"], "") + x["text"]
            if x["finish_reason"]:
                finishes[x["index"]] = x["finish_reason"]
        assert texts == {i: chs[0]["text"] for i in range(3)} and finishes == {0: "length", 1: "length", 2: "length"}
        # Chat: logprobs + top_logprobs in chat's shape.
        r = c.post("/v1/chat/completions", json={
            "model": MODEL, "messages": [{"role": "user", "content": "Say hi"}], "max_tokens": 3,
            "temperature": 0, "logprobs": True, "top_logprobs": 2, "n": 2})
        assert r.status_code == 200, r.text
        for i, x in enumerate(r.json()["choices"]):
            content = x["logprobs"]["content"]
            assert x["index"] == i and len(content) == r.json()["usage"]["completion_tokens"] // 2
            for t in content:
                assert set(t) == {"token", "logprob", "bytes", "top_logprobs"} and len(t["top_logprobs"]) == 2
                assert t["bytes"] == list(t["token"].encode()) and t["logprob"] <= t["top_logprobs"][0]["logprob"] + 1e-6
    wait_idle(server)


def test_lm_eval_loglikelihood_scores_equal_hf(server, hf_smollm2, smollm2_tokenizer, smollm2_dir,
                                               tmp_path, monkeypatch):
    """lm-eval's local-completions loglikelihood path (echo + logprobs over /v1/completions)
    runs a small multiple-choice task and a loglikelihood_rolling (perplexity) task against
    the live server, at batch size 1 and at its usual 8 (a list of token-id prompts per
    request): every choice's loglikelihood equals the one computed from HF's logits, batch 8
    gives batch 1's per-sample figures to 1e-4, and the accuracy follows."""
    lm_eval = pytest.importorskip("lm_eval")
    from lm_eval.tasks import TaskManager
    docs = [
        {"question": "The capital of France is", "choices": ["Paris", "Berlin", "a banana"], "answer": 0},
        {"question": "Two plus two equals", "choices": ["seven", "four", "the sky"], "answer": 1},
        {"question": "The opposite of hot is", "choices": ["cold", "blue", "running"], "answer": 0},
        {"question": "Water freezes at zero degrees", "choices": ["Fahrenheit", "Celsius", "Kelvin"], "answer": 1},
    ]
    texts = [{"text": "The quick brown fox jumps over the lazy dog. " * 3},
             {"text": "In the beginning there was nothing, and then there was a small engine."},
             {"text": "Paris is the capital of France; Rome is the capital of Italy."}]
    for name, rows in (("mc", docs), ("ppl", texts)):
        (tmp_path / f"{name}.jsonl").write_text("".join(json.dumps(d) + "\n" for d in rows))
    (tmp_path / "wb_mc.yaml").write_text(
        "task: wb_mc\ndataset_path: json\ndataset_kwargs:\n  data_files:\n"
        f"    test: {tmp_path / 'mc.jsonl'}\ntest_split: test\noutput_type: multiple_choice\n"
        "doc_to_text: '{{question}}'\ndoc_to_choice: '{{choices}}'\ndoc_to_target: '{{answer}}'\n"
        "metric_list:\n  - metric: acc\n")
    (tmp_path / "wb_ppl.yaml").write_text(
        "task: wb_ppl\ndataset_path: json\ndataset_kwargs:\n  data_files:\n"
        f"    test: {tmp_path / 'ppl.jsonl'}\ntest_split: test\noutput_type: loglikelihood_rolling\n"
        "doc_to_text: ''\ndoc_to_target: '{{text}}'\n"
        "metric_list:\n  - metric: word_perplexity\n")
    monkeypatch.setenv("OPENAI_API_KEY", KEY)
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "datasets"))

    from lm_eval.models.openai_completions import LocalCompletionsAPI
    sent: list[int] = []                # prompts per request, as lm-eval builds them
    payload = LocalCompletionsAPI._create_payload

    def recording(self, messages, *a, **kw):
        sent.append(len(messages) if isinstance(messages, list) and isinstance(messages[0], list) else 1)
        return payload(self, messages, *a, **kw)
    monkeypatch.setattr(LocalCompletionsAPI, "_create_payload", recording)

    def run(batch_size: int, tokenizer: str):
        return lm_eval.simple_evaluate(
            model="local-completions",
            model_args=(f"model={MODEL},base_url={server}/v1/completions,{tokenizer},"
                        "tokenized_requests=True,num_concurrent=1,"
                        f"max_retries=1,batch_size={batch_size},max_length={MAX_MODEL_LEN - 1}"),
            tasks=["wb_mc", "wb_ppl"], task_manager=TaskManager(include_path=str(tmp_path)),
            log_samples=True)

    # Batch 1 with HF's tokenizer here; batch 8 with lm-eval's remote tokenizer, which reads
    # this server's /tokenizer_info, /tokenize and /detokenize.
    one = run(1, f"tokenizer={smollm2_dir},tokenizer_backend=huggingface")
    assert set(sent) == {1}
    sent.clear()
    eight = run(8, f"tokenizer_backend=remote,auth_token={KEY}")
    assert max(sent) == 8, sent
    samples = one["samples"]["wb_mc"]
    assert len(samples) == len(docs)
    correct = 0
    for s in samples:
        ours = []
        for (context, continuation), resp in zip(s["arguments"], s["filtered_resps"]):
            # lm-eval's own split: the continuation's tokens are those past the context's.
            ctx = smollm2_tokenizer.encode(context, add_special_tokens=False)
            whole = smollm2_tokenizer.encode(context + continuation, add_special_tokens=False)
            rows = _hf_rows(hf_smollm2, whole)
            hf_ll = sum(rows[p - 1, whole[p]].item() for p in range(len(ctx), len(whole)))
            assert abs(resp[0] - hf_ll) < 1e-3, (continuation, resp[0], hf_ll)
            ours.append(hf_ll)
        correct += max(range(len(ours)), key=ours.__getitem__) == s["target"]
    assert one["results"]["wb_mc"]["acc,none"] == correct / len(docs)
    for task in ("wb_mc", "wb_ppl"):
        a = sorted(one["samples"][task], key=lambda s: s["doc_id"])
        b = sorted(eight["samples"][task], key=lambda s: s["doc_id"])
        assert len(a) == len(b) > 0
        for sa, sb in zip(a, b):
            for ra, rb in zip(sa["filtered_resps"], sb["filtered_resps"]):
                ra, rb = (ra[0], rb[0]) if isinstance(ra, (list, tuple)) else (ra, rb)
                assert abs(ra - rb) < 1e-4, (task, sa["doc_id"], ra, rb)
    assert one["results"]["wb_mc"]["acc,none"] == eight["results"]["wb_mc"]["acc,none"]
    ppl1 = one["results"]["wb_ppl"]["word_perplexity,none"]
    assert math.isfinite(ppl1) and abs(ppl1 - eight["results"]["wb_ppl"]["word_perplexity,none"]) < 1e-3 * ppl1
    wait_idle(server)


def test_one_hostile_number_fails_only_its_own_request(server):
    """Issue 27's case: eight ordinary completions (temperature 0.7, 64 tokens) are running
    when requests with numbers that do not fit their field arrive (a 10**400 temperature, a
    2**64 + 1 seed, a top_k past int64, a max_tokens past int64, an out-of-float32 penalty):
    each of those gets a 400 naming its field, and the eight finish whole."""
    ordinary = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 64,
                "temperature": 0.7, "ignore_eos": True}
    hostile = [("temperature", 10 ** 400), ("seed", 2 ** 64 + 1), ("top_k", 2 ** 70),
               ("max_tokens", 2 ** 63), ("presence_penalty", 10 ** 40),
               ("logit_bias", {"5": 10 ** 400})]

    async def run():
        async with httpx.AsyncClient(base_url=server, headers=AUTH, timeout=300) as c:
            normal = [asyncio.create_task(c.post("/v1/completions", json=ordinary))
                      for _ in range(8)]
            # The eight are running (the server's own gauge says so) before the hostile
            # requests arrive; a deadline, not a guess at how long admission takes.
            deadline = time.monotonic() + 120
            while re.search(r'^vllm:num_requests_running\{[^}]*\} 8(\.0)?$',
                            (await c.get("/metrics")).text, re.M) is None:
                assert time.monotonic() < deadline, "the eight never ran together"
                await asyncio.sleep(0.02)
            # (json.dumps writes the huge ints as JSON integers, as a hostile client would)
            bad = await asyncio.gather(*(c.post("/v1/completions", content=json.dumps(
                {**ordinary, name: value}), headers={"content-type": "application/json"})
                for name, value in hostile))
            return await asyncio.gather(*normal), bad

    normal, bad = asyncio.run(run())
    for (name, _), r in zip(hostile, bad):
        assert r.status_code == 400, (name, r.status_code, r.text[:300])
        assert r.json()["error"]["param"] == name, (name, r.text[:300])
    for r in normal:
        assert r.status_code == 200, r.text[:300]
        assert r.json()["usage"]["completion_tokens"] == 64
    assert httpx.get(server + "/health", timeout=10).status_code == 200
    wait_idle(server)


@pytest.mark.parametrize("token", ["NaN", "Infinity", "-Infinity"])
def test_json_nan_and_infinity_are_refused_naming_the_field(server, token):
    body = '{"model": "%s", "prompt": "hi", "max_tokens": 2, "top_p": %s}' % (MODEL, token)
    r = httpx.post(server + "/v1/completions", content=body, timeout=30,
                   headers={**AUTH, "content-type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "top_p", r.text
    assert token in r.json()["error"]["message"]
    nested = '{"model": "%s", "messages": [{"role": "user", "content": "hi"}], ' \
             '"logit_bias": {"5": %s}}' % (MODEL, token)
    r = httpx.post(server + "/v1/chat/completions", content=nested, timeout=30,
                   headers={**AUTH, "content-type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "logit_bias", r.text


def test_openapi_declares_both_request_bodies(server):
    """/openapi.json (and /docs) from schema.py's models: each endpoint's body with its
    fields, types and ranges; the same models decide which fields a request may send."""
    from workbench.serving.protocol import REQUEST_FIELDS
    doc = httpx.get(server + "/openapi.json", timeout=10).json()
    for path, kind, required in (("/v1/completions", "completion", "prompt"),
                                 ("/v1/chat/completions", "chat", "messages"),
                                 ("/v1/responses", "responses", "input")):
        body = doc["paths"][path]["post"]["requestBody"]["content"]["application/json"]["schema"]
        assert set(body["properties"]) == set(REQUEST_FIELDS[kind])
        assert body["required"] == [required]
    temp = doc["paths"]["/v1/completions"]["post"]["requestBody"]["content"][
        "application/json"]["schema"]["properties"]["temperature"]
    assert {"type": "number", "minimum": 0.0} in temp["anyOf"]
    assert doc["info"]["version"] and httpx.get(server + "/docs", timeout=10).status_code == 200


# ---- batched prompts, vLLM's answers, the tokenizer endpoints (issue 22) ---------------------
def test_batched_prompts_answer_each_prompt_in_order(server):
    """A list of texts or of token-id lists: one choice per prompt times n, index =
    prompt * n + i, each equal to its prompt sent alone (greedy), with echo and logprobs;
    streamed, every chunk names its index; usage counts every prompt."""
    prompts = ["The capital of France is", "Once upon a time", "1, 2, 3,"]
    body = {"model": MODEL, "max_tokens": 6, "temperature": 0, "ignore_eos": True, "n": 2,
            "logprobs": 1, "echo": True}
    with httpx.Client(base_url=server, headers=AUTH, timeout=300) as c:
        alone = [c.post("/v1/completions", json={**body, "prompt": p}).json() for p in prompts]
        r = c.post("/v1/completions", json={**body, "prompt": prompts})
        assert r.status_code == 200, r.text
        chs = r.json()["choices"]
        assert [x["index"] for x in chs] == list(range(6))
        for p, a in enumerate(alone):
            for i in range(2):
                x = chs[p * 2 + i]
                assert x["text"] == a["choices"][i]["text"] and x["text"].startswith(prompts[p])
                assert x["logprobs"]["tokens"] == a["choices"][i]["logprobs"]["tokens"]
                assert x["finish_reason"] == "length" and x["stop_reason"] is None
        usage = r.json()["usage"]
        assert usage["prompt_tokens"] == sum(a["usage"]["prompt_tokens"] for a in alone)
        assert usage["completion_tokens"] == 3 * 2 * 6
        ids = [c.post("/tokenize", json={"prompt": p}).json()["tokens"] for p in prompts]
        r = c.post("/v1/completions", json={**body, "prompt": ids, "echo": False, "logprobs": None})
        assert [x["text"] for x in r.json()["choices"]] == [
            a["choices"][i]["text"][len(prompts[p]):] for p, a in enumerate(alone) for i in range(2)]
        with c.stream("POST", "/v1/completions", json={**body, "prompt": prompts, "stream": True,
                                                       "stream_options": {"include_usage": True}}) as s:
            events = [json.loads(d) for d in sse_data(s.iter_lines()) if d != "[DONE]"]
        texts, finishes = {}, {}
        for e in events[:-1]:
            (x,) = e["choices"]
            texts[x["index"]] = texts.get(x["index"], "") + x["text"]
            if x["finish_reason"]:
                finishes[x["index"]] = x["finish_reason"]
        assert texts == {i: x["text"] for i, x in enumerate(chs)}
        assert finishes == {i: "length" for i in range(6)}
        assert events[-1]["usage"] == usage
    wait_idle(server)


def test_vllms_answers_where_ours_were_silent_or_wrong(server):
    """Issue 22's list, each as vLLM answers it."""
    with httpx.Client(base_url=server, headers=AUTH, timeout=300) as c:
        def post(path, **body):
            r = c.post(path, json={"model": MODEL, **body})
            assert r.status_code == 200, r.text
            return r.json()

        # continuous_usage_stats: usage, so far, on every chunk.
        with c.stream("POST", "/v1/chat/completions", json={
                "model": MODEL, "messages": HI, "max_tokens": 5, "ignore_eos": True, "stream": True,
                "stream_options": {"include_usage": True, "continuous_usage_stats": True}}) as s:
            events = [json.loads(d) for d in sse_data(s.iter_lines()) if d != "[DONE]"]
        assert all(e["usage"] is not None for e in events)
        counts = [e["usage"]["completion_tokens"] for e in events]
        assert counts == sorted(counts) and counts[0] == 0 and counts[-1] == 5
        assert len({e["usage"]["prompt_tokens"] for e in events}) == 1
        # A -inf logprob (top_logprobs past the tokens the grammar allows) is -9999.0, as
        # vLLM sends it: valid JSON, streamed and not.
        body = {"messages": HI, "structured_outputs": {"choice": ["yes", "no"]}, "logprobs": True,
                "top_logprobs": 20, "max_tokens": 3, "temperature": 0}
        out = post("/v1/chat/completions", **body)
        tops = [t["logprob"] for x in out["choices"][0]["logprobs"]["content"] for t in x["top_logprobs"]]
        assert -9999.0 in tops and min(tops) == -9999.0
        with c.stream("POST", "/v1/chat/completions", json={"model": MODEL, **body, "stream": True}) as s:
            assert any("-9999.0" in d for d in sse_data(s.iter_lines()))   # each parses below
        # min_tokens without max_tokens (chat fills the context): honoured, not refused.
        out = post("/v1/chat/completions", messages=HI, min_tokens=40, temperature=0)
        assert out["usage"]["completion_tokens"] >= 40
        # seed -1 is no seed: two such requests differ (20 tokens at temperature 1).
        sampled = {"prompt": "Once upon a time", "max_tokens": 20, "temperature": 1.0,
                   "ignore_eos": True}
        texts = {post("/v1/completions", **sampled, seed=-1)["choices"][0]["text"] for _ in range(2)}
        assert len(texts) == 2
        # n > 1 with a seed: choice i draws from seed + i, as vLLM's does.
        many = post("/v1/completions", **sampled, seed=100, n=3)["choices"]
        for i in range(3):
            assert many[i]["text"] == post("/v1/completions", **sampled, seed=100 + i)["choices"][0]["text"]
        # stop_reason: the stop string or stop token id that ended a choice; null otherwise.
        count = {"prompt": "Count: one, two, three, four, five, six", "max_tokens": 20,
                 "temperature": 0}
        x = post("/v1/completions", **count, stop=[","])["choices"][0]
        assert (x["finish_reason"], x["stop_reason"], x["text"]) == ("stop", ",", "")
        comma = c.post("/tokenize", json={"prompt": ",", "add_special_tokens": False}).json()["tokens"]
        x = post("/v1/completions", **count, stop_token_ids=comma)["choices"][0]
        assert (x["finish_reason"], x["stop_reason"]) == ("stop", comma[0])
        x = post("/v1/chat/completions", messages=HI, max_tokens=3, ignore_eos=True)["choices"][0]
        assert x["finish_reason"] == "length" and x["stop_reason"] is None
        # Stop strings are looked for only once min_tokens are out.
        x = post("/v1/completions", **count, stop=[","], min_tokens=6)["choices"][0]
        assert x["finish_reason"] == "stop" and x["text"].count(",") >= 2
        ids = c.post("/tokenize", json={"prompt": x["text"], "add_special_tokens": False}).json()
        assert ids["count"] >= 5      # (the sixth token completed the stop string, cut off)
    wait_idle(server)


def test_tokenize_and_detokenize_round_trip(server, smollm2_tokenizer):
    text = "héllo wörld, 你好世界 🌍🚀 — ok"
    with httpx.Client(base_url=server, headers=AUTH, timeout=60) as c:
        r = c.post("/tokenize", json={"model": MODEL, "prompt": text, "return_token_strs": True})
        assert r.status_code == 200, r.text
        out = r.json()
        assert out["tokens"] == smollm2_tokenizer.encode(text) and out["count"] == len(out["tokens"])
        assert out["max_model_len"] == MAX_MODEL_LEN
        assert out["token_strs"] == smollm2_tokenizer.convert_ids_to_tokens(out["tokens"])
        assert c.post("/detokenize", json={"tokens": out["tokens"]}).json() == {"prompt": text}
        # Chat messages through the template, as /v1/chat/completions renders them.
        chat = c.post("/tokenize", json={"messages": HI}).json()
        assert chat["token_strs"] is None
        assert chat["tokens"] == smollm2_tokenizer.apply_chat_template(HI, add_generation_prompt=True,
                                                                       tokenize=True, return_dict=False)
        # Counting a text longer than max_model_len is what /tokenize is for.
        long = c.post("/tokenize", json={"prompt": "word " * (MAX_MODEL_LEN + 10)}).json()
        assert long["count"] > MAX_MODEL_LEN
        for path, body, param in [("/tokenize", {}, "prompt"),
                                  ("/tokenize", {"prompt": "a", "messages": HI}, "prompt"),
                                  ("/tokenize", {"prompt": 5}, "prompt"),
                                  ("/tokenize", {"model": "gpt-17", "prompt": "a"}, "model"),
                                  ("/detokenize", {"tokens": [10**9]}, "tokens"),
                                  ("/detokenize", {"tokens": "1 2"}, "tokens")]:
            assert_openai_error(c.post(path, json=body), 404 if param == "model" else 400, param)
        assert_openai_error(httpx.post(server + "/tokenize", json={"prompt": "a"}), 401)
