// Exp(1) noise for the sampler's exponential race, from a counter-based generator: element i of
// a row with key k is -log(u), u = (top 23 bits of splitmix64(mix(k) + (i + 1) * golden) + 0.5)
// / 2^23, so u lies in [2^-24, 1 - 2^-24] and the noise is finite and positive. A row's noise is
// a function of its key alone: the same for one row or many, any thread count, any chunking.
// torch.rand + log on the CPU draws one uniform at a time (about 9 ms of a sampled 32-row
// decode step at 49,152 tokens of vocabulary); this hashes a vector of counters per instruction
// and takes the log in vectors of the ISA's width (vec_exp.h). services/worker/sampling_noise.py
// keeps a torch version of the same bits.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <cstring>

#include "vec_exp.h"

namespace {

using stoker::kLanes;
using stoker::vf;
using stoker::vi;
constexpr int kHalf = kLanes / 2;  // 64-bit lanes in one vector register
typedef uint64_t vu64 __attribute__((vector_size(4 * kLanes)));

constexpr uint64_t kGolden = 0x9E3779B97F4A7C15ull;

template <typename U>  // uint64_t, or a vector of them
inline U mix64(U z) {  // splitmix64's output function
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

// log(x) for x in (0, 1], one vector (Cephes logf: x = m * 2^e with m in [sqrt(1/2), sqrt(2)),
// a degree-8 polynomial in m - 1; ~1 ulp).
inline vf vlog(vf x) {
  vi bits;
  std::memcpy(&bits, &x, sizeof(bits));
  vi e = ((bits >> 23) & 0xff) - 126;
  const vi mbits = (bits & 0x007fffff) | 0x3f000000;  // mantissa in [0.5, 1)
  vf m;
  std::memcpy(&m, &mbits, sizeof(m));
  const vi small = m < 0.70710678118654752440f;  // -1 where true
  e += small;
  m = (small ? m + m : m) - 1.f;
  const vf z = m * m;
  vf y = m * 7.0376836292e-2f - 1.1514610310e-1f;
  y = y * m + 1.1676998740e-1f;
  y = y * m - 1.2420140846e-1f;
  y = y * m + 1.4249322787e-1f;
  y = y * m - 1.6668057665e-1f;
  y = y * m + 2.0000714765e-1f;
  y = y * m - 2.4999993993e-1f;
  y = y * m + 3.3333331174e-1f;
  y = y * m * z;
  const vf ef = __builtin_convertvector(e, vf);
  y += ef * -2.12194440e-4f;
  y += z * -0.5f;
  return m + y + ef * 0.693359375f;
}

// kLanes noises from counters c0 + 1 .. c0 + kLanes of a row whose mixed key is `state`.
inline vf noise(uint64_t state, int64_t c0) {
  vu64 lanes;
  for (int i = 0; i < kHalf; ++i) lanes[i] = i + 1;
  const vu64 base = state + (static_cast<uint64_t>(c0) + lanes) * kGolden;
  const vu64 a = mix64(base), b = mix64(base + kHalf * kGolden);
  // The top 23 bits of each hash as an odd 24-bit integer 2j + 1, exact in float32.
  const vu64 ja = ((a >> 41) << 1) | 1, jb = ((b >> 41) << 1) | 1;
  vi j;
  for (int i = 0; i < kHalf; ++i)
    j[i] = static_cast<int32_t>(ja[i]), j[kHalf + i] = static_cast<int32_t>(jb[i]);
  const vf u = __builtin_convertvector(j, vf) * 0x1p-24f;
  return -vlog(u);
}

}  // namespace

torch::Tensor exponential_noise_rows(torch::Tensor keys, int64_t vocab) {
  TORCH_CHECK(keys.scalar_type() == torch::kInt64 && keys.dim() == 1, "keys: int64 [rows]");
  TORCH_CHECK(vocab >= 1, "vocab must be positive");
  keys = keys.contiguous();
  const int64_t rows = keys.size(0);
  auto out = torch::empty({rows, vocab}, keys.options().dtype(torch::kFloat32));
  const int64_t* k = keys.data_ptr<int64_t>();
  float* o = out.data_ptr<float>();
  constexpr int64_t kSpan = 4096;  // columns per task, so one row still spreads over threads
  const int64_t spans = (vocab + kSpan - 1) / kSpan;
  at::parallel_for(0, rows * spans, 1, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const int64_t r = t / spans, c_begin = (t % spans) * kSpan;
      const int64_t c_end = std::min(vocab, c_begin + kSpan);
      const uint64_t state = mix64(static_cast<uint64_t>(k[r]));
      float* row = o + r * vocab;
      int64_t c = c_begin;
      for (; c + kLanes <= c_end; c += kLanes) {
        const vf y = noise(state, c);
        std::memcpy(row + c, &y, sizeof(y));
      }
      if (c < c_end) {
        const vf y = noise(state, c);
        std::memcpy(row + c, &y, sizeof(float) * (c_end - c));
      }
    }
  });
  return out;
}
