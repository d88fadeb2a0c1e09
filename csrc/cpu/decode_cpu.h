// The small ops of a CPU decoding step, fused: attention of a few query rows over the KV cache,
// RMSNorm, and the greedy pick (argmax_f32). Torch-free interface; kernels in decode_cpu.cpp
// (compiled per ISA, isa.h).
//
// Why: with the linears at the memory roofline (linear_cpu.h), a one-token step of SmolLM2-135M
// spent ~1.7 ms in 30 calls of torch's SDPA (~55 us each, for ~0.4 MFLOP) and ~1 ms in 61
// RMSNorms of seven ATen ops each, against ~9 ms of weights to read.
//
// Both compute each output row alone, in a fixed order (keys in slot order; features in order),
// so a row's result never depends on the other rows of the call, like the linear's: a token's
// hidden state is the same bits in a 1-token and a 64-token step.
#pragma once

#include <cstdint>

#include "cpu/isa.h"
#include "cpu/linear_cpu.h"

namespace jacobi::cpu {

struct DecodeAttnArgs {
  LinearDType dtype;       // of q, k, v, out (fp32 accumulation)
  int64_t B, Hq, Hkv, Q, W, D;
  const void* q;           // [B, Hq, Q, D], strides sq (elements; D contiguous)
  int64_t sq_b, sq_h, sq_q;
  const void* k;           // [B, Hkv, W, D], strides sk
  int64_t sk_b, sk_h, sk_w;
  const void* v;           // [B, Hkv, W, D], strides sv
  int64_t sv_b, sv_h, sv_w;
  const bool* mask;        // [B, Q, W] contiguous: query i may see slot j
  float scale;
  void* out;               // [B, Q, Hq, D] contiguous (the layout the output projection reads)
  float* scratch;          // threads * W floats
  // The keys kept transposed by the caller, [B, Hkv, ldkt / kKeyPad, D, kKeyPad] (blocks of
  // kKeyPad slots, each [D][kKeyPad]; ldkt >= W rounded up to kKeyPad; slots past W are read and
  // masked), fp32 (fp16 where kv_half), or nullptr: the call transposes k into scratch the same
  // way. Same values either way, so the same scores, bitwise.
  const void* kt = nullptr;
  int64_t ldkt = 0;
  // Slots [first, W) hold the context in position order and [0, first) the step's own tokens
  // after it (the runtime's scratch region): the softmax sum and p V run over the slots in that
  // order, so a row's bits do not depend on where its keys sit (0: slot order).
  int64_t first = 0;
  // k, v (and kt) hold IEEE fp16, q and out the dtype (f32 only): a half-size K/V cache. Each
  // key and value is widened to fp32 exactly where it is read; the arithmetic is unchanged, so
  // the result is the fp32 attention over the fp16-rounded keys and values.
  bool kv_half = false;
};

// Keys per block of the transposed keys ([D][kKeyPad] each, contiguous): W is rounded up to
// this (every ISA's vector width divides it), so the scratch size does not depend on the ISA.
constexpr int64_t kKeyPad = 16;
// Where slot j of one (batch, kv head)'s transposed keys sits, in floats from their start:
// element j % kKeyPad of feature 0's row in block j / kKeyPad (feature d is d kKeyPad further).
// The one statement of the blocked layout, for the attention, its cache write and the commit.
inline int64_t kt_slot(int64_t j, int64_t D) {
  return (j / kKeyPad) * D * kKeyPad + j % kKeyPad;
}
// Query rows of one kv head computed together (their score and output chains interleave).
constexpr int kDecodeRows = 8;

// Whether decode_attention schedules by ranges of keys and features rather than by rows: when
// the (batch, kv head, kDecodeRows rows) units are too few to keep the threads busy (a one-token
// step of a GQA model: 3 units). The results are the same bits either way.
inline bool decode_attention_few_rows(int64_t B, int64_t Hkv, int64_t Hq, int64_t Q,
                                      int64_t threads) {
  const int64_t rows = (Hq / Hkv) * Q;
  return B * Hkv * ((rows + kDecodeRows - 1) / kDecodeRows) < 4 * threads;
}

// fp32 scratch (floats) decode_attention needs: Kt and V per (batch, kv head), per thread the
// scores of kDecodeRows rows (and their probabilities transposed), their queries and outputs,
// and with few rows every row's scores and query.
inline int64_t decode_attention_scratch_floats(int64_t B, int64_t Hkv, int64_t Hq, int64_t Q,
                                               int64_t W, int64_t D, int64_t threads) {
  const int64_t ldk = (W + kKeyPad - 1) / kKeyPad * kKeyPad;
  const int64_t shared =
      decode_attention_few_rows(B, Hkv, Hq, Q, threads) ? B * Hq * Q * (ldk + D) : 0;
  return B * Hkv * (D * ldk + W * D) + threads * (2 * kDecodeRows * ldk + 2 * kDecodeRows * D) +
         shared;
}

// Rotary embedding, K/V cache write and attention in one call (the lean forward's attention
// block). qkv [B, Q, (Hq + 2 Hkv) D] is the fused projection's output; rows i of q and k are
// rotated as transformers' apply_rotary_pos_emb does (q * cos + rotate_half(q) * sin, each
// product and the sum rounded to the dtype), k and v written to the cache at slot slots[i],
// then the queries attend slots [0, W) of the cache where mask allows.
struct RopeAttnArgs {
  LinearDType dtype;
  int64_t B, Hq, Hkv, Q, D;
  const void* qkv;     // [B, Q, (Hq + 2 Hkv) * D] contiguous
  const void* cos;     // [B, Q, D] contiguous, the dtype
  const void* sin;     // [B, Q, D] contiguous, the dtype
  void* k_cache;       // [B, Hkv, capacity, D] contiguous
  void* v_cache;       // [B, Hkv, capacity, D] contiguous
  int64_t capacity;
  const int64_t* slots;  // [Q]: the cache slot query i's k and v go to
  int64_t W;             // slots attended: [0, W)
  const bool* mask;      // [B, Q, W]
  float scale;
  void* out;             // [B, Q, Hq, D] contiguous
  float* scratch;        // decode_attention_scratch_floats(B, Hkv, Hq, Q, W, D, threads)
  // Optional: the caller's transposed copy of k_cache, [B, Hkv, kt_ld / kKeyPad, D, kKeyPad]
  // (kt_ld >= capacity, a multiple of kKeyPad; DecodeAttnArgs::kt), fp32 (fp16 where kv_half).
  // The call writes its k there too and attends from it, so a step does not transpose the whole
  // cache again (at a few hundred keys that was about half the attention's memory traffic).
  void* kt_cache = nullptr;
  int64_t kt_ld = 0;
  int64_t first = 0;  // DecodeAttnArgs::first
  // k_cache, v_cache and kt_cache hold IEEE fp16 (dtype f32 only): k is rotated in fp32 as
  // above, then k and v are rounded to fp16 as they are written (DecodeAttnArgs::kv_half).
  bool kv_half = false;
};

struct RmsNormArgs {
  LinearDType dtype;  // of x, weight and y
  int64_t rows, n;
  const void* x;         // [rows, n] contiguous
  const void* residual;  // [rows, n] contiguous, or nullptr: then h = x
  const void* weight;    // [n]
  float eps;
  void* h;               // [rows, n]: residual + x (rounded to the dtype), or nullptr
  void* y;               // [rows, n]: the norm of h
};

// The RMSNorm of each head of q and of k (Qwen3's q_norm / k_norm, over head_dim), in place in
// the fused q/k/v projection: per token, the row of qkv holds `heads` q heads, then `kv_heads` k
// heads, then the v heads (untouched), each of D features.
struct QkRmsNormArgs {
  LinearDType dtype;  // of qkv and both weights
  int64_t tokens, row;  // qkv [tokens, row] contiguous, row = (heads + 2 kv_heads) D
  int64_t heads, kv_heads, D;
  void* qkv;
  const void* q_weight;  // [D]
  const void* k_weight;  // [D]
  float eps;
};

struct SiluMulArgs {
  LinearDType dtype;
  int64_t rows, n;  // gu [rows, 2n] contiguous -> out [rows, n]
  const void* gu;
  void* out;
};

}  // namespace jacobi::cpu

// out[b, i, h] = softmax_j(scale * q[b, h, i] . k[b, h / G, j] over mask[b, i, j]) v[b, h / G, j]
// (G = Hq / Hkv). Rows that see no slot get zeros. Threads from torch's pool.
JACOBI_DECLARE_CPU_KERNEL(void decode_attention(const ::jacobi::cpu::DecodeAttnArgs& args))
JACOBI_DECLARE_CPU_KERNEL(void rope_attention(const ::jacobi::cpu::RopeAttnArgs& args))
// h = residual + x (if residual), y = weight * (h * rsqrt(mean(h^2) + eps)), transformers'
// RMSNorm: the normalised row is rounded to the dtype before the weight multiplies it.
JACOBI_DECLARE_CPU_KERNEL(void rms_norm(const ::jacobi::cpu::RmsNormArgs& args))
// rms_norm's formula on each q and k head of qkv, in place (QkRmsNormArgs).
JACOBI_DECLARE_CPU_KERNEL(void qk_rms_norm(const ::jacobi::cpu::QkRmsNormArgs& args))
// out[r] = the index of the first NaN of row r of x [rows, vocab] (contiguous), else of the first
// of its maxima: torch's max(-1).indices, the greedy pick.
JACOBI_DECLARE_CPU_KERNEL(void argmax_f32(const float* x, int64_t rows, int64_t vocab,
                                          int64_t* out))
// The greedy head's screen (jacobi/greedy_screen.h), rows m < M: a_j = y0[m, j] + y1[m, j]
// (rows ldy apart), E_j = w1[j] * e[m] + t; the columns j with a_j + E_j >= max_k (a_k - E_k),
// in increasing order, into cand[m * cap, ...), and their number into count[m]; count[m] = -1
// where they are more than cap, or any a_j - E_j or a_j + E_j is not finite (the caller computes
// that row in full).
JACOBI_DECLARE_CPU_KERNEL(void greedy_candidates(const float* y0, const float* y1, int64_t ldy,
                                                 int64_t M, int64_t V, const float* w1,
                                                 const float* e, float t, int64_t cap,
                                                 int32_t* cand, int64_t* count))
// out = silu(gu[:, :n]) * gu[:, n:], silu(g) = g / (1 + exp(-g)) rounded to the dtype first.
JACOBI_DECLARE_CPU_KERNEL(void silu_mul(const ::jacobi::cpu::SiluMulArgs& args))
