// sm_90a-only translation unit (see attention_sm90.h): compiled for sm_90a alone, never for
// sm_80, so that Hopper instructions (wgmma, TMA, setmaxnreg) may appear here freely.
#include "cuda/attention/sm90/attention_sm90.h"

#include "cuda/attention/bwd_rows.h"
#include "cuda/attention/static_switch.h"
#include "jacobi/online_softmax.h"

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
template <typename Element, int kHeadDim>
cudaError_t run_bwd_sm90(const BwdParams& p, cudaStream_t stream);

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

// The sm_90a backward's preprocessing, per (b, h, stream position p < Spad): lse * log2 e of the
// token at p (+inf where lse is -inf, the row saw nothing, and on padding rows: P = 0 there) and
// delta = rowsum(dO * O) (0 on padding), into lse_delta: per 64-row query tile (kBwdBlockM), its
// 64 lse values, then its 64 deltas (one bulk copy per tile). 16 lanes per row, like
// bwd_dsum_kernel.
template <typename Element>
__global__ void bwd_sm90_prep_kernel(const BwdParams p, int32_t seq_pad) {
  const int64_t rows = int64_t(p.batch) * p.heads_q * seq_pad;
  const int64_t r = (int64_t(blockIdx.x) * blockDim.x + threadIdx.x) / 16;
  const int lane = threadIdx.x % 16;
  int32_t tok = -1;
  int64_t bh = 0;
  if (r < rows) {
    const int32_t pos = int32_t(r % seq_pad);
    bh = r / seq_pad;
    tok = pos < p.seq_len ? p.sm90.perm[pos] : -1;
  }
  const float acc = row_dot16<Element>(p, tok >= 0, bh / p.heads_q, bh % p.heads_q, tok, lane);
  if (r < rows && lane == 0) {
    const float lse = tok >= 0 ? p.lse[bh * p.seq_len + tok] : -INFINITY;
    const int64_t out = (r / kBwdBlockM) * 2 * kBwdBlockM + r % kBwdBlockM;  // seq_pad % 64 == 0
    p.sm90.lse_delta[out] = lse == -INFINITY ? INFINITY : lse * jacobi::attn::kLog2e;
    p.sm90.lse_delta[out + kBwdBlockM] = acc;
  }
}

// The last step: dq[token perm[p]] = scale * dq_accum[p] (stream order), cast to the dtype.
template <typename Element>
__global__ void bwd_sm90_dq_convert_kernel(const BwdParams p) {
  const int64_t n = int64_t(p.batch) * p.heads_q * p.seq_len * p.head_dim;
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += int64_t(gridDim.x) * blockDim.x) {
    store_dq<Element>(p, p.sm90.dq_accum, p.sm90.perm, i);
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

bool has_bwd_kernel(DType dtype, int64_t head_dim) { return has_kernel(dtype, head_dim); }

cudaError_t block_attention_bwd(const BwdParams& params, DType dtype, cudaStream_t stream) {
  if (!has_bwd_kernel(dtype, params.head_dim)) return cudaErrorNotSupported;
  const Sm90BwdInputs& in = params.sm90;
  if (in.q == nullptr || in.k == nullptr || in.v == nullptr || in.dout == nullptr ||
      in.perm == nullptr || in.lists.bwd_ptr == nullptr || in.lists.bwd_tile == nullptr ||
      in.lists.bwd_mask == nullptr || in.lse_delta == nullptr ||
      in.dq_accum == nullptr || in.lists.tile_m != kTileM || in.lists.tile_n != kTileN ||
      in.lists.fwd_ptr == nullptr || in.lists.fwd_tile == nullptr) {  // dq_turn reads fwd lists
    return cudaErrorInvalidValue;  // the op builds these; never launch without them
  }
  if (params.seq_len == 0 || params.batch == 0 || params.heads_q == 0) return cudaSuccess;
  const int32_t seq_pad = in.lists.num_q_tiles * kTileM;
  return JACOBI_DTYPE_SWITCH(dtype, [&] {
    const int64_t rows = int64_t(params.batch) * params.heads_q * seq_pad;
    bwd_sm90_prep_kernel<Element><<<unsigned((rows * 16 + 255) / 256), 256, 0, stream>>>(params, seq_pad);
    cudaError_t e = cudaGetLastError();
    if (e != cudaSuccess) return e;
    e = JACOBI_SM90_HEADDIM_SWITCH(params.head_dim,
                                   [&] { return run_bwd_sm90<Element, kHeadDim>(params, stream); });
    if (e != cudaSuccess) return e;
    const int64_t n = int64_t(params.batch) * params.heads_q * params.seq_len * params.head_dim;
    const unsigned blocks = unsigned(n / 256 + 1 < 65535 ? n / 256 + 1 : 65535);
    bwd_sm90_dq_convert_kernel<Element><<<blocks, 256, 0, stream>>>(params);
    return cudaGetLastError();
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
