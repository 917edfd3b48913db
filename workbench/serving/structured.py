"""Structured output asked for over HTTP: the ways a request may ask (OpenAI's
response_format, vLLM's structured_outputs and legacy guided_* fields; one per request) turned
into StructuredOutputsParams, and JSON schemas closed as OpenAI's strict mode closes them."""
from __future__ import annotations

from typing import Any

from ..core.sampling_params import StructuredOutputsParams
from .protocol import APIError, bad_request


GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice",
          "guided_grammar": "grammar"}
"""vLLM's legacy structured-output fields -> the structured_outputs key each stands for."""



def structured_outputs_from(body: dict) -> tuple[StructuredOutputsParams | None, str | None]:
    """response_format, structured_outputs or vLLM's legacy guided_* fields -> the engine's
    StructuredOutputsParams and the field that asked; at most one of the ways per request."""
    asked = [n for n in ("response_format", "structured_outputs", *GUIDED) if body.get(n) is not None]
    rf = body.get("response_format")
    if rf is not None and not isinstance(rf, dict):
        raise bad_request("response_format", "response_format: must be an object with a 'type'")
    if rf is not None and rf.get("type") == "text" and set(rf) == {"type"}:
        asked.remove("response_format")   # plain text: asks for nothing
    if len(asked) > 1:
        raise bad_request(asked[1], f"{asked[1]}: only one of {', '.join(asked)} may be given")
    if not asked:
        return None, None
    name = asked[0]
    return _structured_outputs(body, name), name


def closed_schema(schema: Any) -> Any:
    """The schema with `additionalProperties: false` on each object that lists its properties
    and says nothing of others, as OpenAI's strict mode has it (json_schema with `strict: true`,
    and every tool's arguments): what validates still validates against the schema given, and
    a model cannot go on inventing keys until max_tokens."""
    if isinstance(schema, list):
        return [closed_schema(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: closed_schema(v) if k in ("items", "anyOf", "oneOf", "allOf", "prefixItems") else v
           for k, v in schema.items()}
    for key in ("properties", "$defs", "definitions"):     # name -> schema
        if isinstance(out.get(key), dict):
            out[key] = {k: closed_schema(v) for k, v in out[key].items()}
    if isinstance(out.get("properties"), dict):
        out.setdefault("additionalProperties", False)
    return out


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
                    raise bad_request(name, "response_format.json_schema: must be an object with "
                                     "'name' and 'schema'")
                extra = set(js) - {"name", "schema", "strict", "description"}
                if extra:
                    raise bad_request(name, f"response_format.json_schema: unknown field {sorted(extra)[0]!r}")
                strict = js.get("strict")
                if strict is not None and not isinstance(strict, bool):
                    raise bad_request(name, f"response_format.json_schema.strict: must be true "
                                      f"or false (got {strict!r})")
                # No schema: any JSON value. strict: no keys past those listed.
                schema = js.get("schema", {})
                return StructuredOutputsParams(json=closed_schema(schema) if strict else schema)
            raise bad_request(name, "response_format: must be {'type': 'text'}, {'type': 'json_object'} "
                             "or {'type': 'json_schema', 'json_schema': {...}}")
        if name == "structured_outputs":
            kinds = body[name]                  # {"json": ...}, {"regex": ...}, ...
            if not isinstance(kinds, dict):
                raise bad_request(name, "structured_outputs: must be an object")
            unknown = set(kinds) - set(StructuredOutputsParams.KINDS)
            if unknown:
                raise bad_request(name, f"structured_outputs: {sorted(unknown)[0]!r} is not supported "
                                 f"(known: {', '.join(StructuredOutputsParams.KINDS)})",
                           code="unsupported_parameter")
            return StructuredOutputsParams(**kinds)
        return StructuredOutputsParams(**{GUIDED[name]: body[name]})
    except ValueError as e:
        raise structured_error(name, e) from None


def structured_error(name: str, e: ValueError) -> APIError:
    """The engine names structured_outputs.<kind>; a request that used another field is told
    about the field it sent."""
    msg = str(e)
    if name != "structured_outputs" and msg.startswith("structured_outputs"):
        msg = name + msg[msg.index(":"):]
    return bad_request(name, msg)
