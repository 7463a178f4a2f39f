// Row movement between token order and the expert-major layout of dispatch_layout:
// the permute into the expert GEMMs, the weighted combine back (fixed k order,
// fp32 accumulation: bitwise deterministic), the routing-weight gradient, and a
// copy of expert-major rows bounded by the device-side routed row count, and the zeroing of the rows past it.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace primemoe {

enum class ScaleType : int32_t { kNone = 0, kFloat32 = 1, kBFloat16 = 2 };

// dst[r] = src[row_to_slot[r] / K] * scale[row_to_slot[r]]; rows with slot -1 (or >= T*K) become 0, except
// that with row_end, rows at or past *row_end (read on the device, clamped to [0, num_rows]) are left unwritten.
struct GatherRowsArgs {
  const void* src;  // [T, H] bf16
  const int32_t* row_to_slot;
  const int32_t* slot_to_row;  // [T*K] the inverse of row_to_slot (-1: no row), e.g. dispatch_layout's
  const void* scale;  // [T*K] per-slot factor or null
  ScaleType scale_type;
  void* dst;  // [num_rows, H] bf16
  const int32_t* row_end;  // null, or the layout's routed row count (expert_offsets[E]) for readers of only those
  int64_t num_rows;
  int64_t num_tokens;  // T: src's rows
  int32_t hidden;
  int32_t top_k;
};

// y[t] = sum_k weight[t,k] * row(slot_to_row[t*K+k]) over slots with a row: row(r) = rows[r] for r >= 0,
// local_rows[-2 - r] for r <= -2 (the expert-parallel combine's rows that never left this GPU), none for -1.
struct CombineReduceArgs {
  const void* rows;  // [R, H] bf16
  const void* local_rows;  // [R', H] bf16 or null (then every r < 0 is "none")
  const int32_t* slot_to_row;
  const void* weights;  // [T*K] or null for weight 1
  ScaleType weight_type;
  void* y;  // [T, H] bf16
  int64_t num_tokens;
  int32_t hidden;
  int32_t top_k;
};

// out[s] = <a[slot_to_row[s]], b[slot_to_row[s]]> in fp32, 0 for slots without a row.
struct SlotDotArgs {
  const void* a;  // [R, D] bf16
  const void* b;  // [R, D] bf16
  const int32_t* slot_to_row;
  float* out;  // [T*K]
  int64_t num_slots;
  int32_t width;
};

// out[i] = values[index[i]] in fp32, or 0 where index[i] is outside [0, num_values) (-1: no entry): the routing
// weight of each expert-major row, and each slot's routing-weight gradient from its row's. One kernel where the
// torch composition (clamp, cast, index, compare, where) took five.
struct GatherScalarsArgs {
  const void* values;    // [num_values]
  ScaleType value_type;  // kFloat32 or kBFloat16
  const int32_t* index;
  float* out;
  int64_t num_values;
  int64_t count;  // entries of index and out
};

// dst[r] = src[r] for the routed rows r < expert_offsets[num_experts] (the bound is read on the
// device, clamped to [0, num_rows]); rows past it are not written. Rows are opaque bytes.
struct CopyRoutedRowsArgs {
  const void* src;  // [num_rows, row_bytes], 16-byte aligned
  void* dst;        // same shape, 16-byte aligned
  const int32_t* expert_offsets;  // [num_experts + 1]
  int32_t num_experts;
  int64_t num_rows;
  int64_t row_bytes;  // a multiple of 16
};

// rows[r] = 0 for the rows r >= expert_offsets[num_experts] (the bound is read on the device, clamped to
// [0, num_rows]); the routed rows are not touched.
struct ZeroUnroutedRowsArgs {
  void* rows;  // [num_rows, row_bytes], 16-byte aligned
  const int32_t* expert_offsets;  // [num_experts + 1]
  int32_t num_experts;
  int64_t num_rows;
  int64_t row_bytes;  // a multiple of 16
};

// slot_to_row[s] = r for every row r with row_to_slot[r] = s in [0, num_slots), else -1.
cudaError_t launch_invert_row_to_slot(const int32_t* row_to_slot, int64_t num_rows, int64_t num_slots,
                                      int32_t* slot_to_row, cudaStream_t stream);
cudaError_t launch_gather_rows(const GatherRowsArgs& args, cudaStream_t stream);
cudaError_t launch_combine_reduce(const CombineReduceArgs& args, cudaStream_t stream);
cudaError_t launch_slot_dot(const SlotDotArgs& args, cudaStream_t stream);
cudaError_t launch_gather_scalars(const GatherScalarsArgs& args, cudaStream_t stream);
cudaError_t launch_copy_routed_rows(const CopyRoutedRowsArgs& args, cudaStream_t stream);
cudaError_t launch_zero_unrouted_rows(const ZeroUnroutedRowsArgs& args, cudaStream_t stream);

}  // namespace primemoe
