// Eight bf16 values as one 16-byte vector (the row kernels' unit of load and store), to and from float.
#pragma once

#include <cuda_bf16.h>

namespace primemoe {

constexpr int kBf16Vec = 8;  // bf16 per 16-byte access

#ifdef __CUDACC__
__device__ __forceinline__ void unpack(const uint4& v, float (&f)[kBf16Vec]) {
  const __nv_bfloat162* h = reinterpret_cast<const __nv_bfloat162*>(&v);
#pragma unroll
  for (int i = 0; i < kBf16Vec / 2; ++i) {
    const float2 p = __bfloat1622float2(h[i]);
    f[2 * i] = p.x;
    f[2 * i + 1] = p.y;
  }
}

__device__ __forceinline__ uint4 pack(const float (&f)[kBf16Vec]) {
  uint4 v;
  __nv_bfloat162* h = reinterpret_cast<__nv_bfloat162*>(&v);
#pragma unroll
  for (int i = 0; i < kBf16Vec / 2; ++i) h[i] = __floats2bfloat162_rn(f[2 * i], f[2 * i + 1]);
  return v;
}
#endif

}  // namespace primemoe
