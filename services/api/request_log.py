"""Per-request token-ID log (`stoker serve --log-requests DIR`): one JSON line per finished choice.

The api keeps a `ChoiceLog` per sub-request beside its metrics track and feeds it every delta it
dispatches; when the choice ends (finish, error, or the client went away) the log goes to a
`RotatingWriter`. The writer's thread builds the record, encodes it and writes it, so the event
loop only appends byte strings and puts one object on a bounded queue: when the disk cannot keep
up, records are dropped and counted, never waited for. Nothing here runs in the scheduler.

`output_token_ids` are the ids the engine sent for the choice, as generated: a final eos / stop
token id is included, and a stop string cuts only the text, not the ids (ids up to the step in
which the stop string completed). An aborted choice logs the ids that had arrived by then.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import queue
import re
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, Generic, TypeVar

import msgspec
from prometheus_client.core import CounterMetricFamily, Metric
from prometheus_client.registry import Collector

from stoker.common.messages import ChatMessage, TextDelta, TokenizeRequest, unpack_ids
from stoker.common.sampling_params import SamplingParams

log = logging.getLogger("stoker.api.request_log")

DEFAULT_MAX_BYTES = 64 * 1024 * 1024  # per file
DEFAULT_MAX_FILES = 8  # files kept in DIR; the oldest is deleted past it
DEFAULT_QUEUE = 4096  # records waiting for the writer thread before new ones are dropped
FILE_PREFIX = "requests-"
_FILE_RE = re.compile(r"requests-(\d+)\.jsonl$")


class RequestRecord(msgspec.Struct, omit_defaults=False):
    """One line of the log. Times in seconds; arrival_time is Unix time at the api."""

    request_id: str  # the `id` of the API response (cmpl-... / chatcmpl-...)
    choice_index: int
    model: str
    tokenizer_id: str
    prompt_token_ids: list[int] | None  # None: the choice ended before the tokenizer answered
    output_token_ids: list[int]
    finish_reason: str
    sampling_params: dict[str, Any]
    arrival_time: float
    queue_s: float | None  # arrival at the scheduler to first step; None: never scheduled
    ttft_s: float | None  # arrival at the api to the first token; None: no token
    e2e_s: float
    num_cached_tokens: int  # prompt tokens served from the prefix cache
    num_draft_tokens: int  # speculative tokens proposed for this choice
    num_accepted_tokens: int  # of those, accepted
    error: str | None = None
    prompt: str | None = None  # --log-requests-text only
    messages: list[ChatMessage] | None = None  # --log-requests-text only (chat requests)
    output_text: str | None = None  # --log-requests-text only; after stop-string truncation
    # Structured requests only (docs/structured-outputs.md): the tokenizer's compile time (0 on
    # a cache hit), whether the cache answered, and its share of the worker's mask time.
    grammar_compile_s: float | None = None
    grammar_cache_hit: bool | None = None
    grammar_mask_s: float | None = None
    num_forced_tokens: int | None = None  # fast-forwarded tokens accepted


@dataclasses.dataclass
class ChoiceLog:
    """What the api saw of one sub-request (`{request_id}-{choice_index}`), delta by delta."""

    req_id: str
    params: SamplingParams
    arrival_time: float  # wall clock, from the TokenizeRequest
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    with_text: bool = False
    tokenizer_id: str = ""
    prompt_ids: bytes | None = None
    output: list[bytes] = dataclasses.field(default_factory=list)
    text: list[str] = dataclasses.field(default_factory=list)
    queue_s: float | None = None
    num_cached_tokens: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    finish_reason: str | None = None
    error: str | None = None
    ttft_s: float | None = None
    e2e_s: float = 0.0
    grammar_compile_s: float = 0.0
    grammar_cache_hit: bool = False
    grammar_mask_s: float = 0.0
    num_forced_tokens: int = 0

    @classmethod
    def start(cls, req: TokenizeRequest, with_text: bool) -> ChoiceLog:
        return cls(
            req.req_id,
            req.params,
            req.arrival_time,
            prompt=req.prompt if with_text else None,
            messages=req.messages if with_text else None,
            with_text=with_text,
        )

    def add(self, d: TextDelta) -> None:
        if d.prompt_token_ids is not None:
            self.prompt_ids = d.prompt_token_ids
        if d.token_ids:
            if not self.output:
                self.queue_s, self.num_cached_tokens = d.queue_s, d.num_cached_tokens
            self.output.append(d.token_ids)
        if self.with_text and d.text:
            self.text.append(d.text)
        if d.num_draft_tokens:
            self.num_draft_tokens, self.num_accepted_tokens = (
                d.num_draft_tokens,
                d.num_accepted_tokens,
            )
        if d.grammar_compile_s or d.grammar_cache_hit:
            self.grammar_compile_s, self.grammar_cache_hit = (
                d.grammar_compile_s,
                d.grammar_cache_hit,
            )
        if d.grammar_mask_s:
            self.grammar_mask_s = d.grammar_mask_s
        if d.num_forced_tokens:
            self.num_forced_tokens = d.num_forced_tokens
        if d.error is not None and self.error is None:
            self.error = d.error
        if d.finish_reason is not None or d.error is not None:
            self.finish_reason = d.finish_reason or "abort"


def build_record(c: ChoiceLog, model: str) -> RequestRecord:
    """The JSON line for one ended choice (pure: runs on the writer thread)."""
    request_id, _, index = c.req_id.rpartition("-")
    params = msgspec.structs.asdict(c.params)
    params.pop("n", None)  # always 1 per choice: the api fans n out itself
    return RequestRecord(
        request_id=request_id,
        choice_index=int(index),
        model=model,
        tokenizer_id=c.tokenizer_id,
        prompt_token_ids=None if c.prompt_ids is None else unpack_ids(c.prompt_ids),
        output_token_ids=unpack_ids(b"".join(c.output)),
        finish_reason=c.finish_reason or "abort",
        sampling_params=params,
        arrival_time=c.arrival_time,
        queue_s=c.queue_s,
        ttft_s=c.ttft_s,
        e2e_s=c.e2e_s,
        num_cached_tokens=c.num_cached_tokens,
        num_draft_tokens=c.num_draft_tokens,
        num_accepted_tokens=c.num_accepted_tokens,
        error=c.error,
        prompt=c.prompt,
        messages=c.messages,
        output_text="".join(c.text) if c.with_text else None,
        **_grammar_fields(c),
    )


def _grammar_fields(c: ChoiceLog) -> dict[str, Any]:
    if c.params.structured is None:
        return {}
    return {
        "grammar_compile_s": c.grammar_compile_s,
        "grammar_cache_hit": c.grammar_cache_hit,
        "grammar_mask_s": c.grammar_mask_s,
        "num_forced_tokens": c.num_forced_tokens,
    }


T = TypeVar("T")


class RotatingWriter(Generic[T]):
    """Writes `encode(item)` lines to `DIR/requests-NNNNNN.jsonl` on its own thread, starting a
    new file once one reaches max_bytes and keeping the newest max_files. `submit` never blocks:
    past `queue_size` items waiting, new ones are dropped and counted."""

    def __init__(
        self,
        directory: str | Path,
        encode: Callable[[T], bytes],
        max_bytes: int = DEFAULT_MAX_BYTES,
        max_files: int = DEFAULT_MAX_FILES,
        queue_size: int = DEFAULT_QUEUE,
    ) -> None:
        if max_bytes < 1 or max_files < 1:
            raise ValueError("max_bytes and max_files must be at least 1")
        self.dir = Path(directory)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.encode, self.max_bytes, self.max_files = encode, max_bytes, max_files
        # Each counter has one writing thread: dropped the event loop's, the others the writer's.
        self.written = 0  # records on disk (or in the file's buffer)
        self.dropped = 0  # records not taken: the queue was full
        self.failed = 0  # records that could not be encoded or written
        self._queue: queue.Queue[T | None] = queue.Queue(queue_size)
        # Continue after the newest file in DIR: a restart never appends to an old one.
        self._seq = max((_seq_of(p) for p in self.files()), default=0)
        self._file = None
        self._size = 0
        self._thread = threading.Thread(target=self._run, name="request-log", daemon=True)
        self._thread.start()

    def files(self) -> list[Path]:
        """The log's files, oldest first."""
        return sorted(p for p in self.dir.iterdir() if _FILE_RE.fullmatch(p.name))

    def submit(self, item: T) -> bool:
        try:
            self._queue.put_nowait(item)
        except queue.Full:
            self.dropped += 1
            return False
        return True

    def close(self, timeout: float = 5.0) -> None:
        """Write what is queued, then stop the thread."""
        try:
            self._queue.put(None, timeout=timeout)
        except queue.Full:
            log.warning("request log: writer stuck; %d records not written", self._queue.qsize())
            return
        self._thread.join(timeout)

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                break
            try:
                self._write(self.encode(item) + b"\n")
                self.written += 1
            except Exception:
                self.failed += 1
                log.exception("request log: could not write a record")
            if self._queue.empty() and self._file is not None:
                self._file.flush()  # idle: make what was written visible to readers now
        if self._file is not None:
            self._file.close()

    def _write(self, line: bytes) -> None:
        if self._file is None or (self._size and self._size + len(line) > self.max_bytes):
            self._rotate()
        assert self._file is not None
        self._file.write(line)
        self._size += len(line)

    def _rotate(self) -> None:
        if self._file is not None:
            self._file.close()
        while True:  # "x": never append to a file another writer (or an earlier run) owns
            self._seq += 1
            try:
                path = self.dir / f"{FILE_PREFIX}{self._seq:06d}.jsonl"
                self._file = open(path, "xb")  # noqa: SIM115
                break
            except FileExistsError:
                continue
        self._size = 0
        for old in self.files()[: -self.max_files]:
            try:
                os.unlink(old)
            except OSError:
                log.warning("request log: could not delete %s", old)


def _seq_of(path: Path) -> int:
    m = _FILE_RE.fullmatch(path.name)
    return int(m.group(1)) if m else 0


class RequestLog:
    """The api's request log: ChoiceLogs in, JSON lines out, counters for /metrics."""

    def __init__(
        self,
        directory: str | Path,
        model: str,
        with_text: bool = False,
        max_bytes: int = DEFAULT_MAX_BYTES,
        max_files: int = DEFAULT_MAX_FILES,
        queue_size: int = DEFAULT_QUEUE,
    ) -> None:
        self.model, self.with_text = model, with_text
        encoder = msgspec.json.Encoder()
        self.writer: RotatingWriter[ChoiceLog] = RotatingWriter(
            directory,
            lambda c: encoder.encode(build_record(c, model)),
            max_bytes=max_bytes,
            max_files=max_files,
            queue_size=queue_size,
        )

    def start(self, req: TokenizeRequest) -> ChoiceLog:
        req.return_prompt_ids = True
        return ChoiceLog.start(req, self.with_text)

    def finish(self, c: ChoiceLog) -> None:
        self.writer.submit(c)

    def close(self) -> None:
        self.writer.close()

    def collector(self) -> Collector:
        return _LogCollector(self.writer)


class _LogCollector(Collector):
    def __init__(self, writer: RotatingWriter) -> None:
        self._writer = writer

    def collect(self) -> Iterator[Metric]:
        yield CounterMetricFamily(
            "stoker:request_log_records",
            "Records written to the --log-requests log.",
            value=self._writer.written,
        )
        dropped = CounterMetricFamily(
            "stoker:request_log_dropped",
            "Request-log records lost: the writer's queue was full, or a write failed.",
            labels=["reason"],
        )
        dropped.add_metric(["queue_full"], self._writer.dropped)
        dropped.add_metric(["write_error"], self._writer.failed)
        yield dropped
