// Run-time -> compile-time dispatch (FlashAttention-2's *_SWITCH convention): each supported
// (dtype, head dim) pair is one instantiation file; everything else is rejected here.
#pragma once

#include <cutlass/numeric_types.h>

#include "cuda/attention/attention_cuda.h"

#ifndef JACOBI_CUDA_BF16_ONLY
#define JACOBI_DTYPE_SWITCH(DTYPE, ...)          \
  [&] {                                          \
    if ((DTYPE) == DType::bf16) {                \
      using Element = cutlass::bfloat16_t;       \
      return __VA_ARGS__();                      \
    } else {                                     \
      using Element = cutlass::half_t;           \
      return __VA_ARGS__();                      \
    }                                            \
  }()
#else  // the reduced CI kernel set (CMake JACOBI_EXT_CUDA_KERNELS=ci): no fp16 instantiations
#define JACOBI_DTYPE_SWITCH(DTYPE, ...)          \
  [&] {                                          \
    if ((DTYPE) == DType::bf16) {                \
      using Element = cutlass::bfloat16_t;       \
      return __VA_ARGS__();                      \
    }                                            \
    return cudaErrorNotSupported;                \
  }()
#endif

// Every head dim of supported_head_dim() (attention_cuda.h) has a case; anything else returns
// cudaErrorInvalidValue without launching (the torch op has rejected it before).
#ifdef JACOBI_CUDA_HDIM128_ONLY  // the `gate` kernel set: head dim 128 alone
#define JACOBI_HEADDIM_SWITCH(HEADDIM, ...)      \
  [&] {                                          \
    if ((HEADDIM) == 128) {                      \
      constexpr static int kHeadDim = 128;       \
      return __VA_ARGS__();                      \
    }                                            \
    return cudaErrorInvalidValue;                \
  }()
#else
#define JACOBI_HEADDIM_SWITCH(HEADDIM, ...)      \
  [&] {                                          \
    if ((HEADDIM) == 64) {                       \
      constexpr static int kHeadDim = 64;        \
      return __VA_ARGS__();                      \
    } else if ((HEADDIM) == 96) {                \
      constexpr static int kHeadDim = 96;        \
      return __VA_ARGS__();                      \
    } else if ((HEADDIM) == 128) {               \
      constexpr static int kHeadDim = 128;       \
      return __VA_ARGS__();                      \
    } else if ((HEADDIM) == 256) {               \
      constexpr static int kHeadDim = 256;       \
      return __VA_ARGS__();                      \
    }                                            \
    return cudaErrorInvalidValue;                \
  }()
#endif
