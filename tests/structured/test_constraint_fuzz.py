"""Constraints fuzzed (docs/structured-outputs.md): random JSON schemas (well-formed, malformed,
with keywords llguidance rejects and with nonsense values), random regexes and grammars, sent as
response_format and structured_outputs on both routes. Never a 5xx, every error an OpenAI error
body, and afterwards the server still serves and every KV block is free."""

from __future__ import annotations

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.factory import make_model
from tests.reliability.serve import Served
from tests.reliability.test_input_fuzz import check_healthy_and_free, check_response

pytestmark = pytest.mark.timeout(600)

FAST = settings(
    max_examples=40,
    deadline=None,
    suppress_health_check=list(HealthCheck),
    derandomize=True,
    database=None,
)
SLOW = settings(FAST, max_examples=300, derandomize=False)

KEYWORDS = [
    "type", "properties", "items", "required", "enum", "const", "anyOf", "oneOf", "allOf",
    "not", "minimum", "maximum", "exclusiveMinimum", "minLength", "maxLength", "pattern",
    "format", "minItems", "maxItems", "uniqueItems", "additionalProperties", "$ref", "$defs",
    "prefixItems", "contains", "if", "then", "multipleOf", "patternProperties", "x-guidance",
]  # fmt: skip
TYPES = ["object", "array", "string", "integer", "number", "boolean", "null", "bogus"]
scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**70), 2**70),
    st.floats(allow_nan=False, allow_infinity=False),
    st.text(max_size=12),
    st.sampled_from(TYPES),
)


def _schemas() -> st.SearchStrategy:
    return st.recursive(
        st.one_of(
            st.builds(lambda t: {"type": t}, st.sampled_from(TYPES)),
            st.booleans(),
            st.fixed_dictionaries({}, optional={"pattern": st.text(max_size=10)}),
        ),
        lambda inner: st.dictionaries(
            st.sampled_from(KEYWORDS),
            st.one_of(
                scalars,
                inner,
                st.lists(inner, max_size=3),
                st.dictionaries(st.text(max_size=6), inner, max_size=3),
                st.lists(st.text(max_size=6), max_size=3),
            ),
            max_size=5,
        ),
        max_leaves=12,
    )


def _json_schema_format(schema) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}


regexes = st.text(alphabet="ab()[]{}|*+?.^$\\-0-9,", max_size=20)
grammars = st.one_of(
    st.text(max_size=40),
    st.builds(lambda r: f'start: "x" {r}', st.text(alphabet='ab"()|*+ ', max_size=12)),
    st.builds(lambda r: f"root ::= {r}", st.text(alphabet='ab"()|*+[] ', max_size=12)),
)
constraints = st.one_of(
    st.builds(lambda s: {"structured_outputs": {"json": s}}, _schemas()),
    st.builds(lambda s: {"response_format": _json_schema_format(s)}, _schemas()),
    st.builds(lambda r: {"structured_outputs": {"regex": r}}, regexes),
    st.builds(lambda g: {"structured_outputs": {"grammar": g}}, grammars),
    st.builds(
        lambda c: {"structured_outputs": {"choice": c}}, st.lists(st.text(max_size=5), max_size=4)
    ),
    st.builds(lambda s: {"structured_outputs": {"json": s}}, st.text(max_size=30)),  # bad JSON
)  # fmt: skip


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    model = make_model(tmp_path_factory.mktemp("fuzz") / "model", "llama")
    run = tmp_path_factory.mktemp("run")
    flags = ("--num-kv-blocks", "256", "--block-size", "16", "--max-model-len", "512")
    s = Served(model, run, run / "serve.log", *flags)
    yield s
    s.stop()


def _send(server, route: str, constraint: dict) -> None:
    body: dict = {"max_tokens": 6, "temperature": 0}
    if route == "/v1/completions":
        body["prompt"] = [5, 9, 31]
    else:
        body["messages"] = [{"role": "user", "content": "hi"}]
    r = httpx.post(f"{server.url}{route}", json={**body, **constraint}, timeout=60)
    check_response(r.status_code, r.headers.get("content-type", ""), r.content)
    if r.status_code == 200:
        assert r.json()["choices"]


@given(constraint=constraints, chat=st.booleans())
@FAST
def test_fuzzed_constraints_never_500(server, constraint, chat):
    _send(server, "/v1/chat/completions" if chat else "/v1/completions", constraint)


@pytest.mark.slow
@given(constraint=constraints, chat=st.booleans())
@SLOW
def test_fuzzed_constraints_never_500_long(server, constraint, chat):
    _send(server, "/v1/chat/completions" if chat else "/v1/completions", constraint)


def test_the_server_is_healthy_and_free_afterwards(server):
    check_healthy_and_free(server)
    assert "Traceback" not in server.logs()
