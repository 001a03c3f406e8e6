"""`stoker replay LOG_DIR --base-url URL`: re-send the greedy requests of a `--log-requests` log
by token id and report every one whose output ids differ from the logged ones.

Each replayable record (temperature 0 or top_k 1, prompt ids known, finished with "stop" or
"length") becomes one /v1/completions call with the logged prompt ids and the logged settings
that shape a greedy output (max_tokens, stop strings and ids, ignore_eos, penalties,
logit_bias), with `logprobs: 0` and `return_tokens_as_token_ids` so the server names every
output token by id. Aborted, failed and sampled choices are skipped and counted.

A record that ended on a stop string is compared on the ids both runs have: the engine cuts the
ids at the step the stop string completed in, and a step may hold several tokens (speculation),
so the ids after the stop string's last token may differ in number between runs.
Exit status: 0 when every replayed record matches, 1 when any differs or fails, 2 when the log
holds no replayable record.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import sys
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx

# The settings that change a greedy output; temperature is forced to 0.
_GREEDY_SHAPING = (
    "max_tokens",
    "stop",
    "stop_token_ids",
    "ignore_eos",
    "include_stop_str_in_output",
    "skip_special_tokens",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "logit_bias",
    "top_k",
)


def read_records(log_dir: str | Path) -> Iterator[dict[str, Any]]:
    """Every record in the log's files, oldest file first; a torn last line is skipped."""
    for path in sorted(Path(log_dir).glob("requests-*.jsonl")):
        for line in path.read_text().splitlines():
            try:
                yield json.loads(line)
            except json.JSONDecodeError:
                continue


def skip_reason(rec: dict[str, Any]) -> str | None:
    """Why a record cannot be replayed as a check, or None when it can."""
    params = rec.get("sampling_params") or {}
    if rec.get("error"):
        return "failed"
    if rec.get("finish_reason") not in ("stop", "length"):
        return "not finished (aborted)"
    if not (params.get("temperature", 1.0) < 1e-5 or params.get("top_k") == 1):
        return "not greedy"
    if not rec.get("prompt_token_ids"):
        return "no prompt ids"
    return None


def request_body(rec: dict[str, Any], model: str | None = None) -> dict[str, Any]:
    params = rec["sampling_params"]
    body: dict[str, Any] = {k: params[k] for k in _GREEDY_SHAPING if params.get(k) is not None}
    if params.get("top_k", 0) in (0, -1):
        body.pop("top_k", None)
    if params.get("max_tokens") is None:
        body["max_tokens"] = None  # up to the context length, as logged (not the default 16)
    if body.get("logit_bias"):
        body["logit_bias"] = {str(k): v for k, v in body["logit_bias"].items()}
    body |= {
        "prompt": rec["prompt_token_ids"],
        "temperature": 0.0,
        "logprobs": 0,
        "return_tokens_as_token_ids": True,
    }
    if model is not None:
        body["model"] = model
    return body


def output_ids(response: dict[str, Any]) -> list[int]:
    """The output ids of a one-choice completion asked with return_tokens_as_token_ids."""
    tokens = response["choices"][0]["logprobs"]["tokens"]
    out = []
    for t in tokens:
        if not t.startswith("token_id:"):
            raise ValueError(f"the server does not name tokens by id (got {t!r})")
        out.append(int(t.removeprefix("token_id:")))
    return out


@dataclasses.dataclass
class Outcome:
    request_id: str
    choice_index: int
    expected: list[int]
    got: list[int] | None = None
    error: str | None = None
    prefix_ok: bool = False  # stop-string records: agreeing on the shared ids is a match

    @property
    def diverges_at(self) -> int | None:
        """First position where the ids differ (None: they agree)."""
        if self.got is None:
            return 0
        n = min(len(self.expected), len(self.got))
        for i in range(n):
            if self.expected[i] != self.got[i]:
                return i
        return None if self.prefix_ok or len(self.expected) == len(self.got) else n

    @property
    def ok(self) -> bool:
        return self.error is None and self.diverges_at is None


def compare(rec: dict[str, Any], got: list[int]) -> Outcome:
    stop_string = rec["finish_reason"] == "stop" and bool(rec["sampling_params"].get("stop"))
    return Outcome(
        rec["request_id"], rec["choice_index"], rec["output_token_ids"], got, prefix_ok=stop_string
    )


async def replay(
    records: list[dict[str, Any]],
    base_url: str,
    concurrency: int = 4,
    api_key: str | None = None,
    model: str | None = None,
    timeout_s: float = 120.0,
) -> list[Outcome]:
    url = base_url.rstrip("/")
    url = url if url.endswith("/v1") else f"{url}/v1"
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    gate = asyncio.Semaphore(concurrency)

    async def one(client: httpx.AsyncClient, rec: dict[str, Any]) -> Outcome:
        async with gate:
            try:
                resp = await client.post(f"{url}/completions", json=request_body(rec, model))
                if resp.status_code != 200:
                    raise ValueError(f"HTTP {resp.status_code}: {resp.text[:200]}")
                return compare(rec, output_ids(resp.json()))
            except (httpx.HTTPError, ValueError, KeyError) as e:
                return Outcome(
                    rec["request_id"], rec["choice_index"], rec["output_token_ids"], error=str(e)
                )

    async with httpx.AsyncClient(headers=headers, timeout=timeout_s) as client:
        return await asyncio.gather(*(one(client, r) for r in records))


def _describe(o: Outcome) -> str:
    where = f"{o.request_id} choice {o.choice_index}"
    if o.error is not None:
        return f"FAIL {where}: {o.error}"
    i = o.diverges_at or 0
    assert o.got is not None
    return (
        f"DIFF {where}: first differs at output position {i} of {len(o.expected)} "
        f"(logged {o.expected[i : i + 8]}, replayed {o.got[i : i + 8]})"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="stoker replay", description=__doc__.split("\n\n")[0])
    parser.add_argument("log_dir", help="a --log-requests directory")
    parser.add_argument("--base-url", required=True, help="the server, e.g. http://HOST:8000")
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--limit", type=int, default=None, help="replay at most this many")
    parser.add_argument("--model", default=None, help="model name to send (default: none)")
    parser.add_argument("--api-key", default=os.environ.get("STOKER_API_KEY"))
    parser.add_argument("--json", default=None, metavar="OUT", help="write the outcomes here")
    args = parser.parse_args(argv)

    records, skipped = [], Counter[str]()
    for rec in read_records(args.log_dir):
        reason = skip_reason(rec)
        if reason is None:
            records.append(rec)
        else:
            skipped[reason] += 1
    records = records[: args.limit] if args.limit is not None else records
    skips = ", ".join(f"{n} {why}" for why, n in sorted(skipped.items())) or "none"
    if not records:
        print(f"stoker replay: no replayable records in {args.log_dir} (skipped: {skips})")
        return 2
    outcomes = asyncio.run(
        replay(records, args.base_url, args.concurrency, args.api_key, args.model)
    )
    bad = [o for o in outcomes if not o.ok]
    for o in bad:
        print(_describe(o))
    failed = sum(o.error is not None for o in bad)
    print(
        f"stoker replay: {len(outcomes)} replayed, {len(bad) - failed} differ, "
        f"{failed} failed; skipped: {skips}"
    )
    if args.json:
        out = [dataclasses.asdict(o) | {"diverges_at": o.diverges_at} for o in outcomes]
        Path(args.json).write_text(json.dumps(out))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
