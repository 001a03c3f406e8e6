"""Statistical tests of `spec_verify.verify` (rejection sampling), no model involved.

Each test verifies many identical-in-distribution requests at once: N VerifyGroups in one call,
each with its own k + 1 rows of fixed target logits. Row j's logits depend on the draft before it
(as a real model's would), and penalties see drafts[:j] as output, so the target distribution
p_j is computed per row by an independent float64 reference (`reference_probs`).

Tolerance: each empirical frequency over N = 20 000 groups has standard deviation
sqrt(p (1 - p) / N) <= sqrt(0.25 / 20 000) ~= 0.0035, so TOL = 0.015 is more than 4 sigma for
every token (a false failure has probability < 1e-4 per test even without a fixed seed). The
generators are seeded, so the tests are deterministic. Plausible bugs move the distribution by
far more: e.g. accepting an n-gram draft without the residual correction shifts its token by
p(d) (1 - p(d)) >= 0.1 for the likely drafts used here. Conditional checks over n < N samples
scale the tolerance as 5 * sqrt(0.25 / n).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
import pytest
import torch

from stoker.common.sampling_params import SamplingParams
from stoker.services.worker.sampler import SamplingBatch
from stoker.services.worker.spec_verify import VerifyGroup, verify

V = 6
N = 20_000
TOL = 0.015
# Distinct values: no ties in the top-k / top-p sorts, no ties for greedy argmax.
BASE = [
    [1.2, 0.3, -0.5, 2.0, 0.8, -1.1],  # row 0: the position of the request's last token
    [0.1, 1.5, 0.9, -0.7, 0.4, -1.4],  # row 1: after draft 1
    [-0.2, 0.6, 1.7, 0.2, -0.9, 1.0],  # row 2: after draft 2 (the bonus row when k = 2)
]
COUPLING = 1.3  # row j > 0 boosts the token after the previous draft: p_j depends on d_j
PROMPT = [1, 4]
HISTORY = [3, 3, 0]  # output tokens before this step (penalties need a non-empty history)

PARAMS = {
    "t1": SamplingParams(temperature=1.0),
    "t07_min_p": SamplingParams(temperature=0.7, min_p=0.15),
    "top_k": SamplingParams(temperature=1.0, top_k=3),
    "top_p": SamplingParams(temperature=1.0, top_p=0.75),
    "penalties": SamplingParams(
        temperature=1.0, frequency_penalty=0.6, presence_penalty=0.3, repetition_penalty=1.4
    ),
}


def row_logits(j: int, drafts_before: Sequence[int]) -> list[float]:
    row = list(BASE[j])
    if drafts_before:
        row[(drafts_before[-1] + 1) % V] += COUPLING
    return row


def reference_probs(
    logits: Sequence[float], params: SamplingParams, prompt: Sequence[int], output: Sequence[int]
) -> np.ndarray:
    """The target distribution, independently: penalties (vLLM), softmax(logits / T), top-k,
    top-p (smallest set whose mass reaches top_p, over the top-k mass), min-p; renormalised."""
    x = np.array(logits, dtype=np.float64)
    counts = np.bincount(np.array(output, dtype=np.int64), minlength=V)[:V]
    if params.repetition_penalty != 1.0:
        seen = (counts > 0) | (np.bincount(np.array(prompt, dtype=np.int64), minlength=V)[:V] > 0)
        r = params.repetition_penalty
        x = np.where(seen, np.where(x > 0, x / r, x * r), x)
    x = x - params.frequency_penalty * counts - params.presence_penalty * (counts > 0)
    p = np.exp((x - x.max()) / params.temperature)
    p /= p.sum()
    order = np.argsort(-p)
    keep = np.ones(V, dtype=bool)
    if 0 < params.top_k < V:
        keep[order[params.top_k :]] = False
    if params.top_p < 1.0:
        kept = (p * keep)[order]
        above = np.cumsum(kept) - kept
        keep[order[above >= params.top_p * kept.sum()]] = False
    if params.min_p > 0.0:
        keep &= p >= params.min_p * p.max()
    p = np.where(keep, p, 0.0)
    return p / p.sum()


def target_p(params: SamplingParams, j: int, drafts_before: Sequence[int]) -> np.ndarray:
    return reference_probs(
        row_logits(j, drafts_before), params, PROMPT, HISTORY + list(drafts_before)
    )


def run_verify(
    params: SamplingParams,
    drafts: Sequence[Sequence[int]],
    draft_probs: torch.Tensor | None = None,
    seeds: Sequence[int | None] | None = None,
    output_pos: int = len(HISTORY),
    generator_seed: int = 0,
) -> list[list[int]]:
    """One `verify` call over len(drafts) groups (group g proposes drafts[g])."""
    rows: list[list[float]] = []
    row_params: list[SamplingParams] = []
    prompts: list[list[int]] = []
    outputs: list[list[int]] = []
    groups: list[VerifyGroup] = []
    for g, ds in enumerate(drafts):
        start = len(rows)
        for j in range(len(ds) + 1):  # verify rows see the drafts before them as output
            rows.append(row_logits(j, ds[:j]))
            row_params.append(params)
            prompts.append(PROMPT)
            outputs.append(HISTORY + list(ds[:j]))
        seed = None if seeds is None else seeds[g]
        groups.append(VerifyGroup(start, list(ds), draft_probs, params.greedy, seed, output_pos))
    batch = SamplingBatch.build(row_params, prompts, outputs, V, "cpu")
    logits = torch.tensor(rows, dtype=torch.float32)
    out = verify(logits, batch, groups, torch.Generator().manual_seed(generator_seed))
    assert len(out) == len(drafts)
    for ds, tokens in zip(drafts, out):
        assert 1 <= len(tokens) <= len(ds) + 1 and tokens[:-1] == list(ds[: len(tokens) - 1])
    return out


def frequencies(tokens: Sequence[int]) -> np.ndarray:
    return np.bincount(np.array(tokens, dtype=np.int64), minlength=V) / len(tokens)


def assert_matches(freq: np.ndarray, p: np.ndarray, tol: float = TOL) -> None:
    err = np.abs(freq - p).max()
    assert err < tol, f"max abs error {err:.4f} >= {tol:.4f}\nempirical {freq}\ntarget    {p}"
    # Tokens the target filtered out (top-k / top-p / min-p) must never come out.
    assert np.all(freq[p == 0.0] == 0.0), (freq, p)


def sample_drafts(q: np.ndarray, n: int, seed: int) -> list[list[int]]:
    """n proposals of len(q) drafts, position j drawn from q[j] (a proposer that ignores its
    own earlier drafts is still a valid proposer: rejection sampling only needs the q used)."""
    rng = np.random.default_rng(seed)
    cols = [rng.choice(V, size=n, p=qj) for qj in q]
    return [list(map(int, ds)) for ds in zip(*cols)]


# A proposal distribution unlike every p above: mass on tokens the target rarely picks, one
# token p likes (3) under-proposed, and a zero (token 1 is never proposed at position 0).
Q = np.array(
    [
        [0.10, 0.00, 0.30, 0.20, 0.15, 0.25],
        [0.30, 0.10, 0.05, 0.25, 0.20, 0.10],
    ]
)


# -- the first output token -------------------------------------------------------------------


@pytest.mark.parametrize("name", list(PARAMS))
@pytest.mark.parametrize("likely", [True, False], ids=["likely", "unlikely"])
def test_first_token_ngram_proposals(name: str, likely: bool) -> None:
    """n-gram style: fixed drafts, q one-hot (draft_probs None)."""
    params = PARAMS[name]
    p0 = target_p(params, 0, [])
    d1 = int(np.argmax(p0)) if likely else int(np.argmin(np.where(p0 > 0, p0, np.inf)))
    if not likely and name == "top_k":
        d1 = int(np.argmin(p0))  # a draft the target filtered out: always rejected
    drafts = [[d1, (d1 + 2) % V]] * N
    out = run_verify(params, drafts)
    first = [t[0] for t in out]
    assert_matches(frequencies(first), p0)
    accepted = sum(len(t) > 1 for t in out) / N  # P(accept d) = min(1, p(d) / 1)
    assert abs(accepted - p0[d1]) < TOL
    if p0[d1] == 0.0:
        assert accepted == 0.0


@pytest.mark.parametrize("name", list(PARAMS))
def test_first_token_draft_model_proposals(name: str) -> None:
    """Draft-model style: drafts sampled from q, which differs from p (and has zeros where p
    does not, and mass where p is filtered)."""
    params = PARAMS[name]
    p0 = target_p(params, 0, [])
    drafts = sample_drafts(Q, N, seed=1)
    out = run_verify(params, drafts, torch.tensor(Q, dtype=torch.float32))
    assert_matches(frequencies([t[0] for t in out]), p0)
    accepted = sum(len(t) > 1 for t in out) / N  # sum_x q(x) min(1, p(x) / q(x))
    assert abs(accepted - np.minimum(p0, Q[0]).sum()) < TOL


# -- joint correctness: the second token given the first --------------------------------------


def assert_second_token_conditionals(
    params: SamplingParams, drafts: list[list[int]], out: list[list[int]]
) -> int:
    """For each first token a that was an accepted draft, out[1] | out[0] = a must follow the
    target's next distribution p_1(. | a). Returns the number of conditional samples checked."""
    by_first: dict[int, list[int]] = {}
    for ds, tokens in zip(drafts, out):
        if len(tokens) > 1:  # draft 1 accepted: tokens[1] is draft 2 (accepted), a residual
            assert tokens[0] == ds[0]  # sample at position 1, or the bonus
            by_first.setdefault(tokens[0], []).append(tokens[1])
    checked = 0
    for a, seconds in by_first.items():
        n = len(seconds)
        if n < 2000:
            continue
        tol = 5 * math.sqrt(0.25 / n)
        assert_matches(frequencies(seconds), target_p(params, 1, [a]), tol)
        checked += n
    return checked


@pytest.mark.parametrize("name", ["t1", "top_p", "penalties"])
def test_second_token_given_accepted_first_ngram(name: str) -> None:
    params = PARAMS[name]
    p0 = target_p(params, 0, [])
    d1 = int(np.argmax(p0))
    drafts = [[d1, int(np.argmax(target_p(params, 1, [d1])))]] * N
    out = run_verify(params, drafts)
    assert_matches(frequencies([t[0] for t in out]), p0)
    assert assert_second_token_conditionals(params, drafts, out) >= 0.2 * len(drafts)
    # Both drafts accepted: the bonus comes from p_2(. | d1, d2).
    bonus = [t[2] for t in out if len(t) == 3]
    assert len(bonus) > 2000
    tol = 5 * math.sqrt(0.25 / len(bonus))
    assert_matches(frequencies(bonus), target_p(params, 2, drafts[0]), tol)


@pytest.mark.parametrize("name", ["t1", "top_k", "penalties"])
def test_second_token_given_accepted_first_draft_model(name: str) -> None:
    params = PARAMS[name]
    drafts = sample_drafts(Q, N, seed=2)
    out = run_verify(params, drafts, torch.tensor(Q, dtype=torch.float32), generator_seed=3)
    assert_matches(frequencies([t[0] for t in out]), target_p(params, 0, []))
    assert assert_second_token_conditionals(params, drafts, out) >= 2000


def test_single_draft_bonus_row() -> None:
    """k = 1: an accepted draft is followed by the bonus drawn from p_1(. | d)."""
    params = PARAMS["t1"]
    p0 = target_p(params, 0, [])
    d = int(np.argmax(p0))
    out = run_verify(params, [[d]] * N)
    assert_matches(frequencies([t[0] for t in out]), p0)
    bonus = [t[1] for t in out if len(t) == 2]
    assert_matches(frequencies(bonus), target_p(params, 1, [d]), 5 * math.sqrt(0.25 / len(bonus)))


# -- greedy and seeded groups ------------------------------------------------------------------


def test_greedy_groups_accept_the_argmax_prefix_exactly() -> None:
    """Greedy: accepted = longest prefix equal to the (penalised) argmax, then the argmax at the
    first mismatch, or after the last draft. Mixed into one call with sampled groups and with
    penalties on some greedy rows, so the per-row output history matters."""
    gen = torch.Generator().manual_seed(5)
    rng = np.random.default_rng(5)
    V_big = 50
    rows: list[torch.Tensor] = []
    params: list[SamplingParams] = []
    prompts: list[list[int]] = []
    outputs: list[list[int]] = []
    groups: list[VerifyGroup] = []
    expected: list[list[int] | None] = []
    for g in range(400):
        k = int(rng.integers(1, 6))
        kind = g % 4  # 0, 1: greedy; 2: greedy with penalties; 3: sampled (not checked)
        sp = [
            SamplingParams(temperature=0.0),
            SamplingParams(temperature=0.8, top_k=1),  # top_k = 1 is greedy too
            SamplingParams(temperature=0.0, frequency_penalty=1.5, repetition_penalty=1.3),
            SamplingParams(temperature=1.0),
        ][kind]
        history = [int(t) for t in rng.integers(0, V_big, size=int(rng.integers(0, 6)))]
        prompt = [int(t) for t in rng.integers(0, V_big, size=3)]
        logits = torch.randn(k + 1, V_big, generator=gen) * 3
        drafts: list[int] = []
        tokens: list[int] = []
        mismatch_at = int(rng.integers(0, k + 1))  # k: every draft matches
        for j in range(k + 1):
            p = greedy_reference(logits[j], sp, prompt, history + drafts, V_big)
            if j == k:
                tokens.append(p)
                break
            if j < mismatch_at:
                drafts.append(p)
                tokens.append(p)
            else:
                drafts.append((p + int(rng.integers(1, V_big))) % V_big)
                if j == mismatch_at:
                    tokens.append(p)
        # After the first mismatch the drafts are arbitrary; expected stops there.
        start = len(rows)
        for j in range(k + 1):
            rows.append(logits[j])
            params.append(sp)
            prompts.append(prompt)
            outputs.append(history + drafts[:j])
        groups.append(VerifyGroup(start, drafts, None, sp.greedy, None, len(history)))
        expected.append(tokens[: mismatch_at + 1] if sp.greedy else None)
    batch = SamplingBatch.build(params, prompts, outputs, V_big, "cpu")
    out = verify(torch.stack(rows), batch, groups, torch.Generator().manual_seed(0))
    checked = 0
    for want, got in zip(expected, out):
        if want is not None:
            assert got == want
            checked += 1
    assert checked == 300


def greedy_reference(
    logits: torch.Tensor, params: SamplingParams, prompt: list[int], output: list[int], vocab: int
) -> int:
    """Argmax of the penalised logits (the token greedy decoding would pick)."""
    x = logits.double().numpy().copy()
    counts = np.bincount(np.array(output, dtype=np.int64), minlength=vocab)[:vocab]
    if params.repetition_penalty != 1.0:
        seen = (counts > 0) | (np.bincount(np.array(prompt, dtype=np.int64), minlength=vocab) > 0)
        r = params.repetition_penalty
        x = np.where(seen, np.where(x > 0, x / r, x * r), x)
    x = x - params.frequency_penalty * counts - params.presence_penalty * (counts > 0)
    return int(np.argmax(x))


def test_seeded_groups_reproduce_exactly() -> None:
    """A seeded group's output depends only on (seed, output position, its logits and drafts):
    not on the batch around it, its row offset, or the batch-wide generator."""
    params = SamplingParams(temperature=1.0, top_p=0.9)
    rng = np.random.default_rng(7)
    n = 300
    seeded = sample_drafts(Q, n, seed=8)
    seeds = [int(s) for s in rng.integers(0, 2**31, size=n)]
    noise = sample_drafts(Q, n, seed=9)  # unseeded neighbours, only in the second call
    q = torch.tensor(Q, dtype=torch.float32)
    alone = run_verify(params, seeded, q, seeds=seeds, generator_seed=1)
    mixed_drafts = [d for pair in zip(noise, seeded) for d in pair]
    mixed_seeds = [s for pair in zip([None] * n, seeds) for s in pair]
    mixed = run_verify(params, mixed_drafts, q, seeds=mixed_seeds, generator_seed=2)
    assert mixed[1::2] == alone
    again = run_verify(params, seeded, q, seeds=seeds, generator_seed=3)
    assert again == alone
    # Another output position is another noise stream: outputs are not simply repeated.
    moved = run_verify(params, seeded, q, seeds=seeds, output_pos=len(HISTORY) + 1)
    assert moved != alone


def test_seeded_groups_are_distributed_as_p() -> None:
    """Per-request seeds give independent streams: across N seeds the first token follows p."""
    params = PARAMS["t1"]
    drafts = sample_drafts(Q, N, seed=10)
    out = run_verify(params, drafts, torch.tensor(Q, dtype=torch.float32), seeds=list(range(N)))
    assert_matches(frequencies([t[0] for t in out]), target_p(params, 0, []))


def test_draft_from_p_itself_is_always_accepted() -> None:
    """With q = p (a perfect proposer) min(1, p / q) = 1: every draft passes (up to float32
    rounding of p against q, hence 0.999) and the bonus follows p_1(. | d)."""
    params = PARAMS["t1"]
    p0 = target_p(params, 0, [])
    drafts = sample_drafts(p0[None, :], N, seed=11)
    out = run_verify(params, drafts, torch.tensor(p0[None, :], dtype=torch.float32))
    assert sum(len(t) == 2 for t in out) / N > 0.999
    assert_matches(frequencies([t[0] for t in out]), p0)
