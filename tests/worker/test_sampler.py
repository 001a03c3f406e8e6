"""Tests for the batched sampler: greedy, seeding, sampled distributions, penalties, logprobs."""

from __future__ import annotations

import math

import pytest
import torch

from stoker.common.sampling_params import SamplingParams
from stoker.services.worker.sampler import (
    Sampler,
    SamplingBatch,
    apply_penalties,
    argmax_rows,
    filtered_probs,
    token_logprobs,
)
from stoker.services.worker.sampling_noise import exponential_noise
from stoker.services.worker.sampling_state import RequestSampling, Row, batch_for

V = 8
N = 20_000  # samples per distribution test, drawn as one batch of identical rows
# Each empirical frequency has std <= sqrt(0.25 / N) ~= 0.0035; 0.015 is > 4 sigma, and the
# generators are seeded, so these tests are deterministic.
TOL = 0.015
PROBS = torch.tensor([0.35, 0.25, 0.15, 0.10, 0.06, 0.04, 0.03, 0.02])


def build(
    params: list[SamplingParams], outputs=None, prompts=None, vocab: int = V
) -> SamplingBatch:
    outputs = outputs if outputs is not None else [[] for _ in params]
    prompts = prompts if prompts is not None else [[] for _ in params]
    return SamplingBatch.build(params, prompts, outputs, vocab, "cpu")


def empirical(params: SamplingParams, logits: torch.Tensor = PROBS.log()) -> torch.Tensor:
    sampler = Sampler(generator=torch.Generator().manual_seed(1234))
    out = sampler(logits.expand(N, -1), build([params] * N))
    return torch.bincount(out.token_ids, minlength=logits.shape[-1]).float() / N


def renorm(p: torch.Tensor, keep: list[int]) -> torch.Tensor:
    q = torch.zeros_like(p)
    q[keep] = p[keep]
    return q / q.sum()


def test_greedy_is_argmax_and_top_k1_matches():
    logits = torch.randn(6, 50, generator=torch.Generator().manual_seed(0))
    expected = logits.argmax(-1)
    for params in (SamplingParams(temperature=0.0), SamplingParams(temperature=1.0, top_k=1)):
        batch = build([params] * 6, vocab=50)
        assert batch.all_greedy
        assert torch.equal(Sampler()(logits, batch).token_ids, expected)


def test_mixed_batch_greedy_rows_stay_greedy():
    logits = torch.zeros(4, 16)
    logits[:, 3] = 2.0  # argmax everywhere; random rows over a flat-ish distribution
    params = [
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=5.0),
        SamplingParams(top_k=1),
        SamplingParams(temperature=5.0, seed=7),
    ]
    picked = torch.stack(
        [
            Sampler(torch.Generator().manual_seed(s))(logits, build(params, vocab=16)).token_ids
            for s in range(40)
        ]
    )
    assert (picked[:, 0] == 3).all() and (picked[:, 2] == 3).all()
    assert (picked[:, 1] != 3).any()  # the random row really samples
    assert (picked[:, 3] == picked[0, 3]).all()  # same seed, same position: same token


def run_steps(seed: int, others: list[SamplingParams], row: int, steps: int = 6) -> list[int]:
    """Generate `steps` tokens for a seeded request placed at `row` among `others`."""
    vocab = 64
    target = SamplingParams(temperature=1.0, top_p=0.95, seed=seed)
    params = others[:row] + [target] + others[row:]
    outputs: list[list[int]] = [[] for _ in params]
    sampler = Sampler(generator=torch.Generator().manual_seed(len(others) * 100 + row))
    for step in range(steps):
        # The target's logits depend only on the step; other rows get arbitrary logits.
        logits = torch.randn(len(params), vocab, generator=torch.Generator().manual_seed(99 + row))
        logits[row] = torch.randn(vocab, generator=torch.Generator().manual_seed(step)) * 0.5
        # Other rows have generated different amounts, so output positions differ per row.
        out = sampler(logits, build(params, outputs=outputs, vocab=vocab)).token_ids.tolist()
        for i, tok in enumerate(out):
            outputs[i].append(tok)
    return outputs[row]


def test_seed_reproducible_whatever_the_batch():
    alone = run_steps(42, [], 0)
    others = [
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=0.7, top_k=5, seed=3),
        SamplingParams(temperature=1.3, min_p=0.1, presence_penalty=0.5),
        SamplingParams(),
    ]
    assert run_steps(42, others, 2) == alone
    assert run_steps(42, others[:1], 1) == alone
    assert run_steps(42, others[1:], 0) == alone


def test_seed_depends_on_output_position_only():
    """A preempted request re-run from the same position replays the same token."""
    logits = torch.zeros(1, 64)
    p = SamplingParams(seed=5)
    a = Sampler()(logits, build([p], outputs=[[1, 2, 3]], vocab=64)).token_ids
    b = Sampler()(logits, build([p], outputs=[[9, 9, 9]], vocab=64)).token_ids
    assert torch.equal(a, b)
    # ...while each new position draws fresh noise.
    steps = [build([p], outputs=[[0] * n], vocab=64) for n in range(8)]
    assert len({Sampler()(logits, s).token_ids.item() for s in steps}) > 1


def test_different_seeds_differ():
    assert run_steps(1, [], 0) != run_steps(2, [], 0)


@pytest.mark.parametrize(
    "params, expected",
    [
        (SamplingParams(temperature=1.0), PROBS),
        (SamplingParams(temperature=0.5), torch.softmax(PROBS.log() / 0.5, -1)),
        (SamplingParams(top_k=3), renorm(PROBS, [0, 1, 2])),
        # Exclusive mass above tokens: 0, .35, .60, .75 -> keep 3 for top_p=0.7.
        (SamplingParams(top_p=0.7), renorm(PROBS, [0, 1, 2])),
        # Top-p applies to the top-k renormalised mass (.467, .333, .2): .467 < .75 <= .8 -> 2.
        (SamplingParams(top_k=3, top_p=0.75), renorm(PROBS, [0, 1])),
        # min_p=0.5 drops prob < 0.175.
        (SamplingParams(min_p=0.5), renorm(PROBS, [0, 1])),
        # Temperature 2 first (flatter): then min_p=0.5 drops p < 0.5 * max.
        (
            SamplingParams(temperature=2.0, min_p=0.5),
            renorm(torch.softmax(PROBS.log() / 2, -1), [0, 1, 2, 3]),
        ),
    ],
)
def test_sampled_distribution(params: SamplingParams, expected: torch.Tensor):
    got = empirical(params)
    assert (got - expected).abs().max() < TOL, (got, expected)
    assert (got[expected == 0] == 0).all()  # filtered tokens are never drawn


def test_penalties_match_reference_loop():
    gen = torch.Generator().manual_seed(0)
    vocab = 10
    logits = torch.randn(4, vocab, generator=gen) * 3
    params = [
        SamplingParams(repetition_penalty=1.5, frequency_penalty=0.4, presence_penalty=0.3),
        SamplingParams(),  # untouched row in a penalised batch
        SamplingParams(temperature=0.0, repetition_penalty=0.7, presence_penalty=-1.0),
        SamplingParams(frequency_penalty=-0.5),
    ]
    prompts = [[1, 2, 2, 5], [0, 1], [3, 3, 4], []]
    outputs = [[2, 2, 7, 7, 7], [0], [], [4, 4, 9]]
    batch = build(params, outputs=outputs, prompts=prompts, vocab=vocab)
    got = apply_penalties(logits, batch)

    ref = logits.clone()
    for b, p in enumerate(params):
        for t in range(vocab):
            x = ref[b, t].item()
            if t in prompts[b] or t in outputs[b]:
                x = x / p.repetition_penalty if x > 0 else x * p.repetition_penalty
            count = outputs[b].count(t)
            x -= p.frequency_penalty * count + p.presence_penalty * (count > 0)
            ref[b, t] = x
    torch.testing.assert_close(got, ref)
    assert torch.equal(got[1], logits[1])
    assert build(params[1:2], vocab=vocab).no_penalties  # fast path: nothing built
    assert apply_penalties(logits, build([SamplingParams()] * 4, vocab=vocab)) is logits


def test_greedy_uses_penalised_logits():
    logits = torch.tensor([[0.0, 2.0, 1.5, 0.0]])
    p = SamplingParams(temperature=0.0, repetition_penalty=2.0)
    assert Sampler()(logits, build([p], outputs=[[1]], vocab=4)).token_ids.item() == 2


def test_logprobs_from_raw_logits_for_the_rows_asked():
    gen = torch.Generator().manual_seed(3)
    vocab = 32
    logits = torch.randn(4, vocab, generator=gen).to(torch.bfloat16)
    rows, tokens, top_n = [0, 2, 3], [7, 1, 30], [2, 5, 0]
    got = token_logprobs(logits, rows, tokens, top_n)
    raw = torch.log_softmax(logits.float(), -1)
    assert [len(lp.top_ids) for lp in got] == top_n
    for lp, row, token, n in zip(got, rows, tokens, top_n):
        assert lp.logprob == pytest.approx(raw[row, token].item())
        assert lp.top_ids == (raw[row].topk(n).indices.tolist() if n else [])
        assert lp.top_logprobs == pytest.approx(raw[row].topk(n).values.tolist())


def test_logit_bias_forces_and_bans_tokens_and_leaves_logprobs_raw():
    logits = torch.randn(3, V, generator=torch.Generator().manual_seed(3))
    forced = SamplingParams(temperature=0.0, logit_bias={5: 100.0}, logprobs=1)
    banned_top = int(logits[1].argmax())
    banned = SamplingParams(temperature=0.0, logit_bias={banned_top: -100.0})
    plain = SamplingParams(temperature=0.0)
    out = Sampler()(logits, build([forced, banned, plain]))
    assert out.token_ids[0] == 5
    (lp,) = token_logprobs(logits, [0], [5], [1])
    assert out.token_ids[1] != banned_top
    assert out.token_ids[1] == int(logits[1].topk(2).indices[1])  # the runner-up
    assert out.token_ids[2] == int(logits[2].argmax())  # rows without a bias are untouched
    raw = torch.log_softmax(logits[0], dim=-1)[5]  # logprobs stay those of the raw logits
    assert lp.logprob == pytest.approx(raw.item())


def test_logit_bias_reshapes_the_sampled_distribution():
    """Bias b multiplies a token's odds by e^b: -100 removes it, log(2) doubles it."""
    params = SamplingParams(temperature=1.0, logit_bias={0: -100.0, 1: math.log(2.0)})
    expected = PROBS.clone()
    expected[0] = 0.0
    expected[1] *= 2.0
    got = empirical(params)
    assert got[0] == 0.0
    assert (got - expected / expected.sum()).abs().max() < TOL


def reference_probs(
    logits: list[float], p: SamplingParams, prompt: list[int], output: list[int]
) -> list[float]:
    """One row in plain Python, in vLLM V1's order: logit_bias, repetition, frequency and
    presence penalties, temperature, softmax, min-p, top-k, then top-p over what is left."""
    x = list(logits)
    for t, b in (p.logit_bias or {}).items():
        x[t] += b
    for t in range(len(x)):
        if t in prompt or t in output:
            r = p.repetition_penalty
            x[t] = x[t] / r if x[t] > 0 else x[t] * r
        x[t] -= p.frequency_penalty * output.count(t) + p.presence_penalty * (t in output)
    e = [math.exp(v / p.temperature - max(x) / p.temperature) for v in x]
    probs = [v / sum(e) for v in e]
    keep = set(range(len(x)))
    if p.min_p > 0:
        keep = {t for t in keep if probs[t] >= p.min_p * max(probs)}
    ranked = sorted(keep, key=lambda t: -probs[t])
    if 0 < p.top_k < len(x):
        ranked = ranked[: p.top_k]
    if p.top_p < 1.0:
        total, above, kept = sum(probs[t] for t in ranked), 0.0, []
        for t in ranked:  # smallest set whose renormalised mass reaches top_p
            if above >= p.top_p * total:
                break
            kept.append(t)
            above += probs[t]
        ranked = kept
    mass = sum(probs[t] for t in ranked)
    return [probs[t] / mass if t in ranked else 0.0 for t in range(len(x))]


ORDER_CASES = [
    # logit_bias before the repetition penalty: (l + b) / r, not l / r + b.
    SamplingParams(repetition_penalty=2.0, logit_bias={1: 3.0, 4: -1.0}),
    SamplingParams(repetition_penalty=0.5, frequency_penalty=0.3, logit_bias={0: 2.0}),
    # min-p before top-p: top-p's mass is what min-p left.
    SamplingParams(min_p=0.3, top_p=0.8),
    SamplingParams(temperature=0.7, min_p=0.2, top_k=4, top_p=0.6),
    SamplingParams(temperature=1.5, top_k=3, top_p=0.9, presence_penalty=0.5),
    SamplingParams(
        temperature=0.9, min_p=0.1, top_p=0.7, repetition_penalty=1.3, logit_bias={2: 1.5}
    ),
]


def test_order_matches_vllm_reference_loop():
    vocab = 12
    gen = torch.Generator().manual_seed(11)
    logits = torch.randn(len(ORDER_CASES), vocab, generator=gen) * 2
    prompts = [[1, 2, 3], [0, 0, 5], [], [4], [1, 6, 7], [2, 8]]
    outputs = [[1, 1, 9], [0], [], [3, 3], [6, 6, 6], [2, 10]]
    batch = build(ORDER_CASES, outputs=outputs, prompts=prompts, vocab=vocab)
    got = filtered_probs(apply_penalties(logits, batch), batch)
    for row, p in enumerate(ORDER_CASES):
        want = reference_probs(logits[row].tolist(), p, prompts[row], outputs[row])
        torch.testing.assert_close(got[row], torch.tensor(want), atol=1e-5, rtol=1e-4)


def test_order_matters_in_these_cases():
    """Guards the cases above: in the other order (penalties then bias; min-p last) the
    distributions differ, so the reference test tells the orders apart."""
    logits = torch.tensor([[2.0, 1.0, 0.5, 0.0]])
    p = SamplingParams(repetition_penalty=2.0, logit_bias={1: 3.0})
    batch = build([p], outputs=[[1]], vocab=4)
    got = apply_penalties(logits, batch)[0, 1].item()
    assert got == pytest.approx((1.0 + 3.0) / 2.0)  # not 1.0 / 2.0 + 3.0
    # min_p=0.3 drops p < .105 (tokens 4..7), leaving mass .85; top_p=0.7 of that is .595, and
    # token 2 has .60 above it: only 0 and 1 stay. Top-p first would keep 2 (.60 < .70).
    q = filtered_probs(PROBS.log()[None], build([SamplingParams(min_p=0.3, top_p=0.7)]))[0]
    assert (q > 0).tolist() == [True, True, False, False, False, False, False, False]


def test_device_state_matches_token_lists():
    """The runner's per-request device state (counts updated step by step, verify rows seeing
    the drafts ahead of them) penalises exactly as the token lists would."""
    vocab = 16
    params = [
        SamplingParams(repetition_penalty=1.4, frequency_penalty=0.5, logit_bias={3: 2.0}),
        SamplingParams(),
        SamplingParams(presence_penalty=0.7, logit_bias={1: -1.0, 2: 1.0}),
    ]
    prompts = [[1, 2, 2], [4], [5, 6]]
    outputs = [[7, 7], [8], []]
    states = [RequestSampling(p, pr, [], vocab, "cpu") for p, pr in zip(params, prompts)]
    for state, out in zip(states, outputs):
        for token in out:  # one step at a time, as the runner appends them
            state.add([token])
    drafts = [9, 7, 9]  # request 0 verifies 3 drafts: 4 rows; the others one row each
    rows = [Row(states[0], 2 + j, drafts[:j]) for j in range(4)]
    rows += [Row(states[1], 1), Row(states[2], 0)]
    got = batch_for(rows, vocab, "cpu")
    row_params = [params[0]] * 4 + params[1:]
    want = SamplingBatch.build(
        row_params,
        [prompts[0]] * 4 + prompts[1:],
        [outputs[0] + drafts[:j] for j in range(4)] + outputs[1:],
        vocab,
        "cpu",
    )
    logits = torch.randn(len(rows), vocab, generator=torch.Generator().manual_seed(2))
    torch.testing.assert_close(apply_penalties(logits, got), apply_penalties(logits, want))
    assert got.penalties is not None and got.penalties.rows.tolist() == [0, 1, 2, 3, 5]
    assert got.seeded == want.seeded


def test_exponential_noise_is_exp1_finite_and_positive() -> None:
    """The race's noise: Exp(1) by its moments and tail (P(q > t) = e^-t), and never 0 or
    infinite, even where the uniforms underneath hit their end points."""
    gen = torch.Generator().manual_seed(0)
    q = exponential_noise((2_000_000,), gen, torch.device("cpu"))
    assert q.dtype == torch.float32 and bool(torch.isfinite(q).all()) and float(q.min()) > 0
    assert abs(float(q.mean()) - 1) < 0.005 and abs(float(q.var()) - 1) < 0.01
    for t in (0.05, 0.5, 1.0, 2.0, 4.0):
        assert abs(float((q > t).double().mean()) / math.exp(-t) - 1) < 0.03
    again = exponential_noise((2_000_000,), torch.Generator().manual_seed(0), torch.device("cpu"))
    assert torch.equal(q, again)  # a function of the generator's state


def test_argmax_rows_is_argmax_with_ties_nan_and_infinities():
    # Greedy picks go through argmax_rows (max(dim).indices, faster on CPU): it must give
    # Tensor.argmax's index everywhere, including the first of tied maxima and a NaN.
    x = torch.randint(0, 3, (64, 4096)).float()  # many ties per row
    x[1, 10] = x[1, 20] = float("nan")
    x[2] = -float("inf")
    x[3, 7] = float("inf")
    assert torch.equal(argmax_rows(x), x.argmax(dim=-1))
    assert argmax_rows(x)[1] == 10 and argmax_rows(x)[2] == 0
    y = torch.randn(5, 49152).bfloat16()
    assert torch.equal(argmax_rows(y), y.argmax(dim=-1))
