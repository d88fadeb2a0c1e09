// Block-causal attention on the CPU (forward + backward): torch-free interface.
//
// The visibility rule is jacobi::BlockTable (csrc/include/jacobi/block_table.h). The kernels never
// build a token-level mask: make_attn_plan() cuts queries and keys into tiles (groups of whole
// blocks, or slices of a long block) and classifies every (query tile, key tile) pair from the
// block table as skipped, FULL (every query sees every key: no mask work at all) or PARTIAL (the
// mask is evaluated per block pair inside the tile). Only visible tile pairs are listed, so work
// and memory follow the useful pairs. How many pairs are PARTIAL depends on the token order:
// the Python layer reorders Jacobi Forcing sequences into "stream order" so that almost every
// pair is FULL (see jacobi_ext/layout.py).
#pragma once

#include <cstdint>
#include <vector>

#include "cpu/isa.h"
#include "jacobi/block_table.h"

namespace jacobi::cpu {

// The work list of one call. All indices are token indices of the (already ordered) sequence.
struct AttnPlan {
  int64_t seq_len = 0;
  std::vector<int32_t> token_block;  // [S]: block of each token
  std::vector<int32_t> q_start;      // query tiles: [num_q_tiles + 1] boundaries
  std::vector<int32_t> k_start;      // key tiles: [num_k_tiles + 1] boundaries
  // Query tile i attends key tiles fwd_kt[fwd_ptr[i] .. fwd_ptr[i+1]) (ascending);
  // fwd_partial says whether the pair needs the mask.
  std::vector<int32_t> fwd_ptr, fwd_kt;
  std::vector<uint8_t> fwd_partial;
  // The transpose: key tile j is seen by query tiles bwd_qt[bwd_ptr[j] .. bwd_ptr[j+1]).
  std::vector<int32_t> bwd_ptr, bwd_qt;
  std::vector<uint8_t> bwd_partial;
  // Scheduling weights (query x key tokens computed) per query tile and per key tile.
  std::vector<int64_t> q_cost, k_cost;

  int num_q_tiles() const { return static_cast<int>(q_start.size()) - 1; }
  int num_k_tiles() const { return static_cast<int>(k_start.size()) - 1; }
};

// Tiles of at most q_tile / k_tile tokens. The table must be valid (checked by the caller).
AttnPlan make_attn_plan(const BlockTable& table, int64_t seq_len, int q_tile, int k_tile);

enum class DType : int32_t { f32 = 0, bf16 = 1, f16 = 2 };

// Element strides of a [B, H, S, D] tensor whose last dim is contiguous.
struct Strides4 {
  int64_t b, h, s;
};

struct AttnDims {
  int64_t B, Hq, Hkv, S, D;
};

struct AttnFwdArgs {
  DType dtype;
  AttnDims dims;
  float scale;
  const void* q;
  Strides4 sq;
  const void* k;
  Strides4 sk;
  const void* v;
  Strides4 sv;
  void* out;         // [B, Hq, S, D] contiguous, q's dtype
  float* lse;        // [B, Hq, S] contiguous
  float* workspace;  // fwd_workspace_floats(dims, dtype) floats
};

struct AttnBwdArgs {
  DType dtype;
  AttnDims dims;
  float scale;
  const void* dout;
  Strides4 sdo;
  const void* q;
  Strides4 sq;
  const void* k;
  Strides4 sk;
  const void* v;
  Strides4 sv;
  const void* out;
  Strides4 so;
  const float* lse;  // [B, Hq, S]
  void* dq;          // [B, Hq, S, D] contiguous
  void* dk;          // [B, Hkv, S, D] contiguous
  void* dv;          // [B, Hkv, S, D] contiguous
  // Work items are (batch, kv head, chunk of key tiles). dQ is accumulated in fp32, once per
  // chunk, and the chunks are summed in a fixed order at the end, so the backward is
  // bit-identical run to run (for a given chunk count, which the caller derives from the shape
  // and the thread count).
  int chunks;
  float* workspace;  // bwd_workspace_floats(dims, dtype, chunks) floats
};

// fp32 workspace sizes (in floats) of one call; see the layouts in attention_cpu.cpp.
inline int64_t fwd_workspace_floats(const AttnDims& d, DType dt) {
  const int64_t kv = d.B * d.Hkv * d.S * d.D;
  return kv * (dt == DType::f32 ? 1 : 2);  // K^T, and V widened for bf16/fp16
}
inline int64_t bwd_workspace_floats(const AttnDims& d, DType dt, int chunks) {
  const int64_t kv = d.B * d.Hkv * d.S * d.D, qo = d.B * d.Hq * d.S * d.D, rows = d.B * d.Hq * d.S;
  // K^T; Q^T, Q, dO^T, dO (heads of a group interleaved); lse, delta; dQ^T per chunk;
  // K and V widened for bf16/fp16.
  return kv + 4 * qo + 2 * rows + chunks * qo + (dt == DType::f32 ? 0 : 2 * kv);
}

}  // namespace jacobi::cpu

JACOBI_DECLARE_CPU_KERNEL(void block_attention_fwd(const ::jacobi::cpu::AttnFwdArgs& args,
                                                   const ::jacobi::cpu::AttnPlan& plan,
                                                   const ::jacobi::BlockTable& table))
JACOBI_DECLARE_CPU_KERNEL(void block_attention_bwd(const ::jacobi::cpu::AttnBwdArgs& args,
                                                   const ::jacobi::cpu::AttnPlan& plan,
                                                   const ::jacobi::BlockTable& table))
