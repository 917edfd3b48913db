// fp32 or bf16 elements for the CPU kernels (cpu_ops.cpp, cpu_attention.cpp).
#pragma once
#include "cpu_torch.h"

#include <cstdint>
#include <cstring>
#include <initializer_list>
#include <vector>

// The element types: fp32, or bf16 storage with fp32 arithmetic (torch's "opmath"). Every
// value torch stores in bf16 between two of its ops is rounded to bf16 here too (`rnd`),
// round to nearest even as c10::BFloat16 does, so a bf16 op computes what the torch
// reference computes, not a more precise neighbour of it. The conversions are plain integer
// code that the `omp simd` loops vectorise (no NaN case: the kernels never see NaN).
using bf16_t = uint16_t;

static inline float to_f(float v) { return v; }
static inline float to_f(bf16_t v) {
  uint32_t u = static_cast<uint32_t>(v) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
static inline bf16_t to_bf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<bf16_t>(u >> 16);
}
template <class T> static inline T from_f(float v);
template <> inline float from_f<float>(float v) { return v; }
template <> inline bf16_t from_f<bf16_t>(float v) { return to_bf16(v); }
// What torch's storing a value in T and reading it back does to it.
template <class T> static inline float rnd(float v) { return to_f(from_f<T>(v)); }

template <class T> static inline const T* cptr(const at::Tensor& t) {
  return reinterpret_cast<const T*>(t.data_ptr());
}
template <class T> static inline T* mptr(at::Tensor& t) { return reinterpret_cast<T*>(t.data_ptr()); }

// fp32 or bf16, the same dtype for every tensor named: the kernels' one check.
static inline bool is_bf16(const char* op, std::initializer_list<const at::Tensor*> ts) {
  const auto dt = (*ts.begin())->scalar_type();
  TORCH_CHECK(dt == at::kFloat || dt == at::kBFloat16, op, ": fp32 or bf16 only");
  for (auto* t : ts) TORCH_CHECK(t->scalar_type() == dt, op, ": mixed dtypes");
  return dt == at::kBFloat16;
}


// 32 bf16 weights (one 512-bit vector) times x's 32 values at the same k, into one vector of
// 16 fp32 sums: vdpbf16ps where the build has AVX-512 BF16; elsewhere with AVX-512 (an Ice
// Lake, a Cascade Lake) each 32-bit lane's two bf16 are widened to fp32 in place (the even
// one by a shift, the odd one by a mask: exact) and taken by two FMAs, the pairs vdpbf16ps
// takes. The plain bf16 GEMV (cpu_ops.cpp) and bf16c's (cpu_quant.cpp) both sum through it,
// in the same order, so in any one build bf16c gives bf16's bits.
#if defined(__AVX512BF16__) || (defined(__AVX512F__) && defined(__AVX512BW__))
#define WB_BF16_X32 1
#include <immintrin.h>
struct Bf16X32 {
#ifdef __AVX512BF16__
  __m512bh x;
  explicit Bf16X32(const bf16_t* p, __mmask32 m = ~0u)
      : x((__m512bh)_mm512_maskz_loadu_epi16(m, p)) {}
  __m512 dot(__m512 acc, __m512i w) const { return _mm512_dpbf16_ps(acc, (__m512bh)w, x); }
#else
  __m512 even, odd;
  explicit Bf16X32(const bf16_t* p, __mmask32 m = ~0u) {
    const __m512i v = _mm512_maskz_loadu_epi16(m, p);
    even = lo_half(v), odd = hi_half(v);
  }
  static __m512 lo_half(__m512i v) { return _mm512_castsi512_ps(_mm512_slli_epi32(v, 16)); }
  static __m512 hi_half(__m512i v) {
    return _mm512_castsi512_ps(_mm512_and_si512(v, _mm512_set1_epi32(-65536)));
  }
  __m512 dot(__m512 acc, __m512i w) const {
    return _mm512_fmadd_ps(hi_half(w), odd, _mm512_fmadd_ps(lo_half(w), even, acc));
  }
#endif
};
#endif

// The portable batch-1 kernels' inner loops (a build without AVX-512: AVX2, Arm, plain
// x86-64): plain loops the compiler vectorises for the ISA it builds for (AVX2's 8 lanes,
// NEON's 4), fp32 FMAs into fp32 sums. Four weight rows against one x, four independent
// sums, so that the FMA latency is hidden as the AVX-512 kernels' eight rows hide it.
static inline void dot_rows4(const float* __restrict w, int64_t ldw, const float* __restrict x,
                             int64_t K, float* y) {
  const float* __restrict w0 = w;
  const float* __restrict w1 = w + ldw;
  const float* __restrict w2 = w + 2 * ldw;
  const float* __restrict w3 = w + 3 * ldw;
  float s0 = 0.f, s1 = 0.f, s2 = 0.f, s3 = 0.f;
#pragma omp simd reduction(+ : s0, s1, s2, s3)
  for (int64_t k = 0; k < K; ++k) {
    s0 += w0[k] * x[k];
    s1 += w1[k] * x[k];
    s2 += w2[k] * x[k];
    s3 += w3[k] * x[k];
  }
  y[0] = s0, y[1] = s1, y[2] = s2, y[3] = s3;
}

static inline float dot_row(const float* __restrict w, const float* __restrict x, int64_t K) {
  float s = 0.f;
#pragma omp simd reduction(+ : s)
  for (int64_t k = 0; k < K; ++k) s += w[k] * x[k];
  return s;
}

static inline void widen_bf16(const bf16_t* __restrict in, float* __restrict out, int64_t K) {
#pragma omp simd
  for (int64_t k = 0; k < K; ++k) out[k] = to_f(in[k]);
}

// The portable fp32 GEMV (dot_rows4; bf16 has its own below): each thread streams a
// contiguous range of rows, four at a time.
template <class Put>
static void portable_gemv(int64_t N, int64_t K, const float* x, const float* w, Put put) {
  at::parallel_for(0, (N + 3) / 4, 1, [&](int64_t g0, int64_t e) {
    float y[4];
    for (int64_t g = g0; g < e; ++g) {
      const int64_t n = g * 4;
      if (n + 4 <= N) {
        prefetch_bytes(w + (n + 4) * K, 4 * K * sizeof(float));
        dot_rows4(w + n * K, K, x, K, y);
        for (int i = 0; i < 4; ++i) put(n + i, y[i]);
      } else {
        for (int64_t i = n; i < N; ++i) put(i, dot_row(w + i * K, x, K));
      }
    }
  });
}

// The portable bf16 GEMV: each weight row read in its 2-byte storage, two weights (one
// 32-bit word) at a time, widened in registers (the even one by a shift, the odd one by a
// mask: exact, what the AVX-512 path's Bf16X32 does) against x split once into its even and
// odd elements; fp32 FMAs into four rows' sums. No buffer the row's size in fp32: the plain
// loops vectorise as they are for AVX2's 8 lanes or NEON's 4. bf16c (cpu_quant.cpp) rebuilds
// its rows as bf16 into a small buffer and takes the same sums, so its bits are bf16's.
typedef uint32_t bf16_pair __attribute__((may_alias, aligned(2)));
static inline float even_f(uint32_t u) {
  u <<= 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
static inline float odd_f(uint32_t u) {
  u &= 0xFFFF0000u;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

// x (bf16, K even) as fp32: its even elements in xe, its odd ones in xo.
static inline void split_bf16(const bf16_t* __restrict x, int64_t K, float* __restrict xe,
                              float* __restrict xo) {
  const bf16_pair* p = reinterpret_cast<const bf16_pair*>(x);
#pragma omp simd
  for (int64_t j = 0; j < K / 2; ++j) xe[j] = even_f(p[j]), xo[j] = odd_f(p[j]);
}

static inline float dot_row_bf16(const bf16_t* w, const float* __restrict xe,
                                 const float* __restrict xo, int64_t K2) {
  const bf16_pair* __restrict p = reinterpret_cast<const bf16_pair*>(w);
  float s = 0.f;
#pragma omp simd reduction(+ : s)
  for (int64_t j = 0; j < K2; ++j) s += even_f(p[j]) * xe[j] + odd_f(p[j]) * xo[j];
  return s;
}

// Four rows (each its own pointer: a plain row or one rebuilt into a buffer) against x.
static inline void dot_rows4_bf16(const bf16_t* w0, const bf16_t* w1, const bf16_t* w2,
                                  const bf16_t* w3, const float* __restrict xe,
                                  const float* __restrict xo, int64_t K2, float* y) {
  const bf16_pair* __restrict p0 = reinterpret_cast<const bf16_pair*>(w0);
  const bf16_pair* __restrict p1 = reinterpret_cast<const bf16_pair*>(w1);
  const bf16_pair* __restrict p2 = reinterpret_cast<const bf16_pair*>(w2);
  const bf16_pair* __restrict p3 = reinterpret_cast<const bf16_pair*>(w3);
  float s0 = 0.f, s1 = 0.f, s2 = 0.f, s3 = 0.f;
#pragma omp simd reduction(+ : s0, s1, s2, s3)
  for (int64_t j = 0; j < K2; ++j) {
    s0 += even_f(p0[j]) * xe[j] + odd_f(p0[j]) * xo[j];
    s1 += even_f(p1[j]) * xe[j] + odd_f(p1[j]) * xo[j];
    s2 += even_f(p2[j]) * xe[j] + odd_f(p2[j]) * xo[j];
    s3 += even_f(p3[j]) * xe[j] + odd_f(p3[j]) * xo[j];
  }
  y[0] = s0, y[1] = s1, y[2] = s2, y[3] = s3;
}

// bf16 rows (K even) against x: `row(n, buf)` returns row n as bf16, the weight itself or
// rebuilt into buf (K elements); `put(n, sum)` takes each row's fp32 sum.
template <class Row, class Put>
static void portable_gemv_bf16(int64_t N, int64_t K, const bf16_t* x, Row row, Put put) {
  std::vector<float> xs(K);
  float* xe = xs.data();
  float* xo = xs.data() + K / 2;
  split_bf16(x, K, xe, xo);
  const int64_t K2 = K / 2;
  at::parallel_for(0, (N + 3) / 4, 1, [&](int64_t g0, int64_t e) {
    std::vector<bf16_t> buf(4 * K);
    for (int64_t g = g0; g < e; ++g) {
      const int64_t n = g * 4;
      if (n + 4 <= N) {
        float y[4];
        const bf16_t* r0 = row(n, buf.data());
        const bf16_t* r1 = row(n + 1, buf.data() + K);
        const bf16_t* r2 = row(n + 2, buf.data() + 2 * K);
        const bf16_t* r3 = row(n + 3, buf.data() + 3 * K);
        dot_rows4_bf16(r0, r1, r2, r3, xe, xo, K2, y);
        for (int i = 0; i < 4; ++i) put(n + i, y[i]);
      } else {
        for (int64_t i = n; i < N; ++i) put(i, dot_row_bf16(row(i, buf.data()), xe, xo, K2));
      }
    }
  });
}
