#include <nvshmem.h>
#include <nvshmemx.h>

#include "nvshmem_runtime.cuh"

namespace primemoe {

size_t nvshmem_unique_id_size() { return sizeof(nvshmemx_uniqueid_t); }

int nvshmem_make_unique_id(void* out) {
  nvshmemx_uniqueid_t id = NVSHMEMX_UNIQUEID_INITIALIZER;
  const int status = nvshmemx_get_uniqueid(&id);
  *static_cast<nvshmemx_uniqueid_t*>(out) = id;
  return status;
}

int nvshmem_bootstrap(const void* unique_id, int rank, int world) {
  nvshmemx_init_attr_t attr = NVSHMEMX_INIT_ATTR_INITIALIZER;
  int status = nvshmemx_set_attr_uniqueid_args(rank, world, static_cast<const nvshmemx_uniqueid_t*>(unique_id), &attr);
  if (status != 0) return status;
  // What nvshmemx_init_attr does, minus its exit(-1) on failure: a training job
  // should get a Python exception it can report, not a silent process exit.
  nvshmemx_init_init_attr_ver_only(attr);
  const nvshmemi_version_t version = {NVSHMEM_VENDOR_MAJOR_VERSION, NVSHMEM_VENDOR_MINOR_VERSION,
                                      NVSHMEM_VENDOR_PATCH_VERSION};
  int provided = 0;
  return nvshmemi_init_thread(NVSHMEM_THREAD_SERIALIZED, &provided, NVSHMEMX_INIT_WITH_UNIQUEID, &attr, version);
}

bool nvshmem_is_initialized() { return nvshmemx_init_status() >= NVSHMEM_STATUS_IS_INITIALIZED; }

void nvshmem_shutdown() { nvshmem_finalize(); }

void* nvshmem_alloc_symmetric(size_t bytes) { return nvshmem_malloc(bytes); }

void nvshmem_free_symmetric(void* ptr) { nvshmem_free(ptr); }

bool nvshmem_all_peers_mapped(void* symmetric) {
  const int world = nvshmem_n_pes();
  for (int pe = 0; pe < world; ++pe) {
    if (nvshmem_ptr(symmetric, pe) == nullptr) return false;
  }
  return true;
}

int nvshmem_peers_need_put() {
  void* probe = nvshmem_malloc(16);
  if (probe == nullptr) return -1;
  const bool mapped = nvshmem_all_peers_mapped(probe);
  nvshmem_free(probe);
  return mapped ? 0 : 1;
}

}  // namespace primemoe
