"""Structured output requests -> `StructuredOutput` (common/sampling_params.py).

Two spellings reach the same constraint: OpenAI's `response_format` and vLLM's
`structured_outputs` object. vLLM's removed `guided_*` fields get a 400 naming their replacement
rather than being ignored, since ignoring one would return unconstrained text that looks fine.
The api checks shapes only; the tokenizer process compiles the spec (llguidance) and answers a
schema or grammar it cannot compile with an error delta, which becomes a 400.
"""

from __future__ import annotations

import json
import re
from typing import Any

import msgspec

from stoker.common.sampling_params import StructuredOutput
from stoker.services.api.errors import ApiError

NAME_RE = re.compile(r"^[a-zA-Z0-9_-]{1,64}$")  # OpenAI's rule for schema and function names


class TextFormat(msgspec.Struct, tag_field="type", tag="text", forbid_unknown_fields=True):
    """Plain text: no constraint."""


class JsonObjectFormat(
    msgspec.Struct, tag_field="type", tag="json_object", forbid_unknown_fields=True
):
    """Any JSON object."""


class JsonSchemaSpec(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    name: str  # required by OpenAI; stoker only checks it
    schema: dict[str, Any] | None = None
    description: str | None = None  # no-op: the model sees only what the prompt says
    strict: bool | None = None  # no-op: the grammar enforces the schema exactly either way


class JsonSchemaFormat(
    msgspec.Struct, tag_field="type", tag="json_schema", forbid_unknown_fields=True
):
    json_schema: JsonSchemaSpec


ResponseFormat = TextFormat | JsonObjectFormat | JsonSchemaFormat


class StructuredOutputsIn(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """vLLM's `structured_outputs` (its StructuredOutputsParams): exactly one constraint."""

    json: dict[str, Any] | str | None = None  # a JSON schema, as an object or as JSON text
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None  # GBNF when it uses `::=`, else llguidance's Lark dialect
    json_object: bool | None = None
    # vLLM's: {"structures": [{"begin", "schema", "end"}], "triggers": [...]}; calls in free text
    structural_tag: str | dict[str, Any] | None = None
    disable_fallback: bool | None = None  # no-op: one backend (llguidance), nothing to fall to
    # JSON constraints only, as in vLLM: the schema's llguidance options (x-guidance), and
    # additionalProperties false on every object schema that does not say otherwise.
    disable_any_whitespace: bool | None = None
    disable_additional_properties: bool | None = None
    whitespace_pattern: str | None = None


# vLLM's guided_* fields (removed there in favour of structured_outputs) -> what to send instead.
REMOVED_GUIDED_FIELDS = {
    "guided_json": "structured_outputs.json, or response_format {type: json_schema}",
    "guided_regex": "structured_outputs.regex",
    "guided_choice": "structured_outputs.choice",
    "guided_grammar": "structured_outputs.grammar",
    "guided_json_object": "structured_outputs.json_object, or response_format {type: json_object}",
    "guided_whitespace_pattern": "structured_outputs.whitespace_pattern",
    "guided_decoding_backend": "nothing: stoker has one grammar backend (llguidance)",
}


def reject_removed(given: dict[str, Any]) -> None:
    """A 400 naming the replacement for the first removed guided_* field that is set."""
    for name, value in given.items():
        if value is not None:
            replacement = REMOVED_GUIDED_FIELDS[name]
            raise ApiError(f"`{name}` is vLLM's removed spelling; use {replacement}", param=name)


def structured_output(
    response_format: ResponseFormat | None, structured_outputs: StructuredOutputsIn | None
) -> StructuredOutput | None:
    """The request's one output constraint, or None."""
    from_format = _from_response_format(response_format)
    from_vllm = _from_structured_outputs(structured_outputs)
    if from_format is not None and from_vllm is not None:
        raise ApiError(
            "response_format and structured_outputs both constrain the output; send one of them",
            param="structured_outputs",
        )
    return from_format or from_vllm


def compact_json(obj: Any, param: str) -> str:
    """JSON text without whitespace. A client's object may be nested as deep as the decoder
    allowed, which a few frames further down is too deep: that is the request's fault."""
    try:
        return msgspec.json.encode(obj).decode()
    except RecursionError:
        raise ApiError(f"{param} is nested too deeply", param=param) from None


def _from_response_format(rf: ResponseFormat | None) -> StructuredOutput | None:
    if rf is None or isinstance(rf, TextFormat):
        return None
    if isinstance(rf, JsonObjectFormat):
        return StructuredOutput(kind="json_object")
    spec = rf.json_schema
    if not NAME_RE.match(spec.name):
        raise ApiError(
            "response_format.json_schema.name must be 1-64 characters of a-z, A-Z, 0-9, _ and -",
            param="response_format",
        )
    if spec.schema is None:
        raise ApiError(
            "response_format.json_schema.schema is required: it is what the output must match",
            param="response_format",
        )
    return StructuredOutput(kind="json_schema", spec=compact_json(spec.schema, "response_format"))


def _from_structured_outputs(so: StructuredOutputsIn | None) -> StructuredOutput | None:
    if so is None:
        return None
    param = "structured_outputs"
    if so.structural_tag is not None:
        return _structural_tag(so.structural_tag)
    given = [
        name
        for name, value in (
            ("json", so.json),
            ("regex", so.regex),
            ("choice", so.choice),
            ("grammar", so.grammar),
            ("json_object", so.json_object or None),
        )
        if value is not None
    ]
    if len(given) > 1:
        raise ApiError(
            f"structured_outputs takes exactly one constraint, got {', '.join(given)}", param=param
        )
    if not given:
        return None
    if so.json is not None:
        schema = _schema_object(so.json)
        if so.disable_additional_properties:
            schema = _closed(schema)
        return _json_constraint(schema, so)
    if so.json_object:
        return _json_constraint({"type": "object"}, so)
    if so.regex is not None:
        return StructuredOutput(kind="regex", spec=so.regex)
    if so.choice is not None:
        if not so.choice:
            raise ApiError("structured_outputs.choice must not be empty", param=param)
        return StructuredOutput(kind="choice", spec=compact_json(so.choice, "structured_outputs"))
    if so.grammar is not None:
        # GBNF (llama.cpp's) writes rules with `::=`; llguidance's Lark dialect never does.
        kind = "gbnf" if "::=" in so.grammar else "lark"
        return StructuredOutput(kind=kind, spec=so.grammar)
    raise AssertionError("unreachable: one constraint was given")


def _json_constraint(schema: dict[str, Any], so: StructuredOutputsIn) -> StructuredOutput:
    # llguidance reads its JSON options from the schema's top-level "x-guidance" key
    # (https://github.com/guidance-ai/llguidance/blob/main/docs/json_schema.md).
    options: dict[str, Any] = {}
    if so.disable_any_whitespace:
        options["whitespace_flexible"] = False
    if so.whitespace_pattern is not None:
        options["whitespace_pattern"] = so.whitespace_pattern
    if options:
        given = schema.get("x-guidance")
        schema = {**schema, "x-guidance": {**(given if isinstance(given, dict) else {}), **options}}
    if schema == {"type": "object"}:
        return StructuredOutput(kind="json_object")
    return StructuredOutput(kind="json_schema", spec=compact_json(schema, "structured_outputs"))


def _schema_object(schema: dict[str, Any] | str) -> dict[str, Any]:
    if isinstance(schema, str):
        try:
            schema = msgspec.json.decode(schema)
        except (msgspec.DecodeError, RecursionError):
            raise ApiError(
                "structured_outputs.json is not valid JSON", param="structured_outputs"
            ) from None
    if not isinstance(schema, dict):
        raise ApiError(
            "structured_outputs.json must be a JSON schema object", param="structured_outputs"
        )
    return schema


def _closed(schema: dict[str, Any]) -> dict[str, Any]:
    try:
        return _no_additional_properties(schema)
    except RecursionError:  # as deep as the decoder allowed is deeper than this walk may go
        raise ApiError(
            "structured_outputs.json is nested too deeply", param="structured_outputs"
        ) from None


# The keywords whose values are subschemas (JSON Schema 2020-12 and draft 7), by shape.
_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_SCHEMA_LISTS = ("allOf", "anyOf", "oneOf", "prefixItems")
_SCHEMA_ONES = ("items", "additionalItems", "contains", "not", "if", "then", "else")


def _no_additional_properties(schema: Any) -> Any:
    """vLLM's disable_additional_properties: every object schema that does not say otherwise
    gets additionalProperties false, so the output holds only the properties named."""
    if isinstance(schema, list):  # draft 4's tuple `items`
        return [_no_additional_properties(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    for key in _SCHEMA_MAPS:
        if isinstance(out.get(key), dict):
            out[key] = {name: _no_additional_properties(s) for name, s in out[key].items()}
    for key in (*_SCHEMA_LISTS, *_SCHEMA_ONES):
        if key in out:
            out[key] = _no_additional_properties(out[key])
    is_object = out.get("type") == "object" or "properties" in out or "patternProperties" in out
    if is_object and "additionalProperties" not in out:
        out["additionalProperties"] = False
    return out


def _structural_tag(given: str | dict[str, Any]) -> StructuredOutput:
    """vLLM's structural tag: free text in which each `begin ... end` segment (opened by one of
    the triggers) must hold JSON matching its schema. The tokenizer process compiles it with
    llguidance's StructTag (services/tokenizer/grammar_compile.py)."""
    param = "structured_outputs"
    tag = given
    if isinstance(given, str):
        try:
            tag = json.loads(given)
        except json.JSONDecodeError:
            raise ApiError("structural_tag is not valid JSON", param=param) from None
    if not isinstance(tag, dict):
        raise ApiError("structural_tag must be an object", param=param)
    structures, triggers = tag.get("structures"), tag.get("triggers")
    if not isinstance(structures, list) or not structures or not isinstance(triggers, list):
        raise ApiError("structural_tag needs non-empty `structures` and `triggers`", param=param)
    if not all(isinstance(t, str) and t for t in triggers):
        raise ApiError("structural_tag triggers must be non-empty strings", param=param)
    for s in structures:
        ok = (
            isinstance(s, dict)
            and isinstance(s.get("begin"), str)
            and isinstance(s.get("end"), str)
        )
        if not ok or not isinstance(s.get("schema", {}), dict):
            raise ApiError(
                "each structural_tag structure needs `begin` and `end` strings, and a `schema` "
                "object",
                param=param,
            )
        if not any(s["begin"].startswith(t) for t in triggers):
            raise ApiError(
                f"structural_tag begin {s['begin']!r} starts with none of the triggers", param=param
            )
    spec = {"structures": structures, "triggers": triggers}
    return StructuredOutput(kind="structural_tag", spec=compact_json(spec, param))
