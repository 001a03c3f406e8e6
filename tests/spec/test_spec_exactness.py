"""Greedy outputs with speculative decoding equal those without it, token for token.

Each case runs the offline engine twice with the same options, once without speculation (the
reference, shared per scenario) and once with a proposer:
- "ngram": prompt lookup in the scheduler (repetitive prompts make it fire from the start);
- "1layer": a 1-layer random draft with another seed (almost every draft rejected);
- "noisy": the target with 10% weight noise (partial acceptance, about a third);
- "self": the target as its own draft (every draft must be accepted).
Scenarios: a mixed batch (lengths 1..50, repetitive prompts, varied max_tokens, stop tokens),
forced preemption, prefix-cache hits, chunked prefill, penalties; adaptive k on and off.
A representative subset runs by default; the full matrix is marked slow.
"""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from stoker.common.config import DEFAULT_DRAFT_MODEL, DEFAULT_MODEL
from stoker.common.model_config import ModelLoadError
from stoker.kernels import cpu_ops
from stoker.services.engine import LLM, SamplingParams
from tests.factory import make_model
from tests.spec.fakes import count_proposal_kinds, spec_stats
from tests.spec.spec_models import SpecModels

pytestmark = pytest.mark.timeout(300)  # a broken verify can loop forever
NEW_TOKENS = 32
METHODS = ["ngram", "1layer", "noisy", "self"]


def mixed_prompts(seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    prompts = [[rng.randrange(3, 500) for _ in range(n)] for n in (1, 3, 9, 17, 33, 50)]
    for unit_len, total in ((3, 24), (5, 40), (2, 11)):  # repetitive: n-gram hits at once
        unit = [rng.randrange(3, 500) for _ in range(unit_len)]
        prompts.append((unit * total)[:total])
    return prompts


def shared_prefix_prompts(seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    prefix = [rng.randrange(3, 500) for _ in range(40)]
    return [prefix + [rng.randrange(3, 500) for _ in range(n)] for n in (1, 5, 8, 13, 2, 21)]


GREEDY = {"temperature": 0.0, "ignore_eos": True}
PENALTIES = {
    "frequency_penalty": 0.4,
    "presence_penalty": 0.3,
    "repetition_penalty": 1.2,
    "logit_bias": {5: 1.5, 9: -2.0, 17: 3.0},  # applied to the target logits a verify checks
}


@dataclasses.dataclass(frozen=True)
class Scenario:
    options: dict[str, Any]
    prompts: Callable[[int], list[list[int]]]
    penalties: bool = False


SCENARIOS = {
    "mixed": Scenario({"num_kv_blocks": 256}, mixed_prompts),
    "preempt": Scenario({"num_kv_blocks": 14, "block_size": 8}, mixed_prompts),
    "prefix": Scenario({"num_kv_blocks": 256, "max_num_seqs": 4}, shared_prefix_prompts),
    "chunked": Scenario({"num_kv_blocks": 256, "max_num_batched_tokens": 24}, mixed_prompts),
    "penalties": Scenario({"num_kv_blocks": 256}, mixed_prompts, penalties=True),
}


def sampling_params(
    scenario: Scenario, prompts: list[list[int]], stops: list[int | None]
) -> list[SamplingParams]:
    """Varied max_tokens (so the batch shrinks and adaptive speculation switches back on) and
    a stop token on some requests (so a stop can land inside a run of accepted drafts)."""
    params = []
    for i, _ in enumerate(prompts):
        extra: dict[str, Any] = dict(PENALTIES) if scenario.penalties else {}
        if stops[i] is not None:
            extra["stop_token_ids"] = [stops[i]]
        max_tokens = NEW_TOKENS - 4 * (i % 4)
        params.append(SamplingParams(max_tokens=max_tokens, **GREEDY, **extra))
    return params


@dataclasses.dataclass
class Outcome:
    outputs: list[list[int]]
    finish: list[str | None]
    llm: LLM


def generate(
    path: Path,
    prompts: list[list[int]],
    params,
    before: Callable[[LLM], object] | None = None,
    **options: Any,
) -> Outcome:
    """`before(llm)` runs once the engine is built, before generating (to instrument it)."""
    llm = LLM(str(path), **options)
    if before is not None:
        before(llm)
    outs = llm.generate(prompts, params)
    bm = llm.engine.block_manager
    bm.check_invariants()
    assert bm.num_free_blocks() == bm.num_blocks, "KV blocks leaked"
    return Outcome([o.token_ids for o in outs], [o.finish_reason for o in outs], llm)


_refs: dict[tuple[str, str], tuple[list[list[int]], list[SamplingParams], Outcome]] = {}


def reference(arch: str, name: str, models: SpecModels) -> tuple[list, list, Outcome]:
    """Prompts, params and the non-speculative outcome of a scenario (cached per session).
    Stop tokens are taken from a plain run: for every third request, its 9th output token."""
    key = (arch, name)
    if key not in _refs:
        scenario = SCENARIOS[name]
        prompts = scenario.prompts(1)
        plain = sampling_params(scenario, prompts, [None] * len(prompts))
        first = generate(models.target, prompts, plain, num_kv_blocks=256)
        stops = [out[8] if i % 3 == 1 else None for i, out in enumerate(first.outputs)]
        params = sampling_params(scenario, prompts, stops)
        ref = generate(models.target, prompts, params, **scenario.options)
        assert "stop" in ref.finish
        _refs[key] = (prompts, params, ref)
    return _refs[key]


def spec_options(method: str, models: SpecModels, adaptive: bool) -> dict[str, Any]:
    options: dict[str, Any] = {"speculative_adaptive": adaptive}
    if method == "ngram":
        options["speculative"] = "ngram"
    else:
        options["speculative"] = "draft"
        options["speculative_model"] = str(models.draft(method))
        # The draft's own proposals only (a perfect one accepts all); n-gram first has its own
        # test below.
        options["speculative_ngram_first"] = False
    return options


# A representative subset by default (both archs, every method and scenario, adaptive on and
# off); the rest of the matrix is slow.
DEFAULT = {
    ("llama", "mixed", "ngram", True),
    ("llama", "mixed", "1layer", True),
    ("llama", "mixed", "noisy", True),
    ("llama", "mixed", "self", True),
    ("llama", "mixed", "noisy", False),
    ("llama", "preempt", "ngram", True),
    ("llama", "preempt", "self", True),
    ("llama", "prefix", "noisy", True),
    ("llama", "chunked", "ngram", False),
    ("llama", "chunked", "self", True),
    ("llama", "penalties", "noisy", True),
    ("qwen3", "mixed", "ngram", True),
    ("qwen3", "mixed", "self", False),
    ("qwen3", "preempt", "noisy", False),
    ("qwen3", "prefix", "self", True),
    ("qwen3", "chunked", "1layer", True),
    ("qwen3", "penalties", "self", True),
}


def _cases() -> list[Any]:
    cases = []
    for arch in ("llama", "qwen3"):
        for name in SCENARIOS:
            for method in METHODS:
                if name == "penalties" and method == "ngram":
                    continue  # the penalties steer away from repeats: prompt lookup never fires
                for adaptive in (True, False):
                    case = (arch, name, method, adaptive)
                    marks = () if case in DEFAULT else (pytest.mark.slow,)
                    ident = f"{arch}-{name}-{method}-{'adaptive' if adaptive else 'fixed'}"
                    cases.append(pytest.param(*case, marks=marks, id=ident))
    return cases


@pytest.mark.parametrize("arch, name, method, adaptive", _cases())
def test_greedy_speculation_is_exact(
    spec_models: Callable[[str], SpecModels], arch: str, name: str, method: str, adaptive: bool
) -> None:
    models = spec_models(arch)
    prompts, params, ref = reference(arch, name, models)
    scenario = SCENARIOS[name]
    got = generate(
        models.target, prompts, params, **scenario.options, **spec_options(method, models, adaptive)
    )
    assert got.outputs == ref.outputs
    assert got.finish == ref.finish
    scheduler = got.llm.engine.scheduler
    assert scheduler.spec is not None
    stats = scheduler.spec.stats
    assert stats.drafts > 0 and stats.draft_tokens >= stats.drafts
    assert sum(stats.accepted_per_position) == stats.accepted_tokens <= stats.draft_tokens
    if method == "self" and not scenario.penalties:  # a perfect draft: all drafts accepted
        assert stats.accepted_tokens == stats.draft_tokens
    if method == "noisy":
        assert 0 < stats.accepted_tokens < stats.draft_tokens
    if not adaptive:
        assert stats.disabled_steps == 0
    elif name in ("mixed", "penalties"):
        assert stats.disabled_steps > 0  # 9 running requests > max_batch 8: off at first
    if name == "preempt":
        assert scheduler.num_preemptions > 0, "the pool was meant to force preemption"
    if name == "prefix":
        assert scheduler.prefix_hits > 0, "shared prefixes should hit the cache"


@pytest.mark.skipif(
    not (cpu_ops.use_bf16_pairs() or cpu_ops.use_panel_linear()),
    reason="bfloat16 linears are batch-invariant on the pair kernel or the panel kernel",
)
@pytest.mark.parametrize("name, method", [("mixed", "ngram"), ("chunked", "self")])
def test_greedy_speculation_is_exact_in_bfloat16_on_the_native_linears(
    spec_models: Callable[[str], SpecModels], name: str, method: str
) -> None:
    """bfloat16 linears run on the native pair kernel (AVX512-BF16) or else on the panel kernel
    (AVX2, AVX-512), each of which computes every output as one ordered chain whatever the row
    count (tests/kernels/test_bf16_pairs.py, test_panel_linear.py); every other CPU kernel is
    row-wise too, so a verify row is the decode row it stands for and bfloat16 greedy output
    under speculation is the plain run's. (With oneDNN's bfloat16 linears SmolLM2's batch-1
    n-gram output parted from plain greedy on 5 of 8 chat prompts: docs/speculation.md.)"""
    models = spec_models("llama")
    scenario = SCENARIOS[name]
    prompts = scenario.prompts(1)
    params = sampling_params(scenario, prompts, [None] * len(prompts))
    options = {**scenario.options, "dtype": "bfloat16"}
    ref = generate(models.target, prompts, params, **options)
    got = generate(models.target, prompts, params, **options, **spec_options(method, models, True))
    assert got.outputs == ref.outputs
    assert spec_stats(got.llm.engine.scheduler).accepted_tokens > 0


def generate_ngram_first(
    arch: str, name: str, models: SpecModels, draft: Path, **options: Any
) -> Outcome:
    """A scenario with n-gram first over `draft` (a draft model or EAGLE head), checked against
    the plain run's outcome, with both kinds of proposal seen."""
    prompts, params, ref = reference(arch, name, models)
    kinds: list[dict[str, int]] = []
    got = generate(
        models.target,
        prompts,
        params,
        before=lambda llm: kinds.append(count_proposal_kinds(llm)),
        speculative_model=str(draft),
        speculative_ngram_first=True,
        speculative_row_cost=0.0,  # nobody sits drafts out: both kinds of verify keep coming
        **SCENARIOS[name].options,
        **options,
    )
    assert got.outputs == ref.outputs
    assert got.finish == ref.finish
    assert kinds[0]["ngram"] > 0 and kinds[0]["model"] > 0, kinds
    return got


@pytest.mark.parametrize("arch, name", [("llama", "mixed"), ("qwen3", "preempt")])
def test_ngram_first_with_a_draft_model_is_exact(
    spec_models: Callable[[str], SpecModels], arch: str, name: str
) -> None:
    """--speculative-ngram-first: verifies of n-gram ids and of the draft model's drafts mix
    within one request (the draft catches up on what the n-gram verifies accepted), and the
    output is still the target's alone."""
    models = spec_models(arch)
    got = generate_ngram_first(arch, name, models, models.draft("noisy"))
    stats = spec_stats(got.llm.engine.scheduler)
    assert 0 < stats.accepted_tokens < stats.draft_tokens


@pytest.mark.skipif(
    not (Path(DEFAULT_DRAFT_MODEL) / "config.json").exists(),
    reason="the bundled draft (models/stoker-tiny-draft) is not built",
)
def test_bundled_target_and_draft_are_exact() -> None:
    """`LLM(speculative="draft")` with no model argument: the bundled pair."""
    prompts = [
        "To be, or not to be, that is the question:",
        "Once upon a time",
        "The quick brown fox jumps over the lazy dog. The quick brown fox",
        "Friends, Romans, countrymen,",
    ]
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    plain = LLM()
    spec = LLM(speculative="draft")
    assert spec.engine.config.model == str(DEFAULT_MODEL)
    assert spec.engine.config.speculative_model == str(DEFAULT_DRAFT_MODEL)
    want = [o.token_ids for o in plain.generate(prompts, params)]
    got = [o.token_ids for o in spec.generate(prompts, params)]
    assert got == want
    assert spec.engine.scheduler.spec is not None
    assert spec.engine.scheduler.spec.stats.drafts > 0
    for llm in (plain, spec):
        bm = llm.engine.block_manager
        bm.check_invariants()
        assert bm.num_free_blocks() == bm.num_blocks


@pytest.mark.parametrize("method", ["ngram", "noisy", "self"])
def test_logprobs_match_without_speculation(
    spec_models: Callable[[str], SpecModels], method: str
) -> None:
    """Logprobs of tokens that came out of a verify (accepted drafts and the bonus) are the
    target's raw logprobs at their own positions, as without speculation."""
    models = spec_models("llama")
    prompts = mixed_prompts(2)
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True, logprobs=3)
    ref = LLM(str(models.target), num_kv_blocks=256).generate(prompts, params)
    options = spec_options(method, models, adaptive=False)
    llm = LLM(str(models.target), num_kv_blocks=256, **options)
    got = llm.generate(prompts, params)
    assert llm.engine.scheduler.spec is not None
    assert llm.engine.scheduler.spec.stats.accepted_tokens > 0
    for want, have in zip(ref, got):
        assert have.token_ids == want.token_ids
        assert have.logprobs is not None and want.logprobs is not None
        assert len(have.logprobs) == len(want.logprobs) == len(want.token_ids)
        for a, b in zip(have.logprobs, want.logprobs):
            assert a.top_ids == b.top_ids
            assert a.logprob == pytest.approx(b.logprob, abs=1e-4)
            assert a.top_logprobs == pytest.approx(b.top_logprobs, abs=1e-4)


def test_draft_of_another_architecture(spec_models: Callable[[str], SpecModels]) -> None:
    """A Qwen3 target (head_dim 32) with a Llama draft (head_dim 16): the draft keeps its own KV
    shapes on the target's block ids."""
    qwen, llama = spec_models("qwen3"), spec_models("llama")
    prompts = mixed_prompts(3)
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    ref = generate(qwen.target, prompts, params, num_kv_blocks=14, block_size=8)
    got = generate(
        qwen.target,
        prompts,
        params,
        num_kv_blocks=14,
        block_size=8,
        speculative_model=str(llama.draft_noisy),  # implies speculative="draft"
    )
    assert got.outputs == ref.outputs
    assert got.llm.engine.config.speculative == "draft"
    assert got.llm.engine.scheduler.num_preemptions > 0
    assert spec_stats(got.llm.engine.scheduler).drafts > 0


def test_draft_with_another_vocabulary_is_rejected(tmp_path: Path) -> None:
    target = make_model(tmp_path / "target", "llama", vocab_size=512)
    draft = make_model(tmp_path / "draft", "llama", vocab_size=384, num_layers=1)
    with pytest.raises(ModelLoadError, match="vocab"):
        LLM(str(target), num_kv_blocks=64, speculative_model=str(draft))
