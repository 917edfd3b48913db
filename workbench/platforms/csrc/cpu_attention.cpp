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

// Causal prefill attention for the CPU, every prefill chunk of a step in one call, straight
// from the pool (a chunk's own K/V are written before attention runs, so a cached prefix
// and the chunk's tokens are read alike). Query i of a chunk of n tokens whose context is L
// tokens sits at position L - n + i and attends keys 0 .. L - n + i.
//
// torch's scaled_dot_product_attention, called once a chunk, ran at 2-15 GFLOP/s here (its
// per-call work and GQA expansion dominate at these lengths), and a cached prefix first had
// to be gathered out of the pool. Here one work item is (chunk, kv head, 16 query positions):
// its G * 16 query rows share every K and V row it reads. Scores: W keys at a time (a
// vector's lanes), their K rows transposed into a [D, W] tile, so each query row's W scores
// are D fused multiply-adds into one register (a broadcast query element times a tile row),
// 8 rows at once. Softmax per row over exactly its causal keys; then P.V with NR rows'
// outputs held in registers while the keys stream by. Items are handed out longest first
// from a shared counter, as causal items differ in length.
//
// fp32 runs in fp32 (torch's reference too: they differ in the order of fp32 sums). bf16
// runs in fp64 and rounds only the output, as the reference does on the CPU (attention.py
// prefill_attention): a product of two bf16 numbers is exact in fp64 and so, in practice,
// is a head's dot product, so the two compute the same scores and differ by about 1e-16 of
// each output before it is rounded to bf16's 2^-8. In fp32 they differed in about 3 of
// 10,000 outputs by one bf16 unit, enough to flip a greedy token where the top two logits
// tie in bf16 (test_cpu_bf16).
#ifdef __AVX512F__
#include <atomic>

namespace {
struct PrefillItem {
  int64_t req, head, first, count, cost;
};
template <class A> struct Lanes;
template <> struct Lanes<float> { typedef float V __attribute__((vector_size(64))); };
template <> struct Lanes<double> { typedef double V __attribute__((vector_size(64))); };
// Unaligned vector load and store, by value, so the vectors they move stay in registers.
template <class V, class A> static inline V loadu(const A* p) {
  V v;
  std::memcpy(&v, p, sizeof(V));
  return v;
}
template <class V, class A> static inline void storeu(A* p, V v) { std::memcpy(p, &v, sizeof(V)); }
}  // namespace

template <class T, class A, int C>
static void prefill_impl(const at::Tensor& q, const at::Tensor& k_cache,
                         const at::Tensor& v_cache, const at::Tensor& block_tables,
                         const at::Tensor& query_start, const at::Tensor& context_lens,
                         double scale, at::Tensor& out) {
  using V = typename Lanes<A>::V;
  constexpr int64_t D = 16 * C, QB = 16, W = 64 / sizeof(A), CW = D / W;
  // P.V holds NR rows times CB vectors of output columns in registers (CW / CB passes).
  constexpr int64_t CB = CW % 4 == 0 ? 4 : (CW % 3 == 0 ? 3 : (CW % 2 == 0 ? 2 : 1));
  constexpr int NR = CB <= 2 ? 8 : 4;
  const int64_t H = q.size(1), KVH = k_cache.size(0), NB = k_cache.size(1);
  const int64_t BS = k_cache.size(2), G = H / KVH, MAXB = block_tables.size(1);
  const int64_t R = context_lens.size(0);
  const T* qp = cptr<T>(q);
  const T* kp = cptr<T>(k_cache);
  const T* vp = cptr<T>(v_cache);
  const int64_t* bt = block_tables.data_ptr<int64_t>();
  const int64_t* qs = query_start.data_ptr<int64_t>();
  const int64_t* lens = context_lens.data_ptr<int64_t>();
  T* op = mptr<T>(out);
  const A ascale = static_cast<A>(scale);

  std::vector<PrefillItem> items;
  for (int64_t r = 0; r < R; ++r) {
    const int64_t n = qs[r + 1] - qs[r], start = lens[r] - n;
    for (int64_t h = 0; h < KVH; ++h)
      for (int64_t i0 = 0; i0 < n; i0 += QB) {
        const int64_t cnt = std::min(QB, n - i0);
        items.push_back({r, h, i0, cnt, cnt * (start + i0 + cnt)});
      }
  }
  std::sort(items.begin(), items.end(),
            [](const PrefillItem& a, const PrefillItem& b) { return a.cost > b.cost; });
  std::atomic<int64_t> next{0};
  const int64_t num_items = static_cast<int64_t>(items.size());

  at::parallel_for(0, at::get_num_threads(), 1, [&](int64_t, int64_t) {
    std::vector<A> qf, sc, vf, kt(D * W);
    for (int64_t idx; (idx = next.fetch_add(1)) < num_items;) {
      const PrefillItem& it = items[idx];
      const int64_t n = qs[it.req + 1] - qs[it.req], p0 = lens[it.req] - n + it.first;
      const int64_t M = it.count * G, Mpad = (M + 7) / 8 * 8;      // row m: position m / G
      const int64_t K = p0 + it.count, Kpad = (K + W - 1) / W * W;
      const int64_t* table = bt + it.req * MAXB;
      qf.assign(Mpad * D, A(0));
      sc.resize(Mpad * Kpad);    // every score a row reads is written below (finite elsewhere)
      vf.resize(K * D);
      for (int64_t m = 0; m < M; ++m) {
        const T* src = qp + ((qs[it.req] + it.first + m / G) * H + it.head * G + m % G) * D;
        for (int64_t e = 0; e < D; ++e) qf[m * D + e] = to_f(src[e]);
      }
      // Scores, W keys at a time (rows before those keys are skipped, 8 at a time).
      for (int64_t c0 = 0; c0 < K; c0 += W) {
        const int64_t kc = std::min(W, K - c0);
        for (int64_t l = 0; l < W; ++l) {
          const T* krow = l < kc ? kp + ((it.head * NB + table[(c0 + l) / BS]) * BS + (c0 + l) % BS) * D
                                 : nullptr;
          for (int64_t e = 0; e < D; ++e) kt[e * W + l] = krow ? to_f(krow[e]) : A(0);
        }
        for (int64_t m0 = 0; m0 < Mpad; m0 += 8) {
          if (p0 + (m0 + 7) / G < c0) continue;
          V acc[8];
          for (int j = 0; j < 8; ++j) acc[j] = V{};
          const A* qrow = qf.data() + m0 * D;
          for (int64_t e = 0; e < D; ++e) {
            const V kv = loadu<V>(kt.data() + e * W);
            for (int j = 0; j < 8; ++j) acc[j] += qrow[j * D + e] * kv;
          }
          for (int j = 0; j < 8; ++j) storeu(sc.data() + (m0 + j) * Kpad + c0, acc[j] * ascale);
        }
      }
      // Softmax over each row's causal keys; zeros after them, so P.V can run to K.
      for (int64_t m = 0; m < M; ++m) {
        A* s = sc.data() + m * Kpad;
        const int64_t L = p0 + m / G + 1;
        A mx = s[0];
        for (int64_t t = 1; t < L; ++t) mx = std::max(mx, s[t]);
        A sum = 0;
#pragma omp simd reduction(+ : sum)
        for (int64_t t = 0; t < L; ++t) { s[t] = std::exp(s[t] - mx); sum += s[t]; }
        const A inv = A(1) / sum;
#pragma omp simd
        for (int64_t t = 0; t < L; ++t) s[t] *= inv;
        for (int64_t t = L; t < Kpad; ++t) s[t] = 0;
      }
      // The item's V rows [0, K) out of the pool, in A: a P.V pass reads each of them once
      // per NR rows, converted once here.
      for (int64_t t0 = 0, b = 0; t0 < K; t0 += BS, ++b) {
        const T* vblk = vp + (it.head * NB + table[b]) * BS * D;
        const int64_t nk = std::min(BS, K - t0);
        A* dst = vf.data() + t0 * D;
#pragma omp simd
        for (int64_t i = 0; i < nk * D; ++i) dst[i] = to_f(vblk[i]);
      }
      // P.V: NR rows times CB vectors of their outputs in registers while the keys stream by.
      for (int64_t c0 = 0; c0 < CW; c0 += CB)
        for (int64_t m0 = 0; m0 < M; m0 += NR) {
          const int64_t kend = std::min(K, p0 + (std::min<int64_t>(m0 + NR, M) - 1) / G + 1);
          V acc[NR][CB];
          for (int j = 0; j < NR; ++j)
            for (int c = 0; c < CB; ++c) acc[j][c] = V{};
          const A* p = sc.data() + m0 * Kpad;
          const A* vrow = vf.data() + c0 * W;
          for (int64_t t = 0; t < kend; ++t, vrow += D) {
            V v[CB];
            for (int c = 0; c < CB; ++c) v[c] = loadu<V>(vrow + c * W);
            for (int r = 0; r < NR; ++r) {
              const A pr = p[r * Kpad + t];
              for (int c = 0; c < CB; ++c) acc[r][c] += pr * v[c];
            }
          }
          for (int r = 0; r < NR && m0 + r < M; ++r) {
            const int64_t m = m0 + r;
            T* dst = op + ((qs[it.req] + it.first + m / G) * H + it.head * G + m % G) * D + c0 * W;
            A row[CB * W];
            for (int c = 0; c < CB; ++c) storeu(row + c * W, acc[r][c]);
            for (int64_t e = 0; e < CB * W; ++e) dst[e] = from_f<T>(static_cast<float>(row[e]));
          }
        }
    }
  });
}

// q: [T, H, D] (every prefill chunk's tokens, in order); k_cache/v_cache: [kvH, num_blocks,
// block_size, D], already holding the chunks' K/V; block_tables: [R, max_blocks] int64;
// query_start: [R + 1] int64 (chunk r's tokens are rows query_start[r] .. query_start[r+1]
// of q); context_lens: [R] int64 (each chunk's context once its tokens are in). D a multiple
// of 16 up to 128. Returns [T, H, D].
at::Tensor paged_prefill_attention(at::Tensor q, at::Tensor k_cache, at::Tensor v_cache,
                                   at::Tensor block_tables, at::Tensor query_start,
                                   at::Tensor context_lens, double scale) {
  const bool bf = is_bf16("paged_prefill_attention", {&q, &k_cache, &v_cache});
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(),
              "paged_prefill_attention: a contiguous pool");
  const int64_t D = q.size(2);
  TORCH_CHECK(D % 16 == 0 && D / 16 <= kMaxC, "paged_prefill_attention: head_dim ", D,
              " is not a multiple of 16 up to ", 16 * kMaxC);
  q = q.contiguous();
  block_tables = block_tables.contiguous();
  query_start = query_start.contiguous();
  context_lens = context_lens.contiguous();
  auto out = at::empty_like(q);
  switch (D / 16) {
#define WB_CASE(c)                                                                           \
  case c:                                                                                    \
    bf ? prefill_impl<bf16_t, double, c>(q, k_cache, v_cache, block_tables, query_start,     \
                                         context_lens, scale, out)                           \
       : prefill_impl<float, float, c>(q, k_cache, v_cache, block_tables, query_start,       \
                                       context_lens, scale, out);                            \
    break;
    WB_CASE(1) WB_CASE(2) WB_CASE(3) WB_CASE(4) WB_CASE(5) WB_CASE(6) WB_CASE(7) WB_CASE(8)
#undef WB_CASE
  }
  return out;
}
#endif
