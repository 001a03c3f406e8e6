// Paged decode attention for the CPU, float32: one query token per request, keys and values read
// in place through the block table. The torch reference gathers every request's context into a
// padded copy first (one extra write and read of the whole KV context per layer per step); at
// batch 64 that copy costs more than the attention itself, so this kernel exists.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

torch::Tensor paged_decode_attention(
    torch::Tensor query,         // [B, Hq, D]
    torch::Tensor key_cache,     // [num_blocks, block_size, Hk, D]
    torch::Tensor value_cache,   // [num_blocks, block_size, Hk, D]
    torch::Tensor block_tables,  // [B, max_blocks] int64
    torch::Tensor context_lens,  // [B] int64
    double scale) {
  TORCH_CHECK(query.scalar_type() == torch::kFloat32, "float32 only");
  query = query.contiguous();
  TORCH_CHECK(key_cache.is_contiguous() && value_cache.is_contiguous(), "cache must be contiguous");
  block_tables = block_tables.to(torch::kInt64).contiguous();
  context_lens = context_lens.to(torch::kInt64).contiguous();
  auto out = torch::empty_like(query);
  const int64_t B = query.size(0), Hq = query.size(1), D = query.size(2);
  const int64_t BS = key_cache.size(1), Hk = key_cache.size(2);
  const int64_t G = Hq / Hk, MB = block_tables.size(1);
  const float* q = query.data_ptr<float>();
  const float* kc = key_cache.data_ptr<float>();
  const float* vc = value_cache.data_ptr<float>();
  const int64_t* bt = block_tables.data_ptr<int64_t>();
  const int64_t* lens = context_lens.data_ptr<int64_t>();
  float* o = out.data_ptr<float>();
  const float sc = static_cast<float>(scale);

  at::parallel_for(0, B * Hk, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores;
    std::vector<float> acc(G * D);
    for (int64_t idx = begin; idx < end; ++idx) {
      const int64_t b = idx / Hk, h = idx % Hk;
      const int64_t L = lens[b];
      scores.assign(G * L, 0.f);
      const float* qh = q + (b * Hq + h * G) * D;
      const int64_t* table = bt + b * MB;
      // Walk block by block: no division per token, and each block's rows are read in order.
      for (int64_t t0 = 0; t0 < L; t0 += BS) {
        const int64_t n = std::min(BS, L - t0);
        const float* kb = kc + (table[t0 / BS] * BS * Hk + h) * D;
        for (int64_t i = 0; i < n; ++i) {
          const float* k = kb + i * Hk * D;
          for (int64_t g = 0; g < G; ++g) {
            const float* qv = qh + g * D;
            float dot = 0.f;
#pragma omp simd reduction(+ : dot)
            for (int64_t d = 0; d < D; ++d) dot += qv[d] * k[d];
            scores[g * L + t0 + i] = dot * sc;
          }
        }
      }
      std::fill(acc.begin(), acc.end(), 0.f);
      std::vector<float> denom(G, 0.f);
      for (int64_t g = 0; g < G; ++g) {
        float* s = scores.data() + g * L;
        const float mx = *std::max_element(s, s + L);
        float sum = 0.f;
        for (int64_t t = 0; t < L; ++t) {
          s[t] = std::exp(s[t] - mx);
          sum += s[t];
        }
        denom[g] = sum;
      }
      for (int64_t t0 = 0; t0 < L; t0 += BS) {
        const int64_t n = std::min(BS, L - t0);
        const float* vb = vc + (table[t0 / BS] * BS * Hk + h) * D;
        for (int64_t i = 0; i < n; ++i) {
          const float* v = vb + i * Hk * D;
          for (int64_t g = 0; g < G; ++g) {
            const float p = scores[g * L + t0 + i];
            float* a = acc.data() + g * D;
#pragma omp simd
            for (int64_t d = 0; d < D; ++d) a[d] += p * v[d];
          }
        }
      }
      for (int64_t g = 0; g < G; ++g) {
        float* dst = o + (b * Hq + h * G + g) * D;
        const float inv = 1.f / denom[g];
        for (int64_t d = 0; d < D; ++d) dst[d] = acc[g * D + d] * inv;
      }
    }
  });
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_decode_attention", &paged_decode_attention, "paged decode attention (CPU, fp32)");
}
