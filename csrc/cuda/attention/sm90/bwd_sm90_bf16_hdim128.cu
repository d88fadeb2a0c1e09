// Instantiation: sm_90a backward, bf16, head dim 128 (one CuTe TU per config; sm_90a only).
#include "cuda/attention/sm90/bwd_sm90.h"

namespace jacobi::cuda::attn::sm90 {
template cudaError_t run_bwd_sm90<cutlass::bfloat16_t, 128>(const BwdParams&, cudaStream_t);
}  // namespace jacobi::cuda::attn::sm90
