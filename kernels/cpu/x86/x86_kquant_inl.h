// BF16 and K-quant (Q4_K, Q5_K, Q6_K) dot products for the x86 paths, in the orders
// kernel_table.h fixes. Included into the AVX2 and the AVX-512 translation
// units (internal linkage), each compiling it with its own instruction set:
//  - BF16 keeps its 16 float lanes in two 256-bit registers under AVX2 and in
//    one 512-bit register under AVX-512; every lane sees the same FMAs.
//  - K-quants compute a super-block's exact integers per 32-element chunk
//    with maddubs + madd under AVX2, and two chunks per 512-bit register with
//    maddubs + vpdpwssd under AVX-512 (the halves folded at the block's end),
//    then sum the lanes; the float steps per super-block are scalar, the same
//    in both (kernel_table.h). Batched AVX-512 calls take the tiled VNNI GEMM
//    (kquant_gemm_avx512_inl.h), which computes the same integers.
// Tiles: each weight block is unpacked once and used for every activation row
// of the tile, each row with its own accumulators, so a pair's operations do
// not depend on the tile's row count (batch invariance).
#pragma once

#include <immintrin.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>

#include "common/model/fp16.h"
#include "common/model/quant_blocks.h"
#include "kernels/cpu/x86/x86_kernels_inl.h"

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512DQ__) && \
    defined(__AVX512VNNI__)
#define DUET_X86_512 1
#else
#define DUET_X86_512 0
#endif

namespace duet::cpu {
namespace {

// ---------------------------------------------------------------------------
// BF16 x BF16: 16 float lanes per 32-element chunk (vdpbf16ps's order).

// The odd (high half) and even (low half) BF16 elements of 32-bit words as
// floats: word l holds elements 2l (low 16 bits) and 2l + 1 (high 16 bits).
#if DUET_X86_512
struct Bf16Lanes {
  __m512 v;
  static Bf16Lanes zero() { return {_mm512_setzero_ps()}; }
  struct Chunk {
    __m512 odd, even;
  };
  static Chunk load(const uint16_t* p) {
    const __m512i words = _mm512_loadu_si512(p);
    return {_mm512_castsi512_ps(
                _mm512_and_si512(words, _mm512_set1_epi32(static_cast<int>(0xffff0000u)))),
            _mm512_castsi512_ps(_mm512_slli_epi32(words, 16))};
  }
  void add(const Chunk& w, const Chunk& x) {
    v = _mm512_fmadd_ps(w.odd, x.odd, v);
    v = _mm512_fmadd_ps(w.even, x.even, v);
  }
  float sum() const { return tree_sum16(_mm512_castps512_ps256(v), _mm512_extractf32x8_ps(v, 1)); }
};
#else
struct Bf16Lanes {
  __m256 lo, hi;  // lanes 0-7 and 8-15
  static Bf16Lanes zero() { return {_mm256_setzero_ps(), _mm256_setzero_ps()}; }
  struct Chunk {
    __m256 odd_lo, even_lo, odd_hi, even_hi;
  };
  static Chunk load(const uint16_t* p) {
    const __m256i mask = _mm256_set1_epi32(static_cast<int>(0xffff0000u));
    const __m256i lo = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    const __m256i hi = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 16));
    return {_mm256_castsi256_ps(_mm256_and_si256(lo, mask)),
            _mm256_castsi256_ps(_mm256_slli_epi32(lo, 16)),
            _mm256_castsi256_ps(_mm256_and_si256(hi, mask)),
            _mm256_castsi256_ps(_mm256_slli_epi32(hi, 16))};
  }
  void add(const Chunk& w, const Chunk& x) {
    lo = _mm256_fmadd_ps(w.odd_lo, x.odd_lo, lo);
    lo = _mm256_fmadd_ps(w.even_lo, x.even_lo, lo);
    hi = _mm256_fmadd_ps(w.odd_hi, x.odd_hi, hi);
    hi = _mm256_fmadd_ps(w.even_hi, x.even_hi, hi);
  }
  float sum() const { return tree_sum16(lo, hi); }
};
#endif

template <int NX>
struct Bf16Tile {
  static void run(const uint8_t* w, size_t w_stride, int64_t n_w, const uint8_t* x, size_t x_stride,
                  int64_t k, float* y, int64_t ldy) {
    const int64_t k32 = k - k % 32;
    for (int64_t j = 0; j < n_w; ++j) {
      const auto* wr = reinterpret_cast<const uint16_t*>(w + j * w_stride);
      Bf16Lanes acc[NX];
      for (int r = 0; r < NX; ++r) acc[r] = Bf16Lanes::zero();
      for (int64_t e = 0; e < k32; e += 32) {
        const Bf16Lanes::Chunk wc = Bf16Lanes::load(wr + e);
        for (int r = 0; r < NX; ++r) {
          acc[r].add(wc, Bf16Lanes::load(reinterpret_cast<const uint16_t*>(x + r * x_stride) + e));
        }
      }
      for (int r = 0; r < NX; ++r) {
        const auto* xr = reinterpret_cast<const uint16_t*>(x + r * x_stride);
        float sum = acc[r].sum();
        for (int64_t e = k32; e < k; ++e)
          sum = std::fma(bf16_to_fp32(wr[e]), bf16_to_fp32(xr[e]), sum);
        y[r * ldy + j] = sum;
      }
    }
  }
};

void dot_bf16_x86(const uint8_t* w, size_t w_stride, int64_t n_w, const uint8_t* x, size_t x_stride,
                  int64_t n_x, int64_t k, float* y, int64_t ldy) {
  run_row_tiles<Bf16Tile>(w, w_stride, n_w, x, x_stride, n_x, k, y, ldy);
}

// ---------------------------------------------------------------------------
// K-quants: the integer core. A block's 256 elements are 8 chunks of 32; an
// IntVec holds kChunksPerVec chunks of unsigned weights (or their int16
// scales), and int_dot_add adds scale * (4-element dot) into int32 lanes.

#if DUET_X86_512
using IntVec = __m512i;
constexpr int kChunksPerVec = 2;
inline IntVec int_zero() { return _mm512_setzero_si512(); }
inline IntVec load_x(const int8_t* p) { return _mm512_loadu_si512(p); }
inline IntVec join_chunks(__m256i lo, __m256i hi) {
  return _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1);
}
inline IntVec int_dot_add(IntVec acc, IntVec scale16, IntVec u, IntVec s) {
  return _mm512_dpwssd_epi32(acc, scale16, _mm512_maddubs_epi16(u, s));
}
inline IntVec int_add(IntVec a, IntVec b) { return _mm512_add_epi32(a, b); }
inline __m256i fold(IntVec v) {
  return _mm256_add_epi32(_mm512_castsi512_si256(v), _mm512_extracti64x4_epi64(v, 1));
}
// Activation rows per tile (accumulators fit the 32 vector registers).
constexpr int kKQuantRowTile = 8;
#else
using IntVec = __m256i;
constexpr int kChunksPerVec = 1;
inline IntVec int_zero() { return _mm256_setzero_si256(); }
inline IntVec load_x(const int8_t* p) {
  return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
}
inline IntVec int_dot_add(IntVec acc, IntVec scale16, IntVec u, IntVec s) {
  return _mm256_add_epi32(acc, _mm256_madd_epi16(scale16, _mm256_maddubs_epi16(u, s)));
}
inline IntVec int_add(IntVec a, IntVec b) { return _mm256_add_epi32(a, b); }
inline __m256i fold(IntVec v) { return v; }
constexpr int kKQuantRowTile = kRowTile;
#endif
constexpr int kVecsPerBlock = 8 / kChunksPerVec;

// Chunks c (weights or int16 scales of 32 elements each), kChunksPerVec per vector.
inline void pack_chunks(const __m256i* chunks, IntVec* out) {
  for (int v = 0; v < kVecsPerBlock; ++v) {
#if DUET_X86_512
    out[v] = join_chunks(chunks[2 * v], chunks[2 * v + 1]);
#else
    out[v] = chunks[v];
#endif
  }
}

// Two chains of even and odd vectors: a super-block's integers end in a
// horizontal sum and float steps, so a shorter chain lets the next block's
// work overlap them (one weight row at a time, in decode).
inline __m256i sum_chunks(const IntVec* w, const IntVec* scale, const BlockQ8_K& x) {
  IntVec sum[2] = {int_zero(), int_zero()};
  for (int v = 0; v < kVecsPerBlock; ++v) {
    sum[v % 2] = int_dot_add(sum[v % 2], scale[v], w[v], load_x(x.qs + 32 * kChunksPerVec * v));
  }
  return fold(int_add(sum[0], sum[1]));
}

// The sum of 8 (or 4) int32 lanes, exact.
inline int32_t hsum_epi32(__m128i v) {
  v = _mm_add_epi32(v, _mm_unpackhi_epi64(v, v));
  v = _mm_add_epi32(v, _mm_shuffle_epi32(v, 1));
  return _mm_cvtsi128_si32(v);
}
inline int32_t hsum_epi32(__m256i v) {
  return hsum_epi32(_mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1)));
}

// The K-quants' float steps for one super-block (kernel_table.h); dmin_w is
// 0 for Q6_K, whose M is 0 (then the fma adds -0 and changes nothing).
inline float kquant_step(int32_t s, int32_t m, float d_w, float dmin_w, float d_x, float y) {
  float r = static_cast<float>(s) * d_w;
  r = std::fma(-dmin_w, static_cast<float>(m), r);
  return std::fma(r, d_x, y);
}

// Q4_K's and Q5_K's 6-bit scales (sc_m[0..7]) and mins (sc_m[8..15]),
// ggml's unpacking of the 12 bytes.
[[gnu::always_inline]] inline void q4_k_scales_mins(const uint8_t* scales, uint8_t* sc_m) {
  constexpr uint32_t kmask1 = 0x3f3f3f3f, kmask2 = 0x0f0f0f0f, kmask3 = 0x03030303;
  uint32_t utmp[4];
  std::memcpy(utmp, scales, 12);
  utmp[3] = ((utmp[2] >> 4) & kmask2) | (((utmp[1] >> 6) & kmask3) << 4);
  const uint32_t uaux = utmp[1] & kmask1;
  utmp[1] = (utmp[2] & kmask2) | (((utmp[0] >> 6) & kmask3) << 4);
  utmp[2] = uaux;
  utmp[0] &= kmask1;
  std::memcpy(sc_m, utmp, 16);
}

// Each format: unpack_q gives a block's 8 chunks of 32 unsigned weights in
// element order; unpack adds the scales the row kernels use; accumulate
// takes one super-block's step.
//
// Q4_K: chunk c is sub-block c.
struct Q4KFormat {
  using WeightBlock = BlockQ4_K;
  static constexpr int kSubBlocks = 8;
  static constexpr bool kHasMin = true;
  struct Unpacked {
    IntVec q[kVecsPerBlock];
    IntVec scale[kVecsPerBlock];
    __m128i mins;  // 8 int16
    float d, dmin;
  };
  using Acc = float;
  static Acc zero() { return 0.0f; }

  [[gnu::always_inline]] static void unpack_q(const WeightBlock& b, __m256i* q) {
    unpack_nibbles(b.qs, q);
  }

  [[gnu::always_inline]] static void unpack(const WeightBlock& b, Unpacked* u) {
    __m256i q[8];
    unpack_q(b, q);
    unpack_scales(b, q, u);
  }

  // Q4_K's and Q5_K's scales and mins, with the chunks' weights q.
  template <typename Block, typename Out>
  [[gnu::always_inline]] static void unpack_scales(const Block& b, const __m256i* q, Out* u) {
    uint8_t sc_m[16];
    q4_k_scales_mins(b.scales, sc_m);
    const __m128i sc_m16 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(sc_m));
    u->mins = _mm_cvtepu8_epi16(_mm_srli_si128(sc_m16, 8));
    pack_chunks(q, u->q);
#if DUET_X86_512
    // Vector v: 16 words of sc[2v], then 16 of sc[2v + 1].
    const __m512i scales16 = _mm512_zextsi128_si512(_mm_cvtepu8_epi16(sc_m16));
    for (int v = 0; v < kVecsPerBlock; ++v) {
      const __m512i index =
          _mm512_inserti64x4(_mm512_set1_epi16(static_cast<int16_t>(2 * v)),
                             _mm256_set1_epi16(static_cast<int16_t>(2 * v + 1)), 1);
      u->scale[v] = _mm512_permutexvar_epi16(index, scales16);
    }
#else
    // Vector c: 16 words of sc[c] (bytes 2c, 2c + 1 of the words, repeated).
    const __m256i scales16 = _mm256_broadcastsi128_si256(_mm_cvtepu8_epi16(sc_m16));
    for (int c = 0; c < 8; ++c) {
      const __m256i index = _mm256_set1_epi16(static_cast<int16_t>((2 * c + 1) << 8 | 2 * c));
      u->scale[c] = _mm256_shuffle_epi8(scales16, index);
    }
#endif
    u->d = half_to_float(b.d);
    u->dmin = half_to_float(b.dmin);
  }

  // The low nibbles of chunks 2g (low halves of bytes) and 2g + 1 (high halves).
  [[gnu::always_inline]] static void unpack_nibbles(const uint8_t* qs, __m256i* q) {
    const __m256i m4 = _mm256_set1_epi8(0x0f);
    for (int g = 0; g < 4; ++g) {
      const __m256i bits = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qs + 32 * g));
      q[2 * g] = _mm256_and_si256(bits, m4);
      q[2 * g + 1] = _mm256_and_si256(_mm256_srli_epi16(bits, 4), m4);
    }
  }

  [[gnu::always_inline]] static void accumulate(const Unpacked& w, const BlockQ8_K& x, Acc* acc) {
    // M's 4 lanes: the 8 sub-blocks' mins times the Q8_K sub-block sums.
    const __m256i bsums = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x.bsums));
    const __m128i sums32 =
        _mm_hadd_epi16(_mm256_castsi256_si128(bsums), _mm256_extracti128_si256(bsums, 1));
    const __m128i m4 = _mm_madd_epi16(w.mins, sums32);
    // S's 8 lanes folded to 4, then both summed at once: {S, M, S, M}.
    const __m256i s8 = sum_chunks(w.q, w.scale, x);
    const __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(s8), _mm256_extracti128_si256(s8, 1));
    __m128i sm = _mm_hadd_epi32(s4, m4);
    sm = _mm_hadd_epi32(sm, sm);
    *acc = kquant_step(_mm_cvtsi128_si32(sm), _mm_extract_epi32(sm, 1), w.d, w.dmin, x.d, *acc);
  }

  static float finish(const Acc& acc) { return acc; }
};

// Q5_K: Q4_K's chunks with each element's fifth bit (bit c of qh[l] for
// chunk c) added as 16.
struct Q5KFormat : Q4KFormat {
  using WeightBlock = BlockQ5_K;

  [[gnu::always_inline]] static void unpack_q(const WeightBlock& b, __m256i* q) {
    Q4KFormat::unpack_nibbles(b.qs, q);
    const __m256i high = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b.qh));
    const __m256i one = _mm256_set1_epi8(1);
    for (int c = 0; c < 8; ++c) {
      const __m256i bit = _mm256_and_si256(_mm256_srli_epi16(high, c), one);
      q[c] = _mm256_or_si256(q[c], _mm256_slli_epi16(bit, 4));
    }
  }

  [[gnu::always_inline]] static void unpack(const WeightBlock& b, Unpacked* u) {
    __m256i q[8];
    unpack_q(b, q);
    Q4KFormat::unpack_scales(b, q, u);
  }
};

// Q6_K: chunk c covers sub-blocks 2c (lanes 0-3) and 2c + 1 (lanes 4-7); the
// weights stay unsigned (0..63) and the -32 offset comes off through bsums.
struct Q6KFormat {
  using WeightBlock = BlockQ6_K;
  static constexpr int kSubBlocks = 16;
  static constexpr bool kHasMin = false;
  struct Unpacked {
    IntVec q[kVecsPerBlock];
    IntVec scale[kVecsPerBlock];
    __m256i scales16;  // the 16 sub-block scales as int16
    float d;
  };
  using Acc = float;
  static Acc zero() { return 0.0f; }

  [[gnu::always_inline]] static void unpack_q(const WeightBlock& b, __m256i* q) {
    const __m256i m15 = _mm256_set1_epi8(15), m3 = _mm256_set1_epi8(3);
    for (int h = 0; h < 2; ++h) {
      const __m256i ql1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b.ql + 64 * h));
      const __m256i ql2 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b.ql + 64 * h + 32));
      const __m256i qh = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b.qh + 32 * h));
      const __m256i h0 = _mm256_slli_epi16(_mm256_and_si256(qh, m3), 4);
      const __m256i h1 = _mm256_slli_epi16(_mm256_and_si256(qh, _mm256_set1_epi8(12)), 2);
      const __m256i h2 = _mm256_and_si256(qh, _mm256_set1_epi8(48));
      const __m256i h3 = _mm256_srli_epi16(_mm256_and_si256(qh, _mm256_set1_epi8(-64)), 2);
      q[4 * h + 0] = _mm256_or_si256(_mm256_and_si256(ql1, m15), h0);
      q[4 * h + 1] = _mm256_or_si256(_mm256_and_si256(ql2, m15), h1);
      q[4 * h + 2] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(ql1, 4), m15), h2);
      q[4 * h + 3] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(ql2, 4), m15), h3);
    }
  }

  [[gnu::always_inline]] static void unpack(const WeightBlock& b, Unpacked* u) {
    __m256i q[8], scale[8];
    unpack_q(b, q);
    u->scales16 = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(b.scales)));
    // Chunk c: words of sc[2c] in the low half, of sc[2c + 1] in the high half.
    const __m256i halves[2] = {
        _mm256_broadcastsi128_si256(_mm256_castsi256_si128(u->scales16)),
        _mm256_broadcastsi128_si256(_mm256_extracti128_si256(u->scales16, 1))};
    for (int c = 0; c < 8; ++c) {
      const int w = 2 * (c % 4);  // word of sc[2c] within its half
      const __m256i index =
          _mm256_set_m128i(_mm_set1_epi16(static_cast<int16_t>((2 * w + 3) << 8 | (2 * w + 2))),
                           _mm_set1_epi16(static_cast<int16_t>((2 * w + 1) << 8 | 2 * w)));
      scale[c] = _mm256_shuffle_epi8(halves[c / 4], index);
    }
    pack_chunks(q, u->q);
    pack_chunks(scale, u->scale);
    u->d = half_to_float(b.d);
  }

  [[gnu::always_inline]] static void accumulate(const Unpacked& w, const BlockQ8_K& x, Acc* acc) {
    const __m256i bsums = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x.bsums));
    const __m256i offset = _mm256_slli_epi32(_mm256_madd_epi16(bsums, w.scales16), 5);
    const int32_t s = hsum_epi32(_mm256_sub_epi32(sum_chunks(w.q, w.scale, x), offset));
    *acc = std::fma(static_cast<float>(s) * w.d, x.d, *acc);
  }

  static float finish(const Acc& acc) { return acc; }
};

template <typename Format>
struct KQuantTile {
  template <int NX>
  struct Tile {
    static void run(const uint8_t* w, size_t w_stride, int64_t n_w, const uint8_t* x,
                    size_t x_stride, int64_t k, float* y, int64_t ldy) {
      using WB = typename Format::WeightBlock;
      const int64_t nb = k / kSuperBlock;
      for (int64_t j = 0; j < n_w; ++j) {
        const auto* wb = reinterpret_cast<const WB*>(w + j * w_stride);
        typename Format::Acc acc[NX];
        for (int r = 0; r < NX; ++r) acc[r] = Format::zero();
        typename Format::Unpacked u;
        for (int64_t b = 0; b < nb; ++b) {
          prefetch_ahead(wb + b);
          Format::unpack(wb[b], &u);
          for (int r = 0; r < NX; ++r) {
            Format::accumulate(u, reinterpret_cast<const BlockQ8_K*>(x + r * x_stride)[b], &acc[r]);
          }
        }
        for (int r = 0; r < NX; ++r) y[r * ldy + j] = Format::finish(acc[r]);
      }
    }
  };
};

template <int NX>
using Q4KTile = KQuantTile<Q4KFormat>::Tile<NX>;
template <int NX>
using Q5KTile = KQuantTile<Q5KFormat>::Tile<NX>;
template <int NX>
using Q6KTile = KQuantTile<Q6KFormat>::Tile<NX>;

// The AVX2 batched K-quant path (prefill, batched decode; AVX-512 takes the
// tiled VNNI GEMM from kquant512::kMinRows rows on): each weight row's
// blocks are unpacked once into a panel and used by a pass of up to 64
// activation rows, where the row tiles unpack them again for every
// kKQuantRowTile rows (the unpacking costs about one row's accumulation).
// Each (weight row, activation row) pair runs the row tiles' operations: the
// same accumulate per block in order from Format::zero(), the same finish;
// only the reuse changes, so the result is bit-identical to theirs.
namespace kquant_gemm {

// Rows of up to this many super-blocks (k <= 32768) take this path; the
// panel of one weight row lives on the stack (at most 72 KiB with AVX-512).
constexpr int64_t kMaxBlocks = 128;
// The activation rows of a pass are chosen so that their blocks fit in this
// many bytes, about half of a core's L2: every weight row streams them again.
constexpr int64_t kActBudgetBytes = 256 << 10;
constexpr int64_t kMaxPassRows = 64;  // a matmul task's at most
// From this many activation rows on; below, the row tiles' unpacking per
// kKQuantRowTile rows is what a panel would cost anyway.
constexpr int64_t kMinRows = 2 * kKQuantRowTile;

// Activation rows [0, NX) against one unpacked weight row (nb blocks).
template <typename Format, int NX>
void run_rows(const typename Format::Unpacked* panel, int64_t nb, const uint8_t* x, size_t x_stride,
              float* y, int64_t ldy) {
  typename Format::Acc acc[NX];
  for (int r = 0; r < NX; ++r) acc[r] = Format::zero();
  for (int64_t b = 0; b < nb; ++b) {
    for (int r = 0; r < NX; ++r) {
      Format::accumulate(panel[b], reinterpret_cast<const BlockQ8_K*>(x + r * x_stride)[b],
                         &acc[r]);
    }
  }
  for (int r = 0; r < NX; ++r) y[r * ldy] = Format::finish(acc[r]);
}

template <typename Format, int NX = kKQuantRowTile - 1>
void run_rest(int64_t rest, const typename Format::Unpacked* panel, int64_t nb, const uint8_t* x,
              size_t x_stride, float* y, int64_t ldy) {
  if constexpr (NX > 0) {
    if (rest == NX) return run_rows<Format, NX>(panel, nb, x, x_stride, y, ldy);
    run_rest<Format, NX - 1>(rest, panel, nb, x, x_stride, y, ldy);
  }
}

// The DotTileFn contract (kernel_table.h) for k / 256 <= kMaxBlocks.
template <typename Format>
void gemm(const uint8_t* w, size_t w_stride, int64_t n_w, const uint8_t* x, size_t x_stride,
          int64_t n_x, int64_t k, float* y, int64_t ldy) {
  using WB = typename Format::WeightBlock;
  const int64_t nb = k / kSuperBlock;
  const int64_t budget_rows = kActBudgetBytes / (nb * static_cast<int64_t>(sizeof(BlockQ8_K)));
  const int64_t pass_rows = std::clamp<int64_t>(budget_rows / kKQuantRowTile * kKQuantRowTile,
                                                kKQuantRowTile, kMaxPassRows);
  typename Format::Unpacked panel[kMaxBlocks];
  for (int64_t i0 = 0; i0 < n_x; i0 += pass_rows) {
    const int64_t n_i = std::min(pass_rows, n_x - i0);
    for (int64_t j = 0; j < n_w; ++j) {
      const auto* wb = reinterpret_cast<const WB*>(w + j * w_stride);
      for (int64_t b = 0; b < nb; ++b) Format::unpack(wb[b], &panel[b]);
      int64_t i = i0;
      for (; i + kKQuantRowTile <= i0 + n_i; i += kKQuantRowTile) {
        run_rows<Format, kKQuantRowTile>(panel, nb, x + i * x_stride, x_stride, y + i * ldy + j,
                                         ldy);
      }
      run_rest<Format>(i0 + n_i - i, panel, nb, x + i * x_stride, x_stride, y + i * ldy + j, ldy);
    }
  }
}

}  // namespace kquant_gemm

}  // namespace
}  // namespace duet::cpu

#if DUET_X86_512
#include "kernels/cpu/x86/kquant_gemm_avx512_inl.h"
#endif

namespace duet::cpu {
namespace {

template <typename Format, template <int> class Tile>
void dot_kquant(const uint8_t* w, size_t w_stride, int64_t n_w, const uint8_t* x, size_t x_stride,
                int64_t n_x, int64_t k, float* y, int64_t ldy) {
#if DUET_X86_512
  if (n_x >= kquant512::kMinRows) {
    kquant512::gemm<Format>(w, w_stride, n_w, x, x_stride, n_x, k, y, ldy);
    return;
  }
#endif
  if (n_x >= kquant_gemm::kMinRows && k / kSuperBlock <= kquant_gemm::kMaxBlocks) {
    kquant_gemm::gemm<Format>(w, w_stride, n_w, x, x_stride, n_x, k, y, ldy);
  } else {
    run_row_tiles<Tile, kKQuantRowTile>(w, w_stride, n_w, x, x_stride, n_x, k, y, ldy);
  }
}

void dot_q4_k_x86(const uint8_t* w, size_t w_stride, int64_t n_w, const uint8_t* x, size_t x_stride,
                  int64_t n_x, int64_t k, float* y, int64_t ldy) {
  dot_kquant<Q4KFormat, Q4KTile>(w, w_stride, n_w, x, x_stride, n_x, k, y, ldy);
}

void dot_q5_k_x86(const uint8_t* w, size_t w_stride, int64_t n_w, const uint8_t* x, size_t x_stride,
                  int64_t n_x, int64_t k, float* y, int64_t ldy) {
  dot_kquant<Q5KFormat, Q5KTile>(w, w_stride, n_w, x, x_stride, n_x, k, y, ldy);
}

void dot_q6_k_x86(const uint8_t* w, size_t w_stride, int64_t n_w, const uint8_t* x, size_t x_stride,
                  int64_t n_x, int64_t k, float* y, int64_t ldy) {
  dot_kquant<Q6KFormat, Q6KTile>(w, w_stride, n_w, x, x_stride, n_x, k, y, ldy);
}

}  // namespace
}  // namespace duet::cpu

#undef DUET_X86_512
