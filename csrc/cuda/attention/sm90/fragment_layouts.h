// Register-fragment views of the sm_90a forward (fwd_sm90.h) and backward (bwd_sm90.h), and the
// backward's MMA and shared-memory layout types, in their own header so that a host program can
// check them with CuTe alone (tests/test_sm90_layouts.py, tests/cpp/sm90_host_check.cpp): they are
// the places where the kernels reinterpret registers or read a shared-memory tile through a
// transposed view, and a wrong view computes garbage without any error.
#pragma once

// clang-format off: cute/tensor.hpp first (the atom headers rely on it)
#include <cute/tensor.hpp>
#include <cute/atom/mma_atom.hpp>
// clang-format on
#include <type_traits>

namespace jacobi::cuda::attn::sm90 {

// The accumulator of a 64xN wgmma, ((2 cols, 2 row halves, N/8), M, N) per thread, seen as
// (rows, cols): ((2, M), (2, N/8, N)). Row r of the view is one query row for every column.
template <class L>
CUTE_HOST_DEVICE auto rowcol(L l) {
  using namespace cute;
  return make_layout(make_layout(get<0, 1>(l), get<1>(l)),
                     make_layout(get<0, 0>(l), get<0, 2>(l), get<2>(l)));
}

// The same registers as the A operand of the next wgmma (its K = the accumulator's N): an A
// fragment of a 64x16 atom holds (2 cols, 2 row halves, 2 col halves of the 16) per thread, which
// is two consecutive n8 groups of the accumulator. ((2, 2, N/8), M, N) -> ((2, 2, 2), M, N/16 * N).
template <class L>
CUTE_HOST_DEVICE auto acc_as_operand_a(L l) {
  using namespace cute;
  auto n8 = logical_divide(get<0, 2>(l), Tile<_2>{});  // ((2, N/16))
  return make_layout(make_layout(get<0, 0>(l), get<0, 1>(l), get<0, 0>(n8)), get<1>(l),
                     coalesce(make_layout(get<0, 1>(n8), get<2>(l))));
}

// The sm_90a backward's GEMMs and shared-memory tiles (bwd_sm90.h). One CTA = one 128-key tile;
// query tiles are walked in 64-row halves (kBlockM) so that S^T, dP^T, dK and dV fit in the
// consumers' registers. Two consumer warpgroups split the keys (64 each) for S^T, dP^T, dK, dV
// and the head dim for dQ.
template <typename Element, int kHeadDim, int kBlockM = 64, int kBlockN = 128, int kStages = 2>
struct BwdLayouts {
  using WgAlongM = cute::Layout<cute::Shape<cute::_2, cute::_1, cute::_1>>;
  using WgAlongN = cute::Layout<cute::Shape<cute::_1, cute::_2, cute::_1>>;
  // S^T = K Q^T and dP^T = V dO^T: (keys, queries, head dim), both operands K-major in smem.
  using TileSdP = cute::Shape<cute::Int<kBlockN>, cute::Int<kBlockM>, cute::Int<kHeadDim>>;
  using MmaSdP = decltype(cute::make_tiled_mma(
      cute::GMMA::ss_op_selector<Element, Element, float, TileSdP>(), WgAlongM{}));
  // dV += P^T dO and dK += dS^T Q: (keys, head dim, queries); A = P^T / dS^T from registers (the
  // S^T / dP^T accumulators, acc_as_operand_a), B = dO / Q read transposed (MN-major views).
  using TileKV = cute::Shape<cute::Int<kBlockN>, cute::Int<kHeadDim>, cute::Int<kBlockM>>;
  using MmaKV = decltype(cute::make_tiled_mma(
      cute::GMMA::rs_op_selector<Element, Element, float, TileKV, cute::GMMA::Major::K,
                                 cute::GMMA::Major::MN>(),
      WgAlongM{}));
  // dQ = dS K: (queries, head dim, keys), A = dS and B = K^T, both MN-major views of smem tiles;
  // each warpgroup takes half of the head dim.
  using TileDq = cute::Shape<cute::Int<kBlockM>, cute::Int<kHeadDim / 2>, cute::Int<kBlockN>>;
  using MmaDq = decltype(cute::make_tiled_mma(
      cute::GMMA::ss_op_selector<Element, Element, float, TileDq, cute::GMMA::Major::MN,
                                 cute::GMMA::Major::MN>(),
      WgAlongN{}));

  // Q and dO (a ring of kStages 64-row tiles) and V: 128-byte swizzled K-major.
  using AtomSW128 = cute::GMMA::Layout_K_SW128_Atom<Element>;
  // K is also read as the MN-major B operand of dQ, half the head dim per warpgroup: that half
  // must be a whole swizzle atom wide, so D = 64 (halves of 32) stores K with the 64-byte swizzle.
  using AtomK = std::conditional_t<(kHeadDim / 2 >= 64), AtomSW128,
                                   cute::GMMA::Layout_K_SW64_Atom<Element>>;
  using SmemK = decltype(cute::tile_to_shape(AtomK{}, cute::Shape<cute::Int<kBlockN>, cute::Int<kHeadDim>>{}));
  using SmemV = decltype(cute::tile_to_shape(AtomSW128{}, cute::Shape<cute::Int<kBlockN>, cute::Int<kHeadDim>>{}));
  using SmemQ = decltype(cute::tile_to_shape(
      AtomSW128{}, cute::Shape<cute::Int<kBlockM>, cute::Int<kHeadDim>, cute::Int<kStages>>{}));
  // dS^T (keys x queries, queries contiguous: the accumulator's column pairs), double-buffered.
  using SmemdSt = decltype(cute::tile_to_shape(
      AtomSW128{}, cute::Shape<cute::Int<kBlockN>, cute::Int<kBlockM>, cute::Int<kStages>>{}));
  // dQ of one query half in fp32, row-major with rows padded by 8 floats (32 bytes): what the
  // consumers write from their dQ accumulators and the dQ writer warp adds to global memory one
  // row per cp.reduce.async.bulk (a row is kHeadDim * 4 bytes, 16-byte aligned). With the pad, the
  // 64-bit stores of a half warp (rows r..r+3, column pairs 0..7) hit 32 distinct banks.
  static constexpr int kDqRowStride = kHeadDim + 8;
  using SmemdQ = cute::Layout<cute::Shape<cute::Int<kBlockM>, cute::Int<kHeadDim>>,
                              cute::Stride<cute::Int<kDqRowStride>, cute::_1>>;
  // Transposed views of the same bytes (no copies): K^T (head dim x keys), Q^T / dO^T (head dim x
  // queries x stage), dS (queries x keys x stage).
  using SmemKt = decltype(cute::composition(
      SmemK{}, cute::make_ordered_layout(cute::Shape<cute::Int<kHeadDim>, cute::Int<kBlockN>>{},
                                         cute::Step<cute::_2, cute::_1>{})));
  using SmemQt = decltype(cute::composition(
      SmemQ{}, cute::make_ordered_layout(
                   cute::Shape<cute::Int<kHeadDim>, cute::Int<kBlockM>, cute::Int<kStages>>{},
                   cute::Step<cute::_2, cute::_1, cute::_3>{})));
  using SmemdS = decltype(cute::composition(
      SmemdSt{}, cute::make_ordered_layout(
                     cute::Shape<cute::Int<kBlockM>, cute::Int<kBlockN>, cute::Int<kStages>>{},
                     cute::Step<cute::_2, cute::_1, cute::_3>{})));
};

}  // namespace jacobi::cuda::attn::sm90
