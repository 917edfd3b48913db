"""Tool calling on /v1/chat/completions, as the clients that use it see it: the openai SDK
(streamed and not), LangChain's bind_tools with a ToolMessage round trip, raw HTTP for the
refusals; a real `workbench serve` on the embedded model (SmolLM2, whose chat template has no
tools: the fallback prompt). The parsers are tested on their own too, on text written the way
models write it."""
from __future__ import annotations

import json
import sys

import pytest

import conftest

httpx = pytest.importorskip("httpx")
openai = pytest.importorskip("openai")
jsonschema = pytest.importorskip("jsonschema")
pytest.importorskip("llguidance")
pytest.importorskip("fastapi")

from workbench.serving.tool_parsers import (HermesCallParser, NamedCallParser,  # noqa: E402
                                            RequiredCallParser, assemble)
from workbench.serving.tools import template_takes_tools  # noqa: E402

MODEL = "smollm2"
WEATHER = {"type": "object", "properties": {
    "city": {"type": "string", "maxLength": 40},
    "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
    "required": ["city", "unit"]}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "The weather now in a city",
                                      "parameters": WEATHER}},
    {"type": "function", "function": {"name": "add", "description": "Add two integers",
                                      "parameters": {"type": "object", "properties": {
                                          "a": {"type": "integer"}, "b": {"type": "integer"}},
                                          "required": ["a", "b"]}}},
]
ASK = [{"role": "user", "content": "What is the weather in Paris, in celsius?"}]


@pytest.fixture(scope="module")
def server(smollm2_dir, tmp_path_factory):
    log = tmp_path_factory.mktemp("tools") / "server.log"
    proc, url = conftest.start_server(
        [sys.executable, "-m", "workbench.cli", "serve", "--device", "cpu", "--model", MODEL,
         "--num-kv-blocks", "256", "--max-model-len", "2048", "--log-level", "warning"],
        log, what="workbench serve")
    yield url
    assert conftest.stop_tree(proc) == [], "processes outlived the server"


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server + "/v1", api_key="unused", max_retries=0, timeout=300)


def _schema_of(name: str) -> dict:
    return next(t["function"]["parameters"] for t in TOOLS if t["function"]["name"] == name)


def _streamed(client, **kw):
    """A streamed chat completion put together as the SDK's users do: content, the tool
    calls from their deltas by index, and the finish_reason."""
    content, calls, finish = "", {}, None
    for chunk in client.chat.completions.create(stream=True, **kw):
        (ch,) = chunk.choices
        content += ch.delta.content or ""
        for d in ch.delta.tool_calls or ():
            c = calls.setdefault(d.index, {"id": None, "name": "", "arguments": "", "deltas": 0})
            c["deltas"] += 1
            c["id"] = d.id or c["id"]
            if d.function is not None:
                c["name"] += d.function.name or ""
                c["arguments"] += d.function.arguments or ""
        finish = ch.finish_reason or finish
    return content, [calls[i] for i in sorted(calls)], finish


@pytest.mark.parametrize("choice", ["required", "named"])
def test_forced_calls_validate_streamed_and_not(client, choice):
    """tool_choice required and a named function: whatever the model is, the arguments parse
    and validate against the function's schema; the stream's deltas (the arguments arriving
    in pieces) reassemble to the same call as the reply."""
    tool_choice = ("required" if choice == "required" else
                   {"type": "function", "function": {"name": "get_weather"}})
    kw = dict(model=MODEL, messages=ASK, tools=TOOLS, tool_choice=tool_choice, max_tokens=120,
              temperature=0)
    r = client.chat.completions.create(**kw)
    (ch,) = r.choices
    assert ch.finish_reason == ("tool_calls" if choice == "required" else "stop")
    assert ch.message.content is None and ch.message.tool_calls
    for call in ch.message.tool_calls:
        assert call.type == "function" and call.id.startswith("call_")
        jsonschema.validate(json.loads(call.function.arguments), _schema_of(call.function.name))
    if choice == "named":
        assert [c.function.name for c in ch.message.tool_calls] == ["get_weather"]
    content, calls, finish = _streamed(client, **kw)
    assert content == "" and finish == ch.finish_reason
    assert [(c["name"], c["arguments"]) for c in calls] == [
        (c.function.name, c.function.arguments) for c in ch.message.tool_calls]
    assert all(c["id"].startswith("call_") for c in calls)
    assert max(c["deltas"] for c in calls) > 2, "the arguments came in one piece, not streamed"


def test_sampled_required_calls_validate_for_every_seed(client):
    """Sampled at temperature 1, eight seeds: every call's arguments validate."""
    for seed in range(8):
        r = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, temperature=1.0,
                                           tool_choice="required", max_tokens=200, seed=seed,
                                           parallel_tool_calls=False)
        (ch,) = r.choices
        assert ch.finish_reason == "tool_calls", ch
        (call,) = ch.message.tool_calls           # parallel_tool_calls false: one call
        jsonschema.validate(json.loads(call.function.arguments), _schema_of(call.function.name))


def test_tool_result_round_trip_gets_a_text_answer(client):
    r = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, temperature=0,
                                       tool_choice={"type": "function",
                                                    "function": {"name": "get_weather"}})
    call = r.choices[0].message.tool_calls[0]
    # The assistant message replayed as the SDK dumps it (refusal, annotations, audio: null).
    turn = ASK + [r.choices[0].message.model_dump(),
                  {"role": "tool", "tool_call_id": call.id,
                   "content": json.dumps({"temperature": 21, "sky": "clear"})}]
    assert turn[1]["refusal"] is None and "annotations" in turn[1]
    r2 = client.chat.completions.create(model=MODEL, messages=turn, tools=TOOLS, temperature=0,
                                        tool_choice="none", max_tokens=40)
    (ch,) = r2.choices
    assert ch.message.content and not ch.message.tool_calls
    assert ch.finish_reason in ("stop", "length")


def test_langchain_bind_tools_round_trip(server):
    lc = pytest.importorskip("langchain_openai")
    from langchain_core.messages import HumanMessage, ToolMessage
    from langchain_core.tools import tool

    @tool
    def get_weather(city: str, unit: str) -> str:
        """The weather now in a city; unit is celsius or fahrenheit."""
        return f"21 degrees {unit} and clear in {city}"

    llm = lc.ChatOpenAI(base_url=server + "/v1", api_key="unused", model=MODEL, temperature=0,
                        max_tokens=80, max_retries=0, timeout=300)
    ai = llm.bind_tools([get_weather], tool_choice="required").invoke(
        [HumanMessage("What is the weather in Paris, in celsius?")])
    (call,) = ai.tool_calls[:1]
    assert call["name"] == "get_weather" and isinstance(call["args"]["city"], str)
    result = ToolMessage(content=get_weather.invoke(call["args"]), tool_call_id=call["id"])
    final = llm.bind_tools([get_weather], tool_choice="none").invoke(
        [HumanMessage("What is the weather in Paris, in celsius?"), ai, result])
    assert isinstance(final.content, str) and final.content and not final.tool_calls


def test_auto_renders_tools_through_a_template_that_takes_them(server):
    """auto: a chat template that reads `tools` gets them (what /tokenize shows of the
    rendered prompt); SmolLM2's own template has none and gets the fallback system prompt;
    whatever the model then writes comes back as text or as parsed calls, never an error."""
    template = ("{% if tools %}TOOLS:{% for t in tools %}{{ t.function.name }};{% endfor %}\n"
                "{% endif %}{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}"
                "assistant:")
    with httpx.Client(base_url=server, timeout=300) as c:
        def rendered(**kw):
            r = c.post("/tokenize", json={"model": MODEL, "messages": ASK, **kw})
            assert r.status_code == 200, r.text
            return c.post("/detokenize", json={"tokens": r.json()["tokens"]}).json()["prompt"]
        assert rendered(tools=TOOLS, chat_template=template).startswith(
            "TOOLS:get_weather;add;user: What is the weather")   # (HF trims a block's newline)
        fallback = rendered(tools=TOOLS)
        assert "<tools>" in fallback and '"name": "get_weather"' in fallback and "<tool_call>" in fallback
        assert "<tools>" not in rendered()
        for kw in ({"chat_template": template}, {}):
            r = c.post("/v1/chat/completions", json={"model": MODEL, "messages": ASK, "tools": TOOLS,
                                                     "max_tokens": 60, "temperature": 0, **kw})
            assert r.status_code == 200, r.text
            (ch,) = r.json()["choices"]
            msg = ch["message"]
            assert msg["tool_calls"] or msg["content"]
            for call in msg["tool_calls"]:
                json.loads(call["function"]["arguments"])
            assert ch["finish_reason"] == ("tool_calls" if msg["tool_calls"] else ch["finish_reason"])


BAD_TOOLS = [
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "nonsense"}}}]},
     "tools", "not a JSON Schema"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object",
                                                                                "required": "a"}}}]},
     "tools", "not a JSON Schema"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "array"}}}]},
     "tools", "must describe an object"),
    ({"tools": [{"type": "function", "function": {"name": "no spaces"}}]}, "tools", "function.name"),
    ({"tools": TOOLS + TOOLS[:1]}, "tools", "given twice"),
    ({"tools": [{"type": "function", "function": {"name": f"f{i}"}} for i in range(10_000)]},
     "tools", "at most 128"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "fly"}}},
     "tool_choice", "not among the tools"),
    ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice", "must be"),
    ({"tool_choice": "required"}, "tool_choice", "needs tools"),
    ({"tools": TOOLS, "parallel_tool_calls": "yes"}, "parallel_tool_calls", "true or false"),
    ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}},
     "response_format", "cannot be combined"),
    ({"messages": ASK + [{"role": "tool", "tool_call_id": "call_nobody", "content": "21"}]},
     "messages", "no earlier assistant tool call"),
    ({"messages": ASK + [{"role": "tool", "content": "21"}]}, "messages", "tool_call_id: required"),
]


@pytest.mark.parametrize("extra,param,says", BAD_TOOLS, ids=[f"{p}-{i}" for i, (_, p, _) in enumerate(BAD_TOOLS)])
def test_bad_tools_are_refused_naming_the_field(server, extra, param, says):
    with httpx.Client(base_url=server, timeout=120) as c:
        r = c.post("/v1/chat/completions", json={"model": MODEL, "messages": ASK, "max_tokens": 2,
                                                 **extra})
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["param"] == param and err["message"].startswith(param) and says in err["message"], err
        ok = c.post("/v1/chat/completions", json={"model": MODEL, "messages": ASK, "max_tokens": 2})
        assert ok.status_code == 200, ok.text


# ---- the parsers on their own ---------------------------------------------------------------
def _feed(parser, text: str, step: int):
    content, deltas = "", []
    for i in range(0, len(text), step):
        c, d = parser.feed(text[i:i + step])
        content, deltas = content + c, deltas + d
    c, d = parser.finish()
    return content + c, assemble(deltas + d)


@pytest.mark.parametrize("step", [1, 3, 1000])
def test_required_parser_streams_each_calls_arguments(step):
    text = ('[{"name":"get_weather","arguments":{"city":"Par\\"is]}","unit":"celsius"}},'
            '{"name":"add","arguments":{"a":1,"b":{"deep":[1,{"x":2}]}}}]')
    content, calls = _feed(RequiredCallParser(), text, step)
    assert content == ""
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == [
        ("get_weather", {"city": 'Par"is]}', "unit": "celsius"}),
        ("add", {"a": 1, "b": {"deep": [1, {"x": 2}]}})]
    assert len({c["id"] for c in calls}) == 2


@pytest.mark.parametrize("step", [1, 4, 1000])
def test_hermes_parser_keeps_text_and_returns_broken_calls_as_text(step):
    text = ('Let me check. <tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
            '</tool_call>\n<tool_call>{"name": "add", "arguments": {"a": 1,</tool_call> a < b '
            '<tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}')   # unclosed at the end
    content, calls = _feed(HermesCallParser(), text, step)
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == [
        ("get_weather", {"city": "Paris"}), ("add", {"a": 1, "b": 2})]
    assert content == ('Let me check. \n<tool_call>{"name": "add", "arguments": {"a": 1,'
                       '</tool_call> a < b ')
    assert _feed(HermesCallParser(), "no calls at all <tool", step) == ("no calls at all <tool", [])


def test_named_parser_and_template_detection():
    content, calls = _feed(NamedCallParser("add"), '{"a": 1, "b": 2}', 2)
    assert content == "" and calls[0]["function"] == {"name": "add", "arguments": '{"a": 1, "b": 2}'}
    assert template_takes_tools("{% if tools %}{{ tools | tojson }}{% endif %}")
    assert not template_takes_tools("{% for message in messages %}{{ message.content }}{% endfor %}")
    assert template_takes_tools({"default": "x", "tool_use": "{{ tools }}"})
