#include "picard/cuda/graph_loop.h"

#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime.h>

#include <map>
#include <mutex>
#include <optional>
#include <utility>

namespace dpa {

namespace {

// The loop being captured on this thread.
struct OpenLoop {
  c10::cuda::CUDAStream outer, body;
  cudaGraph_t body_graph;
  c10::cuda::MempoolId_t pool;
  c10::DeviceIndex device;
};
thread_local std::optional<OpenLoop> open_loop;

// A stream of the loop body's own for each capturing stream, created once and kept for the
// process's life (as SideBranch's side streams are): PyTorch's pool hands its 32 streams out
// in turn, so a stream from it can be the very stream whose capture the loop is in.
c10::cuda::CUDAStream body_stream(const c10::cuda::CUDAStream& outer) {
  static std::mutex mutex;
  static std::map<std::pair<c10::DeviceIndex, c10::StreamId>, c10::cuda::CUDAStream> streams;
  const std::lock_guard<std::mutex> lock(mutex);
  const auto key = std::make_pair(outer.device_index(), outer.id());
  auto it = streams.find(key);
  if (it == streams.end()) {
    cudaStream_t created = nullptr;
    C10_CUDA_CHECK(cudaStreamCreateWithFlags(&created, cudaStreamNonBlocking));
    it = streams.emplace(key, c10::cuda::getStreamFromExternal(created, outer.device_index())).first;
  }
  return it->second;
}

c10::cuda::MempoolId_t mempool_of(std::tuple<int64_t, int64_t> pool) {
  return {static_cast<c10::cuda::CaptureId_t>(std::get<0>(pool)), static_cast<c10::cuda::CaptureId_t>(std::get<1>(pool))};
}

}  // namespace

void release_graph_pool(int64_t device, std::tuple<int64_t, int64_t> pool) {
  c10::cuda::CUDACachingAllocator::releasePool(static_cast<c10::DeviceIndex>(device), mempool_of(pool));
}

bool graph_loops_supported() {
#if CUDART_VERSION >= 12040
  int driver = 0;
  return cudaDriverGetVersion(&driver) == cudaSuccess && driver >= 12040;
#else
  return false;
#endif
}

#if CUDART_VERSION >= 12040

int64_t begin_graph_loop(std::tuple<int64_t, int64_t> pool) {
  TORCH_CHECK(!open_loop.has_value(), "begin_graph_loop: a graph loop is open already (loops do not nest)");
  TORCH_CHECK(graph_loops_supported(), "begin_graph_loop: needs a CUDA 12.4+ runtime and driver");
  const c10::cuda::CUDAStream outer = c10::cuda::getCurrentCUDAStream();
  cudaStreamCaptureStatus status;
  cudaGraph_t graph = nullptr;
  const cudaGraphNode_t* deps = nullptr;
  size_t count = 0;
#if CUDART_VERSION >= 13000
  C10_CUDA_CHECK(cudaStreamGetCaptureInfo(outer.stream(), &status, nullptr, &graph, &deps, nullptr, &count));
#else
  C10_CUDA_CHECK(cudaStreamGetCaptureInfo_v2(outer.stream(), &status, nullptr, &graph, &deps, &count));
#endif
  TORCH_CHECK(status == cudaStreamCaptureStatusActive,
              "begin_graph_loop: the current stream is not capturing a CUDA graph");
  cudaGraphConditionalHandle handle;
  // Reset to 1 at every launch of the graph: the body runs at least once.
  C10_CUDA_CHECK(cudaGraphConditionalHandleCreate(&handle, graph, 1, cudaGraphCondAssignDefault));
  cudaGraphNodeParams params{};
  params.type = cudaGraphNodeTypeConditional;
  params.conditional.handle = handle;
  params.conditional.type = cudaGraphCondTypeWhile;
  params.conditional.size = 1;
  cudaGraphNode_t node;
#if CUDART_VERSION >= 13000
  C10_CUDA_CHECK(cudaGraphAddNode(&node, graph, deps, nullptr, count, &params));
#else
  C10_CUDA_CHECK(cudaGraphAddNode(&node, graph, deps, count, &params));
#endif
#if CUDART_VERSION >= 13000
  C10_CUDA_CHECK(cudaStreamUpdateCaptureDependencies(outer.stream(), &node, nullptr, 1, cudaStreamSetCaptureDependencies));
#else
  C10_CUDA_CHECK(cudaStreamUpdateCaptureDependencies(outer.stream(), &node, 1, cudaStreamSetCaptureDependencies));
#endif
  const c10::cuda::CUDAStream body = body_stream(outer);
  cudaGraph_t body_graph = params.conditional.phGraph_out[0];
  cudaStreamCaptureMode mode = cudaStreamCaptureModeRelaxed;
  C10_CUDA_CHECK(cudaStreamBeginCaptureToGraph(body.stream(), body_graph, nullptr, nullptr, 0, mode));
  unsigned long long body_id = 0;
#if CUDART_VERSION >= 13000
  C10_CUDA_CHECK(cudaStreamGetCaptureInfo(body.stream(), &status, &body_id, nullptr, nullptr, nullptr, nullptr));
#else
  C10_CUDA_CHECK(cudaStreamGetCaptureInfo_v2(body.stream(), &status, &body_id, nullptr, nullptr, nullptr));
#endif
  const c10::cuda::MempoolId_t pool_id = mempool_of(pool);
  // The body's allocations come from its own pool, kept for the graph's life.
  try {
    c10::cuda::CUDACachingAllocator::beginAllocateToPool(outer.device_index(), pool_id, [body_id](cudaStream_t s) {
      cudaStreamCaptureStatus st;
      unsigned long long id = 0;
#if CUDART_VERSION >= 13000
      return cudaStreamGetCaptureInfo(s, &st, &id, nullptr, nullptr, nullptr, nullptr) == cudaSuccess &&
#else
      return cudaStreamGetCaptureInfo_v2(s, &st, &id, nullptr, nullptr, nullptr) == cudaSuccess &&
#endif
             st == cudaStreamCaptureStatusActive && id == body_id;
    });
  } catch (...) {
    cudaGraph_t ended = nullptr;
    (void)cudaStreamEndCapture(body.stream(), &ended);  // the outer capture fails at its end anyway
    throw;
  }
  open_loop = OpenLoop{outer, body, body_graph, pool_id, outer.device_index()};
  c10::cuda::setCurrentCUDAStream(body);
  return static_cast<int64_t>(handle);
}

void end_graph_loop() {
  TORCH_CHECK(open_loop.has_value(), "end_graph_loop: no graph loop is open");
  const OpenLoop loop = *open_loop;
  open_loop.reset();
  cudaGraph_t captured = nullptr;
  c10::cuda::setCurrentCUDAStream(loop.outer);
  c10::cuda::CUDACachingAllocator::endAllocateToPool(loop.device, loop.pool);
  C10_CUDA_CHECK(cudaStreamEndCapture(loop.body.stream(), &captured));
  TORCH_CHECK(captured == loop.body_graph, "end_graph_loop: the body's capture ended in another graph");
}

#else

int64_t begin_graph_loop(std::tuple<int64_t, int64_t>) {
  TORCH_CHECK(false, "begin_graph_loop: this build's CUDA runtime is older than 12.4");
}

void end_graph_loop() { TORCH_CHECK(false, "end_graph_loop: this build's CUDA runtime is older than 12.4"); }

#endif

}  // namespace dpa
