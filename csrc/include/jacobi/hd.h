// JACOBI_HD: the qualifier of the functions in these headers that both the CPU ops (g++) and
// the CUDA kernels (nvcc) call. Under nvcc they are __host__ __device__ so a kernel can call
// them, and forced inline because they sit on per-token/per-tile paths; under a host-only
// compiler they are plain inline functions (header-only, defined in every translation unit).
// Defined once here so that every header agrees on it.
#pragma once

#if defined(__CUDACC__)
#define JACOBI_HD __host__ __device__ __forceinline__
#else
#define JACOBI_HD inline
#endif
