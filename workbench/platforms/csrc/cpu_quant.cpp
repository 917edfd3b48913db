// Linear layers over low-bit weights, kept packed (platforms/quant.py says the formats):
//   Q4_1 (fmt 1): per 32 weights a 20-byte block, fp16 scale d, fp16 min m, 16 bytes of
//                 nibbles (weight j low nibble of byte j, weight j+16 its high nibble);
//                 w = d * q + m. The embedded GGUF's layers.
//   Q8_0 (fmt 2): per 32 weights a 34-byte block, fp16 scale d, 32 int8; w = d * q. Its
//                 embedding (and tied LM head).
//   INT8 (fmt 3): per output row a 4-byte fp32 scale s, then K int8; w = s * q. Any
//                 checkpoint quantized at load (quantization="int8").
// At batch 1 a decode step reads every weight once, so the step costs the weights' bytes:
// 98 MB for SmolLM2 in its GGUF formats against 540 MB in fp32. `qgemv` streams the packed
// rows and dequantizes them in registers (fp32 arithmetic, so the only difference from the
// dequantized reference is the order of the sums). Batched rows (prefill, batch decode)
// dequantize a slice of weight rows at a time into a small buffer (about 1 MB: it stays in
// cache) and multiply it with torch's GEMM, fp32 or, for bf16 activations, bf16 (AMX).
#include "cpu_packed.h"

#include <cstring>

// One weight row, dequantized: out[K] = the reference's numbers exactly (d * q + m in fp32,
// as gguf's numpy dequantization computes them).
#pragma GCC push_options
#pragma GCC optimize("fp-contract=off")
static void dequant_row(const uint8_t* row, int64_t fmt, int64_t K, float* out) {
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

static void dequant_rows(const uint8_t* w, int64_t fmt, int64_t K, int64_t first, int64_t n,
                         float* out) {
  const int64_t rb = row_bytes(fmt, K);
  at::parallel_for(first, first + n, 64, [&](int64_t b, int64_t e) {
    for (int64_t r = b; r < e; ++r) dequant_row(w + r * rb, fmt, K, out + (r - first) * K);
  });
}

// weight [N, row bytes] -> fp32 [N, K]: the reference dequantization, for tests and callers.
at::Tensor dequantize(at::Tensor w, int64_t fmt, int64_t K) {
  check_packed(w, fmt, K, "dequantize");
  auto out = at::empty({w.size(0), K}, at::kFloat);
  dequant_rows(w.data_ptr<uint8_t>(), fmt, K, 0, w.size(0), out.data_ptr<float>());
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
// A few rows of x (batch decode, a short chunk) against one packed row at a time: each
// block is dequantized into two registers once and multiplied with every x row, so the
// weights are read once a step, as at batch 1. MT x rows a pass (MT sums in registers).
template <int MT>
static inline void small_rows(const uint8_t* wr, int64_t fmt, const float* x, int64_t ldx,
                              int64_t K, float* y, int64_t ldy) {
  __m512 acc[MT];
  for (int m = 0; m < MT; ++m) acc[m] = _mm512_setzero_ps();
  const __m128i low = _mm_set1_epi8(0x0F);
  float scale = 1.f;
  if (fmt == kInt8) std::memcpy(&scale, wr, 4);
  const int64_t step = fmt == kInt8 ? 16 : 32;
  for (int64_t k = 0; k < K; k += step) {
    __m512 w0, w1 = _mm512_setzero_ps();
    __mmask16 tail = 0xFFFF;
    if (fmt == kQ4_1) {
      const uint8_t* blk = wr + k / 32 * 20;
      const __m512 d = _mm512_set1_ps(half_at(blk)), mn = _mm512_set1_ps(half_at(blk + 2));
      const __m128i q = _mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 4));
      w0 = _mm512_fmadd_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_and_si128(q, low))), mn);
      w1 = _mm512_fmadd_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(
                                  _mm_and_si128(_mm_srli_epi16(q, 4), low))), mn);
    } else if (fmt == kQ8_0) {
      const uint8_t* blk = wr + k / 32 * 34;
      const __m512 d = _mm512_set1_ps(half_at(blk));
      w0 = _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(
                                _mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 2)))));
      w1 = _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(
                                _mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 18)))));
    } else {
      if (K - k < 16) tail = static_cast<__mmask16>((1u << (K - k)) - 1);
      w0 = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_maskz_loadu_epi8(tail, wr + 4 + k)));
    }
    for (int m = 0; m < MT; ++m) {
      const float* xm = x + m * ldx + k;
      if (step == 32) {
        acc[m] = _mm512_fmadd_ps(w0, _mm512_loadu_ps(xm), acc[m]);
        acc[m] = _mm512_fmadd_ps(w1, _mm512_loadu_ps(xm + 16), acc[m]);
      } else {
        acc[m] = _mm512_fmadd_ps(w0, _mm512_maskz_loadu_ps(tail, xm), acc[m]);
      }
    }
  }
  for (int m = 0; m < MT; ++m) y[m * ldy] = scale * _mm512_reduce_add_ps(acc[m]);
}

static constexpr int64_t kSmallRows = 16;
// x rows up to which batched qlinear stays on the packed rows (small_rows); above it the
// GEMM on dequantized slices is faster.

static at::Tensor qlinear_small(const at::Tensor& x, const at::Tensor& w, int64_t fmt) {
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0), rb = w.size(1);
  auto y = at::empty({M, N}, x.options());
  const float* xp = x.data_ptr<float>();
  const uint8_t* wp = w.data_ptr<uint8_t>();
  float* yp = y.data_ptr<float>();
  at::parallel_for(0, N, 8, [&](int64_t b, int64_t e) {
    for (int64_t n = b; n < e; ++n) {
      int64_t m = 0;
      for (; m + 8 <= M; m += 8) small_rows<8>(wp + n * rb, fmt, xp + m * K, K, K, yp + m * N + n, N);
      for (; m + 4 <= M; m += 4) small_rows<4>(wp + n * rb, fmt, xp + m * K, K, K, yp + m * N + n, N);
      for (; m < M; ++m) small_rows<1>(wp + n * rb, fmt, xp + m * K, K, K, yp + m * N + n, N);
    }
  });
  return y;
}
#endif

// x [M, K] (fp32 or bf16) @ packed weight^T -> [M, N] in x's dtype. One fp32 row takes
// qgemv; more rows multiply slices of dequantized rows (about 1 MB each) with torch's GEMM.
at::Tensor a8_dispatch_linear(at::Tensor x, at::Tensor w, int64_t fmt);   // cpu_a8.cpp
at::Tensor a8_embedding(at::Tensor ids, at::Tensor w, int64_t fmt, int64_t K, bool bf16);

at::Tensor qlinear(at::Tensor x, at::Tensor w, int64_t fmt) {
  if (fmt >= 4) return a8_dispatch_linear(x, w, fmt);     // 8-bit activations (cpu_a8.cpp)
  TORCH_CHECK(x.dim() == 2 && (x.scalar_type() == at::kFloat ||
                               x.scalar_type() == at::kBFloat16), "qlinear: fp32 or bf16 [M, K]");
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
  check_packed(w, fmt, K, "qlinear");
  x = x.contiguous();
#ifdef __AVX512F__
  if (M == 1 && x.scalar_type() == at::kFloat) return qgemv(x, w, fmt);
  if (M <= kSmallRows && x.scalar_type() == at::kFloat) return qlinear_small(x, w, fmt);
  if (M <= kSmallRows)        // bf16 rows: the same streaming kernels, on the rows in fp32
    return qlinear(x.to(at::kFloat), w, fmt).to(x.scalar_type());
#endif
  auto out = at::empty({M, N}, x.options());
  const int64_t chunk = std::min<int64_t>(N, std::max<int64_t>(64, (int64_t{1} << 18) / K));
  auto buf = at::empty({chunk, K}, at::kFloat);
  const uint8_t* wp = w.data_ptr<uint8_t>();
  for (int64_t n0 = 0; n0 < N; n0 += chunk) {
    const int64_t nc = std::min(chunk, N - n0);
    dequant_rows(wp, fmt, K, n0, nc, buf.data_ptr<float>());
    auto wt = buf.narrow(0, 0, nc);
    if (x.scalar_type() != at::kFloat) wt = wt.to(x.scalar_type());
    out.narrow(1, n0, nc).copy_(at::mm(x, wt.t()));
  }
  return out;
}

// Embedding rows of a packed table: ids [T] -> [T, K], fp32 (bf16 with `bf16`).
at::Tensor qembedding(at::Tensor ids, at::Tensor w, int64_t fmt, int64_t K,
                         bool bf16) {
  if (fmt >= 4) return a8_embedding(ids, w, fmt, K, bf16);
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
