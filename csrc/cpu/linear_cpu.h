// Decode-shaped linear on the CPU, y[M, N] = x[M, K] W[N, K]^T (+ bias): torch-free interface.
//
// Why a kernel of our own: a decoding step multiplies a handful of rows (M = 1 .. 64) by every
// weight of the model, so it is bound by reading the weights once. MKL's small-M fp32 path
// streams them at about a third of the machine's read bandwidth (ENVIRONMENT.md), and oneDNN
// reorders a plain bf16 weight on every call. Here the weights are repacked once, into panels
// that a thread reads front to back exactly once per call, while the M rows of x stay in L1 and
// the outputs of a tile stay in registers (an outer-product register tile, as in llamafile's
// tinyBLAS).
//
// Packed layout ("panels"): W's N rows are cut into panels of NR = panel_width() consecutive
// output features (the last one zero-padded). Panel p is a contiguous [K, NR] slice holding
// W[p * NR + j, k] at [k, j]; bf16 weights on a CPU with AVX512-BF16 use pairs instead,
// [ceil(K / 2), NR, 2] holding W[p * NR + j, 2i + h] at [i, j, h] (K padded with a zero), which is
// what vdpbf16ps multiplies. pack_format() names the layout in use.
//
// Every output is one fp32 chain over k = 0 .. K-1 in order (a fused multiply-add per k, or per
// pair of k with vdpbf16ps), whatever M is and wherever the row falls in a tile: a row's result
// never depends on the other rows of the call. So a token's logits are bitwise the same whether
// a step feeds 1 or 64 tokens, which is what lets every decoding method equal AR token for token.
#pragma once

#include <cstdint>

#include "cpu/isa.h"

namespace jacobi::cpu {

enum class LinearDType : int32_t { f32 = 0, bf16 = 1 };

// The packed layout the running CPU's kernels use for a weight dtype.
enum class PackFormat : int32_t {
  f32_panels = 0,   // fp32 [K, NR] panels
  bf16_panels = 1,  // bf16 [K, NR] panels, widened to fp32 per k (no AVX512-BF16)
  bf16_pairs = 2,   // bf16 [ceil(K/2), NR, 2] panels for vdpbf16ps (AVX512-BF16)
};

struct LinearArgs {
  LinearDType dtype;  // of x, the packed weight, the output (bias is fp32 or this dtype)
  int64_t M, N, K;
  const void* x;  // [M, K], rows ldx elements apart, k contiguous
  int64_t ldx;
  const void* packed;          // pack()'s layout for (N, K)
  const void* bias;            // [N] or nullptr
  bool bias_f32;               // bias is fp32 (else the dtype)
  void* y;                     // [M, N], rows ldy elements apart
  int64_t ldy;
};

}  // namespace jacobi::cpu

// NR: output features per panel on this ISA (32 for AVX-512, 16 for AVX2 and the baseline).
JACOBI_DECLARE_CPU_KERNEL(int linear_panel_width())
// The layout pack() writes for a weight dtype on this CPU.
JACOBI_DECLARE_CPU_KERNEL(::jacobi::cpu::PackFormat linear_pack_format(::jacobi::cpu::LinearDType d))
// The weight W[N, K] given as its N rows (rows[n]: K contiguous elements; the rows of several
// weights side by side pack their concatenation without materialising it) -> packed:
// [ceil(N / NR), k_rows, NR] elements, k_rows = K (panels) or K rounded up to even (pairs).
JACOBI_DECLARE_CPU_KERNEL(void linear_pack(::jacobi::cpu::LinearDType d, const void* const* rows,
                                           int64_t N, int64_t K, void* packed))
// y = x W^T (+ bias), threads from torch's pool (at::parallel_for over panels).
JACOBI_DECLARE_CPU_KERNEL(void linear_packed(const ::jacobi::cpu::LinearArgs& args))
