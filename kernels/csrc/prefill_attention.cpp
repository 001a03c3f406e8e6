// Prefill attention for the CPU: every prompt chunk of a step in one call, keys and values read
// through the paged cache (the chunk's own K/V are stored before attention runs, so a chunk with
// a cached prefix and one without are the same case). float32 or bfloat16 in and out; the
// arithmetic is float32.
//
// Why: torch's SDPA (its CPU flash kernel) ran a 128-160 token prompt's attention at 40-50
// GFLOP/s here, a third of what the box's FMA units do, and once per request and layer from
// Python. Here a work item is (chunk, kv head, up to 64 query rows): its keys are gathered once,
// transposed, into a float32 buffer that stays in L2, and the G query heads of the kv head times
// the rows form query vectors that run through two register tiles, GEMM-style: Q K^T as 6 query
// vectors x two vectors of keys (12 accumulators, one broadcast per query vector and two key
// loads per step down head_dim), then an exact softmax per vector over its causal range, then
// P V as 6 vectors x 4 (AVX-512) or 2 (AVX2) output vectors. Items are dealt to threads in
// contiguous runs of equal estimated cost (causal rows cost in proportion to their position).
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

namespace {

using stoker::kLanes;
using stoker::vf;
using stoker::vexp;
using stoker::vload;
using stoker::vsplat;
using stoker::vstore;

// Register tiles sized to the ISA's vector registers (32 with AVX-512, 16 with AVX2): Q K^T keeps
// 2 * kTileVectors accumulators, P V kTileVectors * kPvVectors, plus the loads in flight.
constexpr int kTileVectors = 6;  // query vectors per register tile
constexpr int kPvVectors = kLanes == 16 ? 4 : 2;  // output vectors per P V column group
constexpr int kKeyBlock = 2 * kLanes;  // keys per Q K^T tile column block
constexpr int64_t kItemRows = 64;  // query rows per work item

inline float widen(float x) { return x; }
inline float widen(at::BFloat16 x) { return stoker::to_f(x.x); }
inline void narrow(float x, float* out) { *out = x; }
inline void narrow(float x, at::BFloat16* out) { out->x = stoker::from_f<stoker::bf16>(x); }

struct Item {
  int64_t span, head, r0, r1;  // rows [r0, r1) of chunk `span`, local to the chunk
};

// Scores of R query vectors q[R][D] against keys [0, kKeyBlock * blocks) of kt ([D][ld],
// transposed).
template <int R, int D>
inline void qk_tile(const float* q, const float* kt, int64_t ld, int64_t blocks, float* s,
                    int64_t lds) {
  for (int64_t b = 0; b < blocks; ++b) {
    vf a0[R], a1[R];
    for (int i = 0; i < R; ++i) a0[i] = vf{}, a1[i] = vf{};
    const float* k = kt + kKeyBlock * b;
    for (int d = 0; d < D; ++d) {
      const vf k0 = vload(k + d * ld), k1 = vload(k + d * ld + kLanes);
      for (int i = 0; i < R; ++i) {
        const vf x = vsplat(q[i * D + d]);
        a0[i] += x * k0;
        a1[i] += x * k1;
      }
    }
    for (int i = 0; i < R; ++i) {
      vstore(s + i * lds + kKeyBlock * b, a0[i]);
      vstore(s + i * lds + kKeyBlock * b + kLanes, a1[i]);
    }
  }
}

// out[R][D] (float32) = p[R][0..n) @ v[n][D], in column groups of kPvVectors vectors.
template <int R, int D>
inline void pv_tile(const float* p, int64_t ldp, const float* v, int64_t n, float* out) {
  constexpr int C = D / kLanes;
  constexpr int W = C < kPvVectors ? C : kPvVectors;  // vectors per column group
  for (int c0 = 0; c0 < C; c0 += W) {
    vf acc[R][W];
    for (int i = 0; i < R; ++i)
      for (int c = 0; c < W; ++c) acc[i][c] = vf{};
    for (int64_t j = 0; j < n; ++j) {
      vf vv[W];
      for (int c = 0; c < W; ++c) vv[c] = vload(v + j * D + kLanes * (c0 + c));
      for (int i = 0; i < R; ++i) {
        const vf x = vsplat(p[i * ldp + j]);
        for (int c = 0; c < W; ++c) acc[i][c] += x * vv[c];
      }
    }
    for (int i = 0; i < R; ++i)
      for (int c = 0; c < W; ++c) vstore(out + i * D + kLanes * (c0 + c), acc[i][c]);
  }
}

// The tiles above for the 1-6 query vectors left in a work item's last tile.
template <int D>
void qk_rows(int r, const float* q, const float* kt, int64_t ld, int64_t blocks, float* s,
             int64_t lds) {
  switch (r) {
    case 6: return qk_tile<6, D>(q, kt, ld, blocks, s, lds);
    case 5: return qk_tile<5, D>(q, kt, ld, blocks, s, lds);
    case 4: return qk_tile<4, D>(q, kt, ld, blocks, s, lds);
    case 3: return qk_tile<3, D>(q, kt, ld, blocks, s, lds);
    case 2: return qk_tile<2, D>(q, kt, ld, blocks, s, lds);
    default: return qk_tile<1, D>(q, kt, ld, blocks, s, lds);
  }
}

template <int D>
void pv_rows(int r, const float* p, int64_t ldp, const float* v, int64_t n, float* out) {
  switch (r) {
    case 6: return pv_tile<6, D>(p, ldp, v, n, out);
    case 5: return pv_tile<5, D>(p, ldp, v, n, out);
    case 4: return pv_tile<4, D>(p, ldp, v, n, out);
    case 3: return pv_tile<3, D>(p, ldp, v, n, out);
    case 2: return pv_tile<2, D>(p, ldp, v, n, out);
    default: return pv_tile<1, D>(p, ldp, v, n, out);
  }
}

struct Shape {
  int64_t Hq, Hk, G, BS, MB, row;  // row: values per cache slot (Hk * D)
  float scale, cap;
  int64_t window;
};

// One work item: query rows [r0, r1) of a chunk whose local row 0 sits at position pos0.
template <typename T, int D>
void run_item(const Item& it, const T* q, const T* kc, const T* vc, const int64_t* table,
              int64_t pos0, const Shape& sh, T* out) {
  const int64_t G = sh.G;
  const float neg_inf = -std::numeric_limits<float>::infinity();
  auto hi_of = [&](int64_t r) { return pos0 + r + 1; };  // keys [lo, hi) are visible to row r
  auto lo_of = [&](int64_t r) {
    return sh.window > 0 ? std::max<int64_t>(0, hi_of(r) - sh.window) : int64_t{0};
  };
  const int64_t klo = lo_of(it.r0), khi = hi_of(it.r1 - 1), n_keys = khi - klo;
  const int64_t ld = (n_keys + 31) / 32 * 32;
  thread_local std::vector<float> kt_buf, v_buf, q_buf, s_buf, o_buf;
  const int64_t nvec = (it.r1 - it.r0) * G;
  if (static_cast<int64_t>(kt_buf.size()) < D * ld) kt_buf.resize(D * ld);
  if (static_cast<int64_t>(v_buf.size()) < n_keys * D) v_buf.resize(n_keys * D);
  if (static_cast<int64_t>(q_buf.size()) < nvec * D) q_buf.resize(nvec * D);
  if (static_cast<int64_t>(s_buf.size()) < kTileVectors * ld) s_buf.resize(kTileVectors * ld);
  if (static_cast<int64_t>(o_buf.size()) < kTileVectors * D) o_buf.resize(kTileVectors * D);
  float* kt = kt_buf.data();
  float* vb = v_buf.data();
  float* qb = q_buf.data();
  float* s = s_buf.data();
  float* ob = o_buf.data();
  // Gather this head's keys (transposed, zero-padded to a multiple of 32, whole key blocks) and
  // values.
  for (int64_t t = 0; t < n_keys; ++t) {
    const int64_t pos = klo + t;
    const int64_t slot = (table[pos / sh.BS] * sh.BS + pos % sh.BS) * sh.row + it.head * D;
    const T* k = kc + slot;
    const T* v = vc + slot;
    for (int d = 0; d < D; ++d) kt[d * ld + t] = widen(k[d]);
    for (int d = 0; d < D; ++d) vb[t * D + d] = widen(v[d]);
  }
  for (int d = 0; d < D; ++d)
    for (int64_t t = n_keys; t < ld; ++t) kt[d * ld + t] = 0.f;
  // Query vectors: row-major over (row, query head of this kv head's group), pre-scaled.
  for (int64_t r = it.r0; r < it.r1; ++r)
    for (int64_t g = 0; g < G; ++g) {
      const T* src = q + (r * sh.Hq + it.head * G + g) * D;
      float* dst = qb + ((r - it.r0) * G + g) * D;
      for (int d = 0; d < D; ++d) dst[d] = widen(src[d]) * sh.scale;
    }
  float inv[kTileVectors];
  for (int64_t v0 = 0; v0 < nvec; v0 += kTileVectors) {
    const int nv = static_cast<int>(std::min<int64_t>(kTileVectors, nvec - v0));
    const int64_t last_row = it.r0 + (v0 + nv - 1) / G;
    const int64_t tile_keys = hi_of(last_row) - klo;  // keys [0, tile_keys) of the buffer
    qk_rows<D>(nv, qb + v0 * D, kt, ld, (tile_keys + kKeyBlock - 1) / kKeyBlock, s, ld);
    for (int i = 0; i < nv; ++i) {
      const int64_t r = it.r0 + (v0 + i) / G;
      const int64_t a = lo_of(r) - klo, b = hi_of(r) - klo;  // this vector's visible keys
      float* si = s + i * ld;
      if (sh.cap > 0.f)
        for (int64_t j = a; j < b; ++j) si[j] = std::tanh(si[j] / sh.cap) * sh.cap;
      float m = neg_inf;
      for (int64_t j = a; j < b; ++j) m = std::max(m, si[j]);
      for (int64_t j = 0; j < a; ++j) si[j] = 0.f;
      vf sum = {};
      int64_t j = a;
      for (; j + kLanes <= b; j += kLanes) {
        const vf e = vexp(vload(si + j) - m);
        sum += e;
        vstore(si + j, e);
      }
      float tail = 0.f;
      for (; j < b; ++j) {
        vf x = vsplat(neg_inf);
        x[0] = si[j] - m;
        const float e = vexp(x)[0];
        tail += e;
        si[j] = e;
      }
      for (int64_t k = b; k < tile_keys; ++k) si[k] = 0.f;
      float total = tail;
      for (int l = 0; l < kLanes; ++l) total += sum[l];
      inv[i] = 1.f / total;
    }
    pv_rows<D>(nv, s, ld, vb, tile_keys, ob);
    for (int i = 0; i < nv; ++i) {
      const int64_t r = it.r0 + (v0 + i) / G, g = (v0 + i) % G;
      T* dst = out + (r * sh.Hq + it.head * G + g) * D;
      for (int d = 0; d < D; ++d) narrow(ob[i * D + d] * inv[i], dst + d);
    }
  }
}

template <typename T, int D>
void run(const T* q, const T* kc, const T* vc, const int64_t* tables, const int64_t* bounds,
         const int64_t* lens, int64_t S, const Shape& sh, T* out) {
  std::vector<Item> items;
  std::vector<double> cost;
  for (int64_t s = 0; s < S; ++s) {
    const int64_t n = bounds[s + 1] - bounds[s], pos0 = lens[s] - n;
    for (int64_t h = 0; h < sh.Hk; ++h)
      for (int64_t r0 = 0; r0 < n; r0 += kItemRows) {
        const int64_t r1 = std::min(n, r0 + kItemRows);
        items.push_back({s, h, r0, r1});
        const double keys = static_cast<double>(pos0 + r1);
        const double seen = sh.window > 0 ? std::min<double>(keys, sh.window) : keys;
        cost.push_back((r1 - r0) * (seen + 64.0));  // + a fixed share for the gather and tiles
      }
  }
  const std::vector<int64_t> starts = stoker::balanced_runs(cost);
  const int64_t nt = static_cast<int64_t>(starts.size()) - 1;
  at::parallel_for(0, nt, 1, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t)
      for (int64_t i = starts[t]; i < starts[t + 1]; ++i) {
        const Item& it = items[i];
        const int64_t first = bounds[it.span], n = bounds[it.span + 1] - first;
        run_item<T, D>(it, q + first * sh.Hq * D, kc, vc, tables + it.span * sh.MB,
                       lens[it.span] - n, sh, out + first * sh.Hq * D);
      }
  });
}

template <typename T>
using RunFn = void (*)(const T*, const T*, const T*, const int64_t*, const int64_t*,
                       const int64_t*, int64_t, const Shape&, T*);

template <typename T>
RunFn<T> pick(int64_t D) {
  switch (D) {
    case 16: return run<T, 16>;
    case 32: return run<T, 32>;
    case 64: return run<T, 64>;
    case 128: return run<T, 128>;
    case 256: return run<T, 256>;
    default: return nullptr;
  }
}

}  // namespace

bool prefill_supports(int64_t head_dim) { return pick<float>(head_dim) != nullptr; }

// query [T, Hq, D]: the step's prefill rows, chunk s at rows [bounds[s], bounds[s + 1]), its last
// row at position lens[s] - 1; block_tables [S, MB]; every chunk's K/V already stored.
torch::Tensor prefill_attention(torch::Tensor query, torch::Tensor key_cache,
                                torch::Tensor value_cache, torch::Tensor block_tables,
                                torch::Tensor bounds, torch::Tensor context_lens, double scale,
                                int64_t window, double softcap) {
  const auto dtype = key_cache.scalar_type();
  TORCH_CHECK(dtype == torch::kFloat32 || dtype == torch::kBFloat16, "float32 or bfloat16 cache");
  TORCH_CHECK(query.scalar_type() == dtype && value_cache.scalar_type() == dtype,
              "query, key and value caches must share one dtype");
  TORCH_CHECK(key_cache.is_contiguous() && value_cache.is_contiguous(), "cache must be contiguous");
  TORCH_CHECK(key_cache.dim() == 4 && key_cache.sizes() == value_cache.sizes(),
              "key/value caches must be [num_blocks, block_size, kv_heads, head_dim]");
  query = query.contiguous();
  block_tables = block_tables.to(torch::kInt64).contiguous();
  bounds = bounds.to(torch::kInt64).contiguous();
  context_lens = context_lens.to(torch::kInt64).contiguous();
  const int64_t T = query.size(0), Hq = query.size(1), D = query.size(2);
  const int64_t BS = key_cache.size(1), Hk = key_cache.size(2), num_blocks = key_cache.size(0);
  const int64_t S = context_lens.numel(), MB = block_tables.size(1);
  TORCH_CHECK(key_cache.size(3) == D && Hq % Hk == 0, "head shapes do not match the cache");
  TORCH_CHECK(prefill_supports(D), "unsupported head_dim ", D);
  TORCH_CHECK(block_tables.dim() == 2 && block_tables.size(0) == S && bounds.numel() == S + 1,
              "one block-table row, context length and bound pair per chunk");
  TORCH_CHECK(window >= 0 && softcap >= 0, "window and softcap must be >= 0 (0: off)");
  const int64_t* bt = block_tables.data_ptr<int64_t>();
  const int64_t* bd = bounds.data_ptr<int64_t>();
  const int64_t* lens = context_lens.data_ptr<int64_t>();
  TORCH_CHECK(bd[0] == 0 && bd[S] == T, "bounds must run from 0 to the query rows");
  // Every block the kernel reads must exist: a bad table is an error, not a stray read.
  for (int64_t s = 0; s < S; ++s) {
    const int64_t n = bd[s + 1] - bd[s];
    TORCH_CHECK(n >= 0 && lens[s] >= n && lens[s] <= MB * BS, "context length out of range");
    for (int64_t i = 0, nb = (lens[s] + BS - 1) / BS; i < nb; ++i)
      TORCH_CHECK(bt[s * MB + i] >= 0 && bt[s * MB + i] < num_blocks, "block id out of range");
  }
  auto out = torch::empty_like(query);
  const Shape sh{Hq, Hk, Hq / Hk, BS, MB, Hk * D, static_cast<float>(scale),
                 static_cast<float>(softcap), window};
  if (T == 0) return out;
  if (dtype == torch::kFloat32)
    pick<float>(D)(query.data_ptr<float>(), key_cache.data_ptr<float>(),
                   value_cache.data_ptr<float>(), bt, bd, lens, S, sh, out.data_ptr<float>());
  else
    pick<at::BFloat16>(D)(query.data_ptr<at::BFloat16>(), key_cache.data_ptr<at::BFloat16>(),
                          value_cache.data_ptr<at::BFloat16>(), bt, bd, lens, S, sh,
                          out.data_ptr<at::BFloat16>());
  return out;
}
