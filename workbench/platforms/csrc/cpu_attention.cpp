// Paged decode attention for the CPU, fp32 or bf16: one query token per request, attending over its
// context straight from the head-major KV pool [kv_heads, num_blocks, block_size, head_dim].
//
// The plain-torch path must first copy every request's context out of the pool (index_select)
// and then read that copy again in two batched matmuls: three passes over the K/V bytes.
// Here each (request, kv head) pair walks its block table and reads each K and V row once,
// for all G query heads that share the KV head, which is what bounds decode on a CPU.
#include "cpu_torch.h"

#include <algorithm>
#include <cmath>
#include <type_traits>
#include <vector>

#include "cpu_dtype.h"

// Head sizes that are a multiple of 16 (C vectors of 16 lanes; C = 0: any other size, plain
// loops): a query row stays in registers against each K row, and each query head's output
// row in C registers across its whole context, instead of a load and store a V row.
#ifdef __AVX512F__
#include <immintrin.h>
static inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
static inline __m512 load16(const bf16_t* p) {
  const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}
static constexpr int kMaxC = 8;
#else
static constexpr int kMaxC = 0;
#endif

template <class T, int C>
static inline float dot(const float* __restrict a, const T* __restrict b, int64_t n) {
#ifdef __AVX512F__
  if constexpr (C > 0) {
    __m512 acc = _mm512_mul_ps(_mm512_loadu_ps(a), load16(b));
    for (int c = 1; c < C; ++c) acc = _mm512_fmadd_ps(_mm512_loadu_ps(a + 16 * c), load16(b + 16 * c), acc);
    return _mm512_reduce_add_ps(acc);
  }
#endif
  float s = 0.f;
#pragma omp simd reduction(+ : s)
  for (int64_t i = 0; i < n; ++i) s += a[i] * to_f(b[i]);
  return s;
}

// fp32: softmax(q . k * scale) v. bf16 rounds where the torch reference (attention.py
// decode_attention: q * scale, a bf16 baddbmm, softmax in fp32 stored in bf16, a bf16 bmm)
// stores bf16: the scaled query, each score, each probability and the output; every sum
// runs in fp32. Reading a bf16 pool halves the bytes.
template <class T, int C>
static void decode_impl(const at::Tensor& q, const at::Tensor& k_cache,
                        const at::Tensor& v_cache, const at::Tensor& block_tables,
                        const at::Tensor& context_lens, float fscale, at::Tensor& out) {
  constexpr bool kBf16 = std::is_same<T, bf16_t>::value;
  const int64_t B = q.size(0), H = q.size(1), D = q.size(2);
  const int64_t KVH = k_cache.size(0), NB = k_cache.size(1), BS = k_cache.size(2);
  const int64_t G = H / KVH, MAXB = block_tables.size(1);
  const T* qp = cptr<T>(q);
  const T* kp = cptr<T>(k_cache);
  const T* vp = cptr<T>(v_cache);
  const int64_t* bt = block_tables.data_ptr<int64_t>();
  const int64_t* lens = context_lens.data_ptr<int64_t>();
  T* op = mptr<T>(out);

  at::parallel_for(0, B * KVH, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores, qs(G * D), acc(G * D);
    for (int64_t idx = begin; idx < end; ++idx) {
      const int64_t b = idx / KVH, h = idx % KVH, L = lens[b];
      scores.resize(G * L);
      const T* qb = qp + (b * H + h * G) * D;
      for (int64_t i = 0; i < G * D; ++i)
        qs[i] = kBf16 ? rnd<T>(to_f(qb[i]) * fscale) : to_f(qb[i]);
      const int64_t* table = bt + b * MAXB;
      // Walk the block table block by block: no per-token division or table lookup.
      for (int64_t t0 = 0, i = 0; t0 < L; t0 += BS, ++i) {
        const T* kblk = kp + (h * NB + table[i]) * BS * D;
        const int64_t n = std::min(BS, L - t0);
        for (int64_t j = 0; j < n; ++j) {
          const T* krow = kblk + j * D;
          for (int64_t g = 0; g < G; ++g) {
            const float d = dot<T, C>(qs.data() + g * D, krow, D);
            scores[g * L + t0 + j] = kBf16 ? rnd<T>(d) : d * fscale;
          }
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
        for (int64_t t = 0; t < L; ++t) s[t] = rnd<T>(s[t] * inv);
      }
      T* ob = op + (b * H + h * G) * D;
#ifdef __AVX512F__
      if constexpr (C > 0) {
        for (int64_t g = 0; g < G; ++g) {
          const float* p = scores.data() + g * L;
          __m512 o[C];
          for (int c = 0; c < C; ++c) o[c] = _mm512_setzero_ps();
          for (int64_t t0 = 0, i = 0; t0 < L; t0 += BS, ++i) {
            const T* vblk = vp + (h * NB + table[i]) * BS * D;
            const int64_t n = std::min(BS, L - t0);
            for (int64_t j = 0; j < n; ++j) {
              const __m512 pj = _mm512_set1_ps(p[t0 + j]);
              for (int c = 0; c < C; ++c) o[c] = _mm512_fmadd_ps(pj, load16(vblk + j * D + 16 * c), o[c]);
            }
          }
          for (int c = 0; c < C; ++c) _mm512_storeu_ps(acc.data() + g * D + 16 * c, o[c]);
        }
        for (int64_t i = 0; i < G * D; ++i) ob[i] = from_f<T>(acc[i]);
        continue;
      }
#endif
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t t0 = 0, i = 0; t0 < L; t0 += BS, ++i) {
        const T* vblk = vp + (h * NB + table[i]) * BS * D;
        const int64_t n = std::min(BS, L - t0);
        for (int64_t j = 0; j < n; ++j) {
          const T* vrow = vblk + j * D;
          for (int64_t g = 0; g < G; ++g) {
            const float a = scores[g * L + t0 + j];
            float* y = acc.data() + g * D;
#pragma omp simd
            for (int64_t e = 0; e < D; ++e) y[e] += a * to_f(vrow[e]);
          }
        }
      }
      for (int64_t i = 0; i < G * D; ++i) ob[i] = from_f<T>(acc[i]);
    }
  });
}

template <class T>
static void decode_dispatch(const at::Tensor& q, const at::Tensor& k_cache,
                            const at::Tensor& v_cache, const at::Tensor& block_tables,
                            const at::Tensor& context_lens, float fscale, at::Tensor& out) {
  const int64_t D = q.size(2);
  const int64_t C = (D % 16 == 0 && D / 16 <= kMaxC) ? D / 16 : 0;
  switch (C) {
#define WB_CASE(c) case c: return decode_impl<T, c>(q, k_cache, v_cache, block_tables, context_lens, fscale, out);
#ifdef __AVX512F__
    WB_CASE(1) WB_CASE(2) WB_CASE(3) WB_CASE(4) WB_CASE(5) WB_CASE(6) WB_CASE(7) WB_CASE(8)
#endif
#undef WB_CASE
    default: return decode_impl<T, 0>(q, k_cache, v_cache, block_tables, context_lens, fscale, out);
  }
}

// q: [B, H, D]; k_cache/v_cache: [kvH, num_blocks, block_size, D], fp32 or bf16 as q;
// block_tables: [B, max_blocks] int64; context_lens: [B] int64. Returns [B, H, D].
at::Tensor paged_decode_attention(at::Tensor q, at::Tensor k_cache, at::Tensor v_cache,
                                     at::Tensor block_tables, at::Tensor context_lens,
                                     double scale) {
  const bool bf = is_bf16("paged_decode_attention", {&q, &k_cache, &v_cache});
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(),
              "paged_decode_attention: a contiguous pool");
  q = q.contiguous();
  block_tables = block_tables.contiguous();
  context_lens = context_lens.contiguous();
  auto out = at::empty_like(q);
  const float fscale = static_cast<float>(scale);
  bf ? decode_dispatch<bf16_t>(q, k_cache, v_cache, block_tables, context_lens, fscale, out)
     : decode_dispatch<float>(q, k_cache, v_cache, block_tables, context_lens, fscale, out);
  return out;
}
