// Instantiation: backward (dK/dV with atomic or no dQ, deterministic dQ), fp16, head dim 96.
#include "cuda/attention/bwd_kernel.h"

namespace jacobi::cuda::attn {
template cudaError_t run_bwd<cutlass::half_t, 96>(const BwdParams&, cudaStream_t);
}  // namespace jacobi::cuda::attn
