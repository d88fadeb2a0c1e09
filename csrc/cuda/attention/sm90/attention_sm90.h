// The sm_90a (Hopper) attention: entry points of the object library that CMake compiles for
// sm_90a alone (jacobi_cuda_sm90, only when 90a is among JACOBI_EXT_CUDA_ARCHS; the build then
// defines JACOBI_WITH_SM90). Torch-free like the rest of csrc/cuda.
//
// Forward: the warp-specialised wgmma/TMA forward (fwd_sm90.h) for bf16/fp16 x head
// dims 64/128, driven by the host-built tile lists (jacobi/tile_list.h); other configurations
// fall back to the sm_80 kernel (choose_kernel, attention_cuda.cu).
// Backward: the warp-specialised wgmma/TMA backward (bwd_sm90.h) for the same configurations,
// driven by the backward tile lists; it runs when the op's kernel is sm90, deterministic or not
// (a deterministic backward orders each query tile's dQ sums by key tile); otherwise the sm_80
// backward runs (same lse).
// Every __global__ here must be listed in .ci/sass_gate.py (HOPPER_KERNELS if it must use
// HGMMA, OTHER_KERNELS otherwise).
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "cuda/attention/attention_cuda.h"
#include "jacobi/tile_list.h"

namespace jacobi::cuda::attn::sm90 {

// Tile sizes of the sm_90a forward: the host builds the lists at these (fwd_sm90.h).
constexpr int kTileM = 128;
constexpr int kTileN = 128;

// The sm_90a backward walks the same 128 x 128 lists in query halves of this many rows.
constexpr int kBwdBlockM = 64;

// Whether an sm_90a forward exists for (dtype, head dim) in this build.
bool has_kernel(DType dtype, int64_t head_dim);

// Whether an sm_90a backward exists for (dtype, head dim) in this build.
bool has_bwd_kernel(DType dtype, int64_t head_dim);

// The Hopper forward; params.sm90 must hold the stream-ordered q/k/v, perm and the tile lists
// at kTileM x kTileN (cudaErrorInvalidValue otherwise, cudaErrorNotSupported without a kernel).
// The backward of an sm90 forward: block_attention_bwd below, or the sm_80 one (attention_cuda.cu).
cudaError_t block_attention_fwd(const FwdParams& params, DType dtype, cudaStream_t stream);

// The Hopper backward: params.sm90 must hold the stream-ordered q/k/v/dout, perm, the tile lists
// at kTileM x kTileN with the backward lists, and the scratch buffers (attention_cuda.h
// Sm90BwdInputs; dq_semaphore for a deterministic dQ); cudaErrorInvalidValue otherwise, cudaErrorNotSupported
// without a kernel. Three launches: the preprocessing kernel (lse in log2 and delta =
// rowsum(dO * O), stream order), the backward, and the dQ conversion (scale, dtype, token order).
cudaError_t block_attention_bwd(const BwdParams& params, DType dtype, cudaStream_t stream);

// The tile-list consumer on the device: visible[p * S + c] = listed_visible(lists, p, c), what a
// kernel walking the lists computes (jacobi_ext::debug_expand_tile_lists on CUDA; tests compare
// it with the CPU walk). The device must be compute capability 9.x (sm_90a code only).
cudaError_t expand_tile_lists(const jacobi::attn::TileLists& lists, int32_t seq_len,
                              uint8_t* visible, cudaStream_t stream);

}  // namespace jacobi::cuda::attn::sm90
