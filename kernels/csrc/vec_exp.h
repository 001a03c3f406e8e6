// Float vectors of the CPU's native width for the hand-written kernels (GCC/Clang vector
// extensions), and exp on them, shared by the attention softmax and the gated MLP's silu.
//
// Why the width follows the ISA: a 16-float vector on a CPU without AVX-512 is two ymm registers
// to the programmer but not to GCC, whose lowering of over-wide generic vectors moves them
// through the stack piece by piece. On the AVX2 Zen 3 box the attention kernels written for 16
// lanes ran prefill at 5 GFLOP/s (torch's SDPA did 33) and decode at 6 GB/s of KV against a
// 30 GB/s memory floor (docs/benchmarks.md, CPU kernels).
#pragma once

#include <cstdint>
#include <cstring>

namespace stoker {

#if defined(__AVX512F__)
constexpr int kLanes = 16;
#else
constexpr int kLanes = 8;  // AVX2; on narrower ISAs GCC splits these into halves, still correct
#endif

typedef float vf __attribute__((vector_size(4 * kLanes)));
typedef int32_t vi __attribute__((vector_size(4 * kLanes)));

inline vf vload(const float* p) {
  vf v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}
inline void vstore(float* p, vf v) { std::memcpy(p, &v, sizeof(v)); }
inline vf vsplat(float x) { return vf{} + x; }

// exp(x) = 2^k * p(r), k = round(x / ln 2), r = x - k ln 2 (split in two constants), p a degree-6
// polynomial (Cephes expf). ~2 ulp, and vectorised, where std::exp is a scalar libm call per
// lane. x is clamped to [-87, 88]: below, the smallest normal float (not 0); above, about 1.6e38
// (not inf).
inline vf vexp(vf x) {
  const vf lo = vf{} - 87.f, hi = vf{} + 88.f;  // broadcasts (x * 0 is NaN for x = -inf)
  x = x < lo ? lo : x;
  x = x > hi ? hi : x;
  // Adding and subtracting 1.5 * 2^23 rounds to the nearest integer in float arithmetic.
  const vf k = (x * 1.44269504088896341f + 12582912.f) - 12582912.f;
  const vf r = (x - k * 0.693359375f) + k * 2.12194440e-4f;
  vf p = r * 1.9875691500e-4f + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.f;
  const vi bits = (__builtin_convertvector(k, vi) + 127) << 23;
  vf scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return p * scale;
}

// Horizontal sum (halving: lanes i and i + n/2 first, the order the 16-lane kernels always used)
// and max of one vector.
inline float hsum(vf v) {
  float a[kLanes];
  std::memcpy(a, &v, sizeof(a));
  for (int n = kLanes / 2; n >= 4; n /= 2)
    for (int i = 0; i < n; ++i) a[i] += a[i + n];
  return (a[0] + a[2]) + (a[1] + a[3]);
}
inline float hmax(vf v) {
  float m = v[0];
  for (int i = 1; i < kLanes; ++i) m = m > v[i] ? m : v[i];
  return m;
}

}  // namespace stoker
