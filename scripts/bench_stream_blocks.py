"""Does one block per SM stream weights from HBM as fast as two? The question a thread-block-
cluster design of the streaming convs turns on (BENCHMARKS.md, "Finishing a GroupNorm conv in
the next conv's blocks"): a cluster holding a GroupNorm group leaves one 256-thread block per
SM where the kernels run two today.

A read-only kernel streams a layer-sized slice of a 1 GB pool (a different slice each launch,
so that nothing comes from L2) with 16-byte loads, each thread keeping `inflight` loads in
flight (the streaming conv keeps 3 requests x 1-4 weight rows). Every launch is one of 64 in a
CUDA graph, timed with CUDA events (bench_conv_blocks.graph_time_ms); the table gives the
median per launch (launch gaps included, as in a U-Net forward) and the bandwidth that
implies.

    python scripts/bench_stream_blocks.py [--mb 2 8 21 84] [--inflight 3 6 12]
"""
import argparse

import torch
from bench_conv_blocks import graph_time_ms
from torch.utils.cpp_extension import load_inline

SOURCE = r"""
#include <torch/extension.h>
#include <ATen/cuda/CUDAContext.h>

template <int INFLIGHT>
__global__ void __launch_bounds__(256) stream_read(const uint4* p, int64_t n, unsigned* sink) {
  const int64_t per_block = (n + gridDim.x - 1) / gridDim.x;
  const int64_t lo = blockIdx.x * per_block, hi = min(lo + per_block, n);
  unsigned acc = 0;
  for (int64_t i = lo + threadIdx.x; i < hi; i += blockDim.x * INFLIGHT) {
    uint4 v[INFLIGHT];
#pragma unroll
    for (int j = 0; j < INFLIGHT; ++j) {
      const int64_t k = i + static_cast<int64_t>(j) * blockDim.x;
      v[j] = k < hi ? __ldcs(p + k) : make_uint4(0, 0, 0, 0);
    }
#pragma unroll
    for (int j = 0; j < INFLIGHT; ++j) acc ^= v[j].x ^ v[j].y ^ v[j].z ^ v[j].w;
  }
  if (acc == 0x9e3779b9u) *sink = acc;  // keeps the loads; practically never true
}

void stream_slice(torch::Tensor pool, int64_t offset_bytes, int64_t bytes, int64_t blocks,
                  int64_t inflight, torch::Tensor sink) {
  const auto* p = reinterpret_cast<const uint4*>(static_cast<const char*>(pool.data_ptr()) + offset_bytes);
  auto stream = at::cuda::getCurrentCUDAStream();
  const int64_t n = bytes / 16;
  unsigned* s = reinterpret_cast<unsigned*>(sink.data_ptr<int>());
  switch (inflight) {
    case 3: stream_read<3><<<blocks, 256, 0, stream>>>(p, n, s); break;
    case 6: stream_read<6><<<blocks, 256, 0, stream>>>(p, n, s); break;
    case 12: stream_read<12><<<blocks, 256, 0, stream>>>(p, n, s); break;
    default: TORCH_CHECK(false, "inflight must be 3, 6 or 12");
  }
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}
"""
DECLARATION = "void stream_slice(torch::Tensor, int64_t, int64_t, int64_t, int64_t, torch::Tensor);"


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mb", nargs="+", type=float, default=[2, 8, 21, 84],
                        help="bytes per launch (MB): lowdim layers are 1-21 MB in fp32")
    parser.add_argument("--inflight", nargs="+", type=int, default=[3, 6, 12])
    args = parser.parse_args()
    print("compiling the read kernel...", flush=True)
    ext = load_inline("dpa_bench_stream_blocks", cpp_sources=DECLARATION, cuda_sources=SOURCE,
                      functions=["stream_slice"], extra_cuda_cflags=["-O3"])
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    pool = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    sink = torch.zeros(1, dtype=torch.int32, device="cuda")
    print(f"{torch.cuda.get_device_name()}, {sms} SMs, torch {torch.__version__}")
    columns = " ".join(f"{f'{blocks} blocks: µs':>16} {'GB/s':>6}" for blocks in (sms, 2 * sms))
    print(f"{'MB':>6} {'in flight':>9} {columns}")
    for mb in args.mb:
        size = int(mb * 1e6) // 4096 * 4096
        slices = len(pool) // size
        for inflight in args.inflight:
            row = []
            for blocks in (sms, 2 * sms):
                us = 1e3 * graph_time_ms(lambda i: ext.stream_slice(pool, (i % slices) * size, size, blocks,
                                                                    inflight, sink), copies=64)
                row.append(f"{us:16.2f} {size / us / 1e3:6.0f}")
            print(f"{mb:6.1f} {inflight:9d} " + " ".join(row), flush=True)


if __name__ == "__main__":
    main()
