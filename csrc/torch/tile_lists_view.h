// The tensors of jacobi_ext::attention_tile_lists as a jacobi::attn::TileLists (metadata checks;
// the CPU debug op also checks the values it will index with, the CUDA one trusts the host op).
#pragma once

#include <ATen/core/Tensor.h>

#include "checks.h"
#include "jacobi/tile_list.h"

namespace jacobi::ops {

inline jacobi::attn::TileLists tile_lists_view(const at::Tensor& fwd_ptr,
                                               const at::Tensor& fwd_tile,
                                               const at::Tensor& fwd_mask, const at::Tensor& masks,
                                               int64_t seq_len, int64_t tile_m, int64_t tile_n) {
  namespace ck = jacobi::checks;
  namespace ja = jacobi::attn;
  for (auto [t, name] : {std::pair{&fwd_ptr, "fwd_ptr"}, {&fwd_tile, "fwd_tile"},
                         {&fwd_mask, "fwd_mask"}, {&masks, "masks"}}) {
    ck::dtype(*t, name, at::kInt);
    ck::contiguous(*t, name);
    ck::same_device(*t, name, fwd_ptr, "fwd_ptr");
  }
  TORCH_CHECK_VALUE(seq_len >= 0 && seq_len < (int64_t(1) << 30), "bad seq_len ", seq_len);
  const int32_t S = int32_t(seq_len), tm = int32_t(tile_m), tn = int32_t(tile_n);
  const int32_t nq = ja::ceil_div(S, tm), nk = ja::ceil_div(S, tn);
  TORCH_CHECK_VALUE(fwd_ptr.dim() == 1 && fwd_ptr.numel() == nq + 1, "fwd_ptr must have ",
                    nq + 1, " entries (query tiles + 1), got shape ", fwd_ptr.sizes());
  TORCH_CHECK_VALUE(fwd_tile.dim() == 1 && fwd_mask.sizes() == fwd_tile.sizes(),
                    "fwd_tile and fwd_mask must be 1-D of one length, got ", fwd_tile.sizes(),
                    " and ", fwd_mask.sizes());
  TORCH_CHECK_VALUE(masks.dim() == 3 && masks.size(1) == tm && masks.size(2) == ja::mask_words(tn),
                    "masks must be [num_partial, tile_m=", tm, ", tile_n/32=", ja::mask_words(tn),
                    "], got ", masks.sizes());
  if (fwd_ptr.device().is_cpu()) {
    const int32_t* ptr = fwd_ptr.data_ptr<int32_t>();
    TORCH_CHECK_VALUE(ptr[0] == 0 && ptr[nq] == fwd_tile.numel(),
                      "fwd_ptr must run from 0 to len(fwd_tile)");
    for (int32_t i = 0; i < nq; ++i)
      TORCH_CHECK_VALUE(ptr[i + 1] >= ptr[i], "fwd_ptr must be non-decreasing");
    for (int64_t e = 0; e < fwd_tile.numel(); ++e) {
      const int32_t j = fwd_tile.data_ptr<int32_t>()[e], m = fwd_mask.data_ptr<int32_t>()[e];
      TORCH_CHECK_VALUE(j >= 0 && j < nk, "fwd_tile entries must be key tiles in [0, ", nk, ")");
      TORCH_CHECK_VALUE(m >= -1 && m < masks.size(0), "fwd_mask entries must be -1 or in [0, ",
                        masks.size(0), ")");
    }
  }
  return {fwd_ptr.data_ptr<int32_t>(),
          fwd_tile.data_ptr<int32_t>(),
          fwd_mask.data_ptr<int32_t>(),
          nullptr,
          nullptr,
          nullptr,
          reinterpret_cast<const uint32_t*>(masks.data_ptr<int32_t>()),
          nq,
          nk,
          tm,
          tn};
}

}  // namespace jacobi::ops
