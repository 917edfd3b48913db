// The packed weight formats (platforms/quant.py names them) and what every kernel over them
// checks: a row's bytes, the tensor's shape, an fp16 scale read exactly.
//   fmt 1 Q4_1, 2 Q8_0, 3 INT8: one weight row a row (cpu_quant.cpp, fp32 activations);
//   fmt 4-6: the same blocks, 16 rows interleaved (cpu_a8.cpp, 8-bit activations); INT8's
//   rows are padded to a whole 32-block there;
//   fmt 7 BF16C: bf16 kept losslessly in 12.3 bits a weight (cpu_quant.cpp); its rows end
//   with room for the matrix's most escapes in a row, so they are at least row_bytes long.
#pragma once
#include "cpu_torch.h"

#include <cstdint>
#include <cstring>

#if defined(__F16C__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

enum Format : int64_t { kQ4_1 = 1, kQ8_0 = 2, kInt8 = 3, kQ4_1x16 = 4, kQ8_0x16 = 5, kInt8x16 = 6,
                      kBf16c = 7 };

static inline int64_t padded(int64_t K) { return (K + 31) / 32 * 32; }

static inline int64_t row_bytes(int64_t fmt, int64_t K) {
  switch (fmt) {
    case kQ4_1: case kQ4_1x16: return K / 32 * 20;
    case kQ8_0: case kQ8_0x16: return K / 32 * 34;
    case kInt8: return K + 4;
    case kInt8x16: return padded(K) + 4;
    case kBf16c: return 32 + K / 64 * 96;          // without the escapes
  }
  TORCH_CHECK(false, "quantized weight: unknown format ", fmt);
  return 0;
}

static inline void check_packed(const at::Tensor& w, int64_t fmt, int64_t K, const char* what) {
  TORCH_CHECK(w.scalar_type() == at::kByte && w.dim() == 2 && w.is_contiguous(), what,
              ": packed weights are a contiguous uint8 [N, row bytes] tensor");
  TORCH_CHECK(fmt == kInt8 || fmt == kInt8x16 || K % (fmt == kBf16c ? 64 : 32) == 0, what,
              ": block formats need K % 32 == 0, bf16c K % 64 == 0 (K = ", K, ")");
  const int64_t extra = w.size(1) - row_bytes(fmt, K);
  TORCH_CHECK(fmt == kBf16c ? extra >= 0 && extra % 2 == 0 : extra == 0, what, ": ", w.size(1),
              " bytes a row is not format ", fmt, " at K = ", K);
}

// An fp16 scale, exactly (F16C's one instruction where the CPU has it: c10's bit-twiddling
// conversion, twice per block, made the batch-1 kernel compute-bound).
static inline float half_at(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
#ifdef __F16C__
  return _cvtsh_ss(h);
#else
  return c10::detail::fp16_ieee_to_fp32_value(h);
#endif
}
