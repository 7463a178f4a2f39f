#include "dispatch_layout.cuh"

namespace primemoe {
namespace {

template <typename IdT>
__device__ __forceinline__ int32_t local_expert_of(const IdT* ids, int64_t slot, const DispatchLayoutArgs& a) {
  const int64_t id = static_cast<int64_t>(ids[slot]);
  if (id < -1 || id >= a.num_experts) {
    record_error(a.error, kBadExpertId, static_cast<int32_t>(id), a.num_experts, slot / a.top_k, slot % a.top_k);
    return -1;
  }
  const int64_t local = id - a.expert_begin;
  return (id >= 0 && local >= 0 && local < a.num_local) ? static_cast<int32_t>(local) : -1;
}

template <typename IdT>
__global__ void __launch_bounds__(kLayoutThreads) count_kernel(DispatchLayoutArgs a) {
  extern __shared__ int32_t hist[];
  for (int e = threadIdx.x; e < a.num_local; e += blockDim.x) hist[e] = 0;
  __syncthreads();
  const IdT* ids = static_cast<const IdT*>(a.topk_idx);
  const int64_t begin = int64_t(blockIdx.x) * kLayoutSlotsPerBlock;
  const int64_t end = min(begin + kLayoutSlotsPerBlock, a.num_slots);
  for (int64_t s = begin + threadIdx.x; s < end; s += blockDim.x) {
    const int32_t e = local_expert_of(ids, s, a);
    if (e >= 0) atomicAdd(&hist[e], 1);
  }
  __syncthreads();
  for (int e = threadIdx.x; e < a.num_local; e += blockDim.x) a.workspace[int64_t(blockIdx.x) * a.num_local + e] = hist[e];
}

// Turns per-block counts into per-block bases and writes counts and padded offsets.
__global__ void __launch_bounds__(kLayoutThreads) scan_kernel(DispatchLayoutArgs a, int32_t num_blocks) {
  extern __shared__ int32_t padded[];
  for (int e = threadIdx.x; e < a.num_local; e += blockDim.x) {
    int32_t running = 0;
    for (int32_t b = 0; b < num_blocks; ++b) {
      int32_t* cell = a.workspace + int64_t(b) * a.num_local + e;
      const int32_t c = *cell;
      *cell = running;
      running += c;
    }
    a.expert_counts[e] = running;
    padded[e] = (running + a.row_align - 1) / a.row_align * a.row_align;
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    int32_t offset = 0;
    for (int e = 0; e < a.num_local; ++e) {
      a.expert_offsets[e] = offset;
      offset += padded[e];
    }
    a.expert_offsets[a.num_local] = offset;
  }
}

// Stable placement: within a block, slots are ranked per expert in slot order by
// warp match + popc, then across warps through a small shared histogram.
template <typename IdT>
__global__ void __launch_bounds__(kLayoutThreads) place_kernel(DispatchLayoutArgs a) {
  extern __shared__ int32_t smem[];
  int32_t* running = smem;                  // [num_local] rows placed so far by this block
  int32_t* warp_hist = smem + a.num_local;  // [kLayoutWarps][num_local]
  for (int e = threadIdx.x; e < a.num_local * (kLayoutWarps + 1); e += blockDim.x) smem[e] = 0;
  __syncthreads();

  const IdT* ids = static_cast<const IdT*>(a.topk_idx);
  const int warp = threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  const uint32_t lanes_below = (1u << lane) - 1;
  const int32_t* block_base = a.workspace + int64_t(blockIdx.x) * a.num_local;
  const int64_t begin = int64_t(blockIdx.x) * kLayoutSlotsPerBlock;
  const int64_t end = min(begin + kLayoutSlotsPerBlock, a.num_slots);

  for (int64_t round = begin; round < end; round += blockDim.x) {
    const int64_t s = round + threadIdx.x;
    // Ids are re-read here; errors were already recorded by count_kernel.
    int32_t e = -1;
    if (s < end) {
      const int64_t id = static_cast<int64_t>(ids[s]);
      const int64_t local = id - a.expert_begin;
      if (id >= 0 && id < a.num_experts && local >= 0 && local < a.num_local) e = static_cast<int32_t>(local);
    }
    const uint32_t peers = __match_any_sync(0xffffffffu, e);
    const int32_t rank_in_warp = __popc(peers & lanes_below);
    if (e >= 0 && rank_in_warp == 0) warp_hist[warp * a.num_local + e] = __popc(peers);
    __syncthreads();
    if (e >= 0) {
      int32_t pos = running[e] + rank_in_warp;
      for (int w = 0; w < warp; ++w) pos += warp_hist[w * a.num_local + e];
      const int32_t row = a.expert_offsets[e] + block_base[e] + pos;
      a.slot_to_row[s] = row;
      a.row_to_slot[row] = static_cast<int32_t>(s);
    } else if (s < end) {
      a.slot_to_row[s] = -1;
    }
    __syncthreads();
    for (int ex = threadIdx.x; ex < a.num_local; ex += blockDim.x) {
      int32_t total = 0;
      for (int w = 0; w < kLayoutWarps; ++w) {
        total += warp_hist[w * a.num_local + ex];
        warp_hist[w * a.num_local + ex] = 0;
      }
      running[ex] += total;
    }
    __syncthreads();
  }
}

template <typename IdT>
cudaError_t launch_typed(const DispatchLayoutArgs& a, cudaStream_t stream) {
  const int64_t blocks = layout_blocks(a.num_slots);
  const int64_t max_rows = layout_max_rows(a.num_slots, a.num_local, a.row_align);
  if (max_rows > 0) {
    cudaError_t err = cudaMemsetAsync(a.row_to_slot, 0xff, max_rows * sizeof(int32_t), stream);
    if (err != cudaSuccess) return err;
  }
  const size_t hist_bytes = size_t(a.num_local) * sizeof(int32_t);
  if (blocks > 0) count_kernel<IdT><<<blocks, kLayoutThreads, hist_bytes, stream>>>(a);
  scan_kernel<<<1, kLayoutThreads, hist_bytes, stream>>>(a, static_cast<int32_t>(blocks));
  if (blocks > 0) place_kernel<IdT><<<blocks, kLayoutThreads, hist_bytes * (kLayoutWarps + 1), stream>>>(a);
  return cudaGetLastError();
}

}  // namespace

cudaError_t launch_dispatch_layout(const DispatchLayoutArgs& args, cudaStream_t stream) {
  if (args.num_local < 1 || args.top_k < 1 || args.num_local > kLayoutMaxLocalExperts || args.row_align < 1) return cudaErrorInvalidValue;
  return args.idx_is_int64 ? launch_typed<int64_t>(args, stream) : launch_typed<int32_t>(args, stream);
}

}  // namespace primemoe
