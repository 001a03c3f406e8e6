"""The OpenAI request contract: every field the official client can send is honoured, a
documented no-op, or a 400 saying why; null is accepted wherever the client may send it; vLLM's
removed guided_* fields name their replacement. Request decoding is tested without processes;
the last tests run the official client against the real server (tests/services/conftest.py)."""

from __future__ import annotations

import json
import typing
from typing import Any

import openai
import pydantic
import pytest
import tokenizers
from openai.lib._parsing._completions import type_to_response_format_param
from openai.types import completion_create_params as completion_params
from openai.types.chat import completion_create_params as chat_params

from stoker.common.messages import ChatMessage
from stoker.common.sampling_params import StructuredOutput
from stoker.common.tokenizer_files import chat_template_text
from stoker.common.tool_calls import detect_format
from stoker.services.api import generation, openai_schema
from stoker.services.api.errors import ApiError
from stoker.services.api.openai_schema import ACCEPTED_NO_OPS, ChatRequest, CompletionRequest
from stoker.services.api.structured_request import REMOVED_GUIDED_FIELDS

HERMES = detect_format("<tool_call>")
USER = [{"role": "user", "content": "hi"}]
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "the weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"enum": ["Paris", "Rome"]}},
            "required": ["city"],
            "additionalProperties": False,
        },
    },
}
TIME = {"type": "function", "function": {"name": "get_time"}}


def chat(fmt: Any = HERMES, **body: Any) -> generation.Generation:
    raw = json.dumps({"messages": USER, **body}).encode()
    return generation.chat_generation(openai_schema.decode(raw, ChatRequest), tool_format=fmt)


def completion(**body: Any) -> generation.Generation:
    raw = json.dumps({"prompt": "hi", **body}).encode()
    return generation.completion_generation(openai_schema.decode(raw, CompletionRequest))


def rejected(call: Any, **body: Any) -> ApiError:
    with pytest.raises(ApiError) as info:
        call(**body)
    assert info.value.status == 400
    return info.value


def _client_fields(params: Any) -> set[str]:
    return set(typing.get_type_hints(params.CompletionCreateParamsStreaming))


# -- every field is known ---------------------------------------------------------------------


@pytest.mark.parametrize(
    ("params", "struct"),
    [(chat_params, ChatRequest), (completion_params, CompletionRequest)],
    ids=["chat", "completions"],
)
def test_every_client_field_is_a_request_field(params, struct):
    """No field the installed openai client can send is an 'Unrecognized request argument'."""
    missing = _client_fields(params) - set(struct.__struct_fields__)
    assert not missing


@pytest.mark.parametrize(
    ("params", "struct", "call", "required"),
    [
        (chat_params, ChatRequest, chat, {"messages"}),
        (completion_params, CompletionRequest, completion, {"prompt"}),
    ],
    ids=["chat", "completions"],
)
def test_null_is_accepted_for_every_optional_field(params, struct, call, required):
    nulls = {f: None for f in _client_fields(params) - required - {"model"}}
    nulls.update({f: None for f in struct.__struct_fields__ if f not in required | {"model"}})
    gen = call(**nulls)
    assert gen.n == 1 and not gen.stream
    assert gen.params.skip_special_tokens and gen.params.structured is None
    assert gen.add_generation_prompt or gen.kind == "completion"


def test_unknown_fields_are_still_400_naming_them():
    err = rejected(chat, max_tokns=4)
    assert err.param == "max_tokns" and "max_tokns" in err.message


# -- no-ops -----------------------------------------------------------------------------------

NO_OPS = {
    "user": "u-1",
    "metadata": {"team": "search"},
    "store": True,
    "service_tier": "auto",
    "prompt_cache_key": "k",
    "prompt_cache_options": {"mode": "implicit", "ttl": "30m"},
    "prompt_cache_retention": "24h",
    "safety_identifier": "s",
    "parallel_tool_calls": False,
    "verbosity": "low",
    "reasoning_effort": "high",
    "prediction": {"type": "content", "content": "the predicted text"},
    "modalities": ["text"],
    "stream": True,
    "stream_options": {"include_usage": True, "include_obfuscation": False},
}


def test_no_ops_are_accepted_and_change_nothing():
    plain = chat(stream=True)
    gen = chat(**NO_OPS)
    assert gen.params == plain.params
    assert gen.messages == plain.messages
    assert gen.tools == plain.tools and gen.include_usage


def test_no_ops_are_documented():
    top_level = {k for k in ACCEPTED_NO_OPS if "." not in k and "[" not in k}
    assert top_level <= set(ChatRequest.__struct_fields__) | set(
        CompletionRequest.__struct_fields__
    )
    assert set(NO_OPS) - {"stream", "stream_options"} <= top_level
    assert all(isinstance(why, str) and why for why in ACCEPTED_NO_OPS.values())


# -- asking for what stoker cannot do ---------------------------------------------------------


@pytest.mark.parametrize(
    ("body", "param", "words"),
    [
        ({"audio": {"voice": "alloy", "format": "wav"}}, "audio", "audio"),
        ({"modalities": ["text", "audio"]}, "modalities", "audio"),
        ({"web_search_options": {}}, "web_search_options", "web search"),
        ({"moderation": {"model": "omni-moderation-latest"}}, "moderation", "moderation"),
        ({"tool_choice": "auto"}, "tool_choice", "only allowed when 'tools'"),
        ({"tool_choice": "required"}, "tool_choice", "only allowed when 'tools'"),
        ({"function_call": "auto"}, "functions", "functions"),
        ({"functions": [TIME["function"]], "tools": [TIME]}, "functions", "one form"),
        ({"tools": [{"type": "custom", "custom": {"name": "x"}}]}, "tools", "custom"),
        ({"stream_options": {"include_usage": True}}, "stream_options", "stream"),
    ],
)
def test_unsupported_requests_are_400(body, param, words):
    err = rejected(chat, **body)
    assert err.param == param and words in err.message


@pytest.mark.parametrize(
    "part",
    [
        {"type": "image_url", "image_url": {"url": "https://x/y.png"}},
        {"type": "input_audio", "input_audio": {"data": "AAAA", "format": "wav"}},
        {"type": "file", "file": {"file_id": "f"}},
    ],
)
def test_non_text_content_parts_are_400_naming_the_type(part):
    messages = [{"role": "user", "content": [{"type": "text", "text": "look"}, part]}]
    err = rejected(chat, messages=messages)
    assert err.param == "messages" and part["type"] in err.message
    assert "messages[0].content[1]" in err.message


def test_completion_fields():
    assert completion(best_of=None, suffix=None, echo=None, user="u").n == 1
    assert completion(best_of=2, n=2).n == 2
    assert rejected(completion, best_of=3).param == "best_of"
    assert rejected(completion, suffix="tail").param == "suffix"
    echoed = completion(echo=True, logprobs=1, max_tokens=0)  # tests/services/test_echo_logprobs
    assert echoed.shown.echo and echoed.params.prompt_logprobs == 1
    assert echoed.params.max_tokens == 1 and echoed.shown.drop_output


# -- structured outputs -----------------------------------------------------------------------

SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
COMPACT = '{"type":"object","properties":{"a":{"type":"integer"}},"required":["a"]}'


@pytest.mark.parametrize(
    ("body", "expected"),
    [
        ({"response_format": {"type": "text"}}, None),
        ({"response_format": {"type": "json_object"}}, StructuredOutput("json_object")),
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {
                        "name": "answer",
                        "schema": SCHEMA,
                        "strict": True,
                        "description": "d",
                    },
                }
            },
            StructuredOutput("json_schema", COMPACT),
        ),
        ({"structured_outputs": {"json": SCHEMA}}, StructuredOutput("json_schema", COMPACT)),
        (
            {"structured_outputs": {"json": json.dumps(SCHEMA)}},
            StructuredOutput("json_schema", COMPACT),
        ),
        ({"structured_outputs": {"regex": "[0-9]+"}}, StructuredOutput("regex", "[0-9]+")),
        (
            {"structured_outputs": {"choice": ["yes", "no"]}},
            StructuredOutput("choice", '["yes","no"]'),
        ),
        (
            {"structured_outputs": {"grammar": 'root ::= "a" | "b"'}},
            StructuredOutput("gbnf", 'root ::= "a" | "b"'),
        ),
        (
            {"structured_outputs": {"grammar": 'start: "a" | "b"'}},
            StructuredOutput("lark", 'start: "a" | "b"'),
        ),
        ({"structured_outputs": {"json_object": True}}, StructuredOutput("json_object")),
        ({"structured_outputs": {"json_object": False}}, None),
        (
            {"structured_outputs": {"regex": "x", "disable_fallback": True}},
            StructuredOutput("regex", "x"),
        ),
    ],
)
def test_structured_outputs_are_honoured(body, expected):
    assert chat(**body).params.structured == expected
    assert completion(**body).params.structured == expected  # vLLM takes them on both


def test_json_whitespace_options_become_llguidance_options():
    options = {"disable_any_whitespace": True, "whitespace_pattern": "[ ]?"}
    got = chat(structured_outputs={"json": SCHEMA, **options}).params.structured
    expected = {"whitespace_flexible": False, "whitespace_pattern": "[ ]?"}
    assert json.loads(got.spec) == {**SCHEMA, "x-guidance": expected}
    got = chat(structured_outputs={"json_object": True, "disable_any_whitespace": True})
    assert json.loads(got.params.structured.spec) == {
        "type": "object",
        "x-guidance": {"whitespace_flexible": False},
    }
    regex = chat(structured_outputs={"regex": "a+", "disable_any_whitespace": True})
    assert regex.params.structured == StructuredOutput("regex", "a+")  # JSON only, as vLLM


def test_disable_additional_properties_closes_every_object_schema():
    schema = {
        "type": "object",
        "properties": {
            "properties": {"type": "object", "properties": {"x": {"type": "string"}}},
            "open": {"type": "object", "additionalProperties": True},
            "list": {"type": "array", "items": {"type": "object"}},
        },
    }
    body = {"structured_outputs": {"json": schema, "disable_additional_properties": True}}
    got = json.loads(chat(**body).params.structured.spec)
    assert got["additionalProperties"] is False
    props = got["properties"]
    assert set(props) == {"properties", "open", "list"}  # no property named additionalProperties
    assert props["properties"]["additionalProperties"] is False
    assert props["open"]["additionalProperties"] is True
    assert props["list"]["items"]["additionalProperties"] is False


@pytest.mark.parametrize(
    ("body", "param", "words"),
    [
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "bad name!"}}},
            "response_format",
            "name",
        ),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"schema": SCHEMA}}},
            "response_format",
            "name",
        ),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "a"}}},
            None,
            "schema",
        ),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": 5}}},
            "response_format",
            "object",
        ),
        ({"response_format": {"type": "yaml"}}, "response_format", "yaml"),
        ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs", "regex"),
        ({"structured_outputs": {"json": "[1, 2]"}}, "structured_outputs", "object"),
        ({"structured_outputs": {"json": "{nope"}}, "structured_outputs", "JSON"),
        ({"structured_outputs": {"choice": []}}, "structured_outputs", "empty"),
        ({"structured_outputs": {"structural_tag": "{}"}}, "structured_outputs", "structural_tag"),
        (
            {
                "response_format": {"type": "json_object"},
                "structured_outputs": {"regex": "a"},
            },
            "structured_outputs",
            "response_format and structured_outputs",
        ),
        ({"structured_outputs": {"jsn": {}}}, "structured_outputs", "jsn"),
    ],
)
def test_structured_output_shapes_are_checked(body, param, words):
    err = rejected(chat, **body)
    assert words in err.message
    assert param is None or err.param == param


@pytest.mark.parametrize("field", sorted(REMOVED_GUIDED_FIELDS))
def test_guided_fields_name_their_replacement(field):
    err = rejected(chat, **{field: ["x"]})
    assert err.param == field and REMOVED_GUIDED_FIELDS[field] in err.message
    assert rejected(completion, **{field: "x"}).param == field
    assert chat(**{field: None}).params.structured is None  # null asks for nothing


def test_parse_helper_request_passes():
    """client.chat.completions.parse(response_format=Model) sends the model's strict schema."""

    class Answer(pydantic.BaseModel):
        city: str
        days: int

    response_format = type_to_response_format_param(Answer)
    structured = chat(response_format=response_format).params.structured
    assert structured.kind == "json_schema"
    assert json.loads(structured.spec) == response_format["json_schema"]["schema"]


# -- tools ------------------------------------------------------------------------------------


def _spec(gen: generation.Generation) -> dict:
    assert gen.params.structured is not None and gen.params.structured.kind == "tool_calls"
    return json.loads(gen.params.structured.spec)


def test_tools_auto_parses_without_a_grammar():
    gen = chat(tools=[WEATHER, TIME])
    assert gen.tools.parse and gen.params.structured is None and gen.tool_format == "hermes"
    rendered = json.loads(gen.tools.tools)
    assert rendered[0] == WEATHER
    # No parameters: an empty object, as OpenAI documents an omitted `parameters`.
    assert rendered[1]["function"]["parameters"] == {"type": "object", "properties": {}}
    sub = gen.sub_requests("chatcmpl-x", 0.0)[0]
    assert sub.tools == gen.tools.tools and sub.tool_format == "hermes"


def test_tool_choice_none_renders_tools_but_does_not_parse():
    gen = chat(tools=[WEATHER], tool_choice="none")
    assert gen.tools.tools is not None and not gen.tools.parse
    assert gen.params.structured is None and gen.tool_format == "hermes"


def test_tool_choice_required_and_named_force_calls():
    spec = _spec(chat(tools=[WEATHER, TIME], tool_choice="required", parallel_tool_calls=False))
    assert spec["format"] == "hermes" and spec["choice"] == "required"
    assert spec["parallel"] is False
    assert [t["function"]["name"] for t in spec["tools"]] == ["get_weather", "get_time"]
    named = {"type": "function", "function": {"name": "get_time"}}
    spec = _spec(chat(tools=[WEATHER, TIME], tool_choice=named))
    assert spec["choice"] == "get_time" and spec["parallel"] is True


def test_allowed_tools():
    allowed = {
        "type": "allowed_tools",
        "allowed_tools": {
            "mode": "required",
            "tools": [{"type": "function", "function": {"name": "get_time"}}],
        },
    }
    spec = _spec(chat(tools=[WEATHER, TIME], tool_choice=allowed))
    assert [t["function"]["name"] for t in spec["tools"]] == ["get_time"]
    allowed["allowed_tools"]["mode"] = "auto"
    assert rejected(chat, tools=[WEATHER, TIME], tool_choice=allowed).param == "tool_choice"
    assert chat(tools=[TIME], tool_choice=allowed).tools.parse  # all of them: plain auto


@pytest.mark.parametrize(
    ("tools", "choice", "param", "words"),
    [
        ([{"type": "function", "function": {"name": "bad name"}}], None, "tools", "bad name"),
        ([{"type": "function", "function": {"name": "x" * 65}}], None, "tools", "1-64"),
        ([TIME, TIME], None, "tools", "repeated"),
        (
            [{"type": "function", "function": {"name": "f", "parameters": []}}],
            None,
            "tools",
            "object",
        ),
        ([{"type": "function", "function": {"nam": "f"}}], None, "tools", "nam"),
        ([TIME], {"type": "function", "function": {"name": "nope"}}, "tool_choice", "nope"),
        ([TIME], "sometimes", "tool_choice", "sometimes"),
        ([TIME], {"type": "custom", "custom": {"name": "x"}}, "tool_choice", "custom"),
    ],
)
def test_tools_are_validated(tools, choice, param, words):
    body: dict[str, Any] = {"tools": tools}
    if choice is not None:
        body["tool_choice"] = choice
    err = rejected(chat, **body)
    assert err.param == param and words in err.message


def test_a_structural_tag_becomes_its_constraint():
    tag = {
        "structures": [
            {"begin": "<function=f>", "schema": {"type": "object"}, "end": "</function>"}
        ],
        "triggers": ["<function="],
    }
    structured = chat(structured_outputs={"structural_tag": tag}).params.structured
    assert structured.kind == "structural_tag" and json.loads(structured.spec) == tag
    bad = {**tag, "triggers": ["<tool="]}
    err = rejected(chat, structured_outputs={"structural_tag": bad})
    assert "none of the triggers" in err.message


def test_tools_and_an_output_format():
    """auto: one grammar allows calls or the answer (as the Agents SDK asks with an output
    type); required or named: the forced call is this turn's output (the format is for a later
    turn, as OpenAI accepts); a Lark grammar beside tools under auto: not supported."""
    rf = {"type": "json_object"}
    both = chat(tools=[TIME], response_format=rf).params.structured
    spec = json.loads(both.spec)
    assert both.kind == "tool_calls" and spec["choice"] == "auto"
    assert spec["answer"] == {"kind": "json_object", "spec": ""}
    lark = {"grammar": 'start: "x"'}
    assert "tool_choice" in rejected(chat, tools=[TIME], structured_outputs=lark).message
    forced = chat(tools=[TIME], tool_choice="required", response_format=rf).params.structured
    assert forced.kind == "tool_calls" and json.loads(forced.spec)["choice"] == "required"
    assert "answer" not in json.loads(forced.spec)
    assert chat(tools=[TIME], tool_choice="none", response_format=rf).params.structured.kind == (
        "json_object"
    )


def test_tool_choice_none_without_tools_is_accepted():
    assert not chat(tool_choice="none").tools.parse
    assert chat(tools=[], parallel_tool_calls=True).tools.tools is None


def test_functions_map_onto_tools():
    gen = chat(functions=[WEATHER["function"]], function_call={"name": "get_weather"})
    assert gen.tools.legacy and not gen.tools.parallel
    assert _spec(gen)["choice"] == "get_weather" and _spec(gen)["parallel"] is False
    auto = chat(functions=[WEATHER["function"]])
    assert auto.tools.parse and auto.params.structured is None
    assert not chat(functions=[WEATHER["function"]], function_call="none").tools.parse


def test_special_token_formats_keep_special_tokens_when_parsing():
    mistral = detect_format(None, "mistral")
    assert mistral.keeps_special_tokens
    assert not chat(mistral, tools=[TIME]).params.skip_special_tokens
    assert chat(mistral, tools=[TIME], tool_choice="none").params.skip_special_tokens
    assert chat(mistral).params.skip_special_tokens


def test_no_format_means_no_parsing():
    assert rejected(chat, fmt=None, tools=[TIME]).param == "tools"
    assert chat(None, tools=[TIME], tool_choice="none").tool_format == ""


# -- messages ---------------------------------------------------------------------------------


def test_message_roles_and_tool_turns():
    call = {
        "id": "call_1",
        "type": "function",
        "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
    }
    messages = [
        {"role": "developer", "content": [{"type": "text", "text": "Be brief."}]},
        {"role": "user", "content": "Weather?", "name": "ann"},
        {"role": "assistant", "content": None, "tool_calls": [call], "refusal": None},
        {"role": "tool", "tool_call_id": "call_1", "content": [{"type": "text", "text": "sunny"}]},
    ]
    gen = chat(messages=messages, tools=[WEATHER])
    assert gen.messages == [
        ChatMessage("system", "Be brief."),
        ChatMessage("user", "Weather?", name="ann"),
        ChatMessage("assistant", "", tool_calls=json.dumps([call], separators=(",", ":"))),
        ChatMessage("tool", "sunny", tool_call_id="call_1"),
    ]
    assert chat(messages=messages).tool_format == "hermes"  # past calls: tools are in play


def test_an_assistant_message_as_the_client_returned_it_is_accepted():
    """Clients append `choice.message.model_dump()`: every key of a response message."""
    message = openai.types.chat.ChatCompletionMessage(role="assistant", content="Hello.")
    dumped = message.model_dump()
    dumped["reasoning_content"] = None  # what a vLLM server adds
    gen = chat(messages=[*USER, dumped, {"role": "user", "content": "more"}])
    assert gen.messages[1] == ChatMessage("assistant", "Hello.")


def test_deprecated_function_turns_map_onto_tool_turns():
    messages = [
        *USER,
        {"role": "assistant", "function_call": {"name": "get_time", "arguments": "{}"}},
        {"role": "function", "name": "get_time", "content": "noon"},
    ]
    gen = chat(messages=messages, functions=[TIME["function"]])
    assistant, result = gen.messages[1], gen.messages[2]
    calls = json.loads(assistant.tool_calls)
    assert calls[0]["function"] == {"name": "get_time", "arguments": "{}"}
    assert result == ChatMessage("tool", "noon", name="get_time", tool_call_id=calls[0]["id"])


@pytest.mark.parametrize(
    ("messages", "words"),
    [
        ([{"role": "tool", "content": "x"}], "tool_call_id"),
        (
            [
                {
                    "role": "assistant",
                    "tool_calls": [{"id": "c", "type": "custom", "custom": {"name": "x"}}],
                }
            ],
            "function calls",
        ),
        ([{"role": "user", "content": "x", "tool_calls": [{"id": "c"}]}], "assistant"),
        ([{"role": "assistant", "content": "x", "audio": {"id": "a"}}], "audio"),
        ([{"role": "assistant", "tool_calls": [{"id": "c", "function": {"name": 1}}]}], "str"),
    ],
)
def test_message_shapes_are_checked(messages, words):
    err = rejected(chat, messages=messages)
    assert err.param == "messages" and words in err.message


def test_template_kwargs_and_continue_final_message():
    gen = chat(chat_template_kwargs={"enable_thinking": False})
    assert gen.sub_requests("x", 0.0)[0].chat_template_kwargs == '{"enable_thinking":false}'
    err = rejected(chat, chat_template_kwargs={"add_generation_prompt": False})
    assert err.param == "chat_template_kwargs" and "add_generation_prompt" in err.message
    assert rejected(chat, chat_template_kwargs=[1]).param == "chat_template_kwargs"
    prefix = [*USER, {"role": "assistant", "content": "The answer is"}]
    gen = chat(messages=prefix, continue_final_message=True, add_generation_prompt=False)
    sub = gen.sub_requests("x", 0.0)[0]
    assert sub.continue_final_message and not sub.add_generation_prompt
    err = rejected(chat, messages=prefix, continue_final_message=True)
    assert "add_generation_prompt" in err.message
    err = rejected(chat, continue_final_message=True, add_generation_prompt=False)
    assert err.param == "continue_final_message" and "assistant" in err.message


# -- the chat template the api detects the format from ----------------------------------------


def test_chat_template_text(tmp_path):
    assert chat_template_text(tmp_path) is None
    config = tmp_path / "tokenizer_config.json"
    config.write_text(json.dumps({"chat_template": "plain"}))
    assert chat_template_text(tmp_path) == "plain"
    named = [{"name": "default", "template": "d"}, {"name": "tool_use", "template": "t"}]
    config.write_text(json.dumps({"chat_template": named}))
    assert chat_template_text(tmp_path) == "t"
    config.write_text(json.dumps({"chat_template": named[:1]}))
    assert chat_template_text(tmp_path) == "d"
    (tmp_path / "chat_template.jinja").write_text("jinja")
    assert chat_template_text(tmp_path) == "jinja"


# -- against the real server, with the official client ----------------------------------------


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0)


def test_server_accepts_the_no_ops(server, client):
    out = client.chat.completions.create(
        model=server.model_name,
        messages=USER,
        max_completion_tokens=4,
        temperature=0,
        metadata={"team": "search"},
        store=False,
        user="u-1",
        service_tier="auto",
        safety_identifier="s",
        prompt_cache_key="k",
        reasoning_effort="low",
        verbosity="low",
        modalities=["text"],
        n=None,
        stop=None,
        seed=None,
    )
    assert out.choices[0].message.role == "assistant"
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(
            model=server.model_name,
            messages=USER,
            max_completion_tokens=4,
            extra_body={"guided_choice": ["a", "b"]},
        )
    assert "structured_outputs.choice" in str(info.value)


def test_server_constrains_to_a_choice(server, client):
    out = client.chat.completions.create(
        model=server.model_name,
        messages=USER,
        max_completion_tokens=8,
        temperature=1.0,
        seed=3,
        n=3,
        extra_body={"structured_outputs": {"choice": ["yes", "no"]}},
    )
    assert all(c.message.content in ("yes", "no") for c in out.choices)


def _no_whitespace(model_path) -> dict[str, int]:
    """logit_bias banning whitespace-only tokens: a JSON schema allows whitespace between
    tokens (vLLM's default too), and a random-init model would fill max_tokens with it."""
    tok = tokenizers.Tokenizer.from_file(str(model_path / "tokenizer.json"))
    ids = [i for i in range(tok.get_vocab_size()) if (t := tok.decode([i])) and not t.strip()]
    return {str(i): -100 for i in ids}


def test_server_parse_helper_gets_its_model_back(server, client):
    class Color(pydantic.BaseModel):
        color: typing.Literal["red", "green"]

    out = client.chat.completions.parse(
        model=server.model_name,
        messages=USER,
        max_completion_tokens=64,
        temperature=0,
        response_format=Color,
        logit_bias=_no_whitespace(server.model_path),
    )
    assert out.choices[0].message.parsed in (Color(color="red"), Color(color="green"))


FORCED_CALL = {"type": "function", "function": {"name": "get_weather"}}
# Short: the generic format's system prompt and the tools take ~420 of the server's 512 tokens.
SHORT_WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {"type": "object", "properties": {"city": {"enum": ["Paris", "Rome"]}}},
    },
}


def test_server_forced_tool_call_renders_as_tool_calls(server, client):
    """The tiny model's template has no tool syntax (the generic format: Hermes' <tool_call>
    blocks, taught by a system prompt): a forced call is written under the grammar and parsed
    back into message.tool_calls; streamed, the client's accumulator gets the same call."""
    kw: dict[str, Any] = dict(
        model=server.model_name,
        messages=[{"role": "user", "content": "Weather?"}],
        max_completion_tokens=80,
        temperature=0,
        tools=[SHORT_WEATHER],
        tool_choice=FORCED_CALL,
    )
    out = client.chat.completions.create(**kw)
    choice = out.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    assert choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.id.startswith("call_")
    assert call.function.name == "get_weather"
    assert set(json.loads(call.function.arguments)) <= {"city"}

    with client.chat.completions.stream(**kw) as stream:
        streamed = stream.get_final_completion().choices[0]
    assert streamed.finish_reason == "tool_calls"
    assert streamed.message.content is None
    assert [(c.function.name, c.function.arguments) for c in streamed.message.tool_calls] == [
        (call.function.name, call.function.arguments)
    ]
