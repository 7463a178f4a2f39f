#include <cuda_bf16.h>

#include <algorithm>
#include <cstdlib>

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

// The gather and the combine take one token per warp: the gather reads each x row once for all of its
// K destination rows (walking the rows in expert-major order read x once per expert, ~K times from
// DRAM once x outgrows L2), and the combine keeps up to kSlotsInFlight of a token's rows in flight.
constexpr int kWarpThreads = 256;
constexpr int kWarps = kWarpThreads / 32;
constexpr int kGatherUnroll = 8;   // 16-byte vectors per lane loaded before a token's stores
constexpr int kSlotsInFlight = 8;  // rows per token loaded before they are summed

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

// The rows the token pass did not write: those without a slot (zeros), and any that name a slot another
// row holds (a copy of their own). Lane l checks row r0 + l, so a warp pays one latency per 32 rows.
template <bool kScaled>
__device__ __forceinline__ void fill_unslotted_rows(const GatherRowsArgs& a, int64_t warp, int64_t warps) {
  const int vecs = a.hidden / kVec, K = a.top_k, lane = threadIdx.x % 32;
  const int32_t* slot_to_row = a.slot_to_row;
  __nv_bfloat16* dst = static_cast<__nv_bfloat16*>(a.dst);
  const int64_t slots = a.num_tokens * K;
  for (int64_t r0 = warp * 32; r0 < a.num_rows; r0 += warps * 32) {
    const int64_t r = r0 + lane;
    int32_t slot = -1;
    bool left = false;
    if (r < a.num_rows) {
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

// At most 64 registers unscaled: 4 blocks per SM, as measured (it came to 69 without the bound).
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
  fill_unslotted_rows<kScaled>(a, global_warp(), grid_warps());
}

// The unscaled gather by the copy engine: one warp per CTA streams its tokens' x rows through a ring of
// shared-memory stages with TMA bulk copies, lane k storing the token's k-th destination row. The warps' own
// 16-byte copies moved ~2.6 TB/s (reads and writes) at Qwen3-235B T = 8192; a copy runs at ~4.3.
constexpr int kBulkMaxStages = 8;
constexpr int kBulkRingBytes = 32 * 1024;  // per CTA, as stages of one row

__device__ __forceinline__ uint32_t smem_u32(const void* p) { return static_cast<uint32_t>(__cvta_generic_to_shared(p)); }

__device__ __forceinline__ void bulk_load_row(void* smem, const void* src, uint32_t bytes, uint64_t* full) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(smem_u32(full)), "r"(bytes) : "memory");
  asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::"r"(
                   smem_u32(smem)),
               "l"(src), "r"(bytes), "r"(smem_u32(full))
               : "memory");
}

__device__ __forceinline__ void bulk_store_row(void* dst, const void* smem, uint32_t bytes) {
  asm volatile("cp.async.bulk.global.shared::cta.bulk_group [%0], [%1], %2;" ::"l"(dst), "r"(smem_u32(smem)), "r"(bytes)
               : "memory");
}

__device__ __forceinline__ void wait_full(uint64_t* full, uint32_t parity) {
  asm volatile(
      "{\n\t.reg .pred done;\n\t"
      "wait_full_again:\n\t"
      "mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n\t"
      "@!done bra wait_full_again;\n\t}" ::"r"(smem_u32(full)),
      "r"(parity)
      : "memory");
}

__global__ void __launch_bounds__(32) gather_rows_bulk_kernel(GatherRowsArgs a, int stages, int64_t tokens_per_block) {
  extern __shared__ __align__(128) uint8_t ring[];
  __shared__ __align__(8) uint64_t full[kBulkMaxStages];
  const int lane = threadIdx.x, K = a.top_k;
  const uint32_t row_bytes = uint32_t(a.hidden) * sizeof(__nv_bfloat16);
  const int64_t t0 = int64_t(blockIdx.x) * tokens_per_block;
  const int64_t n = max(int64_t(0), min(a.num_tokens - t0, tokens_per_block));
  const char* src = static_cast<const char*>(a.src) + t0 * row_bytes;
  char* dst = static_cast<char*>(a.dst);
  if (lane == 0) {
    for (int s = 0; s < stages; ++s)
      asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(smem_u32(&full[s])) : "memory");
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    for (int64_t i = 0; i < min(int64_t(stages), n); ++i) bulk_load_row(ring + i * row_bytes, src + i * row_bytes, row_bytes, &full[i]);
  }
  __syncwarp();
  const int32_t* slot_rows = a.slot_to_row + t0 * K;
  int32_t row = n > 0 && lane < K ? slot_rows[lane] : -1;
  for (int64_t i = 0; i < n; ++i) {
    const int32_t next = i + 1 < n && lane < K ? slot_rows[(i + 1) * K + lane] : -1;
    const int s = static_cast<int>(i % stages);
    wait_full(&full[s], static_cast<uint32_t>(i / stages) & 1);
    if (row >= 0) bulk_store_row(dst + int64_t(row) * row_bytes, ring + s * row_bytes, row_bytes);
    asm volatile("cp.async.bulk.commit_group;" ::: "memory");
    // The previous token's stores have read its stage once every lane's next-to-last group has.
    asm volatile("cp.async.bulk.wait_group.read 1;" ::: "memory");
    __syncwarp();
    const int64_t refill = i - 1 + stages;
    if (lane == 0 && i >= 1 && refill < n) {
      const int r = static_cast<int>(refill % stages);
      bulk_load_row(ring + r * row_bytes, src + refill * row_bytes, row_bytes, &full[r]);
    }
    row = next;
  }
  asm volatile("cp.async.bulk.wait_group 0;" ::: "memory");
  fill_unslotted_rows<false>(a, blockIdx.x, gridDim.x);
}

// Each lane sums its 16-byte vectors over the slots in k order (fp32): the same sum whatever the grid.
__global__ void __launch_bounds__(kWarpThreads, 3) combine_reduce_kernel(CombineReduceArgs a) {
  const int vecs = a.hidden / kVec, K = a.top_k, lane = threadIdx.x % 32;
  const uint4* rows = static_cast<const uint4*>(a.rows);
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
          has[j] = row >= 0;
          if (has[j]) {
            buf[j] = rows[int64_t(row) * vecs + v];
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

cudaError_t launch_invert_row_to_slot(const int32_t* row_to_slot, int64_t num_rows, int64_t num_slots,
                                      int32_t* slot_to_row, cudaStream_t stream) {
  if (num_slots == 0) return cudaSuccess;
  const cudaError_t err = cudaMemsetAsync(slot_to_row, 0xff, size_t(num_slots) * sizeof(int32_t), stream);  // -1
  if (err != cudaSuccess || num_rows == 0) return err;
  invert_row_to_slot_kernel<<<grid_for((num_rows + 255) / 256, 256), 256, 0, stream>>>(row_to_slot, num_rows,
                                                                                      num_slots, slot_to_row);
  return cudaGetLastError();
}

namespace {

// The ring's stages for the bulk gather, or 0 where it does not apply: scaled rows, more than 32 slots per
// token, rows too long for two stages, or rows not 16-byte aligned.
int bulk_gather_stages(const GatherRowsArgs& a) {
  const int64_t row_bytes = int64_t(a.hidden) * 2;
  const bool aligned = (reinterpret_cast<uintptr_t>(a.src) | reinterpret_cast<uintptr_t>(a.dst)) % 16 == 0;
  if (a.scale_type != ScaleType::kNone || a.top_k > 32 || !aligned || 2 * row_bytes > 200 * 1024) return 0;
  return static_cast<int>(std::clamp<int64_t>(kBulkRingBytes / row_bytes, 2, kBulkMaxStages));
}

cudaError_t launch_gather_rows_bulk(const GatherRowsArgs& a, int stages, cudaStream_t stream) {
  const size_t smem = size_t(stages) * size_t(a.hidden) * 2;
  cudaError_t err = cudaFuncSetAttribute(gather_rows_bulk_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                         static_cast<int>(smem));
  int device = 0, sms = 0, per_sm = 0;
  if (err == cudaSuccess) err = cudaGetDevice(&device);
  if (err == cudaSuccess) err = cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device);
  if (err == cudaSuccess) err = cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, gather_rows_bulk_kernel, 32, smem);
  if (err != cudaSuccess) return err;
  const int64_t work = std::max(a.num_tokens, (a.num_rows + 31) / 32);
  const int grid = static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(work, int64_t(sms) * std::max(per_sm, 1))));
  const int64_t tokens_per_block = (a.num_tokens + grid - 1) / grid;
  gather_rows_bulk_kernel<<<grid, 32, smem, stream>>>(a, stages, tokens_per_block);
  return cudaGetLastError();
}

}  // namespace

cudaError_t launch_gather_rows(const GatherRowsArgs& a, cudaStream_t stream) {
  if (a.hidden % kVec) return cudaErrorInvalidValue;
  if (a.num_rows == 0) return cudaSuccess;
  const char* bulk = std::getenv("PRIMEMOE_GATHER_BULK");
  const int stages = bulk != nullptr && bulk[0] == '0' ? 0 : bulk_gather_stages(a);
  if (stages > 0) return launch_gather_rows_bulk(a, stages, stream);
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
