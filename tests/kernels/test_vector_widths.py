"""The hand-vectorised native kernels at both vector widths, whatever CPU runs the suite.

`kernels/csrc/vec_exp.h` picks 16-float vectors on AVX-512 CPUs and 8-float ones elsewhere, and
the attention kernels' butterflies and tiles differ between the two, as do the panel GEMM's
register tiles. The default suite builds only the host's width, so this builds the attention,
silu, sampling-noise and panel kernels again for AVX2 and, where the CPU has it, for AVX-512, and
checks each build against the torch references.
Slow: each build is a compile of five kernels (about a minute and a half on two cores)."""

from __future__ import annotations

import platform
import shutil
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from stoker.kernels import paged_attention as ref
from stoker.services.worker.sampling_noise import _noise_torch
from tests.kernels.paged_cache import random_paged_cache

pytestmark = pytest.mark.slow

CSRC = Path(__file__).resolve().parents[2] / "kernels" / "csrc"
SOURCES = (
    "paged_decode_attention.cpp",
    "prefill_attention.cpp",
    "silu_mul.cpp",
    "sampling_noise.cpp",
    "panel_linear.cpp",
)

BINDINGS = """
#include "kernels.h"
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_decode_attention", &paged_decode_attention, "");
  m.def("prefill_attention", &prefill_attention, "");
  m.def("silu_and_mul", &silu_and_mul, "");
  m.def("exponential_noise_rows", &exponential_noise_rows, "");
  m.def("pack_panels", &pack_panels, "");
  m.def("panel_linear", &panel_linear, "");
}
"""
# The instruction sets each width is built for, and the CPU flags that running it needs.
WIDTHS = {
    "avx2": (["-mavx2", "-mfma", "-mf16c"], {"avx2", "fma", "f16c"}),
    "avx512": (
        ["-mavx2", "-mfma", "-mf16c", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq"],
        {"avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512dq"},
    ),
}


def _cpu_flags() -> set[str]:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


@pytest.fixture(scope="module", params=sorted(WIDTHS))
def module(request, tmp_path_factory):
    flags, needs = WIDTHS[request.param]
    if platform.machine() != "x86_64" or not needs <= _cpu_flags():
        pytest.skip(f"this CPU cannot run a {request.param} build")
    if shutil.which("c++") is None or shutil.which("ninja") is None:
        pytest.skip("no C++ compiler or ninja")
    from torch.utils.cpp_extension import load

    build = tmp_path_factory.mktemp(f"kernels-{request.param}")
    (build / "bindings.cpp").write_text(BINDINGS)
    return load(
        name=f"stoker_width_{request.param}",
        sources=[str(build / "bindings.cpp"), *(str(CSRC / s) for s in SOURCES)],
        build_directory=str(build),
        extra_cflags=["-O2", "-fopenmp", *flags],
        extra_include_paths=[str(CSRC)],
        extra_ldflags=["-fopenmp"],
    )


# (query heads, kv heads, head_dim): head dims of one, two and eight 8-float vectors, groups 1-4.
SHAPES = [(12, 4, 64), (4, 4, 16), (8, 2, 128), (9, 3, 32)]
# Context lengths that end inside a vector, at its edge and past several (1 to 70).
LENS = [1, 7, 8, 9, 16, 17, 33, 70]


@pytest.mark.parametrize("hq, hk, d", SHAPES)
@pytest.mark.parametrize("window, softcap", [(None, None), (5, None), (None, 30.0)])
def test_decode_attention(module, hq, hk, d, window, softcap):
    kc, vc, tables = random_paged_cache(len(LENS), hk, d, 16, LENS, seed=d)
    q = torch.randn(len(LENS), hq, d) * 3
    lens = torch.tensor(LENS)
    got = module.paged_decode_attention(
        q, kc, vc, tables, lens, d**-0.5, window or 0, softcap or 0.0
    )
    want = ref.paged_decode_attention(q, kc, vc, tables, lens, d**-0.5, window, softcap)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("hq, hk, d", SHAPES)
def test_prefill_attention(module, hq, hk, d):
    spans = [(0, 1), (0, 9), (5, 33), (40, 70), (0, 130)]  # (cached prefix, chunk length)
    lens = [p + n for p, n in spans]
    kc, vc, tables = random_paged_cache(len(spans), hk, d, 16, lens, seed=d + 1)
    q = torch.randn(sum(n for _, n in spans), hq, d) * 3
    bounds = torch.tensor([0, *torch.tensor([n for _, n in spans]).cumsum(0).tolist()])
    scale = d**-0.5
    got = module.prefill_attention(q, kc, vc, tables, bounds, torch.tensor(lens), scale, 0, 0.0)
    for s, length in enumerate(lens):
        rows = slice(int(bounds[s]), int(bounds[s + 1]))
        want = ref.paged_prefill_attention(q[rows], kc, vc, tables[s], length, scale)
        torch.testing.assert_close(got[rows], want, rtol=1e-5, atol=1e-5)


def test_silu_and_mul(module):
    gate_up = torch.randn(5, 2 * 77) * 4  # 77: a tail past the last whole vector
    gate, up = gate_up.chunk(2, dim=-1)
    torch.testing.assert_close(module.silu_and_mul(gate_up), F.silu(gate) * up)


def test_sampling_noise(module):
    keys = torch.tensor([0, 1, -5, 2**62 + 3], dtype=torch.int64)
    for vocab in (1, 7, 8, 9, 100):
        torch.testing.assert_close(
            module.exponential_noise_rows(keys, vocab), _noise_torch(keys, vocab)
        )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_panel_linear(module, dtype):
    """Rows around both widths' tiles (6 on AVX2, 12 on AVX-512) and an odd panel count (the
    AVX-512 tile pairs panels); float32 weights, and bfloat16 ones widened as they load."""
    gen = torch.Generator().manual_seed(0)
    weight, bias = torch.randn(48, 77, generator=gen).to(dtype), torch.randn(48).to(dtype)
    panels = module.pack_panels(weight)
    for rows in (1, 6, 7, 12, 13, 50):
        x = torch.randn(rows, 77, generator=gen).to(dtype)
        got = module.panel_linear(x, panels, bias)
        want = x.double() @ weight.double().T + bias.double()
        tol = 1e-5 if dtype == torch.float32 else 2**-8
        assert got.dtype == dtype
        torch.testing.assert_close(got.double(), want, rtol=tol, atol=1e-5)
