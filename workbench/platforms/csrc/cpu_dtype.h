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


// The portable batch-1 kernels' inner loops (a build without AVX-512, AVX-512 without BF16,
// Arm): plain loops the compiler vectorises for the ISA it builds for (AVX2's 8 lanes,
// AVX-512's 16, NEON's 4), fp32 FMAs into fp32 sums. Four weight rows against one x, four
// independent sums, so that the FMA latency is hidden as the AVX-512 kernels' eight rows
// hide it. bf16 and bf16c rows are widened to fp32 first (exact), so both take the same
// sums in the same order: bf16c's GEMV gives bf16's bits here too.
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

// The portable GEMVs (dot_rows4): fp32 where the build has no AVX-512, bf16
// where it has no AVX-512 BF16 (each weight widened to fp32, exactly, then fp32 FMAs: the
// products are the ones vdpbf16ps takes, only the order of the sums differs). Each thread
// streams a contiguous range of rows, four at a time; `row(n, buf)` puts row n in fp32
// into buf and returns it (the weight itself where it is fp32 already).
template <class Row, class Put>
static void portable_gemv(int64_t N, int64_t K, const float* x, Row row, Put put) {
  at::parallel_for(0, (N + 3) / 4, 1, [&](int64_t g0, int64_t e) {
    std::vector<float> buf(4 * K);
    float y[4];
    for (int64_t g = g0; g < e; ++g) {
      const int64_t n = g * 4;
      if (n + 4 <= N) {
        const float* r0 = row(n, buf.data());
        const float* r1 = row(n + 1, buf.data() + K);
        const float* r2 = row(n + 2, buf.data() + 2 * K);
        const float* r3 = row(n + 3, buf.data() + 3 * K);
        if (r1 == r0 + K && r2 == r0 + 2 * K && r3 == r0 + 3 * K) {
          dot_rows4(r0, K, x, K, y);
        } else {
          y[0] = dot_row(r0, x, K), y[1] = dot_row(r1, x, K);
          y[2] = dot_row(r2, x, K), y[3] = dot_row(r3, x, K);
        }
        for (int i = 0; i < 4; ++i) put(n + i, y[i]);
      } else {
        for (int64_t i = n; i < N; ++i) put(i, dot_row(row(i, buf.data()), x, K));
      }
    }
  });
}

