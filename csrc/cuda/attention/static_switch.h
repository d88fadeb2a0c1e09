// Run-time -> compile-time dispatch (FlashAttention-2's *_SWITCH convention): each supported
// (dtype, head dim) pair is one instantiation file; everything else is rejected here.
#pragma once

#include <cutlass/numeric_types.h>

#include "cuda/attention/attention_cuda.h"

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

#define JACOBI_HEADDIM_SWITCH(HEADDIM, ...)      \
  [&] {                                          \
    if ((HEADDIM) == 64) {                       \
      constexpr static int kHeadDim = 64;        \
      return __VA_ARGS__();                      \
    } else if ((HEADDIM) == 128) {               \
      constexpr static int kHeadDim = 128;       \
      return __VA_ARGS__();                      \
    }                                            \
    return cudaErrorInvalidValue;                \
  }()
