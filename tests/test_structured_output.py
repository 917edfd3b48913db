"""Structured output (llguidance) and the chat-template controls, on the real smollm2 model.

One engine serves the module: smollm2 on the CPU platform whose "graphs" replay captured
functions (conftest.ReplayingCpuPlatform), with async scheduling on, so the same
engine shows that constrained rows never run ahead while greedy unconstrained ones do."""
from __future__ import annotations

import json
import re

import pytest
import torch

pytest.importorskip("llguidance")
jsonschema = pytest.importorskip("jsonschema")

from workbench import Engine, SamplingParams, StructuredOutputsParams  # noqa: E402
from workbench.executor.sampler import apply_token_bitmask  # noqa: E402

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 10},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "city": {"enum": ["Paris", "Rome", "Oslo", "Lima"]},
        "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 2},
    },
    "required": ["name", "age", "city", "tags"],
    "additionalProperties": False,
}
PHONE = r"\(\d{3}\) \d{3}-\d{4}"
COLORS = ["red", "green", "blue", "dark purple"]


@pytest.fixture(scope="module")
def engine(smollm2_dir):
    from conftest import ReplayingCpuPlatform

    import workbench.engine.build as build
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(build, "get_platform", lambda name: ReplayingCpuPlatform())
        e = Engine(model="smollm2", device="cpu", max_model_len=512, num_kv_blocks=128,
                   max_num_seqs=16, cudagraph_capture_sizes=[1, 2, 4, 8, 16],
                   async_scheduling=True)
    assert e.info().async_scheduling
    yield e
    e.close()


def chat(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


def test_constrained_samples_hold_and_never_run_ahead(engine):
    """One batch: 4 sampled (temperature 1) JSON-schema requests, 2 regex and 2 choice ones.
    Every output parses and validates, matches, or is one of the choices."""
    S, P = StructuredOutputsParams, SamplingParams
    prompts, params = [], []
    for seed in range(4):
        prompts.append(chat("Describe a person as JSON."))
        params.append(P(max_tokens=80, temperature=1.0, seed=seed, structured_outputs=S(json=PERSON)))
    for seed in range(2):
        prompts.append(chat("What is your phone number?"))
        params.append(P(max_tokens=30, temperature=1.0, seed=seed, structured_outputs=S(regex=PHONE)))
    for seed in range(2):
        prompts.append(chat("Name a color."))
        params.append(P(max_tokens=10, temperature=1.0, seed=seed, structured_outputs=S(choice=COLORS)))
    first = engine.telemetry.num_steps
    outs = engine.generate(prompts, params)
    for o in outs[:4]:
        assert o.finish_reason == "stop", o.text
        jsonschema.validate(json.loads(o.text), PERSON)
    assert len({o.text for o in outs[:4]}) > 1            # sampled, not one fixed answer
    for o in outs[4:6]:
        assert re.fullmatch(r"\(\d{3}\) \d{3}-\d{4}", o.text, re.ASCII), o.text
    assert all(o.text in COLORS for o in outs[6:]) and all(o.finish_reason == "stop" for o in outs)
    steps = engine.telemetry.steps_since(first)
    assert any(s.graph for s in steps)                      # decode steps replayed graphs ...
    assert not any(s.scheduled_ahead for s in steps)        # ... but none ran ahead
    # The same engine runs ahead for a greedy request without a grammar ...
    first = engine.telemetry.num_steps
    free = engine.generate([chat("Count to twenty.")], P(max_tokens=8, temperature=0, ignore_eos=True))
    assert sum(s.scheduled_ahead for s in engine.telemetry.steps_since(first)) >= 3
    # ... and not for a greedy one with a grammar, whose output is still valid.
    first = engine.telemetry.num_steps
    [o] = engine.generate([chat("What is your phone number?")],
                          P(max_tokens=30, temperature=0, structured_outputs=S(regex=PHONE)))
    assert re.fullmatch(r"\(\d{3}\) \d{3}-\d{4}", o.text, re.ASCII), o.text
    assert not any(s.scheduled_ahead for s in engine.telemetry.steps_since(first))
    assert free[0].finish_reason == "length" and engine.stats().kv_blocks_used == 0


def test_json_object_grammar_and_bad_input(engine):
    S, P = StructuredOutputsParams, SamplingParams
    obj, yes_no = engine.generate(
        ["A JSON object:", "Answer yes or no:"],
        [P(max_tokens=12, temperature=0, structured_outputs=S(json_object=True)),
         P(max_tokens=8, temperature=0, structured_outputs=S(
             grammar='start: answer "."\nanswer: "yes" | "no"'))])
    assert obj.text.startswith("{")   # an object (12 tokens may end before it closes)
    assert yes_no.text in ("yes.", "no.")
    before = engine.stats().num_waiting + engine.stats().num_running
    for bad, field in [(dict(json={"type": "nonsense"}), "structured_outputs.json"),
                       (dict(json="{not json"), "structured_outputs.json"),
                       (dict(regex="(("), "structured_outputs.regex"),
                       (dict(grammar="start: undefined_rule"), "structured_outputs.grammar"),
                       (dict(choice=[]), "structured_outputs.choice"),
                       (dict(regex="a", choice=["a"]), "structured_outputs")]:
        with pytest.raises(ValueError, match=f"^{re.escape(field)}:"):
            engine.add_request("hi", P(structured_outputs=S(**bad)))
    engine.step()
    assert engine.stats().num_waiting + engine.stats().num_running == before == 0   # none queued


def test_token_bitmask_applies_on_the_given_rows():
    torch.manual_seed(0)
    logits = torch.randn(3, 70)
    allowed = torch.rand(2, 70) < 0.3
    allowed[:, 5] = True
    words = torch.zeros(2, 3, dtype=torch.int64)
    for r in range(2):
        for t in allowed[r].nonzero().flatten().tolist():
            words[r, t // 32] |= 1 << (t % 32)
    bitmask = words.to(torch.int32) if words.max() < 2**31 else (
        torch.where(words >= 2**31, words - 2**32, words).to(torch.int32))
    with torch.inference_mode():              # the runner's logits are inference tensors
        inf_logits = logits.clone()
        out = apply_token_bitmask(inf_logits, bitmask, torch.tensor([0, 2]))
    want = logits.clone()
    want[0][~allowed[0]] = float("-inf")
    want[2][~allowed[1]] = float("-inf")
    assert torch.equal(out, want)


TOOL_CHAT = [
    {"role": "system", "content": "You are helpful."},
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": "",
     "tool_calls": [{"id": "call_1", "type": "function",
                     "function": {"name": "weather", "arguments": {"city": "Paris"}}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "18 C, sunny"},
]


def test_chat_template_controls_match_the_tokenizer(engine, smollm2_tokenizer):
    tok = smollm2_tokenizer

    def ref(messages, **kw):
        text = tok.apply_chat_template(messages, tokenize=False, **kw)
        return tok.encode(text, add_special_tokens=False)

    convo = chat("Write a haiku.") + [{"role": "assistant", "content": "Autumn moon"}]
    cases = [
        (chat("Hi"), {}, dict(add_generation_prompt=True)),
        (chat("Hi"), dict(add_generation_prompt=False), dict(add_generation_prompt=False)),
        (convo, dict(add_generation_prompt=False, continue_final_message=True),
         dict(add_generation_prompt=False, continue_final_message=True)),
        (TOOL_CHAT, {}, dict(add_generation_prompt=True)),
    ]
    seen = set()
    for messages, ours, theirs in cases:
        ids = engine.tokenize(messages, **ours)
        assert ids == ref(messages, **theirs)
        seen.add(tuple(ids))
    assert len(seen) == len(cases)                         # each control changed the prompt
    closed = engine.tokenize(convo, add_generation_prompt=False)
    assert engine.tokenize(convo, add_generation_prompt=False, continue_final_message=True) \
        == closed[:len(engine.tokenize(convo, add_generation_prompt=False,
                                       continue_final_message=True))]   # the turn left open
    # chat_template and chat_template_kwargs reach the template.
    template = "{% for m in messages %}<{{ m.role }}|{{ greeting }}>{{ m.content }}{% endfor %}"
    ids = engine.tokenize(chat("Hi"), chat_template=template,
                          chat_template_kwargs={"greeting": "hello"})
    assert tok.decode(ids) == "<user|hello>Hi"
    # Text prompts: truncate_prompt_tokens keeps the last k; add_special_tokens is passed on.
    text = "one two three four five six seven"
    assert engine.tokenize(text, truncate_prompt_tokens=3) == tok.encode(text)[-3:]
    assert engine.tokenize(text, add_special_tokens=False) == tok.encode(text, add_special_tokens=False)
    for kw, field in [(dict(add_generation_prompt=True, continue_final_message=True), "continue_final_message"),
                      (dict(add_generation_prompt=False, continue_final_message=True), "continue_final_message"),
                      (dict(chat_template_kwargs={"tokenize": True}), "chat_template_kwargs"),
                      (dict(chat_template="{% if %}"), "chat_template")]:
        with pytest.raises(ValueError, match=f"^{field}:"):
            engine.tokenize(chat("Hi"), **kw)


def test_logprobs_run_ahead_and_n_choices_have_their_own_grammar(engine, hf_smollm2):
    """Async scheduling on the CPU (graph replay stand-in): a greedy request with logprobs
    still runs ahead, and its logprobs (computed on the device, copied back with the ids)
    equal HF's log_softmax. n choices of a constrained request each follow the grammar."""
    S, P = StructuredOutputsParams, SamplingParams
    first = engine.telemetry.num_steps
    [o] = engine.generate([chat("Count to twenty.")],
                          P(max_tokens=8, temperature=0, ignore_eos=True, logprobs=2))
    assert sum(s.scheduled_ahead for s in engine.telemetry.steps_since(first)) >= 3
    ids = o.prompt_token_ids + o.token_ids
    with torch.inference_mode():
        ref = torch.log_softmax(hf_smollm2(torch.tensor([ids])).logits[0].float(), -1)
    n = len(o.prompt_token_ids)
    for i, (t, lps) in enumerate(zip(o.token_ids, o.outputs[0].logprobs)):
        assert abs(lps[t].logprob - ref[n + i - 1, t].item()) < 1e-4 and lps[t].rank == 1
    [o] = engine.generate([chat("Name a color.")], P(max_tokens=10, temperature=1.0, seed=1, n=3,
                                                     structured_outputs=S(choice=COLORS)))
    assert [c.index for c in o.outputs] == [0, 1, 2]
    assert all(c.text in COLORS and c.finish_reason == "stop" for c in o.outputs), o.outputs
    assert engine.stats().kv_blocks_used == 0


def test_a_served_request_is_checked_tokenized_and_compiled_once(engine, monkeypatch):
    """The server's way through the front door (issue 39): a chat request with a grammar and
    n = 2 has its params checked once (SamplingParams.validate), its conversation rendered and
    encoded once (Engine.tokenize, then make_request with the ids), and its grammar compiled
    once, each choice matching on a copy of the one matcher; its reply still follows it."""
    pytest.importorskip("fastapi")
    from collections import Counter

    from fastapi.testclient import TestClient

    from workbench.serving.app import create_app
    so = engine.core.structured_output
    so.compile(StructuredOutputsParams(regex="warm"))     # llguidance's tokenizer, built once
    calls: Counter = Counter()

    def count(owner, name):
        real = getattr(owner, name)

        def counted(*args, **kwargs):
            calls[name] += 1
            return real(*args, **kwargs)
        monkeypatch.setattr(owner, name, counted)

    count(SamplingParams, "validate")
    count(type(engine.inputs), "__call__")
    count(engine.tokenizer, "apply_chat_template")
    count(engine.tokenizer, "encode")
    count(so, "compile")
    count(so, "_compile")
    pattern = "(yes|no) at [0-9]{2}:1[0-9]"        # a grammar no other test compiled
    with TestClient(create_app(engine, allow_missing_model=True)) as client:
        r = client.post("/v1/chat/completions", json={
            "messages": chat("Answer."), "n": 2, "max_tokens": 12, "temperature": 0.8,
            "seed": 3, "structured_outputs": {"regex": pattern}})
    assert r.status_code == 200, r.text
    assert [re.fullmatch(pattern, c["message"]["content"]) is not None
            for c in r.json()["choices"]] == [True, True]
    assert calls == {"validate": 1, "__call__": 1, "apply_chat_template": 1, "encode": 1,
                     "compile": 1, "_compile": 1}, calls
