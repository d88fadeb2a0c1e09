// Device-side plan construction (jacobi/attention_plan.h), the backward's element-wise pre- and
// post-passes, and the (dtype, head dim) dispatch. No CuTe here: small kernels, cheap to compile.
#include <cuda_runtime.h>

#include <algorithm>

#include "cuda/attention/attention_cuda.h"
#include "cuda/attention/launch.h"
#include "cuda/attention/bwd_rows.h"
#include "cuda/attention/static_switch.h"
#include "jacobi/attention_plan.h"
#ifdef JACOBI_WITH_SM90
#include "cuda/attention/sm90/attention_sm90.h"
#endif

namespace jacobi::cuda::attn {
namespace {

constexpr size_t align16(size_t x) { return (x + 15) / 16 * 16; }

struct WorkspaceLayout {
  size_t order, scratch, pstart, perm, pblk, tile_class, total;
  WorkspaceLayout(int32_t seq_len, int32_t nb) {
    const int32_t nt = jacobi::attn::ceil_div(seq_len, jacobi::attn::kPlanTile);
    order = 0;
    scratch = order + align16(sizeof(int32_t) * size_t(nb));
    pstart = scratch + align16(sizeof(int32_t) * 2 * size_t(nb));
    perm = pstart + align16(sizeof(int32_t) * (size_t(nb) + 1));
    pblk = perm + align16(sizeof(int32_t) * size_t(seq_len));
    tile_class = pblk + align16(sizeof(int32_t) * size_t(seq_len));
    total = tile_class + align16(size_t(nt) * size_t(nt));
  }
};

// The block order is inherently sequential (a walk over a forest of num_blocks nodes, a few
// thousand at most); one thread does it, like the decoding step's bookkeeping.
__global__ void plan_order_kernel(BlockTable t, int32_t* order, int32_t* scratch,
                                  int32_t* pstart) {
  if (threadIdx.x != 0 || blockIdx.x != 0) return;
  jacobi::attn::plan_block_order(t, order, scratch);
  jacobi::attn::plan_block_starts(t, order, pstart);
}

__global__ void plan_tokens_kernel(BlockTable t, const int32_t* order, const int32_t* pstart,
                                   int32_t seq_len, int32_t* perm, int32_t* pblk) {
  const int32_t p = blockIdx.x * blockDim.x + threadIdx.x;
  if (p >= seq_len) return;
  const jacobi::attn::PermutedToken tok = jacobi::attn::plan_token(t, order, pstart, p);
  perm[p] = tok.token;
  pblk[p] = tok.block;
}

// One CTA per query tile row of the plan, threads over key tiles.
__global__ void plan_tiles_kernel(BlockTable t, const int32_t* order, const int32_t* pstart,
                                  int32_t seq_len, int32_t num_tiles, uint8_t* tile_class) {
  const int32_t i = blockIdx.x;
  for (int32_t j = threadIdx.x; j < num_tiles; j += blockDim.x) {
    tile_class[int64_t(i) * num_tiles + j] =
        jacobi::attn::plan_classify_tile(t, order, pstart, seq_len, i, j);
  }
}

// D_i = rowsum(dO * O) over the head dim, per (b, h, token): 16 lanes per row (bwd_rows.h).
template <typename Element>
__global__ void bwd_dsum_kernel(const BwdParams p) {
  const int64_t rows = int64_t(p.batch) * p.heads_q * p.seq_len;
  const int64_t r = (int64_t(blockIdx.x) * blockDim.x + threadIdx.x) / 16;
  const int lane = threadIdx.x % 16;
  const int64_t s = r % p.seq_len;
  const int64_t h = (r / p.seq_len) % p.heads_q;
  const int64_t b = r / (int64_t(p.seq_len) * p.heads_q);
  const float acc = row_dot16<Element>(p, r < rows, b, h, s, lane);
  if (r < rows && lane == 0) p.dsum[r] = acc;
}

// Fast mode's last step: dq = scale * dq_accum, cast to the input dtype (dq may be strided).
template <typename Element>
__global__ void bwd_dq_convert_kernel(const BwdParams p) {
  const int64_t n = int64_t(p.batch) * p.heads_q * p.seq_len * p.head_dim;
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += int64_t(gridDim.x) * blockDim.x) {
    store_dq<Element>(p, p.dq_accum, nullptr, i);
  }
}

}  // namespace

KernelChoice choose_kernel(bool want_sm90, int cc_major, DType dtype, int64_t head_dim) {
  if (!want_sm90) return {Kernel::sm80, nullptr};
  if (cc_major != 9) return {Kernel::sm80, "the device is not compute capability 9.x"};
#ifdef JACOBI_WITH_SM90
  if (!sm90::has_kernel(dtype, head_dim)) {
    return {Kernel::sm80, "no sm_90a kernel for this dtype and head dim (it has bf16/fp16 x head "
                          "dims 64/128)"};
  }
  return {Kernel::sm90, nullptr};
#else
  (void)dtype;
  (void)head_dim;
  return {Kernel::sm80, "this build has no sm_90a objects (CMake JACOBI_EXT_CUDA_ARCHS lacks 90a)"};
#endif
}

size_t plan_workspace_bytes(int32_t seq_len, int32_t num_blocks) {
  return WorkspaceLayout(seq_len, num_blocks).total;
}

cudaError_t build_plan(const BlockTable& table, int32_t seq_len, void* workspace, Plan* plan,
                       cudaStream_t stream) {
  const WorkspaceLayout w(seq_len, table.num_blocks);
  char* base = static_cast<char*>(workspace);
  auto* order = reinterpret_cast<int32_t*>(base + w.order);
  auto* scratch = reinterpret_cast<int32_t*>(base + w.scratch);
  auto* pstart = reinterpret_cast<int32_t*>(base + w.pstart);
  auto* perm = reinterpret_cast<int32_t*>(base + w.perm);
  auto* pblk = reinterpret_cast<int32_t*>(base + w.pblk);
  auto* tile_class = reinterpret_cast<uint8_t*>(base + w.tile_class);
  const int32_t nt = jacobi::attn::ceil_div(seq_len, jacobi::attn::kPlanTile);
  plan_order_kernel<<<1, 32, 0, stream>>>(table, order, scratch, pstart);
  if (seq_len > 0) {
    plan_tokens_kernel<<<jacobi::attn::ceil_div(seq_len, 256), 256, 0, stream>>>(
        table, order, pstart, seq_len, perm, pblk);
    plan_tiles_kernel<<<nt, 128, 0, stream>>>(table, order, pstart, seq_len, nt, tile_class);
  }
  plan->table = table;
  plan->perm = perm;
  plan->pblk = pblk;
  plan->tile_class = tile_class;
  plan->num_tiles = nt;
  return cudaGetLastError();
}

cudaError_t block_attention_fwd(const FwdParams& params, DType dtype, cudaStream_t stream) {
  if (!valid_shape(params.batch, params.heads_q, params.heads_kv, params.head_dim)) {
    return cudaErrorInvalidValue;
  }
  if (params.seq_len == 0 || params.batch == 0 || params.heads_q == 0) return cudaSuccess;
#ifdef JACOBI_WITH_SM90
  if (params.kernel == Kernel::sm90) return sm90::block_attention_fwd(params, dtype, stream);
#endif
  return JACOBI_DTYPE_SWITCH(dtype, [&] {
    return JACOBI_HEADDIM_SWITCH(params.head_dim,
                                 [&] { return run_fwd<Element, kHeadDim>(params, stream); });
  });
}

cudaError_t block_attention_bwd(const BwdParams& params, DType dtype, cudaStream_t stream) {
  if (!valid_shape(params.batch, params.heads_q, params.heads_kv, params.head_dim)) {
    return cudaErrorInvalidValue;
  }
  if (params.seq_len == 0 || params.batch == 0 || params.heads_q == 0) return cudaSuccess;
#ifdef JACOBI_WITH_SM90
  // The sm_90a backward where the op chose it and filled its inputs (attention_ops_cuda.cpp
  // bwd_family: kernel sm90 and a kernel for the dtype and head dim; deterministic or not).
  if (params.kernel == Kernel::sm90 && params.sm90.q != nullptr) {
    if (params.deterministic != (params.sm90.dq_semaphore != nullptr)) return cudaErrorInvalidValue;
    return sm90::block_attention_bwd(params, dtype, stream);
  }
#endif
  // Otherwise this sm_80 backward, also behind the sm_90a forward (it writes the same lse:
  // natural log, token order). Its dsum scratch is allocated by the op only for this path.
  if (params.dsum == nullptr) return cudaErrorInvalidValue;
  return JACOBI_DTYPE_SWITCH(dtype, [&] {
    const int64_t rows = int64_t(params.batch) * params.heads_q * params.seq_len;
    bwd_dsum_kernel<Element><<<unsigned((rows * 16 + 255) / 256), 256, 0, stream>>>(params);
    cudaError_t e = cudaGetLastError();
    if (e != cudaSuccess) return e;
    e = JACOBI_HEADDIM_SWITCH(params.head_dim,
                              [&] { return run_bwd<Element, kHeadDim>(params, stream); });
    if (e != cudaSuccess || params.deterministic) return e;
    const int64_t n = rows * params.head_dim;
    const unsigned blocks = unsigned(std::min<int64_t>((n + 255) / 256, 65535));
    bwd_dq_convert_kernel<Element><<<blocks, 256, 0, stream>>>(params);
    return cudaGetLastError();
  });
}

}  // namespace jacobi::cuda::attn
