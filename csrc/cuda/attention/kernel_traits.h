// Compile-time configuration of the attention kernels (FlashAttention-2's "kernel traits"
// convention): tile sizes, warp layout of the tiled MMA, swizzled shared-memory layouts and the
// copy atoms, in one place per kernel family.
//
// SM80 building blocks only (mma.sync 16x8x16, ldmatrix, cp.async): they run unchanged on Hopper,
// so the same kernels are compiled for sm_80 and sm_90a. No WGMMA/TMA path: it could not be made
// correct without a GPU to test on.
#pragma once

#include <cute/tensor.hpp>
#include <cutlass/numeric_types.h>

#include <type_traits>

#include "cuda/attention/utils.h"
#include "jacobi/attention_plan.h"

namespace jacobi::cuda::attn {

using namespace cute;

template <typename Element_, int kHeadDim_>
struct BaseTraits {
  using Element = Element_;
  using ElementAccum = float;
  static_assert(std::is_same_v<Element, cutlass::half_t> ||
                std::is_same_v<Element, cutlass::bfloat16_t>);
  using MmaAtom = std::conditional_t<std::is_same_v<Element, cutlass::half_t>,
                                     MMA_Atom<SM80_16x8x16_F32F16F16F32_TN>,
                                     MMA_Atom<SM80_16x8x16_F32BF16BF16F32_TN>>;
  using SmemCopyAtom = Copy_Atom<SM75_U32x4_LDSM_N, Element>;            // ldmatrix
  using SmemCopyAtomTransposed = Copy_Atom<SM75_U16x8_LDSM_T, Element>;  // ldmatrix.trans
  using SmemCopyAtomStore = Copy_Atom<AutoVectorizingCopyWithAssumedAlignment<128>, Element>;

  static constexpr int kHeadDim = kHeadDim_;
  static_assert(kHeadDim % 32 == 0 && kHeadDim <= 256, "head dim: a multiple of 32, at most 256");
  // Rows of kPage elements (64: 128 bytes, or 32 for head dim 96) swizzled in 16-byte chunks:
  // conflict-free ldmatrix and cp.async stores. Wider head dims are tiled as pages.
  static constexpr int kPage = smem_page_cols(kHeadDim);
  using SmemLayoutAtom =
      decltype(composition(Swizzle<kPage == 64 ? 3 : 2, 3, 3>{},
                           Layout<Shape<_8, Int<kPage>>, Stride<Int<kPage>, _1>>{}));
  // 64-column atom for the [64 x 64] P / dS tiles of the backward, whatever the head dim.
  using SmemLayoutAtom64 = decltype(composition(Swizzle<3, 3, 3>{},
                                                Layout<Shape<_8, _64>, Stride<_64, _1>>{}));
  template <int kRows>
  using SmemLayoutRows = decltype(tile_to_shape(SmemLayoutAtom{},
                                                Shape<Int<kRows>, Int<kHeadDim>>{}));
  // The same rows seen as [kHeadDim, kRows]: operand of a GEMM that contracts over the rows.
  template <int kRows>
  using SmemLayoutRowsT = decltype(composition(
      SmemLayoutRows<kRows>{}, make_layout(Shape<Int<kHeadDim>, Int<kRows>>{}, GenRowMajor{})));
  template <int kRows>
  using SmemLayoutRowsTNoSwizzle = decltype(get_nonswizzle_portion(SmemLayoutRowsT<kRows>{}));
};

// Forward: one CTA per (kBlockM query rows, batch * query head); warps split the rows, each warp
// owns 16-row slices, so softmax row statistics never leave a warp (quad shuffles only).
template <typename Element_, int kHeadDim_, int kBlockM_, int kNWarps_>
struct FwdTraits : BaseTraits<Element_, kHeadDim_> {
  using Base = BaseTraits<Element_, kHeadDim_>;
  using Element = typename Base::Element;
  static constexpr int kHeadDim = kHeadDim_;
  static constexpr int kBlockM = kBlockM_;
  static constexpr int kBlockN = jacobi::attn::kPlanTile;
  static constexpr int kNWarps = kNWarps_;
  static constexpr int kNThreads = kNWarps * 32;
  static_assert(kBlockM % jacobi::attn::kPlanTile == 0);
  static_assert(kBlockM % (16 * kNWarps) == 0);

  using TiledMma = TiledMMA<typename Base::MmaAtom, Layout<Shape<Int<kNWarps>, _1, _1>>,
                            Tile<Int<16 * kNWarps>, _16, _16>>;
  using SmemLayoutQ = typename Base::template SmemLayoutRows<kBlockM>;
  using SmemLayoutKV = typename Base::template SmemLayoutRows<kBlockN>;
  using SmemLayoutVt = typename Base::template SmemLayoutRowsT<kBlockN>;
  using SmemLayoutVtNoSwizzle = typename Base::template SmemLayoutRowsTNoSwizzle<kBlockN>;

  // sQ (reused for O), sK, sV, one 64-bit mask word per row for partial tiles.
  static constexpr int kSmemSize =
      int(size(SmemLayoutQ{}) + 2 * size(SmemLayoutKV{})) * int(sizeof(Element)) + kBlockM * 8;
};

// Backward, dK/dV pass: one CTA per (kBlockN key rows, batch * kv head); it loops over the query
// heads of its GQA group and over the query tiles that see its keys, so dK/dV accumulate in
// registers with no atomics and K/V are never repeated. 8 warps as 4 (rows) x 2 (columns) for all
// five GEMMs of the step: S = Q K^T, dP = dO V^T, dV += P^T dO, dK += dS^T Q, dQ_part = dS K.
template <typename Element_, int kHeadDim_>
struct BwdDkdvTraits : BaseTraits<Element_, kHeadDim_> {
  using Base = BaseTraits<Element_, kHeadDim_>;
  using Element = typename Base::Element;
  static constexpr int kHeadDim = kHeadDim_;
  static constexpr int kBlockM = jacobi::attn::kPlanTile;  // query rows per step
  static constexpr int kBlockN = jacobi::attn::kPlanTile;  // key rows per CTA
  static constexpr int kNWarps = 8;
  static constexpr int kNThreads = kNWarps * 32;

  using TiledMma = TiledMMA<typename Base::MmaAtom, Layout<Shape<_4, _2, _1>>, Tile<_64, _32, _16>>;
  using SmemLayoutQ = typename Base::template SmemLayoutRows<kBlockM>;  // also dO
  using SmemLayoutQt = typename Base::template SmemLayoutRowsT<kBlockM>;
  using SmemLayoutQtNoSwizzle = typename Base::template SmemLayoutRowsTNoSwizzle<kBlockM>;
  using SmemLayoutKV = typename Base::template SmemLayoutRows<kBlockN>;
  using SmemLayoutKt = typename Base::template SmemLayoutRowsT<kBlockN>;
  using SmemLayoutKtNoSwizzle = typename Base::template SmemLayoutRowsTNoSwizzle<kBlockN>;
  // P and dS tiles [kBlockM query rows, kBlockN key rows], and their transposes.
  using SmemLayoutPdS = decltype(tile_to_shape(typename Base::SmemLayoutAtom64{},
                                               Shape<Int<kBlockM>, Int<kBlockN>>{}));
  using SmemLayoutPdSt = decltype(composition(
      SmemLayoutPdS{}, make_layout(Shape<Int<kBlockN>, Int<kBlockM>>{}, GenRowMajor{})));
  using SmemLayoutPdStNoSwizzle = decltype(get_nonswizzle_portion(SmemLayoutPdSt{}));

  // Column chunk of the atomic dQ partial (dS K): the whole head dim up to 128; at d=256, where
  // dK and dV alone hold 128 floats per thread, 64-wide chunks (ptxas spilled 12 B with 128).
  static constexpr int kDqCols = kHeadDim <= 128 ? kHeadDim : 64;
  static_assert(kHeadDim % kDqCols == 0);

  static constexpr int kSmemRows = int(size(SmemLayoutQ{})) * int(sizeof(Element));
  static constexpr int kSmemPdS = int(size(SmemLayoutPdS{})) * int(sizeof(Element));
  // sQ, sdO, sK, sV, sP, sdS, then lse and row sums of the query tile, then mask words.
  static constexpr int kSmemSize =
      4 * kSmemRows + 2 * kSmemPdS + 2 * kBlockM * int(sizeof(float)) + kBlockM * 8;
};

// Backward, deterministic dQ pass: one CTA per (kBlockM query rows, batch * query head).
// Up to d=128 it has the forward's structure (4 warps split the rows) with dS kept in registers
// as the A operand of dS K. At d=256 that puts a 128-float dQ accumulator per thread next to the
// S and dP tiles (ptxas: 160 B of spills), so 8 warps split the tile 4 (rows) x 2 (columns), as
// in the dK/dV kernel, and dS goes through shared memory.
template <typename Element_, int kHeadDim_>
struct BwdDqTraits : BaseTraits<Element_, kHeadDim_> {
  using Base = BaseTraits<Element_, kHeadDim_>;
  using Element = typename Base::Element;
  static constexpr int kHeadDim = kHeadDim_;
  static constexpr int kBlockM = jacobi::attn::kPlanTile;
  static constexpr int kBlockN = jacobi::attn::kPlanTile;
  static constexpr bool kDsInSmem = kHeadDim > 128;
  static constexpr int kNWarps = kDsInSmem ? 8 : 4;
  static constexpr int kNThreads = kNWarps * 32;

  using TiledMma = std::conditional_t<
      kDsInSmem,
      TiledMMA<typename Base::MmaAtom, Layout<Shape<_4, _2, _1>>, Tile<_64, _32, _16>>,
      TiledMMA<typename Base::MmaAtom, Layout<Shape<Int<kNWarps>, _1, _1>>,
               Tile<Int<16 * kNWarps>, _16, _16>>>;
  using SmemLayoutQ = typename Base::template SmemLayoutRows<kBlockM>;
  using SmemLayoutKV = typename Base::template SmemLayoutRows<kBlockN>;
  using SmemLayoutKt = typename Base::template SmemLayoutRowsT<kBlockN>;
  using SmemLayoutKtNoSwizzle = typename Base::template SmemLayoutRowsTNoSwizzle<kBlockN>;
  using SmemLayoutPdS = decltype(tile_to_shape(typename Base::SmemLayoutAtom64{},
                                               Shape<Int<kBlockM>, Int<kBlockN>>{}));

  // sQ, sdO, sK, sV, [sdS], mask words.
  static constexpr int kSmemDs = kDsInSmem ? int(size(SmemLayoutPdS{})) * int(sizeof(Element)) : 0;
  static constexpr int kSmemSize =
      4 * int(size(SmemLayoutQ{})) * int(sizeof(Element)) + kSmemDs + kBlockM * 8;
};

}  // namespace jacobi::cuda::attn
