"""The race's counter-based noise: native kernel against the torch version, one key one row,
and Exp(1) statistics within and across rows."""

from __future__ import annotations

import math

import pytest
import torch

from stoker.kernels import cpu_ops
from stoker.services.worker import sampling_noise
from stoker.services.worker.sampling_noise import noise_rows, seeded_key, seeded_noise

native = pytest.mark.skipif(cpu_ops.load() is None, reason="native CPU kernels unavailable")


def keys(n: int, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, sampling_noise.MASK63, (n,), generator=gen)


@native
@pytest.mark.parametrize("vocab", [1, 15, 16, 17, 4095, 4096, 4097, 49152, 50257])
def test_native_noise_matches_the_torch_version(vocab: int) -> None:
    k = keys(5)
    got = cpu_ops.load().exponential_noise_rows(k, vocab)  # type: ignore[union-attr]
    want = sampling_noise._noise_torch(k, vocab)
    assert got.shape == (5, vocab) and got.dtype == torch.float32
    # Same uniforms; the logs (a polynomial against libm's) agree within a couple of ulps.
    torch.testing.assert_close(got, want, rtol=3e-7, atol=1e-9)


@pytest.mark.parametrize("build", ["native", "none"])
def test_a_row_is_a_function_of_its_key_alone(build: str, monkeypatch) -> None:
    if build == "none":  # a CPU without the native kernels: per-row generators instead
        monkeypatch.setattr(cpu_ops, "load", lambda: None)
    elif cpu_ops.load() is None:
        pytest.skip("native CPU kernels unavailable")
    k = keys(7)
    batch = noise_rows(k, 3000)
    assert bool(torch.isfinite(batch).all()) and float(batch.min()) > 0
    for i in (0, 3, 6):
        assert torch.equal(noise_rows(k[i : i + 1], 3000)[0], batch[i])
    assert torch.equal(noise_rows(k[[6, 0]], 3000), batch[[6, 0]])  # any order, any batch
    key = torch.tensor([seeded_key(1234, 17)])
    assert torch.equal(seeded_noise(1234, 17, 3000, torch.device("cpu")), noise_rows(key, 3000)[0])


def test_noise_is_exp1_within_rows_and_independent_across_rows_and_positions() -> None:
    # Seeded keys are consecutive integers for one seed: their rows must still be unrelated.
    k = torch.tensor([seeded_key(7, p) for p in range(64)])
    q = noise_rows(k, 32768)
    assert bool(torch.isfinite(q).all()) and float(q.min()) > 0
    flat = q.double().flatten()
    assert abs(float(flat.mean()) - 1) < 0.005 and abs(float(flat.var()) - 1) < 0.01
    for t in (0.01, 0.5, 1.0, 2.0, 5.0):
        assert abs(float((flat > t).double().mean()) / math.exp(-t) - 1) < 0.03
    u = torch.exp(-q.double())  # back to the uniforms: correlation between neighbours ~ 0
    z = (u - 0.5) * math.sqrt(12)
    bound = 5 / math.sqrt(z[:, 1:].numel())
    assert abs(float((z[:, 1:] * z[:, :-1]).mean())) < bound  # adjacent tokens of a row
    assert abs(float((z[1:] * z[:-1]).mean())) < bound  # the same token, adjacent positions
    assert abs(float((z[1:, :-1] * z[:-1, 1:]).mean())) < bound  # diagonal neighbours


def test_exponential_noise_keys_each_row_from_the_generator() -> None:
    shape = (3, 4, 100)
    cpu = torch.device("cpu")
    a = sampling_noise.exponential_noise(shape, torch.Generator().manual_seed(5), cpu)
    b = sampling_noise.exponential_noise(shape, torch.Generator().manual_seed(5), cpu)
    assert a.shape == shape and torch.equal(a, b)
    rows = a.view(12, 100)
    assert len({tuple(r[:4].tolist()) for r in rows}) == 12  # twelve distinct keys
