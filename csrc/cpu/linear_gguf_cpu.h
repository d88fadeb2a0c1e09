// The decode-shaped CPU linear on GGUF weights as they are stored: torch-free interface.
//
// Why: a GGUF file keeps a model's weights in blocks of small integer codes with a scale (and an
// offset) per block: SmolLM2-135M's Q4_1 file is 97 MB against 538 MB of fp32. Decoding is bound
// by reading the weights, so a step that reads the file's bytes instead of an fp32 copy reads
// ~5.6x fewer of them.
//
// What makes it lossless by construction: every weight is dequantized exactly as the `gguf`
// package's own dequantization computes it (the same fp32 products and sums, in the same order,
// each rounded once), into an fp32 panel in L1, and that panel is multiplied by the fp32 kernel's
// own register tile (linear_tile.h): each output is the same single fp32 chain over k as the fp32
// kernel's on the dequantized weight. So a model run from its GGUF codes returns bitwise the
// logits of the same model dequantized to fp32 and run through cpu_linear, and a row's result
// never depends on the other rows of the call.
//
// Supported types (ggml's type ids) and the value of weight k of a row, q its integer code:
//   Q4_0 (2)   d * (q - 8)               q in 0..15, d fp16, blocks of 32
//   Q4_1 (3)   (d * q) + m               q in 0..15, d, m fp16, blocks of 32
//   Q8_0 (8)   d * q                     q in -128..127, d fp16, blocks of 32
//   Q4_K (12)  (d*sc) * q - (dmin*mn)    q in 0..15, super-blocks of 256, 8 sub-blocks of 32 with
//                                        6-bit sc, mn; d, dmin fp16
//   Q5_K (13)  (d*sc) * q - (dmin*mn)    as Q4_K with q in 0..31 (a fifth bit per weight)
//   Q6_K (14)  (d*sc) * q                q in -32..31, super-blocks of 256, 16 sub-blocks of 16
//                                        with int8 sc; d fp16
// (each parenthesis one fp32 rounding, as numpy computes it; a - b is a + (-b) bitwise).
//
// Packed layout: the N rows are cut into panels of NR output features (linear_panel_width(), as
// the fp32 kernel), the last one zero-padded. Panel p is a sequence of K / G groups of G
// consecutive k (G = 32, or 16 for Q6_K); group g holds, for its NR columns,
//   a header:  fp16 d[NR] (Q4_0, Q8_0), fp16 d[NR] then m[NR] (Q4_1): the file's own values;
//              fp32 s[NR] then o[NR] (Q4_K, Q5_K: s = d*sc, o = -(dmin*mn)), fp32 s[NR] (Q6_K):
//              the sub-block's scale and offset, computed at packing as the dequantization does;
//   the codes: 4-bit types, G/2 rows of NR bytes, byte [i][j] = code(2i) | code(2i+1) << 4;
//              the others, G rows of NR int8 (Q5_K's 0..31, Q6_K's q - 32 as stored).
// A group's bytes are contiguous, so a thread reads its panels front to back exactly once per
// call. Q4_0, Q4_1 and Q8_0 pack to the file's bytes exactly; Q4_K to 6 bits a weight (the file:
// 4.5), Q5_K to 10 (5.5), Q6_K to 10 (6.56): the k-quants trade bytes for dequantization work.
#pragma once

#include <cstdint>

#include "cpu/isa.h"
#include "cpu/linear_cpu.h"

namespace jacobi::cpu {

enum class GgufType : int32_t { q4_0 = 2, q4_1 = 3, q8_0 = 8, q4_k = 12, q5_k = 13, q6_k = 14 };

// The file's block and the packed group of a type: the one description the packing, the kernels
// and the op's checks all read.
struct GgufFormat {
  int block_k;       // weights per block in the file
  int block_bytes;   // bytes per block in the file
  int group_k;       // G: consecutive k sharing a header in the packed layout
  int header_bytes;  // header bytes per column of a group
  int code_bits;     // 4 or 8
  bool half_header;  // the header holds the file's fp16 fields (else fp32 scale / offset)
  bool offset;       // a second header field: weight = (scale * q) + offset
};

constexpr GgufFormat gguf_format_of(GgufType t) {
  switch (t) {
    case GgufType::q4_0: return {32, 18, 32, 2, 4, true, false};
    case GgufType::q4_1: return {32, 20, 32, 4, 4, true, true};
    case GgufType::q8_0: return {32, 34, 32, 2, 8, true, false};
    case GgufType::q4_k: return {256, 144, 32, 8, 4, false, true};
    case GgufType::q5_k: return {256, 176, 32, 8, 8, false, true};
    case GgufType::q6_k: return {256, 210, 16, 4, 8, false, false};
  }
  return {};
}

// The format of ggml type id `type`; false if the kernels do not read it.
inline bool gguf_format(int32_t type, GgufFormat* f) {
  switch (static_cast<GgufType>(type)) {
    case GgufType::q4_0:
    case GgufType::q4_1:
    case GgufType::q8_0:
    case GgufType::q4_k:
    case GgufType::q5_k:
    case GgufType::q6_k:
      *f = gguf_format_of(static_cast<GgufType>(type));
      return true;
    default:
      return false;
  }
}

// Bytes of one packed group of NR columns.
inline int64_t gguf_group_bytes(const GgufFormat& f, int64_t nr) {
  return nr * f.header_bytes + nr * f.group_k * f.code_bits / 8;
}

// An unmerged LoRA beside the codes: y = (x W^T + bias) + t B^T, t = x A^T. B in the fp32
// kernel's panels, [ceil(N / NR), rank, NR]; A in panels one vector wide, [ldt / VL, K, VL] (VL =
// NR / 2; its rows padded to whole vectors: a rank-16 A in NR-wide panels was half zeros on
// AVX-512, read at every call). linear_gguf computes t first, then adds each panel's B product,
// each output's LoRA term the fp32 kernel's chain over the rank, added last. The factors are
// fp32, or bf16 (an adapter's stored dtype): each panel row is then widened exactly before the
// same multiply-adds, so the same bits as fp32 factors holding the same values, at half the bytes.
struct GgufLora {
  float* t = nullptr;  // [M, ldt], written by linear_gguf; nullptr: no LoRA
  int64_t ldt = 0;     // columns of t: A's panels times VL
  int64_t rank = 0;    // columns of t each panel of B reads
  bool bf16 = false;   // the factors' dtype: fp32, or bf16 (c10::BFloat16)
  const void* a_packed = nullptr;
  const void* b_packed = nullptr;
  // Per panel, the first of the rank columns of t its B reads; nullptr: column 0. Linears packed
  // side by side (q/k/v) share one t (their A stacked), and each panel reads only its own
  // linear's columns, where a block-diagonal B would multiply the others' by zeros.
  const int64_t* panel_r0 = nullptr;
};

}  // namespace jacobi::cpu

// rows[n]: row n of the weight as the file stores it (K / block_k blocks) -> packed:
// [ceil(N / NR), K / G, gguf_group_bytes] bytes (NR = linear_panel_width()).
JACOBI_DECLARE_CPU_KERNEL(void linear_gguf_pack(::jacobi::cpu::GgufType type,
                                                const uint8_t* const* rows, int64_t N, int64_t K,
                                                uint8_t* packed))
// y = x W^T (+ bias) with x, y, bias float32 (args.dtype f32), args.packed from linear_gguf_pack.
JACOBI_DECLARE_CPU_KERNEL(void linear_gguf(::jacobi::cpu::GgufType type,
                                           const ::jacobi::cpu::LinearArgs& args,
                                           const ::jacobi::cpu::GgufLora& lora))
// The same on 8-bit activations (opt-in; Q4_1 and Q8_0, type checked by the caller): each row of
// x quantized alone per group of 32 k (q = nearbyint(x * 127 / amax), dx = amax / 127), each
// output column's exact integer sum of code x q per group, then acc = fma(d * dx, isum, acc)
// and, for Q4_1's offset, acc = fma(m, dx * sum(q), acc), over the groups in order; bias and
// LoRA as linear_gguf. Not the dequantized fp32 product (llama.cpp's kind of arithmetic, ~1/3
// the instructions per 4-bit weight), but the same bits on every ISA and for a row whatever the
// other rows of the call.
JACOBI_DECLARE_CPU_KERNEL(void linear_gguf_int8(::jacobi::cpu::GgufType type,
                                                const ::jacobi::cpu::LinearArgs& args,
                                                const ::jacobi::cpu::GgufLora& lora))
// r = x - dx q, rows of x [M, K] (K a multiple of 32) quantized per group of 32 exactly as
// linear_gguf_int8 quantizes them (dx, q), each element one fused multiply-add (rounded once):
// what the 8-bit product of x leaves out, for the greedy head's second 8-bit row
// (jacobi/greedy_screen.h). A group with a non-finite value gets NaN.
JACOBI_DECLARE_CPU_KERNEL(void linear_gguf_int8_residual(const float* x, int64_t M, int64_t K,
                                                         int64_t ldx, float* r, int64_t ldr))
// The tile linear_gguf_int8 runs in this variant on this CPU: "amx-int8" (AMX tile products for
// calls of 65 rows or more, prefills and batches, and the "avx512-vnni-vbmi" tile for fewer;
// where the CPU has AMX-INT8 and the OS grants it, unless JACOBI_EXT_CPU_AMX=0),
// "avx512-vnni-vbmi" (vpdpbusd, the
// codes arranged by vpermt2b; where the CPU has AVX512-VNNI and AVX512-VBMI, unless
// JACOBI_EXT_CPU_VBMI=0), "avx512-vnni" (vpdpbusd; AVX512-VNNI, unless JACOBI_EXT_CPU_VNNI=0),
// "avx2" (maddubs) or "scalar". The same bits on every tile.
JACOBI_DECLARE_CPU_KERNEL(const char* linear_gguf_int8_tile())
