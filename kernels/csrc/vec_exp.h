// exp on 16 float lanes (GCC/Clang vector extensions: AVX-512, AVX2 or SSE code), shared by the
// attention softmax and the gated MLP's silu.
#pragma once

#include <cstdint>
#include <cstring>

namespace stoker {

typedef float v16 __attribute__((vector_size(64)));
typedef int32_t i16 __attribute__((vector_size(64)));

// exp(x) = 2^k * p(r), k = round(x / ln 2), r = x - k ln 2 (split in two constants), p a degree-6
// polynomial (Cephes expf). ~2 ulp, and vectorised, where std::exp is a scalar libm call per
// lane. x is clamped to [-87, 88]: below, the smallest normal float (not 0); above, about 1.6e38
// (not inf).
inline v16 vexp(v16 x) {
  const v16 lo = v16{} - 87.f, hi = v16{} + 88.f;  // broadcasts (x * 0 is NaN for x = -inf)
  x = x < lo ? lo : x;
  x = x > hi ? hi : x;
  // Adding and subtracting 1.5 * 2^23 rounds to the nearest integer in float arithmetic.
  const v16 k = (x * 1.44269504088896341f + 12582912.f) - 12582912.f;
  const v16 r = (x - k * 0.693359375f) + k * 2.12194440e-4f;
  v16 p = r * 1.9875691500e-4f + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.f;
  const i16 bits = (__builtin_convertvector(k, i16) + 127) << 23;
  v16 scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return p * scale;
}

}  // namespace stoker
