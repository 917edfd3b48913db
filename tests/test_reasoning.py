"""The reasoning parsers (serving/reasoning.py) on text streams cut at every position: the
pieces put together are the whole text's split, whatever the cuts, so no tag is ever split
across the two fields or leaked into either. Also strict json_schema closing (protocol.py)."""
from __future__ import annotations

import itertools

import pytest

from workbench.serving.reasoning import reasoning_parser, split_reasoning

TEXTS = {
    # text: (qwen3's split, deepseek_r1's split)
    "<think>\nLet me see.\n</think>\n\nParis.": (("\nLet me see.\n", "\n\nParis."),) * 2,
    "\n<think>a<b</think>c</think>d": (("a<b", "c</think>d"),) * 2,
    "Paris.": (("", "Paris."), ("Paris.", "")),
    "<thin": (("", "<thin"), ("<thin", "")),
    "<think>cut short": (("cut short", ""),) * 2,
    "<think>x</thi": (("x</thi", ""),) * 2,
    "<think></think>": (("", ""),) * 2,
    "thinking</think>answer <think>not a tag": (
        ("", "thinking</think>answer <think>not a tag"),
        ("thinking", "answer <think>not a tag")),
    "": (("", ""),) * 2,
    " ": (("", " "), (" ", "")),
    "< think>": (("", "< think>"), ("< think>", "")),
    "<think><think></think>": (("<think>", ""),) * 2,
}


def run(name: str, pieces) -> tuple[str, str, list[tuple[str, str]]]:
    p = reasoning_parser(name)()
    out = [p.feed(x) for x in pieces] + [p.finish()]
    return "".join(r for r, _ in out), "".join(c for _, c in out), out


@pytest.mark.parametrize("name", ["qwen3", "deepseek_r1"])
def test_whole_texts_split_as_the_model_meant(name):
    for text, splits in TEXTS.items():
        want = splits[0] if name == "qwen3" else splits[1]
        assert split_reasoning(name, text) == want, (name, text)


@pytest.mark.parametrize("name", ["qwen3", "deepseek_r1"])
def test_every_cut_gives_the_same_split(name):
    """One and two cuts at every position, and one character at a time: the same fields,
    and no piece of reasoning or content that holds part of a tag that was a tag."""
    for text in TEXTS:
        want = split_reasoning(name, text)
        n = len(text)
        cuts = [(i,) for i in range(n + 1)] + list(itertools.combinations(range(n + 1), 2))
        for cut in cuts + [tuple(range(n + 1))]:
            bounds = (0, *cut, n)
            pieces = [text[a:b] for a, b in zip(bounds, bounds[1:])]
            r, c, out = run(name, pieces)
            assert (r, c) == want, (name, text, pieces, out)


def test_tags_held_back_until_known():
    """A piece that may start a tag is not sent until it is known: '<thi' waits, and goes out
    as content once it turns out not to be '<think>'."""
    p = reasoning_parser("qwen3")()
    assert p.feed("<thi") == ("", "")
    assert p.feed("s is") == ("", "<this is")
    p = reasoning_parser("qwen3")()
    assert p.feed("<think>abc</") == ("abc", "")
    assert p.feed("think>") == ("", "")
    assert p.feed("ok") == ("", "ok")
    with pytest.raises(ValueError, match="reasoning_parser"):
        reasoning_parser("granite")


def test_strict_json_schema_closes_every_object():
    """response_format json_schema strict: every object that lists properties and says
    nothing of others gets additionalProperties false (nested ones too); one that says
    otherwise keeps it; without strict the schema is as sent."""
    from workbench.serving.protocol import APIError
    from workbench.serving.structured import structured_outputs_from
    schema = {"type": "object", "properties": {
        "name": {"type": "string"},
        "address": {"type": "object", "properties": {"city": {"type": "string"}}},
        "tags": {"type": "array", "items": {"type": "object", "properties": {"k": {}}}},
        "extra": {"type": "object", "properties": {}, "additionalProperties": True}}}

    def sent(strict):
        body = {"response_format": {"type": "json_schema", "json_schema": {
            "name": "p", "schema": schema, **({} if strict is None else {"strict": strict})}}}
        return structured_outputs_from(body)[0].json

    closed = sent(True)
    assert closed["additionalProperties"] is False
    assert closed["properties"]["address"]["additionalProperties"] is False
    assert closed["properties"]["tags"]["items"]["additionalProperties"] is False
    assert closed["properties"]["extra"]["additionalProperties"] is True
    assert sent(False) == schema and sent(None) == schema
    with pytest.raises(APIError) as e:
        sent("yes")
    assert e.value.param == "response_format"
