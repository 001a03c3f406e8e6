"""Exp(1) noise for the exponential race, from a counter-based generator.

Each row has a 63-bit key; element i of that row is -log(u), u built from splitmix64 of the
mixed key plus (i + 1) golden-ratio steps (kernels/csrc/sampling_noise.cpp states the bits). A
row's noise is a function of its key alone, so a seeded request's token at an output position
is the same in a plain decode, a verify at any k and any batch; unseeded rows take their keys
from the engine's generator, one draw per row. The native kernel makes the noise of a sampled
32-row step at 49,152 tokens of vocabulary in a fifteenth of torch.rand + log's time; the
torch version here gives the same bits on other devices (CUDA), the log within an ulp or two.
A CPU without the native build seeds one torch generator per row from its key instead.
"""

from __future__ import annotations

import math

import torch

from stoker.kernels import cpu_ops

_GOLDEN = 0x9E3779B97F4A7C15
_M1, _M2 = 0xBF58476D1CE4E5B9, 0x94D049BB133111EB
SEED_MIX = 1_000_003  # seed * SEED_MIX + position: distinct keys per (seed, output position)
MASK63 = (1 << 63) - 1


def _i64(x: int) -> int:
    """A 64-bit constant as the int64 with the same bits (torch multiplies int64 modulo 2^64)."""
    return x - (1 << 64) if x >= 1 << 63 else x


def _shr(x: torch.Tensor, s: int) -> torch.Tensor:
    """Logical right shift of int64 bits (torch's >> on int64 is arithmetic)."""
    return (x >> s) & ((1 << (64 - s)) - 1)


def _mix64(z: torch.Tensor) -> torch.Tensor:
    z = (z ^ _shr(z, 30)) * _i64(_M1)
    z = (z ^ _shr(z, 27)) * _i64(_M2)
    return z ^ _shr(z, 31)


def _noise_torch(keys: torch.Tensor, vocab: int) -> torch.Tensor:
    counters = torch.arange(1, vocab + 1, device=keys.device, dtype=torch.int64)
    z = _mix64(_mix64(keys)[:, None] + counters * _i64(_GOLDEN))
    odd = (_shr(z, 41) * 2 + 1).to(torch.float32)  # 2j + 1 < 2^24: exact
    return torch.log(odd * 2.0**-24).neg_()


def _noise_cpu_generators(keys: torch.Tensor, vocab: int) -> torch.Tensor:
    """Without the native build: one torch generator per row, seeded by its key. Other bits
    than the kernel's, but still a function of the key alone; the int64 hash above runs 15-20x
    slower than this on a CPU (184 against ~11 ms for 32 x 49,152)."""
    out = torch.empty(len(keys), vocab)
    gen = torch.Generator()
    for row, key in enumerate(keys.tolist()):
        gen.manual_seed(key)
        torch.rand(vocab, generator=gen, out=out[row])
    return out.clamp_(2.0**-25, 1.0 - 2.0**-24).log_().neg_()


def noise_rows(keys: torch.Tensor, vocab: int) -> torch.Tensor:
    """[rows, vocab] float32 Exp(1) noise, finite and positive, for int64 keys [rows]."""
    if keys.device.type == "cpu":
        module = cpu_ops.load()
        if module is not None:
            return module.exponential_noise_rows(keys, vocab)
        return _noise_cpu_generators(keys, vocab)
    return _noise_torch(keys, vocab)


def random_keys(rows: int, generator: torch.Generator | None, device: torch.device) -> torch.Tensor:
    return torch.randint(0, MASK63, (rows,), generator=generator, device=device)


def seeded_key(seed: int, position: int) -> int:
    return (seed * SEED_MIX + position) & MASK63


def exponential_noise(
    shape: torch.Size | tuple[int, ...], generator: torch.Generator | None, device: torch.device
) -> torch.Tensor:
    """Exp(1) float32 noise of `shape`, each row (over the last dimension) keyed from
    `generator`."""
    shape = tuple(shape)
    rows = math.prod(shape[:-1])
    return noise_rows(random_keys(rows, generator, device), shape[-1]).view(shape)


def seeded_noise(seed: int, position: int, vocab_size: int, device: torch.device) -> torch.Tensor:
    """The noise of a seeded request's output token `position`: a function of (seed, position)."""
    keys = torch.tensor([seeded_key(seed, position)], dtype=torch.int64, device=device)
    return noise_rows(keys, vocab_size)[0]
