#include "common.h"

#include <array>
#include <atomic>
#include <cstdlib>
#include <limits>
#include <map>
#include <stdexcept>

#include "kernels/device_wait.cuh"

namespace primemoe {

std::string piece(IntArrayRef a) {
  std::string out = "[";
  for (size_t i = 0; i < a.size(); ++i) out += (i ? ", " : "") + std::to_string(a[i]);
  return out + "]";
}

void fail(const std::string& msg) { throw std::runtime_error(msg); }

// ---------------------------------------------------------------- tensors and devices

#ifndef USE_CUDA
#error "setup.py defines USE_CUDA: the stable C shim declares aoti_torch_get_current_cuda_stream only then"
#endif

cudaStream_t current_stream(const Tensor& t) {
  void* stream = nullptr;
  const AOTITorchError err = aoti_torch_get_current_cuda_stream(t.get_device_index(), &stream);
  PRIMEMOE_CHECK(err == AOTI_TORCH_SUCCESS, "primemoe: could not get the current CUDA stream of device ",
                 t.get_device_index());
  return static_cast<cudaStream_t>(stream);
}

int sm_count(int device) {
  // Cached per device, as torch caches its device properties (the count does not change in a process).
  static std::array<std::atomic<int>, 256> cache{};
  const bool cached = device >= 0 && device < static_cast<int>(cache.size());
  if (cached) {
    if (const int n = cache[device].load(std::memory_order_relaxed); n > 0) return n;
  }
  int n = 0;
  check_cuda(cudaDeviceGetAttribute(&n, cudaDevAttrMultiProcessorCount, device), "cudaDeviceGetAttribute");
  if (cached) cache[device].store(n, std::memory_order_relaxed);
  return n;
}

namespace {
std::atomic<int64_t> sm_budget{0};
}  // namespace

void set_gemm_sm_budget(int64_t n) {
  PRIMEMOE_CHECK(n >= 0, "set_num_sms: expected a positive number of SMs (0: every SM), got ", n);
  sm_budget.store(n, std::memory_order_relaxed);
}

int64_t gemm_sm_budget() { return sm_budget.load(std::memory_order_relaxed); }

int gemm_sms(int device) {
  const int n = sm_count(device);
  const int64_t budget = gemm_sm_budget();
  return budget > 0 && budget < n ? static_cast<int>(budget) : n;
}

Tensor empty_like_device(const Tensor& t, IntArrayRef sizes, std::optional<ScalarType> dtype) {
  return torch::stable::new_empty(t, sizes, dtype);
}

Tensor zeros_like_device(const Tensor& t, IntArrayRef sizes, std::optional<ScalarType> dtype) {
  return torch::stable::new_zeros(t, sizes, dtype);
}

std::string describe_error(const ErrorRecord& rec) {
  if (rec.code == kBadExpertId) {
    return "primemoe: topk_idx[" + std::to_string(rec.index0) + ", " + std::to_string(rec.index1) +
           "] = " + std::to_string(rec.value) + " is not an expert id (expected -1 or a value in [0, " +
           std::to_string(rec.limit) + ")); that slot was skipped";
  }
  if (rec.code == kWaitTimeout) {
    static const char* what[] = {"its send counts", "its rows for local expert ", "its combine results",
                                 "the rows of local expert ", "the GEMM's results in receive row block "};
    static_assert(sizeof(what) / sizeof(what[0]) == kWaitPhases, "one description per WaitPhase");
    const int64_t phase = rec.index1 >= 0 && rec.index1 < kWaitPhases ? rec.index1 : 0;
    const std::string awaited = phase == kWaitResults ? "this rank's GEMM"
                                : rec.value >= 0     ? "rank " + std::to_string(rec.value)
                                                     : "a source rank";
    const bool names_expert = phase == kWaitArrivals || phase == kWaitGemmRows || phase == kWaitResults;
    return "primemoe: rank " + std::to_string(rec.limit) + " timed out waiting for " + awaited + " (" +
           what[phase] + (names_expert ? std::to_string(rec.index0) : std::string()) +
           (phase == kWaitGemmRows ? ", before its expert GEMM" : "") + "); the results of that call are invalid" +
           (phase == kWaitCounts ? ": that rank did not start the same dispatch (it raised an error, e.g. more tokens "
                                   "than max_tokens_per_rank, or it makes a different sequence of primemoe calls)"
                                 : "");
  }
  if (rec.code == kRecvOverflow) {
    return "primemoe: rank " + std::to_string(rec.value) + " would have received " + std::to_string(rec.index0) +
           " rows (with its experts' padding) in one dispatch, more than the " + std::to_string(rec.limit) +
           " its Buffer holds (max_recv_rows): it was sent none of them and the results of that call are invalid "
           "(seen by rank " + std::to_string(rec.index1) + "; create the Buffer with a larger max_recv_rows)";
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

ErrorRecord* error_record_for(const Tensor& t) {
  ErrorRecord* rec = device_error_record(t.get_device_index());
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

void check_main_grad(const Tensor& main_grad, int64_t experts, int64_t m, int64_t n, const Tensor& like) {
  PRIMEMOE_CHECK(main_grad.scalar_type() == ScalarType::Float, "main_grad: expected float32, got ",
                 main_grad.scalar_type());
  PRIMEMOE_CHECK(main_grad.dim() == 3 && main_grad.size(0) == experts && main_grad.size(1) == m &&
                     main_grad.size(2) == n,
                 "main_grad: expected [", experts, ", ", m, ", ", n, "] (experts, the weight's rows and columns), got ",
                 main_grad.sizes());
  PRIMEMOE_CHECK(main_grad.is_contiguous(), "main_grad: expected a contiguous tensor");
  check_same_device(main_grad, like, "main_grad");
  check_aligned(main_grad, "main_grad");
}

// A view starting at an element offset that is not a multiple of 8 would fault (misaligned address) instead.
void check_aligned(const Tensor& t, const char* name) {
  const auto misaligned = reinterpret_cast<uintptr_t>(t.data_ptr()) % 16;
  PRIMEMOE_CHECK(!t.is_cuda() || misaligned == 0, name, ": expected 16-byte aligned data on CUDA, got a view ",
                 misaligned, " bytes past a boundary (pass a copy)");
}

void check_rows(const Tensor& t, const char* name) {
  PRIMEMOE_CHECK(t.dim() == 2, name, ": expected a 2-D tensor [rows, H], got ", t.sizes());
  PRIMEMOE_CHECK(t.scalar_type() == ScalarType::BFloat16, name, ": expected bfloat16, got ", t.scalar_type());
  PRIMEMOE_CHECK(t.is_contiguous(), name, ": expected a contiguous tensor");
  check_aligned(t, name);
}

void check_index(const Tensor& t, const char* name, int64_t dims) {
  PRIMEMOE_CHECK(t.dim() == dims, name, ": expected a ", dims, "-D tensor, got ", t.sizes());
  PRIMEMOE_CHECK(t.scalar_type() == ScalarType::Int, name, ": expected int32, got ", t.scalar_type());
  PRIMEMOE_CHECK(t.is_contiguous(), name, ": expected a contiguous tensor");
}

void check_same_device(const Tensor& a, const Tensor& b, const char* name) {
  PRIMEMOE_CHECK(a.device() == b.device(), name, ": expected it on the same device as the rows");
}

ScaleType scale_type_of(const std::optional<Tensor>& s, const char* name) {
  if (!s.has_value()) return ScaleType::kNone;
  PRIMEMOE_CHECK(s->is_contiguous(), name, ": expected a contiguous tensor");
  if (s->scalar_type() == ScalarType::Float) return ScaleType::kFloat32;
  PRIMEMOE_CHECK(s->scalar_type() == ScalarType::BFloat16, name, ": expected float32 or bfloat16, got ",
                 s->scalar_type());
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

void check_args_op(const std::string& op, const std::vector<std::optional<Tensor>>& tensors,
                   const std::vector<int64_t>& ints) {
  const auto found = arg_checks().find(op);
  PRIMEMOE_CHECK(found != arg_checks().end(), "_check_args: no argument check for op '", op, "'");
  const RegisteredCheck& c = found->second;
  PRIMEMOE_CHECK(tensors.size() == c.tensors && ints.size() == c.ints, "_check_args: ", op, " takes ", c.tensors,
                 " tensors and ", c.ints, " ints, got ", tensors.size(), " and ", ints.size());
  const OpArgs args{tensors, ints, found->first.c_str()};
  c.check(args);
}

}  // namespace

const Tensor& OpArgs::tensor(size_t i) const {
  PRIMEMOE_CHECK(tensors[i].has_value(), "_check_args: ", op, "'s tensor argument ", i, " is required");
  return *tensors[i];
}

ArgCheckRegistration::ArgCheckRegistration(const char* op, size_t tensors, size_t ints, ArgCheck check) {
  arg_checks()[op] = {tensors, ints, check};
}

STABLE_TORCH_LIBRARY_IMPL(primemoe, CompositeImplicitAutograd, m) {
  m.impl("_check_args", TORCH_BOX(&check_args_op));
}

}  // namespace primemoe
