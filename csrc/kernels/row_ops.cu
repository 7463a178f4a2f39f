#include <cuda_bf16.h>

#include <algorithm>

#include "row_ops.cuh"

namespace primemoe {
namespace {

constexpr int kVec = 8;  // bf16 per 16-byte access
constexpr int kRowThreads = 128;

__device__ __forceinline__ float load_scale(const void* p, ScaleType type, int64_t i) {
  switch (type) {
    case ScaleType::kFloat32:
      return static_cast<const float*>(p)[i];
    case ScaleType::kBFloat16:
      return __bfloat162float(static_cast<const __nv_bfloat16*>(p)[i]);
    default:
      return 1.0f;
  }
}

__device__ __forceinline__ void unpack(const uint4& v, float (&f)[kVec]) {
  const __nv_bfloat162* h = reinterpret_cast<const __nv_bfloat162*>(&v);
#pragma unroll
  for (int i = 0; i < kVec / 2; ++i) {
    const float2 p = __bfloat1622float2(h[i]);
    f[2 * i] = p.x;
    f[2 * i + 1] = p.y;
  }
}

__device__ __forceinline__ uint4 pack(const float (&f)[kVec]) {
  uint4 v;
  __nv_bfloat162* h = reinterpret_cast<__nv_bfloat162*>(&v);
#pragma unroll
  for (int i = 0; i < kVec / 2; ++i) h[i] = __floats2bfloat162_rn(f[2 * i], f[2 * i + 1]);
  return v;
}

__global__ void __launch_bounds__(kRowThreads) gather_rows_kernel(GatherRowsArgs a) {
  const int vecs = a.hidden / kVec;
  for (int64_t r = blockIdx.x; r < a.num_rows; r += gridDim.x) {
    const int32_t slot = a.row_to_slot[r];
    uint4* dst = reinterpret_cast<uint4*>(static_cast<__nv_bfloat16*>(a.dst) + r * a.hidden);
    if (slot < 0) {
      for (int v = threadIdx.x; v < vecs; v += blockDim.x) dst[v] = make_uint4(0, 0, 0, 0);
      continue;
    }
    const uint4* src =
        reinterpret_cast<const uint4*>(static_cast<const __nv_bfloat16*>(a.src) + int64_t(slot / a.top_k) * a.hidden);
    if (a.scale_type == ScaleType::kNone) {
      for (int v = threadIdx.x; v < vecs; v += blockDim.x) dst[v] = src[v];
      continue;
    }
    const float s = load_scale(a.scale, a.scale_type, slot);
    for (int v = threadIdx.x; v < vecs; v += blockDim.x) {
      float f[kVec];
      unpack(src[v], f);
#pragma unroll
      for (int i = 0; i < kVec; ++i) f[i] *= s;
      dst[v] = pack(f);
    }
  }
}

__global__ void __launch_bounds__(kRowThreads) combine_reduce_kernel(CombineReduceArgs a) {
  const int vecs = a.hidden / kVec;
  const __nv_bfloat16* rows = static_cast<const __nv_bfloat16*>(a.rows);
  for (int64_t t = blockIdx.x; t < a.num_tokens; t += gridDim.x) {
    uint4* y = reinterpret_cast<uint4*>(static_cast<__nv_bfloat16*>(a.y) + t * a.hidden);
    for (int v = threadIdx.x; v < vecs; v += blockDim.x) {
      float acc[kVec] = {};
      for (int k = 0; k < a.top_k; ++k) {
        const int64_t slot = t * a.top_k + k;
        const int32_t row = a.slot_to_row[slot];
        if (row < 0) continue;
        const float w = load_scale(a.weights, a.weight_type, slot);
        float f[kVec];
        unpack(reinterpret_cast<const uint4*>(rows + int64_t(row) * a.hidden)[v], f);
#pragma unroll
        for (int i = 0; i < kVec; ++i) acc[i] = fmaf(w, f[i], acc[i]);
      }
      y[v] = pack(acc);
    }
  }
}

// One warp per slot.
__global__ void __launch_bounds__(kRowThreads) slot_dot_kernel(SlotDotArgs a) {
  const int warps = blockDim.x / 32;
  const int lane = threadIdx.x % 32;
  const int vecs = a.width / kVec;
  for (int64_t s = int64_t(blockIdx.x) * warps + threadIdx.x / 32; s < a.num_slots; s += int64_t(gridDim.x) * warps) {
    const int32_t row = a.slot_to_row[s];
    float acc = 0.f;
    if (row >= 0) {
      const uint4* ra = reinterpret_cast<const uint4*>(static_cast<const __nv_bfloat16*>(a.a) + int64_t(row) * a.width);
      const uint4* rb = reinterpret_cast<const uint4*>(static_cast<const __nv_bfloat16*>(a.b) + int64_t(row) * a.width);
      for (int v = lane; v < vecs; v += 32) {
        float fa[kVec], fb[kVec];
        unpack(ra[v], fa);
        unpack(rb[v], fb);
#pragma unroll
        for (int i = 0; i < kVec; ++i) acc = fmaf(fa[i], fb[i], acc);
      }
#pragma unroll
      for (int off = 16; off > 0; off /= 2) acc += __shfl_xor_sync(0xffffffffu, acc, off);
    }
    if (lane == 0) a.out[s] = acc;
  }
}

constexpr int kCopyThreads = 256;
constexpr int kCopyUnroll = 4;  // 16-byte loads in flight per thread

__global__ void __launch_bounds__(kCopyThreads) copy_routed_rows_kernel(CopyRoutedRowsArgs a) {
  const int64_t bound = a.expert_offsets[a.num_experts];
  const int64_t routed = bound < 0 ? 0 : (bound > a.num_rows ? a.num_rows : bound);
  const int64_t vecs = routed * (a.row_bytes / 16);
  const uint4* __restrict__ src = static_cast<const uint4*>(a.src);
  uint4* __restrict__ dst = static_cast<uint4*>(a.dst);
  const int64_t stride = int64_t(gridDim.x) * blockDim.x;
  int64_t v = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  for (; v + (kCopyUnroll - 1) * stride < vecs; v += kCopyUnroll * stride) {
    uint4 chunk[kCopyUnroll];
#pragma unroll
    for (int i = 0; i < kCopyUnroll; ++i) chunk[i] = src[v + i * stride];
#pragma unroll
    for (int i = 0; i < kCopyUnroll; ++i) dst[v + i * stride] = chunk[i];
  }
  for (; v < vecs; v += stride) dst[v] = src[v];
}

// Blocks of `threads` for `blocks` blocks' worth of work, at most what fills an H200 (132 SMs of
// 2048 threads); the kernels grid-stride past that.
int grid_for(int64_t blocks, int threads = kRowThreads) {
  return static_cast<int>(std::min<int64_t>(blocks, 132 * 2048 / threads));
}

}  // namespace

cudaError_t launch_gather_rows(const GatherRowsArgs& a, cudaStream_t stream) {
  if (a.hidden % kVec) return cudaErrorInvalidValue;
  if (a.num_rows == 0) return cudaSuccess;
  gather_rows_kernel<<<grid_for(a.num_rows), kRowThreads, 0, stream>>>(a);
  return cudaGetLastError();
}

cudaError_t launch_combine_reduce(const CombineReduceArgs& a, cudaStream_t stream) {
  if (a.hidden % kVec) return cudaErrorInvalidValue;
  if (a.num_tokens == 0) return cudaSuccess;
  combine_reduce_kernel<<<grid_for(a.num_tokens), kRowThreads, 0, stream>>>(a);
  return cudaGetLastError();
}

cudaError_t launch_slot_dot(const SlotDotArgs& a, cudaStream_t stream) {
  if (a.width % kVec) return cudaErrorInvalidValue;
  if (a.num_slots == 0) return cudaSuccess;
  slot_dot_kernel<<<grid_for((a.num_slots + 3) / 4), kRowThreads, 0, stream>>>(a);
  return cudaGetLastError();
}

// The grid is sized for every row (the bound is not known on the host); the kernel stops at the bound.
cudaError_t launch_copy_routed_rows(const CopyRoutedRowsArgs& a, cudaStream_t stream) {
  if (a.row_bytes % 16 || a.num_experts < 0) return cudaErrorInvalidValue;
  const int64_t max_vecs = a.num_rows * (a.row_bytes / 16);
  if (max_vecs == 0) return cudaSuccess;
  const int64_t per_block = int64_t(kCopyThreads) * kCopyUnroll;
  copy_routed_rows_kernel<<<grid_for((max_vecs + per_block - 1) / per_block, kCopyThreads), kCopyThreads, 0,
                            stream>>>(a);
  return cudaGetLastError();
}

}  // namespace primemoe
