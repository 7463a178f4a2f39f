// Expert-parallel dispatch and combine over NVSHMEM. Sync-free on the host; every
// device-side wait times out into the error record instead of hanging.
//
// Two transports, chosen per peer: a peer that nvshmem_ptr maps (same node, NVLink) is
// written by plain stores; any other (another node), or every other rank under
// cfg.force_put, by NVSHMEM RMA: nvshmemx_putmem_nbi_warp for rows, nvshmem_*_p for
// scalars, nvshmem_quiet before a run is counted. NVSHMEM's remote transports read the
// local source of a put only from symmetric (registered) memory, so such rows are first
// copied into the workspace's stage_rows. Signals go through nvshmemx_signal_op either way.
//
// dispatch = notify (bump epoch, publish send counts, wait for everyone's, compute
//            the receive layout, where this rank's rows go on each peer, and the send order)
//          + rows (push each routed row, its slot and weight, expert by expert in the order the expert
//            GEMMs walk them: every sender finishes local expert e everywhere before e + 1; count arrivals
//            per (destination, expert) and signal `expert_arrivals` when one is complete; zero this
//            rank's padding rows of each expert in the same sequence and signal them too, so a GEMM that
//            waits on `expert_arrivals` may run alongside this kernel)
//          + wait (with wait_arrivals: until every local expert has heard from every
//            source; the layer skips it and FC1's producer waits per expert instead)
// combine  = push every received row back to its source's `combine_rows[slot]` (a row of this rank's own
//            slot stays where it is: the dispatch noted its place in `combine_map`), signal each source when
//            its rows are done, wait for all sources. With result_flags, the rows kernel runs alongside the
//            GEMM that writes the rows and sends each 64-row block once that GEMM has published it.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "../kernels/error_record.cuh"
#include "../kernels/row_ops.cuh"
#include "ep_workspace.cuh"

namespace primemoe {

struct EpScratch {      // this rank's own part of the workspace (the scratch region's rows), never read remotely
  int32_t* send_base;   // [W][E_local] first row of this rank's rows in dest's receive region
  int32_t* send_done;   // [W][E_local] rows written so far (zeroed by the notify kernel)
  int32_t* recv_from;   // [W] rows this rank receives from each source (for combine)
  int32_t* combine_done;  // [W] rows pushed back so far (zeroed by the notify kernel: one combine per dispatch)
  // [(W + 1) E_local + 1] the rows kernel's work in the order it sends it, as the start of each entry in one
  // sequence of rows: expert-major (all of local expert 0's rows, to every destination, then expert 1's, ...), per
  // expert the destinations from this rank's next one on, then this rank's own padding rows of the expert.
  int32_t* send_order;
  int32_t* pad_rows;    // [E_local] this rank's padding rows of each local expert
  int32_t* pad_done;    // [E_local] of them zeroed so far (zeroed by the notify kernel)
  int32_t* tile_counter;  // the waiting GEMM's claimed-order counter (EpLayout::tile_counter), zeroed by notify
};

struct EpDispatchArgs {
  EpConfig cfg;
  EpLayout layout;
  uint8_t* workspace;  // this rank's symmetric allocation
  int64_t* epoch;
  const void* x;  // [T, H] bf16
  const void* topk_idx;
  bool idx_is_int64;
  const void* topk_weights;
  ScaleType weight_type;
  int64_t num_tokens;
  // Send-side layout from dispatch_layout(topk_idx, E, 0, E, 1), E = W * E_local.
  const int32_t* send_counts;   // [E]
  const int32_t* send_offsets;  // [E + 1]
  const int32_t* send_row_to_slot;
  EpScratch scratch;
  int32_t* expert_counts;   // [E_local] out: rows received per local expert
  int32_t* expert_offsets;  // [E_local + 1] out: padded receive offsets
  int32_t num_blocks;
  // false: the caller's GEMM waits per expert on expert_arrivals itself (its producer's hook), and may be
  // launched programmatically dependent on this dispatch (launch_chained), to run alongside its rows kernel.
  bool wait_arrivals;
  // false: everything but the rows themselves (their meta, weights, combine_map, the arrival counts): with one
  // rank the caller copies them token-major (gather_rows), reading each row of x once instead of K times.
  bool copy_rows;
  uint64_t timeout_ns;
  ErrorRecord* error;
};

struct EpCombineArgs {
  EpConfig cfg;
  EpLayout layout;
  uint8_t* workspace;
  int64_t* epoch;
  const void* rows;            // [max_recv_rows, H] bf16 in the receive layout
  const float* row_scalars;    // [max_recv_rows] or null
  const int32_t* expert_offsets;  // [E_local + 1] from this epoch's dispatch
  // Null: `rows` is complete. Else the GEMM that writes it runs alongside (this combine is launched programmatically
  // dependent on it) and publishes each 64-row block here (the workspace's result_flags, GroupedGemmArgs::done):
  // a block is sent once its flag reaches the epoch.
  const uint64_t* result_flags;
  EpScratch scratch;
  int32_t num_blocks;
  uint64_t timeout_ns;
  ErrorRecord* error;
};

cudaError_t launch_ep_dispatch(const EpDispatchArgs& args, cudaStream_t stream);
// Loads the dispatch and combine kernels on the current device now (a lazily loaded kernel's first launch waits for
// the kernels running then, some of which may spin on peers).
cudaError_t preload_ep_kernels();
// send: the rows kernel; wait: the kernel that waits until every source has pushed this rank's slots back. Apart
// (send, then other work, then wait), the work between them does not wait for the slowest peer.
cudaError_t launch_ep_combine(const EpCombineArgs& args, bool send, bool wait, cudaStream_t stream);

}  // namespace primemoe
