// Throughput of batched decode attention at the default model's shape
// (SmolLM2-135M: 9 query heads over 3 KV heads of 64, 16-token KV blocks):
// one layer's attention_batch for n_seq sequences of one query token each,
// every sequence `ctx` tokens into its (randomly filled) cache, for each ISA
// path this CPU runs, both reduction orders, 1 and 2 threads. Successive
// iterations visit the model's 30 layers in turn, so that the cache is read
// from memory as in a decode step, not from the last level cache.
//
// Reports items/s as sequences (tokens) per second for the one layer.
//
// The prefill cases: one sequence's last `n_q` prompt tokens, in the
// multi-token order, at the end of a `ctx`-token prompt (the last chunk of
// a long prefill); items/s are query tokens per second for the one layer.
// prefill1b: the same at Llama 3.2 1B's shape (32 query heads over 8 KV heads
// of 64); decode1b: 32 sequences' decode at that shape.
//
//   duet-attention-bench --benchmark_filter='avx512/.*/n_seq:32/'
//   duet-attention-bench --benchmark_filter='prefill/avx512'
#include <benchmark/benchmark.h>

#include <cmath>
#include <cstdint>
#include <numeric>
#include <random>
#include <span>
#include <string>
#include <vector>

#include "bench/kernel_bench.h"
#include "common/huge_pages.h"
#include "common/model/fp16.h"
#include "common/model/kv_layout.h"
#include "kernels/cpu/attention.h"
#include "kernels/cpu/isa.h"
#include "kernels/cpu/kernel_table.h"
#include "kernels/cpu/thread_pool.h"

namespace duet::cpu {
namespace {

constexpr int64_t kHeads = 9;
constexpr int64_t kKvHeads = 3;
constexpr int64_t kHeadDim = 64;
constexpr int64_t kBlockSize = 16;
constexpr int64_t kLayers = 30;

struct AttentionCase {
  Isa isa;
  bool one_token;  // the rows' reduction order: llama.cpp's one-token or multi-token
  int64_t n_seq;
  int64_t ctx;
  int n_threads;
  int64_t n_q = 1;  // query rows per sequence: its last n_q positions
  int64_t heads = kHeads;
  int64_t kv_heads = kKvHeads;
};

void bench_attention(benchmark::State& state, AttentionCase c) {
  const KernelTable& kernels = kernel_table(c.isa);
  ThreadPool pool(c.n_threads);
  std::mt19937 rng(7);
  std::normal_distribution<float> normal(0.0f, 1.0f);

  const int64_t blocks_per_seq = (c.ctx + kBlockSize - 1) / kBlockSize;
  KvLayout layout;
  layout.n_layers = kLayers;
  layout.n_kv_heads = c.kv_heads;
  layout.head_dim = kHeadDim;
  layout.block_size = kBlockSize;
  layout.n_blocks = blocks_per_seq * c.n_seq;
  // On huge pages where the kernel has them, as the engine's cache is (worker/kv/kv_cache.h).
  HugePageMemory memory(layout.total_bytes());
  const std::span cache(reinterpret_cast<KvElement*>(memory.data()),
                        static_cast<size_t>(layout.total_elems()));
  for (KvElement& e : cache) e = fp32_to_fp16(normal(rng));

  // Sequence i owns blocks i, i + n_seq, ...: interleaved, as a pool hands them out.
  std::vector<std::vector<int32_t>> tables(static_cast<size_t>(c.n_seq));
  std::vector<AttentionSequence> sequences;
  for (int64_t i = 0; i < c.n_seq; ++i) {
    auto& table = tables[static_cast<size_t>(i)];
    for (int64_t b = 0; b < blocks_per_seq; ++b)
      table.push_back(static_cast<int32_t>(b * c.n_seq + i));
    sequences.push_back(
        {table, c.ctx - c.n_q, c.n_q, i * c.n_q, c.one_token ? 0 : kNoOneTokenRows});
  }
  AttentionShape shape;
  shape.n_heads = c.heads;
  shape.n_kv_heads = c.kv_heads;
  shape.head_dim = kHeadDim;
  shape.scale = 1.0f / std::sqrt(static_cast<float>(kHeadDim));
  std::vector<float> q(static_cast<size_t>(c.n_seq * c.n_q * c.heads * kHeadDim));
  for (float& v : q) v = normal(rng);
  std::vector<float> out(q.size());

  int64_t layer = 0;
  for (auto _ : state) {
    attention_batch(kernels, layout, cache.data(), layer, sequences, shape, q.data(), out.data(),
                    pool);
    layer = (layer + 1) % kLayers;
    benchmark::DoNotOptimize(out.data());
    benchmark::ClobberMemory();
  }
  state.SetItemsProcessed(state.iterations() * c.n_seq * c.n_q);
}

void register_benchmarks() {
  for (Isa isa : {Isa::kScalar, Isa::kAvx2, Isa::kAvx512}) {
    if (!cpu_supports(isa)) continue;
    for (bool one_token : {false, true}) {
      for (int64_t n_seq : {1, 32}) {
        for (int n_threads : {1, 2}) {
          const AttentionCase c{isa, one_token, n_seq, 192, n_threads};
          const std::string name =
              "attention/" + std::string(isa_name(isa)) + "/" +
              (one_token ? "one_token" : "multi_token") + "/n_seq:" + std::to_string(n_seq) +
              "/ctx:" + std::to_string(c.ctx) + "/threads:" + std::to_string(n_threads);
          register_kernel_bench(name, bench_attention, c);
        }
      }
    }
    for (bool one_token : {false, true}) {
      for (int n_threads : {1, 2}) {
        const AttentionCase c{isa, one_token, 32, 192, n_threads, 1, 32, 8};
        register_kernel_bench("decode1b/" + std::string(isa_name(isa)) + "/" +
                                  (one_token ? "one_token" : "multi_token") +
                                  "/n_seq:32/ctx:192/threads:" + std::to_string(n_threads),
                              bench_attention, c);
      }
    }
    for (int64_t ctx : {2048, 8000}) {
      for (int n_threads : {1, 2}) {
        const AttentionCase c{isa, false, 1, ctx, n_threads, 256};
        const std::string name = "prefill/" + std::string(isa_name(isa)) +
                                 "/n_q:256/ctx:" + std::to_string(ctx) +
                                 "/threads:" + std::to_string(n_threads);
        register_kernel_bench(name, bench_attention, c);
      }
    }
    for (int n_threads : {1, 2}) {
      const AttentionCase c{isa, false, 1, 8000, n_threads, 256, 32, 8};
      register_kernel_bench("prefill1b/" + std::string(isa_name(isa)) +
                                "/n_q:256/ctx:8000/threads:" + std::to_string(n_threads),
                            bench_attention, c);
    }
  }
}

}  // namespace
}  // namespace duet::cpu

int main(int argc, char** argv) {
  return duet::cpu::kernel_bench_main(argc, argv, duet::cpu::register_benchmarks);
}
