// Linear layers with 8-bit activations over 16-row interleaved low-bit weights
// ('gguf-a8', 'int8-a8'; platforms/quant.py's q4_1x16 (fmt 4), q8_0x16 (5), int8x16 (6)).
// cpu_quant.cpp's kernels keep fp32 activations, so per 32 weights they convert nibbles or
// bytes to floats and multiply: on two cores that is compute-bound at about a third of the
// memory bandwidth. Here each activation row is quantized once per call to int8 per 32-block
// (one fp32 scale d_x and the block's sum of q_x), and each block's products are summed in
// int32 by AVX-512 VNNI: vpdpbusd multiplies 64 unsigned weight bytes by 64 signed
// activation bytes and adds each 4 into one 32-bit lane. The weights are stored so that the
// 64 bytes are 16 output rows times 4 consecutive weights (lane r: row r), and the 4
// activation bytes are broadcast to every lane: one register holds 16 rows' sums, 8
// instructions do a 32-block. Per block and tile, in fp32:
//   Q4_1:  y += d_w * d_x * sum(q_w q_x) + m_w * d_x * sum(q_x)        (q_w in 0..15)
//   Q8_0:  y += d_w * d_x * (sum((q_w + 128) q_x) - 128 * sum(q_x))    (exact in int32)
//   INT8:  y += d_x * (same), times the row's scale at the end
// which is, up to fp32 rounding, the reference (quant.a8_linear): the dequantized
// activations times the dequantized weights. Rows that do not fill a tile (the last N % 16)
// are a tile of their own, interleaved R rows wide, read with masks. From 32 activation rows
// the full tiles run on AMX-INT8 instead, to the same bits (below).
#include "cpu_packed.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

static constexpr int64_t kTile = 16;

// One activation row -> q [K_pad] int8, d [K_pad / 32], s [K_pad / 32] (the sum of each
// block's q). d = max|x| * (1/127) and q = round-half-even(x * (1/d)), as
// quant.quantize_activations computes them (the reciprocal is a true division there and here).
static void quantize_row(const float* x, int64_t K, int8_t* q, float* d, int32_t* s) {
  const int64_t nb = padded(K) / 32;
  volatile float one = 1.0f;             // a division, never a reciprocal estimate
  for (int64_t b = 0; b < nb; ++b) {
    const int64_t n = std::min<int64_t>(32, K - b * 32);
#if defined(__AVX512F__) && defined(__AVX512BW__)
    const __mmask16 m0 = n >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << n) - 1);
    const __mmask16 m1 = n >= 32 ? 0xFFFF : n > 16 ? static_cast<__mmask16>((1u << (n - 16)) - 1) : 0;
    const __m512 x0 = _mm512_maskz_loadu_ps(m0, x + b * 32), x1 = _mm512_maskz_loadu_ps(m1, x + b * 32 + 16);
    const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(x0), _mm512_abs_ps(x1)));
    const float dd = amax * (1.0f / 127.0f);
    const __m512 id = _mm512_set1_ps(dd > 0.f ? one / dd : 0.f);
    const __m512i lo = _mm512_set1_epi32(-127), hi = _mm512_set1_epi32(127);
    const __m512i q0 = _mm512_min_epi32(hi, _mm512_max_epi32(lo, _mm512_cvtps_epi32(_mm512_mul_ps(x0, id))));
    const __m512i q1 = _mm512_min_epi32(hi, _mm512_max_epi32(lo, _mm512_cvtps_epi32(_mm512_mul_ps(x1, id))));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(q + b * 32), _mm512_cvtsepi32_epi8(q0));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(q + b * 32 + 16), _mm512_cvtsepi32_epi8(q1));
    d[b] = dd;
    s[b] = _mm512_reduce_add_epi32(_mm512_add_epi32(q0, q1));
#else
    float v[32];
    for (int64_t j = 0; j < 32; ++j) v[j] = j < n ? x[b * 32 + j] : 0.f;
    float amax = 0.f;
    for (int j = 0; j < 32; ++j) amax = std::max(amax, std::fabs(v[j]));
    const float dd = amax * (1.0f / 127.0f);
    const float id = dd > 0.f ? one / dd : 0.f;
    int32_t sum = 0;
    for (int j = 0; j < 32; ++j) {
      float r = std::nearbyint(v[j] * id);
      r = std::min(127.f, std::max(-127.f, r));
      q[b * 32 + j] = static_cast<int8_t>(r);
      sum += static_cast<int32_t>(r);
    }
    d[b] = dd;
    s[b] = sum;
#endif
  }
}

struct QuantizedRows {
  std::vector<int8_t> q;
  std::vector<float> d;
  std::vector<int32_t> s;
  int64_t kp, nb;
};

// `rows` >= M rows are allocated; those past M are zeros (whole AMX tiles of 16 rows).
static QuantizedRows quantize_rows(const float* x, int64_t M, int64_t K, int64_t rows = 0) {
  QuantizedRows r;
  r.kp = padded(K);
  r.nb = r.kp / 32;
  rows = std::max(rows, M);
  r.q.resize(rows * r.kp);
  r.d.resize(rows * r.nb);
  r.s.resize(rows * r.nb);
  at::parallel_for(0, M, 16, [&](int64_t b, int64_t e) {
    for (int64_t m = b; m < e; ++m)
      quantize_row(x + m * K, K, r.q.data() + m * r.kp, r.d.data() + m * r.nb,
                   r.s.data() + m * r.nb);
  });
  return r;
}

// x fp32 [M, K] -> (q int8 [M, K_pad], d fp32 [M, K_pad / 32]): for the tests, against
// quant.quantize_activations.
std::vector<at::Tensor> a8_quantize(at::Tensor x) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.dim() == 2, "a8_quantize: fp32 [M, K]");
  x = x.contiguous();
  const int64_t M = x.size(0), K = x.size(1);
  auto r = quantize_rows(x.data_ptr<float>(), M, K);
  auto q = at::empty({M, r.kp}, at::kChar);
  auto d = at::empty({M, r.nb}, at::kFloat);
  std::memcpy(q.data_ptr<int8_t>(), r.q.data(), r.q.size());
  std::memcpy(d.data_ptr<float>(), r.d.data(), r.d.size() * 4);
  return {q, d};
}

// x [M, K] fp32 or bf16 -> the same shape and dtype, each value as its 8-bit block gives it
// back (q * d: quant.dequantize_activations, bit for bit): what an 8-bit-activation format's
// product sees of x. A build without VNNI multiplies it with the weights' row format.
at::Tensor a8_round_trip(at::Tensor x) {
  TORCH_CHECK(x.dim() == 2 && (x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16),
              "a8_round_trip: fp32 or bf16 [M, K]");
  const bool bf = x.scalar_type() == at::kBFloat16;
  at::Tensor xf = bf ? x.to(at::kFloat).contiguous() : x.contiguous();
  const int64_t M = xf.size(0), K = xf.size(1);
  const auto r = quantize_rows(xf.data_ptr<float>(), M, K);
  auto y = at::empty({M, K}, xf.options());
  float* yp = y.data_ptr<float>();
  for (int64_t m = 0; m < M; ++m)
    for (int64_t k = 0; k < K; ++k)
      yp[m * K + k] = static_cast<float>(r.q[m * r.kp + k]) * r.d[m * r.nb + k / 32];
  return bf ? y.to(at::kBFloat16) : y;
}

#if defined(__AVX512F__) && defined(__AVX512VNNI__) && defined(__AVX512BW__)
static inline __m512i bcast4(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return _mm512_set1_epi32(v);
}

// One tile (R rows at t) against MT activation rows: y[m * ldy + r] for r < R. `ahead`:
// the first pass over the tile, which prefetches the next tile (later passes find this one
// in L1).
template <int MT>
static void tile_kernel(const uint8_t* t, int64_t fmt, int64_t R, int64_t nb, const int8_t* xq,
                        int64_t kp, const float* xd, const int32_t* xs, float* y, int64_t ldy,
                        bool ahead) {
  const __mmask16 rm = R == kTile ? 0xFFFF : static_cast<__mmask16>((1u << R) - 1);
  const __mmask64 bm = R == kTile ? ~0ull : (1ull << (4 * R)) - 1;
  const int64_t chunk = 4 * R;
  const int64_t next = ahead ? kTile * row_bytes(fmt, nb * 32) : 0;   // the next tile
  __m512 acc[MT], macc[MT];
  for (int m = 0; m < MT; ++m) acc[m] = _mm512_setzero_ps(), macc[m] = _mm512_setzero_ps();
  __m512i w[8];
  if (fmt == kQ4_1x16) {
    const __m512i low = _mm512_set1_epi8(0x0F);
    for (int64_t b = 0; b < nb; ++b) {
      const uint8_t* blk = t + b * 20 * R;
      for (int64_t o = 0; next && o < 20 * R; o += 64) prefetch(blk + next + o);
      const __m512 dw = _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(rm, blk));
      const __m512 mw = _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(rm, blk + 2 * R));
      for (int c = 0; c < 4; ++c) {
        const __m512i raw = _mm512_maskz_loadu_epi8(bm, blk + 4 * R + c * chunk);
        w[c] = _mm512_and_si512(raw, low);
        w[c + 4] = _mm512_and_si512(_mm512_srli_epi16(raw, 4), low);
      }
      for (int m = 0; m < MT; ++m) {
        const int8_t* q = xq + m * kp + b * 32;
        __m512i s = _mm512_setzero_si512();
        for (int g = 0; g < 8; ++g) s = _mm512_dpbusd_epi32(s, w[g], bcast4(q + 4 * g));
        const float dx = xd[m * nb + b];
        acc[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s), _mm512_mul_ps(dw, _mm512_set1_ps(dx)), acc[m]);
        macc[m] = _mm512_fmadd_ps(mw, _mm512_set1_ps(dx * static_cast<float>(xs[m * nb + b])),
                                  macc[m]);
      }
    }
    for (int m = 0; m < MT; ++m) acc[m] = _mm512_add_ps(acc[m], macc[m]);
  } else {
    const bool q8 = fmt == kQ8_0x16;
    const int64_t bb = q8 ? 34 * R : 32 * R;
    const uint8_t* base = q8 ? t : t + 4 * R;      // int8x16: the row scales come first
    for (int64_t b = 0; b < nb; ++b) {
      const uint8_t* blk = base + b * bb;
      for (int64_t o = 0; next && o < bb; o += 64) prefetch(blk + next + o);
      const uint8_t* qs = q8 ? blk + 2 * R : blk;
      const __m512 dw = q8 ? _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(rm, blk)) : _mm512_set1_ps(1.f);
      for (int g = 0; g < 8; ++g) w[g] = _mm512_maskz_loadu_epi8(bm, qs + g * chunk);
      for (int m = 0; m < MT; ++m) {
        const int8_t* q = xq + m * kp + b * 32;
        __m512i s = _mm512_set1_epi32(-128 * xs[m * nb + b]);
        for (int g = 0; g < 8; ++g) s = _mm512_dpbusd_epi32(s, w[g], bcast4(q + 4 * g));
        const __m512 dx = _mm512_set1_ps(xd[m * nb + b]);
        acc[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s), q8 ? _mm512_mul_ps(dw, dx) : dx, acc[m]);
      }
    }
    if (!q8) {
      const __m512 sw = _mm512_maskz_loadu_ps(rm, t);
      for (int m = 0; m < MT; ++m) acc[m] = _mm512_mul_ps(acc[m], sw);
    }
  }
  for (int m = 0; m < MT; ++m) _mm512_mask_storeu_ps(y + m * ldy, rm, acc[m]);
}

static constexpr int64_t kRowsPerPass = 4;
// Activation rows a pass over a tile multiplies with its unpacked weights (4 sums of 16
// rows in registers beside the 8 weight registers); the tile (at most 16 x K bytes) stays in
// L1 between passes.

// Tiles [i0, i1) of y = x @ w^T by VNNI, every activation row.
static void vnni_tiles(const QuantizedRows& xq, int64_t M, const uint8_t* wp, int64_t fmt,
                       int64_t N, int64_t rb, float* yp, int64_t i0, int64_t i1) {
  for (int64_t i = i0; i < i1; ++i) {
    const int64_t R = std::min(kTile, N - i * kTile);
    const uint8_t* t = wp + i * kTile * rb;
    int64_t m = 0;
    for (; m + kRowsPerPass <= M; m += kRowsPerPass)
      tile_kernel<kRowsPerPass>(t, fmt, R, xq.nb, xq.q.data() + m * xq.kp, xq.kp,
                                xq.d.data() + m * xq.nb, xq.s.data() + m * xq.nb,
                                yp + m * N + i * kTile, N, m == 0);
    for (; m < M; ++m)
      tile_kernel<1>(t, fmt, R, xq.nb, xq.q.data() + m * xq.kp, xq.kp,
                     xq.d.data() + m * xq.nb, xq.s.data() + m * xq.nb,
                     yp + m * N + i * kTile, N, m == 0);
  }
}

#if defined(__AMX_TILE__) && defined(__AMX_INT8__)
// Several activation rows: AMX-INT8. One TDPBSSD multiplies 16 activation rows' block (16 x
// 32 signed bytes, tile A) by a weight tile's block (B: 8 rows of 64 bytes, row g holding the
// 16 output rows' weights 4g..4g+3, which is how a tile stores a block) into 16 x 16 int32
// sums, the work of 128 vpdpbusd. Each block's sums are then scaled into fp32 by AVX-512
// exactly as tile_kernel scales its own (the same int32 sums, the same fmas in the same
// order), so both paths give the same bits and the engine's numbers do not depend on which
// ran. The scaling, not the tile multiply, is the loop's cost: 3 vector ops a row a block.
#include <sys/syscall.h>
#include <unistd.h>

static constexpr int64_t kAmxMinRows = 32;
// Activation rows from which AMX runs. Measured on SmolLM2's shapes (2 threads): below 16
// rows VNNI is 1.5-4x faster (AMX pays a whole 16-row pass and its scaling whatever M is);
// at 16 they are about even; from 32 up AMX is 1.0-1.55x (docs/benchmarks.md).

// Linux gives a process the tile registers' state only on request (once per process).
static bool amx_ready() {
  static const bool ok = [] {
    constexpr long kReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
    return syscall(SYS_arch_prctl, kReqXcompPerm, kXfeatureXtiledata) == 0;
  }();
  return ok;
}

struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// tmm0/1: C, 16 x 16 int32; tmm2/3: A, 16 activation rows x one 32-byte block; tmm4/5: B, a
// block of a weight tile. Two of each, so one block's multiply overlaps the last's scaling.
static void amx_configure() {
  TileConfig c;
  for (int t : {0, 1}) c.rows[t] = 16, c.colsb[t] = 64;
  for (int t : {2, 3}) c.rows[t] = 16, c.colsb[t] = 32;
  for (int t : {4, 5}) c.rows[t] = 8, c.colsb[t] = 64;
  // GCC 12's intrinsic tells the compiler it reads 8 bytes of the 64, which then may store
  // the rest after it (an invalid configuration: #GP): all stores are done before it.
  asm volatile("" : : "r"(&c) : "memory");
  _tile_loadconfig(&c);
}

// A full tile (16 rows) as AMX reads it: per block 512 signed bytes (B), 16 fp32 scales (1
// for INT8, whose row scales come at the end) and Q4_1's 16 mins.
struct UnpackedTile {
  std::vector<int8_t> q;
  std::vector<float> d, m;
};

static void unpack_tile(const uint8_t* t, int64_t fmt, int64_t nb, UnpackedTile& u) {
  u.q.resize(nb * 512);
  u.d.resize(nb * kTile);
  u.m.resize(fmt == kQ4_1x16 ? nb * kTile : 0);
  const __m512i low = _mm512_set1_epi8(0x0F), flip = _mm512_set1_epi8(static_cast<char>(0x80));
  for (int64_t b = 0; b < nb; ++b) {
    int8_t* q = u.q.data() + b * 512;
    if (fmt == kQ4_1x16) {
      const uint8_t* blk = t + b * 20 * kTile;
      _mm512_storeu_ps(u.d.data() + b * kTile, _mm512_cvtph_ps(_mm256_loadu_si256(
          reinterpret_cast<const __m256i*>(blk))));
      _mm512_storeu_ps(u.m.data() + b * kTile, _mm512_cvtph_ps(_mm256_loadu_si256(
          reinterpret_cast<const __m256i*>(blk + 2 * kTile))));
      for (int c = 0; c < 4; ++c) {
        const __m512i raw = _mm512_loadu_si512(blk + 4 * kTile + c * 64);
        _mm512_storeu_si512(q + c * 64, _mm512_and_si512(raw, low));
        _mm512_storeu_si512(q + (c + 4) * 64, _mm512_and_si512(_mm512_srli_epi16(raw, 4), low));
      }
    } else {
      const bool q8 = fmt == kQ8_0x16;
      const uint8_t* blk = q8 ? t + b * 34 * kTile : t + 4 * kTile + b * 32 * kTile;
      _mm512_storeu_ps(u.d.data() + b * kTile, q8 ? _mm512_cvtph_ps(_mm256_loadu_si256(
          reinterpret_cast<const __m256i*>(blk))) : _mm512_set1_ps(1.f));
      const uint8_t* qs = q8 ? blk + 2 * kTile : blk;
      for (int g = 0; g < 8; ++g)       // stored q + 128 (for vpdpbusd): back to signed
        _mm512_storeu_si512(q + g * 64, _mm512_xor_si512(_mm512_loadu_si512(qs + g * 64), flip));
    }
  }
}

// The activation rows as the passes read them: each 16 rows' block is 512 contiguous bytes
// (`a`: [M / 16][nb][16][32], one stream a pass instead of 16 rows kp bytes apart), and
// Q4_1's d_x * sum(q_x) per row and block (tile_kernel's product, computed once a call).
struct AmxRows {
  QuantizedRows rows;     // M rounded up to 16 rows, zeros past M
  std::vector<int8_t> a;
  std::vector<float> ds;
};

static AmxRows amx_rows(const float* x, int64_t M, int64_t K, bool q4) {
  AmxRows r{quantize_rows(x, M, K, (M + 15) / 16 * 16), {}, {}};
  const int64_t rows = r.rows.d.size() / r.rows.nb, nb = r.rows.nb, kp = r.rows.kp;
  r.a.resize(rows * kp);
  for (int64_t p = 0; p < rows / 16; ++p)
    for (int64_t b = 0; b < nb; ++b)
      for (int64_t m = 0; m < 16; ++m)
        std::memcpy(r.a.data() + ((p * nb + b) * 16 + m) * 32,
                    r.rows.q.data() + (p * 16 + m) * kp + b * 32, 32);
  if (q4) {
    r.ds.resize(rows * nb);
    for (int64_t i = 0; i < rows * nb; ++i)
      r.ds[i] = r.rows.d[i] * static_cast<float>(r.rows.s[i]);
  }
  return r;
}

// One block's 16 x 16 sums into `out`, in tiles C, A, B (GCC's tile intrinsics are macros
// that paste the register number: literals only).
#define BLOCK_PRODUCT(C, A, B, a, lda, w, out) \
  do {                                        \
    _tile_zero(C);                            \
    _tile_loadd(A, a, lda);                   \
    _tile_loadd(B, w, 64);                    \
    _tile_dpbssd(C, A, B);                    \
    _tile_stored(C, out, 64);                 \
  } while (0)

// One 16-row pass's tile products, every block's 16 x 16 sums into c (nb KB).
static void amx_products(const int8_t* a, const int8_t* q, int64_t nb, int32_t* c) {
  int64_t b = 0;
  for (; b + 1 < nb; b += 2) {
    BLOCK_PRODUCT(0, 2, 4, a + b * 512, 32, q + b * 512, c + b * 256);
    BLOCK_PRODUCT(1, 3, 5, a + b * 512 + 512, 32, q + b * 512 + 512, c + b * 256 + 256);
  }
  if (b < nb) BLOCK_PRODUCT(0, 2, 4, a + b * 512, 32, q + b * 512, c + b * 256);
}

// The pass of 16 activation rows from m0 (rows of them real) times the unpacked tile at t,
// from its products c: acc[r] += sums[r] * (d_w * d_x[r]), tile_kernel's fma, with the 16
// rows' sums in registers. With `na`, the next pass's products go into nc a block at a time
// in between, so the tile unit multiplies while the vector units scale.
static void amx_scale(const UnpackedTile& u, const uint8_t* t, int64_t fmt, int64_t nb,
                      const AmxRows& x, int64_t m0, int64_t rows, const int32_t* c, float* y,
                      int64_t ldy, const int8_t* na, int32_t* nc) {
  const float* xd = x.rows.d.data() + m0 * nb;
  const int8_t* q = u.q.data();
  __m512 acc[16];
#pragma GCC unroll 16
  for (int r = 0; r < 16; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    if (na && (b & 1)) BLOCK_PRODUCT(1, 3, 5, na + b * 512, 32, q + b * 512, nc + b * 256);
    else if (na) BLOCK_PRODUCT(0, 2, 4, na + b * 512, 32, q + b * 512, nc + b * 256);
    const __m512 dw = _mm512_loadu_ps(u.d.data() + b * kTile);
    const int32_t* cb = c + b * 256;
#pragma GCC unroll 16
    for (int r = 0; r < 16; ++r)
      acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_loadu_si512(cb + 16 * r)),
                               _mm512_mul_ps(dw, _mm512_set1_ps(xd[r * nb + b])), acc[r]);
  }
  if (fmt == kQ4_1x16) {          // + m_w * d_x * sum(q_x), summed apart as tile_kernel does
    const float* ds = x.ds.data() + m0 * nb;
#pragma GCC unroll 16
    for (int r = 0; r < 16; ++r) {
      __m512 macc = _mm512_setzero_ps();
      for (int64_t k = 0; k < nb; ++k)
        macc = _mm512_fmadd_ps(_mm512_loadu_ps(u.m.data() + k * kTile),
                               _mm512_set1_ps(ds[r * nb + k]), macc);
      acc[r] = _mm512_add_ps(acc[r], macc);
    }
  } else if (fmt == kInt8x16) {   // the rows' scales
    const __m512 sw = _mm512_loadu_ps(reinterpret_cast<const float*>(t));
#pragma GCC unroll 16
    for (int r = 0; r < 16; ++r) acc[r] = _mm512_mul_ps(acc[r], sw);
  }
#pragma GCC unroll 16
  for (int r = 0; r < 16; ++r)
    if (r < rows) _mm512_storeu_ps(y + r * ldy, acc[r]);
}

// Full tiles [i0, i1) of y = x @ w^T, every activation row (x has whole 16-row passes).
static void amx_tiles(const AmxRows& x, int64_t M, const uint8_t* wp, int64_t fmt,
                      int64_t N, int64_t rb, float* yp, int64_t i0, int64_t i1) {
  amx_configure();
  UnpackedTile u;
  const int64_t nb = x.rows.nb, passes = (M + 15) / 16, pass_bytes = 16 * nb * 32;
  std::vector<int32_t> c(2 * nb * 256);     // this pass's products and the next one's
  for (int64_t i = i0; i < i1; ++i) {
    const uint8_t* t = wp + i * kTile * rb;
    unpack_tile(t, fmt, nb, u);
    amx_products(x.a.data(), u.q.data(), nb, c.data());
    for (int64_t p = 0; p < passes; ++p) {
      int32_t* cur = c.data() + (p & 1) * nb * 256;
      int32_t* next = c.data() + ((p + 1) & 1) * nb * 256;
      const int8_t* na = p + 1 < passes ? x.a.data() + (p + 1) * pass_bytes : nullptr;
      amx_scale(u, t, fmt, nb, x, p * 16, std::min<int64_t>(16, M - p * 16), cur,
                yp + p * 16 * N + i * kTile, N, na, next);
    }
  }
  _tile_release();
}
#undef BLOCK_PRODUCT
#endif

// Whether a8_linear can run AMX here (the CPU, the compiler and the OS allow it).
bool a8_amx() {
#if defined(__AMX_TILE__) && defined(__AMX_INT8__)
  return amx_ready();
#else
  return false;
#endif
}

// x [M, K] fp32 @ tiled weight^T -> [M, N] fp32. Threads split the tiles. `amx`: 1 forces
// AMX (where the CPU and kernel allow it), 0 VNNI, -1 (the default) chooses by M.
at::Tensor a8_linear(at::Tensor x, at::Tensor w, int64_t fmt, int64_t amx) {
  TORCH_CHECK(x.dim() == 2 && (x.scalar_type() == at::kFloat ||
                               x.scalar_type() == at::kBFloat16), "a8_linear: fp32 or bf16 [M, K]");
  if (x.scalar_type() != at::kFloat)
    return a8_linear(x.to(at::kFloat), w, fmt, amx).to(x.scalar_type());
  x = x.contiguous();
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0), rb = w.size(1);
  check_packed(w, fmt, K, "a8_linear");
  auto y = at::empty({M, N}, x.options());
  const uint8_t* wp = w.data_ptr<uint8_t>();
  float* yp = y.data_ptr<float>();
  const int64_t tiles = (N + kTile - 1) / kTile;
#if defined(__AMX_TILE__) && defined(__AMX_INT8__)
  if ((amx > 0 || (amx < 0 && M >= kAmxMinRows)) && amx_ready()) {
    const auto xa = amx_rows(x.data_ptr<float>(), M, K, fmt == kQ4_1x16);
    const int64_t full = N / kTile;   // a last tile of fewer rows: VNNI's masked loads
    at::parallel_for(0, tiles, 1, [&](int64_t b, int64_t e) {
      if (std::min(e, full) > b) amx_tiles(xa, M, wp, fmt, N, rb, yp, b, std::min(e, full));
      if (e > full) vnni_tiles(xa.rows, M, wp, fmt, N, rb, yp, std::max(b, full), e);
    });
    return y;
  }
#endif
  const auto xq = quantize_rows(x.data_ptr<float>(), M, K);
  at::parallel_for(0, tiles, 1, [&](int64_t b, int64_t e) {
    vnni_tiles(xq, M, wp, fmt, N, rb, yp, b, e);
  });
  return y;
}
#endif

// Rows `ids` of a tiled table, fp32 [T, K] (bf16 with `bf16`): the embedding lookup, the
// reference's numbers exactly (d * q + m in fp32, two roundings, as gguf's numpy computes).
#pragma GCC push_options
#pragma GCC optimize("fp-contract=off")
static void a8_row(const uint8_t* w, int64_t fmt, int64_t N, int64_t K, int64_t id, float* out) {
  const int64_t rb = row_bytes(fmt, K), tile = id / kTile, r = id % kTile;
  const int64_t R = std::min(kTile, N - tile * kTile), nb = padded(K) / 32;
  const uint8_t* t = w + tile * kTile * rb;
  if (fmt == kQ4_1x16) {
    for (int64_t b = 0; b < nb; ++b) {
      const uint8_t* blk = t + b * 20 * R;
      const float d = half_at(blk + 2 * r), m = half_at(blk + 2 * R + 2 * r);
      for (int c = 0; c < 4; ++c)
        for (int j = 0; j < 4; ++j) {
          const uint8_t v = blk[4 * R + c * 4 * R + 4 * r + j];
          out[b * 32 + 4 * c + j] = d * static_cast<float>(v & 0x0F) + m;
          out[b * 32 + 16 + 4 * c + j] = d * static_cast<float>(v >> 4) + m;
        }
    }
    return;
  }
  const bool q8 = fmt == kQ8_0x16;
  float scale = 1.f;
  if (!q8) std::memcpy(&scale, t + 4 * r, 4);
  const uint8_t* base = q8 ? t : t + 4 * R;
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* blk = base + b * (q8 ? 34 : 32) * R;
    const float d = q8 ? half_at(blk + 2 * r) : scale;
    const uint8_t* qs = q8 ? blk + 2 * R : blk;
    for (int g = 0; g < 8; ++g)
      for (int j = 0; j < 4; ++j) {
        const int64_t k = b * 32 + 4 * g + j;
        if (k < K) out[k] = d * static_cast<float>(static_cast<int>(qs[g * 4 * R + 4 * r + j]) - 128);
      }
  }
}
#pragma GCC pop_options

at::Tensor a8_embedding(at::Tensor ids, at::Tensor w, int64_t fmt, int64_t K, bool bf16) {
  check_packed(w, fmt, K, "a8_embedding");
  ids = ids.contiguous().to(at::kLong);
  const int64_t T = ids.numel(), N = w.size(0);
  auto out = at::empty({T, K}, at::kFloat);
  const int64_t* ip = ids.data_ptr<int64_t>();
  for (int64_t t = 0; t < T; ++t) TORCH_CHECK(ip[t] >= 0 && ip[t] < N, "a8_embedding: id out of range");
  const uint8_t* wp = w.data_ptr<uint8_t>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, T, 16, [&](int64_t b, int64_t e) {
    for (int64_t t = b; t < e; ++t) a8_row(wp, fmt, N, K, ip[t], op + t * K);
  });
  return bf16 ? out.to(at::kBFloat16) : out;
}

// cpu_quant.cpp's qlinear and qembedding hand the tiled formats (fmt >= 4) here.
at::Tensor a8_dispatch_linear(at::Tensor x, at::Tensor w, int64_t fmt) {
#if defined(__AVX512F__) && defined(__AVX512VNNI__) && defined(__AVX512BW__)
  return a8_linear(x, w, fmt, -1);
#else
  TORCH_CHECK(false, "a8_linear: this CPU has no AVX-512 VNNI (the torch reference runs it)");
  return x;
#endif
}
