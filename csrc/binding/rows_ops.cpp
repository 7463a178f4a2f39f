// The row primitives around the expert GEMMs: gather_rows (tokens into expert-major rows), combine_reduce
// (a token's rows summed back), slot_dot, gather_scalars, copy_routed_rows and zero_unrouted_rows.

#include "common.h"

namespace primemoe {
namespace {

void check_gather_args(const Tensor& src, const Tensor& row_to_slot, int64_t top_k, const std::optional<Tensor>& scale,
                       const std::optional<Tensor>& slot_to_row, const std::optional<Tensor>& offsets) {
  check_rows(src, "src");
  check_index(row_to_slot, "row_to_slot", 1);
  PRIMEMOE_CHECK(top_k >= 1, "top_k: expected >= 1, got ", top_k);
  scale_type_of(scale, "scale");
  if (scale.has_value()) {
    PRIMEMOE_CHECK(scale->numel() == src.size(0) * top_k, "scale: expected ", src.size(0) * top_k,
                " elements (one per slot), got ", scale->numel());
  }
  if (slot_to_row.has_value()) {
    check_index(*slot_to_row, "slot_to_row", 2);
    PRIMEMOE_CHECK(slot_to_row->size(0) == src.size(0) && slot_to_row->size(1) == top_k,
                   "slot_to_row: expected shape [", src.size(0), ", ", top_k, "], got ", slot_to_row->sizes());
    check_same_device(*slot_to_row, row_to_slot, "slot_to_row");
  }
  if (offsets.has_value()) {
    check_index(*offsets, "expert_offsets", 1);
    PRIMEMOE_CHECK(offsets->numel() >= 1, "expert_offsets: expected at least one entry");
    check_same_device(*offsets, row_to_slot, "expert_offsets");
  }
}

// The kernel walks tokens, so it needs slot_to_row: the caller's (dispatch_layout made both maps),
// else the inverse of row_to_slot, computed on the device. With expert_offsets the rows at or past
// expert_offsets[-1] are left unwritten (undefined), for callers that read only the routed rows.
Tensor gather_rows_cuda(const Tensor& src, const Tensor& row_to_slot, int64_t top_k, const std::optional<Tensor>& scale,
                        const std::optional<Tensor>& slot_to_row, const std::optional<Tensor>& offsets) {
  check_gather_args(src, row_to_slot, top_k, scale, slot_to_row, offsets);
  const DeviceGuard guard(src.get_device_index());
  auto dst = empty_like_device(src, {row_to_slot.size(0), src.size(1)});
  GatherRowsArgs a{};
  a.src = src.data_ptr();
  a.row_to_slot = data_of<int32_t>(row_to_slot);
  a.scale_type = scale_type_of(scale, "scale");
  a.scale = scale.has_value() ? scale->data_ptr() : nullptr;
  a.dst = dst.data_ptr();
  a.row_end = offsets.has_value() ? data_of<int32_t>(*offsets) + (offsets->numel() - 1) : nullptr;
  a.num_rows = row_to_slot.size(0);
  a.num_tokens = src.size(0);
  a.hidden = static_cast<int32_t>(src.size(1));
  a.top_k = static_cast<int32_t>(top_k);
  const cudaStream_t stream = current_stream(src);
  Tensor inverse = slot_to_row.has_value() ? *slot_to_row : empty_like_device(row_to_slot, {src.size(0), top_k});
  if (!slot_to_row.has_value()) {
    check_cuda(launch_invert_row_to_slot(data_of<int32_t>(row_to_slot), a.num_rows, src.size(0) * top_k,
                                         data_of<int32_t>(inverse), stream),
               "gather_rows");
  }
  a.slot_to_row = data_of<int32_t>(inverse);
  check_cuda(launch_gather_rows(a, stream), "gather_rows");
  return dst;
}

void check_combine_args(const Tensor& rows, const Tensor& slot_to_row, const std::optional<Tensor>& w,
                        const std::optional<Tensor>& local_rows) {
  check_rows(rows, "rows");
  check_index(slot_to_row, "slot_to_row", 2);
  scale_type_of(w, "weights");
  if (w.has_value()) {
    PRIMEMOE_CHECK(same_shape(w->sizes(), slot_to_row.sizes()), "weights: expected shape ", slot_to_row.sizes(), ", got ",
                w->sizes());
  }
  if (local_rows.has_value()) {
    check_rows(*local_rows, "local_rows");
    check_same_device(*local_rows, rows, "local_rows");
    PRIMEMOE_CHECK(local_rows->size(1) == rows.size(1), "local_rows: expected ", rows.size(1), " columns, got ",
                   local_rows->size(1));
  }
}

Tensor combine_reduce_cuda(const Tensor& rows, const Tensor& slot_to_row, const std::optional<Tensor>& weights,
                           const std::optional<Tensor>& local_rows) {
  check_combine_args(rows, slot_to_row, weights, local_rows);
  const DeviceGuard guard(rows.get_device_index());
  auto y = empty_like_device(rows, {slot_to_row.size(0), rows.size(1)});
  CombineReduceArgs a{};
  a.rows = rows.data_ptr();
  a.local_rows = local_rows.has_value() ? local_rows->data_ptr() : nullptr;
  a.slot_to_row = data_of<int32_t>(slot_to_row);
  a.weight_type = scale_type_of(weights, "weights");
  a.weights = weights.has_value() ? weights->data_ptr() : nullptr;
  a.y = y.data_ptr();
  a.num_tokens = slot_to_row.size(0);
  a.hidden = static_cast<int32_t>(rows.size(1));
  a.top_k = static_cast<int32_t>(slot_to_row.size(1));
  check_cuda(launch_combine_reduce(a, current_stream(rows)), "combine_reduce");
  return y;
}

void check_slot_dot_args(const Tensor& a, const Tensor& b, const Tensor& slot_to_row) {
  check_rows(a, "a");
  check_rows(b, "b");
  check_index(slot_to_row, "slot_to_row", 2);
  PRIMEMOE_CHECK(same_shape(a.sizes(), b.sizes()), "b: expected the shape of a, ", a.sizes(), ", got ", b.sizes());
}

Tensor slot_dot_cuda(const Tensor& a, const Tensor& b, const Tensor& slot_to_row) {
  check_slot_dot_args(a, b, slot_to_row);
  const DeviceGuard guard(a.get_device_index());
  auto out = empty_like_device(a, slot_to_row.sizes(), ScalarType::Float);
  SlotDotArgs args{};
  args.a = a.data_ptr();
  args.b = b.data_ptr();
  args.slot_to_row = data_of<int32_t>(slot_to_row);
  args.out = data_of<float>(out);
  args.num_slots = slot_to_row.numel();
  args.width = static_cast<int32_t>(a.size(1));
  check_cuda(launch_slot_dot(args, current_stream(a)), "slot_dot");
  return out;
}

void check_gather_scalars_args(const Tensor& values, const Tensor& index) {
  PRIMEMOE_CHECK(values.dim() == 1, "values: expected a 1-D tensor, got ", values.sizes());
  PRIMEMOE_CHECK(values.scalar_type() == ScalarType::Float || values.scalar_type() == ScalarType::BFloat16,
                 "values: expected float32 or bfloat16, got ", values.scalar_type());
  PRIMEMOE_CHECK(values.is_contiguous(), "values: expected a contiguous tensor");
  PRIMEMOE_CHECK(index.scalar_type() == ScalarType::Int, "index: expected int32, got ", index.scalar_type());
  PRIMEMOE_CHECK(index.is_contiguous(), "index: expected a contiguous tensor");
  PRIMEMOE_CHECK(index.device() == values.device(), "index: expected it on the same device as values");
}

Tensor gather_scalars_cuda(const Tensor& values, const Tensor& index) {
  check_gather_scalars_args(values, index);
  const DeviceGuard guard(values.get_device_index());
  auto out = empty_like_device(values, index.sizes(), ScalarType::Float);
  GatherScalarsArgs args{};
  args.values = values.data_ptr();
  args.value_type = values.scalar_type() == ScalarType::Float ? ScaleType::kFloat32 : ScaleType::kBFloat16;
  args.index = data_of<int32_t>(index);
  args.out = data_of<float>(out);
  args.num_values = values.size(0);
  args.count = index.numel();
  check_cuda(launch_gather_scalars(args, current_stream(values)), "gather_scalars");
  return out;
}

// copy_routed_rows: a new tensor whose rows [0, expert_offsets[-1]) are those of `rows`; rows past
// that bound are undefined (the GPU does not write them). The bound is read on the
// device, so the copy needs no host sync and moves only the routed rows of a worst-case-sized region.
void check_routed_rows_args(const Tensor& rows, const Tensor& offsets) {
  PRIMEMOE_CHECK(rows.dim() == 2, "rows: expected a 2-D tensor [rows, width], got ", rows.sizes());
  PRIMEMOE_CHECK(rows.is_contiguous(), "rows: expected a contiguous tensor");
  const int64_t row_bytes = rows.size(1) * rows.element_size();
  PRIMEMOE_CHECK(row_bytes % 16 == 0, "rows: expected rows of a multiple of 16 bytes, got ", row_bytes);
  check_index(offsets, "expert_offsets", 1);
  PRIMEMOE_CHECK(offsets.numel() >= 1, "expert_offsets: expected at least one entry");
  check_same_device(offsets, rows, "expert_offsets");
}

Tensor copy_routed_rows_cuda(const Tensor& rows, const Tensor& offsets) {
  check_routed_rows_args(rows, offsets);
  PRIMEMOE_CHECK(reinterpret_cast<uintptr_t>(rows.data_ptr()) % 16 == 0, "rows: expected 16-byte aligned data");
  const DeviceGuard guard(rows.get_device_index());
  auto out = torch::stable::empty_like(rows);
  CopyRoutedRowsArgs a{};
  a.src = rows.data_ptr();
  a.dst = out.data_ptr();
  a.expert_offsets = data_of<int32_t>(offsets);
  a.num_experts = static_cast<int32_t>(offsets.numel() - 1);
  a.num_rows = rows.size(0);
  a.row_bytes = rows.size(1) * rows.element_size();
  check_cuda(launch_copy_routed_rows(a, current_stream(rows)), "copy_routed_rows");
  return out;
}

// zero_unrouted_rows: rows [expert_offsets[-1], rows) of `rows` set to zero in place, the bound read on the device
// (no host sync): a GEMM run with zero_unrouted=False leaves those rows undefined, and a caller that hands such a
// tensor on (the layer's fc1_out) zeroes them in one pass over the unrouted rows only.
void zero_unrouted_rows_cuda(Tensor& rows, const Tensor& offsets) {
  check_routed_rows_args(rows, offsets);
  PRIMEMOE_CHECK(reinterpret_cast<uintptr_t>(rows.data_ptr()) % 16 == 0, "rows: expected 16-byte aligned data");
  const DeviceGuard guard(rows.get_device_index());
  ZeroUnroutedRowsArgs a{};
  a.rows = rows.data_ptr();
  a.expert_offsets = data_of<int32_t>(offsets);
  a.num_experts = static_cast<int32_t>(offsets.numel() - 1);
  a.num_rows = rows.size(0);
  a.row_bytes = rows.size(1) * rows.element_size();
  check_cuda(launch_zero_unrouted_rows(a, current_stream(rows)), "zero_unrouted_rows");
}

// The checks the CPU kernels (python/primemoe/_cpu.py) run through _check_args.
const ArgCheckRegistration gather_check("gather_rows", 5, 1, [](const OpArgs& a) {
  check_gather_args(a.tensor(0), a.tensor(1), a.integer(0), a.optional(2), a.optional(3), a.optional(4));
});
const ArgCheckRegistration combine_check("combine_reduce", 4, 0, [](const OpArgs& a) {
  check_combine_args(a.tensor(0), a.tensor(1), a.optional(2), a.optional(3));
});
const ArgCheckRegistration slot_dot_check("slot_dot", 3, 0, [](const OpArgs& a) {
  check_slot_dot_args(a.tensor(0), a.tensor(1), a.tensor(2));
});
const ArgCheckRegistration scalars_check("gather_scalars", 2, 0, [](const OpArgs& a) {
  check_gather_scalars_args(a.tensor(0), a.tensor(1));
});
const ArgCheckRegistration copy_check("copy_routed_rows", 2, 0, [](const OpArgs& a) {
  check_routed_rows_args(a.tensor(0), a.tensor(1));
});
const ArgCheckRegistration zero_check("zero_unrouted_rows", 2, 0, [](const OpArgs& a) {
  check_routed_rows_args(a.tensor(0), a.tensor(1));
});

}  // namespace

STABLE_TORCH_LIBRARY_IMPL(primemoe, CUDA, m) {
  m.impl("gather_rows", TORCH_BOX(&gather_rows_cuda));
  m.impl("combine_reduce", TORCH_BOX(&combine_reduce_cuda));
  m.impl("slot_dot", TORCH_BOX(&slot_dot_cuda));
  m.impl("gather_scalars", TORCH_BOX(&gather_scalars_cuda));
  m.impl("copy_routed_rows", TORCH_BOX(&copy_routed_rows_cuda));
  m.impl("zero_unrouted_rows", TORCH_BOX(&zero_unrouted_rows_cuda));
}

}  // namespace primemoe
