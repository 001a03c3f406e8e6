// RMSNorm (with the residual-add variant) and rotary embedding for the CPU, float32 or bfloat16,
// one pass over each row. In bfloat16 each value is rounded where the torch reference's ops
// round it (every elementwise op's output), with float32 arithmetic in between. The torch
// references take 6-14 tensor ops each, one full read and write of the activations per op; at
// decode sizes their dispatch overhead, at prefill sizes their memory traffic, is what costs.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <tuple>

#include "bf16_bits.h"

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

using stoker::bf16;
using stoker::from_f;
using stoker::to_f;

// What the reference's ops produce: a float32 result as is, a bfloat16 one rounded to nearest.
template <typename T>
inline float rnd(float x) {
  return to_f(from_f<T>(x));
}

template <typename T>
T* ptr(const torch::Tensor& t) {
  return reinterpret_cast<T*>(t.data_ptr());
}

void check_rows(const torch::Tensor& x, const torch::Tensor& w) {
  TORCH_CHECK((x.scalar_type() == torch::kFloat32 || x.scalar_type() == torch::kBFloat16) &&
                  w.scalar_type() == x.scalar_type(),
              "float32 or bfloat16 rows and weight of one dtype");
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1, "rows must be contiguous");
  TORCH_CHECK(w.is_contiguous() && w.numel() == x.size(1), "weight must match the row width");
}

// out = w * (s * rsqrt(mean(s^2) + eps)) for one row s, as HF's LlamaRMSNorm computes it.
// In bfloat16: the normed row is rounded before the weight multiplies it (HF casts it back to the
// input dtype first), and the product is rounded again.
template <typename T>
inline void norm_row(const T* s, const T* w, T* out, int64_t H, float eps) {
  float sumsq = 0.f;
#pragma omp simd reduction(+ : sumsq)
  for (int64_t i = 0; i < H; ++i) sumsq += to_f(s[i]) * to_f(s[i]);
  const float inv = 1.f / std::sqrt(sumsq / static_cast<float>(H) + eps);
#pragma omp simd
  for (int64_t i = 0; i < H; ++i) out[i] = from_f<T>(to_f(w[i]) * rnd<T>(to_f(s[i]) * inv));
}

template <typename T>
void norm_rows(const torch::Tensor& x, const torch::Tensor& w, torch::Tensor& out, double eps) {
  const int64_t H = x.size(1), xs = x.stride(0);
  const T* xp = ptr<T>(x);
  const T* wp = ptr<T>(w);
  T* op = ptr<T>(out);
  at::parallel_for(0, x.size(0), 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) norm_row(xp + r * xs, wp, op + r * H, H, eps);
  });
}

template <typename T>
void add_norm_rows(const torch::Tensor& x, const torch::Tensor& residual, const torch::Tensor& w,
                   torch::Tensor& out, torch::Tensor& summed, double eps) {
  const int64_t H = x.size(1), xs = x.stride(0), rs = residual.stride(0);
  const T* xp = ptr<T>(x);
  const T* rp = ptr<T>(residual);
  const T* wp = ptr<T>(w);
  T* op = ptr<T>(out);
  T* sp = ptr<T>(summed);
  at::parallel_for(0, x.size(0), 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      T* s = sp + r * H;
      const T* a = xp + r * xs;
      const T* b = rp + r * rs;
#pragma omp simd
      for (int64_t i = 0; i < H; ++i) s[i] = from_f<T>(to_f(a[i]) + to_f(b[i]));
      norm_row(s, wp, op + r * H, H, eps);
    }
  });
}

}  // namespace

torch::Tensor rms_norm(torch::Tensor x, torch::Tensor w, double eps) {
  check_rows(x, w);
  auto out = torch::empty({x.size(0), x.size(1)}, x.options());
  if (x.scalar_type() == torch::kFloat32)
    norm_rows<float>(x, w, out, eps);
  else
    norm_rows<bf16>(x, w, out, eps);
  return out;
}

std::tuple<torch::Tensor, torch::Tensor> add_rms_norm(torch::Tensor x, torch::Tensor residual,
                                                      torch::Tensor w, double eps) {
  check_rows(x, w);
  check_rows(residual, w);
  TORCH_CHECK(residual.size(0) == x.size(0), "x and residual must have the same rows");
  auto out = torch::empty({x.size(0), x.size(1)}, x.options());
  auto summed = torch::empty_like(out);
  if (x.scalar_type() == torch::kFloat32)
    add_norm_rows<float>(x, residual, w, out, summed, eps);
  else
    add_norm_rows<bf16>(x, residual, w, out, summed, eps);
  return {out, summed};
}

namespace {

template <typename T>
NO_FMA_ATTR void rotate_heads(const T* x, T* out, int64_t heads, int64_t head_stride, const T* c,
                              const T* s, int64_t half) {
  NO_FMA_BEGIN
  for (int64_t h = 0; h < heads; ++h) {
    const T* lo = x + h * head_stride;
    const T* hi = lo + half;
    T* out_lo = out + h * 2 * half;
    T* out_hi = out_lo + half;
#pragma omp simd
    for (int64_t i = 0; i < half; ++i) {
      const float l = to_f(lo[i]), u = to_f(hi[i]);
      out_lo[i] = from_f<T>(rnd<T>(l * to_f(c[i])) + rnd<T>((-u) * to_f(s[i])));
      out_hi[i] = from_f<T>(rnd<T>(u * to_f(c[i + half])) + rnd<T>(l * to_f(s[i + half])));
    }
  }
}

template <typename T>
void rotate(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& cos,
            const torch::Tensor& sin, torch::Tensor& q_out, torch::Tensor& k_out) {
  const int64_t T_ = q.size(0), D = q.size(2), half = D / 2, hq = q.size(1), hk = k.size(1);
  const T* qp = ptr<T>(q);
  const T* kp = ptr<T>(k);
  T* qo = ptr<T>(q_out);
  T* ko = ptr<T>(k_out);
  const T* cp = ptr<T>(cos);
  const T* sp = ptr<T>(sin);
  at::parallel_for(0, T_, 16, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      rotate_heads(qp + t * q.stride(0), qo + t * hq * D, hq, q.stride(1), cp + t * D, sp + t * D,
                   half);
      rotate_heads(kp + t * k.stride(0), ko + t * hk * D, hk, k.stride(1), cp + t * D, sp + t * D,
                   half);
    }
  });
}

void check_heads(const torch::Tensor& t, const torch::Tensor& like) {
  TORCH_CHECK(t.scalar_type() == like.scalar_type() && t.dim() == 3 && t.stride(2) == 1,
              "[tokens, heads, head_dim] of one dtype with contiguous head_dim");
}

}  // namespace

// q [T, Hq, D] and k [T, Hk, D] (views into the qkv projection are fine); cos/sin [T, D] in HF's
// layout (each half repeated). Returns new contiguous (q, k).
std::tuple<torch::Tensor, torch::Tensor> apply_rotary(torch::Tensor q, torch::Tensor k,
                                                      torch::Tensor cos, torch::Tensor sin) {
  TORCH_CHECK(q.scalar_type() == torch::kFloat32 || q.scalar_type() == torch::kBFloat16,
              "float32 or bfloat16 only");
  check_heads(q, q);
  check_heads(k, q);
  TORCH_CHECK(cos.scalar_type() == q.scalar_type() && sin.scalar_type() == q.scalar_type(),
              "cos/sin in q's dtype");
  cos = cos.contiguous();
  sin = sin.contiguous();
  const int64_t T = q.size(0), D = q.size(2), half = D / 2;
  TORCH_CHECK(D % 2 == 0 && cos.size(0) == T && cos.size(1) == D && k.size(2) == D,
              "cos/sin must be [tokens, head_dim]");
  auto q_out = torch::empty({T, q.size(1), D}, q.options());
  auto k_out = torch::empty({T, k.size(1), D}, k.options());
  if (q.scalar_type() == torch::kFloat32)
    rotate<float>(q, k, cos, sin, q_out, k_out);
  else
    rotate<bf16>(q, k, cos, sin, q_out, k_out);
  return {q_out, k_out};
}
