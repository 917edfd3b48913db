// Paged decode attention for the CPU, fp32: one query token per request, attending over its
// context straight from the head-major KV pool [kv_heads, num_blocks, block_size, head_dim].
//
// The plain-torch path must first copy every request's context out of the pool (index_select)
// and then read that copy again in two batched matmuls: three passes over the K/V bytes.
// Here each (request, kv head) pair walks its block table and reads each K and V row once,
// for all G query heads that share the KV head, which is what bounds decode on a CPU.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <vector>

static inline float dot(const float* __restrict a, const float* __restrict b, int64_t n) {
  float s = 0.f;
#pragma omp simd reduction(+ : s)
  for (int64_t i = 0; i < n; ++i) s += a[i] * b[i];
  return s;
}

static inline void axpy(float a, const float* __restrict x, float* __restrict y, int64_t n) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) y[i] += a * x[i];
}

// q: [B, H, D]; k_cache/v_cache: [kvH, num_blocks, block_size, D];
// block_tables: [B, max_blocks] int64; context_lens: [B] int64. Returns [B, H, D].
torch::Tensor paged_decode_attention(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                                     torch::Tensor block_tables, torch::Tensor context_lens,
                                     double scale) {
  TORCH_CHECK(q.scalar_type() == torch::kFloat32 && k_cache.scalar_type() == torch::kFloat32,
              "paged_decode_attention: fp32 only");
  q = q.contiguous();
  block_tables = block_tables.contiguous();
  context_lens = context_lens.contiguous();
  const int64_t B = q.size(0), H = q.size(1), D = q.size(2);
  const int64_t KVH = k_cache.size(0), NB = k_cache.size(1), BS = k_cache.size(2);
  const int64_t G = H / KVH, MAXB = block_tables.size(1);
  auto out = torch::zeros_like(q);
  const float* qp = q.data_ptr<float>();
  const float* kp = k_cache.data_ptr<float>();
  const float* vp = v_cache.data_ptr<float>();
  const int64_t* bt = block_tables.data_ptr<int64_t>();
  const int64_t* lens = context_lens.data_ptr<int64_t>();
  float* op = out.data_ptr<float>();
  const float fscale = static_cast<float>(scale);

  at::parallel_for(0, B * KVH, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores;
    for (int64_t idx = begin; idx < end; ++idx) {
      const int64_t b = idx / KVH, h = idx % KVH, L = lens[b];
      scores.assign(G * L, 0.f);
      const float* qb = qp + (b * H + h * G) * D;
      // Walk the block table block by block: no per-token division or table lookup.
      for (int64_t t0 = 0, i = 0; t0 < L; t0 += BS, ++i) {
        const float* kblk = kp + (h * NB + bt[b * MAXB + i]) * BS * D;
        const int64_t n = std::min(BS, L - t0);
        for (int64_t j = 0; j < n; ++j) {
          const float* krow = kblk + j * D;
          for (int64_t g = 0; g < G; ++g) scores[g * L + t0 + j] = dot(qb + g * D, krow, D) * fscale;
        }
      }
      for (int64_t g = 0; g < G; ++g) {
        float* s = scores.data() + g * L;
        // Only real context positions are visited: no -inf anywhere, so the max starts at s[0].
        float m = s[0];
        for (int64_t t = 1; t < L; ++t) m = std::max(m, s[t]);
        float sum = 0.f;
#pragma omp simd reduction(+ : sum)
        for (int64_t t = 0; t < L; ++t) { s[t] = std::exp(s[t] - m); sum += s[t]; }
        const float inv = 1.f / sum;
#pragma omp simd
        for (int64_t t = 0; t < L; ++t) s[t] *= inv;
      }
      float* ob = op + (b * H + h * G) * D;
      for (int64_t t0 = 0, i = 0; t0 < L; t0 += BS, ++i) {
        const float* vblk = vp + (h * NB + bt[b * MAXB + i]) * BS * D;
        const int64_t n = std::min(BS, L - t0);
        for (int64_t j = 0; j < n; ++j) {
          const float* vrow = vblk + j * D;
          for (int64_t g = 0; g < G; ++g) axpy(scores[g * L + t0 + j], vrow, ob + g * D, D);
        }
      }
    }
  });
  return out;
}


// The decoder's small ops (cpu_ops.cpp), in the same module.
void register_cpu_ops(pybind11::module& m);
void register_cpu_quant(pybind11::module& m);
void register_cpu_a8(pybind11::module& m);

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_decode_attention", &paged_decode_attention,
        "Paged decode attention over a head-major fp32 KV pool (CPU)");
  register_cpu_ops(m);
  register_cpu_quant(m);
  register_cpu_a8(m);
}
