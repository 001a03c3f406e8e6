"""A corpus of real-world JSON schemas for the grammar-backend benchmark
(benchmarks/grammar_backends.py), read at run time from packages installed in .venv: nothing is
downloaded and nothing large is committed.

Sources, in this order (`load_corpus()` keeps it, so runs compare row by row):
- schemastore: the SchemaStore schemas vendored by check-jsonschema (CI configs, compose, ...);
- package: config schemas shipped by setuptools and schemathesis, and JSON Schema's own
  metaschemas (jsonschema-specifications);
- kubernetes: every stable top-level kind of the newest version kubernetes-validate bundles
  (its "strict" flavour, additionalProperties false), with the definitions each one uses
  inlined under $defs: the file it points to ships in the same folder;
- pydantic: schemas generated from the openai and mcp clients' response models, and from a
  few hand-written request models with the constraints users put in response formats.

A schema with a $ref outside itself is skipped with its reason counted: nothing is resolved
over the network. Exact duplicates (one model re-exported under two names) keep the first.
"""

from __future__ import annotations

import datetime as dt
import enum
import functools
import importlib
import inspect
import json
import re
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Annotated, Any, Literal

Schema = dict[str, Any]
Skipped = list[tuple[str, str]]  # (name, reason)

K8S_REF = "/api/_definitions.json#/$defs/"
PYDANTIC_MODULES = ("openai.types", "openai.types.chat", "mcp.types")


def load_corpus() -> list[tuple[str, Schema]]:
    """(name, schema) for every usable schema, in a fixed order."""
    return load_corpus_with_skips()[0]


def load_corpus_with_skips() -> tuple[list[tuple[str, Schema]], Skipped]:
    kept: list[tuple[str, Schema]] = []
    skipped: Skipped = []
    seen: dict[str, str] = {}
    for name, schema in _all_sources(skipped):
        refs = sorted(_external_refs(schema))
        if refs:
            skipped.append((name, f"non-local $ref ({refs[0]})"))
            continue
        key = json.dumps(schema, sort_keys=True)
        if key in seen:
            skipped.append((name, f"duplicate of {seen[key]}"))
            continue
        seen[key] = name
        kept.append((name, schema))
    return kept, skipped


def source_of(name: str) -> str:
    return name.split("/", 1)[0]


def _all_sources(skipped: Skipped) -> Iterator[tuple[str, Schema]]:
    yield from _schemastore(skipped)
    yield from _package_schemas(skipped)
    yield from _kubernetes(skipped)
    yield from _pydantic_models(skipped)
    yield from _example_models()


def _package_dir(package: str, skipped: Skipped) -> Path | None:
    try:
        return Path(str(resources.files(package)))
    except ModuleNotFoundError:
        skipped.append((package, "package not installed"))
        return None


def _read(path: Path) -> Schema:
    return json.loads(path.read_text(encoding="utf-8"))


def _schemastore(skipped: Skipped) -> Iterator[tuple[str, Schema]]:
    root = _package_dir("check_jsonschema", skipped)
    if root is None:
        return
    for path in sorted((root / "builtin_schemas").glob("*/*.json")):
        yield f"schemastore/{path.stem}", _read(path)


def _package_schemas(skipped: Skipped) -> Iterator[tuple[str, Schema]]:
    files = [
        ("setuptools", "config/setuptools.schema.json", "setuptools-pyproject"),
        ("setuptools", "config/distutils.schema.json", "setuptools-distutils"),
        ("schemathesis", "config/schema.json", "schemathesis-config"),
        ("schemathesis", "wfc/schema.json", "schemathesis-wfc"),
    ]
    for package, rel, name in files:
        root = _package_dir(package, skipped)
        if root is not None and (root / rel).is_file():
            yield f"package/{name}", _read(root / rel)
    root = _package_dir("jsonschema_specifications", skipped)
    if root is not None:
        for path in sorted((root / "schemas").glob("*/metaschema.json")):
            yield f"package/metaschema-{path.parent.name}", _read(path)


def _kubernetes(skipped: Skipped) -> Iterator[tuple[str, Schema]]:
    root = _package_dir("kubernetes_validate", skipped)
    if root is None:
        return
    strict = [p for p in (root / "kubernetes-json-schema").iterdir() if p.name.endswith("-strict")]
    folder = max(strict, key=lambda p: tuple(int(x) for x in re.findall(r"\d+", p.name)[:3]))
    defs = _read(folder / "_definitions.json")["$defs"]
    for path in sorted(folder.glob("*.json")):
        if path.name.startswith("_") or path.name == "all.json":
            continue
        if "alpha" in path.stem or "beta" in path.stem:
            continue
        schema = _read(path)
        if "enum" not in schema.get("properties", {}).get("kind", {}):
            continue  # a fragment (PodSpec, ...), not a kind one would apply
        yield f"kubernetes/{path.stem}", _bundle_k8s(schema, defs)


def _bundle_k8s(schema: Schema, defs: dict[str, Schema]) -> Schema:
    """Point the refs into _definitions.json at local $defs, and copy in the ones reached."""

    def rewrite(node: Any) -> Any:
        if isinstance(node, dict):
            return {k: rewrite(v) for k, v in node.items()}
        if isinstance(node, list):
            return [rewrite(v) for v in node]
        if isinstance(node, str) and node.startswith(K8S_REF):
            return "#/$defs/" + node[len(K8S_REF) :]
        return node

    out = rewrite({k: v for k, v in schema.items() if k != "$id"})
    needed: dict[str, Schema] = {}
    todo = [r for r in _refs(out)]
    while todo:
        name = todo.pop().removeprefix("#/$defs/")
        if name in needed or name not in defs:
            continue
        needed[name] = defs[name]
        todo.extend(_refs(defs[name]))
    out["$defs"] = {k: needed[k] for k in sorted(needed)}
    return out


def _refs(node: Any) -> Iterator[str]:
    if isinstance(node, dict):
        for k, v in node.items():
            if k == "$ref" and isinstance(v, str):
                yield v
            else:
                yield from _refs(v)
    elif isinstance(node, list):
        for v in node:
            yield from _refs(v)


def _external_refs(schema: Schema) -> set[str]:
    return {r for r in _refs(schema) if not r.startswith("#")}


def _pydantic_models(skipped: Skipped) -> Iterator[tuple[str, Schema]]:
    from pydantic import BaseModel

    for modname in PYDANTIC_MODULES:
        try:
            module = importlib.import_module(modname)
        except ImportError:
            skipped.append((modname, "package not installed"))
            continue
        for attr in sorted(dir(module)):
            model = getattr(module, attr)
            if inspect.isclass(model) and issubclass(model, BaseModel):
                name = f"pydantic/{modname.split('.')[0]}.{attr}"
                try:
                    yield name, model.model_json_schema()
                except Exception as e:  # a model pydantic can't describe is not a schema
                    skipped.append((name, f"model_json_schema failed: {type(e).__name__}"))


def _example_models() -> Iterator[tuple[str, Schema]]:
    """Request-shaped models of the kind users send as response_format."""
    from pydantic import BaseModel, Field

    class Currency(str, enum.Enum):
        usd = "USD"
        eur = "EUR"
        gbp = "GBP"

    class Address(BaseModel):
        street: str = Field(min_length=1, max_length=200)
        city: str
        postcode: str = Field(pattern=r"^[A-Z0-9 -]{3,10}$")
        country: str = Field(min_length=2, max_length=2, description="ISO 3166-1 alpha-2")

    class LineItem(BaseModel):
        sku: str = Field(pattern=r"^[A-Z]{3}-\d{4}$")
        description: str
        quantity: int = Field(ge=1, le=1000)
        unit_price: float = Field(gt=0)

    class Invoice(BaseModel):
        invoice_id: uuid.UUID
        issued: dt.date
        currency: Currency
        bill_to: Address
        items: list[LineItem] = Field(min_length=1, max_length=20)
        notes: str | None = None

    class Event(BaseModel):
        title: str = Field(max_length=80)
        start: dt.datetime
        end: dt.datetime
        attendees: list[str] = Field(default_factory=list, max_length=10)
        location: Address | None = None
        recurrence: Literal["none", "daily", "weekly", "monthly"] = "none"

    class Sentiment(BaseModel):
        label: Literal["positive", "negative", "neutral"]
        confidence: Annotated[float, Field(ge=0, le=1)]
        aspects: dict[str, Literal["positive", "negative", "neutral"]]

    class Entity(BaseModel):
        text: str
        kind: Literal["person", "org", "place", "date", "other"]
        start: int = Field(ge=0)
        end: int = Field(ge=0)

    class Extraction(BaseModel):
        entities: list[Entity]
        summary: str = Field(max_length=280)
        language: str = Field(pattern=r"^[a-z]{2}$")

    class WeatherArgs(BaseModel):
        """A tool call's arguments."""

        city: str
        unit: Literal["celsius", "fahrenheit"] = "celsius"
        days: int = Field(default=1, ge=1, le=14)

    class TreeNode(BaseModel):
        name: str
        children: list[TreeNode] = Field(default_factory=list)

    TreeNode.model_rebuild()
    for model in (Address, Invoice, Event, Sentiment, Extraction, WeatherArgs, TreeNode):
        yield f"pydantic/example.{model.__name__}", model.model_json_schema()


D4 = "http://json-schema.org/draft-04/schema#"
D7 = "http://json-schema.org/draft-07/schema#"
STR, INT, NUM = {"type": "string"}, {"type": "integer"}, {"type": "number"}

# (keyword, schema, an instance the schema forbids, one it allows), compact JSON: each backend
# either rejects the schema, or must refuse the first and take the second. A backend that takes
# the first relaxes the keyword; the server has to answer 400 for it.
KEYWORD_PROBES: list[tuple[str, Schema, str, str]] = [
    ("type", INT, "1.5", "7"),
    ("enum", {"enum": ["a", 1, None]}, '"b"', "1"),
    ("const", {"const": {"k": [1]}}, '{"k":[2]}', '{"k":[1]}'),
    ("minimum", {**INT, "minimum": 5}, "4", "5"),
    ("maximum", {**NUM, "maximum": 2.5}, "2.6", "2.5"),
    ("exclusiveMinimum", {**INT, "exclusiveMinimum": 5}, "5", "6"),
    ("exclusiveMaximum", {**NUM, "exclusiveMaximum": 0}, "0", "-0.5"),
    (
        "exclusiveMinimum (draft-04 bool)",
        {"$schema": D4, **NUM, "minimum": 5, "exclusiveMinimum": True},
        "5",
        "5.5",
    ),
    ("multipleOf (integer)", {**INT, "multipleOf": 3}, "4", "9"),
    ("multipleOf (number)", {**NUM, "multipleOf": 0.5}, "0.3", "1.5"),
    ("minLength", {**STR, "minLength": 3}, '"ab"', '"abc"'),
    ("maxLength", {**STR, "maxLength": 3}, '"abcd"', '"abc"'),
    ("maxLength (escapes count as one)", {**STR, "maxLength": 1}, '"ab"', '"\\n"'),
    ("pattern", {**STR, "pattern": "^[a-z]+$"}, '"aB"', '"ab"'),
    ("pattern (unanchored)", {**STR, "pattern": "b"}, '"ac"', '"abc"'),
    ("pattern + maxLength", {**STR, "pattern": "^[a-z]+$", "maxLength": 3}, '"abcd"', '"abc"'),
    ("format: date", {**STR, "format": "date"}, '"2023-02-30"', '"2024-02-29"'),
    ("format: date (leap day)", {**STR, "format": "date"}, '"2023-02-29"', '"2024-02-29"'),
    (
        "format: date-time",
        {**STR, "format": "date-time"},
        '"2023-01-01T25:00:00Z"',
        '"2023-01-01T23:59:59Z"',
    ),
    (
        "format: date-time (leap day)",
        {**STR, "format": "date-time"},
        '"2023-02-29T00:00:00Z"',
        '"2024-02-29T00:00:00Z"',
    ),
    ("format: time", {**STR, "format": "time"}, '"24:00:00Z"', '"23:59:59+01:00"'),
    ("format: email", {**STR, "format": "email"}, '"a.b"', '"a@b.io"'),
    ("format: ipv4", {**STR, "format": "ipv4"}, '"256.1.1.1"', '"10.0.0.1"'),
    (
        "format: uuid",
        {**STR, "format": "uuid"},
        '"123e4567-e89b-12d3-a456-42661417400"',
        '"123e4567-e89b-12d3-a456-426614174000"',
    ),
    ("format: hostname", {**STR, "format": "hostname"}, '"-a.com"', '"a-b.example.com"'),
    ("format + maxLength", {**STR, "format": "email", "maxLength": 6}, '"ab@cd.io"', '"a@b.io"'),
    ("format: ipv6", {**STR, "format": "ipv6"}, '"1::2::3"', '"::1"'),
    ("format: uri", {**STR, "format": "uri"}, '"a b"', '"https://a.io/x?y=1"'),
    ("format: duration", {**STR, "format": "duration"}, '"P1H"', '"PT1H"'),
    ("maximum (exponent)", {**NUM, "maximum": 10}, "1e2", "1e1"),
    ("maxLength (non-ASCII counts as one)", {**STR, "maxLength": 1}, '"ab"', '"é"'),
    ("items", {"type": "array", "items": INT}, '[1,"a"]', "[1,2]"),
    (
        "prefixItems",
        {"type": "array", "prefixItems": [INT, STR], "items": False},
        "[1,2]",
        '[1,"a"]',
    ),
    (
        "items array + additionalItems (draft-07)",
        {"$schema": D7, "type": "array", "items": [INT], "additionalItems": False},
        "[1,2]",
        "[1]",
    ),
    ("minItems", {"type": "array", "minItems": 2}, "[1]", "[1,2]"),
    ("maxItems", {"type": "array", "maxItems": 1}, "[1,2]", "[1]"),
    ("uniqueItems", {"type": "array", "items": INT, "uniqueItems": True}, "[1,1]", "[1,2]"),
    ("contains", {"type": "array", "items": INT, "contains": {"const": 3}}, "[1]", "[1,3]"),
    ("properties", {"type": "object", "properties": {"a": INT}}, '{"a":"x"}', '{"a":1}'),
    ("required", {"type": "object", "properties": {"a": INT}, "required": ["a"]}, "{}", '{"a":1}'),
    (
        "additionalProperties: false",
        {"type": "object", "properties": {"a": INT}, "additionalProperties": False},
        '{"b":1}',
        '{"a":1}',
    ),
    (
        "additionalProperties: schema",
        {"type": "object", "additionalProperties": INT},
        '{"b":"x"}',
        '{"b":1}',
    ),
    (
        "additionalProperties (absent means allowed)",
        {"type": "object", "properties": {"a": INT}},
        '{"a":"x"}',
        '{"a":1,"b":2}',
    ),
    (
        "patternProperties",
        {"type": "object", "patternProperties": {"^x": INT}, "additionalProperties": False},
        '{"x":"s"}',
        '{"x1":1}',
    ),
    (
        "propertyNames",
        {"type": "object", "propertyNames": {"pattern": "^[a-z]+$"}},
        '{"A":1}',
        '{"a":1}',
    ),
    (
        "minProperties",
        {"type": "object", "additionalProperties": INT, "minProperties": 1},
        "{}",
        '{"a":1}',
    ),
    (
        "maxProperties",
        {"type": "object", "additionalProperties": INT, "maxProperties": 1},
        '{"a":1,"b":2}',
        '{"a":1}',
    ),
    (
        "duplicate keys (declared property)",
        {"type": "object", "properties": {"a": INT}},
        '{"a":1,"a":2}',
        '{"a":1}',
    ),
    (
        "duplicate keys (open object)",
        {"type": "object", "properties": {"a": INT}},
        '{"a":1,"b":1,"b":2}',
        '{"a":1,"b":1}',
    ),
    (
        "duplicate keys (additionalProperties)",
        {"type": "object", "additionalProperties": INT},
        '{"a":1,"a":2}',
        '{"a":1,"b":2}',
    ),
    (
        "dependentRequired",
        {"type": "object", "properties": {"a": INT, "b": INT}, "dependentRequired": {"a": ["b"]}},
        '{"a":1}',
        '{"a":1,"b":2}',
    ),
    (
        "dependencies (draft-07)",
        {
            "$schema": D7,
            "type": "object",
            "properties": {"a": INT, "b": INT},
            "dependencies": {"a": ["b"]},
        },
        '{"a":1}',
        '{"a":1,"b":2}',
    ),
    (
        "unevaluatedProperties",
        {"type": "object", "allOf": [{"properties": {"a": INT}}], "unevaluatedProperties": False},
        '{"b":1}',
        '{"a":1}',
    ),
    (
        "allOf",
        {
            "allOf": [
                {"type": "object", "properties": {"a": INT}, "required": ["a"]},
                {"type": "object", "properties": {"b": INT}, "required": ["b"]},
            ]
        },
        '{"a":1}',
        '{"a":1,"b":2}',
    ),
    ("anyOf", {"anyOf": [INT, {"type": "boolean"}]}, '"s"', "true"),
    ("oneOf (disjoint)", {"oneOf": [INT, STR]}, "true", "1"),
    ("oneOf (overlapping)", {"oneOf": [NUM, {**INT, "minimum": 0}]}, "1", "-1"),
    ("not", {**INT, "not": {"const": 3}}, "3", "4"),
    (
        "if/then/else",
        {**INT, "if": {"minimum": 10}, "then": {"multipleOf": 2}, "else": {"maximum": 5}},
        "11",
        "12",
    ),
    (
        "$ref + $defs",
        {
            "$defs": {
                "p": {
                    "type": "object",
                    "properties": {"v": INT, "n": {"$ref": "#/$defs/p"}},
                    "required": ["v"],
                }
            },
            "$ref": "#/$defs/p",
        },
        '{"v":1,"n":{}}',
        '{"v":1,"n":{"v":2}}',
    ),
    (
        "$ref with siblings",
        {"$defs": {"s": STR}, "$ref": "#/$defs/s", "maxLength": 2},
        '"abc"',
        '"ab"',
    ),
    ("$anchor", {"$defs": {"a": {"$anchor": "x", **INT}}, "$ref": "#x"}, '"s"', "1"),
    ("nullable type list", {"type": ["string", "null"], "maxLength": 2}, '"abc"', "null"),
    ("required (not in properties)", {"type": "object", "required": ["x"]}, "{}", '{"x":1}'),
    (
        "maxProperties (optional properties)",
        {"type": "object", "properties": {"a": INT, "b": INT}, "maxProperties": 1},
        '{"a":1,"b":2}',
        '{"a":1}',
    ),
    (
        "patternProperties over properties",
        {
            "type": "object",
            "properties": {"ab": STR},
            "patternProperties": {"^a": {"maxLength": 1}},
        },
        '{"ab":"xx"}',
        '{"ab":"x"}',
    ),
    (
        "allOf + additionalProperties false",
        {
            "allOf": [
                {"properties": {"a": INT}, "additionalProperties": False},
                {"properties": {"b": INT}},
            ]
        },
        '{"a":1,"b":1}',
        '{"a":1}',
    ),
    (
        "dependentSchemas",
        {"type": "object", "dependentSchemas": {"a": {"required": ["b"]}}},
        '{"a":1}',
        '{"a":1,"b":2}',
    ),
    (
        "unevaluatedItems",
        {"type": "array", "prefixItems": [INT], "unevaluatedItems": False},
        "[1,2]",
        "[1]",
    ),
]


@dataclass
class Verdict:
    """An output checked against its schema. keywords: those failed without format checking
    ("<not JSON>" if it doesn't parse); formats: "format:X" failed only with it; duplicates:
    an object repeats a key, which JSON Schema can't see (json.loads keeps the last)."""

    keywords: list[str]
    formats: list[str]
    duplicates: bool
    message: str | None

    @property
    def valid(self) -> bool:
        return not (self.keywords or self.formats or self.duplicates)


def validate(schema: Schema, text: str) -> Verdict:
    from jsonschema.validators import validator_for

    dupes: list[str] = []

    def pairs(items: list[tuple[str, Any]]) -> dict:
        keys = [k for k, _ in items]
        dupes.extend(k for k in set(keys) if keys.count(k) > 1)
        return dict(items)

    try:
        instance = json.loads(text, object_pairs_hook=pairs)
    except ValueError as e:
        return Verdict(["<not JSON>"], [], False, str(e)[:300])
    cls = validator_for(schema)
    errors = list(cls(schema).iter_errors(instance))
    if not errors:
        errors = list(cls(schema, format_checker=_format_checker(cls)).iter_errors(instance))
        formats = sorted({f"format:{e.validator_value}" for e in errors})
        keywords: list[str] = []
    else:
        formats, keywords = [], sorted({str(e.validator) for e in errors})
    message = f"{errors[0].json_path}: {errors[0].message}"[:300] if errors else None
    if dupes and not message:
        message = f"duplicate key {sorted(dupes)[0]!r}"
    return Verdict(keywords, formats, bool(dupes), message)


@functools.cache
def _format_checker(cls: Any) -> Any:
    """The draft's own format checker, plus stdlib checks for the formats llguidance enforces
    that jsonschema checks only with optional packages (date-time, time, duration, hostname,
    uri)."""
    from jsonschema import FormatChecker

    checker = FormatChecker(formats=())
    checker.checkers = dict(cls.FORMAT_CHECKER.checkers)
    offset = r"([Zz]|[+-]\d\d:\d\d)"
    patterns = {
        "date-time": rf"\d{{4}}-\d\d-\d\d[Tt]\d\d:\d\d:\d\d(\.\d+)?{offset}",
        "time": rf"\d\d:\d\d:\d\d(\.\d+)?{offset}",
        "duration": r"P(?!$)(\d+W|(\d+Y)?(\d+M)?(\d+D)?(T(?=\d)(\d+H)?(\d+M)?(\d+S)?)?)",
        "hostname": r"(?=.{1,253}$)([A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?\.?)+",
        "uri": r"[A-Za-z][A-Za-z0-9+.-]*:([A-Za-z0-9\-._~:/?#\[\]@!$&'()*+,;=]|%[0-9A-Fa-f]{2})*",
    }
    for fmt, pattern in patterns.items():
        if fmt not in checker.checkers:
            checker.checks(fmt)(functools.partial(_format_ok, fmt, pattern))
    return checker


def formats_checked(schema: Schema) -> list[str]:
    from jsonschema.validators import validator_for

    return sorted(_format_checker(validator_for(schema)).checkers)


def _format_ok(fmt: str, pattern: str, value: object) -> bool:
    if not isinstance(value, str):
        return True
    if not re.fullmatch(pattern, value):
        return False
    if fmt in ("date-time", "time"):  # the ranges: 2023-13-01 or 25:00 match the pattern
        text = re.sub(r":60(?=\D|$)", ":59", value.upper().replace("Z", "+00:00"))  # leap second
        try:
            (dt.datetime if fmt == "date-time" else dt.time).fromisoformat(text)
        except ValueError:
            return False
    return True


if __name__ == "__main__":
    from collections import Counter

    corpus, skips = load_corpus_with_skips()
    print(len(corpus), "schemas:", dict(Counter(source_of(n) for n, _ in corpus)))
    for name, reason in skips:
        if not reason.startswith("duplicate"):
            print("skipped", name, reason)
    print("duplicates skipped:", sum(r.startswith("duplicate") for _, r in skips))
