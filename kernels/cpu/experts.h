// The mixture of experts' own ops (the expert products are ordinary matmuls):
// the router's picks, and moving rows to and from an expert's batch.
#pragma once

#include <cstdint>
#include <span>

#include "kernels/cpu/kernel_table.h"
#include "kernels/cpu/thread_pool.h"
#include "kernels/op_params.h"

namespace duet::cpu {

// For each row of logits (n_rows, n_experts), as llama.cpp's build_moe_ffn on
// its CPU backend: the softmax (exp by ggml's polynomial over whole 16-expert
// chunks, summed per chunk by the lane tree, then the C library's expf for
// the rest, the sum in double), the shape's n_used most probable experts in
// decreasing probability (ties: the lower index) into picked (n_rows, n_used),
// and their probabilities over their sum (clamped to at least 2^-14) into
// weights (n_rows, n_used). The same bits on every ISA.
void route_experts(const KernelTable& kernels, const float* logits, int64_t n_rows,
                   const RouterShape& shape, int32_t* picked, float* weights);

// The router's logits: out (n_rows, n_experts) = x (n_rows, k) times the
// router's F32 rows w (n_experts, k), each row in llama.cpp's order for its
// token (common/model/token_order.h): one-token rows (one_token[r] != 0) as
// ggml_vec_dot_f32 (dot_f32_lanes' groups 4), the others as its tinyBLAS GEMM
// (groups 1) where it runs one (k % 16 == 0 and n_experts % 4 == 0), else as
// ggml_vec_dot_f32. The picks turn on these logits' last bits.
void router_logits(const KernelTable& kernels, const float* x, int64_t n_rows, const float* w,
                   int64_t n_experts, int64_t k, std::span<const uint8_t> one_token, float* out,
                   ThreadPool& pool);

// out[i] (width) = x[rows[i]] (width), for every i.
void gather_rows(const float* x, int64_t width, std::span<const int32_t> rows, float* out);

// out[slots[i]] (width) = y[i] * weights[slots[i]], element by element.
void scatter_weighted(const float* y, int64_t width, std::span<const int32_t> slots,
                      const float* weights, float* out);

// out[r] (width) = ((picks[r][0] + picks[r][1]) + picks[r][2]) + ... over the
// n_used rows of picks (n_rows, n_used, width): llama.cpp's chain of adds.
void sum_picks(const float* picks, int64_t n_rows, int64_t n_used, int64_t width, float* out);

}  // namespace duet::cpu
