// Every native CPU kernel's entry point: bindings.cpp exposes them to Python, and
// llama_layer.cpp calls them directly.
#pragma once

#include <torch/extension.h>

#include <tuple>

bool supports(int64_t head_dim, int64_t group);
bool prefill_supports(int64_t head_dim);
torch::Tensor prefill_attention(torch::Tensor query, torch::Tensor key_cache,
                                torch::Tensor value_cache, torch::Tensor block_tables,
                                torch::Tensor bounds, torch::Tensor context_lens, double scale,
                                int64_t window, double softcap);
torch::Tensor paged_decode_attention(torch::Tensor query, torch::Tensor key_cache,
                                     torch::Tensor value_cache, torch::Tensor block_tables,
                                     torch::Tensor context_lens, double scale, int64_t window,
                                     double softcap);
torch::Tensor rms_norm(torch::Tensor x, torch::Tensor w, double eps);
std::tuple<torch::Tensor, torch::Tensor> add_rms_norm(torch::Tensor x, torch::Tensor residual,
                                                      torch::Tensor w, double eps);
std::tuple<torch::Tensor, torch::Tensor> apply_rotary(torch::Tensor q, torch::Tensor k,
                                                      torch::Tensor cos, torch::Tensor sin);
bool panel_linear_supported();
torch::Tensor pack_panels(torch::Tensor weight);
torch::Tensor panel_linear(torch::Tensor x, torch::Tensor panels, c10::optional<torch::Tensor> bias);
torch::Tensor exponential_noise_rows(torch::Tensor keys, int64_t vocab);
std::tuple<torch::Tensor, torch::Tensor> greedy_candidates(torch::Tensor approx,
                                                           torch::Tensor row_scale,
                                                           torch::Tensor col_norm, double rel,
                                                           double slack, int64_t max_per_row);

void store_kv(torch::Tensor key_cache, torch::Tensor value_cache, torch::Tensor key,
              torch::Tensor value, torch::Tensor slot_mapping);

torch::Tensor silu_and_mul(torch::Tensor gate_up);
void apply_token_bitmask(torch::Tensor logits, torch::Tensor bitmask, torch::Tensor rows,
                         double fill);
bool bf16_pairs_supported();
torch::Tensor pack_bf16_pairs(torch::Tensor weight);
using OptTensor = c10::optional<torch::Tensor>;
torch::Tensor bf16_pairs_linear(torch::Tensor x, torch::Tensor packed, OptTensor bias);
std::tuple<torch::Tensor, torch::Tensor> llama_layer(
    torch::Tensor hidden, OptTensor residual, torch::Tensor input_norm, torch::Tensor qkv_w,
    OptTensor qkv_bias, OptTensor q_norm, OptTensor k_norm, torch::Tensor o_w,
    torch::Tensor post_norm, torch::Tensor gate_up_w, torch::Tensor down_w, torch::Tensor cos,
    torch::Tensor sin, torch::Tensor key_cache, torch::Tensor value_cache,
    torch::Tensor slot_mapping, int64_t num_decode, OptTensor block_tables,
    OptTensor context_lens, OptTensor prefill_tables, OptTensor prefill_bounds,
    OptTensor prefill_lens, OptTensor out_rows, int64_t num_heads, int64_t num_kv_heads,
    int64_t head_dim, double eps, double scale, int64_t window, double softcap);
