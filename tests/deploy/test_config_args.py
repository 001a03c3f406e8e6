"""Flags generated from config dataclasses (common/config_args.py), and `stoker serve` handing
each child its config as one JSON object instead of a retyped argv."""

from __future__ import annotations

import argparse
import dataclasses
import json
import subprocess
import sys

import pytest

from stoker.common.config import EngineConfig
from stoker.common.config_args import (
    Flag,
    add_config_json,
    add_flags,
    config_from,
    flag,
    from_args,
    from_json,
    parse_args,
    to_json,
)
from stoker.launcher import _commands, build_parser
from stoker.services.api.config import ApiConfig
from stoker.services.scheduler.config import SchedulerServiceConfig
from stoker.services.tokenizer.config import TokenizerConfig

SHARED = Flag(3, "shared by two classes")


@dataclasses.dataclass
class Inner:
    name: str = flag(help="required", required=True)
    size: int | None = flag(None, "a size", aliases=("-s",), group="inner")
    mode: str = flag("a", choices=["a", "b"], group="inner")
    on: bool = flag(True, "on or off")
    loud: bool = flag(False, "a bare switch", switch=True)
    ratio: float = flag(0.5)
    home: str = flag("/x", env="TEST_CONFIG_HOME", cli_default="/cli")
    key: str | None = flag(None, env="TEST_CONFIG_KEY", secret=True)
    shared: int = SHARED.field()


@dataclasses.dataclass
class Outer:
    inner: Inner
    shared: int = SHARED.field(group="outer")
    plain: str = "not a flag"


def _parser(cls: type = Outer) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="t")
    add_flags(parser, cls)
    add_config_json(parser)
    return parser


def test_flags_take_their_type_default_choices_and_form_from_the_field(monkeypatch):
    monkeypatch.setenv("TEST_CONFIG_HOME", "/env")
    parser = _parser()
    args = parser.parse_args(["--name", "n", "-s", "4", "--no-on", "--loud", "--ratio", "2"])
    assert (args.size, args.on, args.loud, args.ratio) == (4, False, True, 2.0)
    assert args.home == "/env" and args.mode == "a" and args.shared == 3
    with pytest.raises(SystemExit):
        parser.parse_args(["--name", "n", "--mode", "c"])
    with pytest.raises(SystemExit):  # a switch has no --no- form
        parser.parse_args(["--name", "n", "--no-loud"])
    with pytest.raises(SystemExit):  # required
        parser.parse_args([])
    assert "inner" in {g.title for g in parser._action_groups}
    monkeypatch.delenv("TEST_CONFIG_HOME")
    assert _parser().parse_args(["--name", "n"]).home == "/cli"  # the flag's own default


def test_one_name_is_one_flag_feeding_nested_and_outer_fields():
    args = _parser().parse_args(["--name", "n", "--shared", "7"])
    config = from_args(Outer, args)
    assert config.shared == config.inner.shared == 7
    assert config.plain == "not a flag"
    assert [a.dest for a in _parser()._actions].count("shared") == 1


def test_json_round_trip_leaves_secrets_to_the_environment(monkeypatch):
    monkeypatch.setenv("TEST_CONFIG_KEY", "sekret")
    config = from_args(Outer, _parser().parse_args(["--name", "n", "-s", "2"]))
    assert config.inner.key == "sekret"
    text = to_json(config)
    assert "sekret" not in text and json.loads(text)["inner"]["size"] == 2
    assert from_json(Outer, text) == config
    monkeypatch.delenv("TEST_CONFIG_KEY")
    assert from_json(Outer, text).inner.key is None


def test_config_json_comes_alone():
    parser = _parser(Inner)
    given = Inner(name="n", size=5)
    # --name is required, but not beside --config-json, which brings it
    config = config_from(parser, Inner, parse_args(parser, ["--config-json", to_json(given)]))
    assert config == given
    with pytest.raises(SystemExit):
        config_from(parser, Inner, parse_args(parser, ["--config-json={}", "--size", "1"]))


def test_a_bad_config_is_a_usage_error(capsys):
    parser = argparse.ArgumentParser(prog="t")
    add_flags(parser, EngineConfig)
    with pytest.raises(SystemExit) as e:
        config_from(parser, EngineConfig, parser.parse_args(["--block-size", "0"]))
    assert e.value.code == 2 and "block_size must be positive" in capsys.readouterr().err


def test_every_engine_field_is_a_flag_and_the_aliases_stay(monkeypatch):
    monkeypatch.delenv("STOKER_MODEL", raising=False)
    parser = argparse.ArgumentParser()
    add_flags(parser, EngineConfig)
    dests = {a.dest for a in parser._actions}
    assert {f.name for f in dataclasses.fields(EngineConfig)} <= dests
    assert parser.parse_args(["-tp", "1"]).tensor_parallel_size == 1
    assert parser.parse_args([]).model == "default"
    monkeypatch.setenv("STOKER_MODEL", "smollm2")
    parser = argparse.ArgumentParser()
    add_flags(parser, EngineConfig)
    assert parser.parse_args([]).model == "smollm2"


def _children(argv: list[str]) -> dict[str, list[str]]:
    return dict(_commands(build_parser().parse_args(argv)))


def test_serve_hands_each_child_one_json_config(tmp_path, monkeypatch):
    from tests.factory import make_model

    model = str(make_model(tmp_path / "model", "llama"))
    monkeypatch.chdir(tmp_path)
    argv = ["--model", model, "--max-num-seqs", "8", "--no-overlap", "--step-timeout-s", "5"]
    argv += ["--tokenizers", "2", "--api-key", "sekret", "--max-n", "4", "--max-model-len", "64"]
    argv += ["--profile-dir", "prof", "--no-enable-prefix-caching", "--served-model-name", "m"]
    kids = _children(argv)
    assert set(kids) == {"worker", "scheduler", "tokenizer-0", "tokenizer-1", "api"}
    for name, cmd in kids.items():
        assert cmd[1:3] == ["-P", "-m"] and cmd[4] == "--config-json" and len(cmd) == 6, name
        assert "sekret" not in " ".join(cmd)  # argv is world-readable: the key goes by env
    worker = from_json(EngineConfig, kids["worker"][5])
    assert worker.max_num_seqs == 8 and not worker.enable_prefix_caching
    assert worker.max_model_len == 64 and worker.profile_dir == str(tmp_path / "prof")
    scheduler = from_json(SchedulerServiceConfig, kids["scheduler"][5])
    assert scheduler.engine == worker and scheduler.no_overlap and scheduler.step_timeout_s == 5
    tokenizer = from_json(TokenizerConfig, kids["tokenizer-1"][5])
    assert (tokenizer.model, tokenizer.id, tokenizer.max_model_len) == (model, "tok-1", 64)
    monkeypatch.setenv("STOKER_API_KEY", "sekret")
    api = from_json(ApiConfig, kids["api"][5])
    assert (api.num_tokenizers, api.step_timeout_s, api.limits.max_n) == (2, 5.0, 4)
    assert api.api_key == "sekret" and api.served_model_name == "m"
    assert api.profile_dir == worker.profile_dir


def test_serve_flags_match_the_services_run_alone(tmp_path):
    """The same flags given to a service alone (compose, k8s) give the config serve hands it."""
    from tests.factory import make_model

    model = str(make_model(tmp_path / "model", "llama"))
    argv = ["--model", model, "--max-num-seqs", "8", "--speculative", "ngram"]
    parser = argparse.ArgumentParser()
    add_flags(parser, SchedulerServiceConfig)
    alone = from_args(SchedulerServiceConfig, parser.parse_args([*argv, "--no-overlap"]))
    kids = _children([*argv, "--no-overlap"])
    assert from_json(SchedulerServiceConfig, kids["scheduler"][5]) == alone


def test_a_bad_engine_flag_stops_serve_before_anything_starts(tmp_path):
    cmd = [sys.executable, "-m", "stoker.cli", "serve", "--max-num-seqs", "0"]
    cmd += ["--run-dir", str(tmp_path / "run")]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "max_num_seqs must be positive" in out.stderr
    assert not (tmp_path / "run").exists()  # nothing was started
