// Routing layout on the GPU: per-expert counts, tile-padded offsets and the two
// maps between token slots (t*K + k) and expert-major rows. No host read of the
// counts, so the step stays capturable in a CUDA graph. Rows of one expert keep
// slot order (stable), which makes every later reduction deterministic.
//
// Two kernels: the first counts each block's slots per expert; the second, over the
// same blocks, sums those counts itself (every block reads the whole small count
// matrix: no scan kernel, no cross-block wait), places its slots and writes -1 on
// the padding rows (no memset). The second is chained to the first (chained_launch.cuh).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "host_device.cuh"

#include "error_record.cuh"

namespace primemoe {

struct DispatchLayoutArgs {
  const void* topk_idx;     // [num_slots] int32 or int64 global expert ids, -1 = skipped
  bool idx_is_int64;
  int64_t num_slots;        // T * K
  int32_t top_k;
  int32_t num_experts;      // E (global); ids outside [-1, E) are reported and skipped
  int32_t expert_begin;     // first local expert's global id
  int32_t num_local;        // local experts handled by this layout
  int32_t row_align;        // each expert's row range starts at a multiple of this
  int32_t* expert_counts;   // [num_local] routed rows per local expert
  int32_t* expert_offsets;  // [num_local + 1] padded row starts; last = padded total
  int32_t* slot_to_row;     // [num_slots] row of each slot, -1 when not routed here
  int32_t* row_to_slot;     // [max_rows(num_slots)] slot of each row, -1 for padding
  bool* slot_valid;         // [num_slots] or null: slot_to_row >= 0
  int32_t* workspace;       // [workspace_ints()] per-block counts
  ErrorRecord* error;
};

constexpr int kLayoutThreads = 256;
constexpr int kLayoutWarps = kLayoutThreads / 32;
constexpr int kLayoutMinSlotsPerBlock = 1024;
constexpr int kLayoutMaxLocalExperts = 1024;
// Bound on blocks * num_local, the count matrix every placing block reads.
constexpr int64_t kLayoutMaxCountInts = 16384;
static_assert(kLayoutMaxCountInts >= kLayoutMaxLocalExperts, "at least one block for any num_local");

// A multiple of kLayoutThreads, so each warp of a block takes an equal run of whole 32-slot groups.
inline int64_t layout_slots_per_block(int64_t num_slots, int32_t num_local) {
  const int64_t max_blocks = kLayoutMaxCountInts / num_local;
  const int64_t even = (num_slots + max_blocks - 1) / max_blocks;
  const int64_t rounded = (even + kLayoutThreads - 1) / kLayoutThreads * kLayoutThreads;
  return rounded > kLayoutMinSlotsPerBlock ? rounded : kLayoutMinSlotsPerBlock;
}

inline int64_t layout_blocks(int64_t num_slots, int32_t num_local) {
  const int64_t per_block = layout_slots_per_block(num_slots, num_local);
  return (num_slots + per_block - 1) / per_block;
}

// An expert's rows rounded up to the row alignment: its range in the layout.
PRIMEMOE_HOST_DEVICE inline int32_t layout_padded(int32_t rows, int32_t row_align) {
  return (rows + row_align - 1) / row_align * row_align;
}

// Worst case rows: every slot routed here plus a partial tile per expert.
inline int64_t layout_max_rows(int64_t num_slots, int32_t num_local, int32_t row_align) {
  return num_slots + int64_t(num_local) * (row_align - 1);
}

inline int64_t layout_workspace_ints(int64_t num_slots, int32_t num_local) {
  return layout_blocks(num_slots, num_local) * num_local;
}

cudaError_t launch_dispatch_layout(const DispatchLayoutArgs& args, cudaStream_t stream);

}  // namespace primemoe
