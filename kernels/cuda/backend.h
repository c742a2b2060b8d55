// The CUDA backend's context: one GPU, one stream every op is queued on, a
// cuBLAS handle bound to it, and device memory. Plain C++ (no CUDA headers),
// so code outside kernels/cuda/ can hold one without knowing CUDA.
//
// Every op in kernels/cuda/ takes device pointers and a CudaBackend& where its
// CPU twin in kernels/cpu/ takes host pointers and a ThreadPool&; ops only
// queue work, so the host learns results at synchronize() or a download.
// Memory is plain cudaMalloc (never managed memory). Every CUDA call is
// checked and throws duet::Error naming the file and line.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

namespace duet::cuda {

// Owns one cudaMalloc allocation on the device current when it was made.
class DeviceBuffer {
 public:
  DeviceBuffer() = default;
  explicit DeviceBuffer(size_t bytes);
  ~DeviceBuffer();
  DeviceBuffer(DeviceBuffer&& other) noexcept;
  DeviceBuffer& operator=(DeviceBuffer&& other) noexcept;
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;

  void* data() const { return data_; }
  size_t bytes() const { return bytes_; }
  template <typename T>
  T* as() const {
    return static_cast<T*>(data_);
  }
  // Grows (never shrinks) to at least `bytes`; the contents are lost when it grows.
  void reserve(size_t bytes);

 private:
  void* data_ = nullptr;
  size_t bytes_ = 0;
};

// Page-locked host memory (cudaMallocHost): what asynchronous copies need.
class PinnedBuffer {
 public:
  PinnedBuffer() = default;
  explicit PinnedBuffer(size_t bytes);
  ~PinnedBuffer();
  PinnedBuffer(PinnedBuffer&& other) noexcept;
  PinnedBuffer& operator=(PinnedBuffer&& other) noexcept;
  PinnedBuffer(const PinnedBuffer&) = delete;
  PinnedBuffer& operator=(const PinnedBuffer&) = delete;

  void* data() const { return data_; }
  size_t bytes() const { return bytes_; }
  template <typename T>
  T* as() const {
    return static_cast<T*>(data_);
  }
  void reserve(size_t bytes);  // as DeviceBuffer::reserve

 private:
  void* data_ = nullptr;
  size_t bytes_ = 0;
};

// A captured sequence of the stream's work, replayed with one launch.
class Graph {
 public:
  Graph() = default;
  ~Graph();
  Graph(Graph&& other) noexcept;
  Graph& operator=(Graph&& other) noexcept;
  Graph(const Graph&) = delete;
  Graph& operator=(const Graph&) = delete;
  bool valid() const { return exec_ != nullptr; }

 private:
  friend class CudaBackend;
  void* exec_ = nullptr;  // cudaGraphExec_t
};

class CudaBackend {
 public:
  // Binds `device` (its index). Throws duet::Error (kUnsupported) with a
  // clear message when the machine has no such GPU or no driver.
  explicit CudaBackend(int device = 0);
  ~CudaBackend();
  CudaBackend(const CudaBackend&) = delete;
  CudaBackend& operator=(const CudaBackend&) = delete;

  int device() const { return device_; }
  // "NVIDIA H200 (sm_90, 139.8 GiB)"
  const std::string& name() const { return name_; }
  // cudaStream_t and cublasHandle_t, for kernels/cuda/ only.
  void* stream() const { return stream_; }
  void* cublas() const { return cublas_; }

  // Asynchronous copies on the stream. A host pointer must stay valid (and a
  // source unchanged) until synchronize(); pinned memory makes them truly
  // asynchronous.
  void upload(void* device, const void* host, size_t bytes);
  void download(void* host, const void* device, size_t bytes);
  void copy(void* device_to, const void* device_from, size_t bytes);
  // Waits for everything queued so far.
  void synchronize();

  // Makes this backend's GPU the calling thread's current device. Every
  // public entry of code that holds a backend calls it first: the thread
  // that built a backend is not always the one that runs it (the engine's).
  void bind() const;

  // Device scratch shared by ops within one op call (dequantized weight
  // tiles, converted activations). Valid until the next scratch() call.
  void* scratch(size_t bytes);
  // Grows the scratch to `bytes` now (nothing when it has them), so that
  // later scratch() calls of up to `bytes` never move it.
  void reserve_scratch(size_t bytes) { scratch(bytes); }
  // Counts the times scratch() moved its buffer: a graph captured over the
  // scratch is stale once this changes.
  int64_t scratch_generation() const { return scratch_generation_; }

  // CUDA graphs: between begin_capture() and end_capture() ops are recorded
  // instead of run; launch() replays them (same pointers, same shapes).
  void begin_capture();
  Graph end_capture();
  void launch(const Graph& graph);
  bool capturing() const { return capturing_; }

 private:
  int device_ = 0;
  void* stream_ = nullptr;  // cudaStream_t
  void* cublas_ = nullptr;  // cublasHandle_t
  DeviceBuffer scratch_;
  int64_t scratch_generation_ = 0;
  DeviceBuffer cublas_workspace_;  // fixed, so cuBLAS allocates nothing inside a graph capture
  std::string name_;
  bool capturing_ = false;
};

}  // namespace duet::cuda
