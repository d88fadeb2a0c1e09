// Picks the CPU kernel variant once per process (see csrc/cpu/isa.h).
#include "cpu/isa.h"

#include <cstdlib>
#include <cstring>
#include <stdexcept>
#include <string>

namespace jacobi::cpu {
namespace {

Isa best_supported() {
#if defined(__x86_64__) || defined(_M_X64)
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
      __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq") &&
      __builtin_cpu_supports("fma")) {
    return Isa::avx512;
  }
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) return Isa::avx2;
#endif
  return Isa::baseline;
}

Isa choose() {
  Isa best = best_supported();
  const char* env = std::getenv("JACOBI_EXT_CPU_ISA");
  if (env == nullptr || *env == '\0') return best;
  Isa want;
  if (std::strcmp(env, "baseline") == 0) {
    want = Isa::baseline;
  } else if (std::strcmp(env, "avx2") == 0) {
    want = Isa::avx2;
  } else if (std::strcmp(env, "avx512") == 0) {
    want = Isa::avx512;
  } else {
    throw std::invalid_argument(std::string("JACOBI_EXT_CPU_ISA='") + env +
                                "' is not one of baseline, avx2, avx512");
  }
  // Never run instructions the CPU lacks: a request above what it supports is capped.
  return static_cast<int>(want) < static_cast<int>(best) ? want : best;
}

}  // namespace

Isa active_isa() {
  static const Isa isa = choose();
  return isa;
}

const char* isa_name(Isa isa) {
  switch (isa) {
    case Isa::avx512:
      return "avx512";
    case Isa::avx2:
      return "avx2";
    default:
      return "baseline";
  }
}

}  // namespace jacobi::cpu
