// Host side of the FP8 expert GEMMs: checks, TMA descriptors, launch (the kernel: sm90/fp8_kernel.cuh).
#include <cuda.h>

#include <atomic>
#include <cstdint>

#include "fp8_gemm.cuh"
#include "grouped_gemm.cuh"  // kMaxDevices
#include "host_common.cuh"
#include "sm90/fp8_kernel.cuh"

namespace primemoe {
namespace {

using gemm_host::aligned16;
using gemm_host::compute_capability;
using gemm_host::encode_tiled;

// A 3-D byte tensor (inner, outer, layer), inner contiguous, moved in 128 x 128 boxes with the 128-byte swizzle.
cudaError_t make_fp8_map(CUtensorMap* map, const void* base, uint64_t inner, uint64_t outer, uint64_t layers) {
  return gemm_host::make_swizzled_map(map, CU_TENSOR_MAP_DATA_TYPE_UINT8, 1, base, inner, outer, layers,
                                      uint32_t(kFp8TileK), 128);
}

// The bf16 output [outer, inner] in 64 x 64 boxes with the 128-byte swizzle (the staging boxes' layout).
cudaError_t make_bf16_out_map(CUtensorMap* map, void* base, uint64_t inner, uint64_t outer) {
  return gemm_host::make_swizzled_map(map, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 2, base, inner, outer, 1, 64, 64);
}

template <Fp8Schedule S>
cudaError_t launch(const sm90::Fp8Params& params, int grid, cudaStream_t stream) {
  static_assert(sm90::kFp8SmemBytes <= 227 * 1024, "shared memory ring too large");
  auto kernel = sm90::fp8_gemm_kernel<S>;
  int device = 0;
  cudaError_t err = cudaGetDevice(&device);
  if (err != cudaSuccess) return err;
  static std::atomic<bool> smem_set_on[kMaxDevices];
  if (device >= kMaxDevices) return cudaErrorInvalidDevice;
  if (!smem_set_on[device].load(std::memory_order_acquire)) {
    err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(sm90::kFp8SmemBytes));
    if (err != cudaSuccess) return err;
    smem_set_on[device].store(true, std::memory_order_release);
  }
  if (grid <= 0) return cudaSuccess;  // preload_fp8_gemm_kernels: loaded and configured, nothing launched
  kernel<<<grid, sm90::kFp8Threads, sm90::kFp8SmemBytes, stream>>>(params);
  return cudaGetLastError();
}

}  // namespace

cudaError_t preload_fp8_gemm_kernels() {
  const sm90::Fp8Params params{};
  cudaError_t err = launch<Fp8Schedule::kRows>(params, 0, nullptr);
  return err == cudaSuccess ? launch<Fp8Schedule::kExperts>(params, 0, nullptr) : err;
}

bool fp8_gemm_supported(const Fp8GemmArgs& a, int device, const char** why) {
  auto no = [&](const char* reason) {
    if (why != nullptr) *why = reason;
    return false;
  };
#ifndef PRIMEMOE_HAVE_SM90A
  return no("this build has no sm_90a kernels");
#else
  if (compute_capability(device) != 90) return no("the blockwise FP8 GEMMs need an sm_90 (Hopper) GPU");
#endif
  if (encode_tiled() == nullptr) return no("the driver lacks cuTensorMapEncodeTiled");
  if (a.n <= 0 || a.n % kFp8TileN != 0) return no("the output width is not a multiple of 128");
  if (a.schedule == Fp8Schedule::kRows && (a.k <= 0 || a.k % kFp8TileK != 0)) {
    return no("the reduction length is not a multiple of 128");
  }
  if (a.schedule == Fp8Schedule::kExperts) {
    if (a.m <= 0 || a.m % kFp8TileM != 0) return no("the per-expert output height is not a multiple of 128");
    if (a.num_rows % kFp8TileK != 0) return no("the rows of the weight-gradient operands are not a multiple of 128");
  }
  if (a.num_rows >= (int64_t(1) << 31)) return no("2^31 rows or more");
  if (!aligned16(a.a) || !aligned16(a.b) || !aligned16(a.out) ||
      (a.schedule == Fp8Schedule::kExperts && (!aligned16(a.a_scale) || !aligned16(a.b_scale)))) {
    return no("operands are not 16-byte aligned");
  }
  return true;
}

cudaError_t launch_fp8_gemm(const Fp8GemmArgs& a, cudaStream_t stream) {
  if (a.accumulate && (a.schedule != Fp8Schedule::kExperts || !a.out_fp32)) return cudaErrorInvalidValue;
  sm90::Fp8Params params{};
  params.args = a;
  const uint64_t rows = uint64_t(a.num_rows);
  cudaError_t err;
  if (a.schedule == Fp8Schedule::kRows) {
    err = make_fp8_map(&params.tma_a, a.a, uint64_t(a.k), rows, 1);
    if (err == cudaSuccess) err = make_fp8_map(&params.tma_b, a.b, uint64_t(a.k), uint64_t(a.n), uint64_t(a.num_experts));
  } else {
    err = make_fp8_map(&params.tma_a, a.a, rows, uint64_t(a.m), 1);
    if (err == cudaSuccess) err = make_fp8_map(&params.tma_b, a.b, rows, uint64_t(a.n), 1);
  }
  if (err == cudaSuccess && !a.out_fp32) {
    const uint64_t out_rows = a.schedule == Fp8Schedule::kRows ? rows : uint64_t(a.num_experts) * uint64_t(a.m);
    err = make_bf16_out_map(&params.tma_out, a.out, uint64_t(a.n), out_rows);
  }
  if (err != cudaSuccess) return err;
  const int grid = a.num_sms > 0 ? a.num_sms : 1;
  return a.schedule == Fp8Schedule::kRows ? launch<Fp8Schedule::kRows>(params, grid, stream)
                                          : launch<Fp8Schedule::kExperts>(params, grid, stream);
}

}  // namespace primemoe
