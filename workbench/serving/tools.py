"""Tool calling on /v1/chat/completions: the request's `tools` and `tool_choice` checked, the
tools put into the prompt, the output constrained where the choice says a call must come, and
the model's text turned into OpenAI's `tool_calls`, streamed (deltas) or whole.

How each `tool_choice` runs:

- `none`: the tools are left out of the prompt and the model answers in text.
- `auto`: the tools go into the prompt (through the chat template where it takes `tools`, else
  the fallback below) and the model decides. Its calls are read by the `--tool-call-parser`:
  `hermes`, the `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks that Hermes,
  Qwen2.5/Qwen3 and SmolLM3 are trained to write. A block whose JSON does not parse is
  returned as text, never an error. In a stream each call arrives whole, once its block closes
  (nothing guarantees the JSON before then).
- `required`: the structured-output engine holds the output to a JSON array of
  `{"name": <one of the tools>, "arguments": <that tool's parameters>}` (one item when
  `parallel_tool_calls` is false), so the arguments validate whatever the model is. Streamed,
  the arguments arrive as they are written (OpenAI's incremental `arguments`).
- a named function: the output is held to that function's parameters schema and is its
  arguments, streamed as they are written; finish_reason is "stop", as OpenAI's is.

The fallback for a chat template without tools (SmolLM2's): a system message that lists the
tools as JSON and asks for Hermes-style blocks; earlier assistant calls are written back as
those blocks and tool results as `<tool_response>` user turns, the shape such models read.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from ..core.sampling_params import StructuredOutputsParams
from .protocol import bad_request
from .structured import closed_schema
from .tool_parsers import (CALL_CLOSE, CALL_OPEN, HermesCallParser, NamedCallParser,
                           RequiredCallParser, TextParser, ToolCallParser)

MAX_TOOLS = 128
"""OpenAI's own limit on tools per request."""


NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
"""OpenAI's rule for a function's name."""



@dataclass
class ToolChoice:
    """A request's tools and what it asked of them, checked."""
    tools: list[dict]
    """The tools as chat templates read them: {"type": "function", "function": {name,
    description, parameters}}."""
    mode: str
    """"none", "auto", "required" or "named"."""
    name: str | None = None
    """The function tool_choice names (mode "named")."""
    parallel: bool = True

    @property
    def functions(self) -> dict[str, dict]:
        return {t["function"]["name"]: t["function"] for t in self.tools}

    def structured_outputs(self) -> StructuredOutputsParams | None:
        """The grammar that makes the output a call: for `required` an array of calls, for a
        named function its arguments; None where the model may answer in text."""
        if self.mode == "named":
            return StructuredOutputsParams(json=closed_schema(self.functions[self.name]["parameters"]))
        if self.mode != "required":
            return None
        calls = [{"type": "object", "properties": {"name": {"const": n},
                                                   "arguments": closed_schema(f["parameters"])},
                  "required": ["name", "arguments"], "additionalProperties": False}
                 for n, f in self.functions.items()]
        schema: dict = {"type": "array", "minItems": 1,
                        "items": calls[0] if len(calls) == 1 else {"anyOf": calls}}
        if not self.parallel:
            schema["maxItems"] = 1
        return StructuredOutputsParams(json=schema)

    def parser(self) -> ToolCallParser:
        return {"named": lambda: NamedCallParser(self.name), "required": RequiredCallParser,
                "auto": HermesCallParser}.get(self.mode, TextParser)()

    def finish_reason(self, engine_reason: str | None, made_calls: bool) -> str | None:
        """OpenAI's finish_reason: "tool_calls" when the model stopped after calling (a
        named function's call ends with "stop")."""
        if engine_reason == "stop" and made_calls and self.mode != "named":
            return "tool_calls"
        return engine_reason


def tool_choice_from(body: dict) -> ToolChoice | None:
    """`tools`, `tool_choice` and `parallel_tool_calls` -> a ToolChoice (None: no tools), each
    mistake a 400 naming its field."""
    tools, choice = body.get("tools"), body.get("tool_choice")
    parallel = body.get("parallel_tool_calls")
    if parallel is not None and not isinstance(parallel, bool):
        raise bad_request("parallel_tool_calls", f"parallel_tool_calls: must be true or false "
                          f"(got {parallel!r})")
    if tools is None or tools == []:
        if choice not in (None, "none"):
            raise bad_request("tool_choice", "tool_choice: needs tools (none were given)")
        return None
    if not isinstance(tools, list):
        raise bad_request("tools", "tools: must be a list of {'type': 'function', 'function': {...}}")
    if len(tools) > MAX_TOOLS:
        raise bad_request("tools", f"tools: at most {MAX_TOOLS} tools per request (got {len(tools)})")
    checked = [_tool(t, f"tools[{i}]") for i, t in enumerate(tools)]
    names = [t["function"]["name"] for t in checked]
    dup = next((n for i, n in enumerate(names) if n in names[:i]), None)
    if dup is not None:
        raise bad_request("tools", f"tools: the function name {dup!r} is given twice")
    name = None
    if choice is None:
        mode = "auto"
    elif choice in ("none", "auto", "required"):
        mode = choice
    elif isinstance(choice, dict) and choice.get("type") == "function" and isinstance(
            choice.get("function"), dict) and isinstance(choice["function"].get("name"), str):
        mode, name = "named", choice["function"]["name"]
        if name not in names:
            raise bad_request("tool_choice", f"tool_choice: names the function {name!r}, which is "
                              f"not among the tools ({', '.join(names)})")
    else:
        raise bad_request("tool_choice", "tool_choice: must be 'none', 'auto', 'required' or "
                          "{'type': 'function', 'function': {'name': ...}}")
    return ToolChoice(checked, mode, name, parallel is not False)


def _tool(t: Any, where: str) -> dict:
    fn = t.get("function") if isinstance(t, dict) else None
    if not (isinstance(t, dict) and t.get("type", "function") == "function" and isinstance(fn, dict)):
        raise bad_request("tools", f"{where}: must be {{'type': 'function', 'function': "
                          "{'name': ..., 'parameters': {...}}}")
    name = fn.get("name")
    if not (isinstance(name, str) and NAME.match(name)):
        raise bad_request("tools", f"{where}.function.name: must be 1-64 letters, digits, _ or - "
                          f"(got {name!r})")
    desc = fn.get("description")
    if desc is not None and not isinstance(desc, str):
        raise bad_request("tools", f"{where}.function.description: must be a string")
    params = fn.get("parameters")
    if params is None:
        params = {"type": "object", "properties": {}}
    _check_schema(params, f"{where}.function.parameters")
    out = {"name": name, "parameters": params}
    if desc is not None:
        out["description"] = desc
    return {"type": "function", "function": out}


def _check_schema(schema: Any, where: str) -> None:
    """The parameters are a JSON Schema (checked against the metaschema it names, 2020-12 by
    default) for an object."""
    if not isinstance(schema, dict):
        raise bad_request("tools", f"{where}: must be a JSON Schema object")
    import jsonschema
    try:
        jsonschema.validators.validator_for(schema, jsonschema.Draft202012Validator).check_schema(schema)
    except jsonschema.SchemaError as e:
        path = "".join(f"[{p!r}]" for p in e.path)
        raise bad_request("tools", f"{where}{path}: not a JSON Schema: {e.message}") from None
    if schema.get("type", "object") != "object":
        raise bad_request("tools", f"{where}: must describe an object (type 'object'; got "
                          f"{schema.get('type')!r})")


# ---- the conversation -----------------------------------------------------------------------
def check_tool_messages(messages: list[dict]) -> None:
    """Every `tool` message answers a call an earlier assistant message made, by its id."""
    ids: set[str] = set()
    for i, m in enumerate(messages):
        for c in m.get("tool_calls") or ():
            if c.get("id") is not None:
                ids.add(c["id"])
        if m["role"] == "tool":
            tid = m.get("tool_call_id")
            if tid is None:
                raise bad_request("messages", f"messages[{i}].tool_call_id: required on a tool message")
            if tid not in ids:
                raise bad_request("messages", f"messages[{i}].tool_call_id: no earlier assistant "
                                  f"tool call has the id {tid!r}")


def template_takes_tools(template: Any) -> bool:
    """Whether a chat template renders `tools` itself (it reads the variable)."""
    if isinstance(template, dict):      # named templates: HF picks "tool_use" when there are tools
        template = template.get("tool_use") or template.get("default") or ""
    return isinstance(template, str) and re.search(r"\btools\b", template) is not None


def fallback_messages(messages: list[dict], tools: list[dict]) -> list[dict]:
    """The conversation for a template that has no tools: the tools in a system message, the
    assistant's calls as Hermes blocks and the tool results as <tool_response> user turns."""
    listed = "\n".join(json.dumps(t, ensure_ascii=False) for t in tools)
    system = ("You may call one or more functions to answer. The functions, as JSON Schema:\n"
              f"<tools>\n{listed}\n</tools>\n"
              "To call a function, reply with a JSON object of its name and arguments inside "
              f"{CALL_OPEN}{CALL_CLOSE} tags, one block per call:\n"
              f'{CALL_OPEN}\n{{"name": <function-name>, "arguments": <args-json-object>}}\n{CALL_CLOSE}')
    out = [dict(m) for m in messages]
    if out and out[0]["role"] == "system":
        out[0]["content"] = f"{out[0]['content']}\n\n{system}" if out[0]["content"] else system
    else:
        out.insert(0, {"role": "system", "content": system})
    for m in out:
        calls = m.pop("tool_calls", None)
        if calls:
            blocks = "\n".join(f"{CALL_OPEN}\n" + json.dumps(
                {"name": c["function"]["name"], "arguments": c["function"]["arguments"]},
                ensure_ascii=False) + f"\n{CALL_CLOSE}" for c in calls)
            m["content"] = f"{m['content']}\n{blocks}" if m["content"] else blocks
        if m["role"] == "tool":
            m.pop("tool_call_id", None)
            m.update(role="user", content=f"<tool_response>\n{m['content']}\n</tool_response>")
    return out


# ---- the model's text -> tool calls ---------------------------------------------------------
