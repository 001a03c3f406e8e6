"""Greedy output with an EAGLE head is the target's alone, token for token, and sampled output
keeps the target's distribution. The heads: one trained for seconds by `stoker train-draft
--method eagle` (partial acceptance; the command's smoke test) and a random-init one (almost
nothing accepted): exactness must not depend on acceptance. Scenarios, references and the
statistical check are those of test_spec_exactness.py and test_spec_sampling_e2e.py."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from services.engine import LLM, SamplingParams
from tests.spec.eagle_heads import make_head, train_head
from tests.spec.fakes import spec_stats
from tests.spec.spec_models import SpecModels
from tests.spec.test_spec_exactness import SCENARIOS, generate, reference
from tests.spec.test_spec_sampling_e2e import assert_close, sampled_joint, target_joint

pytestmark = pytest.mark.timeout(300)
_heads: dict[tuple[str, str], Path] = {}


@pytest.fixture(scope="session")
def eagle_head(
    spec_models: Callable[[str], SpecModels], tmp_path_factory: pytest.TempPathFactory
) -> Callable[[str, str], Path]:
    """(arch, "trained" | "random") -> a head folder for that arch's spec target."""

    def get(arch: str, kind: str) -> Path:
        if (arch, kind) not in _heads:
            target = spec_models(arch).target
            out = tmp_path_factory.mktemp(f"eagle-{arch}-{kind}")
            _heads[arch, kind] = (
                train_head(target, out) if kind == "trained" else make_head(target, out, seed=1)
            )
        return _heads[arch, kind]

    return get


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
    options = dict(SCENARIOS[name].options, speculative_adaptive=adaptive)
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
    assert got.llm.engine.runner.eagle is not None


@pytest.mark.slow
def test_sampled_with_eagle_head_follows_the_target_distribution(
    spec_models: Callable[[str], SpecModels], eagle_head: Callable[[str, str], Path]
) -> None:
    models = spec_models("llama")
    got, llm = sampled_joint(models.target, eagle_head("llama", "trained"), seed=5)
    assert_close(got, target_joint(models.target))
    stats = spec_stats(llm.engine.scheduler)
    assert stats.drafts > 0 and stats.accepted_tokens > 0


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
