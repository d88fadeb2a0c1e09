// Register-fragment views of the sm_90a forward (fwd_sm90.h), in their own header so that a host
// program can check them with CuTe alone (tests/test_sm90_layouts.py, tests/cpp/sm90_host_check.cpp):
// they are the two places where the kernel reinterprets registers, and a wrong view computes
// garbage without any error.
#pragma once

#include <cute/tensor.hpp>

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

}  // namespace jacobi::cuda::attn::sm90
