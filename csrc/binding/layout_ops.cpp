// dispatch_layout (the routing layout), and the layout's and the engine's sizes that Python reads
// (_constant, _layout_max_rows) instead of restating them.

#include <algorithm>
#include <limits>
#include <string>

#include "common.h"
#include "gemm/grouped_gemm.cuh"
#include "kernels/dispatch_layout.cuh"

namespace primemoe {
namespace {

void check_layout_args(const Tensor& topk_idx, int64_t num_experts, int64_t expert_begin, int64_t num_local,
                       int64_t row_align) {
  PRIMEMOE_CHECK(topk_idx.dim() == 2, "topk_idx: expected a 2-D tensor [T, K], got ", topk_idx.sizes());
  PRIMEMOE_CHECK(topk_idx.scalar_type() == ScalarType::Long || topk_idx.scalar_type() == ScalarType::Int,
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

LayoutResult dispatch_layout_cuda(const Tensor& topk_idx, int64_t num_experts, int64_t expert_begin, int64_t num_local,
                                  int64_t row_align) {
  return launch_layout(topk_idx, num_experts, expert_begin, num_local, row_align, nullptr);
}

// The check the CPU kernel (python/primemoe/_cpu.py) runs through _check_args.
const ArgCheckRegistration layout_check("dispatch_layout", 1, 4, [](const OpArgs& a) {
  check_layout_args(a.tensor(0), a.integer(0), a.integer(1), a.integer(2), a.integer(3));
});

// Rows of dispatch_layout's row_to_slot (python/primemoe/_constants.py).
int64_t layout_max_rows_op(int64_t num_slots, int64_t num_local, int64_t row_align) {
  constexpr int64_t kInt32Max = std::numeric_limits<int32_t>::max();
  PRIMEMOE_CHECK(num_slots >= 0 && num_local >= 0 && num_local <= kInt32Max && row_align >= 1 &&
                     row_align <= kInt32Max,
                 "_layout_max_rows: expected num_slots >= 0, local_experts in [0, 2^31), row_align in [1, 2^31), got ",
                 num_slots, ", ", num_local, ", ", row_align);
  return layout_max_rows(num_slots, static_cast<int32_t>(num_local), static_cast<int32_t>(row_align));
}

// The sizes Python needs, by name (python/primemoe/_constants.py reads them once).
struct NamedConstant {
  const char* name;
  int64_t value;
};
constexpr NamedConstant kConstants[] = {
    {"gemm_row_align", kGemmRowAlign},                             // expert row alignment of the GEMM engine
    {"gemm_tile_n", kGemmTileN},                                   // output columns of a GEMM tile
    {"gemm_swiglu_tile_n", gemm_tile_n(GemmEpilogue::kSwiGLU)},    // FC1's activation columns per tile
    {"layout_max_local_experts", kLayoutMaxLocalExperts},          // experts one layout spans
};

int64_t constant_op(const std::string& name) {
  std::string known;
  for (const auto& c : kConstants) {
    if (name == c.name) return c.value;
    known += (known.empty() ? "" : ", ") + std::string(c.name);
  }
  PRIMEMOE_CHECK(false, "name: expected one of ", known, ", got '", name, "'");
  return 0;
}

}  // namespace

LayoutResult launch_layout(const Tensor& topk_idx, int64_t num_experts, int64_t expert_begin, int64_t num_local,
                           int64_t row_align, bool* slot_valid, const LayoutInto* into) {
  check_layout_args(topk_idx, num_experts, expert_begin, num_local, row_align);
  const DeviceGuard guard(topk_idx.get_device_index());
  raise_pending_error(topk_idx.get_device_index());
  const int64_t num_slots = topk_idx.numel();
  constexpr auto kInt32 = ScalarType::Int;
  const bool own = into == nullptr;
  auto counts = empty_like_device(topk_idx, {own ? num_local : 0}, kInt32);
  auto offsets = empty_like_device(topk_idx, {own ? num_local + 1 : 0}, kInt32);
  auto slot_to_row = own ? empty_like_device(topk_idx, topk_idx.sizes(), kInt32)
                         : empty_like_device(topk_idx, {0}, kInt32);
  auto row_to_slot = empty_like_device(topk_idx, {own ? layout_max_rows(num_slots, num_local, row_align) : 0}, kInt32);
  auto workspace =
      empty_like_device(topk_idx, {std::max<int64_t>(layout_workspace_ints(num_slots, num_local), 1)}, kInt32);
  DispatchLayoutArgs a{};
  a.topk_idx = topk_idx.data_ptr();
  a.idx_is_int64 = topk_idx.scalar_type() == ScalarType::Long;
  a.num_slots = num_slots;
  a.top_k = static_cast<int32_t>(topk_idx.size(1));
  a.num_experts = static_cast<int32_t>(num_experts);
  a.expert_begin = static_cast<int32_t>(expert_begin);
  a.num_local = static_cast<int32_t>(num_local);
  a.row_align = static_cast<int32_t>(row_align);
  a.expert_counts = own ? data_of<int32_t>(counts) : into->counts;
  a.expert_offsets = own ? data_of<int32_t>(offsets) : into->offsets;
  a.slot_to_row = own ? data_of<int32_t>(slot_to_row) : into->slot_to_row;
  a.row_to_slot = own ? data_of<int32_t>(row_to_slot) : into->row_to_slot;
  a.slot_valid = slot_valid;
  a.workspace = data_of<int32_t>(workspace);
  a.error = error_record_for(topk_idx);
  check_cuda(launch_dispatch_layout(a, current_stream(topk_idx)), "dispatch_layout");
  return {counts, offsets, slot_to_row, row_to_slot};
}

STABLE_TORCH_LIBRARY_IMPL(primemoe, CUDA, m) { m.impl("dispatch_layout", TORCH_BOX(&dispatch_layout_cuda)); }

namespace {
void set_num_sms_op(int64_t n) { set_gemm_sm_budget(n); }
int64_t num_sms_budget_op() { return gemm_sm_budget(); }
}  // namespace

STABLE_TORCH_LIBRARY_IMPL(primemoe, CompositeImplicitAutograd, m) {
  m.impl("_layout_max_rows", TORCH_BOX(&layout_max_rows_op));
  m.impl("_constant", TORCH_BOX(&constant_op));
  m.impl("_set_num_sms", TORCH_BOX(&set_num_sms_op));
  m.impl("_num_sms_budget", TORCH_BOX(&num_sms_budget_op));
}

}  // namespace primemoe
