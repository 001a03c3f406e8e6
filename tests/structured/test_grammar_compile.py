"""The tokenizer process's grammar compile (services/tokenizer/grammar_compile.py): each kind to
a grammar llguidance accepts, strictness a schema cannot relax, the cache (hits, errors, bounds),
the time limit, and tool calls beside an answer format under tool_choice auto."""

from __future__ import annotations

import asyncio
import json
import time

import llguidance
import pytest

from stoker.common.sampling_params import StructuredOutput
from stoker.services.tokenizer.grammar_compile import GrammarCompiler, GrammarError
from tests.factory import make_tokenizer

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}},
                "required": ["city"],
            },
        },
    }
]


@pytest.fixture(scope="module")
def hf():
    return make_tokenizer()


@pytest.fixture
def compiler(hf):
    return GrammarCompiler(hf, len(hf), hf.eos_token_id)


def _accepts(compiler: GrammarCompiler, hf, grammar: str, text: str) -> bool:
    matcher = llguidance.LLMatcher(compiler.ll_tokenizer(), grammar)
    ids = hf.encode(text, add_special_tokens=False)
    return matcher.try_consume_tokens(ids) == len(ids) and matcher.is_accepting()


@pytest.mark.parametrize(
    ("structured", "good", "bad"),
    [
        (StructuredOutput("json_schema", '{"type": "integer"}'), "42", '"42"'),
        (StructuredOutput("json_object"), '{"a": [1, 2]}', "[1]"),
        (StructuredOutput("regex", "(ab)+c"), "ababc", "abc c"),
        (StructuredOutput("choice", '["yes", "no"]'), "no", "maybe"),
        (StructuredOutput("lark", 'start: "x" "y"*'), "xyy", "yx"),
        (StructuredOutput("gbnf", 'root ::= "a" [0-9]+'), "a12", "a"),
    ],
)
def test_each_kind_compiles_to_what_it_says(compiler, hf, structured, good, bad):
    grammar = compiler.compile_sync(structured).grammar
    assert _accepts(compiler, hf, grammar, good)
    assert not _accepts(compiler, hf, grammar, bad)


@pytest.mark.parametrize(
    ("spec", "named"),
    [
        ('{"type": "array", "uniqueItems": true}', "uniqueItems"),
        ('{"not": {"type": "string"}}', "not"),
        ('{"type": "object", "x-guidance": {"lenient": true}, "dependentRequired": {}}', "depend"),
        ('{"$ref": "https://example.com/s.json"}', "example.com"),
        ("[1, 2]", "object or a boolean"),
        ("{", "not valid JSON"),
    ],
)
def test_unenforceable_or_malformed_schemas_name_the_problem(compiler, spec, named):
    with pytest.raises(GrammarError, match=named):
        compiler.compile_sync(StructuredOutput("json_schema", spec))


def test_the_cache_answers_repeats_and_remembers_errors(compiler):
    ok = StructuredOutput("regex", "[0-9]{3}")
    first = compiler.compile_sync(ok)
    again = compiler.compile_sync(ok)
    assert not first.cache_hit and again.cache_hit and again.grammar == first.grammar
    bad = StructuredOutput("regex", "(")
    for _ in range(2):
        with pytest.raises(GrammarError):
            compiler.compile_sync(bad)
    assert (compiler.hits, compiler.misses) == (2, 2)


def test_the_cache_is_bounded(hf):
    compiler = GrammarCompiler(hf, len(hf), hf.eos_token_id, cache_entries=3)
    for i in range(10):
        compiler.compile_sync(StructuredOutput("regex", f"a{{{i + 1}}}"))
    assert len(compiler._cache) == 3
    small = GrammarCompiler(hf, len(hf), hf.eos_token_id, cache_bytes=1)
    small.compile_sync(StructuredOutput("regex", "a+"))
    assert len(small._cache) == 0


def test_a_compile_past_its_time_limit_is_a_400_and_later_hits_are_fast(hf, monkeypatch):
    compiler = GrammarCompiler(hf, len(hf), hf.eos_token_id, timeout_s=0.05)
    slow = compiler._compile

    def slower(structured):
        time.sleep(0.3)
        return slow(structured)

    monkeypatch.setattr(compiler, "_compile", slower)
    structured = StructuredOutput("regex", "x+")

    async def run():
        with pytest.raises(GrammarError, match="longer than"):
            await compiler.compile(structured)
        await asyncio.sleep(0.4)  # the compile finished in the background, into the cache
        return await compiler.compile(structured)

    assert asyncio.run(run()).cache_hit
    assert compiler.timeouts == 1


def test_tool_calls_beside_an_answer_format(compiler, hf):
    answer = {"kind": "json_schema", "spec": '{"type": "object", "properties": {"x": {}}}'}
    spec = {"format": "generic", "tools": TOOLS, "choice": "auto", "parallel": True}
    grammar = compiler.compile_sync(
        StructuredOutput("tool_calls", json.dumps({**spec, "answer": answer}))
    ).grammar
    call = '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'
    assert _accepts(compiler, hf, grammar, call)
    assert _accepts(compiler, hf, grammar, '{"x": 1}')
    assert not _accepts(compiler, hf, grammar, "plain words")
    forced = compiler.compile_sync(
        StructuredOutput("tool_calls", json.dumps({**spec, "choice": "required"}))
    ).grammar
    assert _accepts(compiler, hf, forced, call)
    assert not _accepts(compiler, hf, forced, '{"x": 1}')


def test_a_burst_of_one_new_constraint_compiles_it_once(compiler):
    """32 requests for one schema at once (a benchmark's or a client's first burst): one
    compile, the others wait for it and report a cache hit; none is refused."""
    structured = StructuredOutput("json_schema", '{"type": "object", "properties": {"b": {}}}')

    async def burst():
        return await asyncio.gather(*(compiler.compile(structured) for _ in range(32)))

    results = asyncio.run(burst())
    assert len({r.grammar for r in results}) == 1
    assert sum(not r.cache_hit for r in results) == 1
    assert compiler.misses == 1


def test_the_grammar_modules_do_not_import_triton():
    """llguidance.torch imports torch.compile and with it triton; the kernel tests set triton
    up (TRITON_INTERPRET=1) before its first import, and the serving processes need neither."""
    import subprocess
    import sys

    code = (
        "import sys, llguidance.hf; import stoker.services.engine, stoker.services.worker.grammar"
        "; import stoker.services.tokenizer.grammar_compile; assert 'triton' not in sys.modules"
    )
    subprocess.run([sys.executable, "-P", "-c", code], check=True, timeout=120)


def test_a_structural_tag_constrains_only_its_segments(compiler, hf):
    """vLLM's structural tag: free text, each segment from a trigger to its end holding JSON
    that matches its schema."""
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    spec = {
        "structures": [{"begin": "<function=f>", "schema": schema, "end": "</function>"}],
        "triggers": ["<function="],
    }
    grammar = compiler.compile_sync(StructuredOutput("structural_tag", json.dumps(spec))).grammar
    assert _accepts(compiler, hf, grammar, "free text, no call")
    assert _accepts(compiler, hf, grammar, 'see <function=f>{"a": 1}</function> done')
    assert not _accepts(compiler, hf, grammar, 'see <function=f>{"a": "x"}</function>')
