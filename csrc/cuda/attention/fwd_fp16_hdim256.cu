// Instantiation: forward, fp16, head dim 256.
#include "cuda/attention/fwd_kernel.h"

namespace jacobi::cuda::attn {
template cudaError_t run_fwd<cutlass::half_t, 256>(const FwdParams&, cudaStream_t);
}  // namespace jacobi::cuda::attn
