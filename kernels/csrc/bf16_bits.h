// bfloat16 values handled as their bits, with conversions written as integer ops so loops over
// them vectorise (at::BFloat16's own conversion has a NaN branch that stops them): widening is a
// shift, narrowing rounds to nearest even, as torch's conversion does.
#pragma once

#include <cstdint>
#include <cstring>

namespace stoker {

using bf16 = uint16_t;

inline float to_f(float x) { return x; }
inline float to_f(bf16 h) {
  const uint32_t u = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &u, sizeof(f));
  return f;
}

template <typename T>
inline T from_f(float x);
template <>
inline float from_f<float>(float x) {
  return x;
}
template <>
inline bf16 from_f<bf16>(float x) {
  uint32_t u;
  std::memcpy(&u, &x, sizeof(u));
  const bool nan = (u & 0x7FFFFFFFu) > 0x7F800000u;  // stays a (quiet) NaN, never rounds to inf
  const uint32_t rounded = (u + 0x7FFFu + ((u >> 16) & 1u)) >> 16;
  return static_cast<bf16>(nan ? (u >> 16) | 0x40u : rounded);
}

}  // namespace stoker
