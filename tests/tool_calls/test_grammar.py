"""tool_grammar through llguidance (the backend the worker masks with): each format's canonical
calls, tokenized by a real tokenizer, are accepted; arguments against the schema, a function
other than the named one, and a second call without parallel_tool_calls are not."""

import json
from pathlib import Path

import llguidance
import llguidance.hf
import pytest
from transformers import PreTrainedTokenizerFast

from stoker.common.tool_calls import detect_format, tool_grammar
from tests.factory import make_tokenizer

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "unit": {"enum": ["c", "f"]}},
            "required": ["city"],
            "additionalProperties": False,
        },
    },
}
TIME = {"type": "function", "function": {"name": "get_time"}}  # no parameters: any object
TOOLS = [WEATHER, TIME]
PARIS = ("get_weather", '{"city": "Paris", "unit": "c"}')
NOW = ("get_time", "{}")

HERMES = detect_format(None, "hermes")
GENERIC = detect_format(None, "generic")
LLAMA = detect_format(None, "llama3_json")
MISTRAL = detect_format(None, "mistral")
MISTRAL_V11 = detect_format("[TOOL_CALLS][ARGS]", "mistral")
MISTRAL_NEMO = detect_format('{{- "[TOOL_CALLS][" }}')


class Backend:
    """A Hugging Face tokenizer and its llguidance view, as the tokenizer process pairs them."""

    def __init__(self, hf: PreTrainedTokenizerFast) -> None:
        self.hf = hf
        self.ll = llguidance.hf.from_tokenizer(hf, len(hf))

    def special_token_id(self, text: str) -> int | None:
        """The lookup the tokenizer process gives tool_grammar: a marker that is one token
        llguidance treats as special (all added tokens, in 1.9.1) is named by id."""
        ids = self.hf.encode(text, add_special_tokens=False)
        return ids[0] if len(ids) == 1 and self.ll.is_special_token(ids[0]) else None

    def grammar(self, fmt, choice="required", parallel=False, tools=TOOLS) -> str:
        lark = tool_grammar(fmt, tools, choice, parallel, self.special_token_id)
        grammar = llguidance.LLMatcher.grammar_from_lark(lark)
        assert llguidance.LLMatcher.validate_grammar(grammar, self.ll) == ""
        return grammar

    def accepts(self, grammar: str, text: str) -> bool:
        matcher = llguidance.LLMatcher(self.ll, grammar)
        ok = matcher.consume_tokens(self.hf.encode(text, add_special_tokens=False))
        if not (ok and matcher.is_accepting() and not matcher.is_error()):
            return False
        # After the calls the grammar is complete: the matcher takes EOS and stops.
        return matcher.consume_token(self.hf.eos_token_id) and matcher.is_stopped()


@pytest.fixture(scope="module")
def plain() -> Backend:
    return Backend(make_tokenizer())


@pytest.fixture(scope="module")
def marked() -> Backend:
    """Markers as their models' tokenizers have them: Qwen's <tool_call> tags are added
    (not special) tokens, Mistral's [TOOL_CALLS] and [ARGS] special (control) tokens."""
    hf = make_tokenizer()
    hf.add_tokens(["<tool_call>", "</tool_call>"])
    hf.add_special_tokens({"additional_special_tokens": ["[TOOL_CALLS]", "[ARGS]"]})
    return Backend(hf)


CASES = [
    (HERMES, "plain"),
    (HERMES, "marked"),
    (GENERIC, "plain"),
    (LLAMA, "plain"),
    (MISTRAL, "marked"),
    (MISTRAL_V11, "marked"),
    (MISTRAL_NEMO, "marked"),
]


@pytest.fixture(params=CASES, ids=lambda c: f"{c[0].example[:14]}-{c[1]}")
def case(request, plain, marked):
    fmt, which = request.param
    return fmt, plain if which == "plain" else marked


def test_accepts_the_canonical_call(case):
    fmt, backend = case
    grammar = backend.grammar(fmt)
    assert backend.accepts(grammar, fmt.render_calls([PARIS]))
    assert backend.accepts(grammar, fmt.render_calls([NOW]))
    assert backend.accepts(grammar, fmt.render_calls([("get_weather", '{"city": "Oslo"}')]))
    assert fmt.parse(fmt.render_calls([PARIS]), "s")[1][0].arguments == PARIS[1]


@pytest.mark.parametrize(
    "arguments",
    [
        '{"city": 3}',  # wrong type
        '{"unit": "c"}',  # a required property missing
        '{"city": "Paris", "unit": "k"}',  # not in the enum
        '{"city": "Paris", "zip": "1"}',  # additionalProperties false
        '{"city":"Paris"}',  # not the templates' spacing
    ],
)
def test_rejects_arguments_against_the_schema(case, arguments):
    fmt, backend = case
    assert not backend.accepts(backend.grammar(fmt), fmt.render_calls([("get_weather", arguments)]))


def test_a_named_choice_forces_that_function(case):
    fmt, backend = case
    grammar = backend.grammar(fmt, choice="get_weather", parallel=True)
    assert backend.accepts(grammar, fmt.render_calls([PARIS]))
    assert not backend.accepts(grammar, fmt.render_calls([NOW]))
    assert not backend.accepts(grammar, fmt.render_calls([PARIS, PARIS]))  # exactly one call


def test_one_call_unless_parallel(case):
    fmt, backend = case
    two = fmt.render_calls([PARIS, NOW])
    assert not backend.accepts(backend.grammar(fmt, parallel=False), two)
    assert backend.accepts(backend.grammar(fmt, parallel=True), two)
    assert backend.accepts(backend.grammar(fmt, parallel=True), fmt.render_calls([NOW]))


def test_no_text_before_the_call(case):
    fmt, backend = case
    assert not backend.accepts(backend.grammar(fmt), "Sure. " + fmt.render_calls([PARIS]))


def test_special_markers_are_named_by_id(marked):
    tool_calls = marked.hf.convert_tokens_to_ids("[TOOL_CALLS]")
    args = marked.hf.convert_tokens_to_ids("[ARGS]")
    lark = tool_grammar(MISTRAL_V11, TOOLS, "required", False, marked.special_token_id)
    assert f"<[{tool_calls}]>" in lark and f"<[{args}]>" in lark
    assert "[TOOL_CALLS]" not in lark
    # The marker spelled out as text is not the token: rejected.
    text = MISTRAL_V11.render_calls([PARIS])
    ids = marked.hf.encode(text, add_special_tokens=False, split_special_tokens=True)
    matcher = llguidance.LLMatcher(marked.ll, marked.grammar(MISTRAL_V11))
    assert not matcher.consume_tokens(ids)


def test_plain_markers_are_text(plain):
    lark = tool_grammar(HERMES, TOOLS, "required", False, plain.special_token_id)
    assert '"<tool_call>"' in lark and "<[" not in lark


def test_bad_choices():
    with pytest.raises(ValueError, match="not among the tools"):
        tool_grammar(HERMES, TOOLS, "get_stock", False, lambda _: None)
    with pytest.raises(ValueError, match="at least one"):
        tool_grammar(HERMES, [], "required", False, lambda _: None)
    other = [{"type": "code_interpreter"}]
    with pytest.raises(ValueError, match="at least one"):
        tool_grammar(HERMES, other, "required", False, lambda _: None)


SMOLLM2 = Path(__file__).resolve().parents[2] / ".model-cache/SmolLM2-135M-Instruct"


@pytest.mark.skipif(not (SMOLLM2 / "tokenizer.json").exists(), reason="SmolLM2 not cached")
def test_generic_calls_with_smollm2s_tokenizer():
    hf = PreTrainedTokenizerFast(tokenizer_file=str(SMOLLM2 / "tokenizer.json"))
    hf.eos_token = "<|im_end|>"
    backend = Backend(hf)
    grammar = backend.grammar(GENERIC, parallel=True)
    assert backend.accepts(grammar, GENERIC.render_calls([PARIS, NOW]))
    unicode = ("get_weather", json.dumps({"city": "Zürich"}, ensure_ascii=False))
    assert backend.accepts(grammar, GENERIC.render_calls([unicode]))
