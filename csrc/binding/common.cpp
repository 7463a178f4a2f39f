#include "common.h"

#include <torch/library.h>

#include <cstdlib>
#include <limits>
#include <map>

#include "kernels/device_wait.cuh"

namespace primemoe {

std::string piece(at::IntArrayRef a) {
  std::string out = "[";
  for (size_t i = 0; i < a.size(); ++i) out += (i ? ", " : "") + std::to_string(a[i]);
  return out + "]";
}

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

bool is_device_index(int64_t device) { return device >= 0 && device <= std::numeric_limits<int>::max(); }

uint64_t wait_timeout_ns() {
  const char* s = std::getenv("PRIMEMOE_WAIT_TIMEOUT_S");
  const double seconds = s ? std::atof(s) : 60.0;
  return static_cast<uint64_t>((seconds > 0 ? seconds : 60.0) * 1e9);
}

// A view starting at an element offset that is not a multiple of 8 would fault (misaligned address) instead.
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

// ---------------------------------------------------------------- _check_args

namespace {

struct RegisteredCheck {
  size_t tensors;
  size_t ints;
  ArgCheck check;
};

std::map<std::string, RegisteredCheck>& arg_checks() {
  static std::map<std::string, RegisteredCheck> checks;  // filled by static initialisers of every area
  return checks;
}

void check_args_op(const std::string& op, const c10::List<std::optional<at::Tensor>>& tensors,
                   at::IntArrayRef ints) {
  const auto found = arg_checks().find(op);
  PRIMEMOE_CHECK(found != arg_checks().end(), "_check_args: no argument check for op '", op, "'");
  const RegisteredCheck& c = found->second;
  PRIMEMOE_CHECK(tensors.size() == c.tensors && ints.size() == c.ints, "_check_args: ", op, " takes ", c.tensors,
                 " tensors and ", c.ints, " ints, got ", tensors.size(), " and ", ints.size());
  OpArgs args{{}, std::vector<int64_t>(ints.begin(), ints.end()), found->first.c_str()};
  for (size_t i = 0; i < tensors.size(); ++i) args.tensors.push_back(tensors.get(i));
  c.check(args);
}

}  // namespace

const at::Tensor& OpArgs::tensor(size_t i) const {
  PRIMEMOE_CHECK(tensors[i].has_value(), "_check_args: ", op, "'s tensor argument ", i, " is required");
  return *tensors[i];
}

ArgCheckRegistration::ArgCheckRegistration(const char* op, size_t tensors, size_t ints, ArgCheck check) {
  arg_checks()[op] = {tensors, ints, check};
}

TORCH_LIBRARY_IMPL(primemoe, CompositeImplicitAutograd, m) { m.impl("_check_args", &check_args_op); }

}  // namespace primemoe
