// Host glue every *_ops_cuda.cpp file shares: the stream a launch goes to (the current one, so
// that a CUDA graph being captured records it) and the check of a launch's status, named by op.
#pragma once

#include <c10/cuda/CUDAStream.h>
#include <c10/util/Exception.h>
#include <cuda_runtime_api.h>

namespace jacobi::ops {

inline cudaStream_t current_stream() { return c10::cuda::getCurrentCUDAStream().stream(); }

inline void check_launch(const char* op, cudaError_t err) {
  TORCH_CHECK(err == cudaSuccess, "jacobi_ext::", op, ": CUDA launch failed: ",
              cudaGetErrorString(err));
}

}  // namespace jacobi::ops
