// A float32 linear layer for the GEMMs of decode, verify and prefill steps on AVX2 and AVX-512
// CPUs: y[M, N] = x[M, K] @ W[N, K]^T (+ bias), with W laid out once at load time in panels of 16
// output columns, [N / 16, K, 16], so a panel is one contiguous stream.
//
// Why: at 1-64 rows oneDNN's packed float32 kernel reached 66 GFLOP/s at 32 rows on the 2-core
// AVX2 box where it does 117-125 on a large GEMM (docs/benchmarks.md, CPU kernels), and on an
// AVX-512 Zen 4 box it read the weights at half the bandwidth at 1 row (the same page). Here
// each thread walks whole panels with a register tile that runs down K with one broadcast per row
// and one load per panel per step, so a panel is read from memory once per chunk of rows and the
// FMA units, not the loads, set the pace: on AVX2 a 6 x 16 tile (12 accumulators, BLIS's Haswell
// shape), on AVX-512 a 12 x 32 tile over two panels (24 of the 32 registers).
//
// Every output is one FMA chain over k = 0..K-1 in order, whatever M is, which tile a row lands
// in or which ISA runs it, so a row's result does not depend on the batch it is computed in.
//
// bfloat16 weights use the same panels of 16-bit values, widened to float32 as they are loaded
// (a bfloat16 is the top half of a float32: zero-extend and shift), with float32 inputs (the
// bfloat16 rows converted once) and float32 sums, rounded to bfloat16 once at the end. That is
// the path on CPUs without AVX512-BF16 (the pair kernel, bf16_pairs.cpp, takes the others):
// there torch's bfloat16 GEMM ran at 17-20 GFLOP/s at every row count on the AVX2 Zen 3 box,
// against the float32 panels' 60-190 (docs/benchmarks.md, CPU kernels).
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define STOKER_PANEL_LINEAR 1
#endif

namespace {

constexpr int64_t kPanel = 16;     // output columns per panel: two 8-float registers
constexpr int64_t kTileRows = 6;   // rows per register tile
constexpr int64_t kChunkRows = 48;  // rows whose inputs stay in L2 while every panel streams by

#ifdef STOKER_PANEL_LINEAR
// One panel row (16 output columns at one k) as two 8-float registers.
inline void load_row(const float* p, __m256& lo, __m256& hi) {
  lo = _mm256_load_ps(p);
  hi = _mm256_load_ps(p + 8);
}
inline void load_row(const uint16_t* p, __m256& lo, __m256& hi) {
  const __m128i a = _mm_load_si128(reinterpret_cast<const __m128i*>(p));
  const __m128i b = _mm_load_si128(reinterpret_cast<const __m128i*>(p + 8));
  lo = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(a), 16));
  hi = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(b), 16));
}

// One tile: rows [0, R) of x (row stride ldx) against one panel, into y (row stride ldy). The
// accumulators are named registers, not an array: GCC kept an array's copy on the stack and
// stored all twelve every step, which halved the speed.
template <int R, typename W>
inline void tile(const float* x, int64_t ldx, const W* panel, int64_t K, const float* bias,
                 float* y, int64_t ldy) {
  __m256 l0 = _mm256_setzero_ps(), h0 = l0, l1 = l0, h1 = l0, l2 = l0, h2 = l0, l3 = l0, h3 = l0,
         l4 = l0, h4 = l0, l5 = l0, h5 = l0;
  const float* x0 = x;
  const float* x1 = x + ldx;
  const float* x2 = x + 2 * ldx;
  const float* x3 = x + 3 * ldx;
  const float* x4 = x + 4 * ldx;
  const float* x5 = x + 5 * ldx;
#define STOKER_ROW(i)                                  \
  if constexpr (R > i) {                               \
    const __m256 a = _mm256_broadcast_ss(x##i + k);    \
    l##i = _mm256_fmadd_ps(a, w_lo, l##i);             \
    h##i = _mm256_fmadd_ps(a, w_hi, h##i);             \
  }
  for (int64_t k = 0; k < K; ++k) {
    __m256 w_lo, w_hi;
    load_row(panel + k * kPanel, w_lo, w_hi);
    STOKER_ROW(0) STOKER_ROW(1) STOKER_ROW(2) STOKER_ROW(3) STOKER_ROW(4) STOKER_ROW(5)
  }
#undef STOKER_ROW
  const __m256 b_lo = bias ? _mm256_loadu_ps(bias) : _mm256_setzero_ps();
  const __m256 b_hi = bias ? _mm256_loadu_ps(bias + 8) : _mm256_setzero_ps();
#define STOKER_STORE(i)                                              \
  if constexpr (R > i) {                                             \
    _mm256_storeu_ps(y + i * ldy, bias ? _mm256_add_ps(l##i, b_lo) : l##i);     \
    _mm256_storeu_ps(y + i * ldy + 8, bias ? _mm256_add_ps(h##i, b_hi) : h##i); \
  }
  STOKER_STORE(0) STOKER_STORE(1) STOKER_STORE(2) STOKER_STORE(3) STOKER_STORE(4) STOKER_STORE(5)
#undef STOKER_STORE
}

template <typename W>
inline void tile_rows(int64_t rows, const float* x, int64_t ldx, const W* panel, int64_t K,
                      const float* bias, float* y, int64_t ldy) {
  switch (rows) {
    case 6: return tile<6>(x, ldx, panel, K, bias, y, ldy);
    case 5: return tile<5>(x, ldx, panel, K, bias, y, ldy);
    case 4: return tile<4>(x, ldx, panel, K, bias, y, ldy);
    case 3: return tile<3>(x, ldx, panel, K, bias, y, ldy);
    case 2: return tile<2>(x, ldx, panel, K, bias, y, ldy);
    default: return tile<1>(x, ldx, panel, K, bias, y, ldy);
  }
}
#endif

#ifdef __AVX512F__
// The AVX-512 tile: rows [0, R) against two adjacent panels (32 output columns, one 16-float
// register each), 2R named accumulators, R <= 12, so 24 of the 32 registers accumulate and a
// panel register is loaded once per two FMAs and a broadcast once per two. Each output is the
// same in-order FMA chain over K as the AVX2 tile's, so the two give identical bits.
inline __m512 load_row512(const float* p) { return _mm512_load_ps(p); }
inline __m512 load_row512(const uint16_t* p) {
  const __m256i h = _mm256_load_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

template <int R, bool Two, typename W>
inline void tile512(const float* x, int64_t ldx, const W* pa, int64_t K, const float* bias,
                    float* y, int64_t ldy) {
  const W* pb = pa + K * kPanel;  // the next panel (only read when Two)
  __m512 a0 = _mm512_setzero_ps(), b0 = a0, a1 = a0, b1 = a0, a2 = a0, b2 = a0, a3 = a0, b3 = a0,
         a4 = a0, b4 = a0, a5 = a0, b5 = a0, a6 = a0, b6 = a0, a7 = a0, b7 = a0, a8 = a0, b8 = a0,
         a9 = a0, b9 = a0, a10 = a0, b10 = a0, a11 = a0, b11 = a0;
#define STOKER_ROW(i)                                      \
  if constexpr (R > i) {                                   \
    const __m512 v = _mm512_set1_ps(x[i * ldx + k]);       \
    a##i = _mm512_fmadd_ps(v, wa, a##i);                   \
    if constexpr (Two) b##i = _mm512_fmadd_ps(v, wb, b##i); \
  }
  for (int64_t k = 0; k < K; ++k) {
    const __m512 wa = load_row512(pa + k * kPanel);
    const __m512 wb = Two ? load_row512(pb + k * kPanel) : wa;
    STOKER_ROW(0) STOKER_ROW(1) STOKER_ROW(2) STOKER_ROW(3) STOKER_ROW(4) STOKER_ROW(5)
    STOKER_ROW(6) STOKER_ROW(7) STOKER_ROW(8) STOKER_ROW(9) STOKER_ROW(10) STOKER_ROW(11)
  }
#undef STOKER_ROW
  const __m512 ba = bias ? _mm512_loadu_ps(bias) : _mm512_setzero_ps();
  const __m512 bb = bias && Two ? _mm512_loadu_ps(bias + kPanel) : _mm512_setzero_ps();
#define STOKER_STORE(i)                                                               \
  if constexpr (R > i) {                                                              \
    _mm512_storeu_ps(y + i * ldy, bias ? _mm512_add_ps(a##i, ba) : a##i);             \
    if constexpr (Two)                                                                \
      _mm512_storeu_ps(y + i * ldy + kPanel, bias ? _mm512_add_ps(b##i, bb) : b##i);  \
  }
  STOKER_STORE(0) STOKER_STORE(1) STOKER_STORE(2) STOKER_STORE(3) STOKER_STORE(4) STOKER_STORE(5)
  STOKER_STORE(6) STOKER_STORE(7) STOKER_STORE(8) STOKER_STORE(9) STOKER_STORE(10)
  STOKER_STORE(11)
#undef STOKER_STORE
}

constexpr int64_t kTileRows512 = 12;
constexpr int64_t kChunkRows512 = 96;  // 48, 96, 192 and 384 measured the same

template <bool Two, typename W>
inline void tile512_rows(int64_t rows, const float* x, int64_t ldx, const W* panel, int64_t K,
                         const float* bias, float* y, int64_t ldy) {
  switch (rows) {
    case 12: return tile512<12, Two>(x, ldx, panel, K, bias, y, ldy);
    case 11: return tile512<11, Two>(x, ldx, panel, K, bias, y, ldy);
    case 10: return tile512<10, Two>(x, ldx, panel, K, bias, y, ldy);
    case 9: return tile512<9, Two>(x, ldx, panel, K, bias, y, ldy);
    case 8: return tile512<8, Two>(x, ldx, panel, K, bias, y, ldy);
    case 7: return tile512<7, Two>(x, ldx, panel, K, bias, y, ldy);
    case 6: return tile512<6, Two>(x, ldx, panel, K, bias, y, ldy);
    case 5: return tile512<5, Two>(x, ldx, panel, K, bias, y, ldy);
    case 4: return tile512<4, Two>(x, ldx, panel, K, bias, y, ldy);
    case 3: return tile512<3, Two>(x, ldx, panel, K, bias, y, ldy);
    case 2: return tile512<2, Two>(x, ldx, panel, K, bias, y, ldy);
    default: return tile512<1, Two>(x, ldx, panel, K, bias, y, ldy);
  }
}
#endif

#ifdef STOKER_PANEL_LINEAR
// Rows are split evenly into chunks of at most ChunkRows and each chunk evenly into tiles of at
// most TileRows (8 rows on AVX2: 4 + 4, not 6 + 2), since a tile of 1-3 rows is bound by the FMA
// latency, not the FMA units. Threads share out tasks of Width adjacent panels; an odd panel
// count leaves the last task one panel. tile(rows, x, panel, panels_in_task, bias, y) runs one.
template <int64_t TileRows, int64_t ChunkRows, int64_t Width, typename W, typename Tile>
inline void run(const float* xp, int64_t ldx, int64_t M, const W* wp, int64_t num_panels,
                int64_t K, const float* b, float* yp, Tile tile) {
  const int64_t N = num_panels * kPanel;
  const int64_t tasks = (num_panels + Width - 1) / Width;
  const int64_t chunks = (M + ChunkRows - 1) / ChunkRows;
  for (int64_t c = 0; c < chunks; ++c) {
    const int64_t m0 = M * c / chunks, m1 = M * (c + 1) / chunks;
    const int64_t tiles = (m1 - m0 + TileRows - 1) / TileRows;
    at::parallel_for(0, tasks, 1, [&](int64_t begin, int64_t end) {
      for (int64_t task = begin; task < end; ++task) {
        const int64_t p = task * Width, width = std::min(Width, num_panels - p);
        const W* panel = wp + p * K * kPanel;
        const float* bp = b ? b + p * kPanel : nullptr;
        for (int64_t t = 0; t < tiles; ++t) {
          const int64_t r0 = m0 + (m1 - m0) * t / tiles, r1 = m0 + (m1 - m0) * (t + 1) / tiles;
          tile(r1 - r0, xp + r0 * ldx, panel, width, bp, yp + r0 * N + p * kPanel);
        }
      }
    });
  }
}
#endif

}  // namespace

bool panel_linear_supported() {
#ifdef STOKER_PANEL_LINEAR
  return true;
#else
  return false;
#endif
}

// weight [N, K] -> panels [N / 16, K, 16] (N a multiple of 16), float32 or bfloat16, 64-byte
// aligned by torch's allocator (so every bfloat16 panel row of 32 bytes is aligned too).
torch::Tensor pack_panels(torch::Tensor weight) {
  const auto dtype = weight.scalar_type();
  TORCH_CHECK(weight.dim() == 2 && (dtype == torch::kFloat32 || dtype == torch::kBFloat16),
              "float32 or bfloat16 [N, K]");
  const int64_t N = weight.size(0), K = weight.size(1);
  TORCH_CHECK(N % kPanel == 0, "N must be a multiple of 16, got ", N);
  return weight.reshape({N / kPanel, kPanel, K}).transpose(1, 2).contiguous();
}

// x @ W^T (+ bias) in x's dtype, which must be the panels' (float32, or bfloat16 computed in
// float32 and rounded once).
torch::Tensor panel_linear(torch::Tensor x, torch::Tensor panels, c10::optional<torch::Tensor> bias) {
  TORCH_CHECK(panel_linear_supported(), "panel_linear needs AVX2 and FMA");
  TORCH_CHECK(panels.dim() == 3 && panels.size(2) == kPanel && panels.is_contiguous(), "panels");
  const auto dtype = panels.scalar_type();
  TORCH_CHECK(dtype == torch::kFloat32 || dtype == torch::kBFloat16, "float32 or bfloat16 panels");
  TORCH_CHECK(x.scalar_type() == dtype, "x must have the panels' dtype");
  const bool bf16 = dtype == torch::kBFloat16;
  const int64_t K = panels.size(1), num_panels = panels.size(0), N = num_panels * kPanel;
  TORCH_CHECK(x.size(-1) == K, "x has ", x.size(-1), " features, the weight ", K);
  auto out_shape = x.sizes().vec();
  out_shape.back() = N;
  torch::Tensor x2 = x.reshape({-1, K});
  if (bf16) x2 = x2.to(torch::kFloat32);  // small next to the weight; converted once, not per panel
  if (x2.stride(1) != 1) x2 = x2.contiguous();
  const int64_t M = x2.size(0), ldx = x2.stride(0);
  torch::Tensor y = torch::empty({M, N}, x2.options());
  const float* b = nullptr;
  torch::Tensor bias_c;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->numel() == N && bias->scalar_type() == dtype, "bias");
    bias_c = bias->to(torch::kFloat32).contiguous();
    b = bias_c.data_ptr<float>();
  }
#ifdef STOKER_PANEL_LINEAR
  const float* xp = x2.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  auto launch = [&](auto* wp) {
#ifdef __AVX512F__
    run<kTileRows512, kChunkRows512, 2>(
        xp, ldx, M, wp, num_panels, K, b, yp,
        [&](int64_t rows, const float* x, auto* panel, int64_t width, const float* bp,
            float* yt) {
          if (width == 2) tile512_rows<true>(rows, x, ldx, panel, K, bp, yt, N);
          else tile512_rows<false>(rows, x, ldx, panel, K, bp, yt, N);
        });
#else
    run<kTileRows, kChunkRows, 1>(
        xp, ldx, M, wp, num_panels, K, b, yp,
        [&](int64_t rows, const float* x, auto* panel, int64_t, const float* bp, float* yt) {
          tile_rows(rows, x, ldx, panel, K, bp, yt, N);
        });
#endif
  };
  if (bf16)
    launch(static_cast<const uint16_t*>(panels.data_ptr()));
  else
    launch(static_cast<const float*>(panels.data_ptr()));
#endif
  // Rounded to nearest even, as torch's .to(bfloat16) and its bfloat16 GEMMs round.
  return (bf16 ? y.to(torch::kBFloat16) : y).reshape(out_shape);
}
