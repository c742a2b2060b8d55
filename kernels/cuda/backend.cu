#include <cublas_v2.h>
#include <cuda_runtime.h>

#include <utility>

#include "kernels/cuda/backend.h"
#include "kernels/cuda/check.h"

namespace duet::cuda {
namespace {

// cuBLAS's own workspace (its documentation asks for one set explicitly
// before work is captured into a graph); 32 MiB covers Hopper's largest.
constexpr size_t kCublasWorkspaceBytes = size_t{32} << 20;

cudaStream_t as_stream(void* stream) { return static_cast<cudaStream_t>(stream); }

}  // namespace

DeviceBuffer::DeviceBuffer(size_t bytes) { reserve(bytes); }

DeviceBuffer::~DeviceBuffer() {
  if (data_ != nullptr) cudaFree(data_);
}

DeviceBuffer::DeviceBuffer(DeviceBuffer&& other) noexcept
    : data_(std::exchange(other.data_, nullptr)), bytes_(std::exchange(other.bytes_, 0)) {}

DeviceBuffer& DeviceBuffer::operator=(DeviceBuffer&& other) noexcept {
  if (this != &other) {
    if (data_ != nullptr) cudaFree(data_);
    data_ = std::exchange(other.data_, nullptr);
    bytes_ = std::exchange(other.bytes_, 0);
  }
  return *this;
}

void DeviceBuffer::reserve(size_t bytes) {
  if (bytes <= bytes_) return;
  if (data_ != nullptr) {
    DUET_CUDA_CHECK(cudaFree(data_));
    data_ = nullptr;
    bytes_ = 0;
  }
  DUET_CUDA_CHECK(cudaMalloc(&data_, bytes));
  bytes_ = bytes;
}

PinnedBuffer::PinnedBuffer(size_t bytes) { reserve(bytes); }

PinnedBuffer::~PinnedBuffer() {
  if (data_ != nullptr) cudaFreeHost(data_);
}

PinnedBuffer::PinnedBuffer(PinnedBuffer&& other) noexcept
    : data_(std::exchange(other.data_, nullptr)), bytes_(std::exchange(other.bytes_, 0)) {}

PinnedBuffer& PinnedBuffer::operator=(PinnedBuffer&& other) noexcept {
  if (this != &other) {
    if (data_ != nullptr) cudaFreeHost(data_);
    data_ = std::exchange(other.data_, nullptr);
    bytes_ = std::exchange(other.bytes_, 0);
  }
  return *this;
}

void PinnedBuffer::reserve(size_t bytes) {
  if (bytes <= bytes_) return;
  if (data_ != nullptr) {
    DUET_CUDA_CHECK(cudaFreeHost(data_));
    data_ = nullptr;
    bytes_ = 0;
  }
  DUET_CUDA_CHECK(cudaMallocHost(&data_, bytes));
  bytes_ = bytes;
}

Graph::~Graph() {
  if (exec_ != nullptr) cudaGraphExecDestroy(static_cast<cudaGraphExec_t>(exec_));
}

Graph::Graph(Graph&& other) noexcept : exec_(std::exchange(other.exec_, nullptr)) {}

Graph& Graph::operator=(Graph&& other) noexcept {
  if (this != &other) {
    if (exec_ != nullptr) cudaGraphExecDestroy(static_cast<cudaGraphExec_t>(exec_));
    exec_ = std::exchange(other.exec_, nullptr);
  }
  return *this;
}

CudaBackend::CudaBackend(int device) : device_(device) {
  int count = 0;
  const cudaError_t status = cudaGetDeviceCount(&count);
  if (status != cudaSuccess || count == 0) {
    cudaGetLastError();  // clear the sticky "no driver / no device" error
    throw Error(ErrorKind::kUnsupported,
                format("--device cuda:{} asked for a GPU, but this machine has none ({})", device,
                       status != cudaSuccess ? cudaGetErrorString(status) : "0 CUDA devices"));
  }
  if (device < 0 || device >= count) {
    throw Error(ErrorKind::kUnsupported,
                format("--device cuda:{}: this machine has {} CUDA device(s), 0..{}", device, count,
                       count - 1));
  }
  DUET_CUDA_CHECK(cudaSetDevice(device));
  cudaDeviceProp prop{};
  DUET_CUDA_CHECK(cudaGetDeviceProperties(&prop, device));
  name_ = format("{} (sm_{}{}, {} GiB)", prop.name, prop.major, prop.minor,
                 static_cast<double>(prop.totalGlobalMem / (1 << 20)) / 1024.0);
  cudaStream_t stream = nullptr;
  DUET_CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  stream_ = stream;
  cublasHandle_t handle = nullptr;
  DUET_CUBLAS_CHECK(cublasCreate(&handle));
  cublas_ = handle;
  DUET_CUBLAS_CHECK(cublasSetStream(handle, stream));
  DUET_CUBLAS_CHECK(cublasSetMathMode(handle, CUBLAS_DEFAULT_MATH));
  cublas_workspace_ = DeviceBuffer(kCublasWorkspaceBytes);
  DUET_CUBLAS_CHECK(
      cublasSetWorkspace(handle, cublas_workspace_.data(), cublas_workspace_.bytes()));
}

CudaBackend::~CudaBackend() {
  if (cublas_ != nullptr) cublasDestroy(static_cast<cublasHandle_t>(cublas_));
  if (stream_ != nullptr) {
    cudaStreamSynchronize(as_stream(stream_));
    cudaStreamDestroy(as_stream(stream_));
  }
}

void CudaBackend::upload(void* device, const void* host, size_t bytes) {
  if (bytes == 0) return;
  DUET_CUDA_CHECK(cudaMemcpyAsync(device, host, bytes, cudaMemcpyHostToDevice, as_stream(stream_)));
}

void CudaBackend::download(void* host, const void* device, size_t bytes) {
  if (bytes == 0) return;
  DUET_CUDA_CHECK(cudaMemcpyAsync(host, device, bytes, cudaMemcpyDeviceToHost, as_stream(stream_)));
}

void CudaBackend::copy(void* device_to, const void* device_from, size_t bytes) {
  if (bytes == 0) return;
  DUET_CUDA_CHECK(
      cudaMemcpyAsync(device_to, device_from, bytes, cudaMemcpyDeviceToDevice, as_stream(stream_)));
}

void CudaBackend::bind() const { DUET_CUDA_CHECK(cudaSetDevice(device_)); }

void CudaBackend::synchronize() { DUET_CUDA_CHECK(cudaStreamSynchronize(as_stream(stream_))); }

void* CudaBackend::scratch(size_t bytes) {
  if (bytes > scratch_.bytes()) {
    DUET_ASSERT(!capturing_, "scratch must not grow during a graph capture ({} > {} bytes)", bytes,
                scratch_.bytes());
    synchronize();  // queued ops may still use the old scratch
    scratch_ = DeviceBuffer();
    scratch_ = DeviceBuffer(bytes);
    ++scratch_generation_;
  }
  return scratch_.data();
}

void CudaBackend::begin_capture() {
  DUET_ASSERT(!capturing_);
  DUET_CUDA_CHECK(cudaStreamBeginCapture(as_stream(stream_), cudaStreamCaptureModeThreadLocal));
  capturing_ = true;
}

Graph CudaBackend::end_capture() {
  DUET_ASSERT(capturing_);
  capturing_ = false;
  cudaGraph_t graph = nullptr;
  DUET_CUDA_CHECK(cudaStreamEndCapture(as_stream(stream_), &graph));
  cudaGraphExec_t exec = nullptr;
  const cudaError_t status = cudaGraphInstantiate(&exec, graph, 0);
  cudaGraphDestroy(graph);
  DUET_CUDA_CHECK(status);
  Graph result;
  result.exec_ = exec;
  return result;
}

void CudaBackend::launch(const Graph& graph) {
  DUET_ASSERT(graph.valid());
  DUET_CUDA_CHECK(cudaGraphLaunch(static_cast<cudaGraphExec_t>(graph.exec_), as_stream(stream_)));
}

}  // namespace duet::cuda
