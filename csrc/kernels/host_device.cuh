// Marks helpers that host code (the torch binding, compiled without nvcc) and kernels share.
#pragma once

#ifdef __CUDACC__
#define PRIMEMOE_HOST_DEVICE __host__ __device__
#else
#define PRIMEMOE_HOST_DEVICE
#endif
