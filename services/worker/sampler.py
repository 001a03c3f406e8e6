"""Batched, vectorised token sampler (vLLM semantics).

One call handles a whole step: penalties -> greedy argmax or temperature -> top-k -> top-p ->
min-p -> exponential-race sampling, plus logprobs taken from the RAW logits (vLLM V1 default).
There is no per-token Python work; the only Python loop is over *seeded* requests, each of which
draws its noise from its own generator so its tokens do not depend on the rest of the batch.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from common.sampling_params import SamplingParams

_SEED_MIX = 1_000_003  # seed * _SEED_MIX + position: distinct streams per (seed, output position)
_MASK63 = (1 << 63) - 1  # torch.Generator.manual_seed takes a non-negative 64-bit value


@dataclass
class SamplerOutput:
    token_ids: torch.Tensor  # [B] int64
    logprobs: torch.Tensor | None  # [B] float32 logprob of the chosen token; None if no row asked
    top_ids: torch.Tensor | None  # [B, K] int64, K = max requested top-n (callers slice per row)
    top_logprobs: torch.Tensor | None  # [B, K] float32, sorted descending


@dataclass
class SamplingBatch:
    """Everything the sampler needs for one step, built once per step from per-request state.

    Optional tensors are None when no row needs them, so the sampler can skip that stage.
    Filter tensors (top_k/top_p/min_p) hold "off" values on rows that do not use them.
    """

    vocab_size: int
    greedy: torch.Tensor  # [B] bool
    temperature: torch.Tensor  # [B] float32; 1.0 on greedy rows so dividing is harmless
    top_k: torch.Tensor | None  # [B] int64 in [1, V]; V = off
    top_p: torch.Tensor | None  # [B] float32; 2.0 = off (avoids float cumsum reaching exactly 1)
    min_p: torch.Tensor | None  # [B] float32; 0 = off
    presence: torch.Tensor | None  # [B] float32
    frequency: torch.Tensor | None  # [B] float32
    repetition: torch.Tensor | None  # [B] float32
    prompt_ids: torch.Tensor | None  # [B, Lp] int64 padded with V; only if repetition is used
    output_ids: torch.Tensor | None  # [B, Lo] int64 padded with V; only if penalties are used
    bias: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None  # logit_bias: rows, ids, values
    seeded: list[tuple[int, int]]  # (row, generator seed mixed from (seed, output position))
    max_num_logprobs: int | None  # None: no row asked for logprobs
    all_greedy: bool
    all_random: bool
    no_penalties: bool
    no_top_k: bool
    no_top_p: bool
    no_min_p: bool

    @property
    def no_logprobs(self) -> bool:
        return self.max_num_logprobs is None

    @classmethod
    def build(
        cls,
        params: list[SamplingParams],
        prompt_ids: list[Sequence[int]],
        output_ids: list[Sequence[int]],
        vocab_size: int,
        device: torch.device | str,
    ) -> SamplingBatch:
        """`output_ids[i]` are the tokens request i generated before this step; its length is the
        output position that seeds the request's noise (so a preempted request replays exactly)."""
        V = vocab_size
        greedy = [p.greedy for p in params]
        # Filters only matter on random rows: a greedy row's top_k=1 must not trigger the sort.
        rand = [p for p, g in zip(params, greedy, strict=True) if not g]

        def f32(vals: list[float]) -> torch.Tensor:
            return torch.tensor(vals, dtype=torch.float32, device=device)

        no_top_k = all(p.top_k <= 0 or p.top_k >= V for p in rand)
        no_top_p = all(p.top_p >= 1.0 for p in rand)
        no_min_p = all(p.min_p <= 0.0 for p in rand)
        no_penalties = not any(p.uses_penalties for p in params)
        use_repetition = any(p.repetition_penalty != 1.0 for p in params)
        asked = [p.logprobs for p in params if p.logprobs is not None]

        return cls(
            vocab_size=V,
            greedy=torch.tensor(greedy, dtype=torch.bool, device=device),
            temperature=f32(
                [1.0 if g else p.temperature for p, g in zip(params, greedy, strict=True)]
            ),
            top_k=None
            if no_top_k
            else torch.tensor(
                [p.top_k if 0 < p.top_k < V else V for p in params],
                dtype=torch.int64,
                device=device,
            ),
            top_p=None if no_top_p else f32([p.top_p if p.top_p < 1.0 else 2.0 for p in params]),
            min_p=None if no_min_p else f32([p.min_p for p in params]),
            presence=None if no_penalties else f32([p.presence_penalty for p in params]),
            frequency=None if no_penalties else f32([p.frequency_penalty for p in params]),
            repetition=None if no_penalties else f32([p.repetition_penalty for p in params]),
            prompt_ids=_pad(prompt_ids, V, device) if use_repetition else None,
            output_ids=None if no_penalties else _pad(output_ids, V, device),
            bias=_bias(params, device),
            seeded=[
                (i, (p.seed * _SEED_MIX + len(out)) & _MASK63)
                for i, (p, out) in enumerate(zip(params, output_ids, strict=True))
                if p.seed is not None and not p.greedy
            ],
            max_num_logprobs=min(max(asked), V) if asked else None,
            all_greedy=all(greedy),
            all_random=not any(greedy),
            no_penalties=no_penalties,
            no_top_k=no_top_k,
            no_top_p=no_top_p,
            no_min_p=no_min_p,
        )


def _bias(
    params: list[SamplingParams], device: torch.device | str
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """Every row's logit_bias as flat (rows, token ids, values), or None when no row has one."""
    entries = [
        (row, token, value)
        for row, p in enumerate(params)
        for token, value in (p.logit_bias or {}).items()
    ]
    if not entries:
        return None
    rows, ids, values = zip(*entries)
    return (
        torch.tensor(rows, dtype=torch.int64, device=device),
        torch.tensor(ids, dtype=torch.int64, device=device),
        torch.tensor(values, dtype=torch.float32, device=device),
    )


def _pad(seqs: list[Sequence[int]], pad: int, device: torch.device | str) -> torch.Tensor:
    """[B, max_len] int64, padded with `pad` (= V, an extra count column that is dropped)."""
    width = max((len(s) for s in seqs), default=0)
    rows = [list(s) + [pad] * (width - len(s)) for s in seqs]
    return torch.tensor(rows, dtype=torch.int64).reshape(len(seqs), width).to(device)


def _counts(ids: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[B, V] occurrence counts of each token id in the padded [B, L] `ids`."""
    counts = torch.zeros(ids.shape[0], vocab_size + 1, dtype=torch.int64, device=ids.device)
    counts.scatter_add_(1, ids, torch.ones_like(ids))
    return counts[:, :vocab_size]


def apply_penalties(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """Out-of-place vLLM penalties, then logit_bias, on float32 [B, V] logits.

    Repetition (tokens in prompt OR output): positive logits / p, others * p. Then frequency
    (f * output count) and presence (p * [output count > 0]) are subtracted, and each row's
    logit_bias values added to their tokens (OpenAI semantics: -100 bans, +100 forces).
    """
    if not batch.no_penalties:
        logits = _penalise(logits, batch)
    if batch.bias is not None:
        rows, ids, values = batch.bias
        logits = logits.index_put((rows, ids), values, accumulate=True)
    return logits


def _penalise(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    assert batch.output_ids is not None and batch.presence is not None
    assert batch.frequency is not None and batch.repetition is not None
    V = batch.vocab_size
    out_counts = _counts(batch.output_ids, V)
    if batch.prompt_ids is not None:
        seen = (out_counts > 0) | (_counts(batch.prompt_ids, V) > 0)
        rep = batch.repetition[:, None].expand_as(logits)
        penalised = torch.where(logits > 0, logits / rep, logits * rep)
        logits = torch.where(seen, penalised, logits)
    return (
        logits
        - batch.frequency[:, None] * out_counts
        - batch.presence[:, None] * (out_counts > 0).to(logits.dtype)
    )


class Sampler:
    """Stateless apart from `generator`, the batch-wide noise source for unseeded rows (e.g. the
    engine's global seed); it must live on the logits' device. None uses torch's default."""

    def __init__(self, generator: torch.Generator | None = None) -> None:
        self.generator = generator

    def __call__(self, logits: torch.Tensor, batch: SamplingBatch) -> SamplerOutput:
        raw = logits.float()
        logits = apply_penalties(raw, batch)
        greedy_ids = None if batch.all_random else logits.argmax(dim=-1)
        if batch.all_greedy:
            assert greedy_ids is not None
            token_ids = greedy_ids
        else:
            token_ids = self._sample(logits, batch)
            if greedy_ids is not None:
                token_ids = torch.where(batch.greedy, greedy_ids, token_ids)
        return _with_logprobs(raw, token_ids, batch)

    def _sample(self, logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
        probs = torch.softmax(logits / batch.temperature[:, None], dim=-1)
        probs = _filter(probs, batch)
        # Exponential race: argmax(p / q), q ~ Exp(1) picks i with probability p_i / sum(p), with
        # no normalisation and no host sync (unlike torch.multinomial).
        return probs.div_(self._noise(probs, batch)).argmax(dim=-1)

    def _noise(self, probs: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
        q = torch.empty_like(probs)
        if len(batch.seeded) < q.shape[0]:
            q.exponential_(generator=self.generator)
        for row, seed in batch.seeded:  # own stream: independent of batch makeup and position
            gen = torch.Generator(device=probs.device)
            gen.manual_seed(seed)
            q[row].exponential_(generator=gen)
        # Some backends can return exactly 0; p / 0 would give inf (or nan for filtered p = 0).
        return q.clamp_min_(torch.finfo(q.dtype).tiny)


def _filter(probs: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """Zero out tokens removed by top-k, then top-p (over the top-k renormalised mass), then min-p.

    Leaves probs unnormalised: the exponential race does not need it.
    """
    if not (batch.no_top_k and batch.no_top_p):
        sorted_p, order = probs.sort(dim=-1, descending=True)
        drop = torch.zeros_like(sorted_p, dtype=torch.bool)
        if batch.top_k is not None:
            ranks = torch.arange(probs.shape[-1], device=probs.device)
            drop = ranks[None, :] >= batch.top_k[:, None]
            sorted_p = sorted_p.masked_fill(drop, 0.0)
        if batch.top_p is not None:
            cum = sorted_p.cumsum(dim=-1)
            # Keep a token while the mass strictly above it is < top_p * total: the smallest set
            # reaching top_p; the top token (nothing above it) always stays.
            drop |= (cum - sorted_p) >= batch.top_p[:, None] * cum[:, -1:]
        probs = probs.masked_fill(torch.empty_like(drop).scatter_(-1, order, drop), 0.0)
    if batch.min_p is not None:
        # Relative to the max prob, which top-k/top-p never remove: renormalisation cannot matter.
        threshold = batch.min_p[:, None] * probs.amax(dim=-1, keepdim=True)
        probs = probs.masked_fill(probs < threshold, 0.0)
    return probs


def _with_logprobs(
    raw: torch.Tensor, token_ids: torch.Tensor, batch: SamplingBatch
) -> SamplerOutput:
    if batch.max_num_logprobs is None:
        return SamplerOutput(token_ids, None, None, None)
    logprobs = torch.log_softmax(raw, dim=-1)  # raw logits: before penalties and temperature
    chosen = logprobs.gather(-1, token_ids[:, None]).squeeze(-1)
    top_logprobs, top_ids = logprobs.topk(batch.max_num_logprobs, dim=-1)
    return SamplerOutput(token_ids, chosen, top_ids, top_logprobs)


def filtered_probs(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """The distribution random rows sample from, normalised: softmax(logits / temperature), then
    top-k, top-p and min-p. `logits` are float32 and already penalised. Speculative decoding
    verifies drafts against exactly this distribution."""
    probs = _filter(torch.softmax(logits / batch.temperature[:, None], dim=-1), batch)
    return probs / probs.sum(dim=-1, keepdim=True)


def seeded_generator(seed: int, device: torch.device) -> torch.Generator:
    gen = torch.Generator(device=device)
    gen.manual_seed(seed)
    return gen
