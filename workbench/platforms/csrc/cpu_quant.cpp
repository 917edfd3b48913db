// Linear layers over low-bit weights, kept packed (platforms/quant.py says the formats):
//   Q4_1 (fmt 1): per 32 weights a 20-byte block, fp16 scale d, fp16 min m, 16 bytes of
//                 nibbles (weight j low nibble of byte j, weight j+16 its high nibble);
//                 w = d * q + m. The embedded GGUF's layers.
//   Q8_0 (fmt 2): per 32 weights a 34-byte block, fp16 scale d, 32 int8; w = d * q. Its
//                 embedding (and tied LM head).
//   INT8 (fmt 3): per output row a 4-byte fp32 scale s, then K int8; w = s * q. Any
//                 checkpoint quantized at load (quantization="int8").
//   BF16C (fmt 7): a bf16 model's weights, losslessly: a palette of each row's 15 commonest
//                 high bytes, a 4-bit code and the low byte a weight, the rest whole at the
//                 row's end (quant.py has the layout). Its batch-1 kernel, bf16c_gemv, gives
//                 the plain bf16 gemv's bits.
// At batch 1 a decode step reads every weight once, so the step costs the weights' bytes:
// 98 MB for SmolLM2 in its GGUF formats against 540 MB in fp32. `qgemv` streams the packed
// rows and dequantizes them in registers (fp32 arithmetic, so the only difference from the
// dequantized reference is the order of the sums). Batched rows (prefill, batch decode)
// dequantize a slice of weight rows at a time into a small buffer (about 1 MB: it stays in
// cache) and multiply it with torch's GEMM, fp32 or, for bf16 activations, bf16 (AMX).
#include "cpu_dtype.h"
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/stack.h>
#include "cpu_packed.h"
#include "cpu_small_m.h"

#include <algorithm>
#include <cstring>
#include <vector>

// One weight row, dequantized: out[K] = the reference's numbers exactly (d * q + m in fp32,
// as gguf's numpy dequantization computes them).
#pragma GCC push_options
#pragma GCC optimize("fp-contract=off")
// (As fp32, or as bf16 bits where Out is bf16_t.)
template <class Out>
static void bf16c_row(const uint8_t* row, int64_t K, Out* out) {
  int32_t escapes;
  std::memcpy(&escapes, row + 16, 4);
  const uint8_t* esc = row + 32 + K / 64 * 96;
  for (int64_t s = 0; s < K / 64; ++s) {
    const uint8_t* low = row + 32 + s * 96;
    const uint8_t* codes = low + 64;
    for (int t = 0; t < 64; ++t) {           // weight 64s + t sits at byte p (quant._SRC)
      const int u = t & 31, p = 16 * (u / 8) + (t < 32 ? 0 : 8) + u % 8;
      const int c = p < 32 ? codes[p] & 0x0F : codes[p - 32] >> 4;
      uint32_t v = static_cast<uint32_t>(row[c]) << 8 | low[p];
      if (c == 0) {                          // outside the palette: the next escape
        uint16_t e;
        std::memcpy(&e, esc, 2);
        esc += 2;
        v = e;
      }
      if constexpr (sizeof(Out) == 2) {
        out[s * 64 + t] = static_cast<bf16_t>(v);
      } else {
        v <<= 16;
        std::memcpy(out + s * 64 + t, &v, 4);
      }
    }
  }
}

// A bf16c row rebuilt as bf16, 16 low bytes at a time: their
// codes' nibbles index the row's palette with one byte shuffle (the palette is 16 bytes,
// byte 0 unused: SSSE3's pshufb, NEON's tbl), and two byte interleaves of low and high
// bytes are the 8 + 8 bf16 of weights 8j.. and 32 + 8j.. (quant.py's layout); rows with
// escapes (rare) take bf16c_row, the reference decoder.
#if defined(__SSSE3__)
#include <immintrin.h>
#elif defined(__ARM_NEON)
#include <arm_neon.h>
#endif
static inline void bf16c_row_fast(const uint8_t* row, int64_t K, bf16_t* out) {
  int32_t escapes;
  std::memcpy(&escapes, row + 16, 4);
  if (escapes) return bf16c_row(row, K, out);
#if defined(__SSSE3__)
  const __m128i pal = _mm_loadu_si128(reinterpret_cast<const __m128i*>(row));
  const __m128i nib = _mm_set1_epi8(0x0F);
  for (int64_t s = 0; s < K / 64; ++s) {
    const uint8_t* low = row + 32 + s * 96;
    const __m128i c0 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(low + 64));
    const __m128i c1 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(low + 80));
    const __m128i idx[4] = {_mm_and_si128(c0, nib), _mm_and_si128(c1, nib),
                            _mm_and_si128(_mm_srli_epi16(c0, 4), nib),
                            _mm_and_si128(_mm_srli_epi16(c1, 4), nib)};
    bf16_t* o = out + s * 64;
    for (int j = 0; j < 4; ++j) {
      const __m128i lo = _mm_loadu_si128(reinterpret_cast<const __m128i*>(low + 16 * j));
      const __m128i hi = _mm_shuffle_epi8(pal, idx[j]);
      _mm_storeu_si128(reinterpret_cast<__m128i*>(o + 8 * j), _mm_unpacklo_epi8(lo, hi));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(o + 32 + 8 * j), _mm_unpackhi_epi8(lo, hi));
    }
  }
#elif defined(__ARM_NEON) && defined(__aarch64__)
  const uint8x16_t pal = vld1q_u8(row), nib = vdupq_n_u8(0x0F);
  for (int64_t s = 0; s < K / 64; ++s) {
    const uint8_t* low = row + 32 + s * 96;
    const uint8x16_t c0 = vld1q_u8(low + 64), c1 = vld1q_u8(low + 80);
    const uint8x16_t idx[4] = {vandq_u8(c0, nib), vandq_u8(c1, nib), vshrq_n_u8(c0, 4),
                               vshrq_n_u8(c1, 4)};
    bf16_t* o = out + s * 64;
    for (int j = 0; j < 4; ++j) {
      const uint8x16_t lo = vld1q_u8(low + 16 * j), hi = vqtbl1q_u8(pal, idx[j]);
      vst1q_u8(reinterpret_cast<uint8_t*>(o + 8 * j), vzip1q_u8(lo, hi));
      vst1q_u8(reinterpret_cast<uint8_t*>(o + 32 + 8 * j), vzip2q_u8(lo, hi));
    }
  }
#else
  bf16c_row(row, K, out);
#endif
}

static void dequant_row(const uint8_t* row, int64_t fmt, int64_t K, float* out) {
  if (fmt == kBf16c) {                  // the fast decoder's bf16, widened (both exact)
    thread_local std::vector<bf16_t> bits;
    bits.resize(K);
    bf16c_row_fast(row, K, bits.data());
    return widen_bf16(bits.data(), out, K);
  }
#ifdef __AVX512F__
  if (fmt == kQ4_1) {                    // d * q, then + m: two roundings, as the reference
    const __m128i low = _mm_set1_epi8(0x0F);
    for (int64_t b = 0; b < K / 32; ++b) {
      const uint8_t* blk = row + b * 20;
      const __m512 d = _mm512_set1_ps(half_at(blk)), m = _mm512_set1_ps(half_at(blk + 2));
      const __m128i q = _mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 4));
      const __m512 lo = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_and_si128(q, low)));
      const __m512 hi = _mm512_cvtepi32_ps(
          _mm512_cvtepu8_epi32(_mm_and_si128(_mm_srli_epi16(q, 4), low)));
      _mm512_storeu_ps(out + b * 32, _mm512_add_ps(_mm512_mul_ps(d, lo), m));
      _mm512_storeu_ps(out + b * 32 + 16, _mm512_add_ps(_mm512_mul_ps(d, hi), m));
    }
    return;
  }
  if (fmt == kQ8_0) {
    for (int64_t b = 0; b < K / 32; ++b) {
      const uint8_t* blk = row + b * 34;
      const __m512 d = _mm512_set1_ps(half_at(blk));
      for (int h = 0; h < 2; ++h) {
        const __m512 q = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(
            _mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 2 + 16 * h))));
        _mm512_storeu_ps(out + b * 32 + 16 * h, _mm512_mul_ps(d, q));
      }
    }
    return;
  }
  {                                      // int8: s * q, sixteen at a time, a masked tail
    float s;
    std::memcpy(&s, row, 4);
    const __m512 sv = _mm512_set1_ps(s);
    for (int64_t k = 0; k < K; k += 16) {
      const __mmask16 m = K - k >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << (K - k)) - 1);
      const __m512 q = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_maskz_loadu_epi8(m, row + 4 + k)));
      _mm512_mask_storeu_ps(out + k, m, _mm512_mul_ps(sv, q));
    }
    return;
  }
#endif
  if (fmt == kQ4_1) {
    for (int64_t b = 0; b < K / 32; ++b) {
      const uint8_t* blk = row + b * 20;
      const float d = half_at(blk), m = half_at(blk + 2);
      for (int j = 0; j < 16; ++j) {
        out[b * 32 + j] = d * static_cast<float>(blk[4 + j] & 0x0F) + m;
        out[b * 32 + j + 16] = d * static_cast<float>(blk[4 + j] >> 4) + m;
      }
    }
  } else if (fmt == kQ8_0) {
    for (int64_t b = 0; b < K / 32; ++b) {
      const uint8_t* blk = row + b * 34;
      const float d = half_at(blk);
      const int8_t* q = reinterpret_cast<const int8_t*>(blk + 2);
      for (int j = 0; j < 32; ++j) out[b * 32 + j] = d * static_cast<float>(q[j]);
    }
  } else {
    float s;
    std::memcpy(&s, row, 4);
    const int8_t* q = reinterpret_cast<const int8_t*>(row + 4);
    for (int64_t j = 0; j < K; ++j) out[j] = s * static_cast<float>(q[j]);
  }
}
#pragma GCC pop_options

static void dequant_rows(const uint8_t* w, int64_t rb, int64_t fmt, int64_t K, int64_t first,
                         int64_t n, float* out) {
  at::parallel_for(first, first + n, 64, [&](int64_t b, int64_t e) {
    for (int64_t r = b; r < e; ++r) dequant_row(w + r * rb, fmt, K, out + (r - first) * K);
  });
}

// weight [N, row bytes] -> fp32 [N, K]: the reference dequantization, for tests and callers.
at::Tensor dequantize(at::Tensor w, int64_t fmt, int64_t K) {
  check_packed(w, fmt, K, "dequantize");
  auto out = at::empty({w.size(0), K}, at::kFloat);
  dequant_rows(w.data_ptr<uint8_t>(), w.size(1), fmt, K, 0, w.size(0), out.data_ptr<float>());
  return out;
}

#ifdef __AVX512F__
// R rows at once against the same x (R independent sums in registers, as gemv_rows does).
// A Q4_1 block's sum is d * sum(q x) + m * sum(x): the min's term is accumulated as a vector
// too (m times x0 + x1, whose lanes add up to the block's sum of x), so no scalar chain
// runs beside the vector one.
template <int R>
static inline void q4_1_rows(const uint8_t* w, int64_t rb, const float* x, int64_t nb,
                             float* y) {
  __m512 acc[R], macc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps(), macc[r] = _mm512_setzero_ps();
  const __m128i low = _mm_set1_epi8(0x0F);
  for (int64_t b = 0; b < nb; ++b) {
    const __m512 x0 = _mm512_loadu_ps(x + b * 32), x1 = _mm512_loadu_ps(x + b * 32 + 16);
    const __m512 x01 = _mm512_add_ps(x0, x1);
    for (int r = 0; r < R; ++r) {
      const uint8_t* blk = w + r * rb + b * 20;
      prefetch(blk + R * rb);                    // the next group's same block
      const __m128i q = _mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 4));
      const __m512 lo = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_and_si128(q, low)));
      const __m512 hi = _mm512_cvtepi32_ps(
          _mm512_cvtepu8_epi32(_mm_and_si128(_mm_srli_epi16(q, 4), low)));
      const __m512 s = _mm512_fmadd_ps(hi, x1, _mm512_mul_ps(lo, x0));
      acc[r] = _mm512_fmadd_ps(_mm512_set1_ps(half_at(blk)), s, acc[r]);
      macc[r] = _mm512_fmadd_ps(_mm512_set1_ps(half_at(blk + 2)), x01, macc[r]);
    }
  }
  for (int r = 0; r < R; ++r) y[r] = _mm512_reduce_add_ps(_mm512_add_ps(acc[r], macc[r]));
}

template <int R>
static inline void q8_0_rows(const uint8_t* w, int64_t rb, const float* x, int64_t nb,
                             float* y) {
  __m512 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    const __m512 x0 = _mm512_loadu_ps(x + b * 32), x1 = _mm512_loadu_ps(x + b * 32 + 16);
    for (int r = 0; r < R; ++r) {
      const uint8_t* blk = w + r * rb + b * 34;
      prefetch(blk + R * rb);
      const __m512 q0 = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(
          _mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 2))));
      const __m512 q1 = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(
          _mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 18))));
      const __m512 s = _mm512_fmadd_ps(q1, x1, _mm512_mul_ps(q0, x0));
      acc[r] = _mm512_fmadd_ps(_mm512_set1_ps(half_at(blk)), s, acc[r]);
    }
  }
  for (int r = 0; r < R; ++r) y[r] = _mm512_reduce_add_ps(acc[r]);
}

template <int R>
static inline void int8_rows(const uint8_t* w, int64_t rb, const float* x, int64_t K,
                             float* y) {
  __m512 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  int64_t k = 0;
  for (; k + 16 <= K; k += 16) {
    const __m512 xv = _mm512_loadu_ps(x + k);
    for (int r = 0; r < R; ++r) {
      prefetch(w + (R + r) * rb + 4 + k);
      const __m128i q = _mm_loadu_si128(reinterpret_cast<const __m128i*>(w + r * rb + 4 + k));
      acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(q)), xv, acc[r]);
    }
  }
  if (k < K) {
    const __mmask16 m = static_cast<__mmask16>((1u << (K - k)) - 1);
    const __m512 xv = _mm512_maskz_loadu_ps(m, x + k);
    for (int r = 0; r < R; ++r) {
      const __m128i q = _mm_maskz_loadu_epi8(m, w + r * rb + 4 + k);
      acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(q)), xv, acc[r]);
    }
  }
  for (int r = 0; r < R; ++r) {
    float s;
    std::memcpy(&s, w + r * rb, 4);
    y[r] = s * _mm512_reduce_add_ps(acc[r]);
  }
}

template <int R>
static inline void q_rows(const uint8_t* w, int64_t rb, int64_t fmt, const float* x,
                          int64_t K, float* y) {
  if (fmt == kQ4_1) q4_1_rows<R>(w, rb, x, K / 32, y);
  else if (fmt == kQ8_0) q8_0_rows<R>(w, rb, x, K / 32, y);
  else int8_rows<R>(w, rb, x, K, y);
}

// x [1, K] fp32 @ packed weight [N, ...]^T -> [1, N] fp32. Each thread streams a contiguous
// range of rows, four at a time.
at::Tensor qgemv(at::Tensor x, at::Tensor w, int64_t fmt) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.dim() == 2 && x.size(0) == 1,
              "qgemv: x is one fp32 row");
  x = x.contiguous();
  const int64_t K = x.size(1), N = w.size(0), rb = w.size(1);
  check_packed(w, fmt, K, "qgemv");
  auto y = at::empty({1, N}, x.options());
  const float* xp = x.data_ptr<float>();
  const uint8_t* wp = w.data_ptr<uint8_t>();
  float* yp = y.data_ptr<float>();
  constexpr int64_t R = 4;
  at::parallel_for(0, (N + R - 1) / R, 1, [&](int64_t b, int64_t e) {
    for (int64_t g = b; g < e; ++g) {
      const int64_t n = g * R;
      if (n + R <= N) {
        q_rows<R>(wp + n * rb, rb, fmt, xp, K, yp + n);
      } else {
        for (int64_t i = n; i < N; ++i) q_rows<1>(wp + i * rb, rb, fmt, xp, K, yp + i);
      }
    }
  });
  return y;
}
// A few rows of x (batch decode, a short chunk, a verify step's drafts) against one packed
// row at a time: each block is dequantized into two registers once and multiplied with every
// x row, so the weights are read and decoded once a step, as at batch 1. MT x rows a pass (MT
// sums in registers); up to 8 rows take one pass (a verify of k drafts has k + 1 rows: two
// rows once took two passes, and cost twice a batch-1 step). The format is a template
// argument, so each loop is straight-line code.
template <int64_t F, int MT>
static inline void small_rows(const uint8_t* wr, const float* x, int64_t ldx, int64_t K,
                              float* y, int64_t ldy) {
  __m512 acc[MT];
  for (int m = 0; m < MT; ++m) acc[m] = _mm512_setzero_ps();
  const __m128i low = _mm_set1_epi8(0x0F);
  int64_t k = 0;
  for (; k + 32 <= K; k += 32) {
    __m512 w0, w1;
    if constexpr (F == kQ4_1) {
      const uint8_t* blk = wr + k / 32 * 20;
      const __m512 d = _mm512_set1_ps(half_at(blk)), mn = _mm512_set1_ps(half_at(blk + 2));
      const __m128i q = _mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 4));
      w0 = _mm512_fmadd_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_and_si128(q, low))), mn);
      w1 = _mm512_fmadd_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(
                                  _mm_and_si128(_mm_srli_epi16(q, 4), low))), mn);
    } else if constexpr (F == kQ8_0) {
      const uint8_t* blk = wr + k / 32 * 34;
      const __m512 d = _mm512_set1_ps(half_at(blk));
      w0 = _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(
                                _mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 2)))));
      w1 = _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(
                                _mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 18)))));
    } else {                   // int8: the row's scale is applied to the sums at the end
      w0 = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(
          _mm_loadu_si128(reinterpret_cast<const __m128i*>(wr + 4 + k))));
      w1 = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(
          _mm_loadu_si128(reinterpret_cast<const __m128i*>(wr + 4 + k + 16))));
    }
    for (int m = 0; m < MT; ++m) {
      const float* xm = x + m * ldx + k;
      acc[m] = _mm512_fmadd_ps(w0, _mm512_loadu_ps(xm), acc[m]);
      acc[m] = _mm512_fmadd_ps(w1, _mm512_loadu_ps(xm + 16), acc[m]);
    }
  }
  float scale = 1.f;
  if constexpr (F == kInt8) {  // int8 rows may end in fewer than 32 weights (GGUF blocks never)
    std::memcpy(&scale, wr, 4);
    for (; k < K; k += 16) {
      const __mmask16 tail = K - k >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << (K - k)) - 1);
      const __m512 w0 = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_maskz_loadu_epi8(tail, wr + 4 + k)));
      for (int m = 0; m < MT; ++m)
        acc[m] = _mm512_fmadd_ps(w0, _mm512_maskz_loadu_ps(tail, x + m * ldx + k), acc[m]);
    }
  }
  for (int m = 0; m < MT; ++m) y[m * ldy] = scale * _mm512_reduce_add_ps(acc[m]);
}

static constexpr int64_t kSmallRows = 16;
// x rows up to which batched qlinear always stays on the packed rows (small_rows); up to
// g_packed_rows (measured, below) fp32 rows of the row formats do too.

// One packed row against `mt` (1..8) x rows.
template <int64_t F>
static inline void small_rows_n(int64_t mt, const uint8_t* wr, const float* x, int64_t K,
                                float* y, int64_t N) {
  switch (mt) {
    case 1: return small_rows<F, 1>(wr, x, K, K, y, N);
    case 2: return small_rows<F, 2>(wr, x, K, K, y, N);
    case 3: return small_rows<F, 3>(wr, x, K, K, y, N);
    case 4: return small_rows<F, 4>(wr, x, K, K, y, N);
    case 5: return small_rows<F, 5>(wr, x, K, K, y, N);
    case 6: return small_rows<F, 6>(wr, x, K, K, y, N);
    case 7: return small_rows<F, 7>(wr, x, K, K, y, N);
    default: return small_rows<F, 8>(wr, x, K, K, y, N);
  }
}

template <int64_t F>
static void qlinear_small_f(const float* xp, const uint8_t* wp, int64_t rb, int64_t M,
                            int64_t K, int64_t N, float* yp) {
  // Passes of 8 x rows (9-16 rows: 8, then the rest); a tile of 16 weight rows takes every
  // pass before the next tile, so a pass's x rows stay in L1 across the tile and the tile's
  // packed rows across the passes (weight row by weight row, all passes each, read 24 x rows
  // from L2 for every weight row: 43 ms for SmolLM2's linears against 16 ms for 16 rows).
  constexpr int64_t kTileN = 16;
  at::parallel_for(0, N, kTileN, [&](int64_t b, int64_t e) {
    for (int64_t n0 = b; n0 < e; n0 += kTileN) {
      const int64_t n1 = std::min(e, n0 + kTileN);
      for (int64_t m = 0; m < M; m += 8)
        for (int64_t n = n0; n < n1; ++n)
          small_rows_n<F>(std::min<int64_t>(8, M - m), wp + n * rb, xp + m * K, K,
                          yp + m * N + n, N);
    }
  });
}

static at::Tensor qlinear_small(const at::Tensor& x, const at::Tensor& w, int64_t fmt) {
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0), rb = w.size(1);
  auto y = at::empty({M, N}, x.options());
  const float* xp = x.data_ptr<float>();
  const uint8_t* wp = w.data_ptr<uint8_t>();
  float* yp = y.data_ptr<float>();
  if (fmt == kQ4_1) qlinear_small_f<kQ4_1>(xp, wp, rb, M, K, N, yp);
  else if (fmt == kQ8_0) qlinear_small_f<kQ8_0>(xp, wp, rb, M, K, N, yp);
  else qlinear_small_f<kInt8>(xp, wp, rb, M, K, N, yp);
  return y;
}
#endif

// x [1, K] bf16 @ bf16c weight^T (+ bias) -> [1, N] bf16: the plain bf16 gemv's sums
// (cpu_ops.cpp) over weights rebuilt in registers. Per superblock of 64 weights and row: one
// 64-byte load of low bytes, one 32-byte load of codes, whose nibbles become 64 byte indices
// (a shift and an insert) into the row's palette (vpermb: each index's low six bits pick a
// byte of the palette repeated four times, so the shift's stray bits above the nibble do
// not matter), and two byte interleaves of low and high bytes give the 32 + 32 bf16 that
// the plain kernel's two Bf16X32 steps take, into the same accumulator in the same order. Rows
// with escapes (rare: trained weights' high bytes seldom need more than 15 values in a row)
// take the same loop with the escaped lanes filled from the row's end (vpexpandw).
// At batch 1 the step reads 0.78 of the plain bf16 bytes; two threads on this VM decode
// about as fast as memory delivers the bytes, so the gain is less than the bytes'.
#if defined(WB_BF16_X32) && defined(__AVX512VBMI__) && defined(__AVX512VBMI2__) && \
    defined(__BMI2__)
template <int R, bool kEscapes>
static inline void bf16c_rows(const uint8_t* w, int64_t rb, const bf16_t* x,
                              const bf16_t* bias, bf16_t* y, int64_t K) {
  const int64_t ns = K / 64;
  __m512 acc[R];
  __m512i table[R];
  const bf16_t* esc[R];
  for (int r = 0; r < R; ++r) {
    acc[r] = _mm512_setzero_ps();
    table[r] = _mm512_broadcast_i32x4(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w + r * rb)));
    esc[r] = reinterpret_cast<const bf16_t*>(w + r * rb + 32 + ns * 96);
  }
  for (int64_t s = 0; s < ns; ++s) {
    const Bf16X32 xa(x + 64 * s), xb(x + 64 * s + 32);
    for (int r = 0; r < R; ++r) {
      const uint8_t* sb = w + r * rb + 32 + s * 96;
      prefetch(sb + R * rb);                   // the next group's same superblock
      prefetch(sb + R * rb + 64);
      const __m512i low = _mm512_loadu_si512(sb);
      const __m256i c = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(sb + 64));
      const __m512i idx = _mm512_inserti64x4(_mm512_castsi256_si512(c), _mm256_srli_epi16(c, 4), 1);
      const __m512i high = _mm512_permutexvar_epi8(idx, table[r]);
      __m512i a = _mm512_unpacklo_epi8(low, high), b = _mm512_unpackhi_epi8(low, high);
      if (kEscapes) {
        const __mmask64 out = _mm512_testn_epi8_mask(idx, _mm512_set1_epi8(0x0F));
        if (out) {
          const __mmask32 ea = static_cast<__mmask32>(_pext_u64(out, 0x00FF00FF00FF00FFull));
          const __mmask32 eb = static_cast<__mmask32>(_pext_u64(out, 0xFF00FF00FF00FF00ull));
          a = _mm512_mask_expandloadu_epi16(a, ea, esc[r]);
          esc[r] += __builtin_popcount(ea);
          b = _mm512_mask_expandloadu_epi16(b, eb, esc[r]);
          esc[r] += __builtin_popcount(eb);
        }
      }
      acc[r] = xb.dot(xa.dot(acc[r], a), b);
    }
  }
  for (int r = 0; r < R; ++r)
    y[r] = to_bf16(_mm512_reduce_add_ps(acc[r]) + (bias ? to_f(bias[r]) : 0.f));
}

bool bf16c_in_registers() { return true; }

static inline bool bf16c_has_escapes(const uint8_t* w, int64_t rb, int64_t rows) {
  for (int64_t r = 0; r < rows; ++r) {
    int32_t e;
    std::memcpy(&e, w + r * rb + 16, 4);
    if (e) return true;
  }
  return false;
}

template <int R>
static inline void bf16c_group(const uint8_t* w, int64_t rb, const bf16_t* x, const bf16_t* bias,
                               bf16_t* y, int64_t K) {
  if (bf16c_has_escapes(w, rb, R)) bf16c_rows<R, true>(w, rb, x, bias, y, K);
  else bf16c_rows<R, false>(w, rb, x, bias, y, K);
}

at::Tensor bf16c_gemv(at::Tensor x, at::Tensor w, c10::optional<at::Tensor> bias) {
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && x.dim() == 2 && x.size(0) == 1,
              "bf16c_gemv: x is one bf16 row");
  x = x.contiguous();
  const int64_t K = x.size(1), N = w.size(0), rb = w.size(1);
  check_packed(w, kBf16c, K, "bf16c_gemv");
  at::Tensor b;
  if (bias.has_value()) {
    b = bias->contiguous();
    TORCH_CHECK(b.scalar_type() == at::kBFloat16 && b.numel() == N, "bf16c_gemv: bias");
  }
  auto y = at::empty({1, N}, x.options());
  const bf16_t* xp = cptr<bf16_t>(x);
  const bf16_t* bp = b.defined() ? cptr<bf16_t>(b) : nullptr;
  const uint8_t* wp = w.data_ptr<uint8_t>();
  bf16_t* yp = mptr<bf16_t>(y);
  constexpr int64_t R = 4;
  at::parallel_for(0, (N + R - 1) / R, 1, [&](int64_t g0, int64_t e) {
    for (int64_t g = g0; g < e; ++g) {
      const int64_t n = g * R;
      if (n + R <= N) {
        bf16c_group<R>(wp + n * rb, rb, xp, bp ? bp + n : nullptr, yp + n, K);
      } else {
        for (int64_t i = n; i < N; ++i)
          bf16c_group<1>(wp + i * rb, rb, xp, bp ? bp + i : nullptr, yp + i, K);
      }
    }
  });
  return y;
}
#else
bool bf16c_in_registers() { return false; }

// Without AVX-512 and VBMI: each row rebuilt as bf16 (bf16c_row_fast, exactly) into a small
// buffer as it streams past, then the portable bf16 GEMV's sums (cpu_dtype.h:
// portable_gemv_bf16), so the bits are the plain bf16 gemv's of this build. The matrix is
// read once, in its 12.3 bits a weight; nothing the size of the matrix is made.
at::Tensor bf16c_gemv(at::Tensor x, at::Tensor w, c10::optional<at::Tensor> bias) {
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && x.dim() == 2 && x.size(0) == 1,
              "bf16c_gemv: x is one bf16 row");
  x = x.contiguous();
  const int64_t K = x.size(1), N = w.size(0), rb = w.size(1);
  check_packed(w, kBf16c, K, "bf16c_gemv");
  at::Tensor b;
  if (bias.has_value()) {
    b = bias->contiguous();
    TORCH_CHECK(b.scalar_type() == at::kBFloat16 && b.numel() == N, "bf16c_gemv: bias");
  }
  auto y = at::empty({1, N}, x.options());
  const bf16_t* bp = b.defined() ? cptr<bf16_t>(b) : nullptr;
  const uint8_t* wp = w.data_ptr<uint8_t>();
  bf16_t* yp = mptr<bf16_t>(y);
  portable_gemv_bf16(N, K, cptr<bf16_t>(x), [&](int64_t n, bf16_t* buf) {
    prefetch_bytes(wp + (n + 4) * rb, rb);              // row n's in the next group
    bf16c_row_fast(wp + n * rb, K, buf);
    return static_cast<const bf16_t*>(buf);
  }, [&](int64_t n, float v) { yp[n] = to_bf16(v + (bp ? to_f(bp[n]) : 0.f)); });
  return y;
}
#endif

// x fp32 [M, K] (a few rows) @ packed weight^T -> fp32 [M, N]: four weight rows at a time
// dequantized once into a buffer that stays in L1 (dequant_row: the reference's numbers) and
// multiplied with every x row, two at a time, by small_m_gemm (cpu_small_m.h, small_m_linear's
// loop), so the weights are read once a step in their packed bytes. The portable builds'
// rows, and bf16c's few rows on every build.
static at::Tensor packed_small_m(const at::Tensor& x, const at::Tensor& w, int64_t fmt) {
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0), rb = w.size(1);
  auto y = at::empty({M, N}, x.options());
  const uint8_t* wp = w.data_ptr<uint8_t>();
  float* yp = y.data_ptr<float>();
  small_m_gemm(M, N, K, x.data_ptr<float>(), [&](int64_t n, int64_t rows, float* buf) {
    for (int64_t i = 0; i < rows; ++i) dequant_row(wp + (n + i) * rb, fmt, K, buf + i * K);
    return static_cast<const float*>(buf);
  }, [&](int64_t m, int64_t n, float v) { yp[m * N + n] = v; });
  return y;
}

static int64_t g_packed_rows = 16;
// The most x rows that stay on the packed rows; more multiply dequantized slices with
// torch's GEMM (sliced_linear). On the AVX2 EPYC the packed rows won up to 256 rows (1.2x
// there, 2.4-3.8x at 8-32: dequantizing the slices cost more than their GEMM); on the Zen 5
// (AVX-512) 32 rows of SmolLM2's linears took 26 ms on them against 54 ms in slices, so it
// is measured per build (cpu_choice.small_m_rows sets it through set_packed_rows), not fixed.

#ifndef __AVX512F__
// The portable kernels of the row formats (no AVX-512). Batch 1: qrow_dot, each packed row
// against x without a buffer. More rows (a verify step, a batch of decodes, a prefill
// chunk), up to g_packed_rows: four weight rows at a time dequantized once into a buffer
// that stays in L1 (dequant_row: the reference's numbers) and multiplied with every x row,
// two at a time, by small_m_gemm (cpu_small_m.h, small_m_linear's loop), so the weights are
// read once a step in their packed bytes, as the AVX-512 kernels read them.

// One packed row . x at batch 1, without a buffer: sixteen lanes of sums (acc, kept in
// vector registers by the compiler) take each block's products scaled by its d, and a Q4_1
// block's min enters as m times the block's sum of x (xsum, once a call).
static inline float qrow_dot(const uint8_t* row, int64_t fmt, const float* __restrict x,
                             const float* __restrict xsum, int64_t K) {
  float acc[16] = {0.f};
  float tail = 0.f;
  if (fmt == kQ4_1) {
    for (int64_t b = 0; b < K / 32; ++b) {
      const uint8_t* blk = row + b * 20;
      const float d = half_at(blk);
      const float* x0 = x + b * 32;
#pragma omp simd
      for (int j = 0; j < 16; ++j)
        acc[j] += d * (static_cast<float>(blk[4 + j] & 0x0F) * x0[j] +
                       static_cast<float>(blk[4 + j] >> 4) * x0[16 + j]);
      tail += half_at(blk + 2) * xsum[b];
    }
  } else if (fmt == kQ8_0) {
    for (int64_t b = 0; b < K / 32; ++b) {
      const uint8_t* blk = row + b * 34;
      const float d = half_at(blk);
      const int8_t* q = reinterpret_cast<const int8_t*>(blk + 2);
      const float* x0 = x + b * 32;
#pragma omp simd
      for (int j = 0; j < 16; ++j)
        acc[j] += d * (static_cast<float>(q[j]) * x0[j] + static_cast<float>(q[16 + j]) * x0[16 + j]);
    }
  } else {
    float sc;
    std::memcpy(&sc, row, 4);
    const int8_t* q = reinterpret_cast<const int8_t*>(row + 4);
    int64_t k = 0;
    for (; k + 16 <= K; k += 16) {
#pragma omp simd
      for (int j = 0; j < 16; ++j) acc[j] += static_cast<float>(q[k + j]) * x[k + j];
    }
    for (; k < K; ++k) tail += static_cast<float>(q[k]) * x[k];
    float s = tail;
    for (int j = 0; j < 16; ++j) s += acc[j];
    return sc * s;
  }
  float s = tail;
  for (int j = 0; j < 16; ++j) s += acc[j];
  return s;
}

static at::Tensor qrows(const at::Tensor& x, const at::Tensor& w, int64_t fmt) {
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0), rb = w.size(1);
  auto y = at::empty({M, N}, x.options());
  const float* xp = x.data_ptr<float>();
  const uint8_t* wp = w.data_ptr<uint8_t>();
  float* yp = y.data_ptr<float>();
  if (M == 1) {
    std::vector<float> xsum(K / 32 + 1, 0.f);
    for (int64_t b = 0; b < K / 32; ++b)
      for (int j = 0; j < 32; ++j) xsum[b] += xp[b * 32 + j];
    at::parallel_for(0, N, 16, [&](int64_t n0, int64_t e) {
      for (int64_t n = n0; n < e; ++n) yp[n] = qrow_dot(wp + n * rb, fmt, xp, xsum.data(), K);
    });
    return y;
  }
  return packed_small_m(x, w, fmt);
}

at::Tensor qgemv(at::Tensor x, at::Tensor w, int64_t fmt) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.dim() == 2 && x.size(0) == 1,
              "qgemv: x is one fp32 row");
  TORCH_CHECK(fmt >= 1 && fmt <= 3, "qgemv: a row format (q4_1, q8_0, int8)");
  x = x.contiguous();
  check_packed(w, fmt, x.size(1), "qgemv");
  return qrows(x, w, fmt);
}
#endif

static bool g_onednn_slices = false;
static constexpr int64_t kOnednnBlock = 256;   // cpu_onednn.ONEDNN_BLOCK
// Whether fp32 slices multiply through oneDNN's matmul (torch's mkldnn::_linear_pointwise on
// the plain slice) rather than at::mm: set where cpu_choice measured oneDNN faster than
// torch's F.linear (on a Zen 5 MKL's sgemm ran at a third of oneDNN's speed), as fp32's own
// batched linear is chosen.
bool set_onednn_slices(bool on) {
  const bool old = g_onednn_slices;
  g_onednn_slices = on;
  return old;
}

// x [M, K] fp32 @ wt [N, K]^T by oneDNN, or an undefined tensor where torch has no such op.
static at::Tensor onednn_mm(const at::Tensor& x, const at::Tensor& wt) {
  static const auto op = c10::Dispatcher::singleton().findOp({"mkldnn::_linear_pointwise", ""});
  if (!op) return at::Tensor();
  torch::jit::Stack stack{x, wt, c10::IValue(), std::string("none"),
                          c10::impl::GenericList(c10::OptionalType::create(c10::NumberType::get())),
                          std::string("")};
  op->callBoxed(&stack);
  return stack[0].toTensor();
}

// x [M, K] @ a weight of N rows ^T -> [M, N] in x's dtype, for more rows than the streaming
// kernels take: the weight decoded to fp32 a slice of rows at a time (`decode(n0, rows,
// out)`; about 1 MB, which stays in L2) and each slice multiplied with x by torch's GEMM (in
// x's dtype; fp32 through oneDNN where set_onednn_slices said so).
template <class Decode>
static at::Tensor sliced_linear(const at::Tensor& x, int64_t N, Decode decode) {
  const int64_t M = x.size(0), K = x.size(1);
  auto out = at::empty({M, N}, x.options());
  const int64_t chunk = std::min<int64_t>(N, std::max<int64_t>(64, (int64_t{1} << 18) / K));
  auto buf = at::empty({chunk, K}, at::kFloat);
  for (int64_t n0 = 0; n0 < N; n0 += chunk) {
    const int64_t nc = std::min(chunk, N - n0);
    decode(n0, nc, buf.data_ptr<float>());
    auto wt = buf.narrow(0, 0, nc);
    if (x.scalar_type() != at::kFloat) wt = wt.to(x.scalar_type());
    // oneDNN on whole blocks of kOnednnBlock rows only: it builds and caches a primitive for
    // every row count it sees (a server's prefill chunks see them all: 300 MB in a soak),
    // so the rest of the rows take at::mm.
    int64_t done = 0;
    if (g_onednn_slices && x.scalar_type() == at::kFloat) {
      for (; done + kOnednnBlock <= M; done += kOnednnBlock) {
        at::Tensor y = onednn_mm(x.narrow(0, done, kOnednnBlock), wt);
        if (!y.defined()) break;
        out.narrow(0, done, kOnednnBlock).narrow(1, n0, nc).copy_(y);
      }
    }
    if (done < M)
      out.narrow(0, done, M - done).narrow(1, n0, nc).copy_(at::mm(x.narrow(0, done, M - done), wt.t()));
  }
  return out;
}

// x [M, K] (fp32 or bf16) @ packed weight^T -> [M, N] in x's dtype. One fp32 row takes
// qgemv; more rows multiply slices of dequantized rows with torch's GEMM (sliced_linear).
at::Tensor a8_dispatch_linear(at::Tensor x, at::Tensor w, int64_t fmt);   // cpu_a8.cpp
at::Tensor a8_embedding(at::Tensor ids, at::Tensor w, int64_t fmt, int64_t K, bool bf16);

// The most rows qlinear multiplies on the packed rows (n >= 1; set from cpu_choice's
// measurement), returning the previous; n < 1 only reads it. Up to 16 rows always take
// them on an AVX-512 build (its bf16 and bf16c rows too; past 16, its fp32 rows of the row
// formats alone).
int64_t set_packed_rows(int64_t n) {
  const int64_t old = g_packed_rows;
  if (n >= 1) g_packed_rows = n;
  return old;
}

at::Tensor qlinear(at::Tensor x, at::Tensor w, int64_t fmt) {
  if (fmt == kBf16c && x.dim() == 2 && x.size(0) == 1) return bf16c_gemv(x, w, c10::nullopt);
  if (fmt >= 4 && fmt != kBf16c) return a8_dispatch_linear(x, w, fmt);   // 8-bit activations
  TORCH_CHECK(x.dim() == 2 && (x.scalar_type() == at::kFloat ||
                               x.scalar_type() == at::kBFloat16), "qlinear: fp32 or bf16 [M, K]");
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
  check_packed(w, fmt, K, "qlinear");
  x = x.contiguous();
#ifdef __AVX512F__
  if (M <= kSmallRows && x.scalar_type() != at::kFloat)   // bf16 rows: the same streaming
    return qlinear(x.to(at::kFloat), w, fmt).to(x.scalar_type());   // kernels, in fp32
  if (M == 1 && fmt != kBf16c) return qgemv(x, w, fmt);
  // bf16c's few rows: four rows decoded into L1 at a time (decoding the whole matrix per
  // call, as larger batches do, cost 3x bf16's 8 rows on an Ice Lake).
  if (M <= kSmallRows)
    return fmt == kBf16c ? packed_small_m(x, w, fmt) : qlinear_small(x, w, fmt);
  // More fp32 rows: each weight row, decoded from L1, against 8 x rows a pass.
  if (M <= g_packed_rows && fmt != kBf16c && x.scalar_type() == at::kFloat)
    return qlinear_small(x, w, fmt);
#else
  if (M <= g_packed_rows && (fmt != kBf16c || M > 1))    // bf16c's one row: bf16c_gemv
    return x.scalar_type() == at::kFloat ? qrows(x, w, fmt)
                                         : qrows(x.to(at::kFloat), w, fmt).to(x.scalar_type());
#endif
  const uint8_t* wp = w.data_ptr<uint8_t>();
  return sliced_linear(x, N, [&](int64_t n0, int64_t nc, float* buf) {
    dequant_rows(wp, w.size(1), fmt, K, n0, nc, buf);
  });
}

// x fp32 [M, K] @ bf16 weight [N, K]^T -> fp32 [M, N]: the weight widened to fp32 a slice at a
// time (exact) and multiplied in fp32 by torch's GEMM. Batched bf16 where oneDNN has no
// native bf16 (cpu_ops.onednn_bf16): torch's bf16 GEMM there ran at 0.4x fp32's throughput.
at::Tensor widened_linear(at::Tensor x, at::Tensor w) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.dim() == 2 && w.scalar_type() == at::kBFloat16 &&
              w.dim() == 2 && w.size(1) == x.size(1), "widened_linear: fp32 [M, K], bf16 [N, K]");
  const at::Tensor wc = w.contiguous();
  const int64_t K = w.size(1);
  const bf16_t* wp = cptr<bf16_t>(wc);
  // A few rows (up to the packed formats' measured rows on a portable build, 16 on an
  // AVX-512 one): four rows widened into L1 and multiplied with every x row (the weights read
  // once a step, in their 2-byte storage), as bf16c's few rows are (packed_small_m), so
  // bf16c gives bf16's bits here too.
#ifdef __AVX512F__
  if (x.size(0) <= kSmallRows) {
#else
  if (x.size(0) <= g_packed_rows) {
#endif
    x = x.contiguous();
    const int64_t M = x.size(0), N = w.size(0);
    auto y = at::empty({M, N}, x.options());
    float* yp = y.data_ptr<float>();
    small_m_gemm(M, N, K, x.data_ptr<float>(), [&](int64_t n, int64_t rows, float* buf) {
      widen_bf16(wp + n * K, buf, rows * K);
      return static_cast<const float*>(buf);
    }, [&](int64_t m, int64_t n, float v) { yp[m * N + n] = v; });
    return y;
  }
  return sliced_linear(x.contiguous(), w.size(0), [&](int64_t n0, int64_t nc, float* buf) {
    at::parallel_for(0, nc, 16, [&](int64_t b, int64_t e) {
      for (int64_t n = b; n < e; ++n) widen_bf16(wp + (n0 + n) * K, buf + n * K, K);
    });
  });
}

// Embedding rows of a packed table: ids [T] -> [T, K], fp32 (bf16 with `bf16`).
at::Tensor qembedding(at::Tensor ids, at::Tensor w, int64_t fmt, int64_t K,
                         bool bf16) {
  if (fmt >= 4 && fmt != kBf16c) return a8_embedding(ids, w, fmt, K, bf16);
  check_packed(w, fmt, K, "qembedding");
  ids = ids.contiguous().to(at::kLong);
  const int64_t T = ids.numel(), N = w.size(0), rb = w.size(1);
  auto out = at::empty({T, K}, at::kFloat);
  const int64_t* ip = ids.data_ptr<int64_t>();
  for (int64_t t = 0; t < T; ++t) TORCH_CHECK(ip[t] >= 0 && ip[t] < N, "qembedding: id out of range");
  const uint8_t* wp = w.data_ptr<uint8_t>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, T, 16, [&](int64_t b, int64_t e) {
    for (int64_t t = b; t < e; ++t) dequant_row(wp + ip[t] * rb, fmt, K, op + t * K);
  });
  return bf16 ? out.to(at::kBFloat16) : out;
}
