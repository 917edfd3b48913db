// The few-row GEMM (2 <= M <= kSmallM rows of x against a weight read once), shared by
// cpu_ops.cpp (fp32 and bf16 weights: small_m_linear) and cpu_quant.cpp (packed rows,
// dequantized four at a time into a buffer that stays in L1). Included, not compiled.
#pragma once

#include <cstdint>
#include <cstring>
#include <vector>

#include <ATen/Parallel.h>

// x [M, K] @ weight [N, K]^T (+ bias) -> [M, N] for a few rows (2 <= M <= kSmallM): a
// speculative decoding verify step (k + 1 tokens of one request) or a small batch. Each
// weight row is read from memory once for all M rows (torch's F.linear at these M took
// 1.5-5x a GEMV on the AVX2 EPYC, docs/benchmarks.md): each thread streams a contiguous range
// of rows, four at a time, and multiplies them, while they are in L1, by every row of x, two
// at a time: eight independent fp32 sums of 8-lane vectors, the four weight vectors in
// registers (6 loads per 8 FMAs). At 2 rows that costs about one GEMV; from 4 up, on a CPU
// with two 128-bit FMA units (Zen 1) the arithmetic rather than the weights is the bound.
// bf16: the four weight rows widened to fp32 first (exact), fp32 sums, one rounding after
// the bias, as torch's bf16 linear. The sums are in another order than torch's: results
// differ from F.linear's by an ulp or so (fp32), a bf16 unit now and then.
static constexpr int64_t kSmallM = 16;

// These sums contract a * b + c into one FMA wherever the ISA has one (the rest of the file
// keeps contraction off for torch's bits); a plain x86-64 build multiplies and adds.
#pragma GCC push_options
#pragma GCC optimize("fp-contract=fast")

// The compiler's generic vectors: 8 lanes where there is AVX (one ymm), else 4 (one NEON or
// SSE register: 8 there made gcc keep the sums on the stack), so that each weight vector is
// loaded once for both x rows (an `omp simd` loop reloaded it per x row: 10 loads per 8
// FMAs, and Zen 1 splits each 256-bit load in two).
#if defined(__AVX__)
static constexpr int kLanes = 8;
#else
static constexpr int kLanes = 4;
#endif
typedef float vf __attribute__((vector_size(4 * kLanes)));
static inline vf loadv(const float* p) {
  vf v;
  std::memcpy(&v, p, sizeof v);
  return v;
}
static inline float hsum(vf v) {
  float s = 0.f;
  for (int i = 0; i < kLanes; ++i) s += v[i];
  return s;
}

static void dot_4x2(const float* __restrict w, int64_t K, const float* __restrict x0,
                    const float* __restrict x1, float* s) {
  vf a0 = {}, a1 = {}, a2 = {}, a3 = {}, b0 = {}, b1 = {}, b2 = {}, b3 = {};
  int64_t k = 0;
  for (; k + kLanes <= K; k += kLanes) {
    const vf u = loadv(x0 + k), v = loadv(x1 + k);
    vf w0 = loadv(w + k), w1 = loadv(w + K + k), w2 = loadv(w + 2 * K + k),
        w3 = loadv(w + 3 * K + k);
#if defined(__AVX__)
    __asm__("" : "+x"(w0), "+x"(w1), "+x"(w2), "+x"(w3));   // in registers: gcc would
#endif                                                       // fold each load into both FMAs
    a0 += w0 * u, a1 += w1 * u, a2 += w2 * u, a3 += w3 * u;
    b0 += w0 * v, b1 += w1 * v, b2 += w2 * v, b3 += w3 * v;
  }
  float t[8] = {hsum(a0), hsum(a1), hsum(a2), hsum(a3),
                hsum(b0), hsum(b1), hsum(b2), hsum(b3)};
  for (; k < K; ++k)
    for (int i = 0; i < 4; ++i) {
      t[i] += w[i * K + k] * x0[k];
      t[4 + i] += w[i * K + k] * x1[k];
    }
  for (int i = 0; i < 8; ++i) s[i] = t[i];
}

static void dot_4x1(const float* __restrict w, int64_t K, const float* __restrict x0,
                    float* s) {
  vf a0 = {}, a1 = {}, a2 = {}, a3 = {};
  int64_t k = 0;
  for (; k + kLanes <= K; k += kLanes) {
    const vf u = loadv(x0 + k);
    a0 += loadv(w + k) * u, a1 += loadv(w + K + k) * u;
    a2 += loadv(w + 2 * K + k) * u, a3 += loadv(w + 3 * K + k) * u;
  }
  float t[4] = {hsum(a0), hsum(a1), hsum(a2), hsum(a3)};
  for (; k < K; ++k)
    for (int i = 0; i < 4; ++i) t[i] += w[i * K + k] * x0[k];
  for (int i = 0; i < 4; ++i) s[i] = t[i];
}

static float dot_1(const float* __restrict w, const float* __restrict x, int64_t K) {
  vf a = {};
  int64_t k = 0;
  for (; k + kLanes <= K; k += kLanes) a += loadv(w + k) * loadv(x + k);
  float t = hsum(a);
  for (; k < K; ++k) t += w[k] * x[k];
  return t;
}

#pragma GCC pop_options

// Rows [n, n + 4) of the weight (fp32; `w` already points at row n) against x's M rows;
// put(m, n + i, sum).
template <class Put>
static inline void small_m_rows4(const float* w, int64_t K, const float* x, int64_t M,
                                 int64_t n, Put put) {
  float s[8];
  int64_t m = 0;
  for (; m + 2 <= M; m += 2) {
    dot_4x2(w, K, x + m * K, x + (m + 1) * K, s);
    for (int i = 0; i < 4; ++i) put(m, n + i, s[i]), put(m + 1, n + i, s[4 + i]);
  }
  if (m < M) {
    dot_4x1(w, K, x + m * K, s);
    for (int i = 0; i < 4; ++i) put(m, n + i, s[i]);
  }
}

// row(n, buf) -> row n in fp32 (buf: room for 4 rows; the weight itself where it is fp32).
template <class Row, class Put>
static void small_m_gemm(int64_t M, int64_t N, int64_t K, const float* x, Row row, Put put) {
  at::parallel_for(0, (N + 3) / 4, 1, [&](int64_t g0, int64_t e) {
    std::vector<float> buf(4 * K);
    for (int64_t g = g0; g < e; ++g) {
      const int64_t n = g * 4;
      if (n + 4 <= N) {
        small_m_rows4(row(n, 4, buf.data()), K, x, M, n, put);
      } else {
        for (int64_t i = n; i < N; ++i) {
          const float* r = row(i, 1, buf.data());
          for (int64_t m = 0; m < M; ++m) put(m, i, dot_1(r, x + m * K, K));
        }
      }
    }
  });
}
