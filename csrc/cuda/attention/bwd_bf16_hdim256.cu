// Instantiation: backward (dK/dV with atomic or no dQ, deterministic dQ), bf16, head dim 256.
#include "cuda/attention/bwd_kernel.h"

namespace jacobi::cuda::attn {
template cudaError_t run_bwd<cutlass::bfloat16_t, 256>(const BwdParams&, cudaStream_t);
}  // namespace jacobi::cuda::attn
