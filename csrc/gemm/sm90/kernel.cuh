// The expert-grouped GEMM kernel for sm_90a (see grouped_gemm.cuh): one persistent CTA per SM, warp-specialised.
// Warpgroup 0 produces (producer.cuh: the tile walk, TMA loads, FC1's activation warps), warpgroups 1 and 2 consume
// (consumer.cuh: wgmma and the epilogues). The template parameters are the variant (schedule, epilogue, weight
// layout) and the host heuristics' GemmConfig (claimed tile order, 192-row tiles).
#pragma once

#include <cuda.h>

#include <algorithm>
#include <atomic>

#include <cutlass/arch/reg_reconfig.h>

#include "../../kernels/chained_launch.cuh"
#include "consumer.cuh"
#include "producer.cuh"

namespace primemoe::sm90 {

template <GemmSchedule S, GemmEpilogue E, bool BKMajor, bool Claim, bool Merge>
__global__ void __launch_bounds__(kThreads, 1) grouped_gemm_kernel(const __grid_constant__ GemmParams p) {
  static_assert(!Claim || gemm_claims_tiles(S, E), "no claimed tile order in this variant");
  static_assert(!Merge || gemm_merges_tails(S, E, BKMajor), "no 192-row tiles in this variant");
#if defined(__CUDA_ARCH__) && (__CUDA_ARCH__ == 900) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
  using Smem = SharedStorageOf<S, E>;
  constexpr int kStages = Pipeline<S, E>::kStages;
  constexpr bool kActWarps = gemm_activation_warps(S, E);
  static_assert(!Merge || sizeof(Smem::staging) == kStages * kBoxBytes, "a tail slice per stage");
  extern __shared__ uint8_t smem_raw[];
  auto& smem = *reinterpret_cast<Smem*>((reinterpret_cast<uintptr_t>(smem_raw) + 1023) & ~uintptr_t(1023));

  if (threadIdx.x == 0) {
    for (int s = 0; s < kStages; ++s) {
      cutlass::arch::ClusterTransactionBarrier::init(&smem.full[s], 1);  // the TMA thread's arrival
      cutlass::arch::ClusterBarrier::init(&smem.empty[s], 8);            // one arrival per consumer warp
    }
    for (int s = 0; s < 2; ++s) {
      cutlass::arch::ClusterBarrier::init(&smem.tile_full[s], 1);
      cutlass::arch::ClusterBarrier::init(&smem.tile_empty[s], 8);  // one arrival per consumer warp
    }
    if constexpr (Pipeline<S, E>::kSplitHalves) {
      cutlass::arch::ClusterBarrier::init(&smem.exchange_full, 128);  // one arrival per thread
      cutlass::arch::ClusterBarrier::init(&smem.exchange_empty, 128);
    }
    if constexpr (kActWarps) {
      for (int w = 0; w < 2; ++w) {
        // Every thread of the consumer warpgroup arrives twice (a tail tile's job: every thread of both, once).
        cutlass::arch::ClusterBarrier::init(&smem.act_full[w], 256);
        cutlass::arch::ClusterBarrier::init(&smem.act_empty[w], 64);  // every lane of the owner and the helper
      }
    }
    if constexpr (Merge) cutlass::arch::ClusterBarrier::init(&smem.staging_free, 256);  // every consumer thread
    cutlass::arch::fence_barrier_init();
  }
  __syncthreads();
  // Published results (GroupedGemmArgs::done): the kernel that reads them may start at once, on the SMs left to it.
  if (p.args.done.flags != nullptr) allow_next_kernel();

  TileRing<Smem> tiles{smem};
  if (threadIdx.x / 128 == 0) {
    // Exactly what the consumers take: setmaxnreg grows them only from registers the producer gave back.
    cutlass::arch::warpgroup_reg_dealloc<40>();
    const int ptid = threadIdx.x;
    if (kActWarps && ptid >= 32) {
      activation_warps(p, smem, ptid);
      return;
    }
    if (ptid >= 1) return;
    TileWalker<S, E, Merge> walker(p.args);
    tma_producer<S, E, BKMajor, Claim, Merge>(p, smem, walker, tiles);
    // Launched programmatically (GroupedGemmArgs::overlap_sms), the kernel ends only after the one before it: what
    // follows on the stream may rely on both. A no-op otherwise. Here, after the last load, because the wait stalls
    // the whole warp: in a lane beside the producer's it held the loads back until that kernel had ended.
    wait_for_previous_kernel();
    return;
  }
  cutlass::arch::warpgroup_reg_alloc<232>();
  consumer_warpgroups<S, E, BKMajor, Merge>(p, smem, tiles);
#endif
}

template <GemmSchedule S, GemmEpilogue E, bool BKMajor, bool Claim, bool Merge>
cudaError_t launch(const GemmParams& params, int grid, bool programmatic, cudaStream_t stream) {
  static_assert(kSmemBytes<S, E> <= 227 * 1024, "shared memory ring too large");
  auto kernel = grouped_gemm_kernel<S, E, BKMajor, Claim, Merge>;
  int device = 0;
  cudaError_t err = cudaGetDevice(&device);
  if (err != cudaSuccess) return err;
  static std::atomic<bool> smem_set_on[kMaxDevices];  // the attribute is per device: set once on each
  if (device >= kMaxDevices) return cudaErrorInvalidDevice;
  if (!smem_set_on[device].load(std::memory_order_acquire)) {
    err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(kSmemBytes<S, E>));
    if (err != cudaSuccess) return err;
    smem_set_on[device].store(true, std::memory_order_release);
  }
  if (grid <= 0) return cudaSuccess;  // preload_grouped_gemm_kernels: loaded and configured, nothing launched
  if (programmatic) return launch_chained(kernel, dim3(grid), dim3(kThreads), kSmemBytes<S, E>, stream, params);
  kernel<<<grid, kThreads, kSmemBytes<S, E>, stream>>>(params);
  return cudaGetLastError();
}

}  // namespace primemoe::sm90
