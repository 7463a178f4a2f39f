// What compute-sanitizer racecheck makes of the ways two consumer warpgroups can pass a split half
// tile's partial sums (grouped_gemm_sm90.cuh), in a kernel shaped like the engine: a producer warpgroup
// that gives its registers back and leaves but for one spinning thread, consumers that grow theirs,
// lane 0 of a warpgroup waiting on its bulk stores before the warpgroup's own named barrier.
// On the GPU machine:
//   nvcc -std=c++17 -gencode=arch=compute_90a,code=sm_90a -lineinfo -o /tmp/racecheck_probe scripts/racecheck_probe.cu
//   for m in 0 1 2 4 6 7 8 15 16 40; do compute-sanitizer --tool racecheck /tmp/racecheck_probe $m; done
// mode bits: 1: warpgroup 0 passes its own barrier a varying number of times per round; 2 / 4: warpgroup
// 1 / 0 writes its boxes and stores them with a bulk copy each round (waited on by lane 0, as the
// epilogue); 8: the exchange goes through two mbarriers (as the engine since the thirteenth session)
// instead of pairs of bar.sync 3, 256; 16: no lane-0 wait before the exchange; 32 (with 8): warpgroup 1
// refills the boxes before (not after) waiting for them to be read, a real race with the barrier protocol
// intact: the control case (added after the thirteenth session's runs, not run yet).
// The kernel checks every value it exchanged. Thirteenth session, H200: no mode mismatched a value; every
// bar.sync mode reports 6-8 RAW hazards (mode 16 too, so not the lane-0 wait), the mbarrier modes none.
#include <cstdio>
#include <cstdlib>

__device__ volatile int consumers_done[8];

__device__ __forceinline__ void named_sync(int id, int threads) {
  asm volatile("bar.sync %0, %1;" ::"r"(id), "r"(threads) : "memory");
}

__device__ __forceinline__ void bulk_store(float* dst, const float* src) {
  const unsigned s = static_cast<unsigned>(__cvta_generic_to_shared(src));
  asm volatile("cp.async.bulk.global.shared::cta.bulk_group [%0], [%1], 4096;" ::"l"(dst), "r"(s) : "memory");
  asm volatile("cp.async.bulk.commit_group;" ::: "memory");
}

__device__ __forceinline__ void wait_store_reads() { asm volatile("cp.async.bulk.wait_group.read 0;" ::: "memory"); }

__device__ __forceinline__ void mbar_init(unsigned long long* bar, unsigned count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(static_cast<unsigned>(__cvta_generic_to_shared(bar))),
               "r"(count)
               : "memory");
}

__device__ __forceinline__ void mbar_arrive(unsigned long long* bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(static_cast<unsigned>(__cvta_generic_to_shared(bar)))
               : "memory");
}

__device__ __forceinline__ void mbar_wait(unsigned long long* bar, unsigned parity) {
  asm volatile(
      "{\n .reg .pred done;\n wait:\n"
      " mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
      " @!done bra wait;\n}" ::"r"(static_cast<unsigned>(__cvta_generic_to_shared(bar))),
      "r"(parity)
      : "memory");
}

__global__ void __launch_bounds__(384, 1) probe(float* out, float* stores, int* mismatches, int mode) {
  __shared__ __align__(128) float boxes[2][1024];
  __shared__ unsigned long long exchange_full, exchange_empty;
  if (threadIdx.x == 0) {
    mbar_init(&exchange_full, 128);
    mbar_init(&exchange_empty, 128);
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  __syncthreads();
  const int wg = threadIdx.x / 128;
  if (wg == 0) {
    asm volatile("setmaxnreg.dec.sync.aligned.u32 40;");
    if (threadIdx.x != 0) return;
    while (!consumers_done[blockIdx.x]) {
    }
    return;
  }
  asm volatile("setmaxnreg.inc.sync.aligned.u32 232;");
  const int w = wg - 1, t = threadIdx.x % 128;
  float acc = t;
  unsigned exchanges = 0;
  for (int it = 0; it < 6; ++it) {
    const bool exchange = it % 2 == 1;
    if ((mode & 1) && w == 0) {
      for (int j = 0; j <= it % 3; ++j) named_sync(1, 128);
    }
    if (((mode & 2) && w == 1 && !exchange) || ((mode & 4) && w == 0)) {
      if (t == 0) wait_store_reads();
      named_sync(w + 1, 128);
      boxes[w][t] = acc;
      boxes[w][t + 512] = acc;
      asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
      named_sync(w + 1, 128);
      if (t == 0) bulk_store(stores + (blockIdx.x * 2 + w) * 1024, &boxes[w][0]);
    }
    if (!exchange) continue;
    if (w == 1) {
      if (t == 0 && !(mode & 16)) wait_store_reads();
      named_sync(2, 128);
    }
    for (int round = 0; round < 4; ++round) {
      const float sent = 1000.0f * it + 10.0f * round + t;
      if (mode & 8) {
        const unsigned parity = exchanges & 1;
        if (w == 1) {
          if (!(mode & 32)) mbar_wait(&exchange_empty, parity ^ 1);
          boxes[1][t] = sent;
          boxes[1][t + 512] = sent + 1.0f;
          if (mode & 32) mbar_wait(&exchange_empty, parity ^ 1);
          mbar_arrive(&exchange_full);
        } else {
          mbar_wait(&exchange_full, parity);
          if (boxes[1][t] != sent || boxes[1][t + 512] != sent + 1.0f) atomicAdd(mismatches, 1);
          acc += boxes[1][t] + boxes[1][t + 512];
          mbar_arrive(&exchange_empty);
        }
        ++exchanges;
      } else {
        if (w == 1) {
          boxes[1][t] = sent;
          boxes[1][t + 512] = sent + 1.0f;
        }
        named_sync(3, 256);
        if (w == 0) {
          if (boxes[1][t] != sent || boxes[1][t + 512] != sent + 1.0f) atomicAdd(mismatches, 1);
          acc += boxes[1][t] + boxes[1][t + 512];
        }
        named_sync(3, 256);
      }
    }
    if ((mode & 8) && w == 1) mbar_wait(&exchange_empty, (exchanges & 1) ^ 1);
  }
  out[blockIdx.x * 256 + threadIdx.x - 128] = acc;
  if (t == 0) asm volatile("cp.async.bulk.wait_group 0;" ::: "memory");
  named_sync(3, 256);
  if (threadIdx.x == 256) consumers_done[blockIdx.x] = 1;
}

int main(int argc, char** argv) {
  if (argc != 2) {
    fprintf(stderr, "usage: %s <mode>\n", argv[0]);
    return 2;
  }
  const int mode = atoi(argv[1]);
  float *out, *stores;
  int* mismatches;
  cudaMalloc(&out, 4 * 256 * sizeof(float));
  cudaMalloc(&stores, 8 * 1024 * sizeof(float));
  cudaMalloc(&mismatches, sizeof(int));
  cudaMemset(mismatches, 0, sizeof(int));
  probe<<<4, 384>>>(out, stores, mismatches, mode);
  const cudaError_t err = cudaDeviceSynchronize();
  int bad = -1;
  cudaMemcpy(&bad, mismatches, sizeof(int), cudaMemcpyDeviceToHost);
  printf("mode %d: %s, %d mismatched exchanges\n", mode, cudaGetErrorString(err), bad);
  return err != cudaSuccess || bad != 0;
}
