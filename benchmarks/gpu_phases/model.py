"""model: the Qwen3-0.6B-shaped random-init folder (bf16 on the GPU) with a word tokenizer, built
once into WORK/model for the phases after it."""

from __future__ import annotations

import time
from pathlib import Path

import torch

from gpu_phases.shared import (
    QWEN3_0_6B,
    SMOKE_MODEL,
    Report,
    device,
    dtype,
    dtype_name,
    model_path,
    weight_bytes,
)


def word_tokenizer(vocab_size: int):
    """A word-level tokenizer with one word per id ("w123"), so every sampled id decodes to text
    (the BPE test tokenizer has 512 tokens; this model samples ids up to 151936)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2} | {f"w{i}": i for i in range(3, vocab_size)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<pad>", bos_token="<s>", eos_token="</s>"
    )


def _build(path: Path, shape: dict, report: Report) -> None:
    from tests.factory import make_model

    started = time.perf_counter()
    build = dict(dtype=dtype(), with_tokenizer=False, seed=0, **shape)
    try:
        with torch.device(device()):  # random init on the GPU: seconds, not a minute
            make_model(path, "qwen3", **build)
    except Exception as e:  # a transformers that ignores the device context: the CPU
        report.set(device_init_error=f"{type(e).__name__}: {e}")
        make_model(path, "qwen3", **build)
    word_tokenizer(shape["vocab_size"]).save_pretrained(path)
    report.set(build_s=round(time.perf_counter() - started, 1))


def run(work: Path, smoke: bool, report: Report) -> bool:
    path = model_path(work)
    shape = SMOKE_MODEL if smoke else QWEN3_0_6B
    if not (path / "config.json").is_file():
        _build(path, shape, report)
    report.set(path=str(path), shape=shape, dtype=dtype_name(), weight_bytes=weight_bytes(work))
    return True
