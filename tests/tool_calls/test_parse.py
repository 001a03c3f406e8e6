"""Each format's reader on whole outputs: calls, the content around them, and would-be calls
(cut short, malformed, the wrong shape) staying content."""

import pytest

from stoker.common.tool_calls import ToolCall, call_id, detect_format

HERMES = detect_format(None, "hermes")
GENERIC = detect_format(None, "generic")
LLAMA = detect_format(None, "llama3_json")
MISTRAL = detect_format(None, "mistral")
MISTRAL_V11 = detect_format("[TOOL_CALLS][ARGS]", "mistral")
MISTRAL_NEMO = detect_format('{{- "[TOOL_CALLS][" }}')


def calls(*pairs: tuple[str, str], seed: str = "s") -> list[ToolCall]:
    return [ToolCall(call_id(seed, i), name, args) for i, (name, args) in enumerate(pairs)]


def test_ids_are_deterministic_and_openai_shaped():
    assert call_id("req-1", 0) == call_id("req-1", 0) != call_id("req-1", 1)
    assert call_id("req-1", 0).startswith("call_") and len(call_id("req-1", 0)) == 29


@pytest.mark.parametrize("fmt", [HERMES, GENERIC, LLAMA, MISTRAL, MISTRAL_V11])
def test_plain_text_is_content(fmt):
    assert fmt.parse("The answer is 4.", "s") == ("The answer is 4.", [])
    assert fmt.parse("", "s") == (None, [])


@pytest.mark.parametrize(
    ("text", "content", "expected"),
    [
        (
            '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>',
            None,
            [("get_weather", '{"city": "Paris"}')],
        ),
        (  # text before the first call is content; whitespace next to calls is not
            'Let me check.\n\n<tool_call>\n{"name": "f", "arguments": {}}\n</tool_call>\n'
            '<tool_call>\n{"name": "g", "arguments": {"x": [1, {"y": null}]}}\n</tool_call>\n',
            "Let me check.",
            [("f", "{}"), ("g", '{"x": [1, {"y": null}]}')],
        ),
        (  # the exact bytes: spacing, escapes, number spelling
            '<tool_call>{"name":"f","arguments":{ "a" :1.50e0, "s":"\\u00e9\\"}" }}</tool_call>',
            None,
            [("f", '{ "a" :1.50e0, "s":"\\u00e9\\"}" }')],
        ),
        (  # markers and braces inside strings are just text
            '<tool_call>{"name": "f", "arguments": {"q": "}</tool_call><tool_call>{"}}</tool_call>',
            None,
            [("f", '{"q": "}</tool_call><tool_call>{"}')],
        ),
        (  # Llama's key, which some fine-tunes write
            '<tool_call>{"name": "f", "parameters": {"a": 1}}</tool_call>',
            None,
            [("f", '{"a": 1}')],
        ),
        (  # a repeated key: json.loads keeps the last, and so do we
            '<tool_call>{"name": "f", "arguments": {"a": 1}, "arguments": {"b": 2}}</tool_call>',
            None,
            [("f", '{"b": 2}')],
        ),
        (  # text after the calls is content too
            '<tool_call>{"name": "f", "arguments": {}}</tool_call>\nDone.',
            "Done.",
            [("f", "{}")],
        ),
        (  # a broken block is content, and reading goes on after its marker
            'a < b <tool_call>oops\n<tool_call>{"name": "f", "arguments": {}}</tool_call>',
            "a < b <tool_call>oops",
            [("f", "{}")],
        ),
    ],
)
def test_hermes_calls(text, content, expected):
    assert HERMES.parse(text, "s") == (content, calls(*expected))
    assert GENERIC.parse(text, "s") == (content, calls(*expected))


@pytest.mark.parametrize(
    "text",
    [
        '<tool_call>\n{"name": "f", "arguments": {"a": 1',  # cut by max_tokens
        '<tool_call>\n{"name": "f", "arguments": {"a": 1}}\n</tool_ca',  # close tag cut
        '<tool_call>\n{"name": "f", "arguments": {"a": 1}}\n',  # no close tag
        '<tool_call>{"name": "f", "arguments": {"a": 1}}</tool_call >',  # wrong close tag
        "<tool_call>not json</tool_call>",
        '<tool_call>{"name": "f", "arguments": "{\\"a\\": 1}"}</tool_call>',  # string arguments
        '<tool_call>{"arguments": {}}</tool_call>',  # no name
        '<tool_call>{"name": "", "arguments": {}}</tool_call>',
        '<tool_call>{"name": "f"}</tool_call>',  # no arguments
        '<tool_call>{"name": "f", "arguments": {"a": NaN}}</tool_call>',  # not JSON
        '<tool_call>{"name": "f", "arguments": {"a": 1]}</tool_call>',  # mismatched brackets
        '<tool_call>[{"name": "f", "arguments": {}}]</tool_call>',  # a list
    ],
)
def test_hermes_would_be_calls_are_content(text):
    assert HERMES.parse(text, "s") == (text, [])


@pytest.mark.parametrize(
    ("text", "content", "expected"),
    [
        ('{"name": "f", "parameters": {"a": 1}}', None, [("f", '{"a": 1}')]),
        ('<|python_tag|>{"name": "f", "parameters": {"a": 1}}', None, [("f", '{"a": 1}')]),
        ('\n {"name": "f", "arguments": {}}\n', None, [("f", "{}")]),
        (
            '{"name": "f", "parameters": {}}; {"name": "g", "parameters": {"b": true}}',
            None,
            [("f", "{}"), ("g", '{"b": true}')],
        ),
        (
            '{"name": "f", "parameters": {}}\n{"name": "g", "parameters": {}}',
            None,
            [("f", "{}"), ("g", "{}")],
        ),
        ('{"name": "f", "parameters": {}}; and text', "and text", [("f", "{}")]),
        # A brace later in the text is not a call: Llama answers calls alone.
        ('Sure: {"name": "f", "parameters": {}}', 'Sure: {"name": "f", "parameters": {}}', []),
        ('{"answer": 42}', '{"answer": 42}', []),
        ('{"name": "f", "parameters": {}', '{"name": "f", "parameters": {}', []),
        (  # Llama 3.1's builtin tools are not JSON calls
            '<|python_tag|>brave_search.call(query="x")',
            '<|python_tag|>brave_search.call(query="x")',
            [],
        ),
    ],
)
def test_llama3_json_calls(text, content, expected):
    assert LLAMA.parse(text, "s") == (content, calls(*expected))


@pytest.mark.parametrize(
    ("fmt", "text", "content", "expected"),
    [
        (
            MISTRAL,
            '[TOOL_CALLS] [{"name": "f", "arguments": {"a": 1}}, {"name": "g", "arguments": {}}]',
            None,
            [("f", '{"a": 1}'), ("g", "{}")],
        ),
        (MISTRAL, '[TOOL_CALLS]{"name": "f", "arguments": {}}', None, [("f", "{}")]),
        (
            MISTRAL,
            'Sure.[TOOL_CALLS][{"name": "f", "arguments": {}, "id": "abcDEF123"}]',
            "Sure.",
            [("f", "{}")],
        ),
        (
            MISTRAL,
            '[TOOL_CALLS]f[ARGS]{"a": 1}[TOOL_CALLS]g[ARGS] {}',
            None,
            [("f", '{"a": 1}'), ("g", "{}")],
        ),
        (
            MISTRAL_V11,
            '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}',
            None,
            [("get_weather", '{"city": "Paris"}')],
        ),
    ],
)
def test_mistral_calls(fmt, text, content, expected):
    assert fmt.parse(text, "s") == (content, calls(*expected))


@pytest.mark.parametrize(
    "text",
    [
        '[TOOL_CALLS] [{"name": "f", "arguments": {}}, {"name": "g"}]',  # one bad item: all content
        "[TOOL_CALLS] []",
        '[TOOL_CALLS] [{"name": "f", "arguments": {}}',
        '[TOOL_CALLS] [{"name": "f", "arguments": {}} {"name": "g", "arguments": {}}]',
        "[TOOL_CALLS]f[ARGS][1]",
        '[TOOL_CALLS]f {"a": 1}',
        '[TOOL_CALLS]f[ARGS]{"a": ',
        "[TOOL_CALLS]",
    ],
)
def test_mistral_would_be_calls_are_content(text):
    assert MISTRAL.parse(text, "s") == (text, [])


@pytest.mark.parametrize("fmt", [HERMES, GENERIC, LLAMA, MISTRAL, MISTRAL_V11, MISTRAL_NEMO])
def test_rendered_calls_read_back(fmt):
    pairs = [("get_weather", '{"city": "Paris"}'), ("f", '{"a": [1, 2], "b": "}]"}')]
    assert fmt.parse(fmt.render_calls(pairs), "s") == (None, calls(*pairs))
    assert fmt.parse(fmt.render_calls(pairs[:1]), "s") == (None, calls(pairs[0]))
