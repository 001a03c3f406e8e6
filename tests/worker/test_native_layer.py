"""The native decoder layer (kernels/csrc/llama_layer.cpp) runs a CPU step exactly as the Python
layer does: bit for bit the same hidden states and the same stored K/V, in float32 and bfloat16,
with every weight layout `linear` takes, for decode rows, verifies and prompt chunks (the last
layer keeping only the sampled rows included). Layers it cannot run exactly are never marked,
and forced torch backends keep the Python layer."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from stoker.common.model_config import ModelConfig
from stoker.kernels import cpu_ops
from stoker.kernels.dispatch import force_backend
from stoker.services.worker.loader import load_model
from stoker.services.worker.models.llama import DecoderLayer, enable_native_layers
from stoker.services.worker.step_inputs import MAX_DECODE_CHUNK, Chunk, build_step_inputs
from tests.factory import make_model

BS = 16
CPU = torch.device("cpu")

pytestmark = pytest.mark.skipif(
    cpu_ops.load() is None, reason="the native CPU kernels did not build on this machine"
)


def _chunks(rng: random.Random, prompt: bool) -> list[Chunk]:
    """Decodes at varied context lengths and a verify of 4 rows (the decode path's rows); with
    `prompt`, a fresh prompt's first chunk (no logits) and a later chunk after 37 tokens."""
    shapes = [(1, 30, 1), (1, 5, 1), (4, 21, 4), (1, 70, 1)]
    if prompt:
        shapes += [(MAX_DECODE_CHUNK + 5, 0, 0), (MAX_DECODE_CHUNK + 9, 37, 1)]
    chunks, next_block = [], 0
    for n, start, sampled in shapes:
        width = -(-(start + n) // BS)
        blocks = list(range(next_block, next_block + width))
        next_block += width
        chunks.append(Chunk([rng.randrange(3, 500) for _ in range(n)], start, blocks, sampled))
    return chunks


def _layers(model: torch.nn.Module) -> list[DecoderLayer]:
    return [m for m in model.modules() if isinstance(m, DecoderLayer)]


def _forward(model, cfg, chunks, dtype, native: bool, trim: bool = False):
    """(final hidden states, every layer's K/V cache, native layer calls) of one step over
    random earlier K/V."""
    blocks = 1 + max(b for c in chunks for b in c.block_ids)
    shape = (blocks, BS, cfg.num_kv_heads, cfg.head_dim)
    gen = torch.Generator().manual_seed(0)
    kv = [
        (torch.randn(shape, generator=gen).to(dtype), torch.randn(shape, generator=gen).to(dtype))
        for _ in range(cfg.num_layers)
    ]
    saved = {id(layer): layer.native_forward for layer in _layers(model)}
    calls = []
    for layer in _layers(model):
        fn = saved[id(layer)]
        if native and fn is not None:
            layer.native_forward = lambda *a, fn=fn: calls.append(1) or fn(*a)
        else:
            layer.native_forward = None
    try:
        inputs = build_step_inputs(chunks, BS, CPU, trim_last_layer=trim)
        hidden = model(inputs.input_ids, inputs.positions, kv, inputs.meta, inputs.last_layer_meta)
    finally:
        for layer in _layers(model):
            layer.native_forward = saved[id(layer)]
    return hidden, kv, len(calls)


@pytest.mark.parametrize(
    ("arch", "extra"),
    [
        ("llama", {}),
        ("qwen2", {}),  # a bias on the q/k/v projection
        ("mistral", {"sliding_window": 24}),  # a window shorter than some contexts
        ("qwen3", {"head_dim": 32}),  # q/k norm
    ],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
# Packed weights in the default layouts (float32 panels; bfloat16 pairs where the CPU has
# AVX512-BF16, else bfloat16 panels), packed in oneDNN's, or plain.
@pytest.mark.parametrize("weights", ["native", "onednn", "plain"])
@pytest.mark.parametrize("step", ["decode", "mixed", "mixed-trimmed"])
def test_native_layer_equals_the_python_layer(
    tmp_path: Path, arch: str, extra: dict, dtype: torch.dtype, weights: str, step: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:  # fmt: skip
    monkeypatch.setenv("STOKER_CPU_ONEDNN", "0" if weights == "plain" else "1")
    monkeypatch.setenv("STOKER_CPU_GEMM", "onednn" if weights == "onednn" else "auto")
    folder = make_model(tmp_path / arch, arch, num_layers=3, hidden_size=128, **extra)
    cfg = ModelConfig.from_folder(folder)
    model = load_model(folder, dtype, "cpu", 256)
    assert all(layer.native_forward is not None for layer in _layers(model))
    if weights == "native" and dtype == torch.bfloat16 and cpu_ops.use_bf16_pairs():
        assert all(layer.mlp.gate_up_proj.dim() == 4 for layer in _layers(model))
    elif weights == "native" and dtype == torch.bfloat16 and cpu_ops.use_panel_linear():
        assert all(layer.mlp.gate_up_proj.dim() == 3 for layer in _layers(model))
    if "sliding_window" in extra:
        assert all(layer.attn.window == 24 for layer in _layers(model))
    chunks = _chunks(random.Random(2), prompt=step != "decode")
    trim = step == "mixed-trimmed"
    with torch.inference_mode():
        ref, ref_kv, python_calls = _forward(model, cfg, chunks, dtype, False, trim)
        out, out_kv, native_calls = _forward(model, cfg, chunks, dtype, True, trim)
    assert python_calls == 0 and native_calls == cfg.num_layers
    if trim:  # the last layer kept the decode rows and the sampling chunk's last row
        assert out.shape[0] == 7 + 1
    assert torch.equal(out, ref)
    for (k1, v1), (k2, v2) in zip(ref_kv, out_kv):
        assert torch.equal(k1, k2) and torch.equal(v1, v2)


def test_forced_backends_and_prompts_without_the_prefill_kernel_keep_the_python_layer(
    tmp_path: Path,
) -> None:
    folder = make_model(tmp_path / "llama", "llama", num_layers=2)
    cfg = ModelConfig.from_folder(folder)
    model = load_model(folder, torch.float32, "cpu", 256)
    with torch.inference_mode():
        with force_backend("torch"):  # tests comparing against the references get them
            decode = _chunks(random.Random(3), prompt=False)
            *_, calls = _forward(model, cfg, decode, torch.float32, True)
        assert calls == 0
        for layer in _layers(model):
            layer.native_prompts = False  # as for a head size the prefill kernel lacks
        *_, calls = _forward(model, cfg, _chunks(random.Random(3), True), torch.float32, True)
        assert calls == 0


@pytest.mark.parametrize(
    ("arch", "extra"),
    [
        ("gemma2", {"head_dim": 16}),  # its own layer class
        ("phi3", {"partial_rotary_factor": 0.5}),  # partial rotary
        ("mixtral", {"num_local_experts": 4, "num_experts_per_tok": 2}),  # experts, not a MLP
    ],
)
def test_layers_the_native_call_cannot_run_exactly_are_not_marked(
    tmp_path: Path, arch: str, extra: dict
) -> None:
    folder = make_model(tmp_path / arch, arch, num_layers=2, **extra)
    model = load_model(folder, torch.float32, "cpu", 256)
    assert enable_native_layers(model, CPU, torch.float32) == 0
    assert all(layer.native_forward is None for layer in _layers(model))


def test_an_eagle_heads_layers_are_marked(tmp_path: Path) -> None:
    """The head's draft steps are decode rows too (services/worker/eagle/head.py)."""
    from stoker.services.worker.eagle.config import EagleConfig
    from stoker.services.worker.eagle.head import load_head
    from tests.spec.eagle_heads import make_head

    target = make_model(tmp_path / "target", "llama", num_layers=4)
    folder = make_head(target, tmp_path / "head", num_layers=2)
    head = load_head(folder, EagleConfig.from_folder(folder), torch.float32, CPU, 256)
    assert len(_layers(head)) == 2
    assert all(layer.native_forward is not None for layer in _layers(head))


def test_the_environment_switch_keeps_every_layer_in_python(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("STOKER_NATIVE_LAYER", "off")
    folder = make_model(tmp_path / "llama", "llama", num_layers=2)
    model = load_model(folder, torch.float32, "cpu", 256)
    assert all(layer.native_forward is None for layer in _layers(model))
