// CUDA entry points of the block-causal training attention (torch-free: raw pointers, strides in
// elements, a cudaStream_t). csrc/torch/attention_ops_cuda.cpp does the checks and allocation.
//
// Layouts: q/out/grad_q are [B, Hq, S, D], k/v/grad_k/grad_v [B, Hkv, S, D] with any batch, head
// and row strides (multiples of 8 elements, base 16-byte aligned) and a unit last-dim stride.
// lse and the row sums of the backward are float32 [B, Hq, S], contiguous, natural log:
//   lse[b,h,i] = log sum_{k visible to i} exp(scale * q_i . k_k)   (-inf if i sees nothing).
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

#include "jacobi/block_table.h"
#include "jacobi/tile_list.h"

namespace jacobi::cuda::attn {

enum class DType : int { bf16 = 0, fp16 = 1 };

// Kernel families: sm_80 (everywhere; the fallback) and sm_90a (Hopper, issue 21).
enum class Kernel : int { sm80 = 80, sm90 = 90 };

// The kernels put batch * heads on gridDim.y.
constexpr int64_t kMaxGridY = 65535;

// The device-side work plan (see jacobi/attention_plan.h), built by build_plan() on the stream.
struct Plan {
  BlockTable table;           // device pointers
  const int32_t* perm;        // [S]: permuted position -> original token
  const int32_t* pblk;        // [S]: permuted position -> original block (-1: uncovered)
  const uint8_t* tile_class;  // [num_tiles, num_tiles] at kPlanTile granularity, row = query tile
  int32_t num_tiles;          // ceil(S / kPlanTile)
};

struct Strides {
  int64_t batch, head, row;  // in elements
};

// What the sm_90a forward reads besides FwdParams (the op fills it when that kernel runs): q, k
// and v gathered once into stream order (contiguous [B, H, S, D], permuted position p holds token
// perm[p]), so that every tile is one TMA box, and the host-built tile lists at the kernel's tile
// sizes (jacobi_ext::attention_tile_lists(..., 128, 128), on the device).
struct Sm90FwdInputs {
  const void* q = nullptr;
  const void* k = nullptr;
  const void* v = nullptr;
  const int32_t* perm = nullptr;  // [S]
  jacobi::attn::TileLists lists{};
};

struct FwdParams {
  const void* q;
  const void* k;
  const void* v;
  void* out;
  float* lse;
  Strides q_stride, k_stride, v_stride, o_stride;
  int32_t batch, heads_q, heads_kv, seq_len, head_dim;
  float scale;
  Plan plan;
  Kernel kernel = Kernel::sm80;  // from choose_kernel
  Sm90FwdInputs sm90;            // kernel == sm90 only
};

// What the sm_90a backward reads besides BwdParams (the op fills it when that kernel runs,
// attention_sm90.h block_attention_bwd): q, k, v and dout gathered into stream order like the
// forward's inputs, the tile lists (backward lists included) at 128 x 128, and two scratch
// buffers in stream order: lse_delta [B, Hq, num_q_tiles * 128] x 2 floats (written by the
// backward's preprocessing kernel: per 64-row query tile, its 64 lse * log2 e, then its 64
// delta = rowsum(dO * O); rows past S are padding) and dq_accum [B, Hq, S, D] fp32,
// zero-initialised (dQ is accumulated there with atomics, then scaled and scattered to dq).
struct Sm90BwdInputs {
  const void* q = nullptr;
  const void* k = nullptr;
  const void* v = nullptr;
  const void* dout = nullptr;
  const int32_t* perm = nullptr;  // [S]
  jacobi::attn::TileLists lists{};
  float* lse_delta = nullptr;
  float* dq_accum = nullptr;
  // [B, Hq, Spad / 64] int32 zeros when the backward must be deterministic (each query half's dQ
  // added in ascending key-tile order); null: in any order.
  int32_t* dq_semaphore = nullptr;
};

struct BwdParams {
  const void* dout;
  const void* q;
  const void* k;
  const void* v;
  const void* out;
  const float* lse;  // [B, Hq, S]
  void* dq;
  void* dk;
  void* dv;
  float* dq_accum;  // [B, Hq, S, D] zero-initialised fp32: the sm_80 fast (atomic) mode only
  float* dsum;      // [B, Hq, S] scratch: rowsum(dout * out)
  Strides do_stride, q_stride, k_stride, v_stride, o_stride, dq_stride, dk_stride, dv_stride;
  int32_t batch, heads_q, heads_kv, seq_len, head_dim;
  float scale;
  bool deterministic;
  Plan plan;
  Kernel kernel = Kernel::sm80;  // from choose_kernel
  // kernel == sm90 with an sm_90a backward for (dtype, head dim): the op filled sm90 (its own
  // dq_accum, and dq_semaphore when deterministic) and block_attention_bwd runs the sm_90a
  // backward; otherwise the sm_80 one.
  Sm90BwdInputs sm90;
};

// Bytes of device workspace that build_plan needs (16-byte aligned base).
size_t plan_workspace_bytes(int32_t seq_len, int32_t num_blocks);

// Builds the plan in `workspace` (three small kernels on `stream`, no host synchronisation).
cudaError_t build_plan(const BlockTable& table, int32_t seq_len, void* workspace, Plan* plan,
                       cudaStream_t stream);

cudaError_t block_attention_fwd(const FwdParams& params, DType dtype, cudaStream_t stream);
cudaError_t block_attention_bwd(const BwdParams& params, DType dtype, cudaStream_t stream);

// ---- choosing the kernel family ------------------------------------------------------------------
// The caller names the family (jacobi_ext/attention.py decides which, default included); this only
// says whether the named one can run here.
struct KernelChoice {
  Kernel kernel;
  // Non-null when sm90 was asked for and the sm_80 kernel runs instead: why (for a warning).
  const char* fallback_reason;
};

// The family that runs on a device of compute capability major `cc_major`: sm90 only on 9.x,
// in a build with the sm_90a objects, where one exists for (dtype, head dim); sm80 otherwise.
// want_sm90: the caller asked for sm90 (otherwise, `auto` included, sm80 runs).
KernelChoice choose_kernel(bool want_sm90, int cc_major, DType dtype, int64_t head_dim);

// Head dims with compiled kernels (one fwd_/bwd_<dtype>_hdim<D>.cu file each; static_switch.h
// dispatches them; jacobi_ext/ops.py CUDA_HEAD_DIMS lists the same). The `gate` kernel set
// (CMake JACOBI_EXT_CUDA_KERNELS=gate, the CI compile check) compiles head dim 128 alone.
constexpr bool supported_head_dim(int64_t d) {
#ifdef JACOBI_CUDA_HDIM128_ONLY
  return d == 128;
#else
  return d == 64 || d == 96 || d == 128 || d == 256;
#endif
}

// Element types with compiled kernels: both, unless built with the reduced CI kernel set.
constexpr bool supported_dtype(DType d) {
#ifdef JACOBI_CUDA_BF16_ONLY
  return d == DType::bf16;
#else
  return d == DType::bf16 || d == DType::fp16;
#endif
}

// The shape rules every launch relies on (the torch op checks them with messages first; the entry
// points below check again and return cudaErrorInvalidValue before any launch):
// heads_kv >= 1, heads_q % heads_kv == 0, a compiled head dim, batch * heads within a grid row.
constexpr bool valid_shape(int64_t batch, int64_t heads_q, int64_t heads_kv, int64_t head_dim) {
  return batch >= 0 && heads_kv >= 1 && heads_q >= 0 && heads_q % heads_kv == 0 &&
         supported_head_dim(head_dim) && batch * heads_q <= kMaxGridY;
}

}  // namespace jacobi::cuda::attn
