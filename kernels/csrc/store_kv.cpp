// Writing a step's new keys and values into the paged cache, both caches in one call: a row copy
// per token. torch's index_copy_ did the same in two calls of 12-18 us each at decode sizes (60
// a step on SmolLM2), mostly dispatch, where this costs a few microseconds.
#include <torch/extension.h>

#include <cstdint>
#include <cstring>

void store_kv(torch::Tensor key_cache, torch::Tensor value_cache, torch::Tensor key,
              torch::Tensor value, torch::Tensor slot_mapping) {
  TORCH_CHECK(key_cache.is_contiguous() && value_cache.is_contiguous(), "cache must be contiguous");
  TORCH_CHECK(key.scalar_type() == key_cache.scalar_type() &&
                  value.scalar_type() == key_cache.scalar_type() &&
                  value_cache.scalar_type() == key_cache.scalar_type(),
              "keys, values and caches must share one dtype");
  TORCH_CHECK(slot_mapping.scalar_type() == torch::kInt64, "slot_mapping must be int64");
  const int64_t T = key.size(0);
  const int64_t row = key_cache.numel() / (key_cache.size(0) * key_cache.size(1));  // Hk * D
  const int64_t slots = key_cache.size(0) * key_cache.size(1);
  TORCH_CHECK(key.numel() == T * row && value.numel() == T * row && slot_mapping.numel() == T,
              "one [kv_heads, head_dim] key and value row per slot");
  const int64_t elem = key_cache.element_size(), bytes = row * elem;
  // Rows may be views into the fused qkv projection: each token's row contiguous, rows strided.
  TORCH_CHECK(key.stride(-1) == 1 && value.stride(-1) == 1, "key/value rows must be contiguous");
  TORCH_CHECK(key.dim() == 3 && key.stride(1) == key.size(2) && value.stride(1) == value.size(2),
              "key/value must be [T, kv_heads, head_dim] with contiguous rows");
  const int64_t* slot = slot_mapping.data_ptr<int64_t>();
  auto* kc = static_cast<char*>(key_cache.data_ptr());
  auto* vc = static_cast<char*>(value_cache.data_ptr());
  const auto* k = static_cast<const char*>(key.data_ptr());
  const auto* v = static_cast<const char*>(value.data_ptr());
  const int64_t ks = key.stride(0) * elem, vs = value.stride(0) * elem;
  for (int64_t t = 0; t < T; ++t) {
    TORCH_CHECK(slot[t] >= 0 && slot[t] < slots, "slot out of range: ", slot[t]);
    std::memcpy(kc + slot[t] * bytes, k + t * ks, bytes);
    std::memcpy(vc + slot[t] * bytes, v + t * vs, bytes);
  }
}
