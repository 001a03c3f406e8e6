// The Python module: one binding per native CPU kernel (kernels/cpu_ops.py loads it).
#include "kernels.h"

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("supports", &supports, "whether a head_dim / query-per-kv-head group has a kernel");
  m.def("paged_decode_attention", &paged_decode_attention, "paged decode attention (fp32/bf16)");
  m.def("prefill_supports", &prefill_supports, "whether a head_dim has a prefill kernel");
  m.def("prefill_attention", &prefill_attention,
        "causal attention of a step's prompt chunks through the paged cache (fp32/bf16)");
  m.def("rms_norm", &rms_norm, "RMSNorm over rows (fp32/bf16)");
  m.def("add_rms_norm", &add_rms_norm, "(rms_norm(x + residual), x + residual) (fp32/bf16)");
  m.def("apply_rotary", &apply_rotary, "rotary embedding of q and k (fp32/bf16)");
  m.def("panel_linear_supported", &panel_linear_supported,
        "whether panel_linear was built (AVX2 or AVX-512)");
  m.def("pack_panels", &pack_panels,
        "a float32 or bfloat16 [N, K] weight as [N / 16, K, 16] panels");
  m.def("panel_linear", &panel_linear,
        "x @ W^T (+ bias) against panel-packed W (fp32 or bf16, AVX2 or AVX-512)");
  m.def("exponential_noise_rows", &exponential_noise_rows,
        "Exp(1) float32 noise [rows, vocab] from counter-based per-row keys");
  m.def("silu_and_mul", &silu_and_mul, "silu(gate) * up over a fused gate_up (fp32)");
  m.def("apply_token_bitmask", &apply_token_bitmask,
        "a grammar's token bitmask applied to logits rows in place (fp32, bf16)");
  m.def("store_kv", &store_kv, "new key/value rows into their paged-cache slots");
  m.def("greedy_candidates", &greedy_candidates,
        "per row, the tokens whose bounded bfloat16 logit may be the float32 argmax");
  m.def("bf16_pairs_supported", &bf16_pairs_supported, "whether bf16_pairs_linear was built");
  m.def("pack_bf16_pairs", &pack_bf16_pairs, "a [N, K] weight as [N / 16, K / 2, 16, 2] bf16");
  m.def("bf16_pairs_linear", &bf16_pairs_linear,
        "bfloat16 x @ W^T (+ bias), rounded to bfloat16 once, against pack_bf16_pairs(W) "
        "(AVX512-BF16)",
        pybind11::arg("x"), pybind11::arg("packed"), pybind11::arg("bias") = pybind11::none());
  m.def("llama_layer", &llama_layer,
        "a Llama-style decoder layer over a CPU step, the same kernels as the Python layer");
}
