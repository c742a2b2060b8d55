#include "sim/link/rig.h"

#include <algorithm>
#include <numeric>
#include <thread>

namespace duet::kv_bench {

void wait_quietly(MPI_Request& request) {
  for (int done = 0;;) {
    DUET_MPI_CHECK(MPI_Test(&request, &done, MPI_STATUS_IGNORE));
    if (done) return;
    std::this_thread::sleep_for(100us);
  }
}

void barrier_quietly(MPI_Comm comm) {
  MPI_Request request;
  DUET_MPI_CHECK(MPI_Ibarrier(comm, &request));
  wait_quietly(request);
}

ClockSync sync_clocks(MPI_Comm pair, int pair_rank) {
  constexpr int kRounds = 200;
  ClockSync sync;
  int* global = nullptr;
  int flag = 0;
  DUET_MPI_CHECK(MPI_Comm_get_attr(MPI_COMM_WORLD, MPI_WTIME_IS_GLOBAL, &global, &flag));
  sync.wtime_global = flag && global != nullptr && *global != 0;
  double fastest = 1e30;
  for (int i = 0; i < kRounds; ++i) {
    double t = 0.0;
    if (pair_rank == kPairReceiver) {
      const double t0 = MPI_Wtime();
      send_value(pair, kPairSender, t0);
      DUET_MPI_CHECK(MPI_Recv(&t, 1, MPI_DOUBLE, kPairSender, kTag, pair, MPI_STATUS_IGNORE));
      const double t1 = MPI_Wtime();
      if (t1 - t0 < fastest) {
        fastest = t1 - t0;
        sync.offset = t - 0.5 * (t0 + t1);
      }
    } else {
      DUET_MPI_CHECK(MPI_Recv(&t, 1, MPI_DOUBLE, kPairReceiver, kTag, pair, MPI_STATUS_IGNORE));
      send_value(pair, kPairReceiver, MPI_Wtime());
    }
  }
  sync.uncertainty = 0.5 * fastest;
  return sync;
}

Shape make_shape(const Args& args, const LlamaModel* model) {
  ModelConfig config;  // the flags' layout, or the model's
  config.n_layers = args.n_layers;
  config.n_kv_heads = args.n_kv_heads;
  config.head_dim = args.head_dim;
  if (model != nullptr) config = model->config();
  Shape shape;
  shape.n_tokens = args.n_tokens;
  shape.chunk = args.chunk > 0 ? args.chunk : args.n_tokens;
  DUET_REQUIRE(shape.n_tokens > 0 && shape.n_tokens % shape.chunk == 0,
               "--tokens ({}) must be a positive multiple of --chunk ({})", shape.n_tokens,
               shape.chunk);
  const int64_t block = KvLayout::kDefaultBlockSize;
  shape.layout = make_kv_layout(config, 2 * ((shape.n_tokens + block - 1) / block));
  return shape;
}

void fill_random(KvCache& cache, std::mt19937_64& rng) {
  std::generate_n(cache.data(), cache.layout().total_elems(),
                  [&] { return static_cast<KvElement>(rng()); });
}

void fill_blocks(KvCache& cache, const std::vector<int32_t>& table, std::mt19937_64* rng) {
  const KvLayout& layout = cache.layout();
  for (int64_t layer = 0; layer < layout.n_layers; ++layer) {
    for (const int32_t block : table) {
      KvElement* at = cache.data() + layer * layout.layer_elems() + block * layout.block_elems();
      if (rng != nullptr) {
        std::generate_n(at, layout.block_elems(), [&] { return static_cast<KvElement>((*rng)()); });
      } else {
        std::fill_n(at, layout.block_elems(), KvElement{0});
      }
    }
  }
}

std::vector<int32_t> shuffled_table(const Shape& shape, std::mt19937_64& rng) {
  std::vector<int32_t> table(static_cast<size_t>(shape.layout.n_blocks));
  std::iota(table.begin(), table.end(), 0);
  std::shuffle(table.begin(), table.end(), rng);
  table.resize(static_cast<size_t>(shape.table_blocks()));
  return table;
}

}  // namespace duet::kv_bench
