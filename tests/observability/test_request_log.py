"""`stoker serve --log-requests` over real processes: the log equals what the API answered, and
`stoker replay` re-checks it against the same server and against one with other weights."""

from __future__ import annotations

import json
import os
import shutil
import signal
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest

from stoker.tools import replay
from tests.factory import make_model
from tests.reliability.serve import Served

FLAGS = ["--num-kv-blocks", "256", "--max-model-len", "256", "--tokenizers", "2"]


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> tuple[Path, Path]:
    tmp = tmp_path_factory.mktemp("obs-models")
    # Same architecture and tokenizer; other weights (seed): the replay must notice.
    return make_model(tmp / "a", "llama"), make_model(tmp / "b", "llama", seed=1)


@pytest.fixture(scope="module")
def served(models, tmp_path_factory):
    """A: ids only, n-gram speculation. B: other weights, text on, tiny files (rotation)."""
    tmp = tmp_path_factory.mktemp("obs")
    a = Served(models[0], tmp / "run-a", tmp / "a.log", *FLAGS, "--speculative", "ngram",
               "--log-requests", str(tmp / "log-a"))  # fmt: skip
    try:
        b = Served(models[1], tmp / "run-b", tmp / "b.log", *FLAGS, "--log-requests",
                   str(tmp / "log-b"), "--log-requests-text", "--log-requests-max-bytes", "3000",
                   "--log-requests-max-files", "3")  # fmt: skip
    except BaseException:
        a.stop()
        raise
    yield (a, tmp / "log-a"), (b, tmp / "log-b")
    for s in (a, b):
        s.wait_blocks_free()
        s.stop()


def _post(url: str, path: str, body: dict[str, Any]) -> dict[str, Any]:
    resp = httpx.post(f"{url}{path}", json=body, timeout=60)
    assert resp.status_code == 200, resp.text
    return resp.json()


def _ids(logprobs: dict[str, Any] | None, chat: bool) -> list[int]:
    if not logprobs:
        return []
    tokens = [t["token"] for t in logprobs["content"]] if chat else logprobs["tokens"]
    return [int(t.removeprefix("token_id:")) for t in tokens]


def _stream(url: str, path: str, body: dict[str, Any]) -> tuple[str, dict[int, list[int]]]:
    """The response id and each choice's output ids, from an SSE stream."""
    chat = "chat" in path
    rid, ids = "", {}
    with httpx.stream("POST", f"{url}{path}", json={**body, "stream": True}, timeout=60) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            rid = chunk["id"]
            for c in chunk["choices"]:
                ids.setdefault(c["index"], []).extend(_ids(c.get("logprobs"), chat))
    return rid, ids


def _whole(url: str, path: str, body: dict[str, Any]) -> tuple[str, dict[int, list[int]]]:
    out = _post(url, path, body)
    chat = "chat" in path
    return out["id"], {c["index"]: _ids(c["logprobs"], chat) for c in out["choices"]}


def _records(
    log_dir: Path, want: set[str] | dict[str, int], timeout: float = 10.0
) -> dict[tuple[str, int], dict]:
    """The log's records for these response ids (id -> number of choices; a set: one each),
    once all of them have landed."""
    counts = want if isinstance(want, dict) else dict.fromkeys(want, 1)
    deadline = time.monotonic() + timeout
    while True:
        recs = {
            (r["request_id"], r["choice_index"]): r
            for r in replay.read_records(log_dir)
            if r["request_id"] in counts
        }
        if len(recs) == sum(counts.values()):
            return recs
        assert time.monotonic() < deadline, f"{len(recs)} of {sum(counts.values())} records"
        time.sleep(0.05)


COMPLETION = {"max_tokens": 8, "temperature": 0, "logprobs": 0, "return_tokens_as_token_ids": True}
CHAT = {"max_tokens": 8, "temperature": 0, "logprobs": True, "return_tokens_as_token_ids": True}


def test_log_equals_responses_mixed_streams_and_n(served) -> None:
    (a, log_dir), _ = served
    calls = []
    for i in range(6):
        stream = i % 2 == 0
        n = 1 + i % 3
        if i % 3 == 2:
            msgs = [{"role": "user", "content": f"hello {i}"}]
            calls.append((stream, "/v1/chat/completions", {**CHAT, "messages": msgs, "n": n}))
        else:
            body = {**COMPLETION, "prompt": f"count {i} to ten", "n": n}
            if i == 3:
                body["temperature"], body["seed"] = 0.9, 7  # sampled: logged, not replayable
            calls.append((stream, "/v1/completions", body))
    with ThreadPoolExecutor(6) as pool:
        futures = [
            pool.submit(_stream if stream else _whole, a.url, path, body)
            for stream, path, body in calls
        ]
        results = [f.result() for f in futures]
    recs = _records(log_dir, {rid: body["n"] for (rid, _), (_, _, body) in zip(results, calls)})
    model = a.state()["scheduler"]["model_name"]
    for (rid, choices), (_, path, body) in zip(results, calls):
        assert rid.startswith("chatcmpl-" if "chat" in path else "cmpl-")
        assert sorted(choices) == list(range(body["n"]))
        for index, ids in choices.items():
            rec = recs[(rid, index)]
            assert rec["output_token_ids"] == ids and len(ids) == 8
            assert rec["finish_reason"] == "length"
            assert rec["model"] == model
            assert rec["tokenizer_id"].startswith("tok-")
            assert rec["sampling_params"]["temperature"] == body["temperature"]
            assert rec["prompt_token_ids"]
            assert 0 <= rec["queue_s"] <= rec["ttft_s"] <= rec["e2e_s"] < 60
            assert abs(rec["arrival_time"] - time.time()) < 120
            assert rec["prompt"] is None and rec["messages"] is None  # no --log-requests-text
            assert rec["output_text"] is None
            assert 0 <= rec["num_accepted_tokens"] <= rec["num_draft_tokens"]
    # Chat prompts are logged as the template rendered them: what /tokenize returns.
    for (rid, _), (_, path, body) in zip(results, calls):
        if "chat" in path:
            tok = _post(a.url, "/tokenize", {"messages": body["messages"]})
            assert recs[(rid, 0)]["prompt_token_ids"] == tok["tokens"]


def test_prompt_ids_are_what_the_model_consumed(served) -> None:
    (a, log_dir), _ = served
    text_id, text_out = _whole(a.url, "/v1/completions", {**COMPLETION, "prompt": "once upon"})
    logged = _records(log_dir, {text_id})[(text_id, 0)]["prompt_token_ids"]
    # The logged ids, sent as a token prompt, give the same output: they are the prompt.
    ids_id, ids_out = _whole(a.url, "/v1/completions", {**COMPLETION, "prompt": logged})
    assert ids_out == text_out
    assert _records(log_dir, {ids_id})[(ids_id, 0)]["prompt_token_ids"] == logged


def test_stop_string_logs_ids_before_text_truncation(served) -> None:
    (a, log_dir), _ = served
    body = {**COMPLETION, "prompt": [5, 6, 7, 8], "max_tokens": 24}
    full = _post(a.url, "/v1/completions", {**body, "logprobs": None})["choices"][0]["text"]
    # A stop string from the middle of the greedy output (printable, so it survives decoding).
    k = next(i for i in range(4, len(full) - 1) if full[i : i + 2].isprintable())
    stop = full[k : k + 2]
    for fetch in (_whole, _stream):
        rid, ids = fetch(a.url, "/v1/completions", {**body, "stop": [stop]})
        rec = _records(log_dir, {rid})[(rid, 0)]
        assert rec["finish_reason"] == "stop" and rec["sampling_params"]["stop"] == [stop]
        assert rec["output_token_ids"] == ids[0]
        assert 0 < len(ids[0]) < 24


def test_aborted_stream_logs_what_arrived(served) -> None:
    (a, log_dir), _ = served
    body = {**COMPLETION, "prompt": [9, 10, 11], "max_tokens": 200, "ignore_eos": True}
    seen: list[int] = []
    (worker,) = a.child("worker")
    try:
        with httpx.stream("POST", f"{a.url}/v1/completions", json={**body, "stream": True}) as r:
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    chunk = json.loads(line[6:])
                    rid = chunk["id"]
                    seen += _ids(chunk["choices"][0]["logprobs"], chat=False)
                    if len(seen) >= 3:
                        # Frozen, the worker finishes no more steps: with n-gram drafts the 200
                        # tokens can take 0.1 s, and a final delta dispatched before the api saw
                        # the disconnect would be logged as "length".
                        os.kill(worker, signal.SIGSTOP)
                        break  # the client goes away mid-stream
        rec = _records(log_dir, {rid})[(rid, 0)]
    finally:
        os.kill(worker, signal.SIGCONT)
    assert rec["finish_reason"] == "abort" and rec["error"] is None
    logged = rec["output_token_ids"]
    assert logged[: len(seen)] == seen and len(logged) < 200
    # Greedy: what it produced before the abort is the start of the uninterrupted output.
    _, full = _whole(a.url, "/v1/completions", {**body, "max_tokens": len(logged)})
    assert full[0] == logged
    assert a.wait_blocks_free()["num_free_blocks"] == a.wait_blocks_free()["num_total_blocks"]


def _spec_counters(url: str) -> tuple[float, float]:
    values = {}
    for line in httpx.get(f"{url}/metrics").text.splitlines():
        name, _, value = line.partition(" ")
        values[name] = value
    return (
        float(values["stoker:spec_decode_num_draft_tokens_total"]),
        float(values["stoker:spec_decode_num_accepted_tokens_total"]),
    )


def test_draft_counts_add_up_to_the_engine_totals(served) -> None:
    (a, log_dir), _ = served
    a.wait_blocks_free()
    before = _spec_counters(a.url)
    prompt = [3, 4, 5, 6, 3, 4, 5, 6, 3, 4, 5, 6, 3, 4]  # repetitive: n-gram drafts get proposed

    def call(i: int) -> tuple[str, dict[int, list[int]]]:
        body = {**COMPLETION, "prompt": prompt[i:], "max_tokens": 24}
        return _whole(a.url, "/v1/completions", body)

    with ThreadPoolExecutor(3) as pool:
        results = list(pool.map(call, range(3)))
    recs = _records(log_dir, {rid for rid, _ in results})
    a.wait_blocks_free()
    time.sleep(0.3)  # the scheduler's stats after the engine went idle
    after = _spec_counters(a.url)
    drafts = sum(r["num_draft_tokens"] for r in recs.values())
    accepted = sum(r["num_accepted_tokens"] for r in recs.values())
    assert drafts == after[0] - before[0] > 0
    assert accepted == after[1] - before[1]


def test_prefix_cache_hits_are_logged(served) -> None:
    (a, log_dir), _ = served
    prompt = list(range(20, 60))  # 40 tokens: two full 16-token blocks to share
    first, _ = _whole(a.url, "/v1/completions", {**COMPLETION, "prompt": prompt})
    second, _ = _whole(a.url, "/v1/completions", {**COMPLETION, "prompt": prompt})
    recs = _records(log_dir, {first, second})
    assert recs[(first, 0)]["num_cached_tokens"] == 0
    assert recs[(second, 0)]["num_cached_tokens"] == 32


def test_text_logged_only_with_the_flag_and_files_rotate(served) -> None:
    _, (b, log_dir) = served
    rids = []
    for i in range(30):
        rid, _ = _whole(b.url, "/v1/completions", {**COMPLETION, "prompt": f"line {i}"})
        rids.append(rid)
    msgs = [{"role": "user", "content": "hi there"}]
    chat = _post(b.url, "/v1/chat/completions", {**CHAT, "messages": msgs, "logprobs": False})
    # The writer thread opens a new file, deletes the oldest, then writes: once the last records
    # are visible, the rotations before them are complete (read before that, a loaded box saw a
    # fourth file not yet deleted).
    recs = _records(log_dir, {rids[-1], chat["id"]})
    files = sorted(log_dir.glob("requests-*.jsonl"))
    assert len(files) == 3 and files[0].name != "requests-000001.jsonl"  # rotated, oldest gone
    assert all(f.stat().st_size <= 3000 for f in files)
    last = recs[(rids[-1], 0)]
    assert last["prompt"] == "line 29" and last["output_text"]
    chat_rec = recs[(chat["id"], 0)]
    # ChatMessage, array-like: role, content, then name, tool_call_id and tool_calls (JSON
    # text) for tool conversations, null otherwise.
    assert chat_rec["messages"] == [["user", "hi there", None, None, None]]
    assert chat_rec["output_text"] == chat["choices"][0]["message"]["content"]


def test_replay_same_server_agrees_other_weights_differ(served, tmp_path) -> None:
    (a, log_a), (b, _) = served
    r1, _ = _whole(a.url, "/v1/completions", {**COMPLETION, "prompt": "replay me", "n": 2})
    body = {**COMPLETION, "prompt": [7, 8, 9], "stop_token_ids": [1]}
    r2, _ = _whole(a.url, "/v1/completions", body)
    _records(log_a, {r1: 2, r2: 1})
    # A snapshot: replaying against A adds the replayed requests to A's own log.
    log_a = Path(shutil.copytree(log_a, tmp_path / "log"))
    assert replay.main([str(log_a), "--base-url", a.url, "--json", str(tmp_path / "a.json")]) == 0
    same = json.loads((tmp_path / "a.json").read_text())
    assert len(same) >= 3 and all(o["diverges_at"] is None for o in same)
    assert replay.main([str(log_a), "--base-url", b.url, "--json", str(tmp_path / "b.json")]) == 1
    other = json.loads((tmp_path / "b.json").read_text())
    assert len(other) == len(same) and sum(o["diverges_at"] is not None for o in other) > 0
    assert replay.main([str(tmp_path), "--base-url", a.url]) == 2  # no log there


def test_blocks_all_free_after(served) -> None:
    for server, _ in served:
        s = server.wait_blocks_free()
        assert s["num_free_blocks"] == s["num_total_blocks"]
        metrics = httpx.get(f"{server.url}/metrics").text
        assert "stoker:request_log_records_total" in metrics
        assert 'stoker:request_log_dropped_total{reason="queue_full"} 0.0' in metrics
