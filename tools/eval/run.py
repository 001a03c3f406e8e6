"""`stoker eval`: run a golden prompt set on a live deployment and on a reference, and compare.

    stoker eval --base-url URL --reference MODEL_FOLDER|URL [--prompts FILE.jsonl] ...
    stoker eval --fleet URL1 URL2 [URL3 ...]

The IO shell around tools/eval/compare.py: it asks each source (tools/eval/sources.py)
for its tokenization and greedy output of every prompt, and prints what the core decides.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from collections.abc import Sequence
from typing import Any

import httpx

from stoker.tools.eval.compare import (
    OutputCheck,
    PromptVerdict,
    Tolerances,
    compare_outputs,
    compare_tokenization,
    odd_ones_out,
    verdict,
)
from stoker.tools.eval.sources import GOLDEN, Deployment, Item, Source, Transformers, load_items

DEFAULT = Tolerances()
HELP = f"""\
Exit 0 only when, for every prompt: the server's /tokenize ids equal the reference tokenizer's
(plain prompts: tokenizer(prompt); chat: the chat template with add_generation_prompt) and equal
usage.prompt_tokens; the prompt does not start with a doubled BOS the reference lacks; the greedy
output ids agree (a divergence is tolerated only on a near tie: where the reference's own top two
tokens are within --tie-margin nats, {DEFAULT.tie_margin:g} by default); the chosen tokens'
logprobs agree within --logprob-atol ({DEFAULT.logprob_atol:g}) over the agreeing prefix; and the
finish reason (EOS, length, stop strings) and the text left by a stop string match. --fleet
applies the same output checks between every replica and the first, and names the replicas that
disagree with most others. Exit 1: out of tolerance; 2: a source failed.
"""


@dataclasses.dataclass
class Report:
    mode: str  # "reference" or "fleet"
    servers: list[str]
    reference: str | None
    tolerances: Tolerances
    prompts: list[PromptVerdict]
    odd_ones_out: list[str] = dataclasses.field(default_factory=list)

    @property
    def passed(self) -> bool:
        return all(p.passed for p in self.prompts) and not self.odd_ones_out

    def to_json(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        for entry, prompt in zip(out["prompts"], self.prompts):
            entry["passed"] = prompt.passed
        return {**out, "passed": self.passed}


def against_reference(
    server: Source, reference: Source, items: Sequence[Item], max_tokens: int, tol: Tolerances
) -> Report:
    bos = getattr(reference, "bos_id", None)
    eos = getattr(reference, "eos_ids", frozenset())
    verdicts = []
    for item in items:
        tk = compare_tokenization(server.tokenize(item), reference.tokenize(item), bos)
        got, usage = server.generate(item, max_tokens)
        want, _ = reference.generate(item, max_tokens)
        oc = compare_outputs(got, want, tol, eos)
        stop = (got.text, want.text) if item.stop else None
        verdicts.append(
            verdict(item.id, item.kind, tk, oc, tol, usage_prompt_tokens=usage, stop_text=stop)
        )
    return Report("reference", [server.name], reference.name, tol, verdicts)


def fleet(
    replicas: Sequence[Source], items: Sequence[Item], max_tokens: int, tol: Tolerances
) -> Report:
    n = len(replicas)
    disagree = [[False] * n for _ in range(n)]
    verdicts = []
    for item in items:
        ids = [r.tokenize(item) for r in replicas]
        runs = [r.generate(item, max_tokens) for r in replicas]
        checks: dict[tuple[int, int], OutputCheck] = {}
        for i in range(n):
            for j in range(i + 1, n):
                checks[i, j] = compare_outputs(runs[j][0], runs[i][0], tol)
                tk = compare_tokenization(ids[j], ids[i], None)
                bad = not tk.match or not verdict("", "", tk, checks[i, j], tol).passed
                disagree[i][j] = disagree[j][i] = disagree[i][j] or bad
        for j in range(1, n):
            tk = compare_tokenization(ids[j], ids[0], None)
            stop = (runs[j][0].text, runs[0][0].text) if item.stop else None
            v = verdict(f"{item.id} @{j}", item.kind, tk, checks[0, j], tol,
                        usage_prompt_tokens=runs[j][1], stop_text=stop)  # fmt: skip
            verdicts.append(v)
    odd = [replicas[i].name for i in odd_ones_out(disagree)]
    return Report("fleet", [r.name for r in replicas], None, tol, verdicts, odd)


def _fmt_lp(x: float) -> str:
    return f"{x:.2e}" if x else "0"


def table(report: Report) -> str:
    """A fixed-width table, one row per prompt (per replica in fleet mode), then the findings."""
    head = ("prompt", "kind", "tokens", "ids", "diverge@", "max|Δlp|", "finish", "verdict")
    rows = [head]
    for p in report.prompts:
        tk, o = p.tokenization, p.output
        tok = "-" if tk is None else "same" if tk.match else f"DIFF@{tk.first_diff}"
        rows.append((
            p.id,
            p.kind,
            tok,
            "-" if o is None else "same" if o.ids_agree else "tie" if o.near_tie else "DIFF",
            "-" if o is None or o.first_divergence is None else str(o.first_divergence),
            "-" if o is None else _fmt_lp(o.max_abs_dlogprob),
            "-" if o is None else f"{o.finish_server}/{o.finish_reference}",
            "ok" if p.passed else "FAIL",
        ))  # fmt: skip
    widths = [max(len(r[i]) for r in rows) for i in range(len(head))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]
    against = report.reference or report.servers[0]
    lines.insert(0, f"stoker eval: {', '.join(report.servers)} against {against}")
    for p in report.prompts:
        lines += [f"  {p.id}: FAIL {f}" for f in p.failures]
        lines += [f"  {p.id}: note {w}" for w in p.warnings]
    if report.odd_ones_out:
        lines.append(f"replicas that disagree with the others: {', '.join(report.odd_ones_out)}")
    t = report.tolerances
    failed = sum(not p.passed for p in report.prompts)
    lines.append(
        f"{len(report.prompts) - failed}/{len(report.prompts)} passed "
        f"(logprob_atol {t.logprob_atol:g}, tie_margin {t.tie_margin:g}): "
        + ("PASS" if report.passed else "FAIL")
    )
    return "\n".join(lines)


def _source(spec: str, api_key: str | None, timeout_s: float) -> Source:
    if spec.startswith(("http://", "https://")):
        return Deployment(spec, api_key, timeout_s)
    return Transformers(spec)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="stoker eval",
        description="Compare a live deployment with a reference run, token by token.",
        epilog=HELP,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--base-url", help="the deployment, e.g. http://127.0.0.1:8000")
    parser.add_argument(
        "--reference", help="a model folder (transformers, float32 CPU) or another deployment's URL"
    )
    parser.add_argument(
        "--fleet", nargs="+", metavar="URL", help="compare replicas with each other"
    )
    parser.add_argument(
        "--prompts", default=str(GOLDEN), help="JSONL: {id, prompt|messages, stop?, max_tokens?}"
    )
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--json", metavar="OUT", help="also write the report as JSON")
    parser.add_argument(
        "--logprob-atol",
        type=float,
        default=DEFAULT.logprob_atol,
        help="largest |Δ logprob| of a chosen token allowed (default %(default)g; raise for bf16)",
    )
    parser.add_argument(
        "--tie-margin",
        type=float,
        default=DEFAULT.tie_margin,
        help="nats within which a greedy divergence counts as a tie (default %(default)g)",
    )
    parser.add_argument(
        "--api-key", default=os.environ.get("STOKER_API_KEY"), help="env STOKER_API_KEY"
    )
    parser.add_argument("--timeout-s", type=float, default=120.0, help="per HTTP request")
    args = parser.parse_args(argv)
    if args.fleet is not None:
        if args.base_url or args.reference or len(args.fleet) < 2:
            parser.error("--fleet takes two or more URLs, without --base-url or --reference")
    elif not (args.base_url and args.reference):
        parser.error("give --base-url and --reference, or --fleet URL1 URL2 ...")
    tol = Tolerances(args.logprob_atol, args.tie_margin)
    try:
        items = load_items(args.prompts)
        if args.fleet is not None:
            replicas = [Deployment(u, args.api_key, args.timeout_s) for u in args.fleet]
            report = fleet(replicas, items, args.max_tokens, tol)
        else:
            server = Deployment(args.base_url, args.api_key, args.timeout_s)
            reference = _source(args.reference, args.api_key, args.timeout_s)
            report = against_reference(server, reference, items, args.max_tokens, tol)
    except (OSError, ValueError, RuntimeError, KeyError, httpx.HTTPError) as e:
        print(f"stoker eval: {type(e).__name__}: {e}", file=sys.stderr)
        return 2
    print(table(report))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report.to_json(), f, indent=2, default=sorted)
    return 0 if report.passed else 1


if __name__ == "__main__":
    sys.exit(main())
