// The sm_90a (Hopper) attention: entry points of the object library that CMake compiles for
// sm_90a alone (jacobi_cuda_sm90, only when 90a is among JACOBI_EXT_CUDA_ARCHS; the build then
// defines JACOBI_WITH_SM90). Torch-free like the rest of csrc/cuda.
//
// Stage 0 (issue 21): the dispatch stub and the consumer of the host-built tile lists
// (jacobi/tile_list.h). The warp-specialised wgmma/TMA kernels (stages 1-2) plug in behind
// has_kernel() / block_attention_fwd() / block_attention_bwd(); until then has_kernel() is false
// and choose_kernel() (attention_cuda.cu) runs the sm_80 kernel. Every __global__ here must be
// listed in .ci/sass_gate.py (HOPPER_KERNELS if it must use HGMMA, OTHER_KERNELS otherwise).
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "cuda/attention/attention_cuda.h"
#include "jacobi/tile_list.h"

namespace jacobi::cuda::attn::sm90 {

// Whether an sm_90a kernel exists for (dtype, head dim). False everywhere in stage 0.
bool has_kernel(DType dtype, int64_t head_dim);

// The Hopper kernels (cudaErrorNotSupported until they exist; choose_kernel never picks them
// before has_kernel() says so).
cudaError_t block_attention_fwd(const FwdParams& params, DType dtype, cudaStream_t stream);
cudaError_t block_attention_bwd(const BwdParams& params, DType dtype, cudaStream_t stream);

// The tile-list consumer on the device: visible[p * S + c] = listed_visible(lists, p, c), what a
// kernel walking the lists computes (jacobi_ext::debug_expand_tile_lists on CUDA; tests compare
// it with the CPU walk). The device must be compute capability 9.x (sm_90a code only).
cudaError_t expand_tile_lists(const jacobi::attn::TileLists& lists, int32_t seq_len,
                              uint8_t* visible, cudaStream_t stream);

}  // namespace jacobi::cuda::attn::sm90
