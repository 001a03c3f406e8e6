// RMSNorm (with the residual-add variant) and rotary embedding for the CPU, float32, one pass
// over each row. The torch references take 6-14 tensor ops each, one full read and write of the
// activations per op; at decode sizes their dispatch overhead, at prefill sizes their memory
// traffic, is what costs.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <cmath>
#include <cstdint>
#include <tuple>

// Rotary must round exactly as the torch reference (x * cos + rotate_half(x) * sin, each product
// and the sum rounded): no fused multiply-add here.
#if defined(__clang__)
#define NO_FMA_BEGIN _Pragma("clang fp contract(off)")
#define NO_FMA_ATTR
#else
#define NO_FMA_BEGIN
#define NO_FMA_ATTR __attribute__((optimize("fp-contract=off")))
#endif

namespace {

void check_rows(const torch::Tensor& x, const torch::Tensor& w) {
  TORCH_CHECK(x.scalar_type() == torch::kFloat32 && w.scalar_type() == torch::kFloat32,
              "float32 only");
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1, "rows must be contiguous");
  TORCH_CHECK(w.is_contiguous() && w.numel() == x.size(1), "weight must match the row width");
}

// out = w * (s * rsqrt(mean(s^2) + eps)) for one row s, as HF's LlamaRMSNorm computes it.
inline void norm_row(const float* s, const float* w, float* out, int64_t H, float eps) {
  float sumsq = 0.f;
#pragma omp simd reduction(+ : sumsq)
  for (int64_t i = 0; i < H; ++i) sumsq += s[i] * s[i];
  const float inv = 1.f / std::sqrt(sumsq / static_cast<float>(H) + eps);
#pragma omp simd
  for (int64_t i = 0; i < H; ++i) out[i] = w[i] * (s[i] * inv);
}

}  // namespace

torch::Tensor rms_norm(torch::Tensor x, torch::Tensor w, double eps) {
  check_rows(x, w);
  auto out = torch::empty({x.size(0), x.size(1)}, x.options());
  const int64_t H = x.size(1), xs = x.stride(0);
  const float* xp = x.data_ptr<float>();
  const float* wp = w.data_ptr<float>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, x.size(0), 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) norm_row(xp + r * xs, wp, op + r * H, H, eps);
  });
  return out;
}

std::tuple<torch::Tensor, torch::Tensor> add_rms_norm(torch::Tensor x, torch::Tensor residual,
                                                      torch::Tensor w, double eps) {
  check_rows(x, w);
  check_rows(residual, w);
  TORCH_CHECK(residual.size(0) == x.size(0), "x and residual must have the same rows");
  auto out = torch::empty({x.size(0), x.size(1)}, x.options());
  auto summed = torch::empty_like(out);
  const int64_t H = x.size(1), xs = x.stride(0), rs = residual.stride(0);
  const float* xp = x.data_ptr<float>();
  const float* rp = residual.data_ptr<float>();
  const float* wp = w.data_ptr<float>();
  float* op = out.data_ptr<float>();
  float* sp = summed.data_ptr<float>();
  at::parallel_for(0, x.size(0), 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      float* s = sp + r * H;
      const float* a = xp + r * xs;
      const float* b = rp + r * rs;
#pragma omp simd
      for (int64_t i = 0; i < H; ++i) s[i] = a[i] + b[i];
      norm_row(s, wp, op + r * H, H, eps);
    }
  });
  return {out, summed};
}

namespace {

NO_FMA_ATTR void rotate_heads(const float* x, float* out, int64_t heads, int64_t head_stride,
                              const float* c, const float* s, int64_t half) {
  NO_FMA_BEGIN
  for (int64_t h = 0; h < heads; ++h) {
    const float* lo = x + h * head_stride;
    const float* hi = lo + half;
    float* out_lo = out + h * 2 * half;
    float* out_hi = out_lo + half;
#pragma omp simd
    for (int64_t i = 0; i < half; ++i) {
      out_lo[i] = lo[i] * c[i] + (-hi[i]) * s[i];
      out_hi[i] = hi[i] * c[i + half] + lo[i] * s[i + half];
    }
  }
}

void check_heads(const torch::Tensor& t) {
  TORCH_CHECK(t.scalar_type() == torch::kFloat32 && t.dim() == 3 && t.stride(2) == 1,
              "[tokens, heads, head_dim] float32 with contiguous head_dim");
}

}  // namespace

// q [T, Hq, D] and k [T, Hk, D] (views into the qkv projection are fine); cos/sin [T, D] in HF's
// layout (each half repeated). Returns new contiguous (q, k).
std::tuple<torch::Tensor, torch::Tensor> apply_rotary(torch::Tensor q, torch::Tensor k,
                                                      torch::Tensor cos, torch::Tensor sin) {
  check_heads(q);
  check_heads(k);
  cos = cos.contiguous();
  sin = sin.contiguous();
  const int64_t T = q.size(0), D = q.size(2), half = D / 2;
  TORCH_CHECK(D % 2 == 0 && cos.size(0) == T && cos.size(1) == D && k.size(2) == D,
              "cos/sin must be [tokens, head_dim]");
  auto q_out = torch::empty({T, q.size(1), D}, q.options());
  auto k_out = torch::empty({T, k.size(1), D}, k.options());
  const float* qp = q.data_ptr<float>();
  const float* kp = k.data_ptr<float>();
  float* qo = q_out.data_ptr<float>();
  float* ko = k_out.data_ptr<float>();
  const float* cp = cos.data_ptr<float>();
  const float* sp = sin.data_ptr<float>();
  const int64_t hq = q.size(1), hk = k.size(1);
  at::parallel_for(0, T, 16, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      rotate_heads(qp + t * q.stride(0), qo + t * hq * D, hq, q.stride(1), cp + t * D, sp + t * D,
                   half);
      rotate_heads(kp + t * k.stride(0), ko + t * hk * D, hk, k.stride(1), cp + t * D, sp + t * D,
                   half);
    }
  });
  return {q_out, k_out};
}
