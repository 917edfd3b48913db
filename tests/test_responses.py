"""The Responses API (/v1/responses) and reasoning output, tested as a client sees them: a real
`workbench serve` on 127.0.0.1 (started and stopped as tests/test_server.py does), the
official openai SDK's `client.responses` and raw HTTP. The reasoning split runs on a
Qwen3-shaped random checkpoint whose tokenizer has the <think> tags and whose chat template is
Qwen3's own (tests/data/qwen3_chat_template.jinja, from Qwen3's tokenizer_config.json)."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from test_server import AUTH, KEY, MODEL, assert_openai_error, start_server, stop_process

httpx = pytest.importorskip("httpx")
openai = pytest.importorskip("openai")

from workbench.serving.client import sse_data  # noqa: E402
from workbench.serving.reasoning import split_reasoning  # noqa: E402

QWEN3_TEMPLATE = (Path(__file__).parent / "data" / "qwen3_chat_template.jinja").read_text()
TOOLS = [{"type": "function", "name": "get_weather", "description": "The weather in a city",
          "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                         "required": ["city"]}}]
PERSON = {"type": "object", "properties": {"name": {"type": "string"},
                                           "age": {"type": "integer"}},
          "required": ["name", "age"]}


@pytest.fixture(scope="module")
def server(smollm2_dir, tmp_path_factory):
    log = tmp_path_factory.mktemp("responses") / "server.log"
    proc, url = start_server(["--model", MODEL, "--api-key", KEY, "--num-kv-blocks", "256",
                              "--max-model-len", "1024"], log)
    yield url
    stop_process(proc)


@pytest.fixture
def client(server):
    return openai.OpenAI(base_url=server + "/v1", api_key=KEY, max_retries=0, timeout=120)


def test_plain_and_streamed_give_the_same_response(client):
    r = client.responses.create(model=MODEL, input="What is the capital of France?",
                                instructions="Answer in one sentence.", max_output_tokens=16,
                                temperature=0)
    assert r.object == "response" and r.status == "completed" and r.model == MODEL
    assert "Paris" in r.output_text
    assert [o.type for o in r.output] == ["message"] and r.output[0].role == "assistant"
    assert r.usage.output_tokens > 0 and r.usage.input_tokens > 0
    assert r.usage.total_tokens == r.usage.input_tokens + r.usage.output_tokens
    assert r.instructions == "Answer in one sentence." and r.max_output_tokens == 16

    with client.responses.stream(model=MODEL, input="What is the capital of France?",
                                 instructions="Answer in one sentence.", max_output_tokens=16,
                                 temperature=0) as s:
        events = list(s)
        final = s.get_final_response()
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds[-1] == "response.completed"
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = [e.delta for e in events if e.type == "response.output_text.delta"]
    assert len(deltas) >= 3 and "".join(deltas) == r.output_text == final.output_text
    assert events[-1].response.usage.output_tokens == r.usage.output_tokens
    assert all(getattr(e, "response", None) is None or e.response.id == final.id for e in events)

    # max_output_tokens cuts it: status incomplete, the reason given.
    r = client.responses.create(model=MODEL, input="Tell me a long story.", max_output_tokens=3,
                                temperature=0)
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    assert r.usage.output_tokens == 3


def test_sse_wire_format(server):
    """Each event is named (event: <type>) and its data is the typed JSON; no [DONE]."""
    body = {"model": MODEL, "input": "Hi", "max_output_tokens": 4, "stream": True}
    with httpx.stream("POST", server + "/v1/responses", json=body, headers=AUTH, timeout=60) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        lines = list(r.iter_lines())
    names = [ln[len("event: "):] for ln in lines if ln.startswith("event: ")]
    datas = [json.loads(d) for d in sse_data(iter(lines))]
    assert names == [d["type"] for d in datas] and names[-1] == "response.completed"
    assert datas[-1]["response"]["usage"]["output_tokens"] == 4


def test_tool_round_trip_and_previous_response_id(client):
    r = client.responses.create(model=MODEL, input="What is the weather in Paris?", tools=TOOLS,
                                tool_choice={"type": "function", "name": "get_weather"},
                                max_output_tokens=40, temperature=0)
    calls = [o for o in r.output if o.type == "function_call"]
    assert len(calls) == 1 and calls[0].name == "get_weather"
    assert set(json.loads(calls[0].arguments)) == {"city"} and calls[0].call_id.startswith("call_")

    # Streamed, the arguments arrive as they are written.
    with client.responses.stream(model=MODEL, input="What is the weather in Paris?", tools=TOOLS,
                                 tool_choice="required", parallel_tool_calls=False,
                                 max_output_tokens=40, temperature=0) as s:
        events = list(s)
        final = s.get_final_response()
    args = [e.delta for e in events if e.type == "response.function_call_arguments.delta"]
    done = [e for e in events if e.type == "response.function_call_arguments.done"]
    streamed = [o for o in final.output if o.type == "function_call"]
    assert len(args) >= 2 and len(done) == 1 and len(streamed) == 1
    assert "".join(args) == done[0].arguments == streamed[0].arguments
    json.loads(streamed[0].arguments)

    # The result goes back with previous_response_id: the stored conversation holds the call.
    out = client.responses.create(
        model=MODEL, previous_response_id=r.id, tools=TOOLS, max_output_tokens=8, temperature=0,
        input=[{"type": "function_call_output", "call_id": calls[0].call_id,
                "output": "sunny, 21 C"}])
    assert out.status in ("completed", "incomplete") and out.previous_response_id == r.id
    assert out.usage.input_tokens > r.usage.input_tokens
    # The same conversation sent whole (no store) builds the same prompt.
    whole = client.responses.create(
        model=MODEL, tools=TOOLS, max_output_tokens=8, temperature=0, store=False,
        input=[{"role": "user", "content": "What is the weather in Paris?"},
               {"type": "function_call", "call_id": calls[0].call_id, "name": "get_weather",
                "arguments": calls[0].arguments},
               {"type": "function_call_output", "call_id": calls[0].call_id,
                "output": "sunny, 21 C"}])
    assert whole.usage.input_tokens == out.usage.input_tokens
    assert whole.output_text == out.output_text
    # store false: not kept.
    with pytest.raises(openai.NotFoundError):
        client.responses.create(model=MODEL, input="Again?", previous_response_id=whole.id)
    assert client.responses.retrieve(out.id).output_text == out.output_text


def test_previous_response_id_continues_the_conversation(client):
    first = client.responses.create(model=MODEL, input="What is the capital of France?",
                                    max_output_tokens=12, temperature=0)
    second = client.responses.create(model=MODEL, input="And of Germany?",
                                     previous_response_id=first.id, max_output_tokens=12,
                                     temperature=0)
    assert "Berlin" in second.output_text
    assert second.usage.input_tokens > first.usage.input_tokens + first.usage.output_tokens


def test_unknown_ids_are_404s(server, client):
    with pytest.raises(openai.NotFoundError) as e:
        client.responses.create(model=MODEL, input="Hi", previous_response_id="resp_nothing")
    err = e.value.body
    assert err["param"] == "previous_response_id" and err["code"] == "response_not_found"
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve("resp_nothing")
    r = httpx.post(server + "/v1/responses", headers=AUTH, timeout=60, json={
        "model": MODEL, "input": "Hi", "previous_response_id": "resp_nothing", "stream": True})
    assert_openai_error(r, 404, "previous_response_id")


def test_json_schema_through_structured_output(client):
    jsonschema = pytest.importorskip("jsonschema")
    r = client.responses.create(
        model=MODEL, input="Name a person and their age, as JSON.", max_output_tokens=60,
        temperature=0, text={"format": {"type": "json_schema", "name": "person",
                                        "schema": PERSON, "strict": True}})
    person = json.loads(r.output_text)
    jsonschema.validate(person, PERSON)
    assert set(person) == {"name", "age"}


def test_strict_json_schema_on_chat_closes_objects(server):
    """OpenAI's strict mode: an object without additionalProperties takes no other keys (the
    issue's reply added city and country to this very request)."""
    ask = [{"role": "user", "content": "Describe a person as JSON: name, age, city, country."}]
    with httpx.Client(base_url=server, headers=AUTH, timeout=120) as c:
        keys = {}
        for strict in (False, True):
            r = c.post("/v1/chat/completions", json={
                "model": MODEL, "messages": ask, "max_tokens": 80, "temperature": 0,
                "response_format": {"type": "json_schema", "json_schema": {
                    "name": "person", "schema": PERSON, "strict": strict}}})
            assert r.status_code == 200, r.text
            keys[strict] = set(json.loads(r.json()["choices"][0]["message"]["content"]))
    assert keys[True] == {"name", "age"}
    assert keys[False] > {"name", "age"}     # the same request, open: the model adds keys


BAD = [
    ({"input": "x", "tools": [{"type": "web_search"}]}, "tools", "unsupported_parameter"),
    ({"input": "x", "tools": [{"type": "file_search", "vector_store_ids": []}]}, "tools",
     "unsupported_parameter"),
    ({"input": "x", "tool_choice": {"type": "web_search_preview"}, "tools": TOOLS}, "tool_choice",
     "unsupported_parameter"),
    ({"input": "x", "background": True}, "background", "unsupported_parameter"),
    ({"input": "x", "truncation": "auto"}, "truncation", "unsupported_parameter"),
    ({"input": "x", "max_tool_calls": 2}, "max_tool_calls", "unsupported_parameter"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
     "input", "unsupported_parameter"),
    ({"input": [{"type": "computer_call_output", "call_id": "c"}]}, "input",
     "unsupported_parameter"),
    ({}, "input", None),
    ({"input": []}, "input", None),
    ({"input": "x", "max_output_tokens": 0}, "max_output_tokens", None),
    ({"input": "x", "temperature": -1}, "temperature", None),
    ({"input": "x", "text": {"format": {"type": "xml"}}}, "text.format", None),
    ({"input": "x", "text": {"format": {"type": "json_schema", "name": "p",
                                        "schema": {"type": "nonsense"}}}}, "text.format", None),
    ({"input": "x", "store": "yes"}, "store", None),
    ({"input": [{"type": "function_call", "call_id": "c", "name": "f", "arguments": "{"}]},
     "input", None),
    ({"input": [{"type": "function_call_output", "call_id": "nobody", "output": "x"}]}, "input",
     None),
    ({"input": "x", "tools": TOOLS, "tool_choice": {"type": "function", "name": "other"}},
     "tool_choice", None),
    ({"input": "x" * 20000}, "input", "context_length_exceeded"),
]


def test_what_is_not_served_is_a_400_naming_the_field(server):
    with httpx.Client(base_url=server, headers=AUTH, timeout=60) as c:
        for body, param, code in BAD:
            for stream in (False, True):
                r = c.post("/v1/responses", json={"model": MODEL, **body, "stream": stream})
                err = assert_openai_error(r, 400, param)
                assert err["message"].startswith(param) and err["code"] == code, (body, err)
        r = c.post("/v1/responses", json={"model": MODEL, "input": "Hi", "max_output_tokens": 2,
                                          "include": [], "truncation": "disabled",
                                          "background": False, "store": True})
        assert r.status_code == 200, r.text


# Fields OpenAI's clients send that change nothing computed here: 200, named and logged.
IGNORED = [("safety_identifier", "user-1234"), ("prompt_cache_key", "k-1"),
           ("verbosity", "low"), ("service_tier", "flex")]


@pytest.mark.parametrize("name,value", IGNORED)
def test_newly_accepted_fields_are_warned_about(server, name, value):
    with httpx.Client(base_url=server, headers=AUTH, timeout=60) as c:
        r = c.post("/v1/chat/completions", json={
            "model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2,
            name: value})
        assert r.status_code == 200, r.text
        assert r.headers["x-workbench-ignored-fields"] == name
        rname = "text.verbosity" if name == "verbosity" else name
        rbody = {"model": MODEL, "input": "hi", "max_output_tokens": 2,
                 **({"text": {"verbosity": value}} if name == "verbosity" else {name: value})}
        r = c.post("/v1/responses", json=rbody)
        assert r.status_code == 200, r.text
        assert r.headers["x-workbench-ignored-fields"] == rname


def test_reasoning_effort_reaches_the_chat_template(server):
    """As vLLM: reasoning_effort (chat) and reasoning.effort (Responses) are the template's
    variable reasoning_effort; a template that refuses says what it got."""
    template = "{{ raise_exception('effort=' ~ reasoning_effort) }}"
    with httpx.Client(base_url=server, headers=AUTH, timeout=60) as c:
        r = c.post("/v1/chat/completions", json={
            "model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2,
            "reasoning_effort": "low", "chat_template": template})
        assert "effort=low" in assert_openai_error(r, 400, "chat_template")["message"]
        r = c.post("/v1/responses", json={
            "model": MODEL, "input": "hi", "reasoning": {"effort": "high"},
            "chat_template_kwargs": {"x": 1}, "max_output_tokens": 2})
        assert r.status_code == 200, r.text       # SmolLM2's template ignores it
        err = assert_openai_error(c.post("/v1/chat/completions", json={
            "model": MODEL, "messages": [{"role": "user", "content": "hi"}],
            "reasoning_effort": 3}), 400, "reasoning_effort")
        assert err["message"].startswith("reasoning_effort")


def test_models_root_is_the_tokenizer_folder(server, smollm2_dir):
    r = httpx.get(server + "/v1/models", headers=AUTH, timeout=10).json()
    assert r["data"][0]["root"] == str(smollm2_dir)


# ---- reasoning ------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def qwen3_thinker(tmp_path_factory, smollm2_dir):
    """A tiny random Qwen3 whose tokenizer (SmolLM2's, plus <think> and </think> as tokens of
    their own) renders Qwen3's chat template."""
    from transformers import AutoTokenizer

    from conftest import make_tiny_checkpoint
    path = tmp_path_factory.mktemp("qwen3_thinker")
    tok = AutoTokenizer.from_pretrained(smollm2_dir)
    tok.add_tokens(["<think>", "</think>"])
    tok.chat_template = QWEN3_TEMPLATE
    tok.save_pretrained(path)
    make_tiny_checkpoint(path, "qwen3", vocab_size=len(tok), num_hidden_layers=2)
    return path, tok


@pytest.fixture(scope="module")
def thinking_server(qwen3_thinker, tmp_path_factory):
    path, _ = qwen3_thinker
    log = tmp_path_factory.mktemp("thinking") / "server.log"
    proc, url = start_server(["--model", str(path), "--num-kv-blocks", "128", "--max-model-len",
                              "512", "--allow-missing-model", "--reasoning-parser", "qwen3",
                              "--log-level", "info"], log)
    yield url, log
    stop_process(proc)


def test_qwen3_template_takes_enable_thinking(thinking_server, qwen3_thinker):
    url, _ = thinking_server
    _, tok = qwen3_thinker
    hi = [{"role": "user", "content": "hi"}]
    with httpx.Client(base_url=url, timeout=60) as c:
        def rendered(**kw):
            ids = c.post("/tokenize", json={"messages": hi, **kw}).json()["tokens"]
            return c.post("/detokenize", json={"tokens": ids}).json()["prompt"]
        assert rendered().endswith("<|im_start|>assistant\n")
        off = rendered(chat_template_kwargs={"enable_thinking": False})
        assert off.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
        assert off == tok.apply_chat_template(hi, tokenize=False, add_generation_prompt=True,
                                              enable_thinking=False)
        r = c.post("/v1/chat/completions", json={
            "messages": hi, "max_tokens": 1, "chat_template_kwargs": {"enable_thinking": False}})
        assert r.json()["usage"]["prompt_tokens"] == len(tok.encode(off, add_special_tokens=False))


def _sampled(tok, seed: int, responses: bool = False, **body) -> dict:
    """A request whose output is drawn (seeded) from the tags and two words only (a logit bias
    of +100 on them): random thinking blocks, opened and closed anywhere."""
    ids = [tok.convert_tokens_to_ids(t) for t in ("<think>", "</think>")]
    ids += [tok.encode(w, add_special_tokens=False)[0] for w in (" yes", " no")]
    return {"max_output_tokens" if responses else "max_tokens": 14, "temperature": 1.0,
            "seed": seed, "ignore_eos": True, "logit_bias": {str(i): 100 for i in ids}, **body}


def test_reasoning_split_streamed_and_not(thinking_server, qwen3_thinker):
    """Seeded outputs of the tags and two words: the raw text (the same request through
    /v1/completions, which splits nothing) split by the parser is what chat returns, whole
    and streamed, and what the Responses API's reasoning item and message hold."""
    url, log = thinking_server
    _, tok = qwen3_thinker
    hi = [{"role": "user", "content": "Think first."}]
    seen = {"reasoning+content": 0, "content only": 0}
    with httpx.Client(base_url=url, timeout=120) as c:
        prompt = c.post("/tokenize", json={"messages": hi}).json()["tokens"]
        for seed in range(12):
            raw = c.post("/v1/completions", json=_sampled(tok, seed, prompt=prompt)).json()
            raw = raw["choices"][0]["text"]
            reasoning, content = split_reasoning("qwen3", raw)
            if raw.startswith("<think>") and "</think>" in raw and content:
                seen["reasoning+content"] += 1
            elif not raw.startswith("<think>"):
                seen["content only"] += 1
            r = c.post("/v1/chat/completions", json=_sampled(tok, seed, messages=hi)).json()
            msg = r["choices"][0]["message"]
            assert (msg["reasoning_content"] or "", msg["content"]) == (reasoning, content), raw
            assert (r["usage"]["completion_tokens_details"]["reasoning_tokens"] > 0) == \
                raw.startswith("<think>")

            with c.stream("POST", "/v1/chat/completions", json=_sampled(
                    tok, seed, messages=hi, stream=True)) as s:
                chunks = [json.loads(d) for d in sse_data(s.iter_lines()) if d != "[DONE]"]
            deltas = [ch["choices"][0]["delta"] for ch in chunks if ch["choices"]]
            assert "".join(d.get("reasoning_content", "") for d in deltas) == reasoning
            assert "".join(d.get("content") or "" for d in deltas) == content

            resp = c.post("/v1/responses", json=_sampled(tok, seed, True, input=hi[0]["content"]))
            out = resp.json()["output"]
            thought = [o["content"][0]["text"] for o in out if o["type"] == "reasoning"]
            said = "".join(o["content"][0]["text"] for o in out if o["type"] == "message")
            assert "".join(thought) == reasoning and said == content
            assert resp.json()["usage"]["output_tokens_details"]["reasoning_tokens"] == \
                r["usage"]["completion_tokens_details"]["reasoning_tokens"]
            with c.stream("POST", "/v1/responses", json=_sampled(
                    tok, seed, True, input=hi[0]["content"], stream=True)) as s:
                events = [json.loads(d) for d in sse_data(s.iter_lines())]
            assert "".join(e["delta"] for e in events
                           if e["type"] == "response.reasoning_text.delta") == reasoning
            assert "".join(e["delta"] for e in events
                           if e["type"] == "response.output_text.delta") == content
            assert events[-1]["type"] == "response.completed"
    assert seen["reasoning+content"] >= 1 and seen["content only"] >= 1, seen


def test_a_400_logs_its_reason_and_models_root(thinking_server, qwen3_thinker):
    url, log = thinking_server
    path, _ = qwen3_thinker
    r = httpx.post(url + "/v1/responses", json={"input": "x", "tools": [{"type": "web_search"}],
                                                 "metadata": {"secret": "do-not-log"}})
    assert r.status_code == 400
    lines = [ln for ln in log.read_text().splitlines() if "POST /v1/responses: 400" in ln]
    assert len(lines) == 1 and "tools[0].type: 'web_search' is not supported" in lines[0]
    assert "do-not-log" not in log.read_text()
    assert httpx.get(url + "/v1/models").json()["data"][0]["root"] == str(path)


def test_bench_measures_a_server_through_responses(server, tmp_path):
    """`workbench bench --url ... --endpoint responses`: the requests go to /v1/responses (the
    server's counters see them) and the report has their timings and token counts."""
    import subprocess
    import sys
    out = tmp_path / "bench.json"
    r = subprocess.run([sys.executable, "-m", "workbench.cli", "bench", "--url", server,
                        "--api-key", KEY, "--endpoint", "responses", "--ignore-eos",
                        "--num-requests", "4", "--concurrency", "2", "--input-words", "4:8",
                        "--output-len", "5:5", "--output", str(out)],
                       cwd=Path(__file__).parents[1], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    report = json.loads(out.read_text())
    assert report["workload"]["endpoint"] == "responses"
    assert report["completed"] == 4 and report["failed"] == 0
    assert report["total_output_tokens"] == 20 and report["total_input_tokens"] > 0
    assert report["ttft_s"]["p50"] > 0 and report["tpot_s"]["p50"] > 0
    assert report["server_counts"]["generation_tokens"] == 20


def test_remote_client_hands_on_the_thinking_in_its_tags(thinking_server, qwen3_thinker):
    """The remote client (bench, dashboard --url) gets the thinking as reasoning_content or
    reasoning deltas and hands it on between <think> tags, so its text splits as what the
    model wrote does (the token panel then dims it)."""
    from workbench.serving.client import RemoteEngine
    url, _ = thinking_server
    _, tok = qwen3_thinker
    hi = [{"role": "user", "content": "Think first."}]
    checked = 0
    with httpx.Client(base_url=url, timeout=120) as c, RemoteEngine(url) as remote:
        prompt = c.post("/tokenize", json={"messages": hi}).json()["tokens"]
        for seed in range(12):
            body = _sampled(tok, seed, prompt=prompt)
            raw = c.post("/v1/completions", json=body).json()["choices"][0]["text"]
            if not raw.startswith("<think>"):
                continue
            params = {k: body[k] for k in ("seed", "ignore_eos", "logit_bias")}
            for endpoint in ("chat", "responses"):
                ev = list(remote.stream(hi, 14, endpoint=endpoint, temperature=1.0, **params))[-1]
                text = ev.stats.text     # an empty block is gone; all else is as written
                assert split_reasoning("qwen3", text) == split_reasoning("qwen3", raw), endpoint
                assert text.startswith("<think>") == bool(split_reasoning("qwen3", raw)[0])
                assert ev.stats.completion_tokens == 14
            checked += 1
            if checked == 2:
                break
    assert checked == 2
