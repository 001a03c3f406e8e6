"""Greedy output with an EAGLE head is the target's alone, token for token, and sampled output
keeps the target's distribution. The heads: one trained for seconds by `stoker train-draft
--method eagle` (partial acceptance; the command's smoke test) and a random-init one (almost
nothing accepted): exactness must not depend on acceptance. Scenarios, references and the
statistical check are those of test_spec_exactness.py and test_spec_sampling_e2e.py."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from stoker.services.engine import LLM, SamplingParams
from stoker.services.worker.eagle.proposer import EagleProposer
from tests.spec.eagle_heads import head_factory, oracle_pair
from tests.spec.fakes import spec_stats
from tests.spec.spec_models import SpecModels
from tests.spec.test_spec_exactness import SCENARIOS, generate, generate_ngram_first, reference
from tests.spec.test_spec_sampling_e2e import assert_close, sampled_joint, target_joint

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="session")
def eagle_head(
    spec_models: Callable[[str], SpecModels], tmp_path_factory: pytest.TempPathFactory
) -> Callable[[str, str], Path]:
    return head_factory(spec_models, tmp_path_factory)


CASES = [
    ("llama", "mixed", "trained", True),
    ("llama", "preempt", "trained", True),
    ("llama", "prefix", "trained", True),
    ("llama", "chunked", "trained", False),
    ("llama", "mixed", "random", True),
    ("qwen3", "mixed", "random", True),
    ("qwen3", "preempt", "random", False),
    ("qwen3", "prefix", "random", True),
]


@pytest.mark.parametrize("arch, name, kind, adaptive", CASES)
def test_greedy_with_eagle_head_is_exact(
    spec_models: Callable[[str], SpecModels],
    eagle_head: Callable[[str, str], Path],
    arch: str,
    name: str,
    kind: str,
    adaptive: bool,
) -> None:
    models = spec_models(arch)
    prompts, params, ref = reference(arch, name, models)
    # Row cost 0: requests never sit drafts out, so a trained head's acceptance shows in every
    # scenario (test_spec_scheduler.py covers the pausing).
    options = dict(SCENARIOS[name].options, speculative_adaptive=adaptive, speculative_row_cost=0.0)
    got = generate(
        models.target, prompts, params, speculative_model=str(eagle_head(arch, kind)), **options
    )
    assert got.outputs == ref.outputs
    assert got.finish == ref.finish
    scheduler = got.llm.engine.scheduler
    assert got.llm.engine.config.speculative == "draft"
    stats = spec_stats(scheduler)
    assert stats.drafts > 0
    assert sum(stats.accepted_per_position) == stats.accepted_tokens <= stats.draft_tokens
    if kind == "trained":
        assert stats.accepted_tokens > 0
    if adaptive and name == "mixed":
        assert stats.disabled_steps > 0  # 9 running > max_batch 8: the cut-off applies
    if not adaptive:
        assert stats.disabled_steps == 0
    if name == "preempt":
        assert scheduler.num_preemptions > 0
    if name == "prefix":
        assert scheduler.prefix_hits > 0
    assert isinstance(got.llm.engine.runner.proposer, EagleProposer)


@pytest.mark.parametrize("arch, name", [("llama", "mixed"), ("qwen3", "prefix")])
def test_ngram_first_with_an_eagle_head_is_exact(
    spec_models: Callable[[str], SpecModels],
    eagle_head: Callable[[str, str], Path],
    arch: str,
    name: str,
) -> None:
    """n-gram ids first, the head's drafts otherwise: the head reads the target's features of
    positions an n-gram verify computed, and greedy output is the target's alone."""
    got = generate_ngram_first(arch, name, spec_models(arch), eagle_head(arch, "trained"))
    assert spec_stats(got.llm.engine.scheduler).accepted_tokens > 0


@pytest.fixture(scope="session")
def oracle(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., tuple[Path, Path]]:
    """(noise, draft_vocab=0) -> (a 1-layer target, a head that is that target with noise on
    its layer, drafting over draft_vocab random ids when > 0)."""
    root = tmp_path_factory.mktemp("eagle-oracle")
    return lambda noise, draft_vocab=0: oracle_pair(root, noise, draft_vocab=draft_vocab)


@pytest.mark.parametrize(
    "name, noise, draft_vocab",
    [
        ("mixed", 0.0, 0),
        ("preempt", 0.0, 0),
        ("prefix", 0.3, 0),
        ("chunked", 0.3, 0),
        ("mixed", 0.0, 384),
    ],
)
def test_greedy_with_an_oracle_head_is_exact(
    oracle: Callable[..., tuple[Path, Path]], name: str, noise: float, draft_vocab: int
) -> None:
    """A head that computes the target itself: every draft accepted, so positions, features and
    the head's K/V line up with the target's; with noise, partial acceptance. Over a reduced
    draft vocabulary it misses exactly where the target's token lies outside it."""
    target, head = oracle(noise, draft_vocab)
    models = SpecModels(target, target, target)
    prompts, params, ref = reference(f"oracle-{noise}", name, models)
    options = dict(SCENARIOS[name].options, speculative_ngram_first=False)  # the head's drafts
    got = generate(target, prompts, params, speculative_model=str(head), **options)
    assert got.outputs == ref.outputs
    stats = spec_stats(got.llm.engine.scheduler)
    assert stats.drafts > 0
    if noise == 0.0 and not draft_vocab:
        assert stats.accepted_tokens == stats.draft_tokens
    else:
        assert 0 < stats.accepted_tokens < stats.draft_tokens


@pytest.mark.parametrize("draft_vocab", [0, 256])
def test_sampled_with_eagle_head_follows_the_target_distribution(
    oracle: Callable[..., tuple[Path, Path]], draft_vocab: int
) -> None:
    """The statistical check of test_spec_sampling_e2e.py (8 000 requests in one batch, the
    empirical joint of 3 tokens against transformers'), with a noisy oracle head: q near p,
    so drafts are accepted, rejected and resampled from the residual. With a reduced draft
    vocabulary q is zero on half the tokens, whose mass must come from the residual alone."""
    target, head = oracle(0.3, draft_vocab)
    got, llm = sampled_joint(target, head, seed=5)
    assert_close(got, target_joint(target))
    stats = spec_stats(llm.engine.scheduler)
    assert stats.drafts > 0 and 0 < stats.accepted_tokens < stats.draft_tokens


def test_seeded_request_replays_with_eagle_head(
    spec_models: Callable[[str], SpecModels], eagle_head: Callable[[str, str], Path]
) -> None:
    models = spec_models("llama")
    llm = LLM(
        str(models.target), num_kv_blocks=256, speculative_model=str(eagle_head("llama", "trained"))
    )
    params = SamplingParams(temperature=1.0, max_tokens=20, ignore_eos=True, seed=42)
    prompt = [17, 230, 45, 99, 310]
    first = llm.generate([prompt], params)[0].token_ids
    assert llm.generate([prompt], params)[0].token_ids == first


@pytest.mark.parametrize("kind", ["trained", "oracle"])
def test_graph_path_decode_steps_between_verifies(
    spec_models: Callable[[str], SpecModels],
    eagle_head: Callable[[str, str], Path],
    oracle: Callable[..., tuple[Path, Path]],
    kind: str,
) -> None:
    """Decode-only steps on the CUDA-graph path (run eagerly on CPU) do not tap: the head reads
    zero features there and still never changes the output. The cut-off at 4 decoding
    requests makes the first steps plain decodes, later ones verifies."""
    if kind == "oracle":
        target, head = oracle(0.0)
    else:
        target, head = spec_models("llama").target, eagle_head("llama", "trained")
    prompts, params, ref = reference(f"graphs-{kind}", "mixed", SpecModels(target, target, target))
    llm = LLM(
        str(target),
        num_kv_blocks=256,
        speculative_model=str(head),
        speculative_max_batch=4,
        speculative_ngram_first=False,  # the head's drafts only
    )
    llm.engine.runner.use_decode_graphs(capture=False)
    got = [o.token_ids for o in llm.generate(prompts, params)]
    assert got == ref.outputs
    stats = spec_stats(llm.engine.scheduler)
    assert stats.disabled_steps > 0 and stats.drafts > 0
    if kind == "oracle":
        assert stats.accepted_tokens == stats.draft_tokens
