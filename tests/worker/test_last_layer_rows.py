"""The last layer outputs only the rows that sample (StepInputs.last_layer_meta): the sampled
hidden states and every row's stored K/V equal a forward that keeps all rows."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from stoker.common.model_config import ModelConfig
from stoker.services.worker.loader import load_model
from stoker.services.worker.models import layers
from stoker.services.worker.step_inputs import MAX_DECODE_CHUNK, Chunk, build_step_inputs
from tests.factory import make_model

BS = 16
CPU = torch.device("cpu")


def _step(rng: random.Random) -> list[Chunk]:
    """Decodes, a verify, and prompt chunks that sample or not, fresh or after a prefix."""
    chunks, next_block = [], 0
    for n, start, sampled in [
        (1, 30, 1),
        (40, 0, 1),
        (4, 21, 4),
        (MAX_DECODE_CHUNK + 5, 0, 0),  # a prompt's first chunk: no logits
        (MAX_DECODE_CHUNK + 9, 37, 1),  # its last chunk, after 37 computed tokens
        (3, 0, 1),
    ]:
        width = -(-(start + n) // BS)
        blocks = list(range(next_block, next_block + width))
        next_block += width
        chunks.append(Chunk([rng.randrange(3, 500) for _ in range(n)], start, blocks, sampled))
    return chunks


@pytest.mark.parametrize("arch", ["llama", "qwen3", "gemma2"])
@pytest.mark.parametrize("native_prefill", [True, False])
def test_trimmed_last_layer_matches_the_full_forward(
    tmp_path: Path, arch: str, native_prefill: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    if not native_prefill:  # the per-span fallback attends every row, then keeps the sampled
        monkeypatch.setattr(layers, "prefill_attention_batched", lambda *args, **kw: None)
    extra = {"head_dim": 16} if arch != "llama" else {}
    folder = make_model(tmp_path / arch, arch, num_layers=3, **extra)
    cfg = ModelConfig.from_folder(folder)
    model = load_model(folder, torch.float32, "cpu", 256)
    rng = random.Random(1)
    chunks = _step(rng)
    blocks = 1 + max(b for c in chunks for b in c.block_ids)
    shape = (blocks, BS, cfg.num_kv_heads, cfg.head_dim)
    gen = torch.Generator().manual_seed(0)
    # Earlier positions' K/V (the prefixes the decodes and the later chunk attend to).
    history = [(torch.randn(shape, generator=gen), torch.randn(shape, generator=gen))]
    history *= cfg.num_layers

    def run(trim: bool) -> tuple[torch.Tensor, list[tuple[torch.Tensor, torch.Tensor]]]:
        kv = [(k.clone(), v.clone()) for k, v in history]
        inputs = build_step_inputs(chunks, BS, CPU, trim_last_layer=trim)
        last = inputs.last_layer_meta
        assert (last is not None) == trim
        hidden = model(inputs.input_ids, inputs.positions, kv, inputs.meta, last)
        if last is not None:
            assert hidden.shape[0] == inputs.meta.num_decode + 2  # two prompt chunks sample
            return hidden[inputs.last_layer_sample_rows], kv
        return hidden[inputs.sample_rows], kv

    full, full_kv = run(False)
    trimmed, trimmed_kv = run(True)
    assert full.shape == trimmed.shape == (1 + 1 + 4 + 0 + 1 + 1, cfg.hidden_size)
    torch.testing.assert_close(trimmed, full, rtol=1e-5, atol=1e-5)
    assert torch.equal(
        model.compute_logits(trimmed).argmax(-1), model.compute_logits(full).argmax(-1)
    )
    for (k1, v1), (k2, v2) in zip(full_kv, trimmed_kv):
        assert torch.equal(k1, k2) and torch.equal(v1, v2)


def test_only_steps_with_prompt_chunks_get_a_last_layer_layout() -> None:
    decode = Chunk([5], 9, [0], 1)
    assert build_step_inputs([decode], BS, CPU, trim_last_layer=True).last_layer_meta is None
    prompt = Chunk(list(range(3, 3 + MAX_DECODE_CHUNK + 1)), 0, [1, 2], 1)
    inputs = build_step_inputs([prompt, decode], BS, CPU, trim_last_layer=True)
    meta = inputs.last_layer_meta
    assert meta is not None and meta.out_rows.tolist() == [0, MAX_DECODE_CHUNK + 1]
    assert meta.prefill_bounds.tolist() == [0, 1]  # the prompt keeps its last row
    assert inputs.last_layer_sample_rows.tolist() == [1, 0]  # chunk order: prompt, decode
    assert inputs.meta.out_rows is None  # the other layers keep every row


def test_a_step_where_no_row_samples_stores_the_last_layers_kv(tmp_path: Path) -> None:
    folder = make_model(tmp_path / "m", "llama", num_layers=2)
    cfg = ModelConfig.from_folder(folder)
    model = load_model(folder, torch.float32, "cpu", 256)
    shape = (4, BS, cfg.num_kv_heads, cfg.head_dim)
    chunk = Chunk(list(range(3, 3 + 40)), 0, [0, 1, 2], 0)  # a prompt's first chunk
    caches = []
    for trim in (False, True):
        kv = [(torch.zeros(shape), torch.zeros(shape)) for _ in range(cfg.num_layers)]
        inputs = build_step_inputs([chunk], BS, CPU, trim_last_layer=trim)
        hidden = model(inputs.input_ids, inputs.positions, kv, inputs.meta, inputs.last_layer_meta)
        assert hidden.shape[0] == (0 if trim else 40)
        caches.append(kv)
    for (k1, v1), (k2, v2) in zip(*caches):
        assert torch.equal(k1, k2) and torch.equal(v1, v2) and k1.abs().sum() > 0
