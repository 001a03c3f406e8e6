"""msgspec (msgpack) versus alternatives for stoker's hot messages, at batch 256.

.venv/bin/python benchmarks/ipc_codec.py
"""

from __future__ import annotations

import json
import pickle
import time

import msgspec
from bench_utils import write_result

from stoker.common.messages import (
    RequestTokens,
    RunningRequestData,
    StepPlan,
    StepResult,
    TextBatch,
    TextDelta,
    TokenBatch,
    pack_ids,
)

BATCH = 256


def messages() -> dict[str, object]:
    ids = [f"cmpl-{i:08x}-0" for i in range(BATCH)]
    plan = StepPlan(
        step_id=1234,
        new_requests=[],
        running=RunningRequestData(
            req_ids=ids, num_scheduled_tokens=[1] * BATCH, new_block_ids=[[]] * BATCH
        ),
        finished_req_ids=[],
    )
    result = StepResult(step_id=1234, req_ids=ids, token_ids=pack_ids(range(1000, 1000 + BATCH)))
    # A decode step's tokens as the scheduler sends them (steady columns), and as items.
    tokens = TokenBatch([], ids, pack_ids(range(1000, 1000 + BATCH)))
    items = TokenBatch([RequestTokens(i, pack_ids([1000 + n])) for n, i in enumerate(ids)])
    text = TextBatch("tok-0", [], ids, [" word"] * BATCH, tokens.steady_token_ids)
    text_items = TextBatch(
        "tok-0", [TextDelta(i, " word", t.token_ids) for i, t in zip(ids, items.items)]
    )
    return {
        "StepPlan": plan,
        "StepResult": result,
        "TokenBatch (columns)": tokens,
        "TokenBatch (items)": items,
        "TextBatch (columns)": text,
        "TextBatch (items)": text_items,
    }


def timeit(fn, n: int = 2000) -> float:
    fn()
    start = time.perf_counter()
    for _ in range(n):
        fn()
    return (time.perf_counter() - start) / n * 1e6


def codecs_for(msg: object) -> dict:
    typ = type(msg)
    mp_enc, mp_dec = msgspec.msgpack.Encoder(), msgspec.msgpack.Decoder(typ)
    js_enc, js_dec = msgspec.json.Encoder(), msgspec.json.Decoder(typ)
    as_builtins = msgspec.to_builtins(msg)
    return {
        "msgspec-msgpack": (lambda: mp_enc.encode(msg), mp_dec.decode),
        "msgspec-json": (lambda: js_enc.encode(msg), js_dec.decode),
        "pickle (not used: unsafe)": (lambda: pickle.dumps(msg, 5), pickle.loads),
        "stdlib json (builtins)": (lambda: json.dumps(as_builtins).encode(), json.loads),
    }


def main() -> None:
    out: dict = {}
    for name, msg in messages().items():
        for codec, (encode, decode) in codecs_for(msg).items():
            data = encode()
            row = {
                "bytes": len(data),
                "encode_us": round(timeit(encode), 1),
                "decode_us": round(timeit(lambda d=data, dec=decode: dec(d)), 1),
            }
            out[f"{name}/{codec}"] = row
            print(f"{name:20s} {codec:26s} {row}")
    print("wrote", write_result("ipc_codec", out))


if __name__ == "__main__":
    main()
