// Inline-PTX helpers shared by every device file: timers and acquire loads, shared-memory accesses by 32-bit
// address, mbarrier polls, cp.async, and the bulk tensor (TMA) copies of sm_90.
#pragma once

#include <cstdint>

#ifdef __CUDACC__
#include <cuda.h>

namespace primemoe {

__device__ __forceinline__ uint64_t now_ns() {
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

__device__ __forceinline__ uint64_t load_acquire(const uint64_t* p) {
  uint64_t v;
  asm volatile("ld.acquire.sys.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
  return v;
}

__device__ __forceinline__ uint32_t smem_addr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// Shared-memory accesses by 32-bit shared address: through a generic pointer they compile to 64-bit generic
// accesses whose addresses take two registers each. No memory clobber: the staging boxes are touched only by
// volatile asm (these, cp.async, TMA, the fences and barriers), which the compiler keeps in order.
__device__ __forceinline__ void st_shared(uint32_t addr, uint32_t v) {
  asm volatile("st.shared.b32 [%0], %1;" ::"r"(addr), "r"(v));
}

__device__ __forceinline__ uint32_t ld_shared(uint32_t addr) {
  uint32_t v;
  asm volatile("ld.shared.b32 %0, [%1];" : "=r"(v) : "r"(addr));
  return v;
}

__device__ __forceinline__ uint4 ld_shared_v4(uint32_t addr) {
  uint4 v;
  asm volatile("ld.shared.v4.b32 {%0, %1, %2, %3}, [%4];" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "r"(addr));
  return v;
}

__device__ __forceinline__ void st_shared_v4(uint32_t addr, uint4 v) {
  asm volatile("st.shared.v4.b32 [%0], {%1, %2, %3, %4};" ::"r"(addr), "r"(v.x), "r"(v.y), "r"(v.z), "r"(v.w));
}

// Generic-proxy writes to shared memory made visible to the async proxy (TMA stores, wgmma).
__device__ __forceinline__ void fence_proxy_async_shared() {
  asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
}

// Global data another agent wrote, made visible to this thread's later TMA loads.
__device__ __forceinline__ void fence_proxy_async_global() { asm volatile("fence.proxy.async.global;" ::: "memory"); }

// Named barrier `id` over Threads threads; the aligned form: every thread reaches it from the same instruction.
template <int Threads>
__device__ __forceinline__ void named_barrier(int id) {
  asm volatile("bar.sync %0, %1;" ::"r"(id), "n"(Threads) : "memory");
}

// The same without the alignment requirement, for threads that reach it from different instructions.
template <int Threads>
__device__ __forceinline__ void named_barrier_unaligned(int id) {
  asm volatile("barrier.sync %0, %1;" ::"r"(id), "n"(Threads) : "memory");
}

// `count` arrivals by this thread on a barrier of this CTA (release: its earlier accesses come before).
__device__ __forceinline__ void arrive_count(uint64_t* bar, uint32_t count) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0], %1;" ::"r"(smem_addr(bar)), "r"(count) : "memory");
}

// Whether the barrier's phase of this parity is complete, after waiting at most ~100 ns for it: a warp that
// watches several barriers must not sleep on one while another is ready.
__device__ __forceinline__ bool poll_parity(uint64_t* bar, uint32_t parity) {
  uint32_t done;
  asm volatile(
      "{\n\t.reg .pred p;\n\tmbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2, 100;\n\tselp.u32 %0, 1, 0, p;\n\t}"
      : "=r"(done)
      : "r"(smem_addr(bar)), "r"(parity)
      : "memory");
  return done != 0;
}

// 16 bytes into shared memory, or 16 zero bytes when `bytes` is 0 (src is then not read).
__device__ __forceinline__ void cp_async_16(uint32_t dst, const void* src, uint32_t bytes) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(dst), "l"(src), "r"(bytes) : "memory");
}

__device__ __forceinline__ void cp_async_wait_all() { asm volatile("cp.async.wait_all;" ::: "memory"); }

// A 3-D box of a tensor map into shared memory, completing `bar`'s transaction bytes.
__device__ __forceinline__ void tma_load(const CUtensorMap* map, uint64_t* bar, void* dst, int32_t c0, int32_t c1,
                                         int32_t c2) {
  asm volatile(
      "cp.async.bulk.tensor.3d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%3, %4, %5}], [%2];"
      :
      : "r"(smem_addr(dst)), "l"(map), "r"(smem_addr(bar)), "r"(c0), "r"(c1), "r"(c2)
      : "memory");
}

// A shared-memory box to global memory through a (3-D, layer 0) tensor map, in the current bulk group.
__device__ __forceinline__ void tma_store(const CUtensorMap* map, uint32_t src, int32_t c0, int32_t c1) {
  asm volatile("cp.async.bulk.tensor.3d.global.shared::cta.bulk_group [%0, {%2, %3, %4}], [%1];"
               :
               : "l"(map), "r"(src), "r"(c0), "r"(c1), "r"(0)
               : "memory");
}

__device__ __forceinline__ void store_commit() { asm volatile("cp.async.bulk.commit_group;" ::: "memory"); }

// Every committed bulk store of this thread has finished reading shared memory.
__device__ __forceinline__ void store_wait_read() { asm volatile("cp.async.bulk.wait_group.read 0;" ::: "memory"); }
// Until at most N of this thread's bulk store groups are pending, their writes to global memory done (not only
// their reads of shared memory).
template <int N>
__device__ __forceinline__ void store_wait_written() { asm volatile("cp.async.bulk.wait_group %0;" ::"n"(N) : "memory"); }
__device__ __forceinline__ void store_release(uint64_t* p, uint64_t v) {
  asm volatile("st.release.gpu.global.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}

__device__ __forceinline__ void prefetch_tensormap(const CUtensorMap* map) {
  asm volatile("prefetch.tensormap [%0];" ::"l"(map) : "memory");
}

}  // namespace primemoe
#endif
