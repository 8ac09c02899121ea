#include "conv1d/cuda/launch_plan.h"

#include <ATen/cuda/CUDAContext.h>
#include <cuda.h>
#include <dlfcn.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAFunctions.h>

#include <algorithm>
#include <map>
#include <mutex>
#include <optional>
#include <tuple>
#include <utility>
#include <type_traits>

#include "common/checks.h"
#include "common/launch.h"

namespace dpa {

namespace {

// Dynamic shared memory per block, at most: what kBlocksPerSm blocks can each have beside
// their static arrays (2 KB covers them) on the device, up to 96 KB (a wide position tile of
// a long reduction slice; B = 1 layers use a few KB).
int max_shared_bytes() {
  const cudaDeviceProp* props = at::cuda::getCurrentDeviceProperties();
  const int per_block = static_cast<int>(props->sharedMemPerMultiprocessor) / kBlocksPerSm - 2048;
  return std::min({96 * 1024, per_block, static_cast<int>(props->sharedMemPerBlockOptin) - 2048});
}

}  // namespace

void set_kernel_attributes(const void* kernel, int cluster_blocks, size_t shared_bytes) {
  // Raised only, never lowered: another thread may be launching the same kernel with more
  // shared memory (per device: attributes are set on the current one).
  static std::mutex mutex;
  static std::map<std::pair<int, const void*>, std::pair<size_t, bool>> set;
  const std::lock_guard<std::mutex> lock(mutex);
  auto& [bytes, non_portable] = set[{c10::cuda::current_device(), kernel}];
  if (shared_bytes > 40 * 1024 && shared_bytes > bytes) {
    C10_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                        static_cast<int>(shared_bytes)));
    bytes = shared_bytes;
  }
  if (cluster_blocks > 8 && !non_portable) {
    C10_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeNonPortableClusterSizeAllowed, 1));
    non_portable = true;
  }
}

namespace {

// The SMs of the calling thread's current CUDA context: a green context's share, which the
// device's properties do not show (0 where the driver cannot say). Through the driver's
// cuCtxGetDevResource (CUDA 12.4+), looked up at run time: the extension does not link the
// driver library.
int context_sms() {
  using GetCurrent = CUresult (*)(CUcontext*);
  using GetResource = CUresult (*)(CUcontext, CUdevResource*, CUdevResourceType);
  static const std::pair<GetCurrent, GetResource> driver = [] {
    void* library = dlopen("libcuda.so.1", RTLD_NOW | RTLD_NOLOAD);  // the runtime's
    if (library == nullptr) return std::make_pair(GetCurrent{}, GetResource{});
    return std::make_pair(reinterpret_cast<GetCurrent>(dlsym(library, "cuCtxGetCurrent")),
                          reinterpret_cast<GetResource>(dlsym(library, "cuCtxGetDevResource")));
  }();
  const auto [get_current, get_resource] = driver;
  CUcontext context = nullptr;
  CUdevResource resource{};
  if (get_current == nullptr || get_resource == nullptr || get_current(&context) != CUDA_SUCCESS ||
      context == nullptr || get_resource(context, &resource, CU_DEV_RESOURCE_TYPE_SM) != CUDA_SUCCESS) {
    return 0;
  }
  return static_cast<int>(resource.sm.smCount);
}

}  // namespace

bool cooperative_fits(const void* kernel, int blocks) {
  static std::mutex mutex;
  static std::map<std::pair<int, const void*>, int> resident;  // blocks per SM
  const cudaDeviceProp* props = at::cuda::getCurrentDeviceProperties();
  if (!props->cooperativeLaunch) return false;
  int per_sm = 0;
  {
    const std::lock_guard<std::mutex> lock(mutex);
    auto found = resident.find({c10::cuda::current_device(), kernel});
    if (found == resident.end()) {
      int n = 0;
      C10_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, kernel, kThreads, 0));
      found = resident.emplace(std::make_pair(c10::cuda::current_device(), kernel), n).first;
    }
    per_sm = found->second;
  }
  // A green context's SMs even where KernelConfig.sm_count does not say so: a graph captured
  // with a launch too large for them would wait for ever on replay (the driver refuses it
  // only when launched directly).
  const int context = context_sms();
  const int sms = context > 0 ? std::min(sm_budget(), context) : sm_budget();
  return static_cast<int64_t>(per_sm) * sms >= blocks;
}

// Cached: the occupancy query is not free, and a U-Net asks about few shapes.
bool clusters_fit(const void* kernel, int cluster_blocks, size_t shared_bytes, int clusters) {
  static std::mutex mutex;
  static std::map<std::tuple<int, const void*, int, size_t>, int> resident;
  const int device = c10::cuda::current_device();
  const std::lock_guard<std::mutex> lock(mutex);
  const auto key = std::make_tuple(device, kernel, cluster_blocks, shared_bytes);
  auto found = resident.find(key);
  if (found == resident.end()) {
    set_kernel_attributes(kernel, cluster_blocks, shared_bytes);
    LaunchConfig launch(dim3(cluster_blocks * clusters), dim3(kThreads), shared_bytes);
    launch.clusters(cluster_blocks);
    int n = 0;
    C10_CUDA_CHECK(cudaOccupancyMaxActiveClusters(&n, kernel, launch.get()));
    found = resident.emplace(key, n).first;
  }
  // The query counts the whole device; on an SM budget, its share.
  const int device_sms = at::cuda::getCurrentDeviceProperties()->multiProcessorCount;
  return static_cast<int64_t>(found->second) * sm_budget() / device_sms >= clusters;
}

int wave_blocks() {
  return kBlocksPerSm * sm_budget();
}

namespace {

// Sizes the split-K decomposition so that the problem runs on about `blocks` blocks: the
// reduction slice is a multiple of `granule` where it can be, and at most `max_split_len`
// (the shared memory's limit, which wins).
void plan_splits(StreamArgs& a, int m_tiles, int granule, int max_split_len, int blocks) {
  const int wanted = std::max(1, blocks / (m_tiles * a.n_tiles));
  const int len = ceil_div(ceil_div(a.red, wanted), granule) * granule;
  TORCH_INTERNAL_ASSERT(max_split_len >= 1, "no shared memory for a reduction slice");
  a.split_len = std::min(len, max_split_len);
  a.splits = ceil_div(a.red, a.split_len);
}

template <typename T, int NT>
StreamLaunch plan_conv(StreamArgs& a, bool vectorised, int blocks) {
  constexpr int kVec = 16 / sizeof(T);
  constexpr int R = conv_rows<NT>();
  const int granule = 32 * (vectorised ? kVec : 1);
  const int m_tiles = ceil_div(a.m, kWarps * R);
  plan_splits(a, m_tiles, granule, max_shared_bytes() / (NT * 4) / granule * granule, blocks);
  if (a.groups == 0) a.unit_rows = kWarps * R;
  return {splitk_conv_kernel<T, NT>(vectorised), splitk_pair_kernel<T, NT>(vectorised),
          dim3(m_tiles, a.splits, a.n_tiles), static_cast<size_t>(NT) * a.split_len * sizeof(float)};
}

// How a cluster streams one unit of a problem: row_tiles x splits blocks (row_tiles: set by
// the caller), each with a slice of split_len reduction elements staged in shared memory, its
// weights through registers or (bulk) through a ring of `stages` chunks per warp.
struct ClusterShape {
  int row_tiles, splits, split_len, stages;
  bool bulk;
  size_t shared_bytes;
};

// The shape of a unit of a.unit_rows rows whose reduction is split `splits` ways (fewer where
// whole granules cover it), or false where it does not fit in shared memory. `bulk`: the
// ring or registers, where the caller decides (a pair shares one kernel); `max_stages` caps
// the ring.
template <typename T, int NT>
bool cluster_shape(const StreamArgs& a, bool vectorised, int splits, std::optional<bool> bulk,
                   int max_stages, ClusterShape& shape) {
  constexpr int kVec = 16 / sizeof(T);
  constexpr int R = conv_rows<NT>();
  const int granule = 32 * (vectorised ? kVec : 1);
  shape.split_len = ceil_div(ceil_div(a.red, splits), granule) * granule;
  shape.splits = ceil_div(a.red, shape.split_len);
  // Within what two blocks per SM can each have, so that under programmatic dependent launch
  // the next kernel's block fits beside this one and requests its weights early.
  const size_t budget = max_shared_bytes();
  shape.shared_bytes = static_cast<size_t>(NT) * shape.split_len * sizeof(float);  // the staged input
  // Where a block's first stream_depth<T>() loads per lane and row cover its whole slice, the
  // weights come through registers. Longer slices stream through the shared-memory ring: with
  // one block per SM where split-K has two, registers alone would keep half the bytes in
  // flight, which on those slices cost more than the shorter finishing saves (docs/tried.md,
  // "Long slices' weights through a shared-memory ring").
  shape.bulk = bulk.value_or(shape.split_len > stream_depth<T>() * granule);
  shape.stages = 0;
  if (shape.bulk) {
    if (!vectorised) return false;  // bulk copies move 16-byte aligned runs
    const size_t stage_bytes = static_cast<size_t>(kWarps) * R * granule * sizeof(T);
    if (shape.shared_bytes < budget) {
      shape.stages = static_cast<int>(std::min<size_t>({static_cast<size_t>(ceil_div(shape.split_len, granule)),
                                                        static_cast<size_t>(max_stages),
                                                        (budget - shape.shared_bytes) / stage_bytes}));
    }
    if (shape.stages < 1) return false;
    shape.shared_bytes += shape.stages * stage_bytes;
  }
  return shape.shared_bytes <= budget;
}

void adopt(StreamArgs& a, const ClusterShape& shape) {
  a.split_len = shape.split_len;
  a.splits = shape.splits;
  a.ring_stages = shape.stages;
}

// Whether a streaming conv may run as thread-block clusters at all: one position tile (the
// kernels stage every position at once), the kernel configuration's `clusters`, a Hopper GPU
// and kernels compiled for it (hopper_launches).
bool clusters_usable(const StreamArgs& a) {
  return a.n_tiles == 1 && kernel_config().clusters && hopper_launches();
}

// A GroupNorm conv's cluster shape, if it has one: a group's row tiles times as many
// reduction splits as kMaxClusterBlocks allows.
template <typename T, int NT>
bool groupnorm_cluster_shape(const StreamArgs& a, bool vectorised, ClusterShape& shape) {
  if (a.groups == 0 || !clusters_usable(a)) return false;
  const int row_tiles = ceil_div(a.unit_rows, kWarps * conv_rows<NT>());
  if (row_tiles > kMaxClusterBlocks ||
      !cluster_shape<T, NT>(a, vectorised, kMaxClusterBlocks / row_tiles, std::nullopt, kMaxRingStages, shape)) {
    return false;
  }
  shape.row_tiles = row_tiles;
  // Past the ring's first fill no more in flight than registers keep: split-K does as well.
  if (shape.bulk && shape.stages < stream_depth<T>()) return false;
  // A one-block cluster has no distributed shared memory to push into (compute-sanitizer
  // flags it), and split-K with one split costs the same on such a small layer.
  return shape.row_tiles * shape.splits >= 2;
}

// A plain conv's cluster shape, if it has one: one row tile per cluster, its reduction split
// as split-K would split it over the wave (plan_conv), in at most kMaxClusterBlocks ways.
template <typename T, int NT>
bool plain_cluster_shape(StreamArgs& a, bool vectorised, ClusterShape& shape) {
  constexpr int kTileRows = kWarps * conv_rows<NT>();
  if (a.groups != 0 || !clusters_usable(a)) return false;
  const int splits = std::clamp(wave_blocks() / ceil_div(a.m, kTileRows), 1, kMaxClusterBlocks);
  if (!cluster_shape<T, NT>(a, vectorised, splits, std::nullopt, kMaxRingStages, shape)) return false;
  shape.row_tiles = 1;
  if (shape.bulk && shape.stages < stream_depth<T>()) return false;
  a.unit_rows = kTileRows;
  return shape.splits >= 2;  // no distributed shared memory in a one-block cluster
}

// The cluster plan of a conv (stream_conv_cluster_kernel), if it has one: a GroupNorm conv's
// groups or a plain conv's row tiles, every unit's cluster resident at once (a second wave
// would double the time).
template <typename T, int NT>
bool plan_cluster(StreamArgs& a, bool vectorised, StreamLaunch& launch) {
  ClusterShape shape;
  if (!(a.groups > 0 ? groupnorm_cluster_shape<T, NT>(a, vectorised, shape)
                     : plain_cluster_shape<T, NT>(a, vectorised, shape))) {
    return false;
  }
  const StreamKernel kernel = cluster_conv_kernel<T, NT>(vectorised, shape.bulk);
  const int size = shape.row_tiles * shape.splits;
  const int units = ceil_div(a.m, a.unit_rows);
  if (!clusters_fit(reinterpret_cast<const void*>(kernel), size, shape.shared_bytes, units)) return false;
  adopt(a, shape);
  launch = {kernel, nullptr, dim3(units * size), shape.shared_bytes, size};
  return true;
}

// The pair's cluster plan, if it has one: a's groups as plan_cluster has them; b's rows in
// units of clusters of the same size, its reduction split in as few ways as keep its slices
// no longer than a's (the longest slice sets the launch's time; fewer splits, more rows per
// cluster, fewer clusters) and as many row tiles as the cluster then holds (the ranks left
// over idle), and every cluster of both resident at once.
template <typename T, int NT>
ClusterPairLaunch plan_cluster_pair(StreamArgs& a, StreamArgs& b, bool vectorised) {
  ClusterShape sa, sb;
  if (!groupnorm_cluster_shape<T, NT>(a, vectorised, sa)) return {};
  const int size = sa.row_tiles * sa.splits;
  int splits = 1;
  while (splits <= size && !(cluster_shape<T, NT>(b, vectorised, splits, sa.bulk, sa.stages, sb) &&
                             sb.split_len <= sa.split_len)) {
    ++splits;
  }
  if (splits > size) return {};
  const int unit_rows = size / sb.splits * kWarps * conv_rows<NT>();
  ClusterPairLaunch launch;
  launch.kernel = cluster_pair_kernel<T, NT>(vectorised, sa.bulk);
  launch.a_units = a.groups;
  launch.b_units = ceil_div(b.m, unit_rows);
  launch.cluster_blocks = size;
  launch.shared_bytes = sa.shared_bytes;  // b's slice and ring are no larger
  if (!clusters_fit(reinterpret_cast<const void*>(launch.kernel), size, launch.shared_bytes,
                    launch.a_units + launch.b_units)) return {};
  b.unit_rows = unit_rows;
  adopt(a, sa);
  adopt(b, sb);
  return launch;
}

template <typename T, int NT>
StreamLaunch plan_transposed(StreamArgs& a, bool vectorised) {
  constexpr int kVec = transposed_vector<T, NT>();
  const int epl = vectorised ? kVec : 1;
  const int m_tiles = ceil_div(a.m, 32 * epl);
  // At most 8 splits: the finishing block gathers every split of every tap of an output,
  // which costs more than fewer, longer blocks save on these small layers.
  plan_splits(a, m_tiles, ceil_div(a.red, 8), max_shared_bytes() / (NT * 4), wave_blocks());
  a.unit_rows = 32 * a.ksize;  // output tiles of 32 channels, all K taps of each
  // Shared memory holds the staged inputs, then the tree that sums the warps.
  const size_t floats = std::max<size_t>(static_cast<size_t>(a.split_len) * NT,
                                         static_cast<size_t>(kWarps / 2) * 32 * epl * NT);
  return {splitk_transposed_kernel<T, NT>(vectorised), nullptr, dim3(m_tiles, a.splits, a.n_tiles),
          floats * sizeof(float)};
}

// Where the vector loads of a Conv1d-layout problem can be used: each lane's run of weights
// 16-byte aligned, a row length divisible by the vector, and an aligned base.
template <typename T>
bool rows_vectorised(const StreamArgs& a, const at::Tensor& weight) {
  return a.red % (16 / static_cast<int>(sizeof(T))) == 0 &&
         reinterpret_cast<uintptr_t>(weight.data_ptr()) % 16 == 0;
}

// plan(std::integral_constant<int, NT>) for the kernels' position tile NT of a.
template <typename Plan>
auto with_position_tile(const StreamArgs& a, const Plan& plan) {
  switch (a.nt / a.n_tiles) {
    case 4: return plan(std::integral_constant<int, 4>{});
    case 8: return plan(std::integral_constant<int, 8>{});
    case 16: return plan(std::integral_constant<int, 16>{});
    default: return plan(std::integral_constant<int, 32>{});
  }
}

// The cluster plan of a transposed conv (stream_transposed_cluster_kernel), if it has one:
// a unit's K / EPL column tiles times as many input-channel splits as fill about one wave,
// up to kMaxClusterBlocks, and every unit's cluster resident at once.
template <typename T, int NT>
bool plan_transposed_cluster(StreamArgs& a, bool vectorised, StreamLaunch& launch) {
  constexpr int kVec = transposed_vector<T, NT>();
  const int epl = vectorised ? kVec : 1;
  if (!clusters_usable(a) || a.ksize % epl != 0 || a.ksize / epl > kMaxClusterBlocks) {
    return false;
  }
  const int tiles = a.ksize / epl, units = ceil_div(a.cout, 32);
  const int wanted = std::clamp(wave_blocks() / (units * tiles), 1, kMaxClusterBlocks / tiles);
  const int split_len = ceil_div(a.red, std::min(wanted, a.red));
  const int splits = ceil_div(a.red, split_len), size = tiles * splits;
  if (size < 2) return false;  // no distributed shared memory in a one-block cluster
  const size_t floats = std::max<size_t>(static_cast<size_t>(split_len) * NT, kWarps / 2 * 32 * epl * NT) +
                        static_cast<size_t>(splits) * ceil_div(32, size) * a.ksize * NT;
  const size_t shared_bytes = floats * sizeof(float);
  if (shared_bytes > static_cast<size_t>(max_shared_bytes())) return false;
  const StreamKernel kernel = cluster_transposed_kernel<T, NT>(vectorised);
  if (!clusters_fit(reinterpret_cast<const void*>(kernel), size, shared_bytes, units)) return false;
  a.split_len = split_len;
  a.splits = splits;
  launch = {kernel, nullptr, dim3(units * size), shared_bytes, size};
  return true;
}

// clustered: a conv may take stream_conv_cluster_kernel, a transposed conv
// stream_transposed_cluster_kernel.
template <typename T>
StreamLaunch plan_stream_of(StreamArgs& a, bool transposed, const at::Tensor& weight, int blocks,
                            bool clustered) {
  const auto plan = [&](auto nt) {
    constexpr int NT = decltype(nt)::value;
    // Vector loads need each lane's run of weights 16-byte aligned: a row length (conv) or
    // column count (transposed) divisible by the vector, and an aligned base.
    const bool vectorised = transposed ? a.m % transposed_vector<T, NT>() == 0 &&
                                             reinterpret_cast<uintptr_t>(weight.data_ptr()) % 16 == 0
                                       : rows_vectorised<T>(a, weight);
    StreamLaunch launch;
    if (clustered && (transposed ? plan_transposed_cluster<T, NT>(a, vectorised, launch)
                                 : plan_cluster<T, NT>(a, vectorised, launch))) {
      return launch;
    }
    return transposed ? plan_transposed<T, NT>(a, vectorised) : plan_conv<T, NT>(a, vectorised, blocks);
  };
  return with_position_tile(a, plan);
}

template <typename T>
ClusterPairLaunch plan_cluster_pair_of(StreamArgs& a, StreamArgs& b, const at::Tensor& wa,
                                       const at::Tensor& wb) {
  const bool vectorised = rows_vectorised<T>(a, wa) && rows_vectorised<T>(b, wb);
  return with_position_tile(a, [&](auto nt) {
    return plan_cluster_pair<T, decltype(nt)::value>(a, b, vectorised);
  });
}

}  // namespace

// Position tiles, and whether the blocks prefetch their own weights into L2 while they wait
// for the previous kernel: that pays where a layer's weights fit in (half) the L2 next to
// the previous layer's; bigger ones would evict their own prefetched lines.
void tile_positions(StreamArgs& a, const at::Tensor& weight) {
  const int tile = a.positions <= 4 ? 4 : a.positions <= 8 ? 8 : a.positions <= 16 ? 16 : 32;
  a.n_tiles = ceil_div(a.positions, tile);
  a.nt = a.n_tiles * tile;
  a.prefetch = weight.nbytes() * 2 <= static_cast<size_t>(at::cuda::getCurrentDeviceProperties()->l2CacheSize);
}

StreamLaunch plan_stream(StreamArgs& a, at::ScalarType dtype, bool transposed, const at::Tensor& weight,
                         int blocks, bool clustered) {
  StreamLaunch launch;
  DPA_DISPATCH_FLOAT_TYPES(dtype, "dpa streaming conv", [&] {
    launch = plan_stream_of<scalar_t>(a, transposed, weight, blocks, clustered);
  });
  return launch;
}

ClusterPairLaunch plan_cluster_pair(StreamArgs& a, StreamArgs& b, at::ScalarType dtype, const at::Tensor& wa,
                                    const at::Tensor& wb) {
  ClusterPairLaunch launch;
  DPA_DISPATCH_FLOAT_TYPES(dtype, "dpa streaming conv", [&] { launch = plan_cluster_pair_of<scalar_t>(a, b, wa, wb); });
  return launch;
}

}  // namespace dpa
