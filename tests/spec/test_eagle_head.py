"""The EAGLE head's pieces, without the engine: the worker's chain of drafts is what training's
unrolled test predicts, the feature rows line up with build_step_inputs' layout, and folders
that do not fit the target are refused."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from stoker.common.model_config import ModelConfig, ModelLoadError
from stoker.common.sampling_params import SamplingParams
from stoker.services.engine import LLM
from stoker.services.worker.eagle.config import EagleConfig, default_target_layers, is_eagle_head
from stoker.services.worker.eagle.proposer import EagleProposer, chunk_rows
from stoker.services.worker.loader import load_model
from stoker.services.worker.step_inputs import Chunk, build_step_inputs
from stoker.tools.training.eagle import choose_draft_vocab
from stoker.tools.training.eagle_net import EagleNet
from tests.factory import make_model
from tests.spec.eagle_heads import make_head

CPU = torch.device("cpu")
BLOCK = 8


def _kv(cfg: ModelConfig, blocks: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    shape = (blocks, BLOCK, cfg.num_kv_heads, cfg.head_dim)
    return [(torch.zeros(shape), torch.zeros(shape)) for _ in range(cfg.num_layers)]


@pytest.mark.parametrize(
    "arch, extra, draft_vocab",
    [("llama", {}, 0), ("qwen3", {"head_dim": 32}, 0), ("llama", {}, 96)],
)
def test_worker_chain_is_what_training_unrolls(
    tmp_path: Path, arch: str, extra: dict, draft_vocab: int
) -> None:
    """Prefill, record the taps, propose k = 4 greedily; then feed prompt + drafts to the
    training module's unroll: its step j at the chain's row must predict draft j + 1. So the
    training-time test trains exactly what the worker runs (features, positions, masks, and
    the reduced draft vocabulary's ids)."""
    target_dir = make_model(tmp_path / "t", arch, num_layers=4, **extra)
    head_dir = make_head(target_dir, tmp_path / "h", seed=3, draft_vocab=draft_vocab)
    cfg = ModelConfig.from_folder(target_dir)
    target = load_model(target_dir, torch.float32, "cpu", 256)
    prop = EagleProposer(head_dir, target, cfg, BLOCK, torch.float32, CPU, 256)
    prop.allocate_kv(16, torch.zeros)
    kv, blocks = _kv(cfg, 16), list(range(16))
    rng = random.Random(0)
    prompt = [rng.randrange(3, 500) for _ in range(21)]

    def forward(chunk: Chunk) -> torch.Tensor:
        inputs = build_step_inputs([chunk], BLOCK, CPU, 1)
        target.tap_layers, target.taps = prop.tap_layers, []
        hidden = target(inputs.input_ids, inputs.positions, kv, inputs.meta)
        prop.record([chunk], ["r"], target.taps, 1)
        target.tap_layers = ()
        return target.compute_logits(hidden[inputs.sample_rows])

    first = int(forward(Chunk(prompt, 0, blocks, 1)).argmax())
    known = prompt + [first]
    greedy = SamplingParams(temperature=0.0)
    [(drafts, q)] = prop.propose([("r", known, blocks, greedy, 4, 1)])
    assert q is None and len(drafts) == 4

    # The training side: the target's taps over known + drafts, recomputed from scratch.
    seq = known + drafts[:3]
    inputs = build_step_inputs([Chunk(seq, 0, blocks, 0)], BLOCK, CPU, 1)
    target.tap_layers, target.taps = prop.tap_layers, []
    target(inputs.input_ids, inputs.positions, _kv(cfg, 16), inputs.meta)
    taps = torch.cat(target.taps, -1)[None]
    target.tap_layers = ()
    net = EagleNet(prop.cfg)
    net.load_state_dict(load_file(str(head_dir / "model.safetensors")))
    with torch.no_grad():
        embeds = target.embed(torch.tensor(seq))[None]
        outs = net.unroll(embeds, taps, 4)
    s = len(known) - 1  # the chain starts at the last known token
    logits = [target.compute_logits(outs[j][0, s + j]) for j in range(4)]
    if draft_vocab:
        d2t = net.d2t
        assert d2t is not None and len(d2t) == draft_vocab
        trained = [int(d2t[row[d2t].argmax()]) for row in logits]
        assert set(drafts) <= set(d2t.tolist())
    else:
        trained = [int(row.argmax()) for row in logits]
    assert trained == drafts


def test_chunk_rows_follow_build_step_inputs() -> None:
    rng = random.Random(1)
    chunks = [
        Chunk([rng.randrange(500) for _ in range(n)], s, list(range(8)), 1)
        for n, s in ((20, 0), (1, 9), (5, 3), (17, 4), (3, 0))
    ]
    for decode_chunk in (1, 4, 16):
        inputs = build_step_inputs(chunks, BLOCK, CPU, decode_chunk)
        ids = inputs.input_ids.tolist()
        for chunk, (first, last) in zip(chunks, chunk_rows(chunks, decode_chunk)):
            assert ids[first:last] == chunk.token_ids


def test_default_layers_are_low_middle_high() -> None:
    assert default_target_layers(30) == (1, 14, 26)  # SmolLM2-135M
    assert default_target_layers(2) == (0, 1)
    assert all(0 <= i < n for n in range(1, 9) for i in default_target_layers(n))


def test_heads_that_do_not_fit_the_target_are_refused(tmp_path: Path) -> None:
    target = make_model(tmp_path / "t", "llama")
    other = make_model(tmp_path / "o", "llama", vocab_size=384)
    head = make_head(other, tmp_path / "h")
    assert is_eagle_head(head) and not is_eagle_head(target)
    with pytest.raises(ModelLoadError, match="vocab"):
        LLM(str(target), num_kv_blocks=64, speculative_model=str(head))
    raw = json.loads((head / "config.json").read_text())
    raw.update(vocab_size=512, target_layers=[0, 7])
    (head / "config.json").write_text(json.dumps(raw))
    with pytest.raises(ModelLoadError, match="reads layers"):
        EagleConfig.from_folder(head).check_target(ModelConfig.from_folder(target), head)


def test_draft_vocabularies_that_do_not_fit_are_refused(tmp_path: Path) -> None:
    target = make_model(tmp_path / "t", "llama")
    head = make_head(target, tmp_path / "h", draft_vocab=64)
    weights = head / "model.safetensors"
    state = load_file(str(weights))
    for bad, why in [
        (torch.full((64,), 3), "distinct"),
        (torch.arange(64) + 500, "below 512"),
        (torch.arange(32), "64 ids"),
    ]:
        save_file({**state, "d2t": bad}, str(weights))
        with pytest.raises(ModelLoadError, match=why):
            LLM(str(target), num_kv_blocks=64, speculative_model=str(head))
    raw = json.loads((head / "config.json").read_text())
    raw["draft_vocab_size"] = 1000
    (head / "config.json").write_text(json.dumps(raw))
    with pytest.raises(ModelLoadError, match="draft vocabulary of 1000"):
        EagleConfig.from_folder(head).check_target(ModelConfig.from_folder(target), head)


def test_draft_vocab_is_the_most_frequent_labels() -> None:
    labels = torch.tensor([7, 7, 7, 3, 3, 9, 9, 1])  # 3 and 9 tie: the lower id first
    assert choose_draft_vocab(labels, 16, 3).tolist() == [3, 7, 9]
    assert choose_draft_vocab(labels, 16, 2).tolist() == [3, 7]
    # Fewer distinct labels than the size: the rest by lowest id.
    assert choose_draft_vocab(labels, 16, 6).tolist() == [0, 1, 2, 3, 7, 9]
    assert choose_draft_vocab(labels, 16, 0) is None
    assert choose_draft_vocab(labels, 16, 16) is None


def test_tensor_parallel_with_a_head_is_refused(tmp_path: Path) -> None:
    """Two real ranks (gloo on CPU): the head is refused at load, with the flag named."""
    target = make_model(tmp_path / "t", "llama")
    head = make_head(target, tmp_path / "h")
    with pytest.raises(ModelLoadError, match="tensor-parallel-size"):
        LLM(str(target), tensor_parallel_size=2, num_kv_blocks=64, speculative_model=str(head))


def test_collect_records_each_sequence_as_alone(tmp_path: Path) -> None:
    """collect() batches sequences of similar length and cuts each batch to its longest; every
    valid position's taps and argmax must be what a forward of that sequence alone gives."""
    from transformers import AutoModelForCausalLM

    from stoker.tools.training.eagle import collect

    target = AutoModelForCausalLM.from_pretrained(make_model(tmp_path / "t", num_layers=3)).eval()
    rng = random.Random(1)
    prompts = [[rng.randrange(3, 500) for _ in range(rng.randrange(2, 9))] for _ in range(7)]
    conts = [[rng.randrange(3, 500) for _ in range(rng.randrange(1, 30))] for _ in range(7)]
    data = collect(target, prompts, conts, (0, 1), CPU, batch=3)
    assert data.starts.tolist() == [len(p) for p in prompts]
    for r, (p, c) in enumerate(zip(prompts, conts)):
        n = len(p) + len(c)
        assert data.mask[r].sum() == n and data.tokens[r, :n].tolist() == p + c
        with torch.no_grad():
            out = target(input_ids=torch.tensor([p + c]), output_hidden_states=True)
        # hidden_states[i + 1] is decoder layer i's output (the last is after the final norm)
        alone = torch.cat([out.hidden_states[1][0], out.hidden_states[2][0]], -1)
        torch.testing.assert_close(data.taps[r, :n].float(), alone, atol=2e-3, rtol=2e-3)
        assert data.labels[r, :n].tolist() == out.logits[0].argmax(-1).tolist()
