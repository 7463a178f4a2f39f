// Bounded device-side waits: a wait that never completes records who waited for
// what in the error record and gives up, so nothing hangs forever.
#pragma once

#include <cstdint>

#include "error_record.cuh"
#include "ptx.cuh"

namespace primemoe {

// Recorded in ErrorRecord::index1 of a kWaitTimeout.
enum WaitPhase : int64_t {
  kWaitCounts = 0,
  kWaitArrivals = 1,
  kWaitCombine = 2,
  kWaitGemmRows = 3,
  kWaitResults = 4,  // the combine, for a block of result rows from the GEMM beside it
  kWaitPhases = 5
};

#ifdef __CUDACC__
// Spins until *flag >= target. Returns false after recording a timeout.
__device__ __forceinline__ bool wait_at_least(const uint64_t* flag, uint64_t target, uint64_t timeout_ns,
                                              ErrorRecord* error, int32_t me, int32_t awaited_rank, int64_t what,
                                              int64_t phase) {
  const uint64_t start = now_ns();
  while (load_acquire(flag) < target) {
    if (now_ns() - start > timeout_ns) {
      record_error(error, kWaitTimeout, awaited_rank, me, what, phase);
      return false;
    }
  }
  return true;
}
#endif

}  // namespace primemoe
