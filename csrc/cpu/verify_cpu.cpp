// The verify step is a few hundred integer compares per sequence: one thread, no vector ISA to
// pick; the sequences of a batch one after the other.
#include "cpu/verify_cpu.h"

namespace jacobi::cpu {

void verify_step(const VerifyShape& shape, const VerifyArgs<int64_t>& args, int batch) {
  for (int b = 0; b < batch; ++b) {
    const VerifyArgs<int64_t> a = verify_args_at(shape, args, b);
    if (!verify_active(a)) {
      verify_inactive(shape, a);
      continue;
    }
    for (int r = 0; r < shape.rows; ++r) verify_accept_row(shape, a, r);
    verify_finish(shape, a);
  }
}

}  // namespace jacobi::cpu
