// The decoder's small ops on the CPU, fp32 or bf16 (platforms/cpu_ops.py), built into the same module
// as the paged decode attention (cpu_attention.cpp registers them).
// At batch 1 a layer's four GEMVs read its weights at memory bandwidth, and the ops between
// them (two RMSNorms with their residual adds, RoPE, the KV write, SiLU-and-mul) cost more in
// dispatch than in arithmetic: five to eight aten ops each in plain torch. Each is one call
// here, with torch's arithmetic in torch's order: the residual add, RoPE and the KV write
// are bitwise torch's (no FMA contraction, below); a norm's sum of squares is added in
// another order and SiLU's exp is libmvec's, so those differ from torch by an ulp or so.
// In bf16 each op rounds where torch's bf16 ops round (cpu_dtype.h), so the same holds.
// Rows run in parallel only when there are enough of them to pay for it.
#pragma GCC optimize("fp-contract=off")
#include "cpu_torch.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "cpu_dtype.h"

static constexpr int64_t kRowGrain = 16;

// x and the normed row in T; the sum of squares and the scaling in fp32. fp32:
// w * (x * r); bf16: bf16(w * bf16(x * r)) (ops.rms_norm rounds before the weight multiply).
template <class T>
static inline void rms_row(const T* __restrict x, const T* __restrict w, float eps,
                           T* __restrict out, int64_t d) {
  float ss = 0.f;
#pragma omp simd reduction(+ : ss)
  for (int64_t i = 0; i < d; ++i) ss += to_f(x[i]) * to_f(x[i]);
  const float r = 1.f / std::sqrt(ss / static_cast<float>(d) + eps);
#pragma omp simd
  for (int64_t i = 0; i < d; ++i) out[i] = from_f<T>(to_f(w[i]) * rnd<T>(to_f(x[i]) * r));
}

template <class T>
static void rms_norm_impl(const at::Tensor& x, const at::Tensor& weight, float e,
                          at::Tensor& out) {
  const int64_t d = x.size(-1), rows = x.numel() / d;
  const T* xp = cptr<T>(x);
  const T* wp = cptr<T>(weight);
  T* op = mptr<T>(out);
  at::parallel_for(0, rows, kRowGrain, [&](int64_t b, int64_t end) {
    for (int64_t t = b; t < end; ++t) rms_row(xp + t * d, wp, e, op + t * d, d);
  });
}

// x: [..., D] -> weight * (x * rsqrt(mean(x^2) + eps)), a new contiguous tensor.
at::Tensor rms_norm(at::Tensor x, at::Tensor weight, double eps) {
  const bool bf = is_bf16("rms_norm", {&x, &weight});
  x = x.contiguous();
  weight = weight.contiguous();
  auto out = at::empty_like(x);
  const float e = static_cast<float>(eps);
  bf ? rms_norm_impl<bf16_t>(x, weight, e, out) : rms_norm_impl<float>(x, weight, e, out);
  return out;
}

template <class T>
static void add_rms_norm_impl(const at::Tensor& x, const at::Tensor& residual,
                              const at::Tensor& weight, float e, at::Tensor& sum,
                              at::Tensor& out) {
  const int64_t d = x.size(-1), rows = x.numel() / d;
  const T* xp = cptr<T>(x);
  const T* rp = cptr<T>(residual);
  const T* wp = cptr<T>(weight);
  T* sp = mptr<T>(sum);
  T* op = mptr<T>(out);
  at::parallel_for(0, rows, kRowGrain, [&](int64_t b, int64_t end) {
    for (int64_t t = b; t < end; ++t) {
      T* s = sp + t * d;
#pragma omp simd
      for (int64_t i = 0; i < d; ++i) s[i] = from_f<T>(to_f(xp[t * d + i]) + to_f(rp[t * d + i]));
      rms_row(s, wp, e, op + t * d, d);
    }
  });
}

// x, residual: [T, D] -> (RMSNorm(x + residual), x + residual).
std::vector<at::Tensor> add_rms_norm(at::Tensor x, at::Tensor residual,
                                        at::Tensor weight, double eps) {
  const bool bf = is_bf16("add_rms_norm", {&x, &residual, &weight});
  x = x.contiguous();
  residual = residual.contiguous();
  weight = weight.contiguous();
  auto sum = at::empty_like(x);
  auto out = at::empty_like(x);
  const float e = static_cast<float>(eps);
  bf ? add_rms_norm_impl<bf16_t>(x, residual, weight, e, sum, out)
     : add_rms_norm_impl<float>(x, residual, weight, e, sum, out);
  return {out, sum};
}

// silu(g) * u; in bf16 torch stores silu(g) before the multiply. silu(g) is torch's own
// (at::silu_out into `out`): its exp is not the compiler's, and the two differ in the last
// bit now and then, which bf16's rounding turns into a whole unit (on a Sapphire Rapids VM
// one element in 60k did, and that moved a tied greedy token). The multiply is ours.
template <class T>
static void silu_and_mul_impl(const at::Tensor& gate_up, at::Tensor& out) {
  const int64_t rows = gate_up.size(0), n = gate_up.size(1) / 2;
  at::silu_out(out, gate_up.narrow(1, 0, n));
  const T* gp = cptr<T>(gate_up);
  T* op = mptr<T>(out);
  at::parallel_for(0, rows, kRowGrain, [&](int64_t b, int64_t end) {
    for (int64_t t = b; t < end; ++t) {
      const T* u = gp + t * 2 * n + n;
      T* o = op + t * n;
#pragma omp simd
      for (int64_t i = 0; i < n; ++i) o[i] = from_f<T>(to_f(o[i]) * to_f(u[i]));
    }
  });
}

// gate_up: [T, 2I] (gate, then up) -> silu(gate) * up, [T, I].
at::Tensor silu_and_mul(at::Tensor gate_up) {
  const bool bf = is_bf16("silu_and_mul", {&gate_up});
  gate_up = gate_up.contiguous();
  auto out = at::empty({gate_up.size(0), gate_up.size(1) / 2}, gate_up.options());
  bf ? silu_and_mul_impl<bf16_t>(gate_up, out) : silu_and_mul_impl<float>(gate_up, out);
  return out;
}

// x * cos + roll(x) * sin, each product stored in T before the add (torch's three ops).
template <class T>
static void rope_impl(const at::Tensor& qk, const at::Tensor& cos, const at::Tensor& sin,
                      at::Tensor& out) {
  const int64_t T_ = qk.size(0), H = qk.size(1), D = qk.size(2), half = D / 2;
  const int64_t st = qk.stride(0), sh = qk.stride(1);
  const T* xp = cptr<T>(qk);
  const T* cp = cptr<T>(cos);
  const T* snp = cptr<T>(sin);
  T* op = mptr<T>(out);
  at::parallel_for(0, T_, kRowGrain, [&](int64_t b, int64_t end) {
    for (int64_t t = b; t < end; ++t) {
      const T* c = cp + t * D;
      const T* s = snp + t * D;
      for (int64_t h = 0; h < H; ++h) {
        const T* x = xp + t * st + h * sh;
        T* o = op + (t * H + h) * D;
#pragma omp simd
        for (int64_t i = 0; i < half; ++i) {
          const float a = rnd<T>(to_f(x[i]) * to_f(c[i]));
          const float r = rnd<T>(to_f(x[i + half]) * to_f(s[i]));
          o[i] = from_f<T>(a + r);
        }
#pragma omp simd
        for (int64_t i = half; i < D; ++i) {
          const float a = rnd<T>(to_f(x[i]) * to_f(c[i]));
          const float r = rnd<T>(to_f(x[i - half]) * to_f(s[i]));
          o[i] = from_f<T>(a + r);
        }
      }
    }
  });
}

// qk: [T, Hq + Hk, D], a view whose last dim is contiguous (the model's split of qkv);
// cos, sin_signed: [T, 1, D] -> x * cos + roll(x, D/2) * sin_signed (ops.apply_rope), new.
at::Tensor rope(at::Tensor qk, at::Tensor cos, at::Tensor sin) {
  const bool bf = is_bf16("rope", {&qk, &cos, &sin});
  TORCH_CHECK(qk.stride(2) == 1, "rope: rows with a contiguous last dim");
  cos = cos.contiguous();
  sin = sin.contiguous();
  auto out = at::empty({qk.size(0), qk.size(1), qk.size(2)}, qk.options());
  bf ? rope_impl<bf16_t>(qk, cos, sin, out) : rope_impl<float>(qk, cos, sin, out);
  return out;
}

// k, v: [T, kvH, D] (views, last dim contiguous) into k_cache / v_cache
// [kvH, num_blocks, block_size, D] at slot_mapping [T] (block * block_size + offset).
void write_kv(at::Tensor k_cache, at::Tensor v_cache, at::Tensor k, at::Tensor v,
              at::Tensor slot_mapping) {
  const bool bf = is_bf16("write_kv", {&k, &v, &k_cache, &v_cache});
  TORCH_CHECK(k.stride(2) == 1 && v.stride(2) == 1 && k_cache.is_contiguous() &&
              v_cache.is_contiguous(), "write_kv: contiguous rows");
  slot_mapping = slot_mapping.contiguous();
  const int64_t T = k.size(0), KVH = k.size(1), D = k.size(2);
  const int64_t slots = k_cache.size(1) * k_cache.size(2);
  const int64_t* sm = slot_mapping.data_ptr<int64_t>();
  const int64_t es = bf ? 2 : 4;                  // a plain copy: only the element size matters
  const char* kp = static_cast<const char*>(k.data_ptr());
  const char* vp = static_cast<const char*>(v.data_ptr());
  char* kc = static_cast<char*>(k_cache.data_ptr());
  char* vc = static_cast<char*>(v_cache.data_ptr());
  for (int64_t t = 0; t < T; ++t) {
    TORCH_CHECK(sm[t] >= 0 && sm[t] < slots, "write_kv: slot out of range");
    for (int64_t h = 0; h < KVH; ++h) {
      std::memcpy(kc + (h * slots + sm[t]) * D * es, kp + (t * k.stride(0) + h * k.stride(1)) * es,
                  D * es);
      std::memcpy(vc + (h * slots + sm[t]) * D * es, vp + (t * v.stride(0) + h * v.stride(1)) * es,
                  D * es);
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
    for (int r = 0; r < R; ++r) {
      prefetch(w + (R + r) * K + k);             // the next group's same line
      acc[r] = _mm512_fmadd_ps(_mm512_loadu_ps(w + r * K + k), xv, acc[r]);
    }
  }
  if (k < K) {
    const __mmask16 m = static_cast<__mmask16>((1u << (K - k)) - 1);
    const __m512 xv = _mm512_maskz_loadu_ps(m, x + k);
    for (int r = 0; r < R; ++r)
      acc[r] = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(m, w + r * K + k), xv, acc[r]);
  }
  for (int r = 0; r < R; ++r) y[r] = _mm512_reduce_add_ps(acc[r]);
}

#endif   // __AVX512F__

#ifdef WB_BF16_X32
// bf16: the weights stream as they are stored (2 bytes each, half fp32's) and are taken 32
// at a time by Bf16X32 (cpu_dtype.h: vdpbf16ps, or widened in registers where the CPU has
// no AVX-512 BF16); one rounding to bf16 at the end, after the bias, as torch's bf16 linear.
template <int R>
static inline void gemv_rows_bf16(const bf16_t* __restrict w, const bf16_t* __restrict x,
                                  const bf16_t* __restrict bias, bf16_t* __restrict y, int64_t K) {
  __m512 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  int64_t k = 0;
  for (; k + 32 <= K; k += 32) {
    const Bf16X32 xv(x + k);
    for (int r = 0; r < R; ++r) {
      prefetch(w + (R + r) * K + k);
      acc[r] = xv.dot(acc[r], _mm512_loadu_si512(w + r * K + k));
    }
  }
  if (k < K) {
    const __mmask32 m = static_cast<__mmask32>((1ull << (K - k)) - 1);
    const Bf16X32 xv(x + k, m);
    for (int r = 0; r < R; ++r)
      acc[r] = xv.dot(acc[r], _mm512_maskz_loadu_epi16(m, w + r * K + k));
  }
  for (int r = 0; r < R; ++r)
    y[r] = to_bf16(_mm512_reduce_add_ps(acc[r]) + (bias ? to_f(bias[r]) : 0.f));
}
#endif   // WB_BF16_X32

at::Tensor gemv(at::Tensor x, at::Tensor weight, c10::optional<at::Tensor> bias) {
  const bool bf = is_bf16("gemv", {&x, &weight});
  TORCH_CHECK(x.dim() == 2 && x.size(0) == 1 && weight.dim() == 2 && weight.is_contiguous(),
              "gemv: one row, a contiguous weight");
  x = x.contiguous();
  const int64_t N = weight.size(0), K = weight.size(1);
  TORCH_CHECK(x.size(1) == K, "gemv: shapes");
  auto y = at::empty({1, N}, x.options());
  [[maybe_unused]] constexpr int64_t R = 8;
  if (bf) {
    at::Tensor b;
    if (bias.has_value()) {
      b = bias->contiguous();
      TORCH_CHECK(b.scalar_type() == at::kBFloat16 && b.numel() == N, "gemv: bias");
    }
    const bf16_t* xp = cptr<bf16_t>(x);
    const bf16_t* wp = cptr<bf16_t>(weight);
    const bf16_t* bp = b.defined() ? cptr<bf16_t>(b) : nullptr;
    bf16_t* yp = mptr<bf16_t>(y);
#ifdef WB_BF16_X32
    at::parallel_for(0, (N + R - 1) / R, 1, [&](int64_t g0, int64_t e) {
      for (int64_t g = g0; g < e; ++g) {
        const int64_t n = g * R;
        if (n + R <= N) {
          gemv_rows_bf16<R>(wp + n * K, xp, bp ? bp + n : nullptr, yp + n, K);
        } else {
          for (int64_t i = n; i < N; ++i)
            gemv_rows_bf16<1>(wp + i * K, xp, bp ? bp + i : nullptr, yp + i, K);
        }
      }
    });
#else
    TORCH_CHECK(K % 2 == 0, "gemv: bf16 rows of even length");
    portable_gemv_bf16(N, K, xp, [&](int64_t n, bf16_t*) {
      prefetch_bytes(wp + (n + 4) * K, K * sizeof(bf16_t));   // row n's in the next group
      return wp + n * K;
    },
                       [&](int64_t n, float v) { yp[n] = to_bf16(v + (bp ? to_f(bp[n]) : 0.f)); });
#endif
    return y;
  }
  const float* xp = x.data_ptr<float>();
  const float* wp = weight.data_ptr<float>();
  float* yp = y.data_ptr<float>();
#ifdef __AVX512F__
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
#else
  portable_gemv(N, K, xp, wp, [&](int64_t n, float v) { yp[n] = v; });
#endif
  if (bias.has_value()) y.add_(*bias);
  return y;
}

#include "cpu_small_m.h"

at::Tensor small_m_linear(at::Tensor x, at::Tensor weight, c10::optional<at::Tensor> bias) {
  const bool bf = is_bf16("small_m_linear", {&x, &weight});
  TORCH_CHECK(x.dim() == 2 && x.size(0) >= 1 && x.size(0) <= kSmallM && weight.dim() == 2 &&
              weight.is_contiguous(), "small_m_linear: 1 to ", kSmallM,
              " rows, a contiguous weight");
  x = x.contiguous();
  const int64_t M = x.size(0), N = weight.size(0), K = weight.size(1);
  TORCH_CHECK(x.size(1) == K, "small_m_linear: shapes");
  at::Tensor b;
  if (bias.has_value()) {
    b = bias->contiguous();
    TORCH_CHECK(b.scalar_type() == x.scalar_type() && b.numel() == N, "small_m_linear: bias");
  }
  auto y = at::empty({M, N}, x.options());
  if (bf) {
    const bf16_t* xp = cptr<bf16_t>(x);
    const bf16_t* wp = cptr<bf16_t>(weight);
    const bf16_t* bp = b.defined() ? cptr<bf16_t>(b) : nullptr;
    bf16_t* yp = mptr<bf16_t>(y);
    std::vector<float> xf(M * K);
    widen_bf16(xp, xf.data(), M * K);
    small_m_gemm(M, N, K, xf.data(), [&](int64_t n, int64_t rows, float* buf) {
      widen_bf16(wp + n * K, buf, rows * K);
      return static_cast<const float*>(buf);
    }, [&](int64_t m, int64_t n, float v) { yp[m * N + n] = to_bf16(v + (bp ? to_f(bp[n]) : 0.f)); });
    return y;
  }
  const float* xp = x.data_ptr<float>();
  const float* wp = weight.data_ptr<float>();
  const float* bp = b.defined() ? b.data_ptr<float>() : nullptr;
  float* yp = y.data_ptr<float>();
  small_m_gemm(M, N, K, xp, [&](int64_t n, int64_t, float*) { return wp + n * K; },
               [&](int64_t m, int64_t n, float v) { yp[m * N + n] = bp ? v + bp[n] : v; });
  return y;
}

// A decode step through every layer in one call: a Llama layer without biases or q/k norms
// (SmolLM2, Llama), fp32 or bf16, the same kernels the model calls one by one (so the same
// numbers), without the Python between them: at batch 1 that interpreter and dispatch time,
// about 60 calls per layer, was the largest cost after reading the weights. Up to
// kDecodeRows rows, each a decode with its own block table and length: a small batch, or a speculative
// verify step's k + 1 tokens (each its chunk's table and its own causal length: the K/V of
// every row is written before any row attends).
at::Tensor paged_decode_attention(at::Tensor q, at::Tensor k_cache, at::Tensor v_cache,
                                     at::Tensor block_tables, at::Tensor context_lens,
                                     double scale);

at::Tensor qlinear(at::Tensor x, at::Tensor w, int64_t fmt);   // cpu_quant.cpp

// The most rows decode_layers takes (cpu_ops.DECODE_ROWS): a batch of decodes, or verify
// steps' drafts with them. Dense weights take small_m_linear, so at most kSmallM rows.
static constexpr int64_t kDecodeRows = 256;

// fmt 0: a dense weight (fp32, or bf16 in a bf16 model); else a packed one (cpu_quant.cpp's
// formats). CpuOps.linear's choice for the same rows (the caller checks that it is this one).
static at::Tensor linear1(const at::Tensor& x, const at::Tensor& w, int64_t fmt) {
  if (fmt != 0) return qlinear(x, w, fmt);
  if (x.size(0) > 1) return small_m_linear(x, w, c10::nullopt);
  return gemv(x, w, c10::nullopt);
}

// x: layer 0's input [M, hidden]; weights: per layer input norm, qkv, o, post-attention
// norm, gate_up, down, and formats: each weight's (0: dense, else packed); k_caches /
// v_caches: per layer [kvH, num_blocks, block_size, D]; cos / sin: [M, 1, D]; block_tables
// [M, width], context_lens [M], slot_mapping [M]: each row's. Returns (the last layer's MLP
// output, the residual stream before it), as the layers do.
std::vector<at::Tensor> decode_layers(at::Tensor x, std::vector<at::Tensor> weights,
                                         std::vector<int64_t> formats,
                                         std::vector<at::Tensor> k_caches,
                                         std::vector<at::Tensor> v_caches, at::Tensor cos,
                                         at::Tensor sin, at::Tensor block_tables,
                                         at::Tensor context_lens, at::Tensor slot_mapping,
                                         int64_t num_heads, int64_t num_kv_heads, double eps,
                                         double scale) {
  const int64_t L = static_cast<int64_t>(k_caches.size());
  const int64_t M = x.size(0);
  TORCH_CHECK(M >= 1 && M <= kDecodeRows && static_cast<int64_t>(weights.size()) == 6 * L &&
              formats.size() == weights.size() &&
              static_cast<int64_t>(v_caches.size()) == L,
              "decode_layers: 1 to ", kDecodeRows, " rows, six weights a layer");
  const int64_t D = k_caches[0].size(-1);
  at::Tensor residual;
  for (int64_t l = 0; l < L; ++l) {
    const at::Tensor* w = weights.data() + 6 * l;
    const int64_t* f = formats.data() + 6 * l;
    at::Tensor h;
    if (l == 0) {
      residual = x;
      h = rms_norm(x, w[0], eps);
    } else {
      auto hr = add_rms_norm(x, residual, w[0], eps);
      h = hr[0];
      residual = hr[1];
    }
    auto qkv = linear1(h, w[1], f[1]).view({M, num_heads + 2 * num_kv_heads, D});
    auto qk = rope(qkv.narrow(1, 0, num_heads + num_kv_heads), cos, sin);
    auto v = qkv.narrow(1, num_heads + num_kv_heads, num_kv_heads);
    write_kv(k_caches[l], v_caches[l], qk.narrow(1, num_heads, num_kv_heads), v, slot_mapping);
    auto o = paged_decode_attention(qk.narrow(1, 0, num_heads), k_caches[l], v_caches[l],
                                    block_tables, context_lens, scale);
    auto hr = add_rms_norm(linear1(o.view({M, num_heads * D}), w[2], f[2]), residual, w[3], eps);
    residual = hr[1];
    x = linear1(silu_and_mul(linear1(hr[0], w[4], f[4])), w[5], f[5]);
  }
  return {x, residual};
}
