"""Pretraining the target: token streams from documents, the LM training run, evaluation."""

from __future__ import annotations

import dataclasses
import math

import torch
import torch.nn.functional as F
from tokenizers import Tokenizer
from transformers import LlamaConfig

from stoker.tools.training import loop, net
from stoker.tools.training.corpus import Document, chat_exchanges
from stoker.tools.training.tokenizer import render_chat


@dataclasses.dataclass
class Streams:
    train: torch.Tensor  # 1-D token ids: documents (each ending in <eos>) then chat exchanges
    val: torch.Tensor  # 1-D token ids of the held-out text, documents ending in <eos>
    val_bytes: int  # UTF-8 bytes of the held-out text, for bits per byte
    chat_tokens: int


def encode_docs(tok: Tokenizer, docs: list[Document], eos_id: int) -> list[int]:
    out: list[int] = []
    for enc in tok.encode_batch([d.text for d in docs], add_special_tokens=False):
        out.extend(enc.ids)
        out.append(eos_id)
    return out


def build_streams(
    tok: Tokenizer,
    train_docs: list[Document],
    val_docs: list[Document],
    eos_id: int,
    chat_frac: float,
    seed: int,
) -> Streams:
    """Tokenise the splits; append chat-formatted exchanges (~`chat_frac` of the train tokens)."""
    train = encode_docs(tok, train_docs, eos_id)
    chat: list[int] = []
    if chat_frac > 0:
        target = int(len(train) * chat_frac / (1.0 - chat_frac))
        for conv in chat_exchanges(train_docs, count=max(1, target // 40), seed=seed):
            chat.extend(tok.encode(render_chat(conv), add_special_tokens=False).ids)
            if len(chat) >= target:
                break
    val = encode_docs(tok, val_docs, eos_id)
    val_bytes = sum(len(d.text.encode("utf-8")) for d in val_docs)
    return Streams(torch.tensor(train + chat), torch.tensor(val), val_bytes, len(chat))


def train_target(
    config: LlamaConfig,
    streams: Streams,
    cfg: loop.TrainConfig,
    bos_id: int,
    short_frac: float,
) -> tuple[net.LeanLlama, loop.LoopState]:
    """Train from scratch. The first `short_frac` of the steps use half-length windows (twice
    the batch, the same tokens per step): cheaper attention; the rest teach the full context."""
    model = net.LeanLlama(config)
    model.init_weights(cfg.seed)
    optimizer = loop.make_optimizer(model, cfg)
    gen = torch.Generator().manual_seed(cfg.seed)
    long = loop.TokenStream(streams.train, cfg.seq_len, bos_id)
    short = loop.TokenStream(streams.train, cfg.seq_len // 2, bos_id)
    state = loop.LoopState()

    def next_batch() -> torch.Tensor:
        if state.step < short_frac * cfg.steps:
            return short.sample(cfg.batch_size * 2, gen)
        return long.sample(cfg.batch_size, gen)

    def loss_fn(batch: torch.Tensor) -> torch.Tensor:
        logits = model(batch[:, :-1]).float()
        return F.cross_entropy(logits.flatten(0, 1), batch[:, 1:].flatten())

    state = loop.train(model, loss_fn, next_batch, cfg, optimizer, state, desc="target")
    return model, state


@dataclasses.dataclass
class EvalResult:
    nll: float  # nats per token
    tokens: int
    bits_per_byte: float

    @property
    def perplexity(self) -> float:
        return math.exp(self.nll)


def evaluate(model: net.LeanLlama, streams: Streams, seq_len: int, bos_id: int) -> EvalResult:
    """Teacher-forced NLL over the held-out stream in non-overlapping <bos>-led windows."""
    windows = loop.TokenStream(streams.val, seq_len, bos_id).sequential()
    model.eval()
    nll = loop.evaluate_nll(model, windows)
    tokens = windows[:, 1:].numel()
    covered_bytes = streams.val_bytes * tokens / streams.val.numel()
    return EvalResult(nll, tokens, nll * tokens / math.log(2) / covered_bytes)
