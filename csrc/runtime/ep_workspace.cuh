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

#include <array>
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
  // Routed rows a rank can receive per dispatch (0: the worst case, world * max_slots): the receive region, and the
  // layer's row buffers sized like it, hold this many plus each expert's padding. A dispatch that would bring a rank
  // more sends it nothing and records kRecvOverflow on every rank.
  int64_t recv_capacity;

  PRIMEMOE_HOST_DEVICE int64_t max_slots() const { return int64_t(max_tokens) * top_k; }
  PRIMEMOE_HOST_DEVICE int64_t recv_slots() const {
    const int64_t worst = int64_t(world) * max_slots();
    return recv_capacity > 0 && recv_capacity < worst ? recv_capacity : worst;
  }
  PRIMEMOE_HOST_DEVICE int64_t max_recv_rows() const {
    return recv_slots() + int64_t(local_experts) * (row_align - 1);
  }
};

// Byte offsets of each region inside the symmetric allocation (16-byte aligned), from ep_regions below.
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
  size_t combine_map;      // int32 [max_slots]: combine_reduce's map of my slots, written by the dispatch: -1 not
                           // routed, the slot itself (its row comes back into combine_rows), or -2 - r for a slot
                           // routed to my own experts (its row stays at receive row r: the combine never copies it)
  // This rank's send-side layout (dispatch_layout over all W * E_local experts, row_align 1), read by the rows kernel.
  size_t send_counts;       // int32 [W * E_local]
  size_t send_offsets;      // int32 [W * E_local + 1]
  size_t send_row_to_slot;  // int32 [max_slots]
  // The GEMM whose result rows a combine sends back (FC2, FC1's dgrad) publishes them per 64-row block of the receive
  // layout: result_counts[b] counts the block's column tiles done, and the tile that completes the block resets it
  // and sets result_flags[b] to the epoch; the combine, running alongside, sends a block once its flag is there.
  size_t result_flags;      // uint64 [max_recv_rows / 64 + 1]
  size_t result_counts;     // int32 [max_recv_rows / 64 + 1]
  size_t scratch;          // int32 [6][(W + 1) * E_local + 1]: this rank's own bookkeeping (EpScratch), never read remotely
  size_t tile_counter;     // int32 [1]: the claimed tile order's counter of the GEMM that waits on this dispatch, zeroed
                           // by it (so no fill kernel separates the dispatch from that GEMM)
  // bf16 [max_recv_rows, H], empty unless put_peers: the local source of the rows put to peers. Last, so
  // the other offsets do not depend on put_peers.
  size_t stage_rows;
  size_t total;
};

inline size_t ep_align(size_t x) { return (x + 15) / 16 * 16; }

// One region of the workspace: element type, shape and byte offset. ep_regions is the layout's
// definition; EpLayout holds its offsets for the kernels, and Python reads it (_ep_workspace_layout).
enum class EpElement : int32_t { kInt32, kUInt64, kBFloat16, kFloat32 };

inline size_t ep_element_bytes(EpElement t) {
  switch (t) {
    case EpElement::kUInt64: return 8;
    case EpElement::kBFloat16: return 2;
    default: return 4;
  }
}

inline const char* ep_element_name(EpElement t) {
  switch (t) {
    case EpElement::kInt32: return "int32";
    case EpElement::kUInt64: return "uint64";
    case EpElement::kBFloat16: return "bfloat16";
    default: return "float32";
  }
}

struct EpRegion {
  const char* name;
  EpElement type;
  int32_t dims;
  int64_t shape[3];
  size_t offset;

  size_t bytes() const {
    size_t n = ep_element_bytes(type);
    for (int32_t d = 0; d < dims; ++d) n *= static_cast<size_t>(shape[d]);
    return n;
  }
};

constexpr int kEpRegions = 18;

// Rows per block of the published GEMM results (GroupedGemmArgs::done): a warpgroup's share of a tile.
constexpr int64_t kEpResultBlockRows = 64;
PRIMEMOE_HOST_DEVICE constexpr int64_t ep_result_blocks(int64_t rows) { return rows / kEpResultBlockRows + 1; }

// expert_arrivals[e] grows by this much per dispatch: one signal per source rank once its rows of e have landed, and
// one from this rank once e's padding rows are zeroed.
PRIMEMOE_HOST_DEVICE constexpr int64_t ep_arrivals_per_epoch(int64_t world) { return world + 1; }

// Entries of the dispatch's send order (EpScratch::send_order): per local expert, one per destination and one for this
// rank's own padding of the expert.
PRIMEMOE_HOST_DEVICE constexpr int64_t ep_send_order_entries(int64_t world, int64_t local_experts) {
  return (world + 1) * local_experts;
}

// The regions in allocation order (EpLayout's fields), each starting 16-byte aligned after the previous one.
inline std::array<EpRegion, kEpRegions> ep_regions(const EpConfig& c) {
  const int64_t W = c.world, E = c.local_experts, R = c.max_recv_rows(), S = c.max_slots(), H = c.hidden;
  std::array<EpRegion, kEpRegions> r = {{
      {"count_matrix", EpElement::kInt32, 3, {W, W, E}, 0},
      {"count_flags", EpElement::kUInt64, 1, {W}, 0},
      {"expert_arrivals", EpElement::kUInt64, 1, {E}, 0},
      {"combine_flags", EpElement::kUInt64, 1, {W}, 0},
      {"recv_rows", EpElement::kBFloat16, 2, {R, H}, 0},
      {"recv_meta", EpElement::kInt32, 1, {R}, 0},
      {"recv_weights", EpElement::kFloat32, 1, {R}, 0},
      {"combine_rows", EpElement::kBFloat16, 2, {S, H}, 0},
      {"combine_scalars", EpElement::kFloat32, 1, {S}, 0},
      {"combine_map", EpElement::kInt32, 1, {S}, 0},
      {"send_counts", EpElement::kInt32, 1, {W * E}, 0},
      {"send_offsets", EpElement::kInt32, 1, {W * E + 1}, 0},
      {"send_row_to_slot", EpElement::kInt32, 1, {S}, 0},
      {"result_flags", EpElement::kUInt64, 1, {ep_result_blocks(R)}, 0},
      {"result_counts", EpElement::kInt32, 1, {ep_result_blocks(R)}, 0},
      {"scratch", EpElement::kInt32, 2, {6, ep_send_order_entries(W, E) + 1}, 0},
      {"tile_counter", EpElement::kInt32, 1, {1}, 0},
      {"stage_rows", EpElement::kBFloat16, 2, {c.put_peers ? R : 0, H}, 0},
  }};
  size_t at = 0;
  for (EpRegion& region : r) {
    region.offset = at;
    at = ep_align(at + region.bytes());
  }
  return r;
}

// Bytes of the whole workspace: the end of the last region, aligned.
inline size_t ep_total_bytes(const std::array<EpRegion, kEpRegions>& r) {
  return ep_align(r[kEpRegions - 1].offset + r[kEpRegions - 1].bytes());
}

inline EpLayout ep_layout(const EpConfig& c) {
  const auto r = ep_regions(c);
  EpLayout l{};
  size_t* fields[kEpRegions] = {&l.count_matrix, &l.count_flags,  &l.expert_arrivals, &l.combine_flags,
                                &l.recv_rows,    &l.recv_meta,    &l.recv_weights,    &l.combine_rows,
                                &l.combine_scalars, &l.combine_map, &l.send_counts, &l.send_offsets,
                                &l.send_row_to_slot, &l.result_flags, &l.result_counts, &l.scratch,
                                &l.tile_counter, &l.stage_rows};
  for (int i = 0; i < kEpRegions; ++i) *fields[i] = r[i].offset;
  l.total = ep_total_bytes(r);
  return l;
}

}  // namespace primemoe
