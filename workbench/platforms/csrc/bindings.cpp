// The module's operator registrations (torch.ops.workbench_cpu.*). Registered with
// TORCH_LIBRARY rather than bound with pybind11: <torch/library.h> parses in about 11 s where
// <torch/extension.h> (pybind11 and torch's whole C++ API) took 41, and this file was the
// build's longest step (55 s of its 110 on two cores). The kernels' files include the slice
// of ATen they use (cpu_torch.h). Called from Python through the dispatcher: about 2 us a
// call, as the pybind11 binding was.
#include <torch/library.h>

#include <string>
#include <vector>

// cpu_attention.cpp
at::Tensor paged_decode_attention(at::Tensor q, at::Tensor k_cache, at::Tensor v_cache,
                                  at::Tensor block_tables, at::Tensor context_lens, double scale);
at::Tensor paged_prefill_attention(at::Tensor q, at::Tensor k_cache, at::Tensor v_cache,
                                   at::Tensor block_tables, at::Tensor query_start,
                                   at::Tensor context_lens, double scale);   // where AVX-512 is
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
at::Tensor small_m_linear(at::Tensor x, at::Tensor weight, c10::optional<at::Tensor> bias);
// cpu_quant.cpp
at::Tensor dequantize(at::Tensor w, int64_t fmt, int64_t K);
at::Tensor qlinear(at::Tensor x, at::Tensor w, int64_t fmt);
int64_t set_packed_rows(int64_t n);
bool set_onednn_slices(bool on);
at::Tensor qembedding(at::Tensor ids, at::Tensor w, int64_t fmt, int64_t K, bool bf16);
at::Tensor qgemv(at::Tensor x, at::Tensor w, int64_t fmt);
at::Tensor bf16c_gemv(at::Tensor x, at::Tensor w, c10::optional<at::Tensor> bias);
at::Tensor widened_linear(at::Tensor x, at::Tensor w);
bool bf16c_in_registers();  // whether bf16c_gemv rebuilds the rows in registers in this build
// cpu_a8.cpp
std::vector<at::Tensor> a8_quantize(at::Tensor x);
at::Tensor a8_round_trip(at::Tensor x);
at::Tensor a8_embedding(at::Tensor ids, at::Tensor w, int64_t fmt, int64_t K, bool bf16);
at::Tensor a8_linear(at::Tensor x, at::Tensor w, int64_t fmt, int64_t amx);  // where VNNI is
bool a8_amx();                                                     // where VNNI is

static bool bf16c_fast() { return true; }
static bool bf16c_stream() { return true; }
// The ISA paths this build took (for tests and `workbench doctor`): the macros it saw.
static std::string isa() {
  std::string s;
#ifdef __AVX512F__
  s += "avx512f ";
#endif
#ifdef __AVX512BF16__
  s += "avx512bf16 ";
#endif
#ifdef __AVX512VNNI__
  s += "avx512vnni ";
#endif
#ifdef __AVX512VBMI2__
  s += "avx512vbmi2 ";
#endif
#if defined(__AMX_TILE__)
  s += "amx ";
#endif
#ifdef __AVX2__
  s += "avx2 ";
#endif
#ifdef __FMA__
  s += "fma ";
#endif
#ifdef __F16C__
  s += "f16c ";
#endif
#ifdef __ARM_NEON
  s += "neon ";
#endif
  if (s.empty()) s = "portable ";
  s.pop_back();
  return s;
}

TORCH_LIBRARY(workbench_cpu, m) {
  // Paged decode attention over a head-major fp32 or bf16 KV pool.
  m.def("paged_decode_attention", &paged_decode_attention);
  m.def("rms_norm", &rms_norm);                   // RMSNorm over the last dim (fp32 or bf16)
  m.def("add_rms_norm", &add_rms_norm);           // residual add, then RMSNorm: (normed, sum)
  m.def("silu_and_mul", &silu_and_mul);           // silu(gate) * up of a [T, 2I] tensor
  m.def("rope", &rope);                           // rotate-half RoPE, sign-folded sin table
  m.def("write_kv", &write_kv);                   // this step's K/V into their pool slots
  m.def("decode_layers", &decode_layers);         // up to 256 decode rows through every layer
  m.def("dequantize", &dequantize);               // packed weight [N, row bytes] -> fp32 [N, K]
  m.def("qlinear", &qlinear);                     // x [M, K] @ packed weight^T -> [M, N]
  m.def("set_onednn_slices", &set_onednn_slices);  // fp32 slices through oneDNN
  m.def("set_packed_rows", &set_packed_rows);     // the most rows qlinear keeps packed
  m.def("qembedding", &qembedding);               // rows of a packed table -> [T, K]
  m.def("bf16c_gemv", &bf16c_gemv);               // x [1, K] bf16 @ bf16c weight^T (+ bias)
  m.def("widened_linear", &widened_linear);       // x fp32 [M, K] @ bf16 weight^T, in fp32
  m.def("a8_quantize", &a8_quantize);             // fp32 [M, K] -> (int8 [M, K_pad], scales)
  m.def("a8_round_trip", &a8_round_trip);         // x through its 8-bit blocks and back
  m.def("a8_embedding", &a8_embedding);           // rows of a tiled packed table -> [T, K]
  m.def("gemv", &gemv);                           // x [1, K] @ weight [N, K]^T (+ bias)
  m.def("small_m_linear", &small_m_linear);       // x [M <= 16, K] @ weight [N, K]^T (+ bias)
  m.def("qgemv", &qgemv);                         // x [1, K] fp32 @ packed weight^T
  m.def("bf16c_stream", &bf16c_stream);           // bf16c_gemv streams the packed rows
  m.def("isa", &isa);                             // the ISA macros this build saw
#ifdef __AVX512F__
  // Causal prefill attention for a step's chunks, read from the pool.
  m.def("paged_prefill_attention", &paged_prefill_attention);
#endif
  if (bf16c_in_registers())
    m.def("bf16c_fast", &bf16c_fast);             // bf16c_gemv streams the packed rows here
#if defined(__AVX512F__) && defined(__AVX512VNNI__) && defined(__AVX512BW__)
  // 8-bit activations @ tiled weight^T: VNNI, or AMX-INT8 for several rows (amx: 1 forces
  // it where the CPU has it, 0 VNNI, -1 by the rows).
  m.def("a8_linear(Tensor x, Tensor w, int fmt, int amx=-1) -> Tensor", &a8_linear);
  m.def("a8_amx", &a8_amx);                       // whether a8_linear can run AMX-INT8 here
#endif
}
