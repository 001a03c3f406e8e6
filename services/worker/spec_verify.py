"""Verify draft tokens against the target model (speculative decoding).

Greedy requests accept the longest prefix of drafts equal to the target's argmax, plus the
target's next token. Sampled requests use rejection sampling (Leviathan et al. 2023, Chen et
al. 2023): draft d at position j is accepted with probability min(1, p_j(d) / q_j(d)); at the
first rejection a token is drawn from normalise(max(p_j - q_j, 0)); if every draft passes, a
bonus token is drawn from p_{k}. So output tokens are distributed exactly as the target's p,
where p is the target's distribution after logit_bias, penalties, temperature, min-p, top-k
and top-p, and q is the proposer's (one-hot on d for n-gram proposals).

Seeded requests verify differently, so that their output never depends on k, on whether a
position was drafted at all, or on the batch: the target's token at each output position is
drawn by the same exponential race, with the same (seed, position) noise, as a plain decode
would draw it, and a draft is accepted iff it equals that token. Each token is still distributed
as p. For one-hot (n-gram) proposals the acceptance probability, p(d), is that of rejection
sampling; the draft model draws its seeded proposals with the same noise, which makes
agreement likely when q is close to p (docs/speculation.md).
"""

from __future__ import annotations

import dataclasses

import torch

from stoker.services.worker.sampler import (
    SamplingBatch,
    apply_penalties,
    argmax_rows,
    race,
    race_probs,
)
from stoker.services.worker.sampling_noise import exponential_noise, seeded_noise


@dataclasses.dataclass
class VerifyGroup:
    """One request's k + 1 rows of target logits: positions of its last token and k drafts."""

    start: int  # first row in the logits
    drafts: list[int]
    draft_probs: torch.Tensor | None  # [k, V] proposer distribution q; None: one-hot (n-gram)
    greedy: bool
    seed: int | None
    output_pos: int  # output tokens before this step (seeds the request's own noise stream)


def verify(
    logits: torch.Tensor,
    batch: SamplingBatch,
    groups: list[VerifyGroup],
    generator: torch.Generator | None = None,
) -> list[list[int]]:
    """logits [R, V] (raw), `batch` rows aligned with them. Returns each group's output tokens:
    the accepted drafts plus one token from the target (1 to k + 1 tokens)."""
    logits = apply_penalties(logits.float(), batch)
    argmax = argmax_rows(logits).tolist()
    probs = None if batch.all_greedy else race_probs(logits, batch)
    out: list[list[int]] = []
    for g in groups:
        k = len(g.drafts)
        if g.greedy:
            out.append(accept_equal(g.drafts, argmax[g.start : g.start + k + 1]))
            continue
        assert probs is not None
        p = probs[g.start : g.start + k + 1]
        if g.seed is not None:
            out.append(accept_equal(g.drafts, _seeded_tokens(p, g)))
        else:
            out.append(_rejection_sample(p / p.sum(dim=-1, keepdim=True), g, generator))
    return out


def accept_equal(drafts: list[int], target: list[int]) -> list[int]:
    """The drafts up to the first that differs from the target's token there, then that token."""
    accepted = 0
    while accepted < len(drafts) and drafts[accepted] == target[accepted]:
        accepted += 1
    return drafts[:accepted] + [target[accepted]]


def _seeded_tokens(p: torch.Tensor, g: VerifyGroup) -> list[int]:
    """The token a plain decode would sample at each of the k + 1 output positions."""
    V = p.shape[-1]
    noise = torch.stack(
        [seeded_noise(g.seed, g.output_pos + j, V, p.device) for j in range(len(p))]
    )
    return race(p, noise).tolist()


def _rejection_sample(
    p: torch.Tensor, g: VerifyGroup, generator: torch.Generator | None
) -> list[int]:
    k = len(g.drafts)
    drafts = torch.tensor(g.drafts, device=p.device)
    rows = torch.arange(k, device=p.device)
    p_d = p[rows, drafts]
    q_d = torch.ones_like(p_d) if g.draft_probs is None else g.draft_probs[rows, drafts]
    u = torch.rand(k, generator=generator, device=p.device)
    passed = (u * q_d < p_d).tolist()  # u < p/q, without dividing by q = 0
    accepted = passed.index(False) if False in passed else k
    if accepted < k:
        q = (
            g.draft_probs[accepted]
            if g.draft_probs is not None
            else _one_hot(g.drafts[accepted], p)
        )
        residual = (p[accepted] - q).clamp_min_(0.0)
        if residual.sum() <= 0:  # p <= q everywhere: rejection had probability 0; be safe
            residual = p[accepted]
    else:
        residual = p[k]  # every draft passed: the bonus token comes from the target
    noise = exponential_noise(residual.shape, generator, residual.device)
    token = int((residual / noise).argmax())
    return g.drafts[:accepted] + [token]


def _one_hot(token: int, like: torch.Tensor) -> torch.Tensor:
    q = torch.zeros_like(like[0])
    q[token] = 1.0
    return q
