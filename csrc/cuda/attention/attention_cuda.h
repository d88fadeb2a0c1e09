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

namespace jacobi::cuda::attn {

enum class DType : int { bf16 = 0, fp16 = 1 };

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
  float* dq_accum;  // [B, Hq, S, D] zero-initialised fp32, fast (atomic) mode only
  float* dsum;      // [B, Hq, S] scratch: rowsum(dout * out)
  Strides do_stride, q_stride, k_stride, v_stride, o_stride, dq_stride, dk_stride, dv_stride;
  int32_t batch, heads_q, heads_kv, seq_len, head_dim;
  float scale;
  bool deterministic;
  Plan plan;
};

// Bytes of device workspace that build_plan needs (16-byte aligned base).
size_t plan_workspace_bytes(int32_t seq_len, int32_t num_blocks);

// Builds the plan in `workspace` (three small kernels on `stream`, no host synchronisation).
cudaError_t build_plan(const BlockTable& table, int32_t seq_len, void* workspace, Plan* plan,
                       cudaStream_t stream);

cudaError_t block_attention_fwd(const FwdParams& params, DType dtype, cudaStream_t stream);
cudaError_t block_attention_bwd(const BwdParams& params, DType dtype, cudaStream_t stream);

// Head dims with compiled kernels.
constexpr bool supported_head_dim(int64_t d) { return d == 64 || d == 128; }

}  // namespace jacobi::cuda::attn
