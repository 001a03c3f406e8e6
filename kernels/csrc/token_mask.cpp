// Structured outputs: a grammar's token bitmask applied to logits rows in place, float32 or
// bfloat16 (docs/structured-outputs.md). Bit j of word w allows token 32w + j; a disallowed token's logit
// becomes -inf. Most words of a JSON grammar's mask are all-zero or all-one, so each is tested
// whole first. torch's reference (kernels/token_mask.py) unpacks the bits into a [rows, V] bool
// tensor and masks with it: about 1 ms a row at V = 49152 on these CPUs, this a few us.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <cstdint>

template <typename T>
static void mask_rows(torch::Tensor logits, const uint32_t* b, int64_t W, const int64_t* r,
                      int64_t num_rows, T fill) {
  const int64_t V = logits.size(1), ld = logits.stride(0), R = logits.size(0);
  const int64_t words = std::min<int64_t>(W, (V + 31) / 32);
  T* l = logits.data_ptr<T>();
  at::parallel_for(0, num_rows, 4, [&](int64_t begin, int64_t end) {
    for (int64_t k = begin; k < end; ++k) {
      const int64_t row = r[k];
      TORCH_CHECK(row >= 0 && row < R, "row out of range");
      T* out = l + row * ld;
      const uint32_t* mask = b + row * W;
      for (int64_t w = 0; w < words; ++w) {
        const uint32_t word = mask[w];
        if (word == 0xFFFFFFFFu) continue;
        const int64_t base = w * 32, n = std::min<int64_t>(32, V - base);
        if (word == 0) {
          for (int64_t j = 0; j < n; ++j) out[base + j] = fill;
          continue;
        }
        for (int64_t j = 0; j < n; ++j)
          if (!((word >> j) & 1u)) out[base + j] = fill;
      }
      // Ids past the mask's words (a logits row wider than the tokenizer) are never allowed.
      for (int64_t v = words * 32; v < V; ++v) out[v] = fill;
    }
  });
}

// fill: -inf for logits to sample from; a large finite negative for the greedy head's bfloat16
// screen, which sends rows with non-finite logits to the full head (services/worker/greedy_head.py).
void apply_token_bitmask(torch::Tensor logits, torch::Tensor bitmask, torch::Tensor rows,
                         double fill) {
  TORCH_CHECK((logits.scalar_type() == torch::kFloat32 ||
               logits.scalar_type() == torch::kBFloat16) &&
                  logits.dim() == 2 && logits.stride(1) == 1,
              "logits must be float32 or bfloat16 [R, V] with contiguous rows");
  TORCH_CHECK(bitmask.scalar_type() == torch::kInt32 && bitmask.dim() == 2 &&
                  bitmask.is_contiguous() && bitmask.size(0) == logits.size(0),
              "bitmask must be contiguous int32 [R, ceil(V / 32)]");
  TORCH_CHECK(rows.scalar_type() == torch::kInt64 && rows.dim() == 1 && rows.is_contiguous(),
              "rows must be int64 [K]");
  const uint32_t* b = reinterpret_cast<const uint32_t*>(bitmask.data_ptr<int32_t>());
  if (logits.scalar_type() == torch::kFloat32) {
    mask_rows<float>(logits, b, bitmask.size(1), rows.data_ptr<int64_t>(), rows.size(0),
                     static_cast<float>(fill));
  } else {
    mask_rows<at::BFloat16>(logits, b, bitmask.size(1), rows.data_ptr<int64_t>(), rows.size(0),
                            at::BFloat16(static_cast<float>(fill)));
  }
}
