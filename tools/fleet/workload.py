"""A shared-prefix workload and the replicas' prefix-cache counters (tests/fleet,
benchmarks/fleet.py).

Many chat products send one long system prompt per tenant or task ahead of a short question.
Here: `groups` distinct prefixes, `per_group` requests each, in a seeded shuffled order. On R
replicas a router that ignores the prompt makes every replica miss each prefix once (about
`groups * R` misses); a cache-aware one sends a prefix back where it is cached (about `groups`).
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from prometheus_client.parser import text_string_to_metric_families

_WORDS = (
    "king", "crown", "sword", "castle", "night", "storm", "ghost", "honour", "love", "death",
    "blood", "night", "sea", "ship", "wind", "father", "daughter", "son", "queen", "lord", "lady",
    "court", "banquet", "letter", "poison", "dagger", "battle", "field", "tower", "moon", "star",
    "fortune", "fool", "jest", "masque", "forest", "shepherd", "river", "bridge", "gold",
    "silver",
)  # fmt: skip


def shared_prefix_prompts(
    groups: int, per_group: int, prefix_words: int = 150, seed: int = 0
) -> list[str]:
    """Prompts `Scene g` + a prefix of `prefix_words` words + a question of its own. The seed
    picks the words too, so runs with different seeds share no prefix."""
    rng = random.Random(seed)
    prefixes = [
        f"Scene {seed}-{g}. " + " ".join(rng.choices(_WORDS, k=prefix_words)) for g in range(groups)
    ]
    prompts = [
        f"{p}\nQuestion {i}: " + " ".join(rng.choices(_WORDS, k=8)) + "?"
        for p in prefixes
        for i in range(per_group)
    ]
    rng.shuffle(prompts)
    return prompts


@dataclass(frozen=True)
class PrefixCounters:
    queries: float  # prompt tokens looked up in the prefix cache
    hits: float  # of which found there

    def __sub__(self, other: PrefixCounters) -> PrefixCounters:
        return PrefixCounters(self.queries - other.queries, self.hits - other.hits)

    def __add__(self, other: PrefixCounters) -> PrefixCounters:
        return PrefixCounters(self.queries + other.queries, self.hits + other.hits)

    @property
    def hit_rate(self) -> float:
        return self.hits / self.queries if self.queries else 0.0


def prefix_counters(metrics_text: str) -> PrefixCounters:
    """stoker:prefix_cache_queries / _hits from one replica's /metrics page."""
    values: dict[str, float] = {}
    for family in text_string_to_metric_families(metrics_text):
        for sample in family.samples:
            values[sample.name] = sample.value
    return PrefixCounters(
        values.get("stoker:prefix_cache_queries_total", 0.0),
        values.get("stoker:prefix_cache_hits_total", 0.0),
    )
