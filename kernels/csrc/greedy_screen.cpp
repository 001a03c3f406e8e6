// Candidates for an exact greedy argmax from approximate (bfloat16) logits.
//
// services/worker/greedy_head.py computes a step's logits in bfloat16 (half the float32 LM head's
// cost on CPUs with AVX512-BF16) and bounds each one's distance from the float32 logit the full
// head would compute: |approx[r, v] - exact[r, v]| <= row_scale[r] * col_norm[v]
// + rel * |approx[r, v]| + slack. The exact argmax u of row r then satisfies
// approx[r, u] + e[r, u] >= M_r = max_v (approx[r, v] - e[r, v]), so the tokens passing that test
// are all the float32 head has to recompute. Usually one to a few per row.
//
// Two passes per row over the vocabulary, 16 logits at a time on AVX-512: M_r (and a check that
// every logit is finite), then the test, with the rare group holding a candidate scanned one by
// one. The scalar loops (other CPUs, and the tail) compute the same numbers.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <tuple>

#ifdef __AVX512F__
#include <immintrin.h>
#endif

namespace {

inline float bf16_to_float(uint16_t bits) {
  uint32_t wide = static_cast<uint32_t>(bits) << 16;
  float out;
  std::memcpy(&out, &wide, sizeof(out));
  return out;
}

// Fused as the AVX-512 loops fuse it, so both compute the same bound.
inline float bound(float a, float scale, float norm, float rel, float slack) {
  return std::fma(rel, std::fabs(a), std::fma(scale, norm, slack));
}

inline int64_t scan(const uint16_t* approx, const float* norms, int64_t v, int64_t end,
                     float best, float scale, float rel, float slack, int64_t* out,
                     int64_t count, int64_t max_out) {
  for (; v < end; ++v) {
    const float a = bf16_to_float(approx[v]);
    if (a + bound(a, scale, norms[v], rel, slack) >= best) {
      if (count == max_out) return -1;
      out[count++] = v;
    }
  }
  return count;
}

// Row r's candidates into out[0, max_out); their count, or -1 when the row holds a non-finite
// logit or more than max_out candidates (the caller then computes the row in full).
int64_t row_candidates(const uint16_t* approx, const float* norms, int64_t V, float scale,
                       float rel, float slack, int64_t* out, int64_t max_out) {
  float best = -std::numeric_limits<float>::infinity();
  float zeros = 0.0f;  // a * 0 summed: NaN once any logit is infinite or NaN
  int64_t v = 0;
#ifdef __AVX512F__
  const __m512 vscale = _mm512_set1_ps(scale), vrel = _mm512_set1_ps(rel);
  const __m512 vslack = _mm512_set1_ps(slack), vzero = _mm512_setzero_ps();
  const auto load = [&](int64_t at) {
    const __m256i bits = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(approx + at));
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16));
  };
  const auto bound16 = [&](__m512 a, int64_t at) {
    const __m512 e = _mm512_fmadd_ps(vscale, _mm512_loadu_ps(norms + at), vslack);
    return _mm512_fmadd_ps(vrel, _mm512_abs_ps(a), e);
  };
  __m512 vbest = _mm512_set1_ps(best), vzeros = vzero;
  for (; v + 16 <= V; v += 16) {
    const __m512 a = load(v);
    vzeros = _mm512_add_ps(vzeros, _mm512_mul_ps(a, vzero));
    vbest = _mm512_max_ps(vbest, _mm512_sub_ps(a, bound16(a, v)));
  }
  best = _mm512_reduce_max_ps(vbest);
  zeros = _mm512_reduce_add_ps(vzeros);
#endif
  for (int64_t tail = v; tail < V; ++tail) {
    const float a = bf16_to_float(approx[tail]);
    zeros += a * 0.0f;
    const float low = a - bound(a, scale, norms[tail], rel, slack);
    best = low > best ? low : best;
  }
  if (zeros != zeros) return -1;
  int64_t count = 0;
  v = 0;
#ifdef __AVX512F__
  const __m512 vtop = _mm512_set1_ps(best);
  for (; v + 16 <= V; v += 16) {
    const __m512 a = load(v);
    if (_mm512_cmp_ps_mask(_mm512_add_ps(a, bound16(a, v)), vtop, _CMP_GE_OQ)) {
      count = scan(approx, norms, v, v + 16, best, scale, rel, slack, out, count, max_out);
      if (count < 0) return -1;
    }
  }
#endif
  return scan(approx, norms, v, V, best, scale, rel, slack, out, count, max_out);
}

}  // namespace

// approx: bfloat16 [R, V]; row_scale: float32 [R]; col_norm: float32 [V]. Returns candidates
// int64 [R, max_per_row] (-1 past each row's count) and counts int64 [R] (-1: compute in full).
std::tuple<torch::Tensor, torch::Tensor> greedy_candidates(torch::Tensor approx,
                                                           torch::Tensor row_scale,
                                                           torch::Tensor col_norm, double rel,
                                                           double slack, int64_t max_per_row) {
  TORCH_CHECK(approx.dim() == 2 && approx.scalar_type() == torch::kBFloat16,
              "approx must be a bfloat16 [R, V] tensor");
  TORCH_CHECK(row_scale.scalar_type() == torch::kFloat32 && col_norm.scalar_type() == torch::kFloat32,
              "row_scale and col_norm must be float32");
  approx = approx.contiguous();
  row_scale = row_scale.contiguous();
  col_norm = col_norm.contiguous();
  const int64_t R = approx.size(0), V = approx.size(1);
  TORCH_CHECK(row_scale.numel() == R && col_norm.numel() == V, "shape mismatch");
  auto candidates = torch::full({R, max_per_row}, -1, torch::kInt64);
  auto counts = torch::empty({R}, torch::kInt64);
  const auto* a = reinterpret_cast<const uint16_t*>(approx.data_ptr<at::BFloat16>());
  const float* scale = row_scale.data_ptr<float>();
  const float* norms = col_norm.data_ptr<float>();
  int64_t* cand = candidates.data_ptr<int64_t>();
  int64_t* cnt = counts.data_ptr<int64_t>();
  at::parallel_for(0, R, 1, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      cnt[r] = row_candidates(a + r * V, norms, V, scale[r], static_cast<float>(rel),
                              static_cast<float>(slack), cand + r * max_per_row, max_per_row);
    }
  });
  return {candidates, counts};
}
