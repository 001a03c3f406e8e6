"""Choose the structured-output backend by measurement: llguidance against xgrammar on one
corpus of real-world JSON schemas (benchmarks/schema_corpus.py), with the SmolLM2 tokenizer.

Per backend and schema:
- compile: schema -> the first token mask in hand. llguidance builds lazily, so its first mask
  belongs to compile; xgrammar's is counted the same way, for parity;
- mask: seeded random walks under the mask (EOS whenever allowed, and more and more often a
  token made only of `"`, `}` and `]`, so that outputs close); every later mask fill is timed;
- coverage: compiled or rejected, and each finished output checked with `jsonschema`; failures
  that need format checking (llguidance claims to enforce format) and repeated object keys
  (which JSON Schema can't see) are counted apart.
Then each backend faces KEYWORD_PROBES: per keyword, a schema and an instance it forbids; a
backend that takes that instance relaxes the keyword, and the server must answer 400 for it.

Each backend runs in its own worker process. A schema past --compile-timeout (or its walks past
--walk-timeout) gets the worker killed and restarted, so one schema can't hang the run.
xgrammar is installed beside .venv (--xgrammar-site, `pip --no-deps --target`) and imported
only by its worker; without it the llguidance half still runs and the JSON says why.

    .venv/bin/python benchmarks/grammar_backends.py [--every K] [--out FILE]
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import importlib.metadata
import json
import os
import queue
import random
import re
import subprocess
import sys
import tempfile
import threading
import time
import zlib
from collections import Counter
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_utils import BENCH_DIR, write_result  # noqa: E402
from schema_corpus import (  # noqa: E402
    KEYWORD_PROBES,
    load_corpus_with_skips,
    source_of,
    validate,
)

VOCAB = 49152
XGR_PACKAGES = ["xgrammar==0.2.9", "apache-tvm-ffi==0.1.15.post2"]
# Strictest llguidance: unsupported keywords and formats are errors rather than ignored
# (lenient), oneOf is never widened to anyOf, and JSON is compact, so walks can't spend their
# tokens on whitespace.
LLG_OPTIONS = {"whitespace_flexible": False, "lenient": False, "coerce_one_of": False}
# xgrammar's nearest: compact; strict_mode (its default) closes the objects and arrays a schema
# leaves open, a restriction that can't make an output invalid.
XGR_OPTIONS = {"any_whitespace": False, "separators": (",", ":"), "strict_mode": True}
ROW = "@@row "  # prefix of protocol lines on a worker's stdout


# ---- worker side: one backend, one schema at a time, driven over stdin/stdout ---------------


class Llguidance:
    def __init__(self, hf_tok: Any, threads: int) -> None:  # compiles on the calling thread
        import llguidance
        import llguidance.hf
        import torch

        # Not llguidance.torch: it imports torch.compile and triton, which the triton kernel
        # tests must set up first (they run later in the same pytest process).
        self.llg = llguidance
        self.tok = llguidance.hf.from_tokenizer(hf_tok, VOCAB)
        self.mask = torch.full((1, (VOCAB + 31) // 32), -1, dtype=torch.int32)
        self.version = importlib.metadata.version("llguidance")

    def compile(self, schema: dict) -> list[str]:
        grammar = self.llg.LLMatcher.grammar_from_json_schema(schema, defaults=LLG_OPTIONS)
        self.m = self.llg.LLMatcher(self.tok, grammar, log_level=0)
        self.fill()
        if self.m.is_error():  # the matcher reports grammar errors instead of raising
            raise ValueError(self.m.get_error())
        return self.m.get_grammar_warnings()

    def fill(self) -> None:
        self.m.unsafe_compute_mask_ptr(self.mask.data_ptr(), self.mask.numel() * 4)

    def accept(self, token: int) -> bool:
        return self.m.consume_token(token) and not self.m.is_error()

    def reset(self) -> None:
        self.m.reset()


class Xgrammar:
    def __init__(self, hf_tok: Any, threads: int) -> None:
        import xgrammar

        self.xgr = xgrammar
        info = xgrammar.TokenizerInfo.from_huggingface(hf_tok, vocab_size=VOCAB)
        self.compiler = xgrammar.GrammarCompiler(info, max_threads=threads, cache_enabled=False)
        self.mask = xgrammar.allocate_token_bitmask(1, VOCAB)
        self.version = importlib.metadata.version("xgrammar")

    def compile(self, schema: dict) -> list[str]:
        grammar = self.compiler.compile_json_schema(json.dumps(schema), **XGR_OPTIONS)
        self.m = self.xgr.GrammarMatcher(grammar)
        self.fill()
        return []  # its warnings go to stderr, which the worker captures

    def fill(self) -> None:
        self.m.fill_next_token_bitmask(self.mask)

    def accept(self, token: int) -> bool:
        return self.m.accept_token(token)

    def reset(self) -> None:
        self.m.reset()


def _allowed_bits(b: Any) -> Any:
    import numpy as np

    return np.unpackbits(b.mask.numpy().view(np.uint8), bitorder="little")[:VOCAB]


def finishing_tokens(hf_tok: Any) -> Any:
    """Per token id, whether it is made only of `"`, `}` and `]`: where the mask allows one,
    it closes a string, object or array, so walks that prefer them end."""
    import numpy as np

    texts = [hf_tok.decode([i], clean_up_tokenization_spaces=False) for i in range(VOCAB)]
    return np.array([bool(t) and set(t) <= set('"}]') for t in texts])


Walk = tuple[list[int], bool, str | None, list[float], list[float]]


def walk(
    b: Any, rng: random.Random, eos: int, finishing: Any, max_tokens: int, fresh: bool
) -> Walk:
    """One output under the mask: (ids, finished, error, mask_us, accept_us)."""
    import numpy as np

    ids: list[int] = []
    mask_us: list[float] = []
    accept_us: list[float] = []
    if fresh:
        b.reset()
    for step in range(max_tokens):
        if step or fresh:  # compile already filled the first walk's first mask
            t0 = time.perf_counter_ns()
            b.fill()
            mask_us.append((time.perf_counter_ns() - t0) / 1e3)
        bits = _allowed_bits(b)
        if bits[eos]:
            b.accept(eos)
            return ids, True, None, mask_us, accept_us
        allowed = np.flatnonzero(bits)
        if allowed.size == 0:
            return ids, False, "empty mask", mask_us, accept_us
        closing = allowed[finishing[allowed]]
        if closing.size and rng.random() < min(1.0, 0.3 + step / 150):
            token = int(closing[rng.randrange(closing.size)])
        else:
            token = int(allowed[rng.randrange(allowed.size)])
        t0 = time.perf_counter_ns()
        ok = b.accept(token)
        accept_us.append((time.perf_counter_ns() - t0) / 1e3)
        if not ok:
            return ids, False, f"token {token} refused though allowed", mask_us, accept_us
        ids.append(token)
    return ids, False, None, mask_us, accept_us


def _takes(b: Any, schema: dict, ids: list[int]) -> bool:
    """Whether the grammar lets these tokens, then EOS, through (a fresh matcher each time)."""
    b.compile(schema)
    for i, token in enumerate(ids):
        if i:
            b.fill()
        if not _allowed_bits(b)[token] or not b.accept(token):
            return False
    return True


def _probe(b: Any, hf_tok: Any, schema: dict, bad: str, good: str) -> dict:
    encode = hf_tok.encode
    try:
        b.compile(schema)
    except Exception as e:  # rejecting the schema is a verdict
        return {"verdict": "rejected", "error": _reason(f"{type(e).__name__}: {e}")}
    eos = [hf_tok.eos_token_id]
    takes_bad = _takes(b, schema, encode(bad, add_special_tokens=False) + eos)
    takes_good = _takes(b, schema, encode(good, add_special_tokens=False) + eos)
    verdict = "RELAXED" if takes_bad else "enforced"
    return {"verdict": verdict + ("" if takes_good else ", refuses valid")}


def worker(a: argparse.Namespace) -> None:
    """Answer each stdin line, a corpus index or "probe", with protocol rows on stdout."""
    from transformers import AutoTokenizer

    out, sys.stdout = sys.stdout, sys.stderr  # keep library prints off the protocol

    def send(row: dict) -> None:
        out.write(ROW + json.dumps(row) + "\n")
        out.flush()

    hf_tok = AutoTokenizer.from_pretrained(a.tokenizer)
    b = {"llguidance": Llguidance, "xgrammar": Xgrammar}[a.worker](hf_tok, a.threads)
    finishing = finishing_tokens(hf_tok)
    corpus = load_corpus_with_skips()[0]
    send({"ready": True, "version": b.version, "digest": _digest(corpus)})
    capture = tempfile.TemporaryFile()  # noqa: SIM115 (lives as long as the worker)
    os.dup2(capture.fileno(), 2)  # xgrammar's C++ warnings land here, read back per schema

    def captured() -> list[str]:
        capture.seek(0)
        text = capture.read().decode(errors="replace")
        capture.seek(0)
        capture.truncate()
        return sorted({re.sub(r"^\[[\d:]+\] \S+: ", "", ln) for ln in text.splitlines() if ln})

    for line in sys.stdin:
        if line.strip() == "probe":
            send(
                {"probes": [_probe(b, hf_tok, s, bad, good) for _, s, bad, good in KEYWORD_PROBES]}
            )
            continue
        name, schema = corpus[int(line)]
        captured()
        t0 = time.perf_counter()
        try:
            warnings, error = b.compile(schema), None
        except Exception as e:  # a rejected schema: the error is the result
            warnings, error = [], f"{type(e).__name__}: {e}"
        ms = (time.perf_counter() - t0) * 1e3
        send({"compile_ms": ms, "error": error, "warnings": warnings + captured()})
        if error:
            continue
        walks = []
        for k in range(a.walks):
            rng = random.Random(zlib.crc32(f"{a.seed}/{name}/{k}".encode()))
            ids, done, err, mask_us, accept_us = walk(
                b, rng, hf_tok.eos_token_id, finishing, a.max_tokens, fresh=k > 0
            )
            text = hf_tok.decode(ids, clean_up_tokenization_spaces=False)
            walks.append(
                dict(
                    text=text,
                    tokens=len(ids),
                    finished=done,
                    error=err,
                    mask_us=mask_us,
                    accept_us=accept_us,
                )
            )
        send({"walks": walks})


def _digest(corpus: list[tuple[str, dict]]) -> str:
    return hashlib.sha1("\n".join(n for n, _ in corpus).encode()).hexdigest()[:12]


# ---- driver: workers under timeouts, then validation and the summary ------------------------


class Worker:
    def __init__(self, cmd: list[str], env: dict[str, str]) -> None:
        self.proc = subprocess.Popen(
            cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env, text=True, bufsize=1
        )
        self.rows: queue.Queue[dict | None] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            if line.startswith(ROW):
                self.rows.put(json.loads(line[len(ROW) :]))
        self.rows.put(None)  # exited

    def ask(self, line: str) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()

    def row(self, timeout: float) -> dict | None:
        """The next row, or None if the worker died; raises queue.Empty past the timeout."""
        return self.rows.get(timeout=timeout)

    def stop(self) -> None:
        self.proc.kill()
        self.proc.wait()


def run_backend(backend: str, indexes: list[int], a: argparse.Namespace, env: dict) -> dict:
    cmd = [sys.executable, __file__, "--worker", backend, "--tokenizer", str(a.tokenizer)]
    cmd += ["--walks", str(a.walks), "--max-tokens", str(a.max_tokens), "--seed", str(a.seed)]
    cmd += ["--threads", str(a.xgrammar_threads)]
    rows: dict[int, dict] = {}
    w: Worker | None = None
    info: dict = {}

    def start() -> Worker | None:
        nonlocal info
        w = Worker(cmd, env)
        info = w.row(300) or {}
        return w if info.get("ready") else None

    probes: list[dict] = []
    for i in [*indexes, -1]:  # -1: the keyword probes, last
        w = w or start()
        if w is None:
            return {"available": False, "reason": "worker failed to start"}
        if i < 0:
            w.ask("probe")
            with contextlib.suppress(queue.Empty):  # no probes then, the JSON shows it
                probes = (w.row(a.walk_timeout) or {}).get("probes", [])
            break
        rows[i], alive = _ask_schema(w, i, a)
        if not alive:
            w.stop()
            w = None
    if w is not None:
        w.stop()
    return {
        "available": True,
        "version": info.get("version"),
        "digest": info.get("digest"),
        "rows": rows,
        "probes": probes,
    }


def _ask_schema(w: Worker, i: int, a: argparse.Namespace) -> tuple[dict, bool]:
    """The schema's row, and whether the worker may go on (not killed over a limit, not dead)."""
    w.ask(str(i))
    try:
        row = w.row(a.compile_timeout)
    except queue.Empty:
        return {
            "compile_ms": None,
            "error": f"timeout: compile over {a.compile_timeout:g} s",
        }, False
    if row is None:
        return {"compile_ms": None, "error": "worker died while compiling"}, False
    if row["error"]:
        return row, True
    try:
        walks = w.row(a.walk_timeout)
    except queue.Empty:
        return {**row, "walks": [], "walk_error": f"walks over {a.walk_timeout:g} s"}, False
    if walks is None:
        return {**row, "walks": [], "walk_error": "worker died while walking"}, False
    return {**row, "walks": walks["walks"], "walk_error": None}, True


def _pct(xs: list[float], p: float) -> float | None:
    if not xs:
        return None
    xs = sorted(xs)
    return round(xs[min(len(xs) - 1, int(p / 100 * len(xs)))], 3)


def _reason(error: str) -> str:
    """A rejection reason without schema paths, so that like reasons count together."""
    first = re.sub(r"^\w+Error: ", "", error.split("\n")[0])
    first = re.sub(r"^\[[\d:]+\] \S+: ", "", first)
    return re.sub(r"(at line|while processing|at '|#/).*", "", first).strip()[:120]


def summarize(res: dict, corpus: list[tuple[str, dict]]) -> dict:
    rows = res["rows"]
    accepted = [i for i, r in rows.items() if r["error"] is None]
    s: dict[str, Any] = {"version": res["version"], "schemas": len(rows)}
    s["accepted"] = len(accepted)
    s["accepted_share"] = round(len(accepted) / max(1, len(rows)), 4)
    s["timeouts"] = [corpus[i][0] for i, r in rows.items() if "timeout" in (r["error"] or "")]
    s["rejections"] = dict(Counter(_reason(r["error"]) for r in rows.values() if r["error"]))
    ms = [rows[i]["compile_ms"] for i in accepted]
    s["compile_ms"] = {
        k: _pct(ms, p) for k, p in (("p50", 50), ("p90", 90), ("p99", 99), ("max", 100))
    }
    masks = [x for i in accepted for w in rows[i]["walks"] for x in w["mask_us"]]
    accepts = [x for i in accepted for w in rows[i]["walks"] for x in w["accept_us"]]
    s["mask_us"] = {"p50": _pct(masks, 50), "p99": _pct(masks, 99), "n": len(masks)}
    s["accept_us"] = {"p50": _pct(accepts, 50), "p99": _pct(accepts, 99)}
    n: Counter[str] = Counter()
    failed: Counter[str] = Counter()
    bad: dict[str, dict] = {}
    for i in accepted:
        name, schema = corpus[i]
        for w in rows[i]["walks"]:
            n["walks"] += 1
            n["walk errors"] += bool(w["error"])
            if not w["finished"]:
                n["unfinished"] += 1
                continue
            v = validate(schema, w["text"])
            n["finished"] += 1
            n["invalid"] += bool(v.keywords)
            n["invalid format"] += bool(v.formats)
            n["duplicate keys"] += v.duplicates
            w["failed"] = v.keywords + v.formats + (["<duplicate key>"] if v.duplicates else [])
            failed.update(w["failed"])
            if w["failed"]:
                bad.setdefault(
                    name, {"failed": w["failed"], "error": v.message, "output": w["text"][:400]}
                )
    s["walks"] = {
        k: n[k]
        for k in (
            "walks",
            "finished",
            "unfinished",
            "walk errors",
            "invalid",
            "invalid format",
            "duplicate keys",
        )
    }
    s["failed_keywords"] = dict(failed.most_common())
    s["invalid_schemas"] = bad
    s["probes"] = {p[0]: r for p, r in zip(KEYWORD_PROBES, res["probes"], strict=False)}
    s["relaxed_keywords"] = [k for k, r in s["probes"].items() if "RELAXED" in r["verdict"]]
    s["by_source"] = _by_source(rows, corpus)
    s["rows"] = [_row(corpus[i][0], r) for i, r in rows.items()]
    return s


def _by_source(rows: dict, corpus: list[tuple[str, dict]]) -> dict:
    out: dict[str, dict] = {}
    for source in sorted({source_of(corpus[i][0]) for i in rows}):
        mine = [r for i, r in rows.items() if source_of(corpus[i][0]) == source]
        ms = [r["compile_ms"] for r in mine if r["error"] is None]
        out[source] = {
            "schemas": len(mine),
            "accepted": len(ms),
            "compile_ms_p50": _pct(ms, 50),
            "compile_ms_max": _pct(ms, 100),
        }
    return out


def _row(name: str, r: dict) -> dict:
    """A schema's row in the JSON: timings and verdicts, with the output only where invalid."""
    walks = r.get("walks", [])
    masks = [x for w in walks for x in w["mask_us"]]
    return {
        "schema": name,
        "compile_ms": r["compile_ms"] and round(r["compile_ms"], 3),
        "error": r["error"],
        "warnings": r.get("warnings", [])[:5],
        "walk_error": r.get("walk_error"),
        "walks": [
            {
                "tokens": w["tokens"],
                "finished": w["finished"],
                "error": w["error"],
                "failed": w.get("failed", []),
                **({"output": w["text"][:400]} if w.get("failed") else {}),
            }
            for w in walks
        ],
        "mask_us_p50": _pct(masks, 50),
        "mask_us_max": _pct(masks, 100),
    }


def _on_all(results: dict) -> dict:
    """Compile percentiles over the schemas every backend accepted: like for like."""
    ok = [{i for i, r in res["rows"].items() if r["error"] is None} for res in results.values()]
    common = set.intersection(*ok) if ok else set()
    out: dict[str, Any] = {"schemas": len(common)}
    for name, res in results.items():
        ms = [res["rows"][i]["compile_ms"] for i in common]
        out[name] = {"p50": _pct(ms, 50), "p99": _pct(ms, 99), "max": _pct(ms, 100)}
    return out


def ensure_xgrammar(site: Path) -> str | None:
    """Install xgrammar beside, not into, .venv (no deps: torch and the rest are in .venv).
    Returns why it can't be used, or None."""
    if not (site / "xgrammar" / "__init__.py").is_file():
        cmd = [sys.executable, "-m", "pip", "install", "--no-deps", "--target", str(site)]
        proc = subprocess.run(cmd + XGR_PACKAGES, capture_output=True, text=True)
        if proc.returncode:
            return f"pip install failed: {proc.stderr.strip()[-300:]}"
    env = {**os.environ, "PYTHONPATH": str(site)}
    cmd = [sys.executable, "-c", "import xgrammar"]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=tempfile.gettempdir())
    return f"import failed: {proc.stderr.strip()[-300:]}" if proc.returncode else None


def print_table(summaries: dict, common: dict) -> None:
    def f(x: float | None) -> str:
        return "-" if x is None else f"{x:.1f}"

    head = ["backend", "accepted", "compile ms p50/p90/p99/max", "mask us p50/p99", "outputs"]
    print(" | ".join(head + ["invalid", "format", "dup keys"]))
    for name, s in summaries.items():
        c, m, w = s["compile_ms"], s["mask_us"], s["walks"]
        cols = [name, f"{s['accepted']}/{s['schemas']}", "/".join(f(c[k]) for k in c)]
        cols += [f"{f(m['p50'])}/{f(m['p99'])}", str(w["finished"]), str(w["invalid"])]
        print(" | ".join(cols + [str(w["invalid format"]), str(w["duplicate keys"])]))
    print(f"compile ms on the {common.pop('schemas')} schemas all accept: {common}")
    for name, s in summaries.items():
        print(f"{name} rejects: {dict(Counter(s['rejections']).most_common(5))}")
        print(f"{name} outputs fail: {s['failed_keywords']}; relaxes: {s['relaxed_keywords']}")


def main() -> None:
    from stoker.common.model_registry import cached_model_path

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--worker", choices=["llguidance", "xgrammar"], help=argparse.SUPPRESS)
    ap.add_argument("--threads", type=int, default=1, help=argparse.SUPPRESS)
    ap.add_argument("--tokenizer", type=Path, default=cached_model_path("smollm2"))
    ap.add_argument("--backends", nargs="+", default=["llguidance", "xgrammar"])
    ap.add_argument("--xgrammar-site", type=Path, default=BENCH_DIR / "xgrammar-0.2.9-site")
    ap.add_argument(
        "--xgrammar-threads",
        type=int,
        default=1,
        help="compile threads; 1 compares CPU time with llguidance's",
    )
    ap.add_argument("--walks", type=int, default=3, help="random outputs per accepted schema")
    ap.add_argument("--max-tokens", type=int, default=300)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--compile-timeout", type=float, default=10.0, help="seconds per schema")
    ap.add_argument("--walk-timeout", type=float, default=120.0, help="seconds per schema")
    ap.add_argument("--every", type=int, default=1, help="every K-th schema (quick runs)")
    ap.add_argument("--only", default="", help="regex on schema names")
    ap.add_argument("--out", type=Path, help="default: benchmarks/results/grammar_backends-*.json")
    a = ap.parse_args()
    if a.worker:
        return worker(a)

    corpus, skipped = load_corpus_with_skips()
    indexes = [i for i, (n, _) in enumerate(corpus) if re.search(a.only, n)][:: a.every]
    result: dict[str, Any] = {
        "corpus": {
            "schemas": len(corpus),
            "measured": len(indexes),
            "digest": _digest(corpus),
            "by_source": dict(Counter(source_of(n) for n, _ in corpus)),
            "skipped": [{"name": n, "reason": r} for n, r in skipped],
        },
        "settings": {
            "tokenizer": str(a.tokenizer),
            "vocab": VOCAB,
            "walks": a.walks,
            "max_tokens": a.max_tokens,
            "seed": a.seed,
            "llguidance": LLG_OPTIONS,
            "xgrammar": {**XGR_OPTIONS, "max_threads": a.xgrammar_threads, "cache_enabled": False},
            "compile_timeout_s": a.compile_timeout,
            "cpu": _cpu(),
            "command": " ".join(sys.argv),
        },
        "backends": {},
    }
    results, summaries = {}, {}
    for backend in a.backends:
        env = {**os.environ}
        if backend == "xgrammar":
            why = ensure_xgrammar(a.xgrammar_site)
            if why:
                result["backends"][backend] = {"available": False, "reason": why}
                print("xgrammar unavailable:", why)
                continue
            env["PYTHONPATH"] = str(a.xgrammar_site)
        t0 = time.time()
        res = run_backend(backend, indexes, a, env)
        print(f"{backend}: {len(indexes)} schemas in {time.time() - t0:.0f} s", flush=True)
        if res["available"] and res["digest"] != result["corpus"]["digest"]:
            res = {"available": False, "reason": "the worker loaded a different corpus"}
        if not res["available"]:
            result["backends"][backend] = res
            continue
        results[backend], summaries[backend] = res, summarize(res, corpus)
        result["backends"][backend] = {"available": True, **summaries[backend]}
    common = _on_all(results)
    result["compile_ms_on_schemas_all_accept"] = common
    print_table(summaries, dict(common))
    path = a.out
    if path:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(result, indent=1))
    else:
        path = write_result("grammar_backends", result)
    print("wrote", path)


def _cpu() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
        return next(ln.split(":", 1)[1].strip() for ln in out.splitlines() if "Model name" in ln)
    except (OSError, StopIteration):
        return "unknown"


if __name__ == "__main__":
    main()
