// Host side of primemoe's NVSHMEM use: bootstrap by unique id (the id is made on one
// rank and shared by the caller, e.g. over torch.distributed), symmetric memory, and
// the queries the launchers need. Every function returns 0 or NVSHMEM's status.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

namespace primemoe {

// Size in bytes of the opaque unique id.
size_t nvshmem_unique_id_size();
int nvshmem_make_unique_id(void* out);
// Binds NVSHMEM to the current CUDA device. Unlike nvshmemx_init_attr, a failure is
// returned rather than ending the process.
int nvshmem_bootstrap(const void* unique_id, int rank, int world);
bool nvshmem_is_initialized();
void nvshmem_shutdown();
void* nvshmem_alloc_symmetric(size_t bytes);  // collective
void nvshmem_free_symmetric(void* ptr);       // collective
// True when every PE's copy of `symmetric` is reachable by load/store from this GPU.
bool nvshmem_all_peers_mapped(void* symmetric);
// Collective: 1 when some PE is not reachable by load/store from this GPU (another node: it takes
// NVSHMEM puts), 0 when every PE is, -1 when the probe's small symmetric allocation failed.
int nvshmem_peers_need_put();

}  // namespace primemoe
