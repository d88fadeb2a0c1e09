// Instantiation: forward, fp16, head dim 96.
#include "cuda/attention/fwd_kernel.h"

namespace jacobi::cuda::attn {
template cudaError_t run_fwd<cutlass::half_t, 96>(const FwdParams&, cudaStream_t);
}  // namespace jacobi::cuda::attn
