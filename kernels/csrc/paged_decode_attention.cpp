// Paged decode attention for the CPU: one query token per request, keys and values (float32 or
// bfloat16) read in place through the block table; the arithmetic is float32 either way (with
// AVX512-BF16, q.k of a bfloat16 cache is vdpbf16ps: exact products, float32 sums). The torch
// reference gathers every request's context into a padded copy first (one extra write and read
// of the whole KV context per layer per step); at batch 64 that copy costs more than the
// attention itself, so this kernel exists.
//
// One task per request (per (request, kv head) when there are too few requests to share out).
// The G query heads of a GQA group share every K/V row read; head_dim and G are template
// parameters so the working accumulators stay in registers. Per kv head, two passes over the
// context: q.k for one vector's worth of tokens at a time (kLanes dot products reduced together
// by a butterfly) into a small score buffer, then one exact softmax, then p.v. At batch 64 a
// one-pass online softmax spent as long on its per-16-token rescaling and horizontal reductions
// as on reading memory (30 layers' caches of 64 x 300 tokens: 11-18 % less time a layer with two
// passes). The vector code uses GCC/Clang vector extensions of the ISA's width (vec_exp.h: 16
// floats with AVX-512, 8 otherwise).
// window > 0 (sliding-window layers) starts the walk at L - window; softcap > 0 (Gemma 2) maps
// each score s to tanh(s / softcap) * softcap before the softmax.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#include "balanced_runs.h"
#include "bf16_bits.h"
#include "vec_exp.h"
#if defined(__AVX512BF16__)
#include <immintrin.h>
#endif

namespace {

using stoker::hmax;
using stoker::hsum;
using stoker::kLanes;
using stoker::vexp;
using stoker::vf;
using stoker::vstore;

inline vf load(const float* p) { return stoker::vload(p); }
// bfloat16 is the top half of a float32: widen kLanes of them with a shift (vpmovzxwd + vpslld).
typedef uint16_t u16v __attribute__((vector_size(2 * kLanes)));
typedef uint32_t u32v __attribute__((vector_size(4 * kLanes)));
inline vf load(const at::BFloat16* p) {
  u16v h;
  std::memcpy(&h, p, sizeof(h));
  const u32v w = __builtin_convertvector(h, u32v) << 16;
  vf v;
  std::memcpy(&v, &w, sizeof(v));
  return v;
}

// kLanes dot-product partials -> one vector of their sums. a[j] must hold the partials of token
// kBitrev[j]; the butterfly then leaves token i's sum in lane i. With 16 lanes, 30 shuffles and
// 15 adds replace 16 separate horizontal reductions.
#if defined(__AVX512F__)
constexpr int kBitrev[16] = {0, 8, 4, 12, 2, 10, 6, 14, 1, 9, 5, 13, 3, 11, 7, 15};
inline vf reduce_lanes(const vf* a) {
  vf b[8], c[4], d[2];
  for (int m = 0; m < 8; ++m)
    b[m] = __builtin_shufflevector(a[2 * m], a[2 * m + 1], 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18,
                                   19, 20, 21, 22, 23) +
           __builtin_shufflevector(a[2 * m], a[2 * m + 1], 8, 9, 10, 11, 12, 13, 14, 15, 24, 25,
                                   26, 27, 28, 29, 30, 31);
  for (int m = 0; m < 4; ++m)
    c[m] = __builtin_shufflevector(b[2 * m], b[2 * m + 1], 0, 1, 2, 3, 16, 17, 18, 19, 8, 9, 10,
                                   11, 24, 25, 26, 27) +
           __builtin_shufflevector(b[2 * m], b[2 * m + 1], 4, 5, 6, 7, 20, 21, 22, 23, 12, 13, 14,
                                   15, 28, 29, 30, 31);
  for (int m = 0; m < 2; ++m)
    d[m] = __builtin_shufflevector(c[2 * m], c[2 * m + 1], 0, 1, 16, 17, 4, 5, 20, 21, 8, 9, 24,
                                   25, 12, 13, 28, 29) +
           __builtin_shufflevector(c[2 * m], c[2 * m + 1], 2, 3, 18, 19, 6, 7, 22, 23, 10, 11, 26,
                                   27, 14, 15, 30, 31);
  return __builtin_shufflevector(d[0], d[1], 0, 16, 2, 18, 4, 20, 6, 22, 8, 24, 10, 26, 12, 28,
                                 14, 30) +
         __builtin_shufflevector(d[0], d[1], 1, 17, 3, 19, 5, 21, 7, 23, 9, 25, 11, 27, 13, 29,
                                 15, 31);
}
#else
constexpr int kBitrev[8] = {0, 4, 2, 6, 1, 5, 3, 7};
inline vf reduce_lanes(const vf* a) {
  vf b[4], c[2];
  for (int m = 0; m < 4; ++m)
    b[m] = __builtin_shufflevector(a[2 * m], a[2 * m + 1], 0, 1, 2, 3, 8, 9, 10, 11) +
           __builtin_shufflevector(a[2 * m], a[2 * m + 1], 4, 5, 6, 7, 12, 13, 14, 15);
  for (int m = 0; m < 2; ++m)
    c[m] = __builtin_shufflevector(b[2 * m], b[2 * m + 1], 0, 1, 8, 9, 4, 5, 12, 13) +
           __builtin_shufflevector(b[2 * m], b[2 * m + 1], 2, 3, 10, 11, 6, 7, 14, 15);
  return __builtin_shufflevector(c[0], c[1], 0, 8, 2, 10, 4, 12, 6, 14) +
         __builtin_shufflevector(c[0], c[1], 1, 9, 3, 11, 5, 13, 7, 15);
}
#endif

#if defined(__AVX512BF16__)
constexpr bool kHaveBf16Dot = true;
#else
constexpr bool kHaveBf16Dot = false;
#endif

// The first context token a query attends to (window > 0: a sliding-window layer).
inline int64_t first_token(int64_t L, int64_t window) {
  return window > 0 ? std::max<int64_t>(0, L - window) : 0;
}

// Prefetch K and V rows of tokens [a, e) (nh heads of D from each row's start) with locality
// hint Loc: 2 = prefetcht1, 1 = prefetcht2 (both to L2 here).
template <int Loc, typename KV>
inline void prefetch_rows(const KV* kc, const KV* vc, const int64_t* table, int64_t BS,
                          int64_t row, int64_t width, int64_t a, int64_t e) {
  for (int64_t t = a; t < e; ++t) {
    const int64_t slot = (table[t / BS] * BS + t % BS) * row;
    for (int64_t c = 0; c < width; c += 64 / sizeof(KV)) {  // one cache line
      __builtin_prefetch(kc + slot + c, 0, Loc);
      __builtin_prefetch(vc + slot + c, 0, Loc);
    }
  }
}

// The task a thread runs after this one: its K/V rows are pulled toward L2 while this one computes.
template <typename KV>
struct NextTask {
  const KV* kc = nullptr;
  const KV* vc = nullptr;
  const int64_t* table = nullptr;
  int64_t first = 0, L = 0;  // L == 0: none
};

template <typename KV, int D, int G>
void attend(const KV* q, const KV* kc, const KV* vc, const int64_t* table, int64_t L,
            int64_t BS, int64_t row, int64_t nh, float sc, int64_t window, float cap, KV* out,
            const NextTask<KV>& next) {
  // nh kv heads of one request: q/out hold nh * G query heads; kc/vc point at the first head.
  // Each pass reads only this head's slice of every row.
  constexpr int C = D / kLanes;
  // bfloat16 caches on CPUs with AVX512-BF16: q.k as bfloat16 pair dot products with float32
  // sums (vdpbf16ps). (p.v the same way, tokens in pairs, measured no faster; not taken.)
  constexpr bool kDot = kHaveBf16Dot && std::is_same_v<KV, at::BFloat16> && D % 32 == 0;
  const float neg_inf = -std::numeric_limits<float>::infinity();
  const int64_t first = first_token(L, window);
  const int64_t n_ctx = L - first, chunks = (n_ctx + kLanes - 1) / kLanes;
  thread_local std::vector<float> score_buf;
  thread_local std::vector<int64_t> slot_buf;
  if (static_cast<int64_t>(score_buf.size()) < G * chunks * kLanes)
    score_buf.resize(G * chunks * kLanes);
  if (static_cast<int64_t>(slot_buf.size()) < chunks * kLanes) slot_buf.resize(chunks * kLanes);
  float* scores = score_buf.data();  // [G][chunks * kLanes]
  int64_t* slots = slot_buf.data();
  {
    int64_t block = first / BS, offset = first % BS;
    for (int64_t t = 0; t < n_ctx; ++t) {
      slots[t] = (table[block] * BS + offset) * row;
      if (++offset == BS) offset = 0, ++block;
    }
  }
  const int64_t stride = chunks * kLanes, next_len = next.L - next.first;
  const int64_t steps = 2 * nh * chunks;  // chunk passes of this task (next-task prefetch)
  int64_t step = 0;
  // A slice of the next task's rows, in proportion, toward L2 (prefetcht2) with every chunk
  // pass: a request's K/V for one layer (~460 KB at 300 tokens) then arrives while this one
  // computes (dropping it from the one-pass kernel: 1,864 -> 2,184 us a layer at 64 x 300).
  auto prefetch_next = [&]() {
    if (next_len > 0) {
      prefetch_rows<1>(next.kc, next.vc, next.table, BS, row, nh * D,
                       next.first + step * next_len / steps,
                       next.first + (step + 1) * next_len / steps);
    }
    ++step;
  };
  // This head's slice of its own rows two chunks ahead, into L2 (prefetcht1; into L1 measured
  // slower, 64 rows ahead no faster).
  auto prefetch_own = [&](const KV* base, int64_t c0) {
    for (int64_t t = c0 + 2 * kLanes, e = std::min<int64_t>(n_ctx, c0 + 3 * kLanes); t < e; ++t)
      for (int64_t c = 0; c < D; c += 64 / sizeof(KV))  // one cache line
        __builtin_prefetch(base + slots[t] + c, 0, 2);
  };
  for (int64_t h = 0; h < nh; ++h) {
    const KV* qh = q + h * G * D;
    const KV* kh = kc + h * D;
    const KV* vh = vc + h * D;
    vf mv[G];
    for (int g = 0; g < G; ++g) mv[g] = vf{} + neg_inf;
    for (int64_t c0 = 0; c0 < n_ctx; c0 += kLanes) {
      prefetch_next();
      prefetch_own(kh, c0);
      const int n = static_cast<int>(std::min<int64_t>(kLanes, n_ctx - c0));
      const int64_t* sl = slots + c0;
      for (int g = 0; g < G; ++g) {
        vf part[kLanes];
#if defined(__AVX512BF16__)
        if constexpr (kDot) {  // no widening of K, which each of the G query heads would repeat
          constexpr int C2 = D / 32;
          __m512bh qv[C2];
          for (int c = 0; c < C2; ++c)
            qv[c] = (__m512bh)_mm512_loadu_si512(qh + g * D + 32 * c);
          for (int i = 0; i < kLanes; ++i) {
            __m512 a = _mm512_setzero_ps();
            if (i < n) {
              const KV* k = kh + sl[i];
              for (int c = 0; c < C2; ++c)
                a = _mm512_dpbf16_ps(a, qv[c], (__m512bh)_mm512_loadu_si512(k + 32 * c));
            }
            part[kBitrev[i]] = (vf)a;
          }
        } else
#endif
        {
          vf qs[C];
          for (int c = 0; c < C; ++c) qs[c] = load(qh + g * D + kLanes * c) * sc;
          for (int i = 0; i < kLanes; ++i) {
            vf a = {};
            if (i < n) {
              const KV* k = kh + sl[i];
              for (int c = 0; c < C; ++c) a += qs[c] * load(k + kLanes * c);
            }
            part[kBitrev[i]] = a;
          }
        }
        vf s = reduce_lanes(part);
        if constexpr (kDot) s *= sc;  // the other path scaled q instead
        if (cap > 0.f)
          for (int i = 0; i < n; ++i) s[i] = std::tanh(s[i] / cap) * cap;
        for (int i = n; i < kLanes; ++i) s[i] = neg_inf;
        mv[g] = mv[g] > s ? mv[g] : s;
        vstore(scores + g * stride + c0, s);
      }
    }
    float l[G];
    for (int g = 0; g < G; ++g) {
      const float m = hmax(mv[g]);
      float* sg = scores + g * stride;
      vf sum = {};
      for (int64_t c0 = 0; c0 < n_ctx; c0 += kLanes) {
        const vf e = vexp(load(sg + c0) - m);  // exp(-inf - m) underflows to 0 for the tail
        sum += e;
        vstore(sg + c0, e);
      }
      l[g] = hsum(sum);
    }
    vf acc[G][C];
    for (int g = 0; g < G; ++g)
      for (int c = 0; c < C; ++c) acc[g][c] = vf{};
    for (int64_t c0 = 0; c0 < n_ctx; c0 += kLanes) {
      prefetch_next();
      prefetch_own(vh, c0);
      const int n = static_cast<int>(std::min<int64_t>(kLanes, n_ctx - c0));
      for (int i = 0; i < n; ++i) {
        const KV* v = vh + slots[c0 + i];
        vf vv[C];
        for (int c = 0; c < C; ++c) vv[c] = load(v + kLanes * c);
        for (int g = 0; g < G; ++g) {
          const float p = scores[g * stride + c0 + i];
          for (int c = 0; c < C; ++c) acc[g][c] += p * vv[c];
        }
      }
    }
    for (int g = 0; g < G; ++g) {
      KV* o = out + (h * G + g) * D;
      const float r = 1.f / l[g];
      for (int c = 0; c < C; ++c) {
        const vf y = acc[g][c] * r;
        if constexpr (std::is_same_v<KV, float>) {
          vstore(o + kLanes * c, y);
        } else {  // rounded to nearest even, as torch's .to(bfloat16)
          auto* bits = reinterpret_cast<stoker::bf16*>(o + kLanes * c);
          for (int i = 0; i < kLanes; ++i) bits[i] = stoker::from_f<stoker::bf16>(y[i]);
        }
      }
    }
  }
}

template <typename KV>
using AttendFn = void (*)(const KV*, const KV*, const KV*, const int64_t*, int64_t, int64_t,
                          int64_t, int64_t, float, int64_t, float, KV*, const NextTask<KV>&);

template <typename KV, int D>
AttendFn<KV> pick_g(int64_t G) {
  switch (G) {
    case 1: return attend<KV, D, 1>;
    case 2: return attend<KV, D, 2>;
    case 3: return attend<KV, D, 3>;
    case 4: return attend<KV, D, 4>;
    case 5: return attend<KV, D, 5>;
    case 6: return attend<KV, D, 6>;
    case 7: return attend<KV, D, 7>;
    case 8: return attend<KV, D, 8>;
    default: return nullptr;
  }
}

template <typename KV>
AttendFn<KV> pick(int64_t D, int64_t G) {
  switch (D) {
    case 16: return pick_g<KV, 16>(G);
    case 32: return pick_g<KV, 32>(G);
    case 64: return pick_g<KV, 64>(G);
    case 128: return pick_g<KV, 128>(G);
    case 256: return pick_g<KV, 256>(G);
    default: return nullptr;
  }
}

template <typename KV>
void run(AttendFn<KV> fn, const KV* q, const KV* kc, const KV* vc, const int64_t* bt,
         const int64_t* lens, int64_t B, int64_t Hq, int64_t Hk, int64_t G, int64_t D, int64_t MB,
         int64_t BS, float sc, int64_t window, float cap, KV* o) {
  // Tasks: (request, group of kv heads). All heads of a request in one task read each block's
  // rows whole (contiguous); with few requests, split heads so every thread has work.
  const int64_t threads = at::get_num_threads();
  const int64_t nh = B >= 4 * threads ? Hk : 1;
  const int64_t groups = Hk / nh;
  // Threads take contiguous runs of tasks of about equal cost: a task's time goes with the
  // context it walks.
  std::vector<double> cost(B * groups);
  for (int64_t idx = 0; idx < B * groups; ++idx) {
    const int64_t L = lens[idx / groups];
    cost[idx] = static_cast<double>(L - first_token(L, window) + 16);  // + the task's set-up
  }
  const std::vector<int64_t> starts = stoker::balanced_runs(cost);
  at::parallel_for(0, static_cast<int64_t>(starts.size()) - 1, 1, [&](int64_t first_run,
                                                                        int64_t last_run) {
    const int64_t begin = starts[first_run], end = starts[last_run];
    for (int64_t idx = begin; idx < end; ++idx) {
      const int64_t b = idx / groups, h = (idx % groups) * nh;
      const int64_t head = (b * Hq + h * G) * D;
      NextTask<KV> next;
      if (idx + 1 < end) {  // (two tasks ahead measured slower)
        const int64_t nb = (idx + 1) / groups, nhd = ((idx + 1) % groups) * nh;
        next.kc = kc + nhd * D, next.vc = vc + nhd * D, next.table = bt + nb * MB;
        next.L = lens[nb], next.first = first_token(next.L, window);
      }
      fn(q + head, kc + h * D, vc + h * D, bt + b * MB, lens[b], BS, Hk * D, nh, sc, window, cap,
         o + head, next);
    }
  });
}

}  // namespace

bool supports(int64_t head_dim, int64_t group) {
  return pick<float>(head_dim, group) != nullptr;
}

torch::Tensor paged_decode_attention(
    torch::Tensor query, torch::Tensor key_cache, torch::Tensor value_cache,
    torch::Tensor block_tables, torch::Tensor context_lens, double scale, int64_t window,
    double softcap) {
  const auto dtype = key_cache.scalar_type();
  TORCH_CHECK(dtype == torch::kFloat32 || dtype == torch::kBFloat16, "float32 or bfloat16 cache");
  TORCH_CHECK(query.scalar_type() == dtype && value_cache.scalar_type() == dtype,
              "query, key and value caches must share one dtype");
  query = query.contiguous();  // q is read and the output written in the cache's dtype
  TORCH_CHECK(key_cache.is_contiguous() && value_cache.is_contiguous(), "cache must be contiguous");
  block_tables = block_tables.to(torch::kInt64).contiguous();
  context_lens = context_lens.to(torch::kInt64).contiguous();
  auto out = torch::empty_like(query);
  const int64_t B = query.size(0), Hq = query.size(1), D = query.size(2);
  const int64_t BS = key_cache.size(1), Hk = key_cache.size(2);
  const int64_t G = Hq / Hk, MB = block_tables.size(1), num_blocks = key_cache.size(0);
  TORCH_CHECK(Hq % Hk == 0, "query heads must be a multiple of kv heads");
  TORCH_CHECK(key_cache.dim() == 4 && key_cache.size(3) == D &&
                  key_cache.sizes() == value_cache.sizes(),
              "key/value caches must be [num_blocks, block_size, kv_heads, head_dim]");
  TORCH_CHECK(block_tables.size(0) == B && context_lens.numel() == B,
              "one block-table row and one context length per query row");
  TORCH_CHECK(supports(D, G), "unsupported head_dim ", D, " or group size ", G);
  const int64_t* bt = block_tables.data_ptr<int64_t>();
  const int64_t* lens = context_lens.data_ptr<int64_t>();
  const float sc = static_cast<float>(scale), cap = static_cast<float>(softcap);
  TORCH_CHECK(window >= 0 && softcap >= 0, "window and softcap must be >= 0 (0: off)");
  // Every block the kernel will read must exist: a bad table is an error, not a stray read.
  for (int64_t b = 0; b < B; ++b) {
    TORCH_CHECK(lens[b] >= 1 && lens[b] <= MB * BS, "context length out of range: ", lens[b]);
    for (int64_t i = 0, n = (lens[b] + BS - 1) / BS; i < n; ++i)
      TORCH_CHECK(bt[b * MB + i] >= 0 && bt[b * MB + i] < num_blocks, "block id out of range");
  }

  auto launch = [&](auto cache_type) {
    using KV = decltype(cache_type);
    run<KV>(pick<KV>(D, G), query.data_ptr<KV>(), key_cache.data_ptr<KV>(),
            value_cache.data_ptr<KV>(), bt, lens, B, Hq, Hk, G, D, MB, BS, sc, window, cap,
            out.data_ptr<KV>());
  };
  if (dtype == torch::kFloat32)
    launch(float{});
  else
    launch(at::BFloat16{});
  return out;
}
