// The slice of ATen the kernels use: tensors, TORCH_CHECK, parallel_for and the few ops they
// call. <torch/extension.h> (pybind11 and torch's whole C++ API, about 15 s of parsing a
// file) is included by bindings.cpp alone, where the module's functions are registered: a first
// start on a machine builds the kernel while it serves, and that build is what it waits for.
#pragma once
#include <ATen/core/Tensor.h>
#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/linear.h>
#include <ATen/ops/mm.h>
#include <ATen/ops/silu.h>

// Batch-1 kernels read each weight once a step, straight from DRAM. Each one asks for the
// next row group's (or tile's) bytes while it multiplies this one's, beside each load: on
// a Sapphire Rapids VM that took a bf16 GEMV from 15-16 to 19-25 GB/s (the hardware
// prefetcher alone does not keep enough lines in flight). A prefetch never faults, so the
// last group may point past its tensor.
#if defined(__SSE__) || defined(__AVX512F__)
#include <xmmintrin.h>
static inline void prefetch(const void* p) {
  _mm_prefetch(static_cast<const char*>(p), _MM_HINT_T0);
}
#else
static inline void prefetch(const void*) {}
#endif

// Every cache line of [p, p + bytes): the portable kernels ask for the next row group's
// bytes this way before they multiply this one's (their inner loops are plain vectorised
// loops, with no room for a prefetch beside each load).
static inline void prefetch_bytes(const void* p, int64_t bytes) {
  const char* c = static_cast<const char*>(p);
  for (int64_t i = 0; i < bytes; i += 64) prefetch(c + i);
}
