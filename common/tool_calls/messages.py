"""The messages a chat template sees when a request has tools or a tool-calling history.

A template that renders tools (Qwen2.5's, Llama 3.1's, Mistral's) gets the OpenAI messages
with each past call's `arguments` as a dict, as Hugging Face templates expect (they write it
with `tojson`), and, for Mistral, call ids of the 9 alphanumerics its templates insist on.

A template that does not (SmolLM2's, whose format is "generic") is taught tool calling in a
system message, merged after an existing first system message's text:

    # Tools

    You can call these tools. Each is given as a JSON object: its name, what it does, and the
    JSON schema its arguments must match.
    <tools>
    {"name": "get_weather", "description": "Current weather in a city", "parameters": {...}}
    </tools>

    To call a tool, answer with this, the tool's name and its arguments (a JSON object) in
    place of the <...> placeholders:
    <tool_call>{"name": <tool-name>, "arguments": <arguments-json-object>}</tool_call>
    For several calls, write them one after another.

(SYSTEM_PROMPT; one tool per line; the two sentences before <tools> and before the call are
one line each; the call line is the format's `example`, here the generic one). Past
calls are written into the assistant's content in the same syntax (a format's
render_calls), after its text. Tool results keep role "tool" where the template prints any role
as it is (`tool_role=True`, SmolLM2's does: `<|im_start|>tool\\n...`), which tells the model
what the text is without inventing a wrapper; otherwise they become a user message, each
result in <tool_response></tool_response> tags and consecutive results merged, since such
templates tend to accept only user and assistant turns.
"""

from __future__ import annotations

import hashlib
import json
import string
from typing import Any

from stoker.common.tool_calls.format import ToolFormat

SYSTEM_PROMPT = (
    "# Tools\n\n"
    "You can call these tools. Each is given as a JSON object: its name, what it does, and the "
    "JSON schema its arguments must match.\n"
    "<tools>\n{tools}\n</tools>\n\n"
    "To call a tool, answer with this, the tool's name and its arguments (a JSON object) in "
    "place of the <...> placeholders:\n{example}\n"
    "For several calls, write them one after another."
)


def tools_system_prompt(fmt: ToolFormat, tools: list[dict]) -> str:
    listed = "\n".join(json.dumps(_function(tool), ensure_ascii=False) for tool in tools)
    return SYSTEM_PROMPT.format(tools=listed, example=fmt.example)


def prepare_messages(
    fmt: ToolFormat,
    messages: list[dict],
    tools: list[dict] | None,
    renders_tools: bool,
    *,
    tool_role: bool = True,
) -> list[dict]:
    """The messages for the chat template (the input is not modified). tool_role: the
    template prints any role as it is (detect.template_shows_any_role)."""
    if renders_tools:
        prepared = [_with_dict_arguments(m) for m in messages]
        return _mistral_ids(prepared) if fmt.name == "mistral" else prepared
    prepared = _history_as_text(fmt, messages, tool_role)
    if tools:
        prompt = tools_system_prompt(fmt, tools)
        if prepared and prepared[0].get("role") == "system":
            text = _text(prepared[0].get("content"))
            prepared[0]["content"] = f"{text}\n\n{prompt}" if text else prompt
        else:
            prepared.insert(0, {"role": "system", "content": prompt})
    return prepared


def _history_as_text(fmt: ToolFormat, messages: list[dict], tool_role: bool) -> list[dict]:
    """Past calls written into the assistant's content; results as tool or user turns."""
    out: list[dict] = []
    results: dict = {}  # the user turn consecutive tool results are merged into
    for m in messages:
        calls = _calls(m)
        if m.get("role") == "assistant" and calls:
            text = _text(m.get("content"))
            rendered = fmt.render_calls(
                [(c["function"]["name"], _arguments_text(c)) for c in calls]
            )
            m = {k: v for k, v in _clean(m).items() if k != "tool_calls"}
            out.append({**m, "content": f"{text}\n{rendered}" if text else rendered})
        elif m.get("role") == "tool" and not tool_role:
            result = f"<tool_response>\n{_text(m.get('content'))}\n</tool_response>"
            if out and out[-1] is results:
                results["content"] += "\n" + result
            else:
                results = {"role": "user", "content": result}
                out.append(results)
        else:
            out.append(_clean(m))
    return out


def _function(tool: dict) -> dict:
    """An OpenAI tool's function, as the prompt lists it."""
    fn = tool.get("function", tool)
    listed = {"name": fn.get("name"), "description": fn.get("description")}
    listed["parameters"] = fn.get("parameters", {"type": "object", "properties": {}})
    return {k: v for k, v in listed.items() if v is not None}


def _calls(m: dict) -> list[dict]:
    calls = m.get("tool_calls") or []
    return json.loads(calls) if isinstance(calls, str) else list(calls)


def _text(content: Any) -> str:
    """A message's text: OpenAI allows a string, null, or a list of parts."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    return "".join(p.get("text", "") for p in content if isinstance(p, dict))


def _arguments_text(call: dict) -> str:
    arguments = call["function"].get("arguments", "{}")
    return arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)


def _clean(m: dict) -> dict:
    """A copy without unset optional fields: templates test `'tool_calls' in message`, and
    Llama 3.1's then takes the calls' length."""
    return {k: v for k, v in m.items() if k == "content" or v not in (None, [], "")}


def _with_dict_arguments(m: dict) -> dict:
    """A copy whose calls' `arguments` are dicts where they are JSON objects as text."""
    calls = _calls(m)
    if not calls:
        return _clean(m)
    fixed = []
    for call in calls:
        fn = dict(call.get("function", {}))
        if isinstance(fn.get("arguments"), str):
            try:
                parsed = json.loads(fn["arguments"])
            except ValueError:
                parsed = None
            if isinstance(parsed, dict):
                fn["arguments"] = parsed
        fixed.append({**call, "function": fn})
    return {**_clean(m), "tool_calls": fixed}


_ALNUM = string.ascii_letters + string.digits


def mistral_call_id(call_id: str) -> str:
    """Mistral's templates reject ids that are not 9 alphanumerics: others map to 9 derived
    from a hash, the same for a call and the result that answers it."""
    if len(call_id) == 9 and call_id.isalnum() and call_id.isascii():
        return call_id
    n = int.from_bytes(hashlib.sha256(call_id.encode()).digest()[:8], "big")
    return "".join(_ALNUM[(n // 62**i) % 62] for i in range(9))


def _mistral_ids(messages: list[dict]) -> list[dict]:
    for m in messages:
        if m.get("tool_calls"):
            m["tool_calls"] = [
                {**c, "id": mistral_call_id(c["id"])} if "id" in c else c for c in m["tool_calls"]
            ]
        if m.get("tool_call_id"):
            m["tool_call_id"] = mistral_call_id(m["tool_call_id"])
    return messages
