// One Llama-style decoder layer over a CPU step, as one call: decode rows, and prompt chunks
// through the batched prefill kernel. It runs the same native kernels and torch ops, in the same
// order and on the same inputs, as the Python layer (services/worker/models/llama.py and
// layers.Attention), so its output is bit for bit the same. What it removes is the Python
// between them: module calls, backend dispatch and views cost about 75 us a layer, 2.3 ms of a
// 17 ms SmolLM2 batch-1 step on the 2-core box (docs/benchmarks.md, CPU kernels).
#include <ATen/core/dispatch/Dispatcher.h>

#include <string>
#include <tuple>

#include "kernels.h"

namespace {

// services/worker/models/layers.linear: oneDNN's packed weight, the float32 panel layout, the
// bfloat16 pair layout, or plain.
torch::Tensor layer_linear(const torch::Tensor& x, const torch::Tensor& w, const OptTensor& bias) {
  if (w.is_mkldnn()) {
    static const auto op =
        c10::Dispatcher::singleton().findSchemaOrThrow("mkldnn::_linear_pointwise", "");
    torch::jit::Stack stack;
    stack.emplace_back(x);
    stack.emplace_back(w);
    stack.emplace_back(bias);
    stack.emplace_back(std::string("none"));
    stack.emplace_back(c10::List<c10::optional<at::Scalar>>());
    stack.emplace_back(c10::optional<std::string>(std::string("")));
    op.callBoxed(&stack);
    return stack[0].toTensor();
  }
  if (w.dim() == 3) return panel_linear(x, w, bias);
  if (w.dim() == 4) return bf16_pairs_linear(x, w, bias);
  return torch::nn::functional::linear(x, w, bias.has_value() ? *bias : torch::Tensor());
}

// kernels/dispatch.silu_and_mul on the CPU: native for float32 rows, else the torch reference.
torch::Tensor silu_mul(const torch::Tensor& gate_up) {
  if (gate_up.scalar_type() == torch::kFloat32) return silu_and_mul(gate_up);
  auto halves = gate_up.chunk(2, -1);
  return torch::silu(halves[0]) * halves[1];
}

// kernels/rms_norm.rms_norm, op for op: the q/k norm runs over [T, heads, head_dim] views, which
// the Python layer sends to the torch reference (the native rms_norm takes 2-D rows).
torch::Tensor reference_rms_norm(const torch::Tensor& x, const torch::Tensor& w, double eps) {
  torch::Tensor x32 = x.to(torch::kFloat32);
  x32 = x32 * torch::rsqrt(x32.pow(2).mean(-1, true) + eps);
  return w * x32.to(x.scalar_type());
}

}  // namespace

// (mlp output, residual stream), as DecoderLayer.forward returns them: the stream is their sum.
// residual undefined: the first layer (its input is the embedding, the stream itself). Rows
// [0, num_decode) decode; the rest are prompt chunks described by prefill_tables / bounds / lens
// (AttentionMetadata's). out_rows: in a model's last layer, the rows that need an output.
std::tuple<torch::Tensor, torch::Tensor> llama_layer(
    torch::Tensor hidden, OptTensor residual, torch::Tensor input_norm, torch::Tensor qkv_w,
    OptTensor qkv_bias, OptTensor q_norm, OptTensor k_norm, torch::Tensor o_w,
    torch::Tensor post_norm, torch::Tensor gate_up_w, torch::Tensor down_w, torch::Tensor cos,
    torch::Tensor sin, torch::Tensor key_cache, torch::Tensor value_cache,
    torch::Tensor slot_mapping, int64_t num_decode, OptTensor block_tables,
    OptTensor context_lens, OptTensor prefill_tables, OptTensor prefill_bounds,
    OptTensor prefill_lens, OptTensor out_rows, int64_t num_heads, int64_t num_kv_heads,
    int64_t head_dim, double eps, double scale, int64_t window, double softcap) {
  torch::Tensor normed, stream;
  if (residual.has_value() && residual->defined()) {
    std::tie(normed, stream) = add_rms_norm(hidden, *residual, input_norm, eps);
  } else {
    normed = rms_norm(hidden, input_norm, eps);
    stream = hidden;
  }
  const int64_t T = hidden.size(0), q_size = num_heads * head_dim;
  const int64_t kv_size = num_kv_heads * head_dim;
  torch::Tensor qkv = layer_linear(normed, qkv_w, qkv_bias);
  auto parts = qkv.split_with_sizes({q_size, kv_size, kv_size}, -1);
  torch::Tensor q = parts[0].view({T, num_heads, head_dim});
  torch::Tensor k = parts[1].view({T, num_kv_heads, head_dim});
  torch::Tensor v = parts[2].view({T, num_kv_heads, head_dim});
  if (q_norm.has_value() && q_norm->defined()) {  // Qwen3
    TORCH_CHECK(k_norm.has_value() && k_norm->defined(), "q_norm without k_norm");
    q = reference_rms_norm(q, *q_norm, eps);
    k = reference_rms_norm(k, *k_norm, eps);
  }
  std::tie(q, k) = apply_rotary(q, k, cos, sin);
  store_kv(key_cache, value_cache, k, v, slot_mapping);
  const bool kept = out_rows.has_value() && out_rows->defined();
  torch::Tensor attn;
  if (num_decode) {
    TORCH_CHECK(block_tables.has_value() && context_lens.has_value(), "decode rows need tables");
    attn = paged_decode_attention(q.slice(0, 0, num_decode), key_cache, value_cache, *block_tables,
                                  *context_lens, scale, window, softcap);
  }
  if (num_decode < T) {
    TORCH_CHECK(prefill_tables.has_value() && prefill_bounds.has_value() &&
                    prefill_lens.has_value(),
                "prompt rows need the batched prefill tables");
    torch::Tensor rows = kept ? q.index({out_rows->slice(0, num_decode)}) : q.slice(0, num_decode);
    torch::Tensor prefilled = prefill_attention(rows, key_cache, value_cache, *prefill_tables,
                                                *prefill_bounds, *prefill_lens, scale, window,
                                                softcap);
    attn = num_decode ? torch::cat({attn, prefilled}) : prefilled;
  }
  torch::Tensor out = layer_linear(attn.view({attn.size(0), q_size}), o_w, c10::nullopt);
  if (kept) stream = stream.index({*out_rows});
  std::tie(normed, stream) = add_rms_norm(out, stream, post_norm, eps);
  torch::Tensor gate_up = layer_linear(normed, gate_up_w, c10::nullopt);
  return {layer_linear(silu_mul(gate_up), down_w, c10::nullopt), stream};
}
