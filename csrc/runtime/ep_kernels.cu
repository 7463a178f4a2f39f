#include <cuda_bf16.h>
#include <nvshmem.h>
#include <nvshmemx.h>

#include "../kernels/chained_launch.cuh"
#include "../kernels/device_wait.cuh"
#include "../kernels/dispatch_layout.cuh"
#include "ep_kernels.cuh"

namespace primemoe {
namespace {

constexpr int kThreads = 256;
constexpr int kMaxExperts = kLayoutMaxLocalExperts;  // W * E_local, checked by the binding
constexpr int kVec = 8;  // bf16 per 16-byte access

template <typename T>
__device__ __forceinline__ T* region(uint8_t* ws, size_t offset) {
  return reinterpret_cast<T*>(ws + offset);
}

__device__ __forceinline__ int64_t expert_id(const void* ids, bool is_int64, int64_t slot) {
  return is_int64 ? static_cast<const int64_t*>(ids)[slot] : static_cast<const int32_t*>(ids)[slot];
}

__device__ __forceinline__ float slot_weight(const void* w, ScaleType type, int64_t slot) {
  return type == ScaleType::kBFloat16 ? __bfloat162float(static_cast<const __nv_bfloat16*>(w)[slot])
                                      : static_cast<const float*>(w)[slot];
}

// Row kernels: 16 warps per SM on the Buffer's 16 SMs; with the padding spread over the warps, 24 SMs x 8 warps
// made dispatch and combine slower.
constexpr int kRowThreads = 512;
constexpr int kRowWarps = kRowThreads / 32;
constexpr int kCopyUnroll = 8;

// A warp copies one row: all its loads are issued before its (remote) stores, kCopyUnroll
// 16-byte vectors per lane at a time, so the copy is bound by bandwidth, not load latency.
// `fresh`: the source is being written by a kernel running alongside (read after an acquire, so not through the
// non-coherent read-only path, which is only for data that no one writes while this kernel runs).
__device__ __forceinline__ void copy_row(uint4* dst, const uint4* src, int vecs, int lane, bool fresh = false) {
  for (int base = lane; base < vecs; base += 32 * kCopyUnroll) {
    uint4 buf[kCopyUnroll];
#pragma unroll
    for (int u = 0; u < kCopyUnroll; ++u) {
      if (base + 32 * u < vecs) buf[u] = fresh ? src[base + 32 * u] : __ldg(src + base + 32 * u);
    }
#pragma unroll
    for (int u = 0; u < kCopyUnroll; ++u) {
      if (base + 32 * u < vecs) dst[base + 32 * u] = buf[u];
    }
  }
}

// How this rank writes into `pe`'s copy of its symmetric workspace `ws`: by plain stores through
// `mapped` (that copy as this GPU maps it), or, where null, by NVSHMEM RMA on the symmetric address.
struct PeerWriter {
  int pe;
  uint8_t* ws;
  uint8_t* mapped;

  __device__ PeerWriter(uint8_t* workspace, int peer, const EpConfig& c) : pe(peer), ws(workspace) {
    if (peer == c.rank) mapped = workspace;
    else mapped = c.force_put ? nullptr : static_cast<uint8_t*>(nvshmem_ptr(workspace, peer));
  }

  __device__ bool puts() const { return mapped == nullptr; }

  template <typename T>
  __device__ T* at(T* symmetric) const {
    return reinterpret_cast<T*>(mapped + (reinterpret_cast<uint8_t*>(symmetric) - ws));
  }

  __device__ void value(int32_t* dst, int32_t v) const {
    if (puts()) nvshmem_int_p(dst, v, pe);
    else *at(dst) = v;
  }

  __device__ void value(float* dst, float v) const {
    if (puts()) nvshmem_float_p(dst, v, pe);
    else *at(dst) = v;
  }

  // One row, by the whole warp. A put reads it from `stage`, this rank's own symmetric row.
  __device__ void row(__nv_bfloat16* dst, const __nv_bfloat16* src, __nv_bfloat16* stage, int H, int lane,
                      bool fresh = false) const {
    if (!puts()) {
      copy_row(reinterpret_cast<uint4*>(at(dst)), reinterpret_cast<const uint4*>(src), H / kVec, lane, fresh);
      return;
    }
    copy_row(reinterpret_cast<uint4*>(stage), reinterpret_cast<const uint4*>(src), H / kVec, lane, fresh);
    __syncwarp();
    __threadfence();  // the whole staged row is in memory before the transport reads it
    nvshmemx_putmem_nbi_warp(dst, stage, size_t(H) * sizeof(__nv_bfloat16), pe);
  }
};

// Ends a warp's run of `rows` rows sent to `pe`: makes them visible there (after puts, each lane first
// completes its own), counts them in *done, and the run that brings *done to *expected applies `op`
// with `value` to `signal` on `pe`.
__device__ __forceinline__ void publish_run(int32_t rows, int32_t* done, const int32_t* expected, uint64_t* signal,
                                            uint64_t value, int op, int pe, int lane, bool puts) {
  if (puts) nvshmem_quiet();
  __syncwarp();
  __threadfence_system();
  if (lane == 0 && atomicAdd(done, rows) + rows == *expected) {
    __threadfence_system();
    nvshmemx_signal_op(signal, value, op, pe);
  }
}

// Each warp takes one contiguous share of the rows [first, last), so it makes its rows visible
// and counts them once per run of rows with the same (destination, expert) or source, not once per row.
__device__ __forceinline__ void warp_row_range(int32_t first, int32_t last, int32_t warp, int32_t warps,
                                               int32_t* begin, int32_t* end) {
  const int32_t per_warp = (last - first + warps - 1) / warps;
  *begin = min(last, first + warp * per_warp);
  *end = min(last, *begin + per_warp);
}

__global__ void __launch_bounds__(kThreads) ep_notify_kernel(EpDispatchArgs a) {
  wait_for_previous_kernel();
  allow_next_kernel();
  const EpConfig& c = a.cfg;
  const int W = c.world, E = c.local_experts, me = c.rank;
  __shared__ uint64_t epoch_shared;
  if (threadIdx.x == 0) {
    epoch_shared = *a.epoch + 1;
    *a.epoch = epoch_shared;
  }
  __syncthreads();
  const uint64_t epoch = epoch_shared;
  int32_t* matrix = region<int32_t>(a.workspace, a.layout.count_matrix);  // [src][dest][e]
  uint64_t* count_flags = region<uint64_t>(a.workspace, a.layout.count_flags);
  uint64_t* arrivals = region<uint64_t>(a.workspace, a.layout.expert_arrivals);

  int32_t* my_row = matrix + int64_t(me) * W * E;
  // The rows kernel counts here, and the GEMM that waits on this dispatch claims its tiles here.
  for (int i = threadIdx.x; i < W * E; i += blockDim.x) a.scratch.send_done[i] = 0;
  for (int e = threadIdx.x; e < E; e += blockDim.x) a.scratch.pad_done[e] = 0;
  for (int src = threadIdx.x; src < W; src += blockDim.x) a.scratch.combine_done[src] = 0;  // this epoch's combine
  if (threadIdx.x == 0) *a.scratch.tile_counter = 0;
  for (int p = 0; p < W; ++p) {
    const PeerWriter to(a.workspace, p, c);
    for (int i = threadIdx.x; i < W * E; i += blockDim.x) to.value(my_row + i, a.send_counts[i]);
  }
  // Each writer completes its own puts before the flags below say the counts have landed.
  if (c.put_peers && threadIdx.x < W * E) nvshmem_quiet();
  __threadfence_system();
  __syncthreads();
  for (int p = threadIdx.x; p < W; p += blockDim.x) nvshmemx_signal_op(count_flags + me, epoch, NVSHMEM_SIGNAL_SET, p);
  for (int src = threadIdx.x; src < W; src += blockDim.x)
    wait_at_least(count_flags + src, epoch, a.timeout_ns, a.error, me, src, -1, kWaitCounts);
  __syncthreads();

  // The layouts below come from shared memory: loops over global memory in one thread would pay a
  // memory latency per expert.
  __shared__ int32_t pair_rows[kMaxExperts];    // [dest][e]: rows all sources send to (dest, e)
  __shared__ int32_t pair_before[kMaxExperts];  // [dest][e]: rows of the sources before this rank
  __shared__ int32_t recv_rows_from[kMaxExperts];  // [src], W <= W * E
  __shared__ int32_t dest_rows[kMaxExperts];       // [dest]: its padded receive rows
  __shared__ bool over[kMaxExperts];               // [dest]: more than its receive region holds
  for (int i = threadIdx.x; i < W; i += blockDim.x) recv_rows_from[i] = 0;
  __syncthreads();
  for (int i = threadIdx.x; i < W * E; i += blockDim.x) {
    const int dest = i / E, e = i % E;
    int32_t total = 0, before = 0;
    for (int src = 0; src < W; ++src) {
      const int32_t rows = matrix[(int64_t(src) * W + dest) * E + e];
      total += rows;
      if (src < me) before += rows;
      if (dest == me && rows > 0) atomicAdd(&recv_rows_from[src], rows);
    }
    pair_rows[i] = total;
    pair_before[i] = before;
  }
  __syncthreads();
  // Each destination's experts in order, padded: this rank's send bases there, and for dest == me the
  // receive layout. A warp per destination scans 32 experts per step.
  const int lane = threadIdx.x % 32;
  for (int dest = threadIdx.x / 32; dest < W; dest += blockDim.x / 32) {
    int32_t offset = 0;
    for (int e0 = 0; e0 < E; e0 += 32) {
      const int e = e0 + lane;
      const int32_t total = e < E ? pair_rows[dest * E + e] : 0;
      const int32_t padded = layout_padded(total, c.row_align);
      int32_t inclusive = padded;
#pragma unroll
      for (int d = 1; d < 32; d *= 2) {
        const int32_t up = __shfl_up_sync(0xffffffffu, inclusive, d);
        if (lane >= d) inclusive += up;
      }
      const int32_t start = offset + inclusive - padded;
      if (e < E) {
        a.scratch.send_base[dest * E + e] = start + pair_before[dest * E + e];
        if (dest == me) {
          a.expert_counts[e] = total;
          a.expert_offsets[e] = start;
        }
      }
      offset += __shfl_sync(0xffffffffu, inclusive, 31);
    }
    if (dest == me && lane == 0) a.expert_offsets[E] = offset;
    if (lane == 0) dest_rows[dest] = offset;
  }
  __syncthreads();
  // A destination whose rows would not fit its receive region (EpConfig::recv_capacity) is sent nothing, by every
  // rank alike (each sees every count): its experts get no rows this epoch and every rank records the overflow.
  const int64_t capacity = c.max_recv_rows();
  for (int d = threadIdx.x; d < W; d += blockDim.x) {
    over[d] = dest_rows[d] > capacity;
    if (over[d]) record_error(a.error, kRecvOverflow, d, static_cast<int32_t>(capacity), dest_rows[d], me);
  }
  __syncthreads();
  if (over[me]) {
    for (int e = threadIdx.x; e <= E; e += blockDim.x) {
      if (e < E) a.expert_counts[e] = 0;
      a.expert_offsets[e] = 0;
    }
    for (int src = threadIdx.x; src < W; src += blockDim.x) recv_rows_from[src] = 0;
    __syncthreads();
  }
  for (int src = threadIdx.x; src < W; src += blockDim.x) a.scratch.recv_from[src] = recv_rows_from[src];
  __syncthreads();
  // The send order (EpScratch::send_order): entry p = e (W + 1) + j is destination (me + 1 + j) % W's rows of
  // expert e for j < W, this rank's padding rows of e for j = W; each thread scans a contiguous share of entries.
  __shared__ int32_t share_sums[kThreads];
  const int P = (W + 1) * E;
  const int per_thread = (P + blockDim.x - 1) / blockDim.x;
  const int p0 = min(P, int(threadIdx.x) * per_thread), p1 = min(P, p0 + per_thread);
  auto entry_rows = [&](int p) {
    const int e = p / (W + 1), j = p % (W + 1), dest = (me + 1 + j) % W;
    if (j < W) return over[dest] ? 0 : a.send_counts[dest * E + e];
    return a.expert_offsets[e + 1] - a.expert_offsets[e] - a.expert_counts[e];
  };
  int32_t mine = 0;
  for (int p = p0; p < p1; ++p) mine += entry_rows(p);
  share_sums[threadIdx.x] = mine;
  __syncthreads();
  if (threadIdx.x < 32) {  // exclusive scan of the shares by warp 0, 32 shares per step
    int32_t carried = 0;
    for (int t0 = 0; t0 < int(blockDim.x); t0 += 32) {
      const int32_t v = share_sums[t0 + lane];
      int32_t inclusive = v;
#pragma unroll
      for (int d = 1; d < 32; d *= 2) {
        const int32_t up = __shfl_up_sync(0xffffffffu, inclusive, d);
        if (lane >= d) inclusive += up;
      }
      share_sums[t0 + lane] = carried + inclusive - v;
      carried += __shfl_sync(0xffffffffu, inclusive, 31);
    }
  }
  __syncthreads();
  int32_t start = share_sums[threadIdx.x];
  for (int p = p0; p < p1; ++p) {
    a.scratch.send_order[p] = start;
    start += entry_rows(p);
  }
  if (p1 == P && p0 < p1) a.scratch.send_order[P] = start;
  for (int e = threadIdx.x; e < E; e += blockDim.x) {
    const int32_t pad = a.expert_offsets[e + 1] - a.expert_offsets[e] - a.expert_counts[e];
    a.scratch.pad_rows[e] = pad;
    // An expert without padding rows has them all zeroed already.
    if (pad == 0) nvshmemx_signal_op(arrivals + e, 1, NVSHMEM_SIGNAL_ADD, me);
  }
  // A (destination, expert) pair this rank sends nothing to is complete already.
  for (int i = threadIdx.x; i < W * E; i += blockDim.x) {
    if (a.send_counts[i] == 0 || over[i / E]) nvshmemx_signal_op(arrivals + i % E, 1, NVSHMEM_SIGNAL_ADD, i / E);
  }
}

// The send order's entries are at most W E_local + E_local (the binding's bound on W E_local).
constexpr int kMaxSendOrder = 2 * kMaxExperts + 1;
// Rows a warp takes at a time from the send order: the warps deal the order in 32-row chunks round-robin, so they
// all work on the same few experts at any moment, in the GEMMs' order.
constexpr int kChunkRows = 32;

__global__ void __launch_bounds__(kRowThreads) ep_dispatch_rows_kernel(EpDispatchArgs a) {
  wait_for_previous_kernel();
  allow_next_kernel();
  const EpConfig& c = a.cfg;
  const int W = c.world, E = c.local_experts, me = c.rank, H = c.hidden, K = c.top_k;
  const int lane = threadIdx.x % 32;
  const int64_t S = c.max_slots();
  const int P = (W + 1) * E;
  __nv_bfloat16* recv_rows = region<__nv_bfloat16>(a.workspace, a.layout.recv_rows);
  int32_t* recv_meta = region<int32_t>(a.workspace, a.layout.recv_meta);
  float* recv_weights = region<float>(a.workspace, a.layout.recv_weights);
  uint64_t* arrivals = region<uint64_t>(a.workspace, a.layout.expert_arrivals);
  __nv_bfloat16* stage_rows = region<__nv_bfloat16>(a.workspace, a.layout.stage_rows);  // by send row
  const __nv_bfloat16* x = static_cast<const __nv_bfloat16*>(a.x);
  // The send order in shared memory: each lane finds its row's entry by a binary search in it.
  __shared__ int32_t order[kMaxSendOrder];
  for (int p = threadIdx.x; p <= P; p += blockDim.x) order[p] = a.scratch.send_order[p];
  __syncthreads();
  const int32_t total = order[P];
  const int32_t warps = gridDim.x * kRowWarps;
  const int32_t warp = blockIdx.x * kRowWarps + threadIdx.x / 32;

  int32_t run_p = -1;  // send-order entry of the current run of rows
  int32_t run_rows = 0;
  PeerWriter to(a.workspace, me, c);  // the run's destination
  // Rows of a run are visible on their destination before the run is counted there; the run that completes a
  // (destination, expert) pair, or this rank's padding of an expert, signals the expert's arrival counter.
  auto finish_run = [&]() {
    if (run_rows == 0) return;
    const int e = run_p / (W + 1), j = run_p % (W + 1);
    if (j < W) {
      const int32_t g = to.pe * E + e;
      publish_run(run_rows, &a.scratch.send_done[g], &a.send_counts[g], arrivals + e, 1, NVSHMEM_SIGNAL_ADD, to.pe,
                  lane, to.puts());
    } else {
      publish_run(run_rows, &a.scratch.pad_done[e], &a.scratch.pad_rows[e], arrivals + e, 1, NVSHMEM_SIGNAL_ADD, me,
                  lane, false);
    }
    run_rows = 0;
  };
  for (int32_t chunk = warp * kChunkRows; chunk < total; chunk += warps * kChunkRows) {
    // Lane l looks up row chunk + l: its entry, then (a routed row) its slot, position on the destination and
    // weight, or (a padding row) its row here, so the row loop below starts each copy without dependent loads.
    const int32_t v = chunk + lane;
    int32_t my_p = 0, my_slot = -1, my_pos = 0;
    if (v < total) {
      int lo = 0, hi = P - 1;  // the last entry starting at or before v (it holds v: entries may be empty)
      while (lo < hi) {
        const int mid = (lo + hi + 1) / 2;
        if (order[mid] <= v) lo = mid;
        else hi = mid - 1;
      }
      my_p = lo;
      const int e = lo / (W + 1), j = lo % (W + 1);
      const int32_t k = v - order[lo];
      if (j < W) {
        const int dest = (me + 1 + j) % W;
        const int32_t g = dest * E + e;
        my_slot = a.send_row_to_slot[a.send_offsets[g] + k];
        my_pos = a.scratch.send_base[g] + k;
        // The chunk's scalars first, all lanes at once; they precede the publish of every run they belong to.
        const PeerWriter mine(a.workspace, dest, c);
        mine.value(recv_meta + my_pos, static_cast<int32_t>(me * S + my_slot));
        mine.value(recv_weights + my_pos, slot_weight(a.topk_weights, a.weight_type, my_slot));
        // combine_reduce's map (the layout wrote -1 for the slots not routed).
        region<int32_t>(a.workspace, a.layout.combine_map)[my_slot] = dest == me ? -2 - my_pos : my_slot;
      } else {
        my_pos = a.expert_offsets[e] + a.expert_counts[e] + k;
        recv_meta[my_pos] = -1;
        recv_weights[my_pos] = 0.0f;
      }
    }
    const int rows = min(kChunkRows, total - chunk);
    for (int i = 0; i < rows; ++i) {
      const int32_t p = __shfl_sync(0xffffffffu, my_p, i);
      const int32_t slot = __shfl_sync(0xffffffffu, my_slot, i);
      const int32_t pos = __shfl_sync(0xffffffffu, my_pos, i);
      if (p != run_p) {
        finish_run();
        run_p = p;
        const int j = p % (W + 1);
        to = PeerWriter(a.workspace, j < W ? (me + 1 + j) % W : me, c);
      }
      // Without copy_rows the caller copies the rows (and zeroes the padding rows) itself.
      if (slot >= 0) {
        if (a.copy_rows) {
          to.row(recv_rows + int64_t(pos) * H, x + int64_t(slot / K) * H, stage_rows + int64_t(chunk + i) * H, H,
                 lane);
        }
      } else if (a.copy_rows) {
        // This rank's padding row (source -1 and weight 0 written above): zeros. The expert GEMMs reduce over whole
        // tiles and read the weight of every row in one, so stale data (NaN or Inf included) must not stay there.
        uint4* row = reinterpret_cast<uint4*>(recv_rows + int64_t(pos) * H);
        for (int q = lane; q < H / kVec; q += 32) row[q] = make_uint4(0, 0, 0, 0);
      }
      ++run_rows;
    }
  }
  finish_run();
}

__global__ void __launch_bounds__(kThreads) ep_wait_arrivals_kernel(EpDispatchArgs a) {
  wait_for_previous_kernel();
  const uint64_t target = uint64_t(*a.epoch) * ep_arrivals_per_epoch(a.cfg.world);
  const uint64_t* arrivals = region<uint64_t>(a.workspace, a.layout.expert_arrivals);
  for (int e = threadIdx.x; e < a.cfg.local_experts; e += blockDim.x)
    wait_at_least(arrivals + e, target, a.timeout_ns, a.error, a.cfg.rank, -1, e, kWaitArrivals);
}

__global__ void __launch_bounds__(kRowThreads) ep_combine_rows_kernel(EpCombineArgs a) {
  allow_next_kernel();
  const EpConfig& c = a.cfg;
  const int W = c.world, H = c.hidden, me = c.rank;
  const int lane = threadIdx.x % 32;
  const int32_t S = static_cast<int32_t>(c.max_slots());  // W * S receive rows fit int32
  const uint64_t epoch = *a.epoch;
  const int32_t* recv_meta = region<int32_t>(a.workspace, a.layout.recv_meta);
  __nv_bfloat16* combine_rows = region<__nv_bfloat16>(a.workspace, a.layout.combine_rows);
  float* combine_scalars = region<float>(a.workspace, a.layout.combine_scalars);
  uint64_t* combine_flags = region<uint64_t>(a.workspace, a.layout.combine_flags);
  __nv_bfloat16* stage_rows = region<__nv_bfloat16>(a.workspace, a.layout.stage_rows);  // by receive row
  const __nv_bfloat16* rows_in = static_cast<const __nv_bfloat16*>(a.rows);

  if (blockIdx.x == 0) {
    for (int src = threadIdx.x; src < W; src += blockDim.x) {
      if (a.scratch.recv_from[src] == 0) nvshmemx_signal_op(combine_flags + me, epoch, NVSHMEM_SIGNAL_SET, src);
    }
  }
  const int32_t warp = blockIdx.x * kRowWarps + threadIdx.x / 32, warps = gridDim.x * kRowWarps;
  const int32_t total = a.expert_offsets[c.local_experts];
  int run_src = -1;  // source rank of the current run of rows
  PeerWriter to(a.workspace, me, c);  // writes into run_src
  int32_t run_rows = 0;
  auto finish_run = [&]() {
    if (run_rows == 0) return;
    publish_run(run_rows, &a.scratch.combine_done[run_src], &a.scratch.recv_from[run_src], combine_flags + me, epoch,
                NVSHMEM_SIGNAL_SET, run_src, lane, to.puts());
    run_rows = 0;
  };
  // The rows [batch, end) of the receive layout, at most 32.
  auto send_batch = [&](int32_t batch, int32_t end) {
    const int32_t mine = batch + lane;  // lane l looks up row batch + l
    const int32_t my_meta = mine < end ? recv_meta[mine] : -1;
    const float my_scalar = mine < end && a.row_scalars != nullptr ? a.row_scalars[mine] : 0.0f;
    const int rows = end - batch;
    for (int i = 0; i < rows; ++i) {
      const int32_t meta = __shfl_sync(0xffffffffu, my_meta, i);
      if (meta < 0) continue;  // padding row
      const int src = meta / S;
      if (src != run_src) {
        finish_run();
        run_src = src;
        to = PeerWriter(a.workspace, src, c);
      }
      const int32_t slot = meta % S;
      const int64_t row = batch + i;
      // A row of this rank's own slot stays in `rows`: combine_reduce reads it there (combine_map).
      if (src != me) {
        to.row(combine_rows + int64_t(slot) * H, rows_in + row * H, stage_rows + row * H, H, lane,
               a.result_flags != nullptr);
      }
      if (lane == i && a.row_scalars != nullptr) to.value(combine_scalars + slot, my_scalar);
      ++run_rows;
    }
  };
  if (a.result_flags == nullptr) {
    // Every row is there: each warp one contiguous share (a run per source, few publishes).
    int32_t begin, end;
    warp_row_range(0, total, warp, warps, &begin, &end);
    for (int32_t batch = begin; batch < end; batch += 32) send_batch(batch, min(batch + 32, end));
  } else {
    // Alongside the GEMM: 32-row chunks dealt round-robin, so the warps follow the GEMM through the rows and the
    // last block's rows leave right after it is written. Each chunk waits for its 64-row block's flag.
    static_assert(kEpResultBlockRows % 32 == 0, "a chunk inside one block");
    for (int32_t batch = warp * 32; batch < total; batch += warps * 32) {
      const int64_t block = batch / kEpResultBlockRows;
      if (lane == 0) {
        wait_at_least(a.result_flags + block, epoch, a.timeout_ns, a.error, me, -1, block, kWaitResults);
      }
      __syncwarp();
      send_batch(batch, min(batch + 32, total));
    }
  }
  finish_run();
  // Launched programmatically after the GEMM whose results it sends: it ends only after that GEMM, so what follows
  // on the stream may rely on both. A no-op otherwise.
  wait_for_previous_kernel();
}

__global__ void __launch_bounds__(kThreads) ep_wait_combine_kernel(EpCombineArgs a) {
  wait_for_previous_kernel();
  const uint64_t epoch = *a.epoch;
  const uint64_t* combine_flags = region<uint64_t>(a.workspace, a.layout.combine_flags);
  for (int src = threadIdx.x; src < a.cfg.world; src += blockDim.x)
    wait_at_least(combine_flags + src, epoch, a.timeout_ns, a.error, a.cfg.rank, src, -1, kWaitCombine);
}

}  // namespace

cudaError_t preload_ep_kernels() {
  cudaFuncAttributes attributes;
  for (const void* kernel : {reinterpret_cast<const void*>(ep_notify_kernel),
                             reinterpret_cast<const void*>(ep_dispatch_rows_kernel),
                             reinterpret_cast<const void*>(ep_wait_arrivals_kernel),
                             reinterpret_cast<const void*>(ep_combine_rows_kernel),
                             reinterpret_cast<const void*>(ep_wait_combine_kernel)}) {
    const cudaError_t err = cudaFuncGetAttributes(&attributes, kernel);
    if (err != cudaSuccess) return err;
  }
  return cudaSuccess;
}

cudaError_t launch_ep_dispatch(const EpDispatchArgs& args, cudaStream_t stream) {
  if (args.cfg.hidden % kVec || args.num_blocks < 1) return cudaErrorInvalidValue;
  const EpDispatchArgs& a = args;
  // Each kernel is chained to the one before it (the layout's placement kernel, for notify), so it is
  // launched while that one runs and starts the moment it ends.
  cudaError_t err = launch_chained(ep_notify_kernel, dim3(1), dim3(kThreads), 0, stream, a);
  if (err == cudaSuccess) {
    err = launch_chained(ep_dispatch_rows_kernel, dim3(a.num_blocks), dim3(kRowThreads), 0, stream, a);
  }
  if (err == cudaSuccess && a.wait_arrivals) {
    err = launch_chained(ep_wait_arrivals_kernel, dim3(1), dim3(kThreads), 0, stream, a);
  }
  return err;
}

cudaError_t launch_ep_combine(const EpCombineArgs& a, bool send, bool wait, cudaStream_t stream) {
  if (a.cfg.hidden % kVec || a.num_blocks < 1) return cudaErrorInvalidValue;
  if (!send) return wait ? launch_chained(ep_wait_combine_kernel, dim3(1), dim3(kThreads), 0, stream, a) : cudaSuccess;
  cudaError_t err;
  if (a.result_flags != nullptr) {
    // Starts while the GEMM before it runs (it lets this kernel start and leaves it SMs), waiting per row block.
    err = launch_chained(ep_combine_rows_kernel, dim3(a.num_blocks), dim3(kRowThreads), 0, stream, a);
  } else {
    ep_combine_rows_kernel<<<a.num_blocks, kRowThreads, 0, stream>>>(a);
    err = cudaGetLastError();
  }
  if (err == cudaSuccess && wait) err = launch_chained(ep_wait_combine_kernel, dim3(1), dim3(kThreads), 0, stream, a);
  return err;
}

}  // namespace primemoe
