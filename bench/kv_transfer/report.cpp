#include "bench/kv_transfer/report.h"

#include <fmt/format.h>

#include <utility>

#include "common/stats.h"

namespace duet::kv_bench {
namespace {

// The median and every rep, in milliseconds.
Json timing_json(const std::vector<double>& seconds) {
  std::vector<double> ms;
  for (double s : seconds) ms.push_back(s * 1e3);
  return Json{{"median_ms", median(seconds) * 1e3}, {"ms", ms}};
}

}  // namespace

void report_transfer(const Shape& shape, const Args& args, const ClockSync& sync,
                     const RawTimes& raw, const TransferTimes& transfer, Json& json) {
  const double raw_s = median(raw.spinning);
  const double polled_s = median(raw.polled);
  const double huge_s = median(raw.polled_huge);
  const double blocks_s = median(raw.blocks);
  const double send_s = median(transfer.from_send);
  const double start_s = median(transfer.from_start);
  fmt::print(
      "\nKV of one transfer: {} tokens x {} layers x {} B/token/layer = {:.2f} MB, in {} "
      "messages of {} B ({} chunk(s) of {} tokens x {} layers); medians of {} reps\n",
      shape.n_tokens, shape.layout.n_layers,
      shape.layout.bytes_per_token() / static_cast<size_t>(shape.layout.n_layers),
      shape.total_payload() / 1e6, shape.n_messages(), shape.message_bytes(), shape.n_chunks(),
      shape.chunk, shape.layout.n_layers, args.reps);
  fmt::print("clocks: rank 1 - rank 2 = {:+.1f} us (+- {:.1f} us); MPI_WTIME_IS_GLOBAL = {}\n\n",
             sync.offset * 1e6, sync.uncertainty * 1e6, sync.wtime_global ? 1 : 0);
  fmt::print(
      "| path | ms | GB/s (wire) | GB/s (KV) | % of raw, polled | % of raw, polled, huge pages "
      "| % of raw, spinning | % of raw, block to block |\n"
      "|---|---|---|---|---|---|---|---|\n");
  const auto row = [&](const char* name, double s) {
    fmt::print("| {} | {:.3f} | {:.2f} | {:.2f} | {:.0f} | {:.0f} | {:.0f} | {:.0f} |\n", name,
               s * 1e3, shape.total_wire() / s / 1e9, shape.total_payload() / s / 1e9,
               100.0 * polled_s / s, 100.0 * huge_s / s, 100.0 * raw_s / s, 100.0 * blocks_s / s);
  };
  row("raw MPI, spinning: Isend window -> last Recv (Waitall, Recv)", raw_s);
  row(fmt::format("raw MPI, polled: all posted, Testall every {} us", args.transfer_poll_us)
          .c_str(),
      polled_s);
  row("raw MPI, polled, buffers on huge pages", huge_s);
  row("raw MPI, polled, block to block: a datatype over the blocks on each side", blocks_s);
  const std::string adapter = args.transport == "tcp"  ? "TcpKvTransfer"
                              : transfer.cma_bytes > 0 ? "MpiKvTransfer, payloads by CMA"
                                                       : "MpiKvTransfer, payloads over MPI";
  row(fmt::format("{}: first send_rows -> on_complete", adapter).c_str(), send_s);
  row(fmt::format("{}: start_import -> on_complete (with the order's trip)", adapter).c_str(),
      start_s);
  fmt::print(
      "\nstages: rank 1's send_rows loop (pack + queue) {:.3f} ms; without MPI, "
      "pack_kv_rows {:.3f} ms, unpack_kv_rows {:.3f} ms (every message)\n",
      median(transfer.send_loop) * 1e3, transfer.pack * 1e3, transfer.unpack * 1e3);
  fmt::print("\nreceived KV equals sent KV in every rep: {}\n", transfer.kv_equal ? "yes" : "NO");

  json["shape"] = {{"layers_kv_heads_head_dim",
                    {shape.layout.n_layers, shape.layout.n_kv_heads, shape.layout.head_dim}},
                   {"tokens", shape.n_tokens},
                   {"chunk", shape.chunk},
                   {"messages", shape.n_messages()},
                   {"message_bytes", shape.message_bytes()},
                   {"payload_bytes", shape.total_payload()}};
  json["reps"] = args.reps;
  json["transport"] = args.transport;
  json["cma_bytes"] = transfer.cma_bytes;
  json["clock"] = {{"offset_us", sync.offset * 1e6},
                   {"uncertainty_us", sync.uncertainty * 1e6},
                   {"wtime_is_global", sync.wtime_global}};
  json["raw"] = timing_json(raw.spinning);
  json["raw"]["gbps_wire"] = shape.total_wire() / raw_s / 1e9;
  json["raw_polled"] = timing_json(raw.polled);
  json["raw_polled"]["gbps_wire"] = shape.total_wire() / polled_s / 1e9;
  json["raw_polled_huge_pages"] = timing_json(raw.polled_huge);
  json["raw_polled_huge_pages"]["gbps_wire"] = shape.total_wire() / huge_s / 1e9;
  json["raw_blocks"] = timing_json(raw.blocks);
  json["transfer"] = {{"from_first_send", timing_json(transfer.from_send)},
                      {"from_start_import", timing_json(transfer.from_start)},
                      {"send_rows_loop", timing_json(transfer.send_loop)},
                      {"pack_alone_ms", transfer.pack * 1e3},
                      {"unpack_alone_ms", transfer.unpack * 1e3},
                      {"gbps_wire", shape.total_wire() / send_s / 1e9},
                      {"percent_of_raw", 100.0 * raw_s / send_s},
                      {"percent_of_raw_polled", 100.0 * polled_s / send_s},
                      {"percent_of_raw_polled_huge_pages", 100.0 * huge_s / send_s},
                      {"percent_of_raw_blocks", 100.0 * blocks_s / send_s},
                      {"kv_equal", transfer.kv_equal}};
  json["options"] = {{"checksums", args.checksums},
                     {"transfer_poll_us", args.transfer_poll_us},
                     {"max_idle_sleep_us", args.max_idle_sleep_us}};
}

void report_ttft(const Shape& shape, const Args& args, const TtftTimes& t, Json& json) {
  const std::vector<std::pair<const char*, std::vector<double>>> rows = {
      {"(a) local prefill, rank 2: submit -> first token", t.local},
      {"(b) disaggregated, rank 2: submit_import -> first token", t.ttft},
      {"(b) - (a)", t.added},
      {"order: submit_import (rank 2) -> order on rank 1's engine thread", t.order},
      {"rank 1 prefill with export: order -> first token sampled", t.prefill_export},
      {"rank 1 prefill without export: submit -> first token", t.local_rank1},
      {"export overhead: with - without (rank 1)", t.export_overhead},
      {"rank 1: last layer's KV stored -> first token sampled (its attention, FFN, head)", t.head},
      {"transfer tail: last layer stored -> handoff, every row in (rank 2)", t.tail},
      {"first token sampled (rank 1) -> handoff at rank 2", t.after_done},
      {"handoff: on_complete -> first token on rank 2", t.handoff},
      {"rank 2 CPU (communication thread) while waiting for the KV", t.wait_cpu},
  };
  fmt::print("\nTTFT of a {}-token prompt, {} compute thread(s) per rank, medians of {} reps\n\n",
             shape.n_tokens, args.threads, args.reps);
  fmt::print("| step | ms |\n|---|---|\n");
  Json& out = json["ttft"];
  for (const auto& [name, seconds] : rows) {
    fmt::print("| {} | {:.2f} |\n", name, median(seconds) * 1e3);
    out[name] = timing_json(seconds);
  }
  fmt::print(
      "\nper rep, (b) = order + (order -> last layer stored) + transfer tail + handoff\n"
      "first tokens equal in every rep (local on both ranks, disaggregated): {}\n",
      t.tokens_equal ? "yes" : "NO");
  out["tokens_equal"] = t.tokens_equal;
  out["threads"] = args.threads;
}

}  // namespace duet::kv_bench
