"""Tools on a chat request -> what the template renders, whether the api parses calls out of the
output, and the grammar that forces calls (`tool_choice` required or named).

As vLLM does: with tool_choice "none" the template still sees the tools but the output is not
parsed; "auto" parses whatever the model wrote; "required" and a named function also constrain
the output (a StructuredOutput of kind tool_calls, which the tokenizer process turns into a
grammar). The deprecated `functions` / `function_call` map onto tools / tool_choice, and the
response answers in their shape (`message.function_call`).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Literal

import msgspec

from stoker.common.sampling_params import StructuredOutput
from stoker.services.api.errors import ApiError
from stoker.services.api.structured_request import NAME_RE, compact_json


class FunctionDef(msgspec.Struct, forbid_unknown_fields=True, kw_only=True, omit_defaults=True):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema; omitted: no parameters
    strict: bool | None = None  # no-op: a forced call follows the schema exactly either way


class FunctionTool(msgspec.Struct, tag_field="type", tag="function", forbid_unknown_fields=True):
    function: FunctionDef


class CustomTool(msgspec.Struct, tag_field="type", tag="custom"):
    """OpenAI's free-form tools: a 400 (stoker parses function calls only)."""

    custom: dict[str, Any] | None = None


Tool = FunctionTool | CustomTool


class FunctionName(msgspec.Struct, forbid_unknown_fields=True):
    name: str


class NamedFunctionChoice(
    msgspec.Struct, tag_field="type", tag="function", forbid_unknown_fields=True
):
    function: FunctionName


class NamedCustomChoice(msgspec.Struct, tag_field="type", tag="custom"):
    custom: dict[str, Any] | None = None


class AllowedTools(msgspec.Struct, forbid_unknown_fields=True):
    mode: Literal["auto", "required"]
    tools: list[NamedFunctionChoice]


class AllowedToolsChoice(
    msgspec.Struct, tag_field="type", tag="allowed_tools", forbid_unknown_fields=True
):
    allowed_tools: AllowedTools


ToolChoice = (
    Literal["none", "auto", "required"]
    | NamedFunctionChoice
    | NamedCustomChoice
    | AllowedToolsChoice
)
FunctionCallChoice = Literal["none", "auto"] | FunctionName  # deprecated tool_choice


@dataclasses.dataclass(frozen=True)
class ToolPlan:
    """What a request's tools ask of the template, the output and the response."""

    tools: str | None = None  # the tools the template renders: OpenAI's list, JSON text
    parse: bool = False  # parse calls out of the output
    structured: StructuredOutput | None = None  # forces calls: tool_choice required or named
    parallel: bool = True  # false: at most one call per choice
    legacy: bool = False  # answer as `functions` did: message.function_call
    format: str = ""  # the model's tool-call format, for a grammar that allows calls


NO_TOOLS = ToolPlan()


def tool_plan(
    tools: list[Tool] | None,
    tool_choice: ToolChoice | None,
    parallel_tool_calls: bool | None,
    functions: list[FunctionDef] | None = None,
    function_call: FunctionCallChoice | None = None,
    format_name: str = "",
) -> ToolPlan:
    """format_name: the model's tool-call format, which the grammar forcing calls writes."""
    legacy = functions is not None or function_call is not None
    if legacy:
        tools, tool_choice = _from_functions(tools, tool_choice, functions, function_call)
        parallel_tool_calls = False  # function_call is one call
    if not tools:
        if tool_choice is not None and tool_choice != "none":
            raise ApiError(
                "Invalid value for 'tool_choice': 'tool_choice' is only allowed when 'tools' "
                "are specified.",
                param="tool_choice",
            )
        return NO_TOOLS  # parallel_tool_calls without tools asks for nothing
    functions_given = _functions(tools)
    rendered = compact_json(_as_tools(functions_given), "tools")
    base = ToolPlan(
        tools=rendered,
        parallel=parallel_tool_calls is not False,
        legacy=legacy,
        format=format_name,
    )
    choice, allowed = _choice(tool_choice or "auto", functions_given)
    if choice == "none":
        return base
    if choice == "auto":
        return dataclasses.replace(base, parse=True)
    # The tokenizer process compiles this (common/tool_calls/grammar.py, tool_grammar).
    spec = {
        "format": format_name,
        "tools": _as_tools(allowed),
        "choice": choice,
        "parallel": base.parallel,
    }
    structured = StructuredOutput(kind="tool_calls", spec=compact_json(spec, "tools"))
    return dataclasses.replace(base, parse=True, structured=structured)


def _as_tools(functions: list[FunctionDef]) -> list[dict[str, Any]]:
    return [{"type": "function", "function": f} for f in functions]


def _from_functions(
    tools: list[Tool] | None,
    tool_choice: ToolChoice | None,
    functions: list[FunctionDef] | None,
    function_call: FunctionCallChoice | None,
) -> tuple[list[Tool], ToolChoice | None]:
    """The deprecated spelling as tools and tool_choice."""
    if tools or tool_choice is not None:
        raise ApiError(
            "functions and function_call are the deprecated form of tools and tool_choice; "
            "send one form",
            param="functions",
        )
    if functions is None:
        raise ApiError("function_call is only allowed when functions are given", param="functions")
    choice: ToolChoice | None = None
    if isinstance(function_call, FunctionName):
        choice = NamedFunctionChoice(function_call)
    elif function_call is not None:
        choice = function_call
    return [FunctionTool(f) for f in functions], choice


def _functions(tools: list[Tool]) -> list[FunctionDef]:
    """The function definitions, checked as OpenAI checks them; no parameters: an empty
    object, which is what OpenAI documents an omitted `parameters` to mean."""
    out: list[FunctionDef] = []
    seen: set[str] = set()
    for i, tool in enumerate(tools):
        if isinstance(tool, CustomTool):
            raise ApiError(
                f"tools[{i}]: custom tools are not supported; send a function tool",
                param="tools",
            )
        f = tool.function
        if not NAME_RE.match(f.name):
            raise ApiError(
                f"tools[{i}].function.name {f.name!r} must be 1-64 characters of a-z, A-Z, 0-9, "
                "_ and -",
                param="tools",
            )
        if f.name in seen:
            raise ApiError(f"tools[{i}]: the function name {f.name!r} is repeated", param="tools")
        seen.add(f.name)
        if f.parameters is None:
            f = msgspec.structs.replace(f, parameters={"type": "object", "properties": {}})
        out.append(f)
    return out


def _choice(choice: ToolChoice, functions: list[FunctionDef]) -> tuple[str, list[FunctionDef]]:
    """(none | auto | required | a function name, the functions a forced call may use)."""
    names = {f.name: f for f in functions}
    if isinstance(choice, str):
        return choice, functions
    if isinstance(choice, NamedCustomChoice):
        raise ApiError("tool_choice: custom tools are not supported", param="tool_choice")
    if isinstance(choice, NamedFunctionChoice):
        name = choice.function.name
        if name not in names:
            raise ApiError(
                f"tool_choice names {name!r}, which is not in tools", param="tool_choice"
            )
        return name, functions
    allowed = []
    for entry in choice.allowed_tools.tools:
        if entry.function.name not in names:
            raise ApiError(
                f"tool_choice.allowed_tools names {entry.function.name!r}, which is not in tools",
                param="tool_choice",
            )
        allowed.append(names[entry.function.name])
    if choice.allowed_tools.mode == "required":
        return "required", allowed
    if {f.name for f in allowed} != set(names):
        raise ApiError(
            "tool_choice.allowed_tools with mode auto and a subset of the tools is not supported "
            "(stoker cannot keep an unconstrained model from calling the others); use mode "
            "required, or send only the allowed tools",
            param="tool_choice",
        )
    return "auto", functions
