// Hopper's shared-memory barriers, bulk copies and cluster instructions (sm_90), used only
// where a kernel's body is compiled for sm_90 and newer (the cluster kernels, the bulk weight
// ring of stream_conv.cuh).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace dpa {

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
__device__ __forceinline__ uint32_t shared_address(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// The address of the same shared-memory location in block `rank` of the cluster.
__device__ __forceinline__ uint32_t in_block(uint32_t address, int rank) {
  uint32_t out;
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(out) : "r"(address), "r"(rank));
  return out;
}

__device__ __forceinline__ void mbarrier_init(uint64_t* bar) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(shared_address(bar)) : "memory");
}

__device__ __forceinline__ void mbarrier_expect_bytes(uint64_t* bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(shared_address(bar)), "r"(bytes)
               : "memory");
}

// Until the barrier's phase of this parity completes (0: its first use, 1: its second, ...):
// its expected bytes have all arrived.
__device__ __forceinline__ void mbarrier_wait(uint64_t* bar, uint32_t parity) {
  uint32_t done;
  do {
    asm volatile(
        "{ .reg .pred p; mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2; selp.u32 %0, 1, 0, p; }"
        : "=r"(done)
        : "r"(shared_address(bar)), "r"(parity)
        : "memory");
  } while (!done);
}

// A contiguous global -> shared copy by the copy engine (16-byte aligned, a multiple of 16
// bytes), counted on `bar`: it costs the issuing thread one instruction and no registers.
__device__ __forceinline__ void bulk_load(void* shared, const void* global, uint32_t bytes, uint64_t* bar,
                                          uint64_t policy) {
  asm volatile(
      "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes.L2::cache_hint [%0], [%1], %2, [%3], %4;"
      ::"r"(shared_address(shared)), "l"(global), "r"(bytes), "r"(shared_address(bar)), "l"(policy)
      : "memory");
}

// Stores into another block's shared memory, counted on that block's barrier.
__device__ __forceinline__ void push(uint32_t remote, float v, uint32_t remote_bar) {
  asm volatile("st.async.shared::cluster.mbarrier::complete_tx::bytes.b32 [%0], %1, [%2];"
               ::"r"(remote), "r"(__float_as_uint(v)), "r"(remote_bar) : "memory");
}
__device__ __forceinline__ void push(uint32_t remote, float2 v, uint32_t remote_bar) {
  asm volatile("st.async.shared::cluster.mbarrier::complete_tx::bytes.v2.b32 [%0], {%1, %2}, [%3];"
               ::"r"(remote), "r"(__float_as_uint(v.x)), "r"(__float_as_uint(v.y)), "r"(remote_bar) : "memory");
}
__device__ __forceinline__ void push(uint32_t remote, float4 v, uint32_t remote_bar) {
  asm volatile("st.async.shared::cluster.mbarrier::complete_tx::bytes.v4.b32 [%0], {%1, %2, %3, %4}, [%5];"
               ::"r"(remote), "r"(__float_as_uint(v.x)), "r"(__float_as_uint(v.y)),
               "r"(__float_as_uint(v.z)), "r"(__float_as_uint(v.w)), "r"(remote_bar) : "memory");
}
#endif

}  // namespace dpa
