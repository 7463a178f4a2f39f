#include <cuda_runtime.h>

#include <cstring>
#include <mutex>
#include <vector>

#include "error_record.cuh"

namespace primemoe {
namespace {

std::mutex g_mutex;
std::vector<ErrorRecord*> g_records;  // host pointers, indexed by device

}  // namespace

ErrorRecord* device_error_record(int device) {
  std::lock_guard<std::mutex> lock(g_mutex);
  if (device < 0) return nullptr;
  if (static_cast<size_t>(device) >= g_records.size()) g_records.resize(device + 1, nullptr);
  if (g_records[device] == nullptr) {
    void* host = nullptr;
    // Mapped + portable: every context can write it; with UVA the device pointer equals the host pointer.
    if (cudaHostAlloc(&host, sizeof(ErrorRecord), cudaHostAllocMapped | cudaHostAllocPortable) != cudaSuccess) {
      cudaGetLastError();
      return nullptr;
    }
    std::memset(host, 0, sizeof(ErrorRecord));
    g_records[device] = static_cast<ErrorRecord*>(host);
  }
  void* dev = nullptr;
  if (cudaHostGetDevicePointer(&dev, g_records[device], 0) != cudaSuccess) {
    cudaGetLastError();
    return nullptr;
  }
  return static_cast<ErrorRecord*>(dev);
}

bool take_error(int device, ErrorRecord* out) {
  std::lock_guard<std::mutex> lock(g_mutex);
  if (device < 0 || static_cast<size_t>(device) >= g_records.size() || g_records[device] == nullptr) return false;
  volatile ErrorRecord* rec = g_records[device];
  if (rec->code == kNoError) return false;
  out->claimed = 1;
  out->code = rec->code;
  out->value = rec->value;
  out->limit = rec->limit;
  out->index0 = rec->index0;
  out->index1 = rec->index1;
  rec->code = kNoError;
  rec->claimed = 0;
  return true;
}

}  // namespace primemoe
