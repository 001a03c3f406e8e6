"""Structured-output constraints -> llguidance grammars, compiled in the tokenizer processes
(docs/structured-outputs.md, "Where the work runs").

A request's constraint (json_schema, json_object, regex, choice, lark, gbnf, or a tool choice)
becomes llguidance's grammar text here, and is checked by building a matcher and its first mask
with the tokenizer the worker uses: llguidance builds lazily, so that first mask is the bulk of a
compile. The worker receives only the grammar text and builds its own matcher from it.

Bounds:
- work: llguidance's parser limits (lexer fuel, items per row, grammar size) stop a pathological
  grammar inside the backend, deterministically;
- time: the compile runs in a worker thread (llguidance releases the GIL) under a wall-clock
  limit; past it the request ends with a 400 and the thread finishes in the background, with
  a bounded number of compiles running at once;
- cache: results (grammars and errors) are kept per constraint in an LRU bounded by entries and
  bytes, so a repeated schema costs a dict lookup.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import json
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import llguidance
import llguidance.hf

from stoker.common.sampling_params import StructuredOutput
from stoker.common.tool_calls import detect_format, tool_grammar

# Strict JSON: llguidance names the keywords it can't enforce ("Unimplemented keys") as errors,
# which become 400s naming them, never a silently relaxed schema. The strictness is an override,
# so a schema's own "x-guidance" options cannot turn it off; whitespace is a default it may
# change. Whitespace between JSON tokens is bounded: unbounded, a small model can emit spaces
# until max_tokens (benchmarks/grammar_backends.py measured the corpus with these options).
JSON_OVERRIDES = {"lenient": False, "coerce_one_of": False}
JSON_DEFAULTS = {"whitespace_pattern": r"[\x20\x0A\x0D\x09]{0,16}"}
LIMITS = llguidance.LLParserLimits(
    max_items_in_row=2000,
    initial_lexer_fuel=1_000_000,
    step_lexer_fuel=200_000,
    step_max_items=50_000,
    max_lexer_states=250_000,
    max_grammar_size=500_000,
)
MAX_SPEC_BYTES = 1 << 20  # a constraint's text; larger ones are refused before any work


class GrammarError(ValueError):
    """The constraint is invalid, unsupported, too large or too slow: the client's 4xx."""

    def __init__(self, message: str, status: int = 400) -> None:
        super().__init__(message)
        self.status = status


@dataclasses.dataclass(frozen=True)
class Compiled:
    grammar: str  # llguidance's grammar text, what the worker builds its matcher from
    compile_s: float  # the compile's own time (0 when the cache answered)
    cache_hit: bool


def grammar_text(
    structured: StructuredOutput, special_token_id: Callable[[str], int | None]
) -> str:
    """The constraint as llguidance grammar text (no tokenizer involved)."""
    kind, spec = structured.kind, structured.spec
    matcher = llguidance.LLMatcher
    if kind == "json_schema":
        try:
            schema = json.loads(spec)
        except json.JSONDecodeError as e:
            raise GrammarError(f"the JSON schema is not valid JSON: {e}") from None
        if not isinstance(schema, (dict, bool)):
            raise GrammarError("a JSON schema must be an object or a boolean")
        return matcher.grammar_from_json_schema(schema, JSON_DEFAULTS, JSON_OVERRIDES)
    if kind == "json_object":
        return matcher.grammar_from_json_schema({"type": "object"}, JSON_DEFAULTS, JSON_OVERRIDES)
    if kind == "regex":
        return matcher.grammar_from_regex(spec)
    if kind == "choice":
        choices = json.loads(spec)
        if not choices or not all(isinstance(c, str) and c for c in choices):
            raise GrammarError("choice must be a non-empty list of non-empty strings")
        return matcher.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in choices))
    if kind == "lark":
        return matcher.grammar_from_lark(spec)
    if kind == "gbnf":
        try:
            return matcher.grammar_from_lark(llguidance.gbnf_to_lark.any_to_lark(spec))
        except Exception as e:
            raise GrammarError(f"the GBNF grammar could not be read: {e}") from None
    if kind == "tool_calls":
        request = json.loads(spec)
        fmt = detect_format(None, request["format"])
        answer = request.get("answer")
        choice = "required" if answer is not None else request["choice"]
        lark = tool_grammar(fmt, request["tools"], choice, request["parallel"], special_token_id)
        if answer is not None:  # tool_choice auto beside an output format: calls or the answer
            lark = _calls_or_answer(lark, StructuredOutput(answer["kind"], answer.get("spec", "")))
        return matcher.grammar_from_lark(lark)
    if kind == "structural_tag":
        return _structural_tag(json.loads(spec))
    raise GrammarError(f"unknown structured output kind {kind!r}")


def _structural_tag(spec: dict) -> str:
    """vLLM's structural tag as llguidance's StructTag: free text, each segment from a trigger
    to its end holding JSON that matches its schema (strict, as any JSON schema here)."""
    tags = []
    for s in spec["structures"]:
        trigger = next(t for t in spec["triggers"] if s["begin"].startswith(t))
        schema = _inline_schema(s.get("schema") or {"type": "object"})
        tags.append(
            llguidance.StructTag(trigger=trigger, begin=s["begin"], grammar=schema, end=s["end"])
        )
    grammar = llguidance.StructTag.to_grammar(tags)
    return (
        grammar
        if grammar.lstrip().startswith("{")
        else llguidance.LLMatcher.grammar_from_lark(grammar)
    )


def _inline_schema(schema: dict) -> dict:
    """A schema to embed in a Lark grammar (`%json`), which takes no defaults or overrides
    arguments: the same options as grammar_from_json_schema's, in its own x-guidance."""
    options = {**JSON_DEFAULTS, **schema.get("x-guidance", {}), **JSON_OVERRIDES}
    return {**schema, "x-guidance": options}


def _calls_or_answer(calls_lark: str, answer: StructuredOutput) -> str:
    """One Lark grammar: the tool calls (tool_grammar's, its start renamed) or the answer."""
    if not calls_lark.startswith("start:"):
        raise GrammarError("unexpected tool grammar")
    rules = ["start: tool_calls | answer", "tool_calls:" + calls_lark[len("start:") :]]
    if answer.kind in ("json_schema", "json_object"):
        schema = json.loads(answer.spec) if answer.kind == "json_schema" else {"type": "object"}
        if not isinstance(schema, dict):
            raise GrammarError("a JSON schema beside tools must be an object")
        rules.append(f"answer: %json {json.dumps(_inline_schema(schema))}")
    elif answer.kind == "regex":
        rules.append(f"answer: /{answer.spec.replace('/', chr(92) + '/')}/")
    elif answer.kind == "choice":
        choices = json.loads(answer.spec)
        rules.append("answer: " + " | ".join(json.dumps(c) for c in choices))
    else:
        raise GrammarError(f"a {answer.kind} grammar cannot sit beside tool calls")
    return "\n".join(rules)


class GrammarCompiler:
    """Compiles constraints for one tokenizer, off the event loop, with a cache."""

    def __init__(
        self,
        hf_tokenizer: Any,
        vocab_size: int,
        eos_token_id: int | None,
        timeout_s: float = 2.0,
        max_concurrent: int = 2,
        max_pending: int = 64,
        cache_entries: int = 1024,
        cache_bytes: int = 64 << 20,
    ) -> None:
        self._hf = hf_tokenizer
        self._vocab_size, self._eos = vocab_size, eos_token_id
        self._ll_tokenizer: Any = None
        self._ll_lock = threading.Lock()
        self.timeout_s = timeout_s
        self._pool = concurrent.futures.ThreadPoolExecutor(
            max_concurrent, thread_name_prefix="grammar"
        )
        # Distinct constraints compiling or queued for the pool, by constraint.
        self._inflight: dict[tuple[str, str], asyncio.Future[Compiled]] = {}
        self.max_pending = max_pending
        # (kind, spec) -> (grammar or the error it gave, bytes held)
        self._cache: OrderedDict[tuple[str, str], tuple[str | GrammarError, int]] = OrderedDict()
        self._cache_bytes = 0
        self._cache_lock = threading.Lock()  # compiles finish on pool threads
        self._max_entries, self._max_bytes = cache_entries, cache_bytes
        self.hits = self.misses = self.timeouts = 0

    def ll_tokenizer(self) -> Any:
        with self._ll_lock:  # the first compile builds it (about a third of a second)
            if self._ll_tokenizer is None:
                self._ll_tokenizer = llguidance.hf.from_tokenizer(
                    self._hf, n_vocab=self._vocab_size, eos_token=self._eos
                )
            return self._ll_tokenizer

    def special_token_id(self, text: str) -> int | None:
        """A marker's id where it is one token llguidance treats as special (every added token,
        Qwen's `<tool_call>` included), for `<[id]>` in a grammar: such a token never matches
        the marker's text spelled in a grammar literal."""
        ids = self._hf.encode(text, add_special_tokens=False)
        if len(ids) == 1 and self.ll_tokenizer().is_special_token(ids[0]):
            return int(ids[0])
        return None

    def compile_sync(self, structured: StructuredOutput) -> Compiled:
        """The compile itself, on the calling thread: grammar text, matcher, first mask."""
        key = (structured.kind, structured.spec)
        with self._cache_lock:
            entry = self._cache.get(key)
            cached = None if entry is None else entry[0]
            if cached is not None:
                self._cache.move_to_end(key)
                self.hits += 1
            else:
                self.misses += 1
        if isinstance(cached, GrammarError):
            raise cached
        if cached is not None:
            return Compiled(cached, 0.0, True)
        t0 = time.perf_counter()
        try:
            grammar = self._compile(structured)
        except GrammarError as e:
            self._remember(key, e, len(str(e)))
            raise
        self._remember(key, grammar, len(grammar))
        return Compiled(grammar, time.perf_counter() - t0, False)

    def _compile(self, structured: StructuredOutput) -> str:
        if len(structured.spec) > MAX_SPEC_BYTES:
            raise GrammarError(f"the constraint is larger than {MAX_SPEC_BYTES} bytes")
        try:
            grammar = grammar_text(structured, self.special_token_id)
        except GrammarError:
            raise
        except Exception as e:  # llguidance's parse errors, malformed tool specs
            raise GrammarError(f"invalid {structured.kind} constraint: {e}") from None
        matcher = llguidance.LLMatcher(self.ll_tokenizer(), grammar, limits=LIMITS)
        if not matcher.is_error():
            matcher.compute_bitmask()  # the first mask: the bulk of llguidance's lazy build
        if matcher.is_error():
            raise GrammarError(f"invalid {structured.kind} constraint: {matcher.get_error()}")
        return grammar

    def _remember(self, key: tuple[str, str], value: str | GrammarError, size: int) -> None:
        with self._cache_lock:
            self._remember_locked(key, value, size + len(key[1]))

    def _remember_locked(self, key: tuple[str, str], value: str | GrammarError, size: int) -> None:
        if key in self._cache:  # two compiles of one constraint raced: keep the first
            return
        self._cache[key] = (value, size)
        self._cache_bytes += size
        while len(self._cache) > self._max_entries or self._cache_bytes > self._max_bytes:
            _, (_, old_size) = self._cache.popitem(last=False)
            self._cache_bytes -= old_size

    async def compile(self, structured: StructuredOutput) -> Compiled:
        """compile_sync on a pool thread, under the time limit; raises GrammarError for the
        4xx. Requests for a constraint already compiling wait for that compile (a burst of one
        new schema compiles it once); past max_pending distinct compiles, a 429."""
        key = (structured.kind, structured.spec)
        if key in self._cache:  # no thread hop for a hit
            return self.compile_sync(structured)
        future = self._inflight.get(key)
        joined = future is not None
        if future is None:
            if len(self._inflight) >= self.max_pending:
                raise GrammarError("too many grammars are compiling at once; retry shortly", 429)
            future = asyncio.get_running_loop().run_in_executor(
                self._pool, self.compile_sync, structured
            )
            self._inflight[key] = future
            future.add_done_callback(lambda f: self._compile_done(key, f))
        try:
            compiled = await asyncio.wait_for(asyncio.shield(future), self.timeout_s)
        except asyncio.TimeoutError:
            compiled = None
        if joined and compiled is not None:
            return Compiled(compiled.grammar, 0.0, True)  # another request paid for it
        # wait_for returns a result that is ready when the loop gets to it, however late: the
        # compile's own time decides too. (Its result stays cached: a repeat is a fast hit.)
        if compiled is None or compiled.compile_s > self.timeout_s:
            self.timeouts += 1
            raise GrammarError(
                f"compiling the {structured.kind} constraint took longer than "
                f"{self.timeout_s:g} s (--grammar-compile-timeout)"
            )
        return compiled

    def _compile_done(self, key: tuple[str, str], future: asyncio.Future[Compiled]) -> None:
        self._inflight.pop(key, None)
        if not future.cancelled():
            future.exception()  # retrieved: a timed-out compile's error is not "never retrieved"
