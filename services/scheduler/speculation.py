"""Speculation policy on the scheduler side (sans-IO): whether a step speculates, how many
draft tokens each request gets, n-gram proposals, and the acceptance counters.

Adaptive policy (docs/speculation.md):
- k per request follows an exponential moving average of its accepted drafts per verify:
  k = clamp(round(ema) + 1, 1, K). A request whose drafts keep failing drops to k = 1; a verify
  that accepts every draft lifts the average to k, so the next one gets k + 1, back up to K.
  With ngram_first, K is the n-gram's k (8) for a match's ids, and the model's drafts stay
  capped at its own k.
- A request whose average is below `row_cost x (decoding requests - 1)` sits out the step's
  drafts: every draft row adds to a batched forward's cost, the more so the larger the batch,
  and a request accepting little pays for none of its rows. Every PROBE_EVERY x (decoding
  requests - 1)-th step it sits out, it verifies one draft again, so a request that starts
  copying (or a head that starts agreeing) gets drafts back; the interval grows with the batch
  so that probes cost the batch about the same share of its steps at any size (a head's probe
  first catches it up over every token it skipped). Alone in the batch it always drafts:
  there, on any device, a few extra rows cost next to nothing.
- A step with more decoding requests than `max_batch` does not speculate: at that size the
  forward is no longer dominated by fixed per-step cost, so verifying k extra positions per
  request costs about as much as the tokens it would save.
"""

from __future__ import annotations

from stoker.common.config import NGRAM_SPECULATIVE_TOKENS, EngineConfig
from stoker.common.messages import SpecStats
from stoker.services.scheduler.request import Request

EMA_WEIGHT = 0.5  # recent verifies dominate: acceptance shifts quickly within one answer
PROBE_EVERY = 8  # a request sitting out drafts verifies one again after this many steps


class NgramIndex:
    """Prompt-lookup index for one request: for each n-gram (n in [min_n, max_n]), where the
    token after its most recent occurrence sits. Updated per appended token, so a proposal is a
    few dict probes, never a scan of the context."""

    __slots__ = ("min_n", "max_n", "next_pos", "indexed")

    def __init__(self, min_n: int, max_n: int) -> None:
        self.min_n, self.max_n = min_n, max_n
        self.next_pos: dict[tuple[int, ...], int] = {}
        self.indexed = 0  # tokens[:indexed] are in the index

    def update(self, tokens: list[int]) -> None:
        for p in range(max(self.indexed, 1), len(tokens)):
            for n in range(self.min_n, self.max_n + 1):
                if p >= n:
                    self.next_pos[tuple(tokens[p - n : p])] = p
        self.indexed = len(tokens)

    def propose(self, tokens: list[int], k: int) -> list[int]:
        """Continuation of the longest suffix seen earlier: the tokens that followed it."""
        self.update(tokens)
        for n in range(self.max_n, self.min_n - 1, -1):
            if len(tokens) <= n:
                continue
            start = self.next_pos.get(tuple(tokens[-n:]))
            # The suffix's own occurrence ends at len(tokens) and is registered only once the
            # next token exists, so `start` always points into known tokens.
            if start is not None:
                return tokens[start : start + k]
        return []


class SpecPolicy:
    def __init__(
        self,
        method: str,
        num_tokens: int,
        adaptive: bool = True,
        max_batch: int = 8,
        row_cost: float = 0.0,
        ngram_first: bool = False,
        ngram_k: int | None = None,
        ngram_min: int = 2,
        ngram_max: int = 4,
    ) -> None:
        self.method = method
        # With ngram_first, an n-gram match may offer more drafts than the model does: its ids
        # cost nothing to propose, and a copying request accepts long runs of them. The
        # adaptive k climbs past the model's k only through verifies that accepted all drafts.
        # n-gram alone has no model: its k is num_tokens, as set (or defaulted to ngram_k).
        ngram_first = ngram_first and method != "ngram"
        self.model_k = num_tokens
        self.max_k = max(num_tokens, ngram_k or 0) if ngram_first else num_tokens
        self.adaptive = adaptive
        self.max_batch = max_batch
        self.row_cost = row_cost
        self.ngram_first = ngram_first  # draft method: an n-gram match's ids before the model's
        self.min_accept = 0.0  # this step's: the accepted drafts per verify a request must average
        self.probe_every = PROBE_EVERY  # this step's: a sitting-out request's steps between probes
        self.ngram_min, self.ngram_max = ngram_min, ngram_max
        self.stats = SpecStats(accepted_per_position=[0] * self.max_k)

    @classmethod
    def from_config(cls, config: EngineConfig) -> SpecPolicy | None:
        if config.speculative is None or config.null_model:
            return None
        # Both resolved by the config: k per method, the row cost per device.
        assert config.num_speculative_tokens is not None
        assert config.speculative_row_cost is not None
        return cls(
            config.speculative,
            config.num_speculative_tokens,
            adaptive=config.speculative_adaptive,
            max_batch=config.speculative_max_batch,
            row_cost=config.speculative_row_cost,
            ngram_first=config.speculative_ngram_first,
            ngram_k=NGRAM_SPECULATIVE_TOKENS,
        )

    def enabled_for_step(self, num_decoding: int) -> bool:
        if self.adaptive and num_decoding > self.max_batch:
            self.stats.disabled_steps += 1
            return False
        self.min_accept = self.row_cost * max(0, num_decoding - 1)
        self.probe_every = PROBE_EVERY * max(1, num_decoding - 1)
        return True

    def num_drafts(self, request: Request) -> int:
        """Drafts for `request` this step (0: it sits the step out)."""
        ema = request.spec_ema
        if not self.adaptive or ema is None:
            return self.max_k
        if ema < self.min_accept:
            request.spec_paused += 1
            if request.spec_paused < self.probe_every:
                self.stats.paused_drafts += 1
                return 0
            request.spec_paused = 0
            return 1  # the probe
        request.spec_paused = 0
        return max(1, min(self.max_k, int(ema + 0.5) + 1))

    def propose(self, request: Request, k: int) -> list[int] | int:
        """n-gram: the draft ids (possibly fewer than k, or none). draft model: k (at most the
        model's k), or with ngram_first the ids of an n-gram match when there is one (free to
        propose, and where the output copies its context more often right than a model's
        drafts)."""
        if self.method != "ngram" and not self.ngram_first:
            return min(k, self.model_k)
        if request.ngram_index is None:
            request.ngram_index = NgramIndex(self.ngram_min, self.ngram_max)
        ids = request.ngram_index.propose(request.token_ids, k)
        return ids if ids or self.method == "ngram" else min(k, self.model_k)

    def on_result(self, request: Request, num_drafts: int, num_accepted: int) -> None:
        s = self.stats
        s.drafts += 1
        s.draft_tokens += num_drafts
        s.accepted_tokens += num_accepted
        for j in range(num_accepted):
            s.accepted_per_position[j] += 1
        request.num_draft_tokens += num_drafts
        request.num_accepted_tokens += num_accepted
        # A first verify averages against the model's k: a head's request decays as it did
        # before n-gram matches could offer more.
        previous = self.model_k if request.spec_ema is None else request.spec_ema
        ema = EMA_WEIGHT * num_accepted + (1 - EMA_WEIGHT) * previous
        # All accepted: the request could have taken more, so offer one more next time.
        request.spec_ema = max(ema, num_drafts) if num_accepted == num_drafts else ema
