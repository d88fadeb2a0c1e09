// CUDA entries of the fused small ops of a decoding step (torch-free; the per-element math is
// jacobi/decode_step.h, shared with the CPU kernels of csrc/cpu/decode_cpu.h). Each is one
// launch (the attention two: split-K and the combine), reads no host value it did not get as
// an argument and allocates nothing: capturable in a CUDA graph. Pointers are device pointers to
// contiguous tensors unless a stride is given. Returns the launch status.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

namespace jacobi::cuda {

enum class DecodeDType { kFloat32, kBFloat16 };

struct RmsNormLaunch {
  DecodeDType dtype;     // of x, residual, weight, h and y
  int64_t rows, n;
  const void* x;         // [rows, n]
  const void* residual;  // [rows, n], or nullptr: h = x
  const void* weight;    // [n]
  float eps;
  void* h;               // [rows, n]: residual + x rounded, or nullptr
  void* y;               // [rows, n]
};
cudaError_t rms_norm(const RmsNormLaunch& a, cudaStream_t stream);

// Qwen3's q/k norms: the RMSNorm of each q head and k head of qkv [tokens, row] (row = (heads +
// 2 kv_heads) D), in place, with q_weight / k_weight [D]: one warp a head.
struct QkRmsNormLaunch {
  DecodeDType dtype;  // of qkv and both weights
  int64_t tokens, row, heads, kv_heads, D;
  void* qkv;
  const void* q_weight;
  const void* k_weight;
  float eps;
};
cudaError_t qk_rms_norm(const QkRmsNormLaunch& a, cudaStream_t stream);

// out [rows, n] = silu(gu[:, :n]) * gu[:, n:] (gu [rows, 2 n]).
cudaError_t silu_mul(DecodeDType dtype, int64_t rows, int64_t n, const void* gu, void* out,
                     cudaStream_t stream);

// Keys per split of the decode attention (a multiple of its chunk of 32 keys): a sequence's
// keys [s * kDecodeSplitKeys, (s + 1) * kDecodeSplitKeys) in step_key_slot's order go to split s.
constexpr int64_t kDecodeSplitKeys = 128;
inline int64_t decode_attention_splits(int64_t capacity, int64_t Q) {
  return (capacity + Q + kDecodeSplitKeys - 1) / kDecodeSplitKeys;
}

struct RopeAttentionLaunch {
  DecodeDType dtype;       // of qkv, cos, sin, the caches and out
  int64_t B, Hq, Hkv, Q, D, capacity;
  const void* qkv;         // [B, Q, (Hq + 2 Hkv) D]
  const void* cos;         // [B, Q, D]
  const void* sin;         // [B, Q, D]
  void* k_cache;           // [B, Hkv, capacity, D]: query i's rotated k goes to slot i
  void* v_cache;           // [B, Hkv, capacity, D]
  const int64_t* seg;      // [B, Q] with row stride seg_stride (elements)
  const int64_t* off;      // [B, Q] with row stride off_stride
  int64_t seg_stride, off_stride;
  const int64_t* lo;       // [B]: committed slots [lo[b], hi[b])
  const int64_t* hi;       // [B]
  float scale;
  int64_t splits;          // decode_attention_splits(capacity, Q)
  float* partial_out;      // [splits, B * Q * Hq, D] scratch
  float* partial_stats;    // [splits, B * Q * Hq, 2] scratch: (max, sum) per split and row
  void* out;               // [B, Q, Hq, D]
};
// Head dims 64 and 128.
bool decode_attention_head_dim_ok(int64_t D);
cudaError_t rope_attention(const RopeAttentionLaunch& a, cudaStream_t stream);

// out[r] = the greedy pick of row r of x [rows, vocab] (jacobi/decode_step.h: greedy_better;
// torch's max(-1).indices): one block a row.
enum class LogitsDType { kFloat32, kBFloat16, kFloat16, kFloat64 };
cudaError_t argmax(LogitsDType dtype, const void* x, int64_t rows, int64_t vocab, int64_t* out,
                   cudaStream_t stream);

// The K/V commit of every layer in one launch: in each of the `count` caches [B, H, capacity,
// D] (elements of elem_bytes; all of one shape), sequence b's slots [src[b], src[b] + n[b])
// move to [dst[b], ...) (overlapping ranges as memmove). A sequence whose ranges fall outside the
// cache is left alone (no host check is possible inside a graph; the CPU op raises).
constexpr int kCommitMaxCaches = 256;  // per launch (the caller launches again for more)
struct KvCommitLaunch {
  void* caches[kCommitMaxCaches];
  int count;
  int64_t B, H, capacity, row_bytes;  // row_bytes = D * element size, a multiple of 2
  const int64_t* src;
  const int64_t* dst;
  const int64_t* n;
};
cudaError_t kv_commit(const KvCommitLaunch& a, cudaStream_t stream);

}  // namespace jacobi::cuda
