// Running the streaming kernels: the launch plan (launch_plan.cpp), the split-K workspace and
// tile counters, programmatic dependent launch, and the launch trace.
#include "conv1d/cuda/streaming.h"

#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>

#include <algorithm>
#include <limits>
#include <mutex>
#include <vector>

#include "common/launch.h"
#include "conv1d/cuda/launch_plan.h"

namespace dpa {

namespace {

// Launches being traced (start_launch_trace): the buffer, its rows handed out so far, and the
// blocks of each traced launch.
struct LaunchTrace {
  std::mutex mutex;
  at::Tensor buffer;
  int64_t rows_used = 0;
  std::vector<int64_t> blocks;
};
LaunchTrace launch_trace;

// The trace rows of a launch of `grid` blocks, or null when launches are not traced.
int64_t* next_launch_trace(dim3 grid) {
  const std::lock_guard<std::mutex> lock(launch_trace.mutex);
  if (!launch_trace.buffer.defined()) return nullptr;
  const int64_t blocks = static_cast<int64_t>(grid.x) * grid.y * grid.z;
  TORCH_CHECK(launch_trace.rows_used + blocks <= launch_trace.buffer.size(0),
              "start_launch_trace: the buffer's ", launch_trace.buffer.size(0),
              " rows are full; a launch of ", blocks, " blocks does not fit");
  int64_t* rows = launch_trace.buffer.data_ptr<int64_t>() + launch_trace.rows_used * kTraceEvents;
  launch_trace.rows_used += blocks;
  launch_trace.blocks.push_back(blocks);
  return rows;
}

// The split-K partial sums' workspace (returned: it must live until the launch is queued).
at::Tensor attach_workspace(StreamArgs& a, const at::Tensor& x) {
  at::Tensor ws = at::empty({static_cast<int64_t>(a.splits) * a.m * a.nt}, x.options().dtype(at::kFloat));
  a.ws = ws.data_ptr<float>();
  return ws;
}

// Launches on the current stream in clusters of `cluster_blocks` (0: not a cluster launch;
// a kernel that pushes into other blocks' shared memory needs one even for 1-block
// clusters), with programmatic dependent launch where the GPU has it.
template <typename... Params, typename... Args>
void launch_streaming(void (*kernel)(Params...), dim3 grid, int cluster_blocks, size_t shared_bytes,
                      Args... args) {
  set_kernel_attributes(reinterpret_cast<const void*>(kernel), cluster_blocks, shared_bytes);
  LaunchConfig launch(grid, dim3(kThreads), shared_bytes);
  launch.programmatic_dependent();
  launch.clusters(cluster_blocks);
  C10_CUDA_CHECK(cudaLaunchKernelEx(launch.get(), kernel, args...));
}

}  // namespace

void run_streaming(StreamArgs& a, const ConvProblem& p, const at::Tensor& x, const at::Tensor& weight,
                   int* counters) {
  tile_positions(a, weight);
  const StreamLaunch launch = plan_stream(a, x.scalar_type(), p.transposed, weight, wave_blocks(), true);
  a.trace = next_launch_trace(launch.grid);
  if (launch.cluster_blocks > 0) {
    return launch_streaming(launch.kernel, launch.grid, launch.cluster_blocks, launch.shared_bytes, a);
  }
  const at::Tensor own_counters =
      counters ? at::Tensor() : at::zeros({p.out_channels}, x.options().dtype(at::kInt));
  a.counters = counters ? counters : own_counters.data_ptr<int>();
  const at::Tensor ws = attach_workspace(a, x);
  launch_streaming(launch.kernel, launch.grid, 0, launch.shared_bytes, a);
}

// Two Conv1d problems on the same input and positions (a and b, weights wa and wb) in one
// launch; two launches where their plans need different kernel instantiations. The wave is
// shared so that the most weight bytes any block streams is as small as the integer splits
// allow: that block sets the launch's time. `counters`: a's then b's, or null for fresh zeros.
void run_streaming_pair(StreamArgs& a, StreamArgs& b, const ConvProblem& pa, const ConvProblem& pb,
                        const at::Tensor& x, const at::Tensor& wa, const at::Tensor& wb, int* counters) {
  tile_positions(a, wa);
  tile_positions(b, wb);
  const ClusterPairLaunch cluster = plan_cluster_pair(a, b, x.scalar_type(), wa, wb);
  if (cluster.kernel) {
    const dim3 grid((cluster.a_units + cluster.b_units) * cluster.cluster_blocks);
    a.trace = b.trace = next_launch_trace(grid);
    launch_streaming(cluster.kernel, grid, cluster.cluster_blocks, cluster.shared_bytes, a, b, cluster.a_units);
    return;
  }
  StreamLaunch la, lb;
  const auto plan = [&](int b_blocks) {
    lb = plan_stream(b, x.scalar_type(), false, wb, b_blocks, false);
    la = plan_stream(a, x.scalar_type(), false, wa, std::max(1, wave_blocks() - b_blocks), false);
    // Weight elements per block: rows per tile x reduction slice.
    return std::max(static_cast<int64_t>(ceil_div(a.m, la.grid.x)) * a.split_len,
                    static_cast<int64_t>(ceil_div(b.m, lb.grid.x)) * b.split_len);
  };
  plan(1);
  const int b_tiles = static_cast<int>(lb.grid.x) * b.n_tiles;
  int best_blocks = b_tiles;
  int64_t best = std::numeric_limits<int64_t>::max();
  for (int b_blocks = b_tiles; b_blocks < wave_blocks(); b_blocks += b_tiles) {
    const int64_t per_block = plan(b_blocks);
    if (per_block < best) best = per_block, best_blocks = b_blocks;
  }
  plan(best_blocks);
  const bool paired = la.pair_kernel == lb.pair_kernel;
  const dim3 grid(la.grid.x + lb.grid.x, std::max(la.grid.y, lb.grid.y), la.grid.z);
  const size_t shared_bytes = std::max(la.shared_bytes, lb.shared_bytes);
  const at::Tensor own_counters =
      counters ? at::Tensor()
               : at::zeros({pa.out_channels + pb.out_channels}, x.options().dtype(at::kInt));
  a.counters = counters ? counters : own_counters.data_ptr<int>();
  b.counters = a.counters + pa.out_channels;
  const at::Tensor ws_a = attach_workspace(a, x), ws_b = attach_workspace(b, x);
  a.trace = next_launch_trace(paired ? grid : la.grid);
  b.trace = paired ? a.trace : next_launch_trace(lb.grid);
  if (!paired) {
    launch_streaming(la.kernel, la.grid, 0, la.shared_bytes, a);
    launch_streaming(lb.kernel, lb.grid, 0, lb.shared_bytes, b);
    return;
  }
  launch_streaming(la.pair_kernel, grid, 0, shared_bytes, a, b, static_cast<int>(la.grid.x));
}

void start_launch_trace(const at::Tensor& buffer) {
  TORCH_CHECK_VALUE(buffer.is_cuda() && buffer.scalar_type() == at::kLong && buffer.dim() == 2 &&
                        buffer.size(1) == kTraceEvents && buffer.is_contiguous(),
                    "start_launch_trace: buffer must be a contiguous CUDA int64 tensor [rows, ",
                    kTraceEvents, "]");
  const std::lock_guard<std::mutex> lock(launch_trace.mutex);
  launch_trace.buffer = buffer;
  launch_trace.rows_used = 0;
  launch_trace.blocks.clear();
}

std::vector<int64_t> stop_launch_trace() {
  const std::lock_guard<std::mutex> lock(launch_trace.mutex);
  launch_trace.buffer = at::Tensor();
  return std::move(launch_trace.blocks);
}

}  // namespace dpa
