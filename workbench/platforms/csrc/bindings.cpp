// The module's Python bindings, the one file that includes <torch/extension.h> (pybind11 and
// torch's whole C++ API, about 15 s to parse): the kernels' files include the slice of ATen
// they use (cpu_torch.h), so a first start's build is mostly the kernels' own code.
#include <torch/extension.h>

#include <vector>

// cpu_attention.cpp
at::Tensor paged_decode_attention(at::Tensor q, at::Tensor k_cache, at::Tensor v_cache,
                                  at::Tensor block_tables, at::Tensor context_lens, double scale);
// cpu_ops.cpp
at::Tensor rms_norm(at::Tensor x, at::Tensor weight, double eps);
std::vector<at::Tensor> add_rms_norm(at::Tensor x, at::Tensor residual, at::Tensor weight,
                                     double eps);
at::Tensor silu_and_mul(at::Tensor gate_up);
at::Tensor rope(at::Tensor qk, at::Tensor cos, at::Tensor sin);
void write_kv(at::Tensor k_cache, at::Tensor v_cache, at::Tensor k, at::Tensor v,
              at::Tensor slot_mapping);
std::vector<at::Tensor> decode_layers(at::Tensor x, std::vector<at::Tensor> weights,
                                      std::vector<int64_t> formats,
                                      std::vector<at::Tensor> k_caches,
                                      std::vector<at::Tensor> v_caches, at::Tensor cos,
                                      at::Tensor sin, at::Tensor block_tables,
                                      at::Tensor context_lens, at::Tensor slot_mapping,
                                      int64_t num_heads, int64_t num_kv_heads, double eps,
                                      double scale);
at::Tensor gemv(at::Tensor x, at::Tensor weight, c10::optional<at::Tensor> bias);
// cpu_quant.cpp
at::Tensor dequantize(at::Tensor w, int64_t fmt, int64_t K);
at::Tensor qlinear(at::Tensor x, at::Tensor w, int64_t fmt);
at::Tensor qembedding(at::Tensor ids, at::Tensor w, int64_t fmt, int64_t K, bool bf16);
at::Tensor qgemv(at::Tensor x, at::Tensor w, int64_t fmt);
// cpu_a8.cpp
std::vector<at::Tensor> a8_quantize(at::Tensor x);
at::Tensor a8_embedding(at::Tensor ids, at::Tensor w, int64_t fmt, int64_t K, bool bf16);
at::Tensor a8_linear(at::Tensor x, at::Tensor w, int64_t fmt);     // where VNNI is

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_decode_attention", &paged_decode_attention,
        "Paged decode attention over a head-major fp32 or bf16 KV pool (CPU)");
  m.def("rms_norm", &rms_norm, "RMSNorm over the last dim (fp32 or bf16)");
  m.def("add_rms_norm", &add_rms_norm, "Residual add, then RMSNorm: (normed, sum) (fp32 or bf16)");
  m.def("silu_and_mul", &silu_and_mul, "silu(gate) * up of a [T, 2I] tensor (fp32 or bf16)");
  m.def("rope", &rope, "Rotate-half RoPE with a sign-folded sin table (fp32 or bf16)");
  m.def("write_kv", &write_kv, "This step's K/V into their pool slots (fp32 or bf16)");
  m.def("decode_layers", &decode_layers, "Batch-1 decode through every layer (fp32 or bf16 Llama)");
  m.def("dequantize", &dequantize, "packed weight [N, row bytes] -> fp32 [N, K]");
  m.def("qlinear", &qlinear, "x [M, K] @ packed weight^T -> [M, N] (fp32 or bf16 x)");
  m.def("qembedding", &qembedding, "rows of a packed table -> [T, K]");
  m.def("a8_quantize", &a8_quantize, "activations fp32 [M, K] -> (int8 [M, K_pad], scales)");
  m.def("a8_embedding", &a8_embedding, "rows of a tiled packed table -> [T, K]");
#ifdef __AVX512F__
  m.def("gemv", &gemv, "x [1, K] @ weight [N, K]^T (+ bias), AVX-512 (fp32 or bf16)");
  m.def("qgemv", &qgemv, "x [1, K] fp32 @ packed weight^T, AVX-512");
#endif
#if defined(__AVX512F__) && defined(__AVX512VNNI__) && defined(__AVX512BW__)
  m.def("a8_linear", &a8_linear, "x [M, K] @ tiled packed weight^T, 8-bit activations, VNNI");
#endif
}
