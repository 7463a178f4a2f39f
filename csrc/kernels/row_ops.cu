#include <cuda_bf16.h>

#include <algorithm>

#include "bf16_vec.cuh"
#include "row_ops.cuh"

namespace primemoe {
namespace {

constexpr int kVec = kBf16Vec;
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

// The gather and the combine take one token per warp: the gather reads each x row once for all of its
// K destination rows (walking the rows in expert-major order read x once per expert, ~K times from
// DRAM once x outgrows L2), and the combine keeps up to kSlotsInFlight of a token's rows in flight.
constexpr int kWarpThreads = 256;
constexpr int kWarps = kWarpThreads / 32;
constexpr int kGatherUnroll = 8;   // 16-byte vectors per lane loaded before a token's stores
constexpr int kSlotsInFlight = 8;  // rows per token loaded before they are summed

// The routed row count *end (a layout's expert_offsets[E], read on the device) clamped to [0, num_rows].
__device__ __forceinline__ int64_t routed_rows(const int32_t* end, int64_t num_rows) {
  return max(int64_t(0), min(int64_t(*end), num_rows));
}

__device__ __forceinline__ int64_t global_warp() { return int64_t(blockIdx.x) * kWarps + threadIdx.x / 32; }
__device__ __forceinline__ int64_t grid_warps() { return int64_t(gridDim.x) * kWarps; }

__global__ void invert_row_to_slot_kernel(const int32_t* row_to_slot, int64_t num_rows, int64_t num_slots,
                                          int32_t* slot_to_row) {
  for (int64_t r = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; r < num_rows; r += int64_t(gridDim.x) * blockDim.x) {
    const int32_t s = row_to_slot[r];
    if (s >= 0 && s < num_slots) slot_to_row[s] = static_cast<int32_t>(r);
  }
}

template <bool kScaled>
__device__ __forceinline__ uint4 scaled(const uint4& v, float s) {
  if (!kScaled) return v;
  float f[kVec];
  unpack(v, f);
#pragma unroll
  for (int i = 0; i < kVec; ++i) f[i] *= s;
  return pack(f);
}

// At most 64 registers unscaled: 4 blocks per SM (69 without the bound).
template <bool kScaled>
__global__ void __launch_bounds__(kWarpThreads, kScaled ? 2 : 4) gather_rows_kernel(GatherRowsArgs a) {
  const int vecs = a.hidden / kVec, K = a.top_k, lane = threadIdx.x % 32;
  const int32_t* slot_to_row = a.slot_to_row;
  __nv_bfloat16* dst = static_cast<__nv_bfloat16*>(a.dst);
  for (int64_t t = global_warp(); t < a.num_tokens; t += grid_warps()) {
    const uint4* src = reinterpret_cast<const uint4*>(static_cast<const __nv_bfloat16*>(a.src) + t * a.hidden);
    for (int k0 = 0; k0 < K; k0 += 32) {
      const int slots = min(32, K - k0);
      int32_t my_row = -1;
      float my_scale = 1.0f;
      if (lane < slots) {
        my_row = slot_to_row[t * K + k0 + lane];
        my_scale = load_scale(a.scale, a.scale_type, t * K + k0 + lane);
      }
      if (__ballot_sync(0xffffffffu, my_row >= 0) == 0) continue;
      // Every lane runs every step (the shuffles below need the whole warp), masked past the row's end.
      for (int base = 0; base < vecs; base += 32 * kGatherUnroll) {
        uint4 buf[kGatherUnroll];
#pragma unroll
        for (int u = 0; u < kGatherUnroll; ++u) {
          const int v = base + 32 * u + lane;
          if (v < vecs) buf[u] = __ldg(src + v);
        }
        for (int i = 0; i < slots; ++i) {
          const int32_t row = __shfl_sync(0xffffffffu, my_row, i);
          const float s = __shfl_sync(0xffffffffu, my_scale, i);
          if (row < 0) continue;
          uint4* out = reinterpret_cast<uint4*>(dst + int64_t(row) * a.hidden);
#pragma unroll
          for (int u = 0; u < kGatherUnroll; ++u) {
            const int v = base + 32 * u + lane;
            if (v < vecs) out[v] = scaled<kScaled>(buf[u], s);
          }
        }
      }
    }
  }
  // The rows the token pass did not write: those without a slot (zeros), and any that name a slot another
  // row holds (a copy of their own). Lane l checks row r0 + l, so a warp pays one latency per 32 rows.
  const int64_t slots = a.num_tokens * K;
  const int64_t rows = a.row_end == nullptr ? a.num_rows : routed_rows(a.row_end, a.num_rows);
  for (int64_t r0 = global_warp() * 32; r0 < rows; r0 += grid_warps() * 32) {
    const int64_t r = r0 + lane;
    int32_t slot = -1;
    bool left = false;
    if (r < rows) {
      slot = a.row_to_slot[r];
      if (slot >= slots) slot = -1;
      left = slot < 0 || slot_to_row[slot] != r;
    }
    for (unsigned pending = __ballot_sync(0xffffffffu, left); pending != 0; pending &= pending - 1) {
      const int i = __ffs(pending) - 1;
      const int32_t s = __shfl_sync(0xffffffffu, slot, i);
      uint4* out = reinterpret_cast<uint4*>(dst + (r0 + i) * a.hidden);
      if (s < 0) {
        for (int v = lane; v < vecs; v += 32) out[v] = make_uint4(0, 0, 0, 0);
        continue;
      }
      const uint4* src =
          reinterpret_cast<const uint4*>(static_cast<const __nv_bfloat16*>(a.src) + int64_t(s / K) * a.hidden);
      const float scale = load_scale(a.scale, a.scale_type, s);
      for (int v = lane; v < vecs; v += 32) out[v] = scaled<kScaled>(__ldg(src + v), scale);
    }
  }
}

// Each lane sums its 16-byte vectors over the slots in k order (fp32): the same sum whatever the grid.
__global__ void __launch_bounds__(kWarpThreads, 3) combine_reduce_kernel(CombineReduceArgs a) {
  const int vecs = a.hidden / kVec, K = a.top_k, lane = threadIdx.x % 32;
  const uint4* rows = static_cast<const uint4*>(a.rows);
  const uint4* local_rows = static_cast<const uint4*>(a.local_rows);
  for (int64_t t = global_warp(); t < a.num_tokens; t += grid_warps()) {
    const int32_t* slot_rows = a.slot_to_row + t * K;
    uint4* y = reinterpret_cast<uint4*>(static_cast<__nv_bfloat16*>(a.y) + t * a.hidden);
    for (int v = lane; v < vecs; v += 32) {
      float acc[kVec] = {};
      for (int k0 = 0; k0 < K; k0 += kSlotsInFlight) {
        uint4 buf[kSlotsInFlight];
        float w[kSlotsInFlight];
        bool has[kSlotsInFlight];
#pragma unroll
        for (int j = 0; j < kSlotsInFlight; ++j) {
          const int32_t row = k0 + j < K ? slot_rows[k0 + j] : -1;
          has[j] = row >= 0 || (row <= -2 && local_rows != nullptr);
          if (has[j]) {
            buf[j] = row >= 0 ? rows[int64_t(row) * vecs + v] : local_rows[int64_t(-2 - row) * vecs + v];
            w[j] = load_scale(a.weights, a.weight_type, t * K + k0 + j);
          }
        }
#pragma unroll
        for (int j = 0; j < kSlotsInFlight; ++j) {
          if (!has[j]) continue;
          float f[kVec];
          unpack(buf[j], f);
#pragma unroll
          for (int i = 0; i < kVec; ++i) acc[i] = fmaf(w[j], f[i], acc[i]);
        }
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

__global__ void __launch_bounds__(kRowThreads) gather_scalars_kernel(GatherScalarsArgs a) {
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < a.count; i += int64_t(gridDim.x) * blockDim.x) {
    const int64_t at = a.index[i];
    a.out[i] = at >= 0 && at < a.num_values ? load_scale(a.values, a.value_type, at) : 0.f;
  }
}

constexpr int kCopyThreads = 256;
constexpr int kCopyUnroll = 4;  // 16-byte loads in flight per thread

__global__ void __launch_bounds__(kCopyThreads) copy_routed_rows_kernel(CopyRoutedRowsArgs a) {
  const int64_t routed = routed_rows(a.expert_offsets + a.num_experts, a.num_rows);
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

__global__ void __launch_bounds__(kCopyThreads) zero_unrouted_rows_kernel(ZeroUnroutedRowsArgs a) {
  const int64_t first = routed_rows(a.expert_offsets + a.num_experts, a.num_rows);
  const int64_t per_row = a.row_bytes / 16;
  const int64_t vecs = (a.num_rows - first) * per_row;
  uint4* __restrict__ dst = static_cast<uint4*>(a.rows) + first * per_row;
  const int64_t stride = int64_t(gridDim.x) * blockDim.x;
  for (int64_t v = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; v < vecs; v += stride) {
    dst[v] = make_uint4(0, 0, 0, 0);
  }
}

// Blocks of `threads` for `blocks` blocks' worth of work, at most what fills an H200 (132 SMs of
// 2048 threads); the kernels grid-stride past that.
int grid_for(int64_t blocks, int threads = kRowThreads) {
  return static_cast<int>(std::min<int64_t>(blocks, 132 * 2048 / threads));
}

}  // namespace

cudaError_t launch_invert_row_to_slot(const int32_t* row_to_slot, int64_t num_rows, int64_t num_slots,
                                      int32_t* slot_to_row, cudaStream_t stream) {
  if (num_slots == 0) return cudaSuccess;
  const cudaError_t err = cudaMemsetAsync(slot_to_row, 0xff, size_t(num_slots) * sizeof(int32_t), stream);  // -1
  if (err != cudaSuccess || num_rows == 0) return err;
  invert_row_to_slot_kernel<<<grid_for((num_rows + 255) / 256, 256), 256, 0, stream>>>(row_to_slot, num_rows,
                                                                                      num_slots, slot_to_row);
  return cudaGetLastError();
}

cudaError_t launch_gather_rows(const GatherRowsArgs& a, cudaStream_t stream) {
  if (a.hidden % kVec) return cudaErrorInvalidValue;
  if (a.num_rows == 0) return cudaSuccess;
  const int64_t warps = std::max(a.num_tokens, (a.num_rows + 31) / 32);
  const int grid = grid_for((warps + kWarps - 1) / kWarps, kWarpThreads);
  if (a.scale_type == ScaleType::kNone) gather_rows_kernel<false><<<grid, kWarpThreads, 0, stream>>>(a);
  else gather_rows_kernel<true><<<grid, kWarpThreads, 0, stream>>>(a);
  return cudaGetLastError();
}

cudaError_t launch_combine_reduce(const CombineReduceArgs& a, cudaStream_t stream) {
  if (a.hidden % kVec) return cudaErrorInvalidValue;
  if (a.num_tokens == 0) return cudaSuccess;
  combine_reduce_kernel<<<grid_for((a.num_tokens + kWarps - 1) / kWarps, kWarpThreads), kWarpThreads, 0, stream>>>(a);
  return cudaGetLastError();
}

cudaError_t launch_slot_dot(const SlotDotArgs& a, cudaStream_t stream) {
  if (a.width % kVec) return cudaErrorInvalidValue;
  if (a.num_slots == 0) return cudaSuccess;
  slot_dot_kernel<<<grid_for((a.num_slots + 3) / 4), kRowThreads, 0, stream>>>(a);
  return cudaGetLastError();
}

cudaError_t launch_gather_scalars(const GatherScalarsArgs& a, cudaStream_t stream) {
  if (a.value_type == ScaleType::kNone) return cudaErrorInvalidValue;
  if (a.count == 0) return cudaSuccess;
  gather_scalars_kernel<<<grid_for((a.count + kRowThreads - 1) / kRowThreads), kRowThreads, 0, stream>>>(a);
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

cudaError_t launch_zero_unrouted_rows(const ZeroUnroutedRowsArgs& a, cudaStream_t stream) {
  if (a.row_bytes % 16 || a.num_experts < 0) return cudaErrorInvalidValue;
  const int64_t max_vecs = a.num_rows * (a.row_bytes / 16);
  if (max_vecs == 0) return cudaSuccess;
  zero_unrouted_rows_kernel<<<grid_for((max_vecs + kCopyThreads - 1) / kCopyThreads, kCopyThreads), kCopyThreads, 0,
                              stream>>>(a);
  return cudaGetLastError();
}

}  // namespace primemoe
