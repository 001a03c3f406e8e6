"""The shared training loop (AdamW, warmup + cosine LR, bf16 autocast, tqdm, resumable)."""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable

import torch
from tqdm.auto import tqdm


@dataclasses.dataclass
class TrainConfig:
    steps: int
    batch_size: int
    seq_len: int
    lr: float = 2e-3
    min_lr_ratio: float = 0.1
    warmup_frac: float = 0.03
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    bf16: bool = True  # autocast matmuls to bfloat16 (fp32 master weights)
    minutes: float | None = None  # wall-clock cap: the schedule runs on max(step, time) progress
    seed: int = 0


@dataclasses.dataclass
class LoopState:
    """What a checkpoint needs to continue the schedule where it stopped."""

    step: int = 0
    elapsed_s: float = 0.0
    loss_ema: float | None = None


class TokenStream:
    """Training windows from one long token stream; every window starts with <bos>."""

    def __init__(self, ids: torch.Tensor, seq_len: int, bos_id: int) -> None:
        if ids.numel() < seq_len:
            raise ValueError(f"stream of {ids.numel()} tokens is shorter than seq_len {seq_len}")
        self.ids, self.seq_len, self.bos_id = ids.long(), seq_len, bos_id

    def sample(self, batch_size: int, gen: torch.Generator) -> torch.Tensor:
        body = self.seq_len - 1
        starts = torch.randint(0, self.ids.numel() - body + 1, (batch_size,), generator=gen)
        windows = torch.stack([self.ids[s : s + body] for s in starts.tolist()])
        return torch.cat([torch.full((batch_size, 1), self.bos_id), windows], dim=1)

    def sequential(self) -> torch.Tensor:
        """Non-overlapping windows covering the stream (the ragged tail dropped), for evaluation."""
        body = self.seq_len - 1
        n = max(1, self.ids.numel() // body)
        windows = self.ids[: n * body].view(n, body)
        return torch.cat([torch.full((n, 1), self.bos_id), windows], dim=1)


def lr_factor(progress: float, warmup_frac: float, min_ratio: float) -> float:
    if progress < warmup_frac:
        return progress / warmup_frac
    p = min(1.0, (progress - warmup_frac) / max(1e-9, 1.0 - warmup_frac))
    return min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * p))


def make_optimizer(model: torch.nn.Module, cfg: TrainConfig) -> torch.optim.Optimizer:
    params = [p for p in model.parameters() if p.requires_grad]
    decay = [p for p in params if p.dim() >= 2]
    no_decay = [p for p in params if p.dim() < 2]
    groups = [
        {"params": decay, "weight_decay": cfg.weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=(0.9, 0.95), eps=1e-8)


def train(
    model: torch.nn.Module,
    loss_fn: Callable[[torch.Tensor], torch.Tensor],
    next_batch: Callable[[], torch.Tensor],
    cfg: TrainConfig,
    optimizer: torch.optim.Optimizer,
    state: LoopState | None = None,
    desc: str = "train",
    checkpoint: Callable[[LoopState], None] | None = None,
    checkpoint_every_s: float = 120.0,
) -> LoopState:
    """Run until `cfg.steps` steps or `cfg.minutes` of (cumulative) wall time have passed."""
    state = state or LoopState()
    budget_s = cfg.minutes * 60.0 if cfg.minutes else math.inf
    model.train()
    by_time = cfg.minutes is not None  # the bar then counts seconds of the budget
    total, unit = (int(budget_s), "s") if by_time else (cfg.steps, "step")
    bar = tqdm(total=total, desc=desc, unit=unit, dynamic_ncols=True)
    start, last_ckpt = time.perf_counter() - state.elapsed_s, time.perf_counter()
    while state.step < cfg.steps and state.elapsed_s < budget_s:
        progress = max(state.step / cfg.steps, state.elapsed_s / budget_s)
        lr = cfg.lr * lr_factor(progress, cfg.warmup_frac, cfg.min_lr_ratio)
        for group in optimizer.param_groups:
            group["lr"] = lr
        batch = next_batch()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=cfg.bf16):
            loss = loss_fn(batch)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
        optimizer.step()
        value = loss.item()
        ema = state.loss_ema
        state.loss_ema = value if ema is None else 0.98 * ema + 0.02 * value
        state.step += 1
        state.elapsed_s = time.perf_counter() - start
        bar.update(min(total, int(state.elapsed_s) if by_time else state.step) - bar.n)
        bar.set_postfix(step=state.step, loss=f"{state.loss_ema:.3f}", lr=f"{lr:.1e}")
        if checkpoint and time.perf_counter() - last_ckpt > checkpoint_every_s:
            checkpoint(state)
            last_ckpt = time.perf_counter()
    bar.close()
    model.eval()
    return state


@torch.no_grad()
def evaluate_nll(
    logits_fn: Callable[[torch.Tensor], torch.Tensor], windows: torch.Tensor, batch_size: int = 8
) -> float:
    """Mean next-token negative log-likelihood (nats) over all windows, in float32."""
    total, count = 0.0, 0
    for i in range(0, windows.shape[0], batch_size):
        chunk = windows[i : i + batch_size]
        logits = logits_fn(chunk[:, :-1]).float()
        nll = torch.nn.functional.cross_entropy(
            logits.flatten(0, 1), chunk[:, 1:].flatten(), reduction="sum"
        )
        total += nll.item()
        count += chunk[:, 1:].numel()
    return total / count
