"""The request log's sans-IO parts: the record built from deltas, and the rotating writer."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import msgspec

from stoker.common.messages import ChatMessage, TextDelta, TokenizeRequest, pack_ids
from stoker.common.sampling_params import SamplingParams
from stoker.services.api.request_log import ChoiceLog, RequestLog, RotatingWriter, build_record


def _request(prompt: str | None = "hi", **params) -> TokenizeRequest:
    return TokenizeRequest(
        "cmpl-abc-1", SamplingParams(**params), prompt=prompt, arrival_time=1234.5
    )


def test_record_from_deltas() -> None:
    c = ChoiceLog.start(_request(temperature=0.0, max_tokens=4, stop=["x"]), with_text=False)
    c.add(
        TextDelta(
            "cmpl-abc-1",
            "a",
            pack_ids([7]),
            num_prompt_tokens=3,
            num_cached_tokens=2,
            queue_s=0.25,
            prompt_token_ids=pack_ids([1, 2, 3]),
        )
    )
    c.add(TextDelta("cmpl-abc-1", "b", pack_ids([8, 9]), num_draft_tokens=3, num_accepted_tokens=1))
    c.add(TextDelta("cmpl-abc-1", "", pack_ids([2]), finish_reason="stop"))
    c.tokenizer_id, c.ttft_s, c.e2e_s = "tok-0-1", 0.5, 0.75
    r = build_record(c, "tiny")
    assert (r.request_id, r.choice_index, r.model, r.tokenizer_id) == (
        "cmpl-abc",
        1,
        "tiny",
        "tok-0-1",
    )
    assert r.prompt_token_ids == [1, 2, 3]
    assert r.output_token_ids == [7, 8, 9, 2]  # the stop token id too
    assert r.finish_reason == "stop"
    assert (r.queue_s, r.ttft_s, r.e2e_s, r.arrival_time) == (0.25, 0.5, 0.75, 1234.5)
    assert (r.num_cached_tokens, r.num_draft_tokens, r.num_accepted_tokens) == (2, 3, 1)
    assert r.sampling_params["temperature"] == 0.0 and r.sampling_params["stop"] == ["x"]
    assert "n" not in r.sampling_params
    assert r.prompt is None and r.output_text is None and r.messages is None
    line = json.loads(msgspec.json.encode(r))
    assert line["output_token_ids"] == [7, 8, 9, 2] and line["prompt"] is None


def test_record_with_text_and_chat_messages() -> None:
    req = TokenizeRequest(
        "chatcmpl-q-0",
        SamplingParams(),
        messages=[ChatMessage("user", "hello")],
        arrival_time=1.0,
    )
    c = ChoiceLog.start(req, with_text=True)
    c.add(TextDelta("chatcmpl-q-0", "he", pack_ids([5])))
    c.add(TextDelta("chatcmpl-q-0", "y", pack_ids([6]), finish_reason="length"))
    r = build_record(c, "m")
    assert r.request_id == "chatcmpl-q" and r.choice_index == 0
    assert r.messages == [ChatMessage("user", "hello")] and r.prompt is None
    assert r.output_text == "hey"


def test_aborted_and_failed_choices() -> None:
    c = ChoiceLog.start(_request(), with_text=False)
    c.add(TextDelta("cmpl-abc-1", "a", pack_ids([4])))
    r = build_record(c, "m")  # released while running: the client went away
    assert r.finish_reason == "abort" and r.output_token_ids == [4] and r.error is None
    assert r.prompt_token_ids is None  # the first delta did not carry them in this test

    c = ChoiceLog.start(_request(), with_text=False)
    c.add(TextDelta("cmpl-abc-1", "", b"", finish_reason="abort", error="engine lost"))
    r = build_record(c, "m")
    assert (r.finish_reason, r.error, r.output_token_ids, r.queue_s) == (
        "abort",
        "engine lost",
        [],
        None,
    )


def test_request_log_asks_tokenizer_for_prompt_ids(tmp_path: Path) -> None:
    log = RequestLog(tmp_path, "m")
    req = _request()
    log.start(req)
    assert req.return_prompt_ids
    log.close()


def _wait(pred, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < deadline
        time.sleep(0.01)


def test_writer_rotates_and_keeps_newest(tmp_path: Path) -> None:
    w: RotatingWriter[int] = RotatingWriter(
        tmp_path, lambda i: b'{"i":%d,"pad":"%s"}' % (i, b"x" * 80), max_bytes=1000, max_files=3
    )
    for i in range(100):
        assert w.submit(i)
    w.close()
    files = w.files()
    last = int(files[-1].name[9:15])
    assert last > 3  # it rotated, and deleted the oldest
    assert [f.name for f in files] == [f"requests-{n:06d}.jsonl" for n in range(last - 2, last + 1)]
    lines = [json.loads(x) for f in files for x in f.read_text().splitlines()]
    assert all(f.stat().st_size <= 1000 for f in files)
    # The newest records survive, in order, none torn.
    assert [x["i"] for x in lines] == list(range(100 - len(lines), 100))
    assert w.written == 100 and w.dropped == 0 and w.failed == 0


def test_writer_continues_after_existing_files(tmp_path: Path) -> None:
    (tmp_path / "requests-000007.jsonl").write_text('{"old":1}\n')
    w: RotatingWriter[int] = RotatingWriter(tmp_path, lambda i: b"%d" % i)
    w.submit(1)
    w.close()
    assert [f.name for f in w.files()] == ["requests-000007.jsonl", "requests-000008.jsonl"]
    assert (tmp_path / "requests-000007.jsonl").read_text() == '{"old":1}\n'


def test_writer_drops_and_counts_instead_of_blocking(tmp_path: Path) -> None:
    gate = threading.Event()

    def slow(i: int) -> bytes:  # a disk that has stalled
        gate.wait()
        return b"%d" % i

    w: RotatingWriter[int] = RotatingWriter(tmp_path, slow, queue_size=4)
    t0 = time.perf_counter()
    accepted = [w.submit(i) for i in range(50)]
    assert time.perf_counter() - t0 < 0.5  # never waited on the writer
    assert w.dropped == accepted.count(False) >= 45
    gate.set()
    w.close()
    assert w.written == accepted.count(True)


def test_writer_counts_failed_records(tmp_path: Path) -> None:
    def encode(i: int) -> bytes:
        if i == 1:
            raise ValueError("bad record")
        return b"%d" % i

    w: RotatingWriter[int] = RotatingWriter(tmp_path, encode)
    for i in range(3):
        w.submit(i)
    w.close()
    assert (w.written, w.failed) == (2, 1)
    assert w.files()[0].read_text().splitlines() == ["0", "2"]


def test_writer_flushes_when_idle(tmp_path: Path) -> None:
    w: RotatingWriter[int] = RotatingWriter(tmp_path, lambda i: b"%d" % i)
    w.submit(5)
    _wait(lambda: bool(w.files()) and w.files()[0].read_text() == "5\n")
    w.close()


def test_scheduler_counts_drafts_per_request() -> None:
    from stoker.services.scheduler.request import Request
    from stoker.services.scheduler.speculation import SpecPolicy

    policy = SpecPolicy("ngram", 3)
    a = Request("a", [1, 2, 3], SamplingParams(), 8, (0,))
    b = Request("b", [1, 2, 3], SamplingParams(), 8, (0,))
    policy.on_result(a, 3, 2)
    policy.on_result(a, 2, 0)
    policy.on_result(b, 3, 3)
    assert (a.num_draft_tokens, a.num_accepted_tokens) == (5, 2)
    assert (b.num_draft_tokens, b.num_accepted_tokens) == (3, 3)
    assert (policy.stats.draft_tokens, policy.stats.accepted_tokens) == (8, 5)
