// sm_90a-only translation unit (see attention_sm90.h): compiled for sm_90a alone, never for
// sm_80, so that Hopper instructions (wgmma, TMA, setmaxnreg) may appear here freely.
#include "cuda/attention/sm90/attention_sm90.h"

#include "cuda/attention/static_switch.h"

// The guard that keeps this TU sm_90a-only: a build that compiles it for another architecture
// (or for plain sm_90, which has no wgmma) stops here instead of producing a kernel that cannot
// run its own instructions.
#if defined(__CUDA_ARCH__) && (__CUDA_ARCH__ != 900 || !defined(__CUDA_ARCH_FEAT_SM90_ALL))
#error "attention_sm90.cu is sm_90a code: compile it with -gencode arch=compute_90a,code=sm_90a"
#endif

namespace jacobi::cuda::attn::sm90 {

// The launchers, one instantiation file each (fwd_sm90_<dtype>_hdim<D>.cu).
template <typename Element, int kHeadDim>
cudaError_t run_fwd_sm90(const FwdParams& p, cudaStream_t stream);

// Head dims of the sm_90a forward (has_kernel): 64 and 128; the gate set has 128 alone.
#ifdef JACOBI_CUDA_HDIM128_ONLY
#define JACOBI_SM90_HEADDIM_SWITCH(HEADDIM, ...) \
  [&] {                                          \
    if ((HEADDIM) == 128) {                      \
      constexpr static int kHeadDim = 128;       \
      return __VA_ARGS__();                      \
    }                                            \
    return cudaErrorNotSupported;                \
  }()
#else
#define JACOBI_SM90_HEADDIM_SWITCH(HEADDIM, ...) \
  [&] {                                          \
    if ((HEADDIM) == 64) {                       \
      constexpr static int kHeadDim = 64;        \
      return __VA_ARGS__();                      \
    } else if ((HEADDIM) == 128) {               \
      constexpr static int kHeadDim = 128;       \
      return __VA_ARGS__();                      \
    }                                            \
    return cudaErrorNotSupported;                \
  }()
#endif

namespace {

// One thread per (p, c) pair, grid-stride: a debug kernel, small sequences only.
__global__ void expand_tile_lists_kernel(const jacobi::attn::TileLists lists, int32_t seq_len,
                                         uint8_t* visible) {
  const int64_t n = int64_t(seq_len) * seq_len;
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += int64_t(gridDim.x) * blockDim.x) {
    const int32_t p = int32_t(i / seq_len), c = int32_t(i % seq_len);
    visible[i] = jacobi::attn::listed_visible(lists, p, c) ? 1 : 0;
  }
}

}  // namespace

bool has_kernel(DType dtype, int64_t head_dim) {
  return supported_dtype(dtype) && supported_head_dim(head_dim) &&
         (head_dim == 64 || head_dim == 128);
}

cudaError_t block_attention_fwd(const FwdParams& params, DType dtype, cudaStream_t stream) {
  if (!has_kernel(dtype, params.head_dim)) return cudaErrorNotSupported;
  const Sm90FwdInputs& in = params.sm90;
  if (in.q == nullptr || in.k == nullptr || in.v == nullptr || in.perm == nullptr ||
      in.lists.fwd_ptr == nullptr || in.lists.tile_m != kTileM || in.lists.tile_n != kTileN) {
    return cudaErrorInvalidValue;  // the op builds these; never launch without them
  }
  return JACOBI_DTYPE_SWITCH(dtype, [&] {
    return JACOBI_SM90_HEADDIM_SWITCH(params.head_dim,
                                      [&] { return run_fwd_sm90<Element, kHeadDim>(params, stream); });
  });
}

cudaError_t expand_tile_lists(const jacobi::attn::TileLists& lists, int32_t seq_len,
                              uint8_t* visible, cudaStream_t stream) {
  const int64_t n = int64_t(seq_len) * seq_len;
  if (n == 0) return cudaSuccess;
  const int blocks = int(n / 256 + 1 < 4096 ? n / 256 + 1 : 4096);
  expand_tile_lists_kernel<<<blocks, 256, 0, stream>>>(lists, seq_len, visible);
  return cudaGetLastError();
}

}  // namespace jacobi::cuda::attn::sm90
