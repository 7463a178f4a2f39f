// Does compute-sanitizer's racecheck order a two-warpgroup exchange through a named barrier
// (bar.sync 3, 256), as the engine's split half tiles pass partial sums (grouped_gemm_sm90.cuh)?
// On the GPU machine (RESULTS.md, twelfth session: 0 hazards in every mode):
//   nvcc -std=c++17 -gencode=arch=compute_90a,code=sm_90a -lineinfo \
//        -I <site-packages>/cutlass_library/source/include -o /tmp/racecheck_probe scripts/racecheck_probe.cu
//   compute-sanitizer --tool racecheck /tmp/racecheck_probe <threads> <mode>
// threads 384: warpgroup 0 stands aside; 256: the block is the two warpgroups. mode 0: warpgroup 0 exits
// at once; 1: it stays until the end; 2: __syncthreads instead of the named barrier; 3 (384 only): as the
// engine, below.
#include <cstdio>
#include <cstdlib>
#include <cutlass/arch/reg_reconfig.h>
__device__ volatile int done_flag[4];
// Mode 3: as the engine: the producer warpgroup gives registers back, keeps one thread alive until the
// consumers are done (spinning on a global flag), the consumers grow their registers and sync per
// warpgroup with bar.sync 1/2 besides the cross-warpgroup bar.sync 3.
__global__ void __launch_bounds__(384, 1) engine_like(float* out) {
  __shared__ float buf[2][4 * 128];
  const int wg = threadIdx.x / 128;
  if (wg == 0) {
    cutlass::arch::warpgroup_reg_dealloc<40>();
    if (threadIdx.x != 0) return;
    while (done_flag[blockIdx.x] == 0) {
    }
    return;
  }
  cutlass::arch::warpgroup_reg_alloc<232>();
  const int w = wg - 1, t = threadIdx.x % 128;
  float acc = t;
  for (int it = 0; it < 4; ++it) {
    buf[w][t] = acc;  // each warpgroup's own slots first, as the epilogue does
    asm volatile("bar.sync %0, 128;" ::"r"(w + 1) : "memory");
    acc += buf[w][(t + 1) % 128];
    asm volatile("bar.sync %0, 128;" ::"r"(w + 1) : "memory");
    for (int v0 = 0; v0 < 4; ++v0) {
      if (w == 1) buf[1][v0 * 128 + t] = acc + it;
      asm volatile("bar.sync 3, 256;" ::: "memory");
      if (w == 0) acc += buf[1][v0 * 128 + t];
      asm volatile("bar.sync 3, 256;" ::: "memory");
    }
  }
  out[threadIdx.x] = acc;
  asm volatile("bar.sync 3, 256;" ::: "memory");
  if (threadIdx.x == 128) done_flag[blockIdx.x] = 1;
}

__global__ void exchange(float* out, int mode) {
  __shared__ float buf[4 * 128];
  const int wg = threadIdx.x / 128;
  const int first = blockDim.x == 384 ? 1 : 0;  // 384 threads: warpgroup 0 is a producer that leaves
  if (wg < first) {
    if (mode == 0) return;
  } else {
    const int w = wg - first, t = threadIdx.x % 128;
    float acc = t;
    for (int it = 0; it < 4; ++it) {
      for (int v0 = 0; v0 < 4; ++v0) {
        if (w == 1) buf[v0 * 128 + t] = acc + it;
        if (mode == 2) __syncthreads(); else asm volatile("bar.sync 3, 256;" ::: "memory");
        if (w == 0) acc += buf[v0 * 128 + t];
        if (mode == 2) __syncthreads(); else asm volatile("bar.sync 3, 256;" ::: "memory");
      }
    }
    out[threadIdx.x] = acc;
  }
}
int main(int argc, char** argv) {
  const int threads = atoi(argv[1]), mode = atoi(argv[2]);
  float* out;
  cudaMalloc(&out, 384 * sizeof(float));
  if (mode == 3) engine_like<<<4, 384>>>(out);
  else exchange<<<4, threads>>>(out, mode);
  printf("threads %d mode %d: %s\n", threads, mode, cudaGetErrorString(cudaDeviceSynchronize()));
  return 0;
}
