// fp32 or bf16 elements for the CPU kernels (cpu_ops.cpp, cpu_attention.cpp).
#pragma once
#include "cpu_torch.h"

#include <cstdint>
#include <cstring>
#include <initializer_list>

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

