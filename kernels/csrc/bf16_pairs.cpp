// bfloat16 linear layers at decode's few rows (services/worker/models/layers.linear), and the
// greedy head's screen (services/worker/greedy_head.py): x @ W^T (+ bias) from bfloat16 x and W,
// in vdpbf16ps (exact products, float32 sums), the bias added in float32, rounded to bfloat16
// once, as oneDNN's bfloat16 linear rounds its output (so greedy_candidates' bound holds). Each
// output is one ordered chain over K whatever the row count, so a row's result does not depend
// on the batch it runs in. oneDNN's kernel costs 25-35 us a call at one row whatever the size
// (SmolLM2's 576-wide layers take 6-27 us here) and read the 56.6 MB head at about 22 GB/s,
// where this streams it at about 34.
//
// The weight is laid out [N / 16, K / 2, 16, 2]: for 16 outputs at a time, each pair of inputs'
// weights side by side, one 64-byte vector per pair (what vdpbf16ps multiplies against a
// broadcast pair of x). Up to four such panels and four rows per tile: 16 accumulators.
#include <ATen/Parallel.h>

#include <cstdint>

#include "kernels.h"

#if defined(__AVX512BF16__)
#include <immintrin.h>
#endif

namespace {
constexpr int64_t kLanes = 16;
constexpr int kPanels = 4;  // panels per tile
constexpr int kRows = 4;    // rows per tile

#if defined(__AVX512BF16__)
template <int NR, int NP>
void tile(const uint32_t* x, int64_t K2, const uint16_t* w, const float* bias, int64_t N,
          int64_t p0, int64_t r0, uint16_t* out) {
  __m512 acc[NR][NP];
  for (int i = 0; i < NR; ++i)
    for (int j = 0; j < NP; ++j) acc[i][j] = _mm512_setzero_ps();
  const uint16_t* base = w + p0 * K2 * 2 * kLanes;
  for (int64_t k2 = 0; k2 < K2; ++k2) {
    __m512bh wv[NP];
    for (int j = 0; j < NP; ++j)
      wv[j] = (__m512bh)_mm512_loadu_si512(base + (j * K2 + k2) * 2 * kLanes);
    for (int i = 0; i < NR; ++i) {
      const __m512bh xv = (__m512bh)_mm512_set1_epi32(static_cast<int>(x[(r0 + i) * K2 + k2]));
      for (int j = 0; j < NP; ++j) acc[i][j] = _mm512_dpbf16_ps(acc[i][j], xv, wv[j]);
    }
  }
  if (bias) {
    for (int j = 0; j < NP; ++j) {
      const __m512 b = _mm512_loadu_ps(bias + (p0 + j) * kLanes);
      for (int i = 0; i < NR; ++i) acc[i][j] = _mm512_add_ps(acc[i][j], b);
    }
  }
  for (int i = 0; i < NR; ++i)
    for (int j = 0; j < NP; ++j)
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + (r0 + i) * N + (p0 + j) * kLanes),
                          (__m256i)_mm512_cvtneps_pbh(acc[i][j]));
}

template <int NP>
void rows(const uint32_t* x, int64_t M, int64_t K2, const uint16_t* w, const float* bias,
          int64_t N, int64_t p0, uint16_t* out) {
  int64_t r = 0;
  for (; r + kRows <= M; r += kRows) tile<kRows, NP>(x, K2, w, bias, N, p0, r, out);
  switch (M - r) {
    case 3: tile<3, NP>(x, K2, w, bias, N, p0, r, out); break;
    case 2: tile<2, NP>(x, K2, w, bias, N, p0, r, out); break;
    case 1: tile<1, NP>(x, K2, w, bias, N, p0, r, out); break;
    default: break;
  }
}

// Panels [p0, p1) in tiles of kPanels, the last one narrower.
void panel_range(const uint32_t* x, int64_t M, int64_t K2, const uint16_t* w, const float* bias,
                 int64_t N, int64_t p0, int64_t p1, uint16_t* out) {
  int64_t p = p0;
  for (; p + kPanels <= p1; p += kPanels) rows<kPanels>(x, M, K2, w, bias, N, p, out);
  switch (p1 - p) {
    case 3: rows<3>(x, M, K2, w, bias, N, p, out); break;
    case 2: rows<2>(x, M, K2, w, bias, N, p, out); break;
    case 1: rows<1>(x, M, K2, w, bias, N, p, out); break;
    default: break;
  }
}
#endif
}  // namespace

bool bf16_pairs_supported() {
#if defined(__AVX512BF16__)
  return true;
#else
  return false;
#endif
}

torch::Tensor pack_bf16_pairs(torch::Tensor weight) {
  TORCH_CHECK(weight.dim() == 2, "a [N, K] weight");
  const int64_t N = weight.size(0), K = weight.size(1);
  TORCH_CHECK(N % kLanes == 0 && K % 2 == 0, "N must be a multiple of 16 and K even");
  return weight.to(torch::kBFloat16)
      .contiguous()
      .view({N / kLanes, kLanes, K / 2, 2})
      .permute({0, 2, 1, 3})
      .contiguous();
}

torch::Tensor bf16_pairs_linear(torch::Tensor x, torch::Tensor packed, OptTensor bias) {
  TORCH_CHECK(bf16_pairs_supported(), "bf16_pairs_linear needs AVX512-BF16");
  TORCH_CHECK(x.scalar_type() == torch::kBFloat16, "x: bfloat16");
  TORCH_CHECK(packed.dim() == 4 && packed.size(2) == kLanes && packed.size(3) == 2 &&
                  packed.scalar_type() == torch::kBFloat16 && packed.is_contiguous(),
              "packed: pack_bf16_pairs' layout");
  const int64_t P = packed.size(0), K2 = packed.size(1), N = P * kLanes;
  TORCH_CHECK(x.size(-1) == 2 * K2, "x has ", x.size(-1), " features, the weight ", 2 * K2);
  auto out_shape = x.sizes().vec();
  out_shape.back() = N;
  torch::Tensor xc = x.reshape({-1, 2 * K2}).contiguous();
  const int64_t M = xc.size(0);
  torch::Tensor out = torch::empty({M, N}, x.options());
  torch::Tensor bias32;
  if (bias.has_value() && bias->defined()) {
    bias32 = bias->to(torch::kFloat32).contiguous();
    TORCH_CHECK(bias32.numel() == N, "bias has ", bias32.numel(), " values, the weight ", N);
  }
#if defined(__AVX512BF16__)
  const auto* xp = reinterpret_cast<const uint32_t*>(xc.data_ptr());
  const auto* wp = reinterpret_cast<const uint16_t*>(packed.data_ptr());
  const float* bp = bias32.defined() ? bias32.data_ptr<float>() : nullptr;
  auto* op = reinterpret_cast<uint16_t*>(out.data_ptr());
  // Panels split evenly over the threads (SmolLM2's 576 outputs are 36 panels: 18 each, where
  // whole tiles of four would give 5 and 4), each thread's share in tiles of four.
  if (M) {
    at::parallel_for(0, P, 1, [&](int64_t p0, int64_t p1) {
      panel_range(xp, M, K2, wp, bp, N, p0, p1, op);
    });
  }
#endif
  return out.view(out_shape);
}
