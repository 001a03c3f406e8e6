"""The comparison core of `stoker eval`: pure functions over token ids and logprobs -> verdicts.

No sockets, no models: the shell (tools/eval/run.py) fetches a server's and a reference's
tokenization and greedy outputs, and these functions decide whether they agree, within stated
tolerances, and say where they part.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence


@dataclasses.dataclass(frozen=True)
class Tolerances:
    # The largest |Δ logprob| of a chosen token, over the prefix where both chose the same ids.
    # float32 stoker and float32 transformers on CPU agree to ~1e-5 (SmolLM2: 2.5e-5); a bf16
    # deployment needs more.
    logprob_atol: float = 0.02
    # Greedy outputs may part where the reference's best two tokens are within this many nats:
    # rounding decides such a tie, not a bug. Any other divergence fails.
    tie_margin: float = 0.02


@dataclasses.dataclass
class Step:
    """One generated token: its id, its logprob, and the alternatives known at that step."""

    token_id: int
    logprob: float
    top: dict[int, float] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass
class Output:
    steps: list[Step]
    finish_reason: str | None
    text: str = ""

    @property
    def ids(self) -> list[int]:
        return [s.token_id for s in self.steps]


@dataclasses.dataclass
class TokenizationCheck:
    match: bool
    first_diff: int | None  # first index where the ids differ (or the shorter length)
    server_count: int
    reference_count: int
    doubled_bos: bool  # the server's ids start with two BOS tokens
    reference_doubled_bos: bool


@dataclasses.dataclass
class OutputCheck:
    ids_agree: bool
    first_divergence: int | None  # None: the same ids throughout
    compared: int  # tokens in the agreeing prefix
    max_abs_dlogprob: float
    near_tie: bool  # they part where the reference's top two are within tie_margin
    tie_gap: float | None  # the reference's logprob gap at the divergence, where known
    finish_server: str | None
    finish_reference: str | None


@dataclasses.dataclass
class PromptVerdict:
    id: str
    kind: str  # "prompt" or "chat"
    tokenization: TokenizationCheck | None
    output: OutputCheck | None
    failures: list[str]
    warnings: list[str]

    @property
    def passed(self) -> bool:
        return not self.failures


def first_difference(a: Sequence[int], b: Sequence[int]) -> int | None:
    """The first index where a and b differ, or the shorter length if one extends the other;
    None when they are equal."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def doubled_bos(ids: Sequence[int], bos_id: int | None) -> bool:
    return bos_id is not None and len(ids) >= 2 and ids[0] == ids[1] == bos_id


def compare_tokenization(
    server: Sequence[int], reference: Sequence[int], bos_id: int | None
) -> TokenizationCheck:
    diff = first_difference(server, reference)
    return TokenizationCheck(
        match=diff is None,
        first_diff=diff,
        server_count=len(server),
        reference_count=len(reference),
        doubled_bos=doubled_bos(server, bos_id),
        reference_doubled_bos=doubled_bos(reference, bos_id),
    )


def strip_eos(out: Output, eos_ids: frozenset[int]) -> Output:
    """Engines differ on whether an EOS that ended the output is listed among its tokens; the
    finish reason says it either way, so compare without it."""
    steps = out.steps
    if steps and out.finish_reason == "stop" and steps[-1].token_id in eos_ids:
        steps = steps[:-1]
    return Output(steps, out.finish_reason, out.text)


def compare_outputs(
    server: Output, reference: Output, tol: Tolerances, eos_ids: frozenset[int] = frozenset()
) -> OutputCheck:
    s, r = strip_eos(server, eos_ids), strip_eos(reference, eos_ids)
    diff = first_difference(s.ids, r.ids)
    compared = min(len(s.steps), len(r.steps)) if diff is None else diff
    deltas = [abs(a.logprob - b.logprob) for a, b in zip(s.steps[:compared], r.steps[:compared])]
    gap = None
    if diff is not None and diff < len(s.steps) and diff < len(r.steps):
        gap = _tie_gap(s.steps[diff], r.steps[diff])
    return OutputCheck(
        ids_agree=diff is None,
        first_divergence=diff,
        compared=compared,
        max_abs_dlogprob=max(deltas, default=0.0),
        near_tie=gap is not None and gap <= tol.tie_margin,
        tie_gap=gap,
        finish_server=server.finish_reason,
        finish_reference=reference.finish_reason,
    )


def _tie_gap(server: Step, reference: Step) -> float | None:
    """How much the reference preferred its own token over the server's at the step they
    parted (from the reference's alternatives, else the server's); None if neither lists it."""
    if server.token_id in reference.top:
        return reference.logprob - reference.top[server.token_id]
    if reference.token_id in server.top:
        return server.logprob - server.top[reference.token_id]
    return None


def truncate_at_stop(prefix_texts: Sequence[str], stop: Sequence[str]) -> tuple[int, str] | None:
    """Where stop strings end a generation: prefix_texts[i] is the text of tokens[: i + 1].
    Returns (tokens kept, text before the stop string), or None when no stop string appears."""
    for i, text in enumerate(prefix_texts):
        hits = [text.find(s) for s in stop if s and s in text]
        if hits:
            return i + 1, text[: min(hits)]
    return None


def verdict(
    id: str,
    kind: str,
    tokenization: TokenizationCheck | None,
    output: OutputCheck | None,
    tol: Tolerances,
    *,
    usage_prompt_tokens: int | None = None,
    stop_text: tuple[str, str] | None = None,
) -> PromptVerdict:
    """Collect what is out of tolerance. stop_text: (server text, text the reference gives once
    its stop strings are applied)."""
    failures: list[str] = []
    warnings: list[str] = []
    tk = tokenization
    if tk is not None:
        if not tk.match:
            failures.append(
                f"tokenization differs at id {tk.first_diff} "
                f"({tk.server_count} ids vs {tk.reference_count})"
            )
        if tk.doubled_bos and not tk.reference_doubled_bos:
            failures.append("doubled BOS in the server's prompt")
        elif tk.doubled_bos:
            warnings.append("doubled BOS (the reference doubles it too)")
        if usage_prompt_tokens is not None and usage_prompt_tokens != tk.server_count:
            failures.append(
                f"usage.prompt_tokens {usage_prompt_tokens} != /tokenize count {tk.server_count}"
            )
    o = output
    if o is not None:
        if o.first_divergence is not None:
            where = f"token ids diverge at output token {o.first_divergence}"
            if o.near_tie:
                warnings.append(f"{where}, on a near tie (gap {o.tie_gap:.2g} nats)")
            else:
                gap = "" if o.tie_gap is None else f", reference gap {o.tie_gap:.3g} nats"
                failures.append(where + gap)
        if not math.isfinite(o.max_abs_dlogprob) or o.max_abs_dlogprob > tol.logprob_atol:
            failures.append(
                f"max |Δ logprob| {o.max_abs_dlogprob:.3g} > {tol.logprob_atol:g} "
                f"over {o.compared} agreeing tokens"
            )
        # Only meaningful where the ids agreed to the end: a tie changes everything after it.
        if o.first_divergence is None and o.finish_server != o.finish_reference:
            failures.append(
                f"finish_reason {o.finish_server!r}, reference {o.finish_reference!r} "
                "(EOS or stop handling)"
            )
    if stop_text is not None and (o is None or o.first_divergence is None):
        got, want = stop_text
        if got != want:
            failures.append(f"stop string handling: text {got!r}, expected {want!r}")
    return PromptVerdict(id, kind, tokenization, output, failures, warnings)


def odd_ones_out(disagree: Sequence[Sequence[bool]]) -> list[int]:
    """Replicas that disagree with most of the others: disagree[i][j] is True when replicas i
    and j disagree on some prompt. With two replicas both are named (neither can be trusted)."""
    n = len(disagree)
    counts = [sum(disagree[i][j] for j in range(n) if j != i) for i in range(n)]
    return [i for i in range(n) if counts[i] * 2 > n - 1]
