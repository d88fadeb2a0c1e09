// Declarations of the per-(dtype, head dim) launchers; each is explicitly instantiated in its own
// file (fwd_<dtype>_hdim<D>.cu, bwd_<dtype>_hdim<D>.cu) so that one CuTe TU compiles one config.
#pragma once

#include <cuda_runtime_api.h>

#include "cuda/attention/attention_cuda.h"

namespace jacobi::cuda::attn {

template <typename Element, int kHeadDim>
cudaError_t run_fwd(const FwdParams& p, cudaStream_t stream);

// Needs p.dsum filled (rowsum(dout * out)) and, unless deterministic, p.dq_accum zeroed.
template <typename Element, int kHeadDim>
cudaError_t run_bwd(const BwdParams& p, cudaStream_t stream);

}  // namespace jacobi::cuda::attn
