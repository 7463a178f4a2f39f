// Device-side error reporting without a host sync: kernels record the first bad
// datum they see into a small host-mapped struct; the host reads it later.
#pragma once

#include <cstdint>

namespace primemoe {

enum ErrorCode : int32_t {
  kNoError = 0,
  kBadExpertId = 1,  // value = the id, limit = E, index0 = token, index1 = k
  kWaitTimeout = 2,  // value = awaited rank, limit = waiting rank, index0 = awaited expert/block
  kRecvOverflow = 3,  // value = the receiving rank, limit = its receive rows, index0 = the rows it would get,
                      // index1 = the rank that recorded it
};

struct ErrorRecord {
  int32_t claimed;  // first writer wins; the rest of the record belongs to it
  int32_t code;     // written last, so a non-zero code means the fields are complete
  int32_t value;
  int32_t limit;
  int64_t index0;
  int64_t index1;
};

#ifdef __CUDACC__
__device__ __forceinline__ void record_error(ErrorRecord* rec, int32_t code, int32_t value, int32_t limit,
                                             int64_t index0, int64_t index1) {
  if (rec == nullptr) return;
  if (atomicCAS(&rec->claimed, 0, 1) != 0) return;
  rec->value = value;
  rec->limit = limit;
  rec->index0 = index0;
  rec->index1 = index1;
  __threadfence_system();
  *reinterpret_cast<volatile int32_t*>(&rec->code) = code;
  __threadfence_system();
}
#endif

// Host side: one host-mapped record per device, allocated on first use.
ErrorRecord* device_error_record(int device);
// Copies the pending record of `device` into *out and clears it; false when none is pending.
bool take_error(int device, ErrorRecord* out);

}  // namespace primemoe
