// Programmatic dependent launch (sm_90): a kernel started by launch_chained may begin while the kernel
// before it on the stream is still running, so its launch and block scheduling overlap that kernel's
// tail instead of following it. It must call wait_for_previous_kernel() before anything else (that
// waits for the previous kernel to finish and its writes to be visible, which in turn had waited for
// its own predecessor). The previous kernel lets it begin early with allow_next_kernel(); one launched
// without launch_chained follows the whole previous kernel as usual.
#pragma once

#include <cuda_runtime.h>

#include <utility>

namespace primemoe {

#ifdef __CUDACC__
__device__ __forceinline__ void wait_for_previous_kernel() { asm volatile("griddepcontrol.wait;" ::: "memory"); }
__device__ __forceinline__ void allow_next_kernel() { asm volatile("griddepcontrol.launch_dependents;" ::: "memory"); }
#endif

template <typename... Params, typename... Args>
cudaError_t launch_chained(void (*kernel)(Params...), dim3 grid, dim3 block, size_t smem, cudaStream_t stream,
                           Args&&... args) {
  cudaLaunchAttribute attr{};
  attr.id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr.val.programmaticStreamSerializationAllowed = 1;
  cudaLaunchConfig_t config{};
  config.gridDim = grid;
  config.blockDim = block;
  config.dynamicSmemBytes = smem;
  config.stream = stream;
  config.attrs = &attr;
  config.numAttrs = 1;
  const cudaError_t err = cudaLaunchKernelEx(&config, kernel, std::forward<Args>(args)...);
  if (err != cudaSuccess) cudaGetLastError();  // returned here: not left for the next op's check
  return err;
}

}  // namespace primemoe
