"""Structured outputs against the same server unconstrained, in one run.

    .venv/bin/python benchmarks/structured_outputs.py smollm2 --streams 32   # ITL, tok/s ratios
    .venv/bin/python benchmarks/structured_outputs.py null --streams 256    # host cost per token
    .venv/bin/python benchmarks/structured_outputs.py fast-forward          # passes saved
    .venv/bin/python benchmarks/structured_outputs.py speculation --streams 1  # n-gram on JSON
    .venv/bin/python benchmarks/structured_outputs.py compile-stall         # others' ITL p99

See docs/structured-outputs.md. Every structured request carries a JSON schema (vLLM's
`structured_outputs.json`) whose `minItems` makes the answer longer than max_tokens, so
constrained and unconstrained requests generate the same number of tokens and every
constrained token is under the grammar. Requests
alternate between the two modes run by run (unconstrained, structured, unconstrained, ...),
against one server, and the figures compare the medians.
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import threading
import time

import httpx
from bench_utils import write_result
from serving import Server, bench, histogram_quantile, metric_sum, process_cpu_seconds

from stoker.common.model_registry import resolve_model

# A realistic schema (a recipe, as pydantic writes one), long enough to fill max_tokens: at
# least 40 steps. `--bounded-strings` adds maxLength to its strings: llguidance then leaves its
# fast path for string content, and a mask costs about 15x more (docs/structured-outputs.md).
SCHEMA = {
    "type": "object",
    "properties": {
        "title": {"type": "string"},
        "servings": {"type": "integer", "minimum": 1, "maximum": 20},
        "steps": {
            "type": "array",
            "minItems": 40,
            "items": {
                "type": "object",
                "properties": {
                    "n": {"type": "integer"},
                    "text": {"type": "string"},
                    "minutes": {"type": "number"},
                },
                "required": ["n", "text", "minutes"],
                "additionalProperties": False,
            },
        },
    },
    "required": ["title", "servings", "steps"],
    "additionalProperties": False,
}


BOUNDED = False  # --bounded-strings
# A forced call of a tool whose arguments are the recipe (docs/tool-calling.md).
TOOL_CALL = {
    "tools": [
        {"type": "function", "function": {"name": "save_recipe", "parameters": SCHEMA}},
    ],
    "tool_choice": "required",
}


def _structured(compact: bool = False) -> str:
    schema = copy.deepcopy(SCHEMA)
    if compact:  # llguidance's option: no whitespace between JSON tokens
        schema["x-guidance"] = {"whitespace_flexible": False}
    if BOUNDED:
        schema["properties"]["title"]["maxLength"] = 60
        schema["properties"]["steps"]["items"]["properties"]["text"]["maxLength"] = 80
    return json.dumps({"structured_outputs": {"json": schema}})


def _run(server: Server, args: list[str], structured: str | None) -> dict:
    extra = ["--extra-body", structured] if structured else []
    t0 = time.monotonic()
    r = bench(server, [*args, *extra])
    r["wall_s"] = round(time.monotonic() - t0, 2)
    prompts = int(args[args.index("--num-prompts") + 1])
    if r["completed"] != prompts:  # a failed request would make the ratios meaningless
        raise RuntimeError(f"{prompts - r['completed']} of {prompts} requests failed")
    return r


def _warm_up(server: Server, args: list[str], structured: str | None) -> None:
    """One short run, not counted: llguidance builds a grammar's lexer states lazily, so the
    first few hundred steps of a new grammar cost more than the steady state measured here
    (the compile itself is measured by benchmarks/grammar_backends.py)."""
    shape = list(args)
    shape[shape.index("--num-prompts") + 1] = str(
        min(8, int(args[args.index("--num-prompts") + 1]))
    )
    _run(server, shape, structured)


def _compare(server: Server, args: list[str], repeats: int, compact: bool = False) -> dict:
    """Alternate unconstrained and structured runs; medians of ITL p50 and output tok/s."""
    _warm_up(server, args, _structured(compact))
    runs: dict[str, list[dict]] = {"unconstrained": [], "structured": []}
    for _ in range(repeats):
        runs["unconstrained"].append(_run(server, args, None))
        runs["structured"].append(_run(server, args, _structured(compact)))
    summary = {}
    for mode, rs in runs.items():
        summary[mode] = {
            "itl_p50_ms": statistics.median(r["p50_itl_ms"] for r in rs),
            "output_tok_s": statistics.median(r["output_throughput"] for r in rs),
            "runs": rs,
        }
    u, s = summary["unconstrained"], summary["structured"]
    summary["itl_p50_ratio"] = round(s["itl_p50_ms"] / u["itl_p50_ms"], 4)
    summary["tok_s_ratio"] = round(s["output_tok_s"] / u["output_tok_s"], 4)
    return summary


def _shape(a: argparse.Namespace, prompts: int) -> list[str]:
    return [
        "--random-input-len", "64", "--random-output-len", str(a.output_len),
        "--num-prompts", str(prompts), "--max-concurrency", str(a.streams),
        "--metric-percentiles", "50,99",
    ]  # fmt: skip


def scenario(name: str, a: argparse.Namespace) -> dict:
    if name == "smollm2":
        model = str(resolve_model(a.model or "smollm2"))
        s = Server(model, a.flags)
        try:
            out = _compare(s, _shape(a, a.streams * 2), a.repeats)
            m = s.metrics()
        finally:
            s.stop()
        out["grammar_mask_step_p50_s"] = histogram_quantile(
            m, "stoker:step_grammar_mask_seconds", 0.5
        )
        out["grammar_wait_step_p50_s"] = histogram_quantile(
            m, "stoker:step_grammar_wait_seconds", 0.5
        )
        return {"model": "SmolLM2-135M-Instruct", "streams": a.streams, **out}
    if name == "null":
        # As benchmarks/serving.py's null scenario: a pool that holds every stream.
        blocks = a.streams * (-(-(64 + a.output_len) // 16) + 1)
        flags = ["--null-model", "--max-num-seqs", "512", "--num-kv-blocks", str(blocks)]
        s = Server(
            str(resolve_model(a.model or "smollm2")), [*flags, "--block-size", "16", *a.flags]
        )
        out: dict = {}
        try:
            _warm_up(s, _shape(a, a.streams * 2), _structured(compact=True))
            for mode in ("unconstrained", "structured", "unconstrained_2", "structured_2"):
                structured = _structured(compact=True) if mode.startswith("structured") else None
                cpu0 = process_cpu_seconds(s.proc.pid)
                r = _run(s, _shape(a, a.streams * 2), structured)
                cpu1 = process_cpu_seconds(s.proc.pid)
                tokens = r["total_output_tokens"]
                r["cpu_us_per_token"] = {
                    k: round((cpu1[k] - cpu0.get(k, 0.0)) / tokens * 1e6, 2) for k in cpu1
                }
                out[mode] = r
            m = s.metrics()
        finally:
            s.stop()

        def total(mode: str) -> float:
            return sum(out[mode]["cpu_us_per_token"].values())

        added = [
            total("structured") - total("unconstrained"),
            total("structured_2") - total("unconstrained_2"),
        ]
        out["added_cpu_us_per_structured_token"] = [round(x, 2) for x in added]
        mask_p50 = histogram_quantile(m, "stoker:step_grammar_mask_seconds", 0.5)
        out["grammar_mask_step_p50_s"] = mask_p50
        out["grammar_mask_us_per_row_p50"] = round(mask_p50 / a.streams * 1e6, 2)
        tok = [
            out[k]["output_throughput"]
            for k in out
            if isinstance(out[k], dict) and "output_throughput" in out[k]
        ]
        out["tok_s_ratio"] = round((tok[1] + tok[3]) / (tok[0] + tok[2]), 4)
        return {"model": "null (SmolLM2 tokenizer)", "streams": a.streams, **out}
    if name == "fast-forward":
        model = str(resolve_model(a.model or "smollm2"))
        out = {}
        for mode, flags in (("on", []), ("off", ["--no-grammar-fast-forward"])):
            s = Server(model, [*flags, *a.flags])
            try:
                _warm_up(s, _shape(a, a.streams * 2), _structured(compact=True))
                m0 = s.metrics()
                r = _run(s, _shape(a, a.streams * 2), _structured(compact=True))
                m = s.metrics()
            finally:
                s.stop()
            steps = _grew(m0, m, "stoker:steps_total")
            forced = _grew(m0, m, "stoker:grammar_forced_tokens_total")
            r["steps"], r["forced_tokens_accepted"] = steps, forced
            r["forward_passes_saved_share"] = round(forced / r["total_output_tokens"], 4)
            out[mode] = r
        return {"model": "SmolLM2-135M-Instruct", "streams": a.streams, "compact_json": True, **out}
    if name == "speculation":
        # Batch 1, a forced tool call (chat, the model's template): repeated keys and the
        # schema's own text are what prompt lookup (n-gram) finds.
        model = str(resolve_model(a.model or "smollm2"))
        chat = ["--endpoint", "/v1/chat/completions"]
        out = {}
        for mode, flags in (("none", []), ("ngram", ["--speculative", "ngram"])):
            s = Server(model, [*flags, *a.flags])
            try:
                _warm_up(s, [*_shape(a, 8), *chat], json.dumps(TOOL_CALL))
                r = _run(s, [*_shape(a, 8), *chat], json.dumps(TOOL_CALL))
            finally:
                s.stop()
            out[mode] = r
        ratio = out["ngram"]["output_throughput"] / out["none"]["output_throughput"]
        out["speedup"] = round(ratio, 3)
        return {"model": "SmolLM2-135M-Instruct", "streams": a.streams, **out}
    if name == "compile-stall":
        return _compile_stall(a)
    raise SystemExit(f"unknown scenario {name}")


def _grew(before: str, after: str, name: str) -> float:
    return metric_sum(after, name) - metric_sum(before, name)


def _pathological(i: int) -> dict:
    """A schema that takes llguidance long to compile (300 patterned properties), unique per i
    so the compile cache never answers."""
    pattern = "^[a-z]{3,9}[0-9]{2,5}(-[A-Z]{2,4}){1,3}$"
    props = {f"p{j}": {"type": "string", "pattern": pattern} for j in range(300)}
    props["tag"] = {"const": f"t{i}"}
    return {"type": "object", "properties": props, "required": ["tag"]}


def _flood(port: int, stop: threading.Event, sent: list[int], offset: int) -> None:
    """Keep sending one-token requests, each with a never-seen pathological schema."""
    i = 0
    with httpx.Client(timeout=60) as client:
        while not stop.is_set():
            body = {"prompt": [5, 6, 7], "max_tokens": 1}
            body["structured_outputs"] = {"json": _pathological(offset + i)}
            client.post(f"http://127.0.0.1:{port}/v1/completions", json=body)
            sent[0] += 1
            i += 1


def _compile_stall(a: argparse.Namespace) -> dict:
    """Plain streams alone, then while other requests keep sending never-seen pathological
    schemas: the plain streams' ITL p99 and throughput, against the run without."""
    model = str(resolve_model(a.model or "smollm2"))
    s = Server(model, a.flags)
    out: dict = {}
    try:
        for n, mode in enumerate(("alone", "with_compiles", "alone_2", "with_compiles_2")):
            stop, sent = threading.Event(), [0]
            flood = None
            if mode.startswith("with"):
                flood = threading.Thread(target=_flood, args=(s.port, stop, sent, n * 10**6))
            m0 = s.metrics()
            if flood:
                flood.start()
            r = _run(s, _shape(a, a.streams * 2), None)
            stop.set()
            if flood:
                flood.join()
            m1 = s.metrics()
            r["pathological_requests"] = sent[0]
            name = "stoker:grammar_compile_seconds_sum"
            r["compile_s_sum"] = round(metric_sum(m1, name) - metric_sum(m0, name), 3)
            out[mode] = r
    finally:
        s.stop()
    for key in ("p99_itl_ms", "p50_itl_ms", "output_throughput"):
        alone = statistics.median([out["alone"][key], out["alone_2"][key]])
        busy = statistics.median([out["with_compiles"][key], out["with_compiles_2"][key]])
        out[f"{key}_ratio"] = round(busy / alone, 4)
    return {"model": "SmolLM2-135M-Instruct", "streams": a.streams, **out}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument(
        "scenario", choices=["smollm2", "null", "fast-forward", "speculation", "compile-stall"]
    )
    ap.add_argument("--model", default=None, help="default: smollm2")
    ap.add_argument("--streams", type=int, default=32)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--flags", nargs="*", default=[], help="more `stoker serve` flags")
    ap.add_argument("--bounded-strings", action="store_true", help="maxLength on the strings")
    a = ap.parse_args()
    global BOUNDED
    BOUNDED = a.bounded_strings
    result = scenario(a.scenario, a)
    result["serve_flags"] = a.flags
    result["bounded_strings"] = a.bounded_strings
    path = write_result(f"structured_{a.scenario}_{a.streams}", result)
    print(json.dumps({k: v for k, v in result.items() if not isinstance(v, dict)}, indent=1))
    print("wrote", path)


if __name__ == "__main__":
    main()
