// The device error record read from Python (primemoe.check_errors): _take_error and _describe_error.

#include <vector>

#include "common.h"

namespace primemoe {
namespace {

std::vector<int64_t> take_error_op(int64_t device) {
  ErrorRecord rec{};
  if (!is_device_index(device) || !take_error(static_cast<int>(device), &rec)) return {};
  return {rec.code, rec.value, rec.limit, rec.index0, rec.index1};
}

// The message of a record from _take_error, so Python raises the same text as raise_pending_error.
std::string describe_error_op(const std::vector<int64_t>& record) {
  PRIMEMOE_CHECK(record.size() == 5, "record: expected the 5 fields _take_error returns, got ", record.size());
  ErrorRecord rec{};
  rec.code = static_cast<int32_t>(record[0]);
  rec.value = static_cast<int32_t>(record[1]);
  rec.limit = static_cast<int32_t>(record[2]);
  rec.index0 = record[3];
  rec.index1 = record[4];
  return describe_error(rec);
}

}  // namespace

STABLE_TORCH_LIBRARY_IMPL(primemoe, CompositeImplicitAutograd, m) {
  m.impl("_take_error", TORCH_BOX(&take_error_op));
  m.impl("_describe_error", TORCH_BOX(&describe_error_op));
}

}  // namespace primemoe
