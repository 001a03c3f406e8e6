"""prepare_messages through real chat-template rendering (transformers' apply_chat_template):
each family's template shows the tools, the past call in the model's own syntax, and the
result."""

import copy
import json

import pytest

from stoker.common.tool_calls import (
    detect_format,
    prepare_messages,
    template_renders_tools,
    template_shows_any_role,
    tools_system_prompt,
)
from stoker.common.tool_calls.messages import mistral_call_id
from tests.factory import make_tokenizer
from tests.tool_calls.templates import LLAMA31, MISTRAL_V3, MISTRAL_V11, QWEN25, SMOLLM2

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Current weather in a city",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}},
                "required": ["city"],
            },
        },
    }
]
CALL_ID = "call_0123456789abcdef01234567"
MESSAGES = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Weather in Paris?"},
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {
                "id": CALL_ID,
                "type": "function",
                "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
            }
        ],
    },
    {"role": "tool", "tool_call_id": CALL_ID, "content": '{"temp_c": 21}'},
]


@pytest.fixture(scope="module")
def tokenizer():
    return make_tokenizer()


def render(tokenizer, template, messages=MESSAGES, tools=TOOLS, **kwargs):
    fmt = detect_format(template)
    renders = template_renders_tools(template)
    prepared = prepare_messages(
        fmt, messages, tools, renders, tool_role=template_shows_any_role(template), **kwargs
    )
    text = tokenizer.apply_chat_template(
        prepared,
        tools=tools if renders else None,
        chat_template=template,
        tokenize=False,
        add_generation_prompt=True,
    )
    return fmt, prepared, text


def past_call(fmt):
    return fmt.render_calls([("get_weather", '{"city": "Paris"}')])


def test_qwen_writes_the_call_as_hermes_reads_it(tokenizer):
    fmt, prepared, text = render(tokenizer, QWEN25)
    assert prepared[2]["tool_calls"][0]["function"]["arguments"] == {"city": "Paris"}
    assert '"name": "get_weather"' in text.split("<tools>\n")[1]  # the tools are listed
    assert f"<|im_start|>assistant\n{past_call(fmt)}<|im_end|>" in text
    assert '<|im_start|>user\n<tool_response>\n{"temp_c": 21}\n</tool_response>' in text
    assert fmt.parse(past_call(fmt), "s")[1][0].arguments == '{"city": "Paris"}'


def test_llama_writes_the_call_as_llama3_json_reads_it(tokenizer):
    fmt, _, text = render(tokenizer, LLAMA31)
    assert "Environment: ipython" in text
    assert f"<|start_header_id|>assistant<|end_header_id|>\n\n{past_call(fmt)}<|eot_id|>" in text
    assert "<|start_header_id|>ipython<|end_header_id|>" in text


def test_mistral_v3_gets_nine_character_ids(tokenizer):
    fmt, prepared, text = render(tokenizer, MISTRAL_V3)
    short = mistral_call_id(CALL_ID)
    assert len(short) == 9 and short.isalnum()
    assert prepared[2]["tool_calls"][0]["id"] == prepared[3]["tool_call_id"] == short
    assert "[AVAILABLE_TOOLS]" in text
    assert (
        '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris"}, '
        f'"id": "{short}"}}]' in text
    )
    assert f'[TOOL_RESULTS] {{"content": {{"temp_c": 21}}, "call_id": "{short}"}}' in text
    assert mistral_call_id("abcDEF123") == "abcDEF123"  # already valid: kept


def test_mistral_v11_writes_the_call_as_mistral_reads_it(tokenizer):
    fmt, _, text = render(tokenizer, MISTRAL_V11)
    assert past_call(fmt) == '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}'
    assert past_call(fmt) in text
    assert '[TOOL_RESULTS]{"temp_c": 21}[/TOOL_RESULTS]' in text


def test_smollm2_is_taught_tools_in_the_system_message(tokenizer):
    fmt, prepared, text = render(tokenizer, SMOLLM2)
    assert fmt.name == "generic"
    system = prepared[0]["content"]
    assert system.startswith("Be brief.\n\n# Tools\n")
    assert system == "Be brief.\n\n" + tools_system_prompt(fmt, TOOLS)
    listed = json.loads(system.split("<tools>\n")[1].split("\n</tools>")[0])
    assert listed == {k: TOOLS[0]["function"][k] for k in ("name", "description", "parameters")}
    assert text.count("<|im_start|>system\n") == 1
    assert (
        '<|im_start|>assistant\n<tool_call>{"name": "get_weather", "arguments": '
        '{"city": "Paris"}}</tool_call><|im_end|>' in text
    )
    assert '<|im_start|>tool\n{"temp_c": 21}<|im_end|>' in text


def test_a_system_message_is_added_when_there_is_none(tokenizer):
    _, prepared, text = render(tokenizer, SMOLLM2, messages=MESSAGES[1:])
    assert prepared[0]["role"] == "system"
    assert prepared[0]["content"].startswith("# Tools\n")
    assert "You are a helpful AI assistant named SmolLM" not in text


def test_results_become_one_user_turn_for_a_template_without_a_tool_role():
    fmt = detect_format(None, "generic")
    two_results = [
        *MESSAGES[:3],
        {"role": "tool", "tool_call_id": CALL_ID, "content": "21"},
        {"role": "tool", "tool_call_id": "call_2", "content": "22"},
    ]
    prepared = prepare_messages(fmt, two_results, TOOLS, False, tool_role=False)
    assert [m["role"] for m in prepared] == ["system", "user", "assistant", "user"]
    assert prepared[3]["content"] == (
        "<tool_response>\n21\n</tool_response>\n<tool_response>\n22\n</tool_response>"
    )


def test_assistant_text_comes_before_its_calls():
    fmt = detect_format(None, "generic")
    messages = [{**MESSAGES[2], "content": "Let me check."}]
    (prepared,) = prepare_messages(fmt, messages, None, False)
    assert prepared["content"] == f"Let me check.\n{past_call(fmt)}"
    assert "tool_calls" not in prepared
    assert fmt.parse(prepared["content"], "s")[0] == "Let me check."


def test_arguments_that_are_not_a_json_object_stay_text():
    fmt = detect_format(QWEN25)
    calls = [
        {"id": "a", "function": {"name": "f", "arguments": "not json"}},
        {"id": "b", "function": {"name": "f", "arguments": "[1, 2]"}},
        {"id": "c", "function": {"name": "f", "arguments": {"already": "dict"}}},
    ]
    (prepared,) = prepare_messages(fmt, [{"role": "assistant", "tool_calls": calls}], None, True)
    assert [c["function"]["arguments"] for c in prepared["tool_calls"]] == [
        "not json",
        "[1, 2]",
        {"already": "dict"},
    ]


def test_the_input_is_not_modified():
    before = copy.deepcopy(MESSAGES)
    for template in (QWEN25, MISTRAL_V3, SMOLLM2):
        fmt = detect_format(template)
        prepare_messages(fmt, MESSAGES, TOOLS, template_renders_tools(template))
    assert before == MESSAGES


def test_unset_fields_are_dropped():
    # Llama 3.1's template takes `'tool_calls' in message` to mean there are calls.
    fmt = detect_format(LLAMA31)
    (prepared,) = prepare_messages(
        fmt, [{"role": "assistant", "content": "hi", "tool_calls": None, "name": None}], None, True
    )
    assert prepared == {"role": "assistant", "content": "hi"}
