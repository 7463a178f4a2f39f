// The one torch-facing layer: op schemas, argument checks, CPU implementations of the
// primitives, and thin CUDA wrappers over the raw-pointer launchers in kernels/.
// moe_forward / moe_backward get their implementations in the Python shim.
#include <Python.h>
#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <initializer_list>
#include <limits>
#include <string>
#include <tuple>
#include <type_traits>
#include <vector>

#include "kernels/device_wait.cuh"
#include "kernels/dispatch_layout.cuh"
#include "kernels/error_record.cuh"
#include "gemm/grouped_gemm.cuh"
#include "kernels/row_ops.cuh"
#include "runtime/ep_kernels.cuh"
#include "runtime/ep_workspace.cuh"
#include "runtime/nvshmem_runtime.cuh"

namespace primemoe {
namespace {

// Messages are assembled with std::to_string: streaming an integer into TORCH_CHECK's
// ostringstream from this library crashed the process on the H200 image (torch 2.11).
std::string piece(const std::string& s) { return s; }
std::string piece(const char* s) { return s; }
std::string piece(at::ScalarType t) { return c10::toString(t); }
template <typename T>
  requires std::is_integral_v<T>
std::string piece(T v) {
  return std::to_string(v);
}
std::string piece(at::IntArrayRef a) {
  std::string out = "[";
  for (size_t i = 0; i < a.size(); ++i) out += (i ? ", " : "") + std::to_string(a[i]);
  return out + "]";
}
template <typename... Args>
std::string message(const Args&... args) {
  return (std::string() + ... + piece(args));
}

#define PRIMEMOE_CHECK(cond, ...) TORCH_CHECK(cond, ::primemoe::message(__VA_ARGS__))

std::string describe_error(const ErrorRecord& rec) {
  if (rec.code == kBadExpertId) {
    return "primemoe: topk_idx[" + std::to_string(rec.index0) + ", " + std::to_string(rec.index1) +
           "] = " + std::to_string(rec.value) + " is not an expert id (expected -1 or a value in [0, " +
           std::to_string(rec.limit) + ")); that slot was skipped";
  }
  if (rec.code == kWaitTimeout) {
    static const char* what[] = {"its send counts", "its rows for local expert ", "its combine results",
                                 "the rows of local expert "};
    static_assert(sizeof(what) / sizeof(what[0]) == kWaitPhases, "one description per WaitPhase");
    const int64_t phase = rec.index1 >= 0 && rec.index1 < kWaitPhases ? rec.index1 : 0;
    const std::string awaited = rec.value >= 0 ? "rank " + std::to_string(rec.value) : "a source rank";
    const bool names_expert = phase == kWaitArrivals || phase == kWaitGemmRows;
    return "primemoe: rank " + std::to_string(rec.limit) + " timed out waiting for " + awaited + " (" +
           what[phase] + (names_expert ? std::to_string(rec.index0) : std::string()) +
           (phase == kWaitGemmRows ? ", before its expert GEMM" : "") + "); the results of that call are invalid";
  }
  return "primemoe: device error code " + std::to_string(rec.code);
}

// Raised by dispatch_layout, the first primitive of every forward and backward, so
// errors of earlier calls surface at the next primemoe call on that device without a
// host sync, and a call never raises its own (still in flight) error midway.
void raise_pending_error(int device) {
  ErrorRecord rec{};
  if (take_error(device, &rec)) PRIMEMOE_CHECK(false, describe_error(rec));
}

ErrorRecord* error_record_for(const at::Tensor& t) {
  ErrorRecord* rec = device_error_record(t.get_device());
  PRIMEMOE_CHECK(rec != nullptr, "primemoe: could not allocate the host-mapped error record");
  return rec;
}

void check_cuda(cudaError_t err, const char* what) {
  PRIMEMOE_CHECK(err == cudaSuccess, "primemoe: ", what, " failed: ", cudaGetErrorString(err));
}

// The kernels move rows in 16-byte vectors and TMA boxes: a view starting at an element offset that is not a
// multiple of 8 would fault (misaligned address) instead.
void check_aligned(const at::Tensor& t, const char* name) {
  const auto misaligned = reinterpret_cast<uintptr_t>(t.data_ptr()) % 16;
  PRIMEMOE_CHECK(!t.is_cuda() || misaligned == 0, name, ": expected 16-byte aligned data on CUDA, got a view ",
                 misaligned, " bytes past a boundary (pass a copy)");
}

void check_rows(const at::Tensor& t, const char* name) {
  PRIMEMOE_CHECK(t.dim() == 2, name, ": expected a 2-D tensor [rows, H], got ", t.sizes());
  PRIMEMOE_CHECK(t.scalar_type() == at::kBFloat16, name, ": expected bfloat16, got ", t.scalar_type());
  PRIMEMOE_CHECK(t.is_contiguous(), name, ": expected a contiguous tensor");
  check_aligned(t, name);
}

void check_index(const at::Tensor& t, const char* name, int64_t dims) {
  PRIMEMOE_CHECK(t.dim() == dims, name, ": expected a ", dims, "-D tensor, got ", t.sizes());
  PRIMEMOE_CHECK(t.scalar_type() == at::kInt, name, ": expected int32, got ", t.scalar_type());
  PRIMEMOE_CHECK(t.is_contiguous(), name, ": expected a contiguous tensor");
}

void check_same_device(const at::Tensor& a, const at::Tensor& b, const char* name) {
  PRIMEMOE_CHECK(a.device() == b.device(), name, ": expected it on the same device as the rows");
}

ScaleType scale_type_of(const std::optional<at::Tensor>& s, const char* name) {
  if (!s.has_value()) return ScaleType::kNone;
  PRIMEMOE_CHECK(s->is_contiguous(), name, ": expected a contiguous tensor");
  if (s->scalar_type() == at::kFloat) return ScaleType::kFloat32;
  PRIMEMOE_CHECK(s->scalar_type() == at::kBFloat16, name, ": expected float32 or bfloat16, got ", s->scalar_type());
  return ScaleType::kBFloat16;
}

void check_layout_args(const at::Tensor& topk_idx, int64_t num_experts, int64_t expert_begin, int64_t num_local,
                       int64_t row_align) {
  PRIMEMOE_CHECK(topk_idx.dim() == 2, "topk_idx: expected a 2-D tensor [T, K], got ", topk_idx.sizes());
  PRIMEMOE_CHECK(topk_idx.scalar_type() == at::kLong || topk_idx.scalar_type() == at::kInt,
              "topk_idx: expected int64 or int32, got ", topk_idx.scalar_type());
  PRIMEMOE_CHECK(topk_idx.size(1) >= 1, "topk_idx: expected at least one slot per token");
  PRIMEMOE_CHECK(num_local >= 1 && num_local <= kLayoutMaxLocalExperts, "num_local_experts: expected 1..",
              kLayoutMaxLocalExperts, ", got ", num_local);
  PRIMEMOE_CHECK(expert_begin >= 0 && expert_begin + num_local <= num_experts,
              "expert_begin: local experts must lie in [0, num_experts)");
  PRIMEMOE_CHECK(row_align >= 1, "row_align: expected >= 1, got ", row_align);
  PRIMEMOE_CHECK(layout_max_rows(topk_idx.numel(), num_local, row_align) < (int64_t(1) << 31),
              "topk_idx: too many slots for 32-bit row indices");
}

using LayoutResult = std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor>;

// slot_valid: [num_slots] bool, filled with slot_to_row >= 0 by the layout kernel itself, or null.
LayoutResult launch_layout(const at::Tensor& topk_idx, int64_t num_experts, int64_t expert_begin, int64_t num_local,
                           int64_t row_align, bool* slot_valid) {
  check_layout_args(topk_idx, num_experts, expert_begin, num_local, row_align);
  const c10::cuda::CUDAGuard guard(topk_idx.device());
  raise_pending_error(topk_idx.get_device());
  const auto opts = topk_idx.options().dtype(at::kInt);
  const int64_t num_slots = topk_idx.numel();
  auto counts = at::empty({num_local}, opts);
  auto offsets = at::empty({num_local + 1}, opts);
  auto slot_to_row = at::empty(topk_idx.sizes(), opts);
  auto row_to_slot = at::empty({layout_max_rows(num_slots, num_local, row_align)}, opts);
  auto workspace = at::empty({std::max<int64_t>(layout_workspace_ints(num_slots, num_local), 1)}, opts);
  DispatchLayoutArgs a{};
  a.topk_idx = topk_idx.data_ptr();
  a.idx_is_int64 = topk_idx.scalar_type() == at::kLong;
  a.num_slots = num_slots;
  a.top_k = static_cast<int32_t>(topk_idx.size(1));
  a.num_experts = static_cast<int32_t>(num_experts);
  a.expert_begin = static_cast<int32_t>(expert_begin);
  a.num_local = static_cast<int32_t>(num_local);
  a.row_align = static_cast<int32_t>(row_align);
  a.expert_counts = counts.data_ptr<int32_t>();
  a.expert_offsets = offsets.data_ptr<int32_t>();
  a.slot_to_row = slot_to_row.data_ptr<int32_t>();
  a.row_to_slot = row_to_slot.data_ptr<int32_t>();
  a.slot_valid = slot_valid;
  a.workspace = workspace.data_ptr<int32_t>();
  a.error = error_record_for(topk_idx);
  check_cuda(launch_dispatch_layout(a, c10::cuda::getCurrentCUDAStream()), "dispatch_layout");
  return {counts, offsets, slot_to_row, row_to_slot};
}

LayoutResult dispatch_layout_cuda(const at::Tensor& topk_idx, int64_t num_experts, int64_t expert_begin,
                                  int64_t num_local, int64_t row_align) {
  return launch_layout(topk_idx, num_experts, expert_begin, num_local, row_align, nullptr);
}

// Same layout on the host; out-of-range ids raise at once (the data is already here).
LayoutResult dispatch_layout_cpu(const at::Tensor& topk_idx, int64_t num_experts, int64_t expert_begin,
                                 int64_t num_local, int64_t row_align) {
  check_layout_args(topk_idx, num_experts, expert_begin, num_local, row_align);
  const auto ids = topk_idx.to(at::kLong).contiguous();
  const int64_t* id = ids.data_ptr<int64_t>();
  const int64_t num_slots = ids.numel(), K = ids.size(1);
  const auto opts = topk_idx.options().dtype(at::kInt);
  auto counts = at::zeros({num_local}, opts);
  auto offsets = at::empty({num_local + 1}, opts);
  auto slot_to_row = at::empty(topk_idx.sizes(), opts);
  auto row_to_slot = at::full({layout_max_rows(num_slots, num_local, row_align)}, -1, opts);
  int32_t* c = counts.data_ptr<int32_t>();
  for (int64_t s = 0; s < num_slots; ++s) {
    PRIMEMOE_CHECK(id[s] >= -1 && id[s] < num_experts, "topk_idx[", s / K, ", ", s % K, "] = ", id[s],
                " is not an expert id (expected -1 or a value in [0, ", num_experts, "))");
    const int64_t local = id[s] - expert_begin;
    if (id[s] >= 0 && local >= 0 && local < num_local) ++c[local];
  }
  int32_t* o = offsets.data_ptr<int32_t>();
  std::vector<int32_t> next(num_local);
  int32_t offset = 0;
  for (int64_t e = 0; e < num_local; ++e) {
    o[e] = next[e] = offset;
    offset += layout_padded(c[e], row_align);
  }
  o[num_local] = offset;
  int32_t* s2r = slot_to_row.data_ptr<int32_t>();
  int32_t* r2s = row_to_slot.data_ptr<int32_t>();
  for (int64_t s = 0; s < num_slots; ++s) {
    const int64_t local = id[s] - expert_begin;
    if (id[s] >= 0 && local >= 0 && local < num_local) {
      s2r[s] = next[local]++;
      r2s[s2r[s]] = static_cast<int32_t>(s);
    } else {
      s2r[s] = -1;
    }
  }
  return {counts, offsets, slot_to_row, row_to_slot};
}

void check_gather_args(const at::Tensor& src, const at::Tensor& row_to_slot, int64_t top_k,
                       const std::optional<at::Tensor>& scale, const std::optional<at::Tensor>& slot_to_row,
                       const std::optional<at::Tensor>& offsets) {
  check_rows(src, "src");
  check_index(row_to_slot, "row_to_slot", 1);
  PRIMEMOE_CHECK(top_k >= 1, "top_k: expected >= 1, got ", top_k);
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
at::Tensor gather_rows_cuda(const at::Tensor& src, const at::Tensor& row_to_slot, int64_t top_k,
                            const std::optional<at::Tensor>& scale, const std::optional<at::Tensor>& slot_to_row,
                            const std::optional<at::Tensor>& offsets) {
  check_gather_args(src, row_to_slot, top_k, scale, slot_to_row, offsets);
  const c10::cuda::CUDAGuard guard(src.device());
  auto dst = at::empty({row_to_slot.size(0), src.size(1)}, src.options());
  GatherRowsArgs a{};
  a.src = src.data_ptr();
  a.row_to_slot = row_to_slot.data_ptr<int32_t>();
  a.scale_type = scale_type_of(scale, "scale");
  a.scale = scale.has_value() ? scale->data_ptr() : nullptr;
  a.dst = dst.data_ptr();
  a.row_end = offsets.has_value() ? offsets->data_ptr<int32_t>() + (offsets->numel() - 1) : nullptr;
  a.num_rows = row_to_slot.size(0);
  a.num_tokens = src.size(0);
  a.hidden = static_cast<int32_t>(src.size(1));
  a.top_k = static_cast<int32_t>(top_k);
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  at::Tensor inverse = slot_to_row.has_value() ? *slot_to_row : at::empty({src.size(0), top_k}, row_to_slot.options());
  if (!slot_to_row.has_value()) {
    check_cuda(launch_invert_row_to_slot(row_to_slot.data_ptr<int32_t>(), a.num_rows, src.size(0) * top_k,
                                         inverse.data_ptr<int32_t>(), stream),
               "gather_rows");
  }
  a.slot_to_row = inverse.data_ptr<int32_t>();
  check_cuda(launch_gather_rows(a, stream), "gather_rows");
  return dst;
}

// slot_to_row is not needed here: the rows are taken in row order. Rows past expert_offsets[-1] are written
// either way (zeros are one of the undefined values).
at::Tensor gather_rows_cpu(const at::Tensor& src, const at::Tensor& row_to_slot, int64_t top_k,
                           const std::optional<at::Tensor>& scale, const std::optional<at::Tensor>& slot_to_row,
                           const std::optional<at::Tensor>& offsets) {
  check_gather_args(src, row_to_slot, top_k, scale, slot_to_row, offsets);
  const int64_t slots = src.size(0) * top_k;
  if (slots == 0) return at::zeros({row_to_slot.size(0), src.size(1)}, src.options());
  // A slot outside [0, T * K) gives a zero row, as on the GPU.
  const auto slot_ids = row_to_slot.to(at::kLong);  // T * K may pass int32
  const auto valid = slot_ids.ge(0).logical_and(slot_ids.lt(slots));
  const auto slot = slot_ids.clamp(0, slots - 1);
  auto rows = src.index_select(0, slot.div(top_k, "floor")).to(at::kFloat);
  if (scale.has_value()) rows = rows * scale->reshape({-1}).to(at::kFloat).index_select(0, slot).unsqueeze(1);
  return at::where(valid.unsqueeze(1), rows, at::zeros({}, rows.options())).to(src.scalar_type());
}

void check_combine_args(const at::Tensor& rows, const at::Tensor& slot_to_row, const std::optional<at::Tensor>& w) {
  check_rows(rows, "rows");
  check_index(slot_to_row, "slot_to_row", 2);
  if (w.has_value()) {
    PRIMEMOE_CHECK(w->sizes() == slot_to_row.sizes(), "weights: expected shape ", slot_to_row.sizes(), ", got ",
                w->sizes());
  }
}

at::Tensor combine_reduce_cuda(const at::Tensor& rows, const at::Tensor& slot_to_row,
                               const std::optional<at::Tensor>& weights) {
  check_combine_args(rows, slot_to_row, weights);
  const c10::cuda::CUDAGuard guard(rows.device());
  auto y = at::empty({slot_to_row.size(0), rows.size(1)}, rows.options());
  CombineReduceArgs a{};
  a.rows = rows.data_ptr();
  a.slot_to_row = slot_to_row.data_ptr<int32_t>();
  a.weight_type = scale_type_of(weights, "weights");
  a.weights = weights.has_value() ? weights->data_ptr() : nullptr;
  a.y = y.data_ptr();
  a.num_tokens = slot_to_row.size(0);
  a.hidden = static_cast<int32_t>(rows.size(1));
  a.top_k = static_cast<int32_t>(slot_to_row.size(1));
  check_cuda(launch_combine_reduce(a, c10::cuda::getCurrentCUDAStream()), "combine_reduce");
  return y;
}

// Rows of the slots, [T, K, H] in fp32, zero where a slot has no row.
at::Tensor slot_rows_cpu(const at::Tensor& rows, const at::Tensor& slot_to_row) {
  const auto valid = slot_to_row.ge(0).unsqueeze(-1);
  const auto idx = slot_to_row.clamp_min(0).reshape({-1}).to(at::kLong);
  auto g = rows.index_select(0, idx).to(at::kFloat).view({slot_to_row.size(0), slot_to_row.size(1), rows.size(1)});
  return at::where(valid, g, at::zeros({}, g.options()));
}

at::Tensor combine_reduce_cpu(const at::Tensor& rows, const at::Tensor& slot_to_row,
                              const std::optional<at::Tensor>& weights) {
  check_combine_args(rows, slot_to_row, weights);
  auto g = slot_rows_cpu(rows, slot_to_row);
  if (weights.has_value()) g = g * weights->to(at::kFloat).unsqueeze(-1);
  return g.sum(1).to(rows.scalar_type());
}

void check_slot_dot_args(const at::Tensor& a, const at::Tensor& b, const at::Tensor& slot_to_row) {
  check_rows(a, "a");
  check_rows(b, "b");
  check_index(slot_to_row, "slot_to_row", 2);
  PRIMEMOE_CHECK(a.sizes() == b.sizes(), "b: expected the shape of a, ", a.sizes(), ", got ", b.sizes());
}

at::Tensor slot_dot_cuda(const at::Tensor& a, const at::Tensor& b, const at::Tensor& slot_to_row) {
  check_slot_dot_args(a, b, slot_to_row);
  const c10::cuda::CUDAGuard guard(a.device());
  auto out = at::empty(slot_to_row.sizes(), a.options().dtype(at::kFloat));
  SlotDotArgs args{};
  args.a = a.data_ptr();
  args.b = b.data_ptr();
  args.slot_to_row = slot_to_row.data_ptr<int32_t>();
  args.out = out.data_ptr<float>();
  args.num_slots = slot_to_row.numel();
  args.width = static_cast<int32_t>(a.size(1));
  check_cuda(launch_slot_dot(args, c10::cuda::getCurrentCUDAStream()), "slot_dot");
  return out;
}

at::Tensor slot_dot_cpu(const at::Tensor& a, const at::Tensor& b, const at::Tensor& slot_to_row) {
  check_slot_dot_args(a, b, slot_to_row);
  return (slot_rows_cpu(a, slot_to_row) * slot_rows_cpu(b, slot_to_row)).sum(-1);
}

void check_gather_scalars_args(const at::Tensor& values, const at::Tensor& index) {
  PRIMEMOE_CHECK(values.dim() == 1, "values: expected a 1-D tensor, got ", values.sizes());
  PRIMEMOE_CHECK(values.scalar_type() == at::kFloat || values.scalar_type() == at::kBFloat16,
                 "values: expected float32 or bfloat16, got ", values.scalar_type());
  PRIMEMOE_CHECK(values.is_contiguous(), "values: expected a contiguous tensor");
  PRIMEMOE_CHECK(index.scalar_type() == at::kInt, "index: expected int32, got ", index.scalar_type());
  PRIMEMOE_CHECK(index.is_contiguous(), "index: expected a contiguous tensor");
  PRIMEMOE_CHECK(index.device() == values.device(), "index: expected it on the same device as values");
}

at::Tensor gather_scalars_cuda(const at::Tensor& values, const at::Tensor& index) {
  check_gather_scalars_args(values, index);
  const c10::cuda::CUDAGuard guard(values.device());
  auto out = at::empty(index.sizes(), values.options().dtype(at::kFloat));
  GatherScalarsArgs args{};
  args.values = values.data_ptr();
  args.value_type = values.scalar_type() == at::kFloat ? ScaleType::kFloat32 : ScaleType::kBFloat16;
  args.index = index.data_ptr<int32_t>();
  args.out = out.data_ptr<float>();
  args.num_values = values.size(0);
  args.count = index.numel();
  check_cuda(launch_gather_scalars(args, c10::cuda::getCurrentCUDAStream()), "gather_scalars");
  return out;
}

at::Tensor gather_scalars_cpu(const at::Tensor& values, const at::Tensor& index) {
  check_gather_scalars_args(values, index);
  const int64_t n = values.size(0);
  auto out = at::zeros(index.sizes(), values.options().dtype(at::kFloat));
  if (n == 0) return out;
  const auto taken = values.index_select(0, index.clamp(0, n - 1).reshape({-1}).to(at::kLong)).to(at::kFloat);
  return at::where(index.ge(0).logical_and(index.lt(n)), taken.view(index.sizes()), out);
}

// copy_routed_rows: a new tensor whose rows [0, expert_offsets[-1]) are those of `rows`; rows past
// that bound are undefined (the GPU does not write them). The bound is read on the
// device, so the copy needs no host sync and moves only the routed rows of a worst-case-sized region.
void check_routed_rows_args(const at::Tensor& rows, const at::Tensor& offsets) {
  PRIMEMOE_CHECK(rows.dim() == 2, "rows: expected a 2-D tensor [rows, width], got ", rows.sizes());
  PRIMEMOE_CHECK(rows.is_contiguous(), "rows: expected a contiguous tensor");
  const int64_t row_bytes = rows.size(1) * rows.element_size();
  PRIMEMOE_CHECK(row_bytes % 16 == 0, "rows: expected rows of a multiple of 16 bytes, got ", row_bytes);
  check_index(offsets, "expert_offsets", 1);
  PRIMEMOE_CHECK(offsets.numel() >= 1, "expert_offsets: expected at least one entry");
  check_same_device(offsets, rows, "expert_offsets");
}

at::Tensor copy_routed_rows_cuda(const at::Tensor& rows, const at::Tensor& offsets) {
  check_routed_rows_args(rows, offsets);
  PRIMEMOE_CHECK(reinterpret_cast<uintptr_t>(rows.data_ptr()) % 16 == 0, "rows: expected 16-byte aligned data");
  const c10::cuda::CUDAGuard guard(rows.device());
  auto out = at::empty_like(rows);
  CopyRoutedRowsArgs a{};
  a.src = rows.data_ptr();
  a.dst = out.data_ptr();
  a.expert_offsets = offsets.data_ptr<int32_t>();
  a.num_experts = static_cast<int32_t>(offsets.numel() - 1);
  a.num_rows = rows.size(0);
  a.row_bytes = rows.size(1) * rows.element_size();
  check_cuda(launch_copy_routed_rows(a, c10::cuda::getCurrentCUDAStream()), "copy_routed_rows");
  return out;
}

// Copies every row: whatever a consumer reads past the bound stays what the source held there.
at::Tensor copy_routed_rows_cpu(const at::Tensor& rows, const at::Tensor& offsets) {
  check_routed_rows_args(rows, offsets);
  return rows.clone();
}

// zero_unrouted_rows: rows [expert_offsets[-1], rows) of `rows` set to zero in place, the bound read on the device
// (no host sync): a GEMM run with zero_unrouted=False leaves those rows undefined, and a caller that hands such a
// tensor on (the layer's fc1_out) zeroes them in one pass over the unrouted rows only.
void zero_unrouted_rows_cuda(at::Tensor& rows, const at::Tensor& offsets) {
  check_routed_rows_args(rows, offsets);
  PRIMEMOE_CHECK(reinterpret_cast<uintptr_t>(rows.data_ptr()) % 16 == 0, "rows: expected 16-byte aligned data");
  const c10::cuda::CUDAGuard guard(rows.device());
  ZeroUnroutedRowsArgs a{};
  a.rows = rows.data_ptr();
  a.expert_offsets = offsets.data_ptr<int32_t>();
  a.num_experts = static_cast<int32_t>(offsets.numel() - 1);
  a.num_rows = rows.size(0);
  a.row_bytes = rows.size(1) * rows.element_size();
  check_cuda(launch_zero_unrouted_rows(a, c10::cuda::getCurrentCUDAStream()), "zero_unrouted_rows");
}

void zero_unrouted_rows_cpu(at::Tensor& rows, const at::Tensor& offsets) {
  check_routed_rows_args(rows, offsets);
  const int64_t bound = std::clamp<int64_t>(offsets[-1].item<int32_t>(), 0, rows.size(0));
  rows.slice(0, bound).zero_();
}

// ---------------------------------------------------------------- NVSHMEM runtime

at::Tensor nvshmem_unique_id_op() {
  auto id = at::empty({static_cast<int64_t>(nvshmem_unique_id_size())}, at::TensorOptions().dtype(at::kByte));
  PRIMEMOE_CHECK(nvshmem_make_unique_id(id.data_ptr()) == 0, "nvshmem: could not create a unique id");
  return id;
}

void nvshmem_init_op(const at::Tensor& unique_id, int64_t rank, int64_t world) {
  PRIMEMOE_CHECK(unique_id.scalar_type() == at::kByte && unique_id.is_cpu() &&
                     unique_id.numel() == static_cast<int64_t>(nvshmem_unique_id_size()),
                 "unique_id: expected the uint8 CPU tensor made by nvshmem_unique_id");
  PRIMEMOE_CHECK(world >= 1 && rank >= 0 && rank < world, "rank: expected 0 <= rank < world, got rank ", rank,
                 " of ", world);
  PRIMEMOE_CHECK(!nvshmem_is_initialized(), "nvshmem: already initialised in this process");
  const auto contiguous = unique_id.contiguous();
  const int status = nvshmem_bootstrap(contiguous.data_ptr(), static_cast<int>(rank), static_cast<int>(world));
  PRIMEMOE_CHECK(status == 0, "nvshmem: initialisation failed with status ", status, " on rank ", rank, " of ", world,
                 " (NVSHMEM_DEBUG=INFO shows why; without InfiniBand set NVSHMEM_REMOTE_TRANSPORT=none)");
}

void nvshmem_finalize_op() {
  if (nvshmem_is_initialized()) nvshmem_shutdown();
}

// Collective (a small symmetric allocation): whether some peer is not reachable by load/store from here.
bool nvshmem_peers_need_put_op() {
  PRIMEMOE_CHECK(nvshmem_is_initialized(), "nvshmem: call nvshmem_init before probing the peers");
  const int status = nvshmem_peers_need_put();
  PRIMEMOE_CHECK(status >= 0, "nvshmem: could not allocate 16 bytes of symmetric memory to probe the peers");
  return status == 1;
}

EpConfig ep_config(int64_t rank, int64_t world, int64_t max_tokens, int64_t hidden, int64_t top_k,
                   int64_t local_experts, int64_t row_align, bool put_peers, bool force_put) {
  PRIMEMOE_CHECK(world >= 1 && rank >= 0 && rank < world, "rank: expected 0 <= rank < world");
  PRIMEMOE_CHECK(max_tokens >= 1 && hidden >= 8 && hidden % 8 == 0 && top_k >= 1 && local_experts >= 1 &&
                     row_align >= 1,
                 "ep: expected positive sizes and a hidden size that is a multiple of 8");
  PRIMEMOE_CHECK(world * local_experts <= kLayoutMaxLocalExperts, "ep: at most ", kLayoutMaxLocalExperts,
                 " experts in all, got ", world * local_experts);
  PRIMEMOE_CHECK(put_peers || !force_put, "ep: force_put needs the put staging region (put_peers=True)");
  EpConfig c{static_cast<int32_t>(rank),       static_cast<int32_t>(world),  static_cast<int32_t>(max_tokens),
             static_cast<int32_t>(hidden),     static_cast<int32_t>(top_k),  static_cast<int32_t>(local_experts),
             static_cast<int32_t>(row_align),  put_peers,                    force_put};
  PRIMEMOE_CHECK(c.max_recv_rows() < (int64_t(1) << 31), "ep: max_tokens * top_k * world exceeds 32-bit row indices");
  return c;
}

// Byte offsets of the regions in declaration order, then the total: the Python views
// take them from here so the layout is defined once.
std::vector<int64_t> ep_workspace_layout_op(int64_t world, int64_t max_tokens, int64_t hidden, int64_t top_k,
                                            int64_t local_experts, int64_t row_align, bool put_peers) {
  const EpLayout l =
      ep_layout(ep_config(0, world, max_tokens, hidden, top_k, local_experts, row_align, put_peers, false));
  const size_t fields[] = {l.count_matrix, l.count_flags, l.expert_arrivals,
                           l.combine_flags, l.recv_rows, l.recv_meta, l.recv_weights, l.combine_rows,
                           l.combine_scalars, l.scratch, l.stage_rows, l.total};
  return std::vector<int64_t>(std::begin(fields), std::end(fields));
}

at::Tensor ep_workspace_alloc_op(int64_t nbytes) {
  PRIMEMOE_CHECK(nvshmem_is_initialized(), "nvshmem: call nvshmem_init before allocating the workspace");
  PRIMEMOE_CHECK(nbytes > 0, "nbytes: expected > 0");
  void* ptr = nvshmem_alloc_symmetric(static_cast<size_t>(nbytes));
  PRIMEMOE_CHECK(ptr != nullptr, "nvshmem: could not allocate ", nbytes,
                 " bytes of symmetric memory (raise NVSHMEM_SYMMETRIC_SIZE)");
  int device = 0;
  check_cuda(cudaGetDevice(&device), "cudaGetDevice");
  check_cuda(cudaMemset(ptr, 0, static_cast<size_t>(nbytes)), "cudaMemset");
  check_cuda(cudaDeviceSynchronize(), "cudaDeviceSynchronize");
  // The Buffer frees it collectively through ep_workspace_free; the tensor never owns it.
  return at::from_blob(ptr, {nbytes}, [](void*) {}, at::TensorOptions().dtype(at::kByte).device(at::kCUDA, device));
}

void ep_workspace_free_op(const at::Tensor& workspace) {
  check_cuda(cudaDeviceSynchronize(), "cudaDeviceSynchronize");
  nvshmem_free_symmetric(workspace.data_ptr());
}

// Read at every launch, so a process (or a test) can change it between calls.
uint64_t wait_timeout_ns() {
  const char* s = std::getenv("PRIMEMOE_WAIT_TIMEOUT_S");
  const double seconds = s ? std::atof(s) : 60.0;
  return static_cast<uint64_t>((seconds > 0 ? seconds : 60.0) * 1e9);
}

EpScratch ep_scratch(uint8_t* ws, const EpLayout& l, const EpConfig& c) {
  int32_t* base = reinterpret_cast<int32_t*>(ws + l.scratch);
  const int64_t pairs = int64_t(c.world) * c.local_experts;
  return {base, base + pairs, base + 2 * pairs, base + 3 * pairs};
}

void check_workspace(const at::Tensor& ws, const at::Tensor& epoch, const EpConfig& c, const EpLayout& l) {
  PRIMEMOE_CHECK(ws.is_cuda() && ws.scalar_type() == at::kByte && ws.numel() >= static_cast<int64_t>(l.total),
                 "workspace: expected the Buffer's uint8 CUDA workspace of at least ", static_cast<int64_t>(l.total),
                 " bytes");
  PRIMEMOE_CHECK(nvshmem_is_initialized(), "nvshmem: not initialised (the workspace comes from a primemoe.Buffer)");
  // Without the staging region a peer that needs puts could not be written at all.
  PRIMEMOE_CHECK(c.put_peers || nvshmem_all_peers_mapped(ws.data_ptr()),
                 "workspace: not NVSHMEM symmetric memory, or some peer is not reachable by load/store and "
                 "put_peers is false");
  PRIMEMOE_CHECK(epoch.is_cuda() && epoch.scalar_type() == at::kLong && epoch.numel() == 1,
                 "epoch: expected a 1-element int64 CUDA tensor");
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> ep_dispatch_cuda(at::Tensor& workspace, at::Tensor& epoch,
                                                                 const at::Tensor& x, const at::Tensor& topk_idx,
                                                                 const at::Tensor& topk_weights, int64_t rank,
                                                                 int64_t world, int64_t max_tokens,
                                                                 int64_t local_experts, int64_t row_align,
                                                                 int64_t num_sms, bool wait_arrivals, bool put_peers,
                                                                 bool force_put) {
  check_rows(x, "x");
  const EpConfig c = ep_config(rank, world, max_tokens, x.size(1), topk_idx.size(1), local_experts, row_align,
                               put_peers, force_put);
  const EpLayout l = ep_layout(c);
  check_workspace(workspace, epoch, c, l);
  PRIMEMOE_CHECK(x.size(0) <= max_tokens, "x: ", x.size(0), " tokens exceed the buffer's max_tokens_per_rank ",
                 max_tokens);
  PRIMEMOE_CHECK(topk_weights.sizes() == topk_idx.sizes(), "topk_weights: expected the shape of topk_idx");
  PRIMEMOE_CHECK(num_sms >= 1, "num_sms: expected >= 1");
  const int64_t experts = world * local_experts;
  auto slot_valid = at::empty(topk_idx.sizes(), topk_idx.options().dtype(at::kBool));
  auto [send_counts, send_offsets, slot_to_row, row_to_slot] =
      launch_layout(topk_idx, experts, 0, experts, 1, slot_valid.data_ptr<bool>());
  const c10::cuda::CUDAGuard guard(x.device());
  auto opts = x.options().dtype(at::kInt);
  auto expert_counts = at::empty({local_experts}, opts);
  auto expert_offsets = at::empty({local_experts + 1}, opts);
  EpDispatchArgs a{};
  a.cfg = c;
  a.layout = l;
  a.workspace = workspace.data_ptr<uint8_t>();
  a.epoch = epoch.data_ptr<int64_t>();
  a.x = x.data_ptr();
  a.topk_idx = topk_idx.data_ptr();
  a.idx_is_int64 = topk_idx.scalar_type() == at::kLong;
  a.topk_weights = topk_weights.data_ptr();
  a.weight_type = scale_type_of(topk_weights, "topk_weights");
  a.num_tokens = x.size(0);
  a.send_counts = send_counts.data_ptr<int32_t>();
  a.send_offsets = send_offsets.data_ptr<int32_t>();
  a.send_row_to_slot = row_to_slot.data_ptr<int32_t>();
  a.scratch = ep_scratch(a.workspace, l, c);
  a.expert_counts = expert_counts.data_ptr<int32_t>();
  a.expert_offsets = expert_offsets.data_ptr<int32_t>();
  a.num_blocks = static_cast<int32_t>(num_sms);
  a.wait_arrivals = wait_arrivals;
  a.timeout_ns = wait_timeout_ns();
  a.error = error_record_for(x);
  check_cuda(launch_ep_dispatch(a, c10::cuda::getCurrentCUDAStream()), "ep_dispatch");
  return {expert_counts, expert_offsets, slot_valid};
}

void ep_combine_cuda(at::Tensor& workspace, at::Tensor& epoch, const at::Tensor& rows,
                     const std::optional<at::Tensor>& row_scalars, const at::Tensor& expert_offsets, int64_t rank,
                     int64_t world, int64_t max_tokens, int64_t hidden, int64_t top_k, int64_t local_experts,
                     int64_t row_align, int64_t num_sms, bool put_peers, bool force_put) {
  const EpConfig c = ep_config(rank, world, max_tokens, hidden, top_k, local_experts, row_align, put_peers,
                               force_put);
  const EpLayout l = ep_layout(c);
  check_workspace(workspace, epoch, c, l);
  check_rows(rows, "rows");
  PRIMEMOE_CHECK(rows.size(0) >= c.max_recv_rows() && rows.size(1) == hidden, "rows: expected [",
                 c.max_recv_rows(), ", ", hidden, "] in the receive layout, got ", rows.sizes());
  check_index(expert_offsets, "expert_offsets", 1);
  PRIMEMOE_CHECK(expert_offsets.numel() == local_experts + 1, "expert_offsets: expected ", local_experts + 1,
                 " entries");
  if (row_scalars.has_value()) {
    PRIMEMOE_CHECK(row_scalars->scalar_type() == at::kFloat && row_scalars->is_contiguous() &&
                       row_scalars->numel() >= c.max_recv_rows(),
                   "row_scalars: expected a contiguous float32 tensor with one value per receive row");
  }
  PRIMEMOE_CHECK(num_sms >= 1, "num_sms: expected >= 1");
  const c10::cuda::CUDAGuard guard(rows.device());
  EpCombineArgs a{};
  a.cfg = c;
  a.layout = l;
  a.workspace = workspace.data_ptr<uint8_t>();
  a.epoch = epoch.data_ptr<int64_t>();
  a.rows = rows.data_ptr();
  a.row_scalars = row_scalars.has_value() ? row_scalars->data_ptr<float>() : nullptr;
  a.expert_offsets = expert_offsets.data_ptr<int32_t>();
  a.scratch = ep_scratch(a.workspace, l, c);
  a.num_blocks = static_cast<int32_t>(num_sms);
  a.timeout_ns = wait_timeout_ns();
  a.error = error_record_for(rows);
  check_cuda(launch_ep_combine(a, c10::cuda::getCurrentCUDAStream()), "ep_combine");
}

// Device indices past int are no device (cast, one could name device 0).
bool is_device_index(int64_t device) { return device >= 0 && device <= std::numeric_limits<int>::max(); }

int64_t paired_gemm_launches_op(int64_t device) {
  return is_device_index(device) ? paired_gemm_launches(static_cast<int>(device)) : 0;
}

std::vector<int64_t> take_error_op(int64_t device) {
  ErrorRecord rec{};
  if (!is_device_index(device) || !take_error(static_cast<int>(device), &rec)) return {};
  return {rec.code, rec.value, rec.limit, rec.index0, rec.index1};
}

// The message of a record from take_error, so Python raises the same text as raise_pending_error.
std::string describe_error_op(const std::vector<int64_t>& record) {
  PRIMEMOE_CHECK(record.size() == 5, "record: expected the 5 fields take_error returns, got ", record.size());
  ErrorRecord rec{};
  rec.code = static_cast<int32_t>(record[0]);
  rec.value = static_cast<int32_t>(record[1]);
  rec.limit = static_cast<int32_t>(record[2]);
  rec.index0 = record[3];
  rec.index1 = record[4];
  return describe_error(rec);
}

// ---------------------------------------------------------------- expert GEMMs (grouped over the routing layout)

void check_offsets(const at::Tensor& offsets, const at::Tensor& like, int64_t num_experts) {
  check_index(offsets, "expert_offsets", 1);
  PRIMEMOE_CHECK(offsets.numel() == num_experts + 1, "expert_offsets: expected ", num_experts + 1,
                 " entries (one per expert + 1), got ", offsets.numel());
  PRIMEMOE_CHECK(offsets.device() == like.device(), "expert_offsets: expected it on the operands' device");
}

void check_weights3(const at::Tensor& w, const char* name) {
  PRIMEMOE_CHECK(w.dim() == 3, name, ": expected a 3-D tensor [E, out, in], got ", w.sizes());
  PRIMEMOE_CHECK(w.scalar_type() == at::kBFloat16, name, ": expected bfloat16, got ", w.scalar_type());
  PRIMEMOE_CHECK(w.is_contiguous(), name, ": expected a contiguous tensor");
  check_aligned(w, name);
}

GroupedGemmArgs gemm_args(GemmSchedule schedule, GemmEpilogue epilogue, const at::Tensor& a, const at::Tensor& b,
                          bool b_k_major, int64_t m, int64_t n, int64_t k, const at::Tensor& offsets,
                          const at::Tensor& out) {
  GroupedGemmArgs g{};
  g.schedule = schedule;
  g.epilogue = epilogue;
  g.a = a.data_ptr();
  g.b = b.data_ptr();
  g.b_k_major = b_k_major;
  g.num_rows = a.size(0);
  g.m = static_cast<int32_t>(m);
  g.n = static_cast<int32_t>(n);
  g.k = static_cast<int32_t>(k);
  g.num_experts = static_cast<int32_t>(offsets.numel() - 1);
  g.expert_offsets = offsets.data_ptr<int32_t>();
  g.out = out.data_ptr();
  g.num_sms = at::cuda::getDeviceProperties(a.get_device())->multiProcessorCount;
  return g;
}

// A GEMM override from the environment, read at every launch so that a process can alternate the settings: -1
// where unset or empty, else the index of its value in `values`; any other value is an error.
int gemm_override(const char* name, std::initializer_list<const char*> values) {
  const char* value = std::getenv(name);
  if (value == nullptr || *value == '\0') return -1;
  const std::string v(value);
  std::string expected;
  int index = 0;
  for (const char* choice : values) {
    if (v == choice) return index;
    expected += (index == 0 ? "" : index + 1 == int(values.size()) ? " or " : ", ") + std::string(choice);
    ++index;
  }
  PRIMEMOE_CHECK(false, name, ": expected ", expected, ", got '", v, "'");
  return -1;
}

void run_gemm(const GroupedGemmArgs& g, const at::Tensor& like, const char* what) {
  const char* why = "";
  PRIMEMOE_CHECK(grouped_gemm_supported(g, like.get_device(), &why), "primemoe: ", what, ": ", why);
  // Unset, the heuristics' choice of each. PRIMEMOE_GEMM_PAIRS=1 / 0: paired row blocks wherever a variant has them
  // (gemm_pairs_rows) / nowhere. PRIMEMOE_FC1_ACTIVATION: who computes FC1's activation (unset:
  // warps, with the helper warp; two_warps: without it; consumers).
  // PRIMEMOE_GEMM_MERGE_TAILS=1 / 0: 192-row tail tiles wherever a variant has them (gemm_merges_tails) / nowhere.
  // PRIMEMOE_FC1_MERGED_ACTIVATION: who computes FC1's activation around a 192-row tile (MergedActivation).
  const int order = gemm_override("PRIMEMOE_GEMM_TILE_ORDER", {"static", "claimed"});
  const int pairs = gemm_override("PRIMEMOE_GEMM_PAIRS", {"0", "1"});
  const int activation = gemm_override("PRIMEMOE_FC1_ACTIVATION", {"warps", "two_warps", "consumers"});
  const int merge = gemm_override("PRIMEMOE_GEMM_MERGE_TAILS", {"0", "1"});
  const int merged_activation = gemm_override("PRIMEMOE_FC1_MERGED_ACTIVATION", {"consumers", "tail", "warps"});
  const GemmConfig config = choose_gemm_config(
      g, order < 0 ? TileOrder::kAuto : order == 0 ? TileOrder::kStatic : TileOrder::kClaimed,
      pairs < 0 ? PairRows::kAuto : pairs == 0 ? PairRows::kOff : PairRows::kOn,
      activation == 1 ? Fc1Activation::kTwoWarps : activation == 2 ? Fc1Activation::kConsumers : Fc1Activation::kWarps,
      merge < 0 ? MergeTails::kAuto : merge == 0 ? MergeTails::kOff : MergeTails::kOn,
      merged_activation == 1   ? MergedActivation::kTail
      : merged_activation == 2 ? MergedActivation::kWarps
                               : MergedActivation::kConsumers);
  GroupedGemmArgs args = g;
  at::Tensor counter;  // the claimed tile order's counter, zeroed on the stream (graph-capturable)
  if (config.claim_tiles) {
    counter = at::zeros({1}, like.options().dtype(at::kInt));
    args.tile_counter = counter.data_ptr<int32_t>();
  }
  check_cuda(launch_grouped_gemm(args, config, c10::cuda::getCurrentCUDAStream()), what);
}

// rows [R, K] x w[e] for each expert's rows: w is [E, N, K] (w_kn = false) or [E, K, N].
void check_expert_gemm_args(const at::Tensor& rows, const at::Tensor& w, const at::Tensor& offsets, bool w_kn,
                            const char* rows_name = "rows") {
  check_rows(rows, rows_name);
  check_weights3(w, "w");
  check_same_device(w, rows, "w");
  check_offsets(offsets, rows, w.size(0));
  const int64_t k = w_kn ? w.size(1) : w.size(2);
  PRIMEMOE_CHECK(rows.size(1) == k, rows_name, ": expected ", k, " columns (w's reduction size), got ", rows.size(1));
}

void check_row_weight(const std::optional<at::Tensor>& row_weight, const at::Tensor& rows) {
  if (!row_weight.has_value()) return;
  PRIMEMOE_CHECK(row_weight->dim() == 1 && row_weight->numel() == rows.size(0) &&
                     row_weight->scalar_type() == at::kFloat && row_weight->is_contiguous(),
                 "row_weight: expected a contiguous float32 vector of ", rows.size(0), " entries");
  check_same_device(*row_weight, rows, "row_weight");
}

at::Tensor expert_gemm_cuda(const at::Tensor& rows, const at::Tensor& w, const at::Tensor& offsets, bool w_kn,
                            const std::optional<at::Tensor>& row_weight, bool zero_unrouted) {
  check_expert_gemm_args(rows, w, offsets, w_kn);
  check_row_weight(row_weight, rows);
  const c10::cuda::CUDAGuard guard(rows.device());
  const int64_t n = w_kn ? w.size(2) : w.size(1);
  auto out = at::empty({rows.size(0), n}, rows.options());
  if (rows.size(0) == 0) return out;
  auto g = gemm_args(GemmSchedule::kRows, GemmEpilogue::kStore, rows, w, !w_kn, 0, n, rows.size(1), offsets, out);
  g.row_weight = row_weight.has_value() ? row_weight->data_ptr<float>() : nullptr;
  g.skip_unrouted_rows = !zero_unrouted;
  run_gemm(g, rows, "expert_gemm");
  return out;
}

// fp32 products of each expert's rows with its weight; rows outside every expert stay 0.
at::Tensor expert_products_cpu(const at::Tensor& rows, const at::Tensor& w, const at::Tensor& offsets, bool w_kn) {
  const int64_t n = w_kn ? w.size(2) : w.size(1);
  auto out = at::zeros({rows.size(0), n}, rows.options().dtype(at::kFloat));
  auto off = offsets.accessor<int32_t, 1>();
  for (int64_t e = 0; e + 1 < offsets.numel(); ++e) {
    if (off[e + 1] == off[e]) continue;
    auto we = w_kn ? w[e].to(at::kFloat) : w[e].to(at::kFloat).t();
    out.slice(0, off[e], off[e + 1]) = at::matmul(rows.slice(0, off[e], off[e + 1]).to(at::kFloat), we);
  }
  return out;
}

// On the CPU the rows past the routed ones are zeros either way (zeros are one of the undefined values).
at::Tensor expert_gemm_cpu(const at::Tensor& rows, const at::Tensor& w, const at::Tensor& offsets, bool w_kn,
                           const std::optional<at::Tensor>& row_weight, bool) {
  check_expert_gemm_args(rows, w, offsets, w_kn);
  check_row_weight(row_weight, rows);
  auto out = expert_products_cpu(rows, w, offsets, w_kn);
  if (row_weight.has_value()) out *= row_weight->unsqueeze(1);
  return out.to(at::kBFloat16);
}

void check_fc1_args(const at::Tensor& rows, const at::Tensor& w1, const at::Tensor& offsets,
                    const char* rows_name = "rows") {
  check_expert_gemm_args(rows, w1, offsets, false, rows_name);
  PRIMEMOE_CHECK(w1.size(1) % 2 == 0, "w1: expected an even number of rows [gate; up], got ", w1.size(1));
}

// The optional wait hook: before loading expert e's rows, the GEMM's producer waits until
// rows_ready[e] >= epoch[0] * per_epoch (the EP workspace's arrival counters).
void check_rows_ready(const std::optional<at::Tensor>& rows_ready, const std::optional<at::Tensor>& epoch,
                      const at::Tensor& w1, int64_t per_epoch) {
  if (!rows_ready.has_value()) {
    PRIMEMOE_CHECK(!epoch.has_value(), "epoch: only meaningful together with rows_ready");
    return;
  }
  PRIMEMOE_CHECK(epoch.has_value(), "epoch: required with rows_ready");
  for (const auto& [t, name] : {std::pair{*rows_ready, "rows_ready"}, std::pair{*epoch, "epoch"}}) {
    PRIMEMOE_CHECK(t.scalar_type() == at::kLong && t.dim() == 1 && t.is_contiguous(), name,
                   ": expected a contiguous int64 vector");
    PRIMEMOE_CHECK(t.device() == w1.device(), name, ": expected it on the operands' device");
  }
  PRIMEMOE_CHECK(rows_ready->numel() == w1.size(0), "rows_ready: expected one counter per expert (",
                 w1.size(0), "), got ", rows_ready->numel());
  PRIMEMOE_CHECK(epoch->numel() == 1, "epoch: expected one element, got ", epoch->numel());
  PRIMEMOE_CHECK(per_epoch >= 1, "per_epoch: expected >= 1, got ", per_epoch);
}

std::tuple<at::Tensor, at::Tensor> fc1_swiglu_cuda(const at::Tensor& rows, const at::Tensor& w1,
                                                   const at::Tensor& offsets, bool keep_fc1,
                                                   const std::optional<at::Tensor>& rows_ready,
                                                   const std::optional<at::Tensor>& epoch, int64_t per_epoch,
                                                   int64_t rank, bool zero_unrouted) {
  check_fc1_args(rows, w1, offsets);
  check_rows_ready(rows_ready, epoch, w1, per_epoch);
  const c10::cuda::CUDAGuard guard(rows.device());
  const int64_t inter = w1.size(1) / 2;
  auto a = at::empty({rows.size(0), inter}, rows.options());
  auto h = at::empty({keep_fc1 ? rows.size(0) : 0, 2 * inter}, rows.options());
  if (rows.size(0) == 0) return {a, h};
  auto g = gemm_args(GemmSchedule::kRows, GemmEpilogue::kSwiGLU, rows, w1, true, 0, inter, rows.size(1), offsets, a);
  g.out_h = keep_fc1 ? h.data_ptr() : nullptr;
  g.skip_unrouted_rows = !zero_unrouted;
  if (rows_ready.has_value()) {
    g.hook.counters = reinterpret_cast<const uint64_t*>(rows_ready->data_ptr<int64_t>());
    g.hook.epoch = epoch->data_ptr<int64_t>();
    g.hook.per_epoch = static_cast<uint64_t>(per_epoch);
    g.hook.rank = static_cast<int32_t>(rank);
    g.hook.timeout_ns = wait_timeout_ns();
    g.error = error_record_for(rows);  // where a timed-out wait is reported
  }
  run_gemm(g, rows, "fc1_swiglu");
  return {a, h};
}

// On the CPU every row is in memory already: the wait hook's arguments are checked, nothing waits.
std::tuple<at::Tensor, at::Tensor> fc1_swiglu_cpu(const at::Tensor& rows, const at::Tensor& w1,
                                                  const at::Tensor& offsets, bool keep_fc1,
                                                  const std::optional<at::Tensor>& rows_ready,
                                                  const std::optional<at::Tensor>& epoch, int64_t per_epoch,
                                                  int64_t, bool) {
  check_fc1_args(rows, w1, offsets);
  check_rows_ready(rows_ready, epoch, w1, per_epoch);
  const int64_t inter = w1.size(1) / 2;
  auto h = expert_products_cpu(rows, w1, offsets, false).to(at::kBFloat16);
  auto hf = h.to(at::kFloat);
  auto a = (at::silu(hf.slice(1, 0, inter)) * hf.slice(1, inter)).to(at::kBFloat16);
  return {a, keep_fc1 ? h : h.slice(0, 0, 0).contiguous()};
}

// FC1 over the tokens themselves: row r of the expert-major layout is x[row_to_slot[r] / top_k]
// (zeros where row_to_slot[r] < 0), gathered by the GEMM's loads instead of a separate pass.
void check_fc1_gather_args(const at::Tensor& x, const at::Tensor& row_to_slot, int64_t top_k, const at::Tensor& w1,
                           const at::Tensor& offsets) {
  check_fc1_args(x, w1, offsets, "x");
  check_index(row_to_slot, "row_to_slot", 1);
  check_same_device(row_to_slot, x, "row_to_slot");
  PRIMEMOE_CHECK(top_k >= 1, "top_k: expected >= 1, got ", top_k);
  // The kernel holds where each row starts in x in 16-byte units, as int32.
  PRIMEMOE_CHECK(x.numel() / 8 < (int64_t(1) << 31), "x: expected fewer than 2^34 elements, got ", x.numel());
  // The kernel reads token row_to_slot[r] / top_k of x unchecked: the map must be the layout of x's slots.
  const int64_t rows = layout_max_rows(x.size(0) * top_k, static_cast<int32_t>(w1.size(0)), kGemmRowAlign);
  PRIMEMOE_CHECK(row_to_slot.numel() == rows, "row_to_slot: expected the ", rows, " rows of dispatch_layout over x's ",
                 x.size(0), " x ", top_k, " slots (", w1.size(0), " experts, row_align ", kGemmRowAlign, "), got ",
                 row_to_slot.numel());
}

std::tuple<at::Tensor, at::Tensor> fc1_swiglu_gather_cuda(const at::Tensor& x, const at::Tensor& row_to_slot,
                                                          int64_t top_k, const at::Tensor& w1,
                                                          const at::Tensor& offsets, bool keep_fc1) {
  check_fc1_gather_args(x, row_to_slot, top_k, w1, offsets);
  const c10::cuda::CUDAGuard guard(x.device());
  const int64_t rows = row_to_slot.numel();
  const int64_t inter = w1.size(1) / 2;
  auto a = at::empty({rows, inter}, x.options());
  auto h = at::empty({keep_fc1 ? rows : 0, 2 * inter}, x.options());
  if (rows == 0) return {a, h};
  if (x.size(0) == 0) return {a.zero_(), h.zero_()};
  auto g = gemm_args(GemmSchedule::kRows, GemmEpilogue::kSwiGLU, x, w1, true, 0, inter, x.size(1), offsets, a);
  g.num_rows = rows;
  g.a_row_src = row_to_slot.data_ptr<int32_t>();
  g.a_src_div = static_cast<int32_t>(top_k);
  g.out_h = keep_fc1 ? h.data_ptr() : nullptr;
  run_gemm(g, x, "fc1_swiglu_gather");
  return {a, h};
}

std::tuple<at::Tensor, at::Tensor> fc1_swiglu_gather_cpu(const at::Tensor& x, const at::Tensor& row_to_slot,
                                                         int64_t top_k, const at::Tensor& w1,
                                                         const at::Tensor& offsets, bool keep_fc1) {
  check_fc1_gather_args(x, row_to_slot, top_k, w1, offsets);
  return fc1_swiglu_cpu(gather_rows_cpu(x, row_to_slot, top_k, std::nullopt, std::nullopt, std::nullopt), w1, offsets,
                        keep_fc1, std::nullopt, std::nullopt, 1, 0, true);
}

void check_fc2_dgrad_args(const at::Tensor& dy_rows, const at::Tensor& w2, const at::Tensor& h,
                          const at::Tensor& row_weight, const at::Tensor& offsets) {
  check_expert_gemm_args(dy_rows, w2, offsets, true);
  check_rows(h, "h");
  check_same_device(h, dy_rows, "h");
  const int64_t inter = w2.size(2);
  PRIMEMOE_CHECK(h.size(0) == dy_rows.size(0) && h.size(1) == 2 * inter, "h: expected [", dy_rows.size(0), ", ",
                 2 * inter, "], got ", h.sizes());
  check_row_weight(row_weight, dy_rows);
  PRIMEMOE_CHECK(inter % kGemmTileN == 0, "w2: the intermediate size must be a multiple of ", kGemmTileN, ", got ",
                 inter);
}

// dh = d[gate | up] of silu(gate) * up times the row weight, aw = weight * a (FC2's wgrad operand),
// dot[:, p] = <da, a> over activation columns [256 p, 256 p + 256) (summed into d_topk_weights).
std::tuple<at::Tensor, at::Tensor, at::Tensor> fc2_dgrad_swiglu_cuda(const at::Tensor& dy_rows, const at::Tensor& w2,
                                                                      const at::Tensor& h, const at::Tensor& row_weight,
                                                                      const at::Tensor& offsets, bool zero_unrouted) {
  check_fc2_dgrad_args(dy_rows, w2, h, row_weight, offsets);
  const c10::cuda::CUDAGuard guard(dy_rows.device());
  const int64_t rows = dy_rows.size(0);
  const int64_t inter = w2.size(2);
  auto dh = at::empty({rows, 2 * inter}, dy_rows.options());
  auto aw = at::empty({rows, inter}, dy_rows.options());
  auto dot = at::empty({rows, inter / kGemmTileN}, dy_rows.options().dtype(at::kFloat));
  if (rows == 0) return {dh, aw, dot};
  auto g = gemm_args(GemmSchedule::kRows, GemmEpilogue::kSwiGLUBackward, dy_rows, w2, false, 0, inter,
                     dy_rows.size(1), offsets, aw);
  g.in_h = h.data_ptr();
  g.row_weight = row_weight.data_ptr<float>();
  g.out_dh = dh.data_ptr();
  g.out_dot = dot.data_ptr<float>();
  g.skip_unrouted_rows = !zero_unrouted;
  run_gemm(g, dy_rows, "fc2_dgrad_swiglu");
  return {dh, aw, dot};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> fc2_dgrad_swiglu_cpu(const at::Tensor& dy_rows, const at::Tensor& w2,
                                                                     const at::Tensor& h, const at::Tensor& row_weight,
                                                                     const at::Tensor& offsets, bool) {
  check_fc2_dgrad_args(dy_rows, w2, h, row_weight, offsets);
  const int64_t inter = w2.size(2);
  auto da = expert_products_cpu(dy_rows, w2, offsets, true);
  // Rows past the last expert give zeros whatever their inputs, as on the GPU.
  const int64_t routed = offsets[offsets.numel() - 1].item<int32_t>();
  auto inside = (at::arange(dy_rows.size(0)) < routed).unsqueeze(1);
  auto hf = at::where(inside, h.to(at::kFloat), 0.0);
  auto g = hf.slice(1, 0, inter);
  auto u = hf.slice(1, inter);
  auto s = at::sigmoid(g);
  auto a = (g * s * u).to(at::kBFloat16).to(at::kFloat);
  auto dot = (da * a).view({dy_rows.size(0), inter / kGemmTileN, kGemmTileN}).sum(-1);
  auto w = at::where(inside, row_weight.unsqueeze(1), 0.0);
  auto daw = da * w;
  auto dh = at::cat({daw * u * s * (1 + g * (1 - s)), daw * g * s}, 1).to(at::kBFloat16);
  return {dh, (a * w).to(at::kBFloat16), dot};
}

// out[e] = a_rows[rows of e]^T b_rows[rows of e]: the weight gradient, summed over each expert's rows.
// expert_rows: the layout's routed rows per expert, or none. The kernel then skips 64-row k-slices of
// padding, which must be zeros as the layout leaves them: wrong counts would give wrong results, so they
// are the layout's own.
void check_wgrad_args(const at::Tensor& a_rows, const at::Tensor& b_rows, const at::Tensor& offsets,
                      const std::optional<at::Tensor>& expert_rows) {
  check_rows(a_rows, "a_rows");
  check_rows(b_rows, "b_rows");
  check_same_device(b_rows, a_rows, "b_rows");
  PRIMEMOE_CHECK(a_rows.size(0) == b_rows.size(0), "b_rows: expected ", a_rows.size(0), " rows, got ",
                 b_rows.size(0));
  check_index(offsets, "expert_offsets", 1);
  PRIMEMOE_CHECK(offsets.numel() >= 2, "expert_offsets: expected at least one expert");
  check_same_device(offsets, a_rows, "expert_offsets");
  if (!expert_rows.has_value()) return;
  check_index(*expert_rows, "expert_rows", 1);
  PRIMEMOE_CHECK(expert_rows->numel() == offsets.numel() - 1, "expert_rows: expected one count per expert (",
                 offsets.numel() - 1, "), got ", expert_rows->numel());
  check_same_device(*expert_rows, a_rows, "expert_rows");
}

at::Tensor expert_wgrad_cuda(const at::Tensor& a_rows, const at::Tensor& b_rows, const at::Tensor& offsets,
                             const std::optional<at::Tensor>& expert_rows) {
  check_wgrad_args(a_rows, b_rows, offsets, expert_rows);
  const c10::cuda::CUDAGuard guard(a_rows.device());
  auto out = at::empty({offsets.numel() - 1, a_rows.size(1), b_rows.size(1)}, a_rows.options());
  if (a_rows.size(0) == 0) return out.zero_();
  auto g = gemm_args(GemmSchedule::kExperts, GemmEpilogue::kStore, a_rows, b_rows, false, a_rows.size(1),
                     b_rows.size(1), 0, offsets, out);
  g.expert_rows = expert_rows.has_value() ? expert_rows->data_ptr<int32_t>() : nullptr;
  run_gemm(g, a_rows, "expert_wgrad");
  return out;
}

at::Tensor expert_wgrad_cpu(const at::Tensor& a_rows, const at::Tensor& b_rows, const at::Tensor& offsets,
                            const std::optional<at::Tensor>& expert_rows) {
  check_wgrad_args(a_rows, b_rows, offsets, expert_rows);
  auto out = at::zeros({offsets.numel() - 1, a_rows.size(1), b_rows.size(1)}, a_rows.options());
  auto off = offsets.accessor<int32_t, 1>();
  for (int64_t e = 0; e + 1 < offsets.numel(); ++e) {
    if (off[e + 1] == off[e]) continue;
    out[e] = at::matmul(a_rows.slice(0, off[e], off[e + 1]).to(at::kFloat).t(),
                        b_rows.slice(0, off[e], off[e + 1]).to(at::kFloat))
                 .to(at::kBFloat16);
  }
  return out;
}

// Empty when the expert GEMM kernels cover an MoE of this size on `device`, else why not.
std::string expert_gemm_unsupported_op(int64_t device, int64_t hidden, int64_t intermediate) {
  const char* why = "";
  return moe_gemms_supported(static_cast<int>(device), hidden, intermediate, &why) ? "" : why;
}

}  // namespace

TORCH_LIBRARY(primemoe, m) {
  m.def(
      "moe_forward(Tensor x, Tensor topk_idx, Tensor topk_weights, Tensor w1, Tensor w2, str precision=\"bf16\", "
      "bool keep_fc1=True) -> (Tensor y, Tensor fc1_out)");
  m.def(
      "moe_backward(Tensor dy, Tensor x, Tensor topk_idx, Tensor topk_weights, Tensor w1, Tensor w2, "
      "Tensor? fc1_out, str precision=\"bf16\") -> (Tensor dx, Tensor d_topk_weights, Tensor dw1, Tensor dw2)");
  m.def(
      "dispatch_layout(Tensor topk_idx, int num_experts, int expert_begin, int num_local_experts, int row_align) "
      "-> (Tensor expert_counts, Tensor expert_offsets, Tensor slot_to_row, Tensor row_to_slot)");
  m.def(
      "gather_rows(Tensor src, Tensor row_to_slot, int top_k, Tensor? scale, Tensor? slot_to_row=None, "
      "Tensor? expert_offsets=None) -> Tensor");
  m.def("combine_reduce(Tensor rows, Tensor slot_to_row, Tensor? weights) -> Tensor");
  m.def("slot_dot(Tensor a, Tensor b, Tensor slot_to_row) -> Tensor");
  // out[i] = values[index[i]] in fp32, 0 where index[i] is not an index of values.
  m.def("gather_scalars(Tensor values, Tensor index) -> Tensor");
  m.def("copy_routed_rows(Tensor rows, Tensor expert_offsets) -> Tensor");
  m.def("zero_unrouted_rows(Tensor(a!) rows, Tensor expert_offsets) -> ()");
  // zero_unrouted=False: output rows at or past expert_offsets[-1] are left unwritten (undefined), for
  // callers that read only the routed rows.
  m.def(
      "expert_gemm(Tensor rows, Tensor w, Tensor expert_offsets, bool w_kn, Tensor? row_weight=None, "
      "bool zero_unrouted=True) -> Tensor");
  m.def(
      "fc1_swiglu(Tensor rows, Tensor w1, Tensor expert_offsets, bool keep_fc1, Tensor? rows_ready=None, "
      "Tensor? epoch=None, int per_epoch=1, int rank=0, bool zero_unrouted=True) -> (Tensor a, Tensor h)");
  m.def(
      "fc1_swiglu_gather(Tensor x, Tensor row_to_slot, int top_k, Tensor w1, Tensor expert_offsets, bool keep_fc1) "
      "-> (Tensor a, Tensor h)");
  m.def(
      "fc2_dgrad_swiglu(Tensor dy_rows, Tensor w2, Tensor h, Tensor row_weight, Tensor expert_offsets, "
      "bool zero_unrouted=True) -> (Tensor dh, Tensor aw, Tensor dot)");
  // expert_rows: the layout's routed rows per expert, so that k-slices of padding are skipped (the same
  // result: the layout's padding rows are zeros).
  m.def("expert_wgrad(Tensor a_rows, Tensor b_rows, Tensor expert_offsets, Tensor? expert_rows=None) -> Tensor");
  m.def("expert_gemm_unsupported(int device, int hidden, int intermediate) -> str", &expert_gemm_unsupported_op);
  m.def("take_error(int device) -> int[]", &take_error_op);
  m.def("paired_gemm_launches(int device) -> int", &paired_gemm_launches_op);
  m.def("describe_error(int[] record) -> str", &describe_error_op);
  m.def("nvshmem_unique_id() -> Tensor", &nvshmem_unique_id_op);
  m.def("nvshmem_init(Tensor unique_id, int rank, int world) -> ()", &nvshmem_init_op);
  m.def("nvshmem_finalize() -> ()", &nvshmem_finalize_op);
  m.def("nvshmem_peers_need_put() -> bool", &nvshmem_peers_need_put_op);
  m.def(
      "ep_workspace_layout(int world, int max_tokens, int hidden, int top_k, int local_experts, int row_align, "
      "bool put_peers) -> int[]",
      &ep_workspace_layout_op);
  m.def("ep_workspace_alloc(int nbytes) -> Tensor", &ep_workspace_alloc_op);
  m.def("ep_workspace_free(Tensor workspace) -> ()", &ep_workspace_free_op);
  m.def(
      "ep_dispatch(Tensor(a!) workspace, Tensor(b!) epoch, Tensor x, Tensor topk_idx, Tensor topk_weights, int rank, "
      "int world, int max_tokens, int local_experts, int row_align, int num_sms, bool wait_arrivals=True, "
      "bool put_peers=False, bool force_put=False) -> (Tensor expert_counts, Tensor expert_offsets, "
      "Tensor slot_valid)");
  m.def(
      "ep_combine(Tensor(a!) workspace, Tensor(b!) epoch, Tensor rows, Tensor? row_scalars, Tensor expert_offsets, "
      "int rank, int world, int max_tokens, int hidden, int top_k, int local_experts, int row_align, int num_sms, "
      "bool put_peers=False, bool force_put=False) -> ()");
}

TORCH_LIBRARY_IMPL(primemoe, CUDA, m) {
  m.impl("dispatch_layout", &dispatch_layout_cuda);
  m.impl("gather_rows", &gather_rows_cuda);
  m.impl("combine_reduce", &combine_reduce_cuda);
  m.impl("slot_dot", &slot_dot_cuda);
  m.impl("gather_scalars", &gather_scalars_cuda);
  m.impl("copy_routed_rows", &copy_routed_rows_cuda);
  m.impl("zero_unrouted_rows", &zero_unrouted_rows_cuda);
  m.impl("expert_gemm", &expert_gemm_cuda);
  m.impl("fc1_swiglu", &fc1_swiglu_cuda);
  m.impl("fc1_swiglu_gather", &fc1_swiglu_gather_cuda);
  m.impl("fc2_dgrad_swiglu", &fc2_dgrad_swiglu_cuda);
  m.impl("expert_wgrad", &expert_wgrad_cuda);
  m.impl("ep_dispatch", &ep_dispatch_cuda);
  m.impl("ep_combine", &ep_combine_cuda);
}

TORCH_LIBRARY_IMPL(primemoe, CPU, m) {
  m.impl("dispatch_layout", &dispatch_layout_cpu);
  m.impl("gather_rows", &gather_rows_cpu);
  m.impl("combine_reduce", &combine_reduce_cpu);
  m.impl("slot_dot", &slot_dot_cpu);
  m.impl("gather_scalars", &gather_scalars_cpu);
  m.impl("copy_routed_rows", &copy_routed_rows_cpu);
  m.impl("zero_unrouted_rows", &zero_unrouted_rows_cpu);
  m.impl("expert_gemm", &expert_gemm_cpu);
  m.impl("fc1_swiglu", &fc1_swiglu_cpu);
  m.impl("fc1_swiglu_gather", &fc1_swiglu_gather_cpu);
  m.impl("fc2_dgrad_swiglu", &fc2_dgrad_swiglu_cpu);
  m.impl("expert_wgrad", &expert_wgrad_cpu);
}

}  // namespace primemoe

// Importing primemoe._C loads this library, whose static initialisers register the ops.
extern "C" PyObject* PyInit__C(void) {
  static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_C", nullptr, -1, nullptr};
  return PyModule_Create(&module);
}
