"""The greedy head (services/worker/greedy_head.py): bfloat16 logits screened by a rounding bound,
the candidates recomputed in float32, must give exactly the full float32 head's argmax, ties
and near-ties included; rows it cannot bound go back to the full head. In the engine, greedy
output with it equals greedy output without it, beside rows that need the full logits."""

from __future__ import annotations

import pytest
import torch

from stoker.kernels import cpu_ops
from stoker.services.engine import LLM, SamplingParams
from stoker.services.worker import greedy_head as gh
from stoker.services.worker.greedy_head import GreedyHead
from tests.factory import make_model

_module = cpu_ops.load()
pytestmark = pytest.mark.skipif(
    _module is None or not _module.panel_linear_supported(),
    reason="the greedy head recomputes with the panel kernel (native build, AVX2 + FMA CPU)",
)


def _full_argmax(weight: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    return cpu_ops.panel_linear(x, cpu_ops.pack_panels(weight)).argmax(dim=-1)


def _heads(weight: torch.Tensor) -> list[GreedyHead]:
    """A head on every screen kernel this machine has: the native pair kernel (AVX512-BF16),
    oneDNN's bfloat16 linear, and plain F.linear."""
    bf16 = weight.to(torch.bfloat16).contiguous()
    kernels = {"torch": bf16}
    if _module.bf16_pairs_supported():
        kernels["pairs"] = _module.pack_bf16_pairs(bf16)
    if torch.ops.mkldnn._is_mkldnn_bf16_supported():
        kernels["onednn"] = torch.ops.mkldnn._reorder_linear_weight(bf16, 64)
    heads = []
    for packed in kernels.values():  # `linear` tells the layouts apart
        head = GreedyHead(weight)
        head._packed = packed
        heads.append(head)
    return heads


@pytest.mark.skipif(
    _module is None or not _module.bf16_pairs_supported(), reason="needs an AVX512-BF16 CPU"
)
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 9])
@pytest.mark.parametrize("vocab", [16, 80, 1024])  # 1, 5 and 64 panels: full and partial tiles
def test_the_pair_kernel_is_within_the_screens_bound(rows, vocab):
    """Exact products and float32 sums, rounded to bfloat16 once: within bfloat16 rounding
    plus the sums' rounding of the exact dot product of the bfloat16 inputs."""
    gen = torch.Generator().manual_seed(rows * vocab)
    hidden = 96
    w = (torch.randn(vocab, hidden, generator=gen) * 0.2).to(torch.bfloat16)
    x = (torch.randn(rows, hidden, generator=gen) * 3).to(torch.bfloat16)
    got = _module.bf16_pairs_linear(x, _module.pack_bf16_pairs(w))
    assert got.dtype == torch.bfloat16 and got.shape == (rows, vocab)
    exact = x.double() @ w.double().T
    sums = 1.1 * hidden * 2.0**-24 * (x.double().abs() @ w.double().abs().T)
    bound = 2.0**-8 * exact.abs() + sums  # bfloat16 keeps 8 significant bits
    assert bool(((got.double() - exact).abs() <= bound * (1 + 2.0**-8) + 1e-30).all())
    assert torch.equal(got, _module.bf16_pairs_linear(x, _module.pack_bf16_pairs(w)))


@pytest.mark.parametrize("rows", [1, 3, 12, 33, 64])
@pytest.mark.parametrize("scale", [0.1, 3.0, 40.0])
def test_argmax_equals_the_full_heads(rows, scale):
    gen = torch.Generator().manual_seed(rows)
    weight = torch.randn(1024, 96, generator=gen) * 0.2
    x = torch.randn(rows, 96, generator=gen) * scale
    want = _full_argmax(weight, x)
    for head in _heads(weight):
        got = head.argmax(x)
        assert got is not None and torch.equal(got, want)
    assert head.rows_screened == rows and head.rows_full == 0


def test_ties_and_near_ties_keep_the_first_maximum():
    """Rows the bfloat16 logits cannot tell apart: exact duplicates (the first index wins, as
    argmax's), and rows one float32 ulp apart (the larger one wins)."""
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(512, 64, generator=gen) * 0.1
    x = torch.randn(40, 64, generator=gen)
    for r in range(40):
        top = 100 + 5 * r
        weight[top] = x[r] * 0.05
        weight[top + 2] = weight[top]  # an exact tie with top: top must win
        near = weight[top].clone()
        near[r % 64] = torch.nextafter(near[r % 64], near[r % 64] * 2)  # one ulp further out
        weight[top + 1 if r % 2 else top - 1] = near  # after or before top
    want = _full_argmax(weight, x)
    for head in _heads(weight):
        got = head.argmax(x)
        assert got is not None and torch.equal(got, want)


def test_rows_it_cannot_bound_go_to_the_full_head():
    weight = torch.randn(256, 32) * 0.1
    head = GreedyHead(weight)
    x = torch.randn(4, 32)
    x[2, 0] = float("inf")
    assert head.argmax(x) is None  # a non-finite logit
    flat = GreedyHead(torch.ones(256, 32))  # every token ties: more candidates than allowed
    assert flat.argmax(torch.randn(2, 32)) is None
    assert head.rows_full == 4 and flat.rows_full == 2


def test_the_screen_keeps_the_argmax_of_bfloat16_rounded_logits():
    """The kernel alone: every row's float32 argmax is among its candidates, and the bound is
    tight enough that few are kept."""
    gen = torch.Generator().manual_seed(1)
    weight = torch.randn(49152 // 16, 64, generator=gen) * 0.3
    x = torch.randn(16, 64, generator=gen) * 5
    head = GreedyHead(weight)
    row_scale = (x.double().norm(dim=1) * head.scale).float()
    candidates, counts = _module.greedy_candidates(
        head.approx_logits(x), row_scale, head.col_norm, gh.OUTPUT_REL, gh.SLACK, 64
    )
    want = _full_argmax(weight, x)
    for r in range(16):
        kept = candidates[r, : counts[r]].tolist()
        assert counts[r] >= 1 and want[r].item() in kept
    assert counts.float().mean() < 8


def test_engine_greedy_output_is_unchanged_with_it(tmp_path, monkeypatch):
    """Steps of greedy rows take the head; a step holding a row that asks for logprobs or a
    penalty computes the full logits. Outputs match an engine without the head."""
    path = make_model(tmp_path / "m", "llama", tie_word_embeddings=True)
    prompts = [[(7 * i + 3 * j) % 500 + 3 for j in range(5 + 3 * i)] for i in range(6)]
    plain = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    mixed = [plain] * 4 + [
        SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, logprobs=2),
        SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, presence_penalty=1.0),
    ]
    outputs = {}
    for mode in ("on", "off"):
        monkeypatch.setenv("STOKER_GREEDY_HEAD", mode)
        with LLM(str(path), num_kv_blocks=64, block_size=16) as llm:
            runner = llm.engine.runner
            assert (runner.greedy_head is not None) == (mode == "on")
            outputs[mode] = [
                [o.token_ids for o in llm.generate(prompts, plain, use_tqdm=False)],
                [o.token_ids for o in llm.generate(prompts, mixed, use_tqdm=False)],
            ]
            if mode == "on":
                assert runner.greedy_head.rows_screened > 0
    assert outputs["on"] == outputs["off"]


def test_greedy_verify_with_it_matches_plain_decoding(tmp_path, monkeypatch):
    """n-gram verifies of greedy rows take their argmax from the head: the output is still the
    target's own greedy output, with speculation on or off and the head on or off."""
    path = make_model(tmp_path / "m", "llama")
    prompts = [[5, 6, 7, 8, 9] * 6, [40, 41, 42] * 9, [100 + i for i in range(20)]]
    params = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)
    outputs = {}
    for mode, spec in (("on", "ngram"), ("off", "ngram"), ("off", None)):
        monkeypatch.setenv("STOKER_GREEDY_HEAD", mode)
        with LLM(str(path), num_kv_blocks=64, block_size=16, speculative=spec) as llm:
            outputs[mode, spec] = [
                o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)
            ]
            if mode == "on":
                assert llm.engine.runner.greedy_head.rows_screened > len(prompts) * 32 // 4
    assert outputs["on", "ngram"] == outputs["off", "ngram"] == outputs["off", None]


@pytest.mark.parametrize("rows", [1, 4, 9])
def test_masked_argmax_equals_the_masked_full_heads(rows):
    """With a grammar's bitmask (worker/grammar.py): the argmax over the allowed tokens only,
    each row under its own mask, rows without a grammar (all bits set) as before."""
    from stoker.kernels.token_mask import apply_token_bitmask

    g = torch.Generator().manual_seed(rows)
    vocab = 1024  # panels of 16
    weight = torch.randn(vocab, 64, generator=g)
    x = torch.randn(rows, 64, generator=g)
    words = (vocab + 31) // 32
    bitmask = torch.randint(-(2**31), 2**31 - 1, (rows, words), dtype=torch.int32, generator=g)
    bitmask[:, : words // 2] = 0  # the full head's argmax is often in a disallowed half
    bitmask[0] = -1  # a row without a grammar
    full = cpu_ops.panel_linear(x, cpu_ops.pack_panels(weight))
    apply_token_bitmask(full, bitmask, torch.arange(rows))
    for head in _heads(weight):
        assert torch.equal(head.argmax(x, bitmask), full.argmax(dim=-1))
