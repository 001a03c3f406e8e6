"""The OpenAI contract as clients nobody here wrote use it (issue 50): the official `openai`
client, LangChain's ChatOpenAI, LiteLLM and the OpenAI Agents SDK, over real HTTP, against one
real server (conftest.py) whose tiny random-init model has Qwen2.5's template (hermes calls).

The model writes garbage, so a test that needs a particular output forces it (tool_choice
required or named, a JSON schema, structured_outputs); `auto` is checked for acceptance and
shape only. Every body a client sent goes through a capturing proxy; at the end each one is
POSTed again and must get a 2xx, and so must the committed payloads.json (pinned bodies, should
a client version change what it sends; regenerate with capture_payloads.py). The replay and idle
tests come last and rely on file order. A server bug found here is an xfail(strict) test named
in KNOWN_BUGS."""

from __future__ import annotations

import asyncio
import json
import typing
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import litellm
import openai
import pydantic
import pytest
from agents import (
    Agent,
    AgentsException,
    ModelSettings,
    OpenAIChatCompletionsModel,
    Runner,
    function_tool,
    set_tracing_disabled,
)
from langchain_core.messages import AIMessage, AIMessageChunk
from langchain_core.tools import tool
from langchain_openai import ChatOpenAI
from transformers import AutoTokenizer

from tests.clients.conftest import MODEL_NAME, CapturingProxy, StokerServer

PAYLOADS = Path(__file__).with_name("payloads.json")
USER = [{"role": "user", "content": "What is the weather in Paris?"}]


class WeatherArgs(pydantic.BaseModel):
    """The weather in a city."""

    model_config = pydantic.ConfigDict(extra="forbid")
    city: typing.Literal["Paris", "Rome"]


class Color(pydantic.BaseModel):
    """An answer short enough for a random model to finish under its schema."""

    color: typing.Literal["red", "green"]
    sunny: bool


WEATHER_SCHEMA = WeatherArgs.model_json_schema()
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "the weather in a city",
        "parameters": WEATHER_SCHEMA,
    },
}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}}
SCHEMAS = {"get_weather": WEATHER_SCHEMA, "get_time": TIME["function"]["parameters"]}
NAMED = {"type": "function", "function": {"name": "get_weather"}}


@pytest.fixture(scope="module")
def tokenizer(stoker_server: StokerServer) -> Any:
    return AutoTokenizer.from_pretrained(stoker_server.model_path)


@pytest.fixture(scope="module")
def no_whitespace(tokenizer: Any) -> dict[str, int]:
    """logit_bias banning whitespace-only tokens: JSON schemas allow whitespace between tokens,
    and a random model would fill max_tokens with it."""
    ids = [i for i in range(len(tokenizer)) if (t := tokenizer.decode([i])) and not t.strip()]
    return {str(i): -100 for i in ids}


@pytest.fixture(scope="module")
def close_early(tokenizer: Any) -> dict[str, int]:
    """logit_bias for `}` and <|im_end|> (the eos): under a grammar each is allowed only where an
    object or the output may end, so an open schema's object closes at the first chance and
    `required` with parallel calls stops after the first call instead of writing calls (or
    properties) until max_tokens."""
    ids = [tokenizer.convert_tokens_to_ids("<|im_end|>"), *tokenizer.encode("}")]
    return {str(i): 100 for i in ids}


@pytest.fixture(scope="module")
def client(proxy: CapturingProxy) -> openai.OpenAI:
    return openai.OpenAI(base_url=proxy.base_url, api_key="x", max_retries=0)


def check_call(name: str, arguments: str) -> None:
    jsonschema.validate(json.loads(arguments), SCHEMAS[name])


def streamed_message(chunks: Iterator[Any]) -> tuple[str | None, list[tuple[str, str, str]], str]:
    """content, [(id, name, arguments)] and finish_reason accumulated from raw chunks, checking
    that a call's id and name come once, on its first delta."""
    content: list[str] = []
    calls: dict[int, list[str]] = {}
    finish = ""
    for chunk in chunks:
        if not chunk.choices:
            continue
        choice = chunk.choices[0]
        delta = choice.delta
        if delta.content:
            content.append(delta.content)
        for tc in delta.tool_calls or []:
            if tc.index not in calls:
                assert tc.id and tc.function and tc.function.name and tc.type == "function"
                calls[tc.index] = [tc.id, tc.function.name, ""]
            else:
                assert tc.id is None and (tc.function is None or tc.function.name is None)
            if tc.function and tc.function.arguments:
                calls[tc.index][2] += tc.function.arguments
        finish = choice.finish_reason or finish
    assert sorted(calls) == list(range(len(calls)))
    return ("".join(content) if content else None), [tuple(calls[i]) for i in sorted(calls)], finish


def whole_and_streamed(client: openai.OpenAI, **kw: Any) -> tuple[Any, tuple]:
    """The same greedy request, whole and streamed; the streamed message must be the same bytes
    (content, names, arguments) as the whole one. Ids differ: each request has its own."""
    whole = client.chat.completions.create(**kw).choices[0]
    content, calls, finish = streamed_message(client.chat.completions.create(**kw, stream=True))
    got = [(c.function.name, c.function.arguments) for c in whole.message.tool_calls or []]
    assert (content, [(n, a) for _, n, a in calls]) == (whole.message.content, got)
    assert finish == whole.finish_reason
    ids = [c[0] for c in calls]
    assert all(i.startswith("call_") for i in ids) and len(set(ids)) == len(ids)
    return whole, (content, calls, finish)


# -- openai -----------------------------------------------------------------------------------


def test_openai_parse_returns_the_model(proxy, client, no_whitespace):
    proxy.label("openai/parse")
    out = client.chat.completions.parse(
        model=MODEL_NAME,
        messages=USER,
        max_completion_tokens=64,
        temperature=0,
        response_format=Color,
        logit_bias=no_whitespace,
    )
    assert out.choices[0].finish_reason == "stop"
    assert isinstance(out.choices[0].message.parsed, Color)


def test_openai_json_object(proxy, client, no_whitespace):
    proxy.label("openai/json_object")
    out = client.chat.completions.create(
        model=MODEL_NAME,
        messages=USER,
        max_completion_tokens=64,
        temperature=0,
        response_format={"type": "json_object"},
        logit_bias=no_whitespace,
    )
    choice = out.choices[0]
    assert choice.finish_reason in ("stop", "length")
    if choice.finish_reason == "stop":
        assert isinstance(json.loads(choice.message.content), dict)


@pytest.mark.parametrize(
    ("label", "choice", "extra"),
    [
        ("openai/tools_required", "required", {}),
        ("openai/tools_required_single", "required", {"parallel_tool_calls": False}),
        ("openai/tools_named", NAMED, {}),
    ],
)
def test_openai_forced_calls_whole_and_streamed(proxy, client, close_early, label, choice, extra):
    proxy.label(label)
    if choice == "required" and not extra:
        extra = {"logit_bias": close_early}
    whole, _ = whole_and_streamed(
        client,
        model=MODEL_NAME,
        messages=USER,
        max_completion_tokens=120,
        temperature=0,
        tools=[WEATHER, TIME],
        tool_choice=choice,
        **extra,
    )
    assert whole.finish_reason == "tool_calls", whole
    assert whole.message.content is None and whole.message.tool_calls
    for call in whole.message.tool_calls:
        assert call.type == "function" and call.id.startswith("call_")
        check_call(call.function.name, call.function.arguments)
    if choice is NAMED or "parallel_tool_calls" in extra:
        assert len(whole.message.tool_calls) == 1
    if choice is NAMED:
        assert whole.message.tool_calls[0].function.name == "get_weather"


def test_openai_auto_is_accepted_and_well_formed(proxy, client):
    proxy.label("openai/tools_auto")
    whole, _ = whole_and_streamed(
        client,
        model=MODEL_NAME,
        messages=USER,
        max_completion_tokens=40,
        temperature=0,
        tools=[WEATHER, TIME],
    )
    assert whole.finish_reason in ("stop", "length", "tool_calls")
    assert whole.message.content is not None or whole.message.tool_calls
    for call in whole.message.tool_calls or []:
        json.loads(call.function.arguments)  # a call is only parsed out when it is an object


CONVERSATION = [
    *USER,
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {
                "id": "call_1",
                "type": "function",
                "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
            }
        ],
    },
    {"role": "tool", "tool_call_id": "call_1", "content": '{"sky": "sunny", "celsius": 21}'},
]


@pytest.mark.parametrize("choice", ["auto", NAMED], ids=["auto", "named"])
def test_openai_conversation_with_a_tool_result(proxy, client, choice):
    proxy.label(f"openai/tool_result_{'auto' if choice == 'auto' else 'named'}")
    whole, _ = whole_and_streamed(
        client,
        model=MODEL_NAME,
        messages=CONVERSATION,
        max_completion_tokens=60,
        temperature=0,
        tools=[WEATHER, TIME],
        tool_choice=choice,
    )
    if choice is NAMED:
        assert whole.finish_reason == "tool_calls"
        (call,) = whole.message.tool_calls
        check_call(call.function.name, call.function.arguments)
    else:
        assert whole.message.content is not None or whole.message.tool_calls


def test_openai_loop_sends_back_the_returned_message(proxy, client):
    """An agent loop written on the client: the response's message object itself goes back into
    the conversation (the client serialises every field it has), then the tool's result."""
    proxy.label("openai/loop")
    kw: dict[str, Any] = dict(
        model=MODEL_NAME, max_completion_tokens=60, temperature=0, tools=[WEATHER, TIME]
    )
    first = client.chat.completions.create(messages=USER, tool_choice=NAMED, **kw)
    message = first.choices[0].message
    (call,) = message.tool_calls
    result = {"role": "tool", "tool_call_id": call.id, "content": "sunny"}
    second = client.chat.completions.create(messages=[*USER, message, result], **kw)
    assert second.choices[0].message.content is not None or second.choices[0].message.tool_calls


def test_openai_stream_closed_early(proxy, client):
    """A client that stops reading a stream (closes it) mid-answer: the idle check at the end
    sees every KV block free again."""
    proxy.label("openai/stream_closed_early")
    stream = client.chat.completions.create(
        model=MODEL_NAME,
        messages=USER,
        max_completion_tokens=400,
        temperature=0,
        stream=True,
    )
    for i, _ in enumerate(stream):
        if i == 2:
            break
    stream.close()


def test_openai_models_list(proxy, client):
    proxy.label("openai/models")
    assert [m.id for m in client.models.list()] == [MODEL_NAME]


def test_openai_stream_helper_strict_tool_and_usage(proxy, client):
    """The client's own accumulator (chat.completions.stream), a strict tool made from a
    pydantic model (parsed back into it), and include_usage."""
    proxy.label("openai/stream_helper")
    kw: dict[str, Any] = dict(
        model=MODEL_NAME,
        messages=USER,
        max_completion_tokens=80,
        temperature=0,
        tools=[openai.pydantic_function_tool(WeatherArgs, name="get_weather")],
        tool_choice=NAMED,
        stream_options={"include_usage": True},
    )
    with client.chat.completions.stream(**kw) as stream:
        final = stream.get_final_completion()
    (call,) = final.choices[0].message.tool_calls
    assert final.choices[0].finish_reason == "tool_calls"
    assert isinstance(call.function.parsed_arguments, WeatherArgs)
    check_call(call.function.name, call.function.arguments)
    assert final.usage is not None and final.usage.completion_tokens > 0


# -- LangChain --------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def lc(proxy: CapturingProxy) -> Callable[..., ChatOpenAI]:
    def make(**kw: Any) -> ChatOpenAI:
        kw = {"max_tokens": 16, "temperature": 0, **kw}
        return ChatOpenAI(base_url=proxy.base_url, api_key="x", model=MODEL_NAME, **kw)

    return make


@tool
def get_weather(city: typing.Literal["Paris", "Rome"]) -> str:
    """The weather in a city."""
    return "sunny"


@tool
def get_time() -> str:
    """The time now."""
    return "noon"


def test_langchain_invoke_stream_batch(proxy, lc):
    chat_model = lc()
    proxy.label("langchain/invoke")
    msg = chat_model.invoke("What is the weather in Paris?")
    assert isinstance(msg, AIMessage) and isinstance(msg.content, str)
    assert msg.response_metadata["finish_reason"] in ("stop", "length")
    proxy.label("langchain/stream")
    chunks = list(chat_model.stream("What is the weather in Paris?"))
    assert chunks and all(isinstance(c, AIMessageChunk) for c in chunks)
    assert "".join(c.content for c in chunks) == msg.content  # greedy: the same text
    proxy.label("langchain/batch")
    out = chat_model.batch(["Hi", "What is the weather in Paris?"])
    assert [m.content for m in out][1] == msg.content


def test_langchain_stream_usage(proxy, lc):
    """Usage comes once, after the text (LangChain may add an empty closing chunk)."""
    proxy.label("langchain/stream_usage")
    chunks = list(lc(stream_usage=True).stream("Hi"))
    at = [i for i, c in enumerate(chunks) if c.usage_metadata]
    assert len(at) == 1 and not any(c.content for c in chunks[at[0] + 1 :])
    usage = chunks[at[0]].usage_metadata
    assert usage["output_tokens"] == 16 and usage["input_tokens"] > 0


def test_langchain_structured_output_json_schema(proxy, lc, no_whitespace):
    proxy.label("langchain/structured_json_schema")
    model = lc(logit_bias=no_whitespace, max_tokens=64)
    out = model.with_structured_output(Color).invoke("Describe Paris.")
    assert isinstance(out, Color)


def test_langchain_structured_output_function_calling(proxy, lc, close_early):
    """LangChain's tool schema is open (no additionalProperties false): `}` is pushed."""
    proxy.label("langchain/structured_function_calling")
    model = lc(max_tokens=64, logit_bias=close_early)
    structured = model.with_structured_output(Color, method="function_calling")
    assert isinstance(structured.invoke("Describe Paris."), Color)


def test_langchain_structured_output_json_mode(proxy, lc, no_whitespace, close_early):
    """json_mode asks for any JSON object: the reply is JSON; whether it fits the model is up to
    the (random) model, so the parse may fail on the client."""
    proxy.label("langchain/structured_json_mode")
    model = lc(logit_bias={**no_whitespace, **close_early}, max_tokens=64)
    structured = model.with_structured_output(Color, method="json_mode", include_raw=True)
    out = structured.invoke("Describe Paris as JSON.")
    raw = out["raw"]
    assert isinstance(raw, AIMessage)
    if raw.response_metadata["finish_reason"] == "stop":
        assert isinstance(json.loads(raw.content), dict)


@pytest.mark.parametrize("choice", ["get_weather", "any", "required"])
def test_langchain_bind_tools(proxy, lc, close_early, choice):
    proxy.label(f"langchain/bind_tools_{choice}")
    model = lc(max_tokens=120, logit_bias=close_early)
    bound = model.bind_tools([get_weather, get_time], tool_choice=choice)
    msg = bound.invoke("What is the weather in Paris?")
    assert msg.tool_calls, msg
    for call in msg.tool_calls:
        assert call["id"].startswith("call_")
        check_call(call["name"], json.dumps(call["args"]))
    if choice == "get_weather":
        assert [c["name"] for c in msg.tool_calls] == ["get_weather"]


# -- LiteLLM ----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def litellm_kw(proxy: CapturingProxy) -> dict[str, Any]:
    return dict(model=f"openai/{MODEL_NAME}", api_base=proxy.base_url, api_key="x", temperature=0)


def test_litellm_plain_and_streamed(proxy, litellm_kw):
    proxy.label("litellm/completion")
    out = litellm.completion(messages=USER, max_tokens=16, **litellm_kw)
    assert out.choices[0].finish_reason in ("stop", "length")
    proxy.label("litellm/stream")
    chunks = list(litellm.completion(messages=USER, max_tokens=16, stream=True, **litellm_kw))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == out.choices[0].message.content


def test_litellm_response_format(proxy, litellm_kw, no_whitespace):
    proxy.label("litellm/response_format")
    out = litellm.completion(
        messages=USER, max_tokens=64, response_format=Color, logit_bias=no_whitespace, **litellm_kw
    )
    assert out.choices[0].finish_reason == "stop"
    Color.model_validate_json(out.choices[0].message.content)


def test_litellm_tools_whole_and_streamed(proxy, litellm_kw):
    proxy.label("litellm/tools")
    kw = dict(messages=USER, max_tokens=120, tools=[WEATHER, TIME], tool_choice=NAMED, **litellm_kw)
    choice = litellm.completion(**kw).choices[0]
    assert choice.finish_reason == "tool_calls"
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_weather"
    check_call(call.function.name, call.function.arguments)
    proxy.label("litellm/tools_stream")
    content, calls, finish = streamed_message(litellm.completion(**kw, stream=True))
    assert finish == "tool_calls" and not content
    assert [(n, a) for _, n, a in calls] == [(call.function.name, call.function.arguments)]


# -- OpenAI Agents SDK ------------------------------------------------------------------------


@function_tool
def weather(city: typing.Literal["Paris", "Rome"]) -> str:
    """The weather in a city."""
    return "sunny"


def _agent_model(proxy: CapturingProxy) -> OpenAIChatCompletionsModel:
    client = openai.AsyncOpenAI(base_url=proxy.base_url, api_key="x", max_retries=0)
    return OpenAIChatCompletionsModel(model=MODEL_NAME, openai_client=client)


def _run_agent(proxy: CapturingProxy, label: str, agent: Agent, streamed: bool = False) -> Any:
    """Run the agent (max 3 turns); every request it made must have been accepted. A loop that
    does not converge on a random model, or a reply the SDK cannot use, is the model's doing."""
    set_tracing_disabled(True)
    proxy.label(label)
    start = len(proxy.exchanges)

    async def run_streamed() -> Any:
        result = Runner.run_streamed(agent, "What is the weather in Paris?", max_turns=3)
        async for _ in result.stream_events():
            pass
        return result.final_output

    output = None
    try:
        if streamed:
            output = asyncio.run(run_streamed())
        else:
            output = Runner.run_sync(agent, "What is the weather in Paris?", max_turns=3)
            output = output.final_output
    except AgentsException:
        pass
    sent = proxy.exchanges[start:]
    assert sent and all(e.status == 200 for e in sent), [(e.status, e.body) for e in sent]
    return output


@pytest.mark.parametrize("streamed", [False, True], ids=["run_sync", "run_streamed"])
def test_agents_sdk_output_type(proxy, no_whitespace, streamed):
    """An output type beside a tool under tool_choice auto: one grammar allows the call or the
    answer; greedy, this model answers, and the SDK parses its Color."""
    agent = Agent(
        name="forecaster",
        instructions="Answer with the weather.",
        tools=[weather],
        output_type=Color,
        model=_agent_model(proxy),
        model_settings=ModelSettings(
            temperature=0, max_tokens=64, extra_body={"logit_bias": no_whitespace}
        ),
    )
    label = "agents/output_type" + ("_streamed" if streamed else "")
    assert isinstance(_run_agent(proxy, label, agent, streamed), Color)


def test_agents_sdk_tool_loop(proxy, close_early):
    """tool_choice required: the first turn calls the tool, the SDK runs it and sends the
    server's call (its id) and the result back with tool_choice reset to auto."""
    agent = Agent(
        name="forecaster",
        instructions="Answer with the weather.",
        tools=[weather],
        model=_agent_model(proxy),
        model_settings=ModelSettings(
            temperature=0,
            max_tokens=80,
            tool_choice="required",
            extra_body={"logit_bias": close_early},
        ),
    )
    _run_agent(proxy, "agents/tool_loop", agent)
    first, second = (json.loads(e.body) for e in proxy.exchanges if e.label == "agents/tool_loop")
    assert first["tool_choice"] == "required" and "tool_choice" not in second
    call, result = second["messages"][-2:]
    assert result == {
        "role": "tool",
        "tool_call_id": call["tool_calls"][0]["id"],
        "content": "sunny",
    }


# Server bugs found by these tests: label -> what is wrong (each test is xfail(strict)).
KNOWN_BUGS: dict[str, str] = {}


def test_agents_sdk_required_tool_with_output_type(proxy):
    agent = Agent(
        name="forecaster",
        instructions="Answer with the weather.",
        tools=[weather],
        output_type=Color,
        model=_agent_model(proxy),
        model_settings=ModelSettings(temperature=0, max_tokens=80, tool_choice="required"),
    )
    try:
        _run_agent(proxy, "agents/required_with_output_type", agent)
    except openai.BadRequestError as e:
        pytest.fail(f"refused: {e}")


# -- replay and idle --------------------------------------------------------------------------


def _replay(server: StokerServer, path: str, body: bytes) -> int:
    with httpx.stream(
        "POST",
        server.url + path,
        content=body,
        headers={"content-type": "application/json"},
        timeout=60,
    ) as resp:
        resp.read()
        return resp.status_code


def test_replay_of_every_captured_body(stoker_server, proxy):
    """Every body a client sent above, exactly as sent, is accepted again."""
    posts = [e for e in proxy.exchanges if e.method == "POST" and e.label not in KNOWN_BUGS]
    if not posts:
        pytest.skip("no client test ran before this one")
    refused = [(e.label, e.status, e.body) for e in posts if not 200 <= e.status < 300]
    assert not refused
    again = [(e.label, _replay(stoker_server, e.path, e.body)) for e in posts]
    assert all(200 <= status < 300 for _, status in again), again


def test_replay_of_pinned_payloads(stoker_server):
    pinned = json.loads(PAYLOADS.read_text())
    assert pinned
    statuses = {
        f"{label}[{i}]": _replay(stoker_server, "/v1/chat/completions", json.dumps(b).encode())
        for label, bodies in pinned.items()
        for i, b in enumerate(bodies)
    }
    assert all(200 <= s < 300 for s in statuses.values()), statuses


def test_idle_server_frees_every_block_and_logged_no_failure(stoker_server, proxy):
    state = stoker_server.wait_idle()
    assert state["num_free_blocks"] == state["num_total_blocks"], state
    assert not [e for e in proxy.exchanges if e.status >= 500]
    assert not stoker_server.error_lines()
