"""Which format each family's template gets, and what the template reads."""

import pytest

from stoker.common.tool_calls import (
    FORMAT_NAMES,
    detect_format,
    template_renders_tools,
    template_shows_any_role,
)
from tests.factory import CHAT_TEMPLATE
from tests.tool_calls.templates import LLAMA31, MISTRAL_V3, MISTRAL_V11, QWEN25, SMOLLM2


@pytest.mark.parametrize(
    ("template", "name", "renders"),
    [
        (QWEN25, "hermes", True),
        (LLAMA31, "llama3_json", True),
        # Llama 3.2 / 3.3 templates dropped the builtin tools and their <|python_tag|>.
        (LLAMA31.replace("<|python_tag|>", ""), "llama3_json", True),
        (MISTRAL_V3, "mistral", True),
        (MISTRAL_V11, "mistral", True),
        (SMOLLM2, "generic", False),
        (CHAT_TEMPLATE, "generic", False),
        (None, "generic", False),
    ],
)
def test_detects_each_family(template, name, renders):
    assert detect_format(template).name == name
    assert template_renders_tools(template) is renders


def test_mistral_generation_follows_the_template():
    assert detect_format(MISTRAL_V11).args_marker
    assert not detect_format(MISTRAL_V3).args_marker
    assert detect_format(MISTRAL_V3).list_open == " ["
    assert detect_format('{{- "[TOOL_CALLS][" }}').list_open == "["  # Nemo's
    assert detect_format(MISTRAL_V3).keeps_special_tokens
    assert not detect_format(QWEN25).keeps_special_tokens


def test_a_template_that_only_says_ipython_is_not_llama_json():
    # Llama 3.0 style: no tools variable, so no JSON calls either.
    template = "{% for m in messages %}{{ m['role'] }} ipython \"parameters\"{% endfor %}"
    assert detect_format(template).name == "generic"


def test_tools_in_a_string_literal_is_not_reading_tools():
    template = "{{ 'You have no tools' }}{% for m in messages %}{{ m.content }}{% endfor %}"
    assert not template_renders_tools(template)
    assert template_renders_tools("{% if tools %}x{% endif %}")
    assert not template_renders_tools("{% if builtin_tools %}x{% endif %}")


@pytest.mark.parametrize("name", FORMAT_NAMES)
def test_override_wins(name):
    assert detect_format(SMOLLM2, override=name).name == name
    assert detect_format(None, override=name).name == name


def test_unknown_override_lists_the_names():
    with pytest.raises(ValueError, match="hermes, llama3_json, mistral, generic"):
        detect_format(QWEN25, override="pythonic")


def test_shows_any_role():
    assert template_shows_any_role(SMOLLM2)
    assert template_shows_any_role(CHAT_TEMPLATE)
    assert not template_shows_any_role(MISTRAL_V3)
    assert not template_shows_any_role(None)
