// Error checks for CUDA runtime, cuBLAS and NCCL calls, naming file and line.
#pragma once

#include <cublas_v2.h>
#include <cuda_runtime.h>
#include <nccl.h>

#include "common/error.h"
#include "common/format.h"

#define DUET_CUDA_CHECK(call)                                                               \
  do {                                                                                      \
    const cudaError_t duet_status = (call);                                                 \
    if (duet_status != cudaSuccess)                                                         \
      throw ::duet::Error(::duet::ErrorKind::kInternal,                                     \
                          ::duet::format("{}:{}: {} failed: {}", __FILE__, __LINE__, #call, \
                                         cudaGetErrorString(duet_status)));                 \
  } while (0)

#define DUET_CUBLAS_CHECK(call)                                                                    \
  do {                                                                                             \
    const cublasStatus_t duet_status = (call);                                                     \
    if (duet_status != CUBLAS_STATUS_SUCCESS)                                                      \
      throw ::duet::Error(::duet::ErrorKind::kInternal,                                            \
                          ::duet::format("{}:{}: {} failed: cuBLAS status {}", __FILE__, __LINE__, \
                                         #call, static_cast<int>(duet_status)));                   \
  } while (0)

#define DUET_NCCL_CHECK(call)                                                               \
  do {                                                                                      \
    const ncclResult_t duet_status = (call);                                                \
    if (duet_status != ncclSuccess)                                                         \
      throw ::duet::Error(::duet::ErrorKind::kInternal,                                     \
                          ::duet::format("{}:{}: {} failed: {}", __FILE__, __LINE__, #call, \
                                         ncclGetErrorString(duet_status)));                 \
  } while (0)
