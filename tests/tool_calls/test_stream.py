"""The streamed reader agrees with parse() byte for byte, however the output is chunked: the
content deltas join to parse()'s content and each call's deltas to its call. Texts are drawn
from pieces that stress the reader: whole calls, calls cut short, markers and their
prefixes, separators, whitespace, brackets and quotes, and free text."""

import json

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from stoker.common.tool_calls import (
    ContentDelta,
    ToolCall,
    ToolCallDelta,
    call_id,
    detect_format,
)

FORMATS = [
    detect_format(None, "hermes"),
    detect_format(None, "generic"),
    detect_format(None, "llama3_json"),
    detect_format(None, "mistral"),
    detect_format("[TOOL_CALLS][ARGS]", "mistral"),
    detect_format('{{- "[TOOL_CALLS][" }}'),  # Mistral Nemo's list, without the space
]

_json = st.recursive(
    st.none() | st.booleans() | st.integers() | st.text(alphabet='ab"\\{}[]<>_ \n', max_size=6),
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text("xyz", max_size=2), inner, max_size=3)
    ),
    max_leaves=6,
)
_arguments = st.builds(
    lambda obj, indent, compact: json.dumps(
        obj, indent=indent, separators=(",", ":") if compact else None
    ),
    st.dictionaries(st.text("abc", max_size=3), _json, max_size=3),
    st.sampled_from([None, 1]),
    st.booleans(),
)
_name = st.sampled_from(["f", "get_weather", "a.b-c"])


def _pieces(fmt):
    call = st.builds(lambda n, a: fmt.render_calls([(n, a)]), _name, _arguments)
    calls = st.lists(st.tuples(_name, _arguments), min_size=1, max_size=3).map(fmt.render_calls)
    cut = st.tuples(calls, st.floats(0, 1)).map(lambda c: c[0][: int(len(c[0]) * c[1])])
    markers = [m[:k] for m in fmt.markers for k in range(1, len(m) + 1)]
    symbols = st.sampled_from(
        [" ", "\n", ";", "; ", "{", "}", "[", "]", '"', "\\", ",", "<", "[ARGS]", "</tool_call>"]
        + ['{"name": "f", "arguments": {}}', '{"name": "f", "parameters": {"a": 1}}', "f"]
    )
    return st.one_of(call, calls, cut, st.sampled_from(markers), symbols, st.text(max_size=5))


def _texts(fmt):
    return st.lists(_pieces(fmt), max_size=8).map("".join)


def _streamed(fmt, chunks: list[str]) -> tuple[str, list[ToolCall]]:
    parser = fmt.stream_parser("seed")
    deltas = [d for chunk in chunks for d in parser.feed(chunk)] + parser.finish()
    content = "".join(d.text for d in deltas if isinstance(d, ContentDelta))
    by_index: dict[int, list[ToolCallDelta]] = {}
    for d in deltas:
        if isinstance(d, ToolCallDelta):
            by_index.setdefault(d.index, []).append(d)
    assert list(by_index) == list(range(len(by_index)))  # indices in order, none skipped
    calls = [
        ToolCall(parts[0].id or "", parts[0].name or "", "".join(p.arguments for p in parts))
        for parts in by_index.values()
    ]
    return content, calls


def _split(text: str, cuts: list[int]) -> list[str]:
    points = sorted({0, len(text), *(c % (len(text) + 1) for c in cuts)})
    return [text[a:b] for a, b in zip(points, points[1:])]


@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.example[:16])
@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_any_chunking_matches_parse(fmt, data):
    text = data.draw(_texts(fmt), label="text")
    cuts = data.draw(st.lists(st.integers(0, 10_000), max_size=12), label="cuts")
    content, calls = fmt.parse(text, "seed")
    assert _streamed(fmt, _split(text, cuts)) == (content or "", calls)
    assert _streamed(fmt, list(text)) == (content or "", calls)  # one character at a time


@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.example[:16])
def test_calls_survive_any_chunking(fmt):
    # Not just agreement: a rendered call is found whichever way it is chunked.
    text = "Hi " + fmt.render_calls([("f", '{"a": "x}"}'), ("g", "{}")])
    text = text if not fmt.bare_object else text[3:]
    for size in (1, 2, 3, 7):
        content, calls = _streamed(fmt, [text[i : i + size] for i in range(0, len(text), size)])
        assert [(c.name, c.arguments) for c in calls] == [("f", '{"a": "x}"}'), ("g", "{}")]


def test_content_is_released_as_soon_as_it_is_decided():
    parser = detect_format(None, "hermes").stream_parser("s")
    assert parser.feed("Hello wor") == [ContentDelta("Hello wor")]
    assert parser.feed("ld <tool") == [ContentDelta("ld")]  # " <tool" may open a call
    assert parser.feed("box> ") == [ContentDelta(" <toolbox>")]  # it did not
    assert parser.feed('<tool_call>{"name": "f", "arguments": {"a": 1') == []
    (delta,) = parser.feed("}}</tool_call>")
    assert (delta.index, delta.name, delta.arguments) == (0, "f", '{"a": 1}')


def test_a_call_is_one_delta_when_its_block_closes():
    fmt = detect_format(None, "hermes")
    parser = fmt.stream_parser("s")
    assert parser.feed('<tool_call>{"name": "f", "arguments": {"a": 1}}</tool_ca') == []
    (delta,) = parser.feed("ll>")
    assert delta == ToolCallDelta(0, call_id("s", 0), "f", '{"a": 1}')
    assert parser.feed("\n") == [] and parser.finish() == []


def test_finish_releases_an_unclosed_call_as_content():
    parser = detect_format(None, "llama3_json").stream_parser("s")
    assert parser.feed('{"name": "f", "parameters": {"a": ') == []
    assert parser.finish() == [ContentDelta('{"name": "f", "parameters": {"a": ')]
