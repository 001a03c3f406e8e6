"""The grammar that forces tool calls (tool_choice "required" or a named function), in
llguidance's Lark dialect (https://github.com/guidance-ai/llguidance/blob/main/docs/syntax.md):
the format's call syntax around each function's arguments, which `%json` holds to the
function's `parameters` schema. The grammar ends after the calls, so the matcher then allows
EOS."""

from __future__ import annotations

import json
from collections.abc import Callable

from stoker.common.tool_calls.format import ToolFormat, lark_literal

# The arguments are written as Hugging Face templates write past ones (`tojson`: ", " and ": ",
# no other whitespace), which keeps the model in distribution and the output compact.
JSON_STYLE = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


def tool_grammar(
    fmt: ToolFormat,
    tools: list[dict],
    choice: str,
    parallel: bool,
    special_token_id: Callable[[str], int | None],
) -> str:
    """choice: "required" (any of the tools; with `parallel`, one or more calls) or a function
    name (exactly one call of it). special_token_id: a marker's token id where it is a special
    token to the grammar backend, else None (it is matched as text). Raises ValueError."""
    functions = {fn["name"]: fn for fn in (_function(t) for t in tools) if fn is not None}
    if choice == "required":
        if not functions:
            raise ValueError('tool_choice "required" needs at least one function tool')
        chosen = list(functions.values())
    elif choice in functions:
        chosen, parallel = [functions[choice]], False
    else:
        raise ValueError(f"tool_choice names {choice!r}, which is not among the tools")

    def token(text: str) -> str:
        tid = special_token_id(text)
        return lark_literal(text) if tid is None else f"<[{tid}]>"

    rules = [f"start: {fmt.lark_calls('call', parallel, token)}"]
    rules.append("call: " + " | ".join(f"call_{i}" for i in range(len(chosen))))
    for i, fn in enumerate(chosen):
        schema = dict(fn.get("parameters") or {})
        schema.setdefault("type", "object")  # arguments are an object, whatever else is said
        schema["x-guidance"] = JSON_STYLE
        rules.append(f"call_{i}: {fmt.lark_call(fn['name'], f'args_{i}', token)}")
        rules.append(f"args_{i}: %json {json.dumps(schema, ensure_ascii=False)}")
    return "\n".join(rules) + "\n"


def _function(tool: dict) -> dict | None:
    """An OpenAI tool's function ({"type": "function", "function": {...}}), else None."""
    if tool.get("type", "function") != "function" or "function" not in tool:
        return None
    return tool["function"]
