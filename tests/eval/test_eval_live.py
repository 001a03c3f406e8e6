"""`stoker eval` against real `stoker serve` processes on tiny random-init models: it passes on
a faithful deployment, and fails on one whose tokenizer or chat template differs from the
reference folder's; `--fleet` names the replica that runs different weights."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from stoker.tools.eval.run import main as eval_main
from stoker.tools.eval.sources import GOLDEN, Item, Transformers, load_items
from tests.factory import make_model
from tests.reliability.serve import REPO, Served

KEY = "eval-test-key"


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("eval")


@pytest.fixture(scope="module")
def folder(root) -> Path:
    return make_model(root / "tiny", "llama", seed=0)


def _serve(root: Path, model: Path, name: str, *flags: str):
    server = Served(model, root / f"run-{name}", root / f"{name}.log", "--max-model-len", "256",
                    "--num-kv-blocks", "64", *flags)  # fmt: skip
    return server


@pytest.fixture(scope="module")
def faithful(root, folder):
    server = _serve(root, folder, "faithful")
    yield server
    server.stop()


@pytest.fixture(scope="module")
def prompts(root, folder) -> Path:
    """The shipped golden set, plus a prompt that opens with the BOS text (a doubled BOS where
    the tokenizer also adds one) and one whose stop string the reference's output contains."""
    ref = Transformers(folder)
    out, _ = ref.generate(Item("probe", prompt="Once upon a time"), 12)
    stop = next(c for c in out.text[2:] if not c.isspace())
    lines = GOLDEN.read_text().splitlines()
    lines.append(json.dumps({"id": "plain-bos", "prompt": "<s>To be, or not to be"}))
    lines.append(json.dumps({"id": "plain-stop-hit", "prompt": "Once upon a time", "stop": [stop]}))
    path = root / "prompts.jsonl"
    path.write_text("\n".join(lines) + "\n")
    return path


def _eval(capsys, *argv: str) -> tuple[int, dict, str]:
    out = Path(argv[argv.index("--json") + 1])
    code = eval_main(list(argv))
    return code, json.loads(out.read_text()), capsys.readouterr().out


def test_eval_passes_on_a_faithful_deployment(root, folder, faithful, prompts, capsys):
    code, body, table = _eval(capsys, "--base-url", faithful.url, "--reference", str(folder),
                              "--prompts", str(prompts), "--max-tokens", "8",
                              "--json", str(root / "faithful.json"))  # fmt: skip
    assert code == 0, table
    assert body["passed"] and len(body["prompts"]) == len(load_items(prompts))
    for p in body["prompts"]:
        assert p["tokenization"]["match"] and p["output"]["ids_agree"], p
        assert p["output"]["max_abs_dlogprob"] < 1e-3
    stop = next(p for p in body["prompts"] if p["id"] == "plain-stop-hit")
    assert stop["output"]["finish_server"] == stop["output"]["finish_reference"] == "stop"
    assert "PASS" in table.splitlines()[-1]


def test_cli_states_its_tolerances():
    cmd = [sys.executable, "-m", "stoker.cli", "eval", "--help"]
    done = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0
    assert "--logprob-atol (0.02)" in done.stdout and "--tie-margin" in done.stdout
    usage = subprocess.run([sys.executable, "-m", "stoker.cli"], cwd=REPO, capture_output=True)
    assert b"\n  eval " in usage.stdout


@pytest.mark.slow
def test_eval_fails_on_an_altered_tokenizer(root, folder, prompts, capsys):
    """A copy of the folder whose tokenizer.json adds a BOS to every encoded prompt (the
    classic release bug), served with --api-key."""
    bad = root / "bos-tokenizer"
    shutil.copytree(folder, bad)
    spec = json.loads((bad / "tokenizer.json").read_text())
    bos = {"SpecialToken": {"id": "<s>", "type_id": 0}}
    spec["post_processor"] = {
        "type": "TemplateProcessing",
        "single": [bos, {"Sequence": {"id": "A", "type_id": 0}}],
        "pair": [
            bos,
            {"Sequence": {"id": "A", "type_id": 0}},
            {"Sequence": {"id": "B", "type_id": 1}},
        ],
        "special_tokens": {"<s>": {"id": "<s>", "ids": [1], "tokens": ["<s>"]}},
    }
    (bad / "tokenizer.json").write_text(json.dumps(spec))
    server = _serve(root, bad, "bad-tokenizer", "--api-key", KEY)
    try:
        assert httpx.post(f"{server.url}/tokenize", json={"prompt": "a"}).status_code == 401
        code, body, table = _eval(
            capsys,
            "--base-url",
            server.url,
            "--reference",
            str(folder),
            "--prompts",
            str(prompts),
            "--max-tokens",
            "4",
            "--api-key",
            KEY,
            "--json",
            str(root / "bad-tok.json"),
        )
    finally:
        server.stop()
    assert code == 1 and not body["passed"] and "FAIL" in table.splitlines()[-1]
    by_id = {p["id"]: p for p in body["prompts"]}
    for pid, p in by_id.items():
        if pid.startswith("plain"):  # every plain prompt gained a BOS
            assert p["tokenization"]["first_diff"] == (1 if pid == "plain-bos" else 0), p
            assert any("tokenization differs" in f for f in p["failures"])
    assert by_id["plain-bos"]["tokenization"]["doubled_bos"]
    assert any("doubled BOS" in f for f in by_id["plain-bos"]["failures"])


@pytest.mark.slow
def test_eval_fails_on_an_altered_chat_template(root, folder, prompts, capsys):
    bad = root / "other-template"
    shutil.copytree(folder, bad)
    template = (bad / "chat_template.jinja").read_text()
    (bad / "chat_template.jinja").write_text(template.replace("\\n", ": ").replace("\n", ": "))
    server = _serve(root, bad, "bad-template")
    try:
        code, body, _ = _eval(capsys, "--base-url", server.url, "--reference", str(folder),
                              "--prompts", str(prompts), "--max-tokens", "4",
                              "--json", str(root / "bad-template.json"))  # fmt: skip
    finally:
        server.stop()
    assert code == 1
    for p in body["prompts"]:
        if p["kind"] == "chat":
            assert not p["tokenization"]["match"] and not p["passed"], p
        else:  # plain prompts never touch the template
            assert p["passed"], p


@pytest.mark.slow
def test_fleet_flags_the_replica_with_other_weights(root, folder, faithful, prompts, capsys):
    twin = _serve(root, folder, "twin")
    other = _serve(root, make_model(root / "other-weights", "llama", seed=1), "other")
    try:
        args = ["--prompts", str(prompts), "--max-tokens", "6"]
        code, body, _ = _eval(capsys, "--fleet", faithful.url, twin.url, *args,
                              "--json", str(root / "fleet-ok.json"))  # fmt: skip
        assert code == 0 and body["passed"] and body["odd_ones_out"] == [], body
        code, body, table = _eval(capsys, "--fleet", faithful.url, twin.url, other.url, *args,
                                  "--json", str(root / "fleet-bad.json"))  # fmt: skip
    finally:
        twin.stop()
        other.stop()
    assert code == 1 and body["odd_ones_out"] == [other.url]
    assert f"disagree with the others: {other.url}" in table
    against_other = [p for p in body["prompts"] if p["id"].endswith("@2")]
    assert against_other and all(not p["passed"] for p in against_other)
    assert all(p["passed"] for p in body["prompts"] if p["id"].endswith("@1"))
