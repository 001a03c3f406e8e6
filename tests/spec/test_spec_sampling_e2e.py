"""Sampled (non-greedy) speculation through the whole offline engine, and seeded replay.

The distribution test generates N copies of one prompt (temperature 1, top_k 2, 3 tokens) in a
single batch with a draft model, and compares the empirical joint distribution of the first
three output tokens (8 outcomes) with the target's, computed by transformers:
p(t1) p(t2 | t1) p(t3 | t1, t2). t1 comes from the prefill; t2 and t3 from a verify of k = 2
drafts (accepted drafts, a residual sample, or the bonus). N = 8 000: each outcome's frequency
has std <= sqrt(0.25 / N) ~= 0.0056, and TOL = 0.028 is 5 sigma (deterministic anyway: the
engine is seeded). The bug below shifts outcomes by ~0.045.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from stoker.services.engine import LLM, SamplingParams
from tests.spec.fakes import spec_stats
from tests.spec.spec_models import SpecModels

pytestmark = pytest.mark.timeout(300)  # a broken verify can loop forever
N = 8_000
TOL = 0.028
PROMPT = [17, 230, 45, 99, 310]
TOP_K = 2
PARAMS = SamplingParams(temperature=1.0, top_k=TOP_K, max_tokens=3, ignore_eos=True)


def target_joint(path: Path) -> dict[tuple[int, ...], float]:
    """p(t1, t2, t3) under temperature 1 and top-k 2, from transformers in float64."""
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()

    def next_probs(context: list[int]) -> dict[int, float]:
        with torch.inference_mode():
            logits = model(torch.tensor([context])).logits[0, -1].double()
        top = torch.softmax(logits, dim=-1).topk(TOP_K)
        return dict(zip(top.indices.tolist(), (top.values / top.values.sum()).tolist()))

    joint: dict[tuple[int, ...], float] = {(): 1.0}
    for _ in range(3):
        joint = {
            seq + (t,): p * q
            for seq, p in joint.items()
            for t, q in next_probs(PROMPT + list(seq)).items()
        }
    return joint


def sampled_joint(path: Path, draft: Path, seed: int) -> tuple[dict[tuple[int, ...], float], LLM]:
    llm = LLM(
        str(path),
        seed=seed,
        speculative="draft",
        speculative_model=str(draft),
        speculative_max_batch=N,  # speculate in a batch of N
        num_kv_blocks=N + 64,
        max_num_seqs=N,
        max_num_batched_tokens=8 * N,
    )
    outs = llm.generate([PROMPT] * N, PARAMS, use_tqdm=False)
    counts = Counter(tuple(o.token_ids) for o in outs)
    bm = llm.engine.block_manager
    bm.check_invariants()
    assert bm.num_free_blocks() == bm.num_blocks
    return {seq: n / N for seq, n in counts.items()}, llm


def assert_close(got: dict[tuple[int, ...], float], want: dict[tuple[int, ...], float]) -> None:
    assert set(got) <= set(want), "a token outside the target's top-k came out"
    err = max(abs(got.get(seq, 0.0) - p) for seq, p in want.items())
    assert err < TOL, f"max abs error {err:.4f}\ngot  {got}\nwant {want}"


@pytest.mark.parametrize("draft", [pytest.param("self", marks=pytest.mark.slow), "noisy"])
def test_sampled_speculation_follows_the_target_distribution(
    spec_models: Callable[[str], SpecModels], draft: str
) -> None:
    models = spec_models("llama")
    got, llm = sampled_joint(models.target, models.draft(draft), seed=5)
    assert_close(got, target_joint(models.target))
    stats = spec_stats(llm.engine.scheduler)
    assert stats.drafts >= N and stats.accepted_tokens > 0


def test_sampled_speculation_with_the_default_seed(
    spec_models: Callable[[str], SpecModels],
) -> None:
    models = spec_models("llama")
    got, _ = sampled_joint(models.target, models.target, seed=0)  # EngineConfig's default seed
    assert_close(got, target_joint(models.target))


def test_seeded_request_replays_with_a_draft_model(
    spec_models: Callable[[str], SpecModels],
) -> None:
    models = spec_models("llama")
    llm = LLM(
        str(models.target),
        num_kv_blocks=256,
        speculative="draft",
        speculative_model=str(models.draft_noisy),
    )
    params = SamplingParams(temperature=1.0, max_tokens=20, ignore_eos=True, seed=42)
    first = llm.generate([PROMPT], params)[0].token_ids
    again = llm.generate([PROMPT], params)[0].token_ids  # same engine, same request, alone
    assert again == first


def test_seeded_request_replays_with_ngram(spec_models: Callable[[str], SpecModels]) -> None:
    """n-gram drafts depend only on the request's tokens: a seeded request replays exactly
    (same engine, and a fresh one) as long as the same steps speculate."""
    models = spec_models("llama")
    prompt = [5, 6, 7] * 6
    params = SamplingParams(temperature=0.5, max_tokens=24, ignore_eos=True, seed=42)
    llm = LLM(str(models.target), num_kv_blocks=256, speculative="ngram")
    first = llm.generate([prompt], params)[0].token_ids
    assert llm.generate([prompt], params)[0].token_ids == first
    fresh = LLM(str(models.target), num_kv_blocks=256, speculative="ngram")
    assert fresh.generate([prompt], params)[0].token_ids == first
