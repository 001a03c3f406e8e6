"""timing: each kernel as the model calls it (kernels.dispatch: triton on CUDA) against the time
its bytes take at the measured device copy bandwidth: decode attention (uniform and mixed
contexts, split-K tried), RMSNorm, rotary, the fused q/k norm + rotary, silu-and-mul and the
sampling race, each beside what it replaced where it replaced something."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch

from gpu_phases.shared import Report, bench, copy_bandwidth, device, dtype


class Timer:
    """The shared set-up of every timing: shapes, random inputs, and one record per timing."""

    def __init__(self, smoke: bool, report: Report) -> None:
        self.smoke, self.report = smoke, report
        self.dev, self.dtype = device(), dtype()
        self.elem = torch.tensor([], dtype=self.dtype).element_size()
        self.bandwidth = copy_bandwidth(smoke)
        self.gen = torch.Generator(self.dev).manual_seed(0)
        shape = (4, 2, 32, 64, 16) if smoke else (16, 8, 128, 1024, 16)
        self.num_q, self.num_kv, self.head_dim, self.hidden, self.bs = shape

    def randn(self, *shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=self.gen, device=self.dev).to(self.dtype)

    def paged(self, batch: int, width: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """K/V caches and a [batch, width] table of distinct shuffled blocks."""
        blocks = batch * width + 1
        shape = (blocks, self.bs, self.num_kv, self.head_dim)
        kc, vc = self.randn(*shape), self.randn(*shape)
        tables = torch.randperm(blocks, generator=self.gen, device=self.dev)[: batch * width]
        return kc, vc, tables.view(batch, width)

    def record(self, name: str, nbytes: int, fn: Callable[[], object], **shape) -> None:
        seconds = bench(fn, iters=3 if self.smoke else 50)
        floor = nbytes / self.bandwidth
        self.report.add(
            kernel=name,
            **shape,
            us=round(seconds * 1e6, 2),
            floor_us=round(floor * 1e6, 2),
            of_floor=round(floor / seconds, 3),
            gb_s=round(nbytes / seconds / 1e9, 1),
        )
        print("timing:", self.report.data["records"][-1])


def _decode_uniform(t: Timer) -> None:
    """Every row at one context, tables as wide as the context or as max_model_len 2048 (the
    CUDA-graph padding): the launch grid comes from the width."""
    from stoker.kernels import dispatch

    ctx = 64 if t.smoke else 1024
    for batch in (1, 4) if t.smoke else (1, 64, 256):
        for width_from in ("context", "max_model_len_2048"):
            width = -(-ctx // t.bs) if width_from == "context" else -(-2048 // t.bs)
            kc, vc, tables = t.paged(batch, width)
            lens = torch.full((batch,), ctx, device=t.dev)
            q = t.randn(batch, t.num_q, t.head_dim)
            nbytes = (2 * batch * ctx * t.num_kv + 2 * batch * t.num_q) * t.head_dim * t.elem
            t.record(
                "paged_decode_attention",
                nbytes,
                lambda q=q, kc=kc, vc=vc, tab=tables, n=lens: dispatch.paged_decode_attention(
                    q, kc, vc, tab, n, 0.1
                ),
                batch=batch,
                context=ctx,
                table_width_from=width_from,
            )


def _decode_mixed(t: Timer) -> None:
    """Mixed context lengths, as in the nano-vllm workload (uniform 100-2048): whole-context
    programs leave the longest rows as a tail, which split-K could even out."""
    from stoker.kernels import dispatch

    lo, hi = (8, 64) if t.smoke else (100, 2048)
    for batch in (4, 8) if t.smoke else (64, 256):
        lens = torch.randint(lo, hi + 1, (batch,), generator=t.gen, device=t.dev)
        kc, vc, tables = t.paged(batch, -(-hi // t.bs))
        q = t.randn(batch, t.num_q, t.head_dim)
        nbytes = (2 * int(lens.sum()) * t.num_kv + 2 * batch * t.num_q) * t.head_dim * t.elem
        splits_tried = [None] if dispatch.backend_for(q) != "triton" else [None, 2, 4, 8]
        for splits in splits_tried:

            def fn(q=q, kc=kc, vc=vc, tab=tables, n=lens, s=splits):
                if s is None:  # the launch heuristic, as the model calls it
                    return dispatch.paged_decode_attention(q, kc, vc, tab, n, 0.1)
                from stoker.kernels import triton_attention as ta

                return ta.paged_decode_attention(q, kc, vc, tab, n, 0.1, num_splits=s)

            t.record(
                "paged_decode_attention_mixed",
                nbytes,
                fn,
                batch=batch,
                context=f"uniform {lo}-{hi}",
                num_splits=splits or "auto",
            )


def _norms(t: Timer, tokens: int) -> None:
    from stoker.kernels import dispatch

    x, res, w = t.randn(tokens, t.hidden), t.randn(tokens, t.hidden), t.randn(t.hidden)
    t.record(
        "rms_norm",
        (2 * tokens + 1) * t.hidden * t.elem,
        lambda x=x, w=w: dispatch.rms_norm(x, w, 1e-6),
        tokens=tokens,
    )
    t.record(
        "add_rms_norm",
        (4 * tokens + 1) * t.hidden * t.elem,
        lambda x=x, r=res, w=w: dispatch.add_rms_norm(x, r, w, 1e-6),
        tokens=tokens,
    )
    qk = t.randn(tokens, t.num_q, t.head_dim)
    t.record(
        "qk_rms_norm",
        (2 * tokens * t.num_q + 1) * t.head_dim * t.elem,
        lambda x=qk, w=t.randn(t.head_dim): dispatch.rms_norm(x, w, 1e-6),
        tokens=tokens,
    )


def _rotary(t: Timer, tokens: int) -> None:
    """Rotary alone, then Qwen3's q/k norm and rotary: one launch against the three it replaced."""
    from stoker.kernels import dispatch
    from stoker.kernels.rotary import rope_cos_sin, rope_inv_freq

    cos, sin = rope_cos_sin(rope_inv_freq(t.head_dim, 1e6, None), 4096)
    pos = torch.randint(0, 4096, (tokens,), generator=t.gen, device=t.dev)
    cos, sin = cos.to(t.dev)[pos].to(t.dtype), sin.to(t.dev)[pos].to(t.dtype)
    q, k = t.randn(tokens, t.num_q, t.head_dim), t.randn(tokens, t.num_kv, t.head_dim)
    nbytes = (2 * (t.num_q + t.num_kv) + 2) * tokens * t.head_dim * t.elem
    t.record(
        "apply_rotary",
        nbytes,
        lambda q=q, k=k, c=cos, s=sin: dispatch.apply_rotary(q, k, c, s),
        tokens=tokens,
    )
    qw, kw = t.randn(t.head_dim), t.randn(t.head_dim)

    def chain(q=q, k=k, c=cos, s=sin, qw=qw, kw=kw):
        q, k = dispatch.rms_norm(q, qw, 1e-6), dispatch.rms_norm(k, kw, 1e-6)
        return dispatch.apply_rotary(q, k, c, s)

    t.record("qk_norm_then_rotary_3_launches", nbytes, chain, tokens=tokens)
    t.record(
        "qk_norm_rotary",
        nbytes,
        lambda q=q, k=k, c=cos, s=sin, qw=qw, kw=kw: dispatch.qk_norm_rotary(
            q, k, qw, kw, 1e-6, c, s
        ),
        tokens=tokens,
    )


def _activation(t: Timer) -> None:
    """The gated MLP's activation: one pass against torch's silu then mul."""
    from stoker.kernels import activation as ref_act
    from stoker.kernels import dispatch

    for tokens in (1, 8) if t.smoke else (1, 256, 4096):
        gate_up = t.randn(tokens, 2 * (96 if t.smoke else 3072))
        nbytes = 3 * tokens * gate_up.shape[1] // 2 * t.elem
        t.record("silu_and_mul", nbytes, lambda x=gate_up: dispatch.silu_and_mul(x), tokens=tokens)
        t.record(
            "silu_then_mul_torch", nbytes, lambda x=gate_up: ref_act.silu_and_mul(x), tokens=tokens
        )


def _race(t: Timer) -> None:
    """The sampler's race: the fused kernel against the materialised noise it replaced on CUDA."""
    from stoker.kernels import dispatch
    from stoker.services.worker.sampling_noise import noise_rows

    vocab = 3000 if t.smoke else 151936
    for rows in (1, 8) if t.smoke else (1, 256):
        probs = torch.rand(rows, vocab, generator=t.gen, device=t.dev)
        keys = torch.randint(0, 2**62, (rows,), generator=t.gen, device=t.dev)
        if dispatch.race_sample(probs, keys) is not None:
            t.record(
                "race_sample",
                rows * vocab * 4,
                lambda p=probs, k=keys: dispatch.race_sample(p, k),
                rows=rows,
                vocab=vocab,
            )
        t.record(
            "race_materialised_noise",
            rows * vocab * 4,
            lambda p=probs, k=keys: (p / noise_rows(k, p.shape[-1])).max(dim=-1).indices,
            rows=rows,
            vocab=vocab,
        )


def run(work: Path, smoke: bool, report: Report) -> bool:
    from stoker.kernels import dispatch

    t = Timer(smoke, report)
    report.set(
        copy_gb_s=round(t.bandwidth / 1e9, 1),
        backend=dispatch.backend_for(torch.empty(1, dtype=t.dtype, device=t.dev)),
    )
    _decode_uniform(t)
    _decode_mixed(t)
    for tokens in (1, 256) if smoke else (1, 256, 4096):
        _norms(t, tokens)
        _rotary(t, tokens)
    _activation(t)
    _race(t)
    return True
