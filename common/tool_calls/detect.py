"""Which tool-call format a model speaks, read from its chat template (the markers a template
writes past calls with are the ones its model was trained to emit), or named by the server's
override."""

from __future__ import annotations

import re

from stoker.common.tool_calls.format import ToolFormat
from stoker.common.tool_calls.hermes import GenericFormat, HermesFormat
from stoker.common.tool_calls.llama3 import Llama3JsonFormat
from stoker.common.tool_calls.mistral import ARGS, TOOL_CALLS, MistralFormat

FORMAT_NAMES = ("hermes", "llama3_json", "mistral", "generic")
_FORMATS: dict[str, type[ToolFormat]] = {
    "hermes": HermesFormat,
    "llama3_json": Llama3JsonFormat,
    "generic": GenericFormat,
}


def detect_format(chat_template: str | None, override: str | None = None) -> ToolFormat:
    template = chat_template or ""
    if override is not None and override not in FORMAT_NAMES:
        raise ValueError(
            f"unknown tool-call format {override!r}; choose one of: {', '.join(FORMAT_NAMES)}"
        )
    name = override or _detected(template)
    if name == "mistral":
        return MistralFormat(
            args_marker=ARGS in template, list_open="[" if f"{TOOL_CALLS}[" in template else " ["
        )
    return _FORMATS[name]()


def _detected(template: str) -> str:
    if TOOL_CALLS in template or "[AVAILABLE_TOOLS]" in template:
        return "mistral"
    if "<tool_call>" in template:  # Hermes 2 Pro, Qwen2.5, Qwen3
        return "hermes"
    # Llama 3.1's and 3.3's templates write builtin calls after <|python_tag|>; 3.2's has no
    # builtin tools, only the custom calls' '"parameters": ' and the "ipython" results role.
    if template_renders_tools(template) and (
        "<|python_tag|>" in template or ("ipython" in template and '"parameters"' in template)
    ):
        return "llama3_json"
    return "generic"


# Jinja's expression and statement blocks, and the string literals inside them.
_BLOCK = re.compile(r"\{\{.*?\}\}|\{%.*?%\}", re.S)
_STRING = re.compile(r"'(?:[^'\\]|\\.)*'|\"(?:[^\"\\]|\\.)*\"", re.S)


def _code(template: str) -> str:
    """The template's Jinja code without its string literals."""
    return " ".join(_STRING.sub("''", block) for block in _BLOCK.findall(template))


def template_renders_tools(chat_template: str | None) -> bool:
    """Whether the template reads the `tools` variable (then it shows the tools itself)."""
    return re.search(r"(?<![\w.])tools\b", _code(chat_template or "")) is not None


def template_shows_any_role(chat_template: str | None) -> bool:
    """Whether the template prints a message's role as it is (SmolLM2's
    `'<|im_start|>' + message['role']`), so a "tool" message renders like any other; a
    template that names each role it knows would drop or reject it."""
    return _ROLE_OUTPUT.search(chat_template or "") is not None


_ROLE_OUTPUT = re.compile(r"\{\{[^}]*?(\[\s*['\"]role['\"]\s*\]|\.role\b)", re.S)
