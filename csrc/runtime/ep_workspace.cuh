// The expert-parallel symmetric workspace: one NVSHMEM allocation per rank, same
// layout (and so the same offsets) on every rank, shared by the dispatch/combine
// kernels and the expert GEMM engine, whose FC1 producer waits on `expert_arrivals`.
// Sized for the worst case, so no routing can overflow it: a rank may receive every
// slot of every rank (all tokens to its experts).
//
// Synchronisation is epoch based, so nothing is ever reset between calls and a
// captured CUDA graph replays correctly: `epoch` (local, device memory) is bumped
// once per dispatch by the notify kernel, every flag below is compared against it.
#pragma once

#include <cstddef>
#include <cstdint>

#include "../kernels/host_device.cuh"

namespace primemoe {

struct EpConfig {
  int32_t rank;
  int32_t world;
  int32_t max_tokens;  // per rank
  int32_t hidden;
  int32_t top_k;
  int32_t local_experts;
  int32_t row_align;  // each local expert's received rows start at a multiple of this
  bool put_peers;     // some peer takes NVSHMEM puts (not reachable by load/store): the layout has stage_rows
  bool force_put;     // every other rank takes puts, as if on another node (tests the put path on one node)

  PRIMEMOE_HOST_DEVICE int64_t max_slots() const { return int64_t(max_tokens) * top_k; }
  PRIMEMOE_HOST_DEVICE int64_t max_recv_rows() const {
    return int64_t(world) * max_slots() + int64_t(local_experts) * (row_align - 1);
  }
};

// Byte offsets of each region inside the symmetric allocation (16-byte aligned).
struct EpLayout {
  size_t count_matrix;     // int32 [W src][W dest][E_local]: src's send counts, written by src into every rank
  size_t count_flags;      // uint64 [W src]: epoch at which src's counts landed here
  size_t expert_arrivals;  // uint64 [E_local]: += 1 per source that finished its rows for the expert
  size_t combine_flags;    // uint64 [W src]: epoch at which expert rank src finished pushing my slots back
  size_t recv_rows;        // bf16 [max_recv_rows, H]: expert-major; per expert, sources in rank order
  size_t recv_meta;        // int32 [max_recv_rows]: src_rank * max_slots + slot, -1 for padding rows
  size_t recv_weights;     // float [max_recv_rows]: routing weight of the row's slot, 0 for padding rows
  size_t combine_rows;     // bf16 [max_slots, H]: result row of each of my slots, pushed by its expert rank
  size_t combine_scalars;  // float [max_slots]: per-slot scalar pushed with it (d_topk_weights in backward)
  size_t scratch;          // int32 [4][W * E_local]: this rank's own bookkeeping (EpScratch), never read remotely
  // bf16 [max_recv_rows, H], empty unless put_peers: the local source of the rows put to peers. Last, so
  // the other offsets do not depend on put_peers.
  size_t stage_rows;
  size_t total;
};

inline size_t ep_align(size_t x) { return (x + 15) / 16 * 16; }

inline EpLayout ep_layout(const EpConfig& c) {
  EpLayout l{};
  size_t at = 0;
  auto take = [&at](size_t bytes) {
    const size_t here = at;
    at = ep_align(at + bytes);
    return here;
  };
  const size_t W = c.world, E = c.local_experts, R = c.max_recv_rows(), S = c.max_slots(), H = c.hidden;
  l.count_matrix = take(W * W * E * sizeof(int32_t));
  l.count_flags = take(W * sizeof(uint64_t));
  l.expert_arrivals = take(E * sizeof(uint64_t));
  l.combine_flags = take(W * sizeof(uint64_t));
  l.recv_rows = take(R * H * 2);
  l.recv_meta = take(R * sizeof(int32_t));
  l.recv_weights = take(R * sizeof(float));
  l.combine_rows = take(S * H * 2);
  l.combine_scalars = take(S * sizeof(float));
  l.scratch = take(4 * W * E * sizeof(int32_t));
  l.stage_rows = take(c.put_peers ? R * H * 2 : 0);
  l.total = at;
  return l;
}

}  // namespace primemoe
