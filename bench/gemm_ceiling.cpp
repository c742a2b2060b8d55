// The most an AVX2 GEMM can do while keeping Duet's arithmetic for
// block-quantized weights: every output's 8 int32 lanes of each 32-element
// block product converted and FMA'd into 8 float lanes with the block's scale
// (kernels/cpu/kernels_scalar.cpp defines it; every path matches it bit for
// bit). On AVX2, without VNNI, that is per output and block:
//
//   signed (Q8_0, Q5_0):  sign, maddubs, madd, cvt, fma
//   unsigned (Q4_1):            maddubs, madd, cvt, fma
//
// (Q4_0 sums each block into one integer first, kernel_table.h: its float
// step is one FMA per block for 8 outputs at once, so this does not bound it.)
//
// This runs exactly that sequence in the GEMM's 2 x 4 register tile on
// operands that stay in L1 (16 blocks, aligned), with nothing else: no
// packing, no activation stream, no reduction. Its FLOP rate bounds what the
// real kernel (quant_gemm_avx2_inl.h) can reach on this CPU, which is how
// docs/BENCHMARKS.md tells a missed prefill target from a slow kernel.
//
// With AVX-512 VNNI the same order (Q8_0, Q5_0 and Q4_1 keep it: llama.cpp's
// own on x86) costs per output pair and block at least vpdpbusd, cvt and fma
// on 8 lanes; the AVX-512 GEMM (quant_gemm_avx512_inl.h) puts two pairs in a
// register. `ceiling/avx512/lanes_tile_4x8` runs those three instructions in
// its 4 x 8 register tile (16 accumulators, a broadcast scale each) and
// nothing else.
//
//   duet-matmul-bench --benchmark_filter=ceiling
#include "bench/gemm_ceiling.h"

#include <immintrin.h>

#include <cstdint>
#include <random>

#include "kernels/cpu/isa.h"

namespace duet::cpu {
namespace {

constexpr int kBlocks = 16;
constexpr int kWeightRows = 2, kActRows = 4;

struct alignas(32) Operands {
  int8_t w[kBlocks][kWeightRows][32];
  int8_t x[kBlocks][kActRows][32];
  float scales[kBlocks][8];
};

template <bool kSigned>
__attribute__((target("avx2,fma"))) void run_tiles(const Operands& op, int64_t passes, float* out) {
  const __m256i ones = _mm256_set1_epi16(1);
  __m256 acc[kWeightRows][kActRows];
  for (auto& row : acc)
    for (auto& a : row) a = _mm256_setzero_ps();
  for (int64_t pass = 0; pass < passes; ++pass) {
    for (int b = 0; b < kBlocks; ++b) {
      __m256i w[kWeightRows], u[kWeightRows];
      for (int j = 0; j < kWeightRows; ++j) {
        w[j] = _mm256_load_si256(reinterpret_cast<const __m256i*>(op.w[b][j]));
        u[j] = kSigned ? _mm256_sign_epi8(w[j], w[j]) : w[j];
      }
      for (int i = 0; i < kActRows; ++i) {
        const __m256i x = _mm256_load_si256(reinterpret_cast<const __m256i*>(op.x[b][i]));
        for (int j = 0; j < kWeightRows; ++j) {
          const __m256i s = kSigned ? _mm256_sign_epi8(x, w[j]) : x;
          const __m256i lanes = _mm256_madd_epi16(_mm256_maddubs_epi16(u[j], s), ones);
          acc[j][i] = _mm256_fmadd_ps(_mm256_broadcast_ss(&op.scales[b][4 * j + i]),
                                      _mm256_cvtepi32_ps(lanes), acc[j][i]);
        }
      }
    }
  }
  __m256 sum = _mm256_setzero_ps();
  for (auto& row : acc)
    for (auto& a : row) sum = _mm256_add_ps(sum, a);
  _mm256_storeu_ps(out, sum);
}

// 4 weight rows x 4 activation pairs of zmm accumulators (two pairs each).
// GCC 12's _mm512_cvtepi32_ps passes _mm512_undefined_ps(), which it then
// reports as uninitialized inside a target("avx512f") function.
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
__attribute__((target("avx512f,avx512bw,avx512vnni"))) void run_tiles_512(const Operands& op,
                                                                          int64_t passes,
                                                                          float* out) {
  constexpr int kRows = 4, kPairs = 4;
  __m512 acc[kRows][kPairs];
  for (auto& row : acc)
    for (auto& a : row) a = _mm512_setzero_ps();
  const auto* w = reinterpret_cast<const __m512i*>(op.w);  // 2 x 16 x 64 bytes: 8 blocks' rows
  const auto* x = reinterpret_cast<const __m512i*>(op.x);
  for (int64_t pass = 0; pass < passes; ++pass) {
    for (int b = 0; b < kBlocks / 2; ++b) {
      __m512i xv[kPairs];
      for (int p = 0; p < kPairs; ++p) xv[p] = _mm512_load_si512(x + (b * kPairs + p) % 32);
      for (int j = 0; j < kRows; ++j) {
        const __m512i wv = _mm512_load_si512(w + (b * kRows + j) % 16);
        for (int p = 0; p < kPairs; ++p) {
          const __m512i dot = _mm512_dpbusd_epi32(_mm512_setzero_si512(), xv[p], wv);
          acc[j][p] = _mm512_fmadd_ps(_mm512_set1_ps(op.scales[b][(j + p) % 8]),
                                      _mm512_cvtepi32_ps(dot), acc[j][p]);
        }
      }
    }
  }
  __m512 sum = _mm512_setzero_ps();
  for (auto& row : acc)
    for (auto& a : row) sum = _mm512_add_ps(sum, a);
  alignas(64) float lanes[16];
  _mm512_store_ps(lanes, sum);
  for (int i = 0; i < 8; ++i) out[i] = lanes[i] + lanes[i + 8];
}
#pragma GCC diagnostic pop

// Operands of the tile: weights drawn from [w_lo, w_hi], activations from
// [-127, 127], every scale 1e-3.
Operands random_operands(int w_lo, int w_hi) {
  Operands op{};
  std::mt19937 rng(7);
  std::uniform_int_distribution<int> weight(w_lo, w_hi);
  std::uniform_int_distribution<int> act(-127, 127);
  for (auto& block : op.w)
    for (auto& row : block)
      for (int8_t& v : row) v = static_cast<int8_t>(weight(rng));
  for (auto& block : op.x)
    for (auto& row : block)
      for (int8_t& v : row) v = static_cast<int8_t>(act(rng));
  for (auto& block : op.scales)
    for (float& v : block) v = 1e-3f;
  return op;
}

using RunTiles = void (*)(const Operands&, int64_t, float*);

// Times `run` over `op`, reporting FLOP/s from `flops_per_pass`.
void time_tiles(benchmark::State& state, const Operands& op, RunTiles run, double flops_per_pass) {
  constexpr int64_t kPasses = 4096;
  alignas(32) float out[8];
  for (auto _ : state) {
    run(op, kPasses, out);
    benchmark::DoNotOptimize(out);
  }
  state.counters["FLOP"] =
      benchmark::Counter(flops_per_pass * kPasses * static_cast<double>(state.iterations()),
                         benchmark::Counter::kIsRate);
}

void bench_ceiling_512(benchmark::State& state) {
  // Per pass: 4 weight rows x 8 activation rows x 32 elements, kBlocks / 2 blocks.
  time_tiles(state, random_operands(-127, 127), run_tiles_512, 2.0 * 32 * 4 * 8 * (kBlocks / 2));
}

void bench_ceiling(benchmark::State& state, bool is_signed) {
  time_tiles(state, is_signed ? random_operands(-8, 7) : random_operands(0, 15),
             is_signed ? run_tiles<true> : run_tiles<false>,
             2.0 * 32 * kWeightRows * kActRows * kBlocks);
}

}  // namespace

void register_gemm_ceiling_benchmarks() {
  if (cpu_supports(Isa::kAvx512)) {
    benchmark::RegisterBenchmark("ceiling/avx512/lanes_tile_4x8", bench_ceiling_512)
        ->Unit(benchmark::kMicrosecond);
  }
  if (!cpu_supports(Isa::kAvx2)) return;
  for (bool is_signed : {true, false}) {
    benchmark::RegisterBenchmark(
        is_signed ? "ceiling/avx2/signed_tile_2x4" : "ceiling/avx2/unsigned_tile_2x4",
        bench_ceiling, is_signed)
        ->Unit(benchmark::kMicrosecond);
  }
}

}  // namespace duet::cpu
