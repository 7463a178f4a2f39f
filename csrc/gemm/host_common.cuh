// What the GEMM launchers' host sides share (grouped_gemm.cu, fp8_gemm.cu): the driver's tensor-map encoder, looked
// up once through the runtime (no link against libcuda), the 128B-swizzled 3-D tensor maps both kernel families
// load and store through, the device's compute capability, and the 16-byte alignment check.
#pragma once

#include <cuda.h>
#include <cuda_runtime.h>

#include <atomic>
#include <cstdint>

#include "grouped_gemm.cuh"  // kMaxDevices

namespace primemoe::gemm_host {

using EncodeTiled = CUresult (*)(CUtensorMap*, CUtensorMapDataType, cuuint32_t, void*, const cuuint64_t*,
                                 const cuuint64_t*, const cuuint32_t*, const cuuint32_t*, CUtensorMapInterleave,
                                 CUtensorMapSwizzle, CUtensorMapL2promotion, CUtensorMapFloatOOBfill);

inline EncodeTiled encode_tiled() {
  static EncodeTiled fn = [] {
    void* p = nullptr;
    cudaDriverEntryPointQueryResult status;
    if (cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &p, 12000, cudaEnableDefault, &status) !=
            cudaSuccess ||
        status != cudaDriverEntryPointSuccess) {
      p = nullptr;
    }
    return reinterpret_cast<EncodeTiled>(p);
  }();
  return fn;
}

// A 3-D tensor (inner, outer, layer) of `elem_bytes`-byte elements, inner contiguous, moved in boxes of box_inner x
// box_rows with the 128-byte swizzle (box_inner * elem_bytes = 128).
inline cudaError_t make_swizzled_map(CUtensorMap* map, CUtensorMapDataType dtype, uint32_t elem_bytes,
                                     const void* base, uint64_t inner, uint64_t outer, uint64_t layers,
                                     uint32_t box_inner, uint32_t box_rows) {
  EncodeTiled encode = encode_tiled();
  if (encode == nullptr) return cudaErrorNotSupported;
  const cuuint64_t dims[3] = {inner, outer, layers};
  const cuuint64_t strides[2] = {inner * elem_bytes, inner * outer * elem_bytes};
  const cuuint32_t box[3] = {box_inner, box_rows, 1};
  const cuuint32_t elem_strides[3] = {1, 1, 1};
  CUresult r = encode(map, dtype, 3, const_cast<void*>(base), dims, strides, box, elem_strides,
                      CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
                      CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  return r == CUDA_SUCCESS ? cudaSuccess : cudaErrorInvalidValue;
}

// major * 10 + minor, asked once per device (every GEMM launch checks it).
inline int compute_capability(int device) {
  static std::atomic<int> known[kMaxDevices];
  if (device < 0 || device >= kMaxDevices) return 0;
  int cc = known[device].load(std::memory_order_relaxed);
  if (cc == 0) {
    int major = 0;
    int minor = 0;
    cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device);
    cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device);
    cc = major * 10 + minor;
    known[device].store(cc, std::memory_order_relaxed);
  }
  return cc;
}

inline bool aligned16(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15) == 0; }

}  // namespace primemoe::gemm_host
