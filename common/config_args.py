"""Command-line flags generated from config dataclasses, as vLLM's EngineArgs does: a field made
with `flag(...)` (or a shared `Flag`'s `.field()`) is its flag, declared once with its help,
default, choices and aliases. `--max-num-seqs` is the field `max_num_seqs`; a bool field is
`--x/--no-x` (argparse.BooleanOptionalAction) unless it is a plain switch. A field whose type is
a config dataclass itself adds that class's flags to the same parser (flat, as the services'
flags have always been), and one name shared by several classes is one flag feeding them all.

A process started by `stoker serve` gets its whole config as one JSON object (`--config-json`,
hidden from --help) instead of a retyped argv; a secret field (the API key) is left out of it
and read from its environment variable, since a command line is world-readable in /proc.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import types
import typing
from collections.abc import Callable, Collection, Iterator, Sequence
from typing import Any, TypeVar

from stoker.common.logs import add_log_format_arg, configure_logging

T = TypeVar("T")
FLAG = "stoker.flag"  # the key of a field's metadata that holds its Flag
CONFIG_JSON = "config_json"
SAME: Any = object()  # cli_default's marker: the flag's default is the field's


@dataclasses.dataclass(frozen=True)
class Flag:
    """One flag: a field's default and everything argparse needs to offer it."""

    default: Any = None
    help: str | None = None
    aliases: tuple[str, ...] = ()  # more option strings, e.g. ("-tp",)
    choices: Collection[Any] | None = None
    metavar: str | None = None
    env: str | None = None  # the flag's default comes from this variable when it is set
    cli_default: Any = SAME  # the flag's default, where it is not the field's
    parse: Callable[[str], Any] | None = None  # argparse's type=, to check a value early
    switch: bool = False  # a bool as a bare `--x` (store_true), not `--x/--no-x`
    required: bool = False
    secret: bool = False  # never serialised: a child reads it from `env`
    group: str | None = None  # the --help section (None: the parser's own options)

    def field(self, **changes: Any) -> Any:
        """A dataclass field for this flag; `changes` adjust it for one class."""
        spec = dataclasses.replace(self, **changes) if changes else self
        if spec.required:  # no default: the class must give this field first
            return dataclasses.field(metadata={FLAG: spec})
        return dataclasses.field(default=spec.default, metadata={FLAG: spec})

    def flag_default(self) -> Any:
        base = self.default if self.cli_default is SAME else self.cli_default
        return os.environ.get(self.env, base) if self.env else base


def flag(default: Any = None, help: str | None = None, **options: Any) -> Any:
    """A dataclass field that is a flag: `x: int = flag(8, "what x is")`."""
    return Flag(default, help, **options).field()


def option_name(name: str) -> str:
    return "--" + name.replace("_", "-")


def flags_of(cls: type) -> Iterator[tuple[str, Flag, type]]:
    """(field name, Flag, value type) for each flag of `cls`, nested config classes' in place."""
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        nested = _config_class(hints[f.name])
        if nested is not None:
            yield from flags_of(nested)
        elif FLAG in f.metadata:
            yield f.name, f.metadata[FLAG], _value_type(hints[f.name])


def add_flags(
    parser: argparse.ArgumentParser,
    cls: type,
    *,
    only: Collection[str] | None = None,
    skip: Collection[str] = (),
) -> None:
    """Add the flags of `cls` (those in `only`, less `skip`). A flag the parser already has is
    left as it is: one `--model` serves every class with a `model` field."""
    have = {a.dest for a in parser._actions}
    groups = {g.title: g for g in parser._action_groups}
    for name, spec, kind in flags_of(cls):
        if name in have or name in skip or (only is not None and name not in only):
            continue
        have.add(name)
        if spec.group is None:
            target: Any = parser
        else:
            target = groups.get(spec.group) or parser.add_argument_group(spec.group)
            groups[spec.group] = target
        target.add_argument(option_name(name), *spec.aliases, **_argparse_options(spec, kind))


def _argparse_options(spec: Flag, kind: type) -> dict[str, Any]:
    options: dict[str, Any] = {"help": spec.help}
    if kind is bool:
        options["action"] = "store_true" if spec.switch else argparse.BooleanOptionalAction
    else:
        options["type"] = spec.parse or kind
        if spec.choices is not None:
            options["choices"] = spec.choices
        if spec.metavar is not None:
            options["metavar"] = spec.metavar
    if spec.required:
        options["required"] = True
    else:
        options["default"] = spec.flag_default()
    return options


def _value_type(hint: Any) -> type:
    """`int` for `int` or `int | None`; str for anything else a flag may hold."""
    if isinstance(hint, types.UnionType):
        hint = next(t for t in typing.get_args(hint) if t is not type(None))
    return hint if hint in (bool, int, float) else str


def _config_class(hint: Any) -> type | None:
    """`hint` itself when it is a dataclass that holds flags (a nested config)."""
    if isinstance(hint, type) and dataclasses.is_dataclass(hint):
        return hint
    return None


def from_args(cls: type[T], args: argparse.Namespace, **values: Any) -> T:
    """An instance of `cls` from parsed flags: each field takes the flag of its name (nested
    configs likewise), a flag this parser lacks its default, and `values` override."""
    return _build(cls, vars(args) | values, lambda nested, _: from_args(nested, args))


def to_json(config: Any) -> str:
    """The config's init fields as JSON, less secret ones."""
    return json.dumps(_plain(config), separators=(",", ":"))


def _plain(config: Any) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for f in dataclasses.fields(config):
        spec = f.metadata.get(FLAG)
        if not f.init or (spec is not None and spec.secret):
            continue
        value = getattr(config, f.name)
        out[f.name] = _plain(value) if dataclasses.is_dataclass(value) else value
    return out


def from_json(cls: type[T], text: str | dict[str, Any]) -> T:
    """The inverse of to_json; a secret field comes from its environment variable."""
    raw = json.loads(text) if isinstance(text, str) else text
    return _build(cls, raw, lambda nested, name: from_json(nested, raw.get(name, {})))


def _build(cls: type[T], values: dict[str, Any], nested: Callable[[type, str], Any]) -> T:
    hints = typing.get_type_hints(cls)
    kwargs: dict[str, Any] = {}
    for f in dataclasses.fields(cls):  # type: ignore[arg-type]  # T is a dataclass
        spec, inner = f.metadata.get(FLAG), _config_class(hints[f.name])
        if not f.init:
            continue
        if inner is not None:  # an instance given as is, else built from the same source
            given = values.get(f.name)
            kwargs[f.name] = given if isinstance(given, inner) else nested(inner, f.name)
        elif f.name in values:
            kwargs[f.name] = values[f.name]
        elif spec is not None and not spec.required:
            kwargs[f.name] = spec.flag_default()  # as if its flag were left out
    return cls(**kwargs)


def add_config_json(parser: argparse.ArgumentParser) -> None:
    """The hidden `--config-json` through which `stoker serve` hands a child its config."""
    parser.add_argument("--config-json", default=None, help=argparse.SUPPRESS)


def parse_args(
    parser: argparse.ArgumentParser, argv: Sequence[str] | None = None
) -> argparse.Namespace:
    """parser.parse_args, but a required flag is not, when --config-json brings it."""
    argv = sys.argv[1:] if argv is None else list(argv)
    if any(a.split("=", 1)[0] == "--config-json" for a in argv):
        for action in parser._actions:
            action.required = False
    return parser.parse_args(argv)


def config_from(parser: argparse.ArgumentParser, cls: type[T], args: argparse.Namespace) -> T:
    """`cls` from parsed flags, or from --config-json when given (no flag of `cls` may come
    with it). A config that fails its checks is a usage error."""
    text = getattr(args, CONFIG_JSON, None)
    try:
        if text is None:
            return from_args(cls, args)
        given = [n for n, _, _ in flags_of(cls) if getattr(args, n) != parser.get_default(n)]
        if given:
            parser.error(f"--config-json comes alone, not with {option_name(given[0])}")
        return from_json(cls, text)
    except (TypeError, ValueError) as e:
        parser.error(str(e))


def service_config(
    process: str, cls: type[T], argv: Sequence[str] | None, description: str | None = None
) -> T:
    """A service process's settings, from its flags or the one --config-json object `stoker
    serve` hands it; logging is set up first (the config's checks may log)."""
    parser = argparse.ArgumentParser(prog=f"stoker {process}", description=description)
    add_flags(parser, cls)
    add_log_format_arg(parser)
    add_config_json(parser)
    args = parse_args(parser, argv)
    configure_logging(process, args.log_format)
    return config_from(parser, cls, args)
