#include "dispatch_layout.cuh"

#include "chained_launch.cuh"

namespace primemoe {
namespace {

constexpr uint32_t kFullWarp = 0xffffffffu;
constexpr int kGroupsPerBatch = 4;   // 32-slot groups whose ids a warp loads before using any of them
constexpr int kCountsPerBatch = 16;  // count-matrix loads in flight per thread

// Shared memory of place_kernel, in ints: warp_rows, before, total, offsets, warp_sums.
constexpr int64_t place_smem_ints(int32_t num_local) {
  return int64_t(kLayoutWarps + 3) * num_local + 1 + kLayoutWarps;
}
static_assert(place_smem_ints(kLayoutMaxLocalExperts) * 4 <= 48 * 1024, "place_kernel needs no smem opt-in");

// The local expert of a slot's id, -1 when the slot is not routed here. Only the counting
// kernel records bad ids: both kernels read the same ids.
template <bool kRecord>
__device__ __forceinline__ int32_t local_expert_of(int64_t id, int64_t slot, const DispatchLayoutArgs& a) {
  if (id < -1 || id >= a.num_experts) {
    if constexpr (kRecord) {
      record_error(a.error, kBadExpertId, static_cast<int32_t>(id), a.num_experts, slot / a.top_k, slot % a.top_k);
    }
    return -1;
  }
  const int64_t local = id - a.expert_begin;
  return (id >= 0 && local >= 0 && local < a.num_local) ? static_cast<int32_t>(local) : -1;
}

// Local experts of this lane's slot in kGroupsPerBatch groups of 32 slots, `group_stride` apart
// from `first`; -1 from `end` on. Every load is issued before any id is looked at.
template <bool kRecord, typename IdT>
__device__ __forceinline__ void load_local_experts(int32_t (&e)[kGroupsPerBatch], const IdT* ids, int64_t first,
                                                   int64_t group_stride, int64_t end, const DispatchLayoutArgs& a) {
  const int lane = threadIdx.x % 32;
  int64_t id[kGroupsPerBatch];
#pragma unroll
  for (int g = 0; g < kGroupsPerBatch; ++g) {
    const int64_t s = first + g * group_stride + lane;
    id[g] = s < end ? static_cast<int64_t>(ids[s]) : -1;
  }
#pragma unroll
  for (int g = 0; g < kGroupsPerBatch; ++g) e[g] = local_expert_of<kRecord>(id[g], first + g * group_stride + lane, a);
}

// workspace[block][e] = slots of the block's range routed to local expert e.
template <typename IdT>
__global__ void __launch_bounds__(kLayoutThreads) count_kernel(DispatchLayoutArgs a, int64_t slots_per_block) {
  allow_next_kernel();
  extern __shared__ int32_t block_counts[];
  for (int e = threadIdx.x; e < a.num_local; e += kLayoutThreads) block_counts[e] = 0;
  __syncthreads();
  const IdT* ids = static_cast<const IdT*>(a.topk_idx);
  const int warp = threadIdx.x / 32;
  const uint32_t lanes_below = (1u << (threadIdx.x % 32)) - 1;
  const int64_t begin = int64_t(blockIdx.x) * slots_per_block;
  const int64_t end = min(begin + slots_per_block, a.num_slots);
  // Counting needs no order: the warps' groups interleave.
  for (int64_t first = begin + warp * 32; first < end; first += kLayoutThreads * kGroupsPerBatch) {
    int32_t e[kGroupsPerBatch];
    load_local_experts<true>(e, ids, first, kLayoutThreads, end, a);
#pragma unroll
    for (int g = 0; g < kGroupsPerBatch; ++g) {
      const uint32_t peers = __match_any_sync(kFullWarp, e[g]);
      if (e[g] >= 0 && (peers & lanes_below) == 0) atomicAdd(&block_counts[e[g]], __popc(peers));
    }
  }
  __syncthreads();
  int32_t* out = a.workspace + int64_t(blockIdx.x) * a.num_local;
  for (int e = threadIdx.x; e < a.num_local; e += kLayoutThreads) out[e] = block_counts[e];
}

// before[e] += expert e's slots in blocks below this one, total[e] += its slots in all blocks.
// Threads split the [num_blocks][num_local] matrix by expert and, when experts are fewer than
// threads, by interleaved blocks; each adds its sums once.
__device__ __forceinline__ void sum_block_counts(const int32_t* counts, int32_t num_blocks, int32_t num_local,
                                                 int32_t* before, int32_t* total) {
  const int32_t parts = num_local < kLayoutThreads ? kLayoutThreads / num_local : 1;
  const int32_t part = int32_t(threadIdx.x) / num_local;
  if (part >= parts) return;
  for (int32_t e = int32_t(threadIdx.x) % num_local; e < num_local; e += kLayoutThreads) {
    int32_t sum_before = 0, sum_all = 0;
    for (int32_t first = part; first < num_blocks; first += parts * kCountsPerBatch) {
      int32_t c[kCountsPerBatch];
#pragma unroll
      for (int j = 0; j < kCountsPerBatch; ++j) {
        const int32_t b = first + j * parts;
        c[j] = b < num_blocks ? counts[int64_t(b) * num_local + e] : 0;
      }
#pragma unroll
      for (int j = 0; j < kCountsPerBatch; ++j) {
        sum_all += c[j];
        if (first + j * parts < int32_t(blockIdx.x)) sum_before += c[j];
      }
    }
    if (sum_all) atomicAdd(&total[e], sum_all);
    if (sum_before) atomicAdd(&before[e], sum_before);
  }
}

// offsets[e] = sum of the experts below e of their row counts padded to row_align; offsets[L] = the total.
// Each thread scans a run of consecutive experts; warps combine through warp_sums.
__device__ __forceinline__ void scan_padded_offsets(const int32_t* total, int32_t* offsets, int32_t* warp_sums,
                                                    int32_t num_local, int32_t row_align) {
  const int lane = threadIdx.x % 32;
  const int warp = threadIdx.x / 32;
  const int32_t per_thread = (num_local + kLayoutThreads - 1) / kLayoutThreads;
  const int32_t first = min(int32_t(threadIdx.x) * per_thread, num_local);
  const int32_t last = min(first + per_thread, num_local);
  int32_t mine = 0;
  for (int32_t e = first; e < last; ++e) mine += layout_padded(total[e], row_align);
  int32_t inclusive = mine;
#pragma unroll
  for (int d = 1; d < 32; d *= 2) {
    const int32_t up = __shfl_up_sync(kFullWarp, inclusive, d);
    if (lane >= d) inclusive += up;
  }
  if (lane == 31) warp_sums[warp] = inclusive;
  __syncthreads();
  int32_t row = inclusive - mine;
  for (int w = 0; w < warp; ++w) row += warp_sums[w];
  for (int32_t e = first; e < last; ++e) {
    offsets[e] = row;
    row += layout_padded(total[e], row_align);
  }
  if (threadIdx.x == kLayoutThreads - 1) offsets[num_local] = row;
  __syncthreads();
}

// Stable placement over the same blocks as count_kernel (at least one, to write the offsets and
// the -1 rows when there are no slots). Each warp takes a contiguous run of the block's slots, so
// (block, warp, group, lane) order is slot order: a slot's row is its expert's offset, plus the
// expert's slots in earlier blocks, earlier warps of this block, earlier groups of this warp and
// lower lanes of its group.
template <typename IdT>
__global__ void __launch_bounds__(kLayoutThreads) place_kernel(DispatchLayoutArgs a, int64_t slots_per_block,
                                                                 int32_t num_count_blocks, int64_t max_rows) {
  wait_for_previous_kernel();
  allow_next_kernel();
  extern __shared__ int32_t smem[];
  const int32_t L = a.num_local;
  int32_t* warp_rows = smem;                       // [kLayoutWarps][L]: the warp's count, then its next row
  int32_t* before = warp_rows + kLayoutWarps * L;  // [L]
  int32_t* total = before + L;                     // [L]
  int32_t* offsets = total + L;                    // [L + 1]
  int32_t* warp_sums = offsets + L + 1;            // [kLayoutWarps]
  for (int i = threadIdx.x; i < (kLayoutWarps + 2) * L; i += kLayoutThreads) smem[i] = 0;
  __syncthreads();

  const IdT* ids = static_cast<const IdT*>(a.topk_idx);
  const int warp = threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  const uint32_t lanes_below = (1u << lane) - 1;
  const int64_t per_warp = slots_per_block / kLayoutWarps;
  const int64_t warp_begin = int64_t(blockIdx.x) * slots_per_block + warp * per_warp;
  const int64_t warp_end = min(warp_begin + per_warp, a.num_slots);
  int32_t* my_rows = warp_rows + warp * L;

  for (int64_t first = warp_begin; first < warp_end; first += 32 * kGroupsPerBatch) {
    int32_t e[kGroupsPerBatch];
    load_local_experts<false>(e, ids, first, 32, warp_end, a);
#pragma unroll
    for (int g = 0; g < kGroupsPerBatch; ++g) {
      const uint32_t peers = __match_any_sync(kFullWarp, e[g]);
      if (e[g] >= 0 && (peers & lanes_below) == 0) my_rows[e[g]] += __popc(peers);
      __syncwarp();
    }
  }
  sum_block_counts(a.workspace, num_count_blocks, L, before, total);
  __syncthreads();

  scan_padded_offsets(total, offsets, warp_sums, L, a.row_align);
  if (blockIdx.x == 0) {
    for (int e = threadIdx.x; e <= L; e += kLayoutThreads) {
      a.expert_offsets[e] = offsets[e];
      if (e < L) a.expert_counts[e] = total[e];
    }
  }
  for (int e = threadIdx.x; e < L; e += kLayoutThreads) {
    int32_t row = offsets[e] + before[e];
    for (int w = 0; w < kLayoutWarps; ++w) {
      const int32_t n = warp_rows[w * L + e];
      warp_rows[w * L + e] = row;
      row += n;
    }
  }
  __syncthreads();

  for (int64_t first = warp_begin; first < warp_end; first += 32 * kGroupsPerBatch) {
    int32_t e[kGroupsPerBatch];
    load_local_experts<false>(e, ids, first, 32, warp_end, a);
#pragma unroll
    for (int g = 0; g < kGroupsPerBatch; ++g) {
      const int64_t s = first + g * 32 + lane;
      const uint32_t peers = __match_any_sync(kFullWarp, e[g]);
      const uint32_t peers_below = peers & lanes_below;
      if (e[g] >= 0) {
        const int32_t row = my_rows[e[g]] + __popc(peers_below);
        a.slot_to_row[s] = row;
        a.row_to_slot[row] = static_cast<int32_t>(s);
        if (a.slot_valid != nullptr) a.slot_valid[s] = true;
      } else if (s < warp_end) {
        a.slot_to_row[s] = -1;
        if (a.slot_valid != nullptr) a.slot_valid[s] = false;
      }
      __syncwarp();
      if (e[g] >= 0 && peers_below == 0) my_rows[e[g]] += __popc(peers);
      __syncwarp();
    }
  }

  // -1 on the rows no slot takes: each expert's partial last tile (by one block), then the rows
  // past the last expert (by the whole grid).
  for (int e = blockIdx.x; e < L; e += gridDim.x) {
    for (int32_t r = offsets[e] + total[e] + int32_t(threadIdx.x); r < offsets[e + 1]; r += kLayoutThreads) {
      a.row_to_slot[r] = -1;
    }
  }
  const int64_t grid_threads = int64_t(gridDim.x) * kLayoutThreads;
  for (int64_t r = offsets[L] + int64_t(blockIdx.x) * kLayoutThreads + threadIdx.x; r < max_rows; r += grid_threads) {
    a.row_to_slot[r] = -1;
  }
}

template <typename IdT>
cudaError_t launch_typed(const DispatchLayoutArgs& a, cudaStream_t stream) {
  const int64_t slots_per_block = layout_slots_per_block(a.num_slots, a.num_local);
  const int64_t blocks = layout_blocks(a.num_slots, a.num_local);
  const int64_t max_rows = layout_max_rows(a.num_slots, a.num_local, a.row_align);
  const size_t count_smem = size_t(a.num_local) * sizeof(int32_t);
  if (blocks > 0) {
    count_kernel<IdT><<<blocks, kLayoutThreads, count_smem, stream>>>(a, slots_per_block);
    const cudaError_t err = cudaGetLastError();
    if (err != cudaSuccess) return err;
  }
  const size_t place_smem = size_t(place_smem_ints(a.num_local)) * sizeof(int32_t);
  return launch_chained(place_kernel<IdT>, dim3(blocks > 0 ? blocks : 1), dim3(kLayoutThreads), place_smem, stream,
                        a, slots_per_block, static_cast<int32_t>(blocks), max_rows);
}

}  // namespace

cudaError_t launch_dispatch_layout(const DispatchLayoutArgs& args, cudaStream_t stream) {
  if (args.num_local < 1 || args.top_k < 1 || args.num_local > kLayoutMaxLocalExperts || args.row_align < 1)
    return cudaErrorInvalidValue;
  return args.idx_is_int64 ? launch_typed<int64_t>(args, stream) : launch_typed<int32_t>(args, stream);
}

}  // namespace primemoe
