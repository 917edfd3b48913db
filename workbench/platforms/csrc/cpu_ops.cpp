// The decoder's small ops on the CPU, fp32 (platforms/cpu_ops.py), built into the same module
// as the paged decode attention (cpu_attention.cpp registers them).
// At batch 1 a layer's four GEMVs read its weights at memory bandwidth, and the ops between
// them (two RMSNorms with their residual adds, RoPE, the KV write, SiLU-and-mul) cost more in
// dispatch than in arithmetic: five to eight aten ops each in plain torch. Each is one call
// here, with torch's arithmetic in torch's order: the residual add, RoPE and the KV write
// are bitwise torch's (no FMA contraction, below); a norm's sum of squares is added in
// another order and SiLU's exp is libmvec's, so those differ from torch by an ulp or so.
// Rows run in parallel only when there are enough of them to pay for it.
#pragma GCC optimize("fp-contract=off")
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <vector>

static constexpr int64_t kRowGrain = 16;

static inline void rms_row(const float* __restrict x, const float* __restrict w, float eps,
                           float* __restrict out, int64_t d) {
  float ss = 0.f;
#pragma omp simd reduction(+ : ss)
  for (int64_t i = 0; i < d; ++i) ss += x[i] * x[i];
  const float r = 1.f / std::sqrt(ss / static_cast<float>(d) + eps);
#pragma omp simd
  for (int64_t i = 0; i < d; ++i) out[i] = w[i] * (x[i] * r);
}

// x: [..., D] -> weight * (x * rsqrt(mean(x^2) + eps)), a new contiguous tensor.
torch::Tensor rms_norm(torch::Tensor x, torch::Tensor weight, double eps) {
  TORCH_CHECK(x.scalar_type() == torch::kFloat32, "rms_norm: fp32 only");
  x = x.contiguous();
  const int64_t d = x.size(-1), rows = x.numel() / d;
  auto out = torch::empty_like(x);
  const float* xp = x.data_ptr<float>();
  const float* wp = weight.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const float e = static_cast<float>(eps);
  at::parallel_for(0, rows, kRowGrain, [&](int64_t b, int64_t end) {
    for (int64_t t = b; t < end; ++t) rms_row(xp + t * d, wp, e, op + t * d, d);
  });
  return out;
}

// x, residual: [T, D] -> (RMSNorm(x + residual), x + residual).
std::vector<torch::Tensor> add_rms_norm(torch::Tensor x, torch::Tensor residual,
                                        torch::Tensor weight, double eps) {
  TORCH_CHECK(x.scalar_type() == torch::kFloat32, "add_rms_norm: fp32 only");
  x = x.contiguous();
  residual = residual.contiguous();
  const int64_t d = x.size(-1), rows = x.numel() / d;
  auto sum = torch::empty_like(x);
  auto out = torch::empty_like(x);
  const float* xp = x.data_ptr<float>();
  const float* rp = residual.data_ptr<float>();
  const float* wp = weight.data_ptr<float>();
  float* sp = sum.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const float e = static_cast<float>(eps);
  at::parallel_for(0, rows, kRowGrain, [&](int64_t b, int64_t end) {
    for (int64_t t = b; t < end; ++t) {
      float* s = sp + t * d;
#pragma omp simd
      for (int64_t i = 0; i < d; ++i) s[i] = xp[t * d + i] + rp[t * d + i];
      rms_row(s, wp, e, op + t * d, d);
    }
  });
  return {out, sum};
}

// gate_up: [T, 2I] (gate, then up) -> silu(gate) * up, [T, I].
torch::Tensor silu_and_mul(torch::Tensor gate_up) {
  TORCH_CHECK(gate_up.scalar_type() == torch::kFloat32, "silu_and_mul: fp32 only");
  gate_up = gate_up.contiguous();
  const int64_t rows = gate_up.size(0), n = gate_up.size(1) / 2;
  auto out = torch::empty({rows, n}, gate_up.options());
  const float* gp = gate_up.data_ptr<float>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, rows, kRowGrain, [&](int64_t b, int64_t end) {
    for (int64_t t = b; t < end; ++t) {
      const float* g = gp + t * 2 * n;
      const float* u = g + n;
      float* o = op + t * n;
#pragma omp simd
      for (int64_t i = 0; i < n; ++i) o[i] = g[i] / (1.f + std::exp(-g[i])) * u[i];
    }
  });
  return out;
}

// qk: [T, Hq + Hk, D], a view whose last dim is contiguous (the model's split of qkv);
// cos, sin_signed: [T, 1, D] -> x * cos + roll(x, D/2) * sin_signed (ops.apply_rope), new.
torch::Tensor rope(torch::Tensor qk, torch::Tensor cos, torch::Tensor sin) {
  TORCH_CHECK(qk.scalar_type() == torch::kFloat32 && qk.stride(2) == 1, "rope: fp32 rows");
  cos = cos.contiguous();
  sin = sin.contiguous();
  const int64_t T = qk.size(0), H = qk.size(1), D = qk.size(2), half = D / 2;
  const int64_t st = qk.stride(0), sh = qk.stride(1);
  auto out = torch::empty({T, H, D}, qk.options());
  const float* xp = qk.data_ptr<float>();
  const float* cp = cos.data_ptr<float>();
  const float* snp = sin.data_ptr<float>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, T, kRowGrain, [&](int64_t b, int64_t end) {
    for (int64_t t = b; t < end; ++t) {
      const float* c = cp + t * D;
      const float* s = snp + t * D;
      for (int64_t h = 0; h < H; ++h) {
        const float* x = xp + t * st + h * sh;
        float* o = op + (t * H + h) * D;
#pragma omp simd
        for (int64_t i = 0; i < half; ++i) {
          const float a = x[i] * c[i], r = x[i + half] * s[i];
          o[i] = a + r;
        }
#pragma omp simd
        for (int64_t i = half; i < D; ++i) {
          const float a = x[i] * c[i], r = x[i - half] * s[i];
          o[i] = a + r;
        }
      }
    }
  });
  return out;
}

// k, v: [T, kvH, D] (views, last dim contiguous) into k_cache / v_cache
// [kvH, num_blocks, block_size, D] at slot_mapping [T] (block * block_size + offset).
void write_kv(torch::Tensor k_cache, torch::Tensor v_cache, torch::Tensor k, torch::Tensor v,
              torch::Tensor slot_mapping) {
  TORCH_CHECK(k.scalar_type() == torch::kFloat32 && k_cache.scalar_type() == torch::kFloat32 &&
              k.stride(2) == 1 && v.stride(2) == 1 && k_cache.is_contiguous() &&
              v_cache.is_contiguous(), "write_kv: fp32, contiguous rows");
  slot_mapping = slot_mapping.contiguous();
  const int64_t T = k.size(0), KVH = k.size(1), D = k.size(2);
  const int64_t slots = k_cache.size(1) * k_cache.size(2);
  const int64_t* sm = slot_mapping.data_ptr<int64_t>();
  const float* kp = k.data_ptr<float>();
  const float* vp = v.data_ptr<float>();
  float* kc = k_cache.data_ptr<float>();
  float* vc = v_cache.data_ptr<float>();
  for (int64_t t = 0; t < T; ++t) {
    TORCH_CHECK(sm[t] >= 0 && sm[t] < slots, "write_kv: slot out of range");
    for (int64_t h = 0; h < KVH; ++h) {
      std::copy_n(kp + t * k.stride(0) + h * k.stride(1), D, kc + (h * slots + sm[t]) * D);
      std::copy_n(vp + t * v.stride(0) + h * v.stride(1), D, vc + (h * slots + sm[t]) * D);
    }
  }
}

// x [1, K] @ weight [N, K]^T (+ bias) -> [1, N]: batch-1 decode's linear layers. Each of
// the two threads streams one contiguous half of the weight rows, eight rows at a time
// against the same x chunk (eight independent sums in registers). In a loop over the
// model's 121 weight matrices this read them at 28.5 GB/s where MKL's sgemv reached 26.3
// (the two cores' streaming bandwidth here is about 24-26 GB/s for a plain sum): at
// batch 1 every step reads all the weights, so that is the step's floor.
#ifdef __AVX512F__
#include <immintrin.h>

template <int R>
static inline void gemv_rows(const float* __restrict w, const float* __restrict x,
                             float* __restrict y, int64_t K) {
  __m512 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  int64_t k = 0;
  for (; k + 16 <= K; k += 16) {
    const __m512 xv = _mm512_loadu_ps(x + k);
    for (int r = 0; r < R; ++r) acc[r] = _mm512_fmadd_ps(_mm512_loadu_ps(w + r * K + k), xv, acc[r]);
  }
  if (k < K) {
    const __mmask16 m = static_cast<__mmask16>((1u << (K - k)) - 1);
    const __m512 xv = _mm512_maskz_loadu_ps(m, x + k);
    for (int r = 0; r < R; ++r)
      acc[r] = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(m, w + r * K + k), xv, acc[r]);
  }
  for (int r = 0; r < R; ++r) y[r] = _mm512_reduce_add_ps(acc[r]);
}

torch::Tensor gemv(torch::Tensor x, torch::Tensor weight, c10::optional<torch::Tensor> bias) {
  TORCH_CHECK(x.scalar_type() == torch::kFloat32 && weight.scalar_type() == torch::kFloat32 &&
              x.dim() == 2 && x.size(0) == 1 && weight.is_contiguous(), "gemv: fp32, one row");
  x = x.contiguous();
  const int64_t N = weight.size(0), K = weight.size(1);
  TORCH_CHECK(x.size(1) == K, "gemv: shapes");
  auto y = torch::empty({1, N}, x.options());
  const float* xp = x.data_ptr<float>();
  const float* wp = weight.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  constexpr int64_t R = 8;
  at::parallel_for(0, (N + R - 1) / R, 1, [&](int64_t b, int64_t e) {
    for (int64_t g = b; g < e; ++g) {
      const int64_t n = g * R;
      if (n + R <= N) {
        gemv_rows<R>(wp + n * K, xp, yp + n, K);
      } else {
        for (int64_t i = n; i < N; ++i) gemv_rows<1>(wp + i * K, xp, yp + i, K);
      }
    }
  });
  if (bias.has_value()) y.add_(*bias);
  return y;
}
#endif

// Batch-1 decode through every layer in one call: a Llama layer without biases or q/k norms
// (SmolLM2, Llama), fp32, the same kernels the model calls one by one (so the same numbers),
// without the Python between them: at batch 1 that interpreter and dispatch time, about
// 60 calls per layer, was the largest cost after reading the weights.
torch::Tensor paged_decode_attention(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                                     torch::Tensor block_tables, torch::Tensor context_lens,
                                     double scale);

torch::Tensor qlinear(torch::Tensor x, torch::Tensor w, int64_t fmt);   // cpu_quant.cpp

// fmt 0: an fp32 weight; else a packed one (cpu_quant.cpp's formats).
static torch::Tensor linear1(const torch::Tensor& x, const torch::Tensor& w, int64_t fmt) {
  if (fmt != 0) return qlinear(x, w, fmt);
#ifdef __AVX512F__
  return gemv(x, w, c10::nullopt);
#else
  return at::linear(x, w);
#endif
}

// x: layer 0's input [1, hidden]; weights: per layer input norm, qkv, o, post-attention
// norm, gate_up, down, and formats: each weight's (0: fp32, else packed); k_caches / v_caches: per layer [kvH, num_blocks, block_size, D];
// cos / sin: [1, 1, D]; block_tables, context_lens, slot_mapping: the step's (one row).
// Returns (the last layer's MLP output, the residual stream before it), as the layers do.
std::vector<torch::Tensor> decode_layers(torch::Tensor x, std::vector<torch::Tensor> weights,
                                         std::vector<int64_t> formats,
                                         std::vector<torch::Tensor> k_caches,
                                         std::vector<torch::Tensor> v_caches, torch::Tensor cos,
                                         torch::Tensor sin, torch::Tensor block_tables,
                                         torch::Tensor context_lens, torch::Tensor slot_mapping,
                                         int64_t num_heads, int64_t num_kv_heads, double eps,
                                         double scale) {
  const int64_t L = static_cast<int64_t>(k_caches.size());
  TORCH_CHECK(x.size(0) == 1 && static_cast<int64_t>(weights.size()) == 6 * L &&
              formats.size() == weights.size() &&
              static_cast<int64_t>(v_caches.size()) == L, "decode_layers: one row, six weights a layer");
  const int64_t D = k_caches[0].size(-1);
  torch::Tensor residual;
  for (int64_t l = 0; l < L; ++l) {
    const torch::Tensor* w = weights.data() + 6 * l;
    const int64_t* f = formats.data() + 6 * l;
    torch::Tensor h;
    if (l == 0) {
      residual = x;
      h = rms_norm(x, w[0], eps);
    } else {
      auto hr = add_rms_norm(x, residual, w[0], eps);
      h = hr[0];
      residual = hr[1];
    }
    auto qkv = linear1(h, w[1], f[1]).view({1, num_heads + 2 * num_kv_heads, D});
    auto qk = rope(qkv.narrow(1, 0, num_heads + num_kv_heads), cos, sin);
    auto v = qkv.narrow(1, num_heads + num_kv_heads, num_kv_heads);
    write_kv(k_caches[l], v_caches[l], qk.narrow(1, num_heads, num_kv_heads), v, slot_mapping);
    auto o = paged_decode_attention(qk.narrow(1, 0, num_heads), k_caches[l], v_caches[l],
                                    block_tables, context_lens, scale);
    auto hr = add_rms_norm(linear1(o.view({1, num_heads * D}), w[2], f[2]), residual, w[3], eps);
    residual = hr[1];
    x = linear1(silu_and_mul(linear1(hr[0], w[4], f[4])), w[5], f[5]);
  }
  return {x, residual};
}

void register_cpu_ops(pybind11::module& m) {
  m.def("rms_norm", &rms_norm, "RMSNorm over the last dim (fp32)");
  m.def("add_rms_norm", &add_rms_norm, "Residual add, then RMSNorm: (normed, sum) (fp32)");
  m.def("silu_and_mul", &silu_and_mul, "silu(gate) * up of a [T, 2I] tensor (fp32)");
  m.def("rope", &rope, "Rotate-half RoPE with a sign-folded sin table (fp32)");
  m.def("write_kv", &write_kv, "This step's K/V into their pool slots (fp32)");
  m.def("decode_layers", &decode_layers, "Batch-1 decode through every layer (fp32 Llama)");
#ifdef __AVX512F__
  m.def("gemv", &gemv, "x [1, K] @ weight [N, K]^T (+ bias), AVX-512 (fp32)");
#endif
}
