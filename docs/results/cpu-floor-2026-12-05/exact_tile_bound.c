// The exact GGUF tile's arithmetic limit on this CPU (2026-12-05), a micro-benchmark, not the
// product: one core's 512-bit FMA rate, and the exact Q4_1 one-row tile's inner loop (the
// product's codes_tile at P = 2, one group's codes in L1, so memory never waits) in cycles per
// 16 bytes of codes: widened, split into nibbles, converted, dequantized (fma(d, q, m)) and
// multiplied into the chains (fma(x, w, acc)), as the product does; and the same with the
// conversion by the 2^23 trick instead of vcvtdq2ps.
//   gcc -O2 -march=native -ffp-contract=off exact_tile_bound.c -o bound && ./bound
#include <immintrin.h>
#include <stdint.h>
#include <stdio.h>
#include <time.h>

static double now(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return t.tv_sec + t.tv_nsec * 1e-9;
}

static uint8_t codes[2][16 * 32] __attribute__((aligned(64)));
static float xg[32] __attribute__((aligned(64)));

__attribute__((noinline)) static void tile_cvt(long iters, __m512* acc) {
  const __m512 s = _mm512_set1_ps(0.01f), o = _mm512_set1_ps(-0.1f);
  for (long it = 0; it < iters; it++)
    for (int i = 0; i < 16; i++)
      for (int p = 0; p < 2; p++)
        for (int h = 0; h < 2; h++) {
          __m512i b = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)(codes[p] + i * 32 + h * 16)));
          __m512 w0 = _mm512_fmadd_ps(s, _mm512_cvtepi32_ps(_mm512_and_si512(b, _mm512_set1_epi32(15))), o);
          __m512 w1 = _mm512_fmadd_ps(s, _mm512_cvtepi32_ps(_mm512_srli_epi32(b, 4)), o);
          acc[p * 2 + h] = _mm512_fmadd_ps(_mm512_set1_ps(xg[2 * i]), w0, acc[p * 2 + h]);
          acc[p * 2 + h] = _mm512_fmadd_ps(_mm512_set1_ps(xg[2 * i + 1]), w1, acc[p * 2 + h]);
        }
}

__attribute__((noinline)) static void tile_magic(long iters, __m512* acc) {
  const __m512 s = _mm512_set1_ps(0.01f), o = _mm512_set1_ps(-0.1f);
  const __m512i mg = _mm512_set1_epi32(0x4B000000);
  const __m512 mf = _mm512_set1_ps(8388608.f);
  for (long it = 0; it < iters; it++)
    for (int i = 0; i < 16; i++)
      for (int p = 0; p < 2; p++)
        for (int h = 0; h < 2; h++) {
          __m512i b = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)(codes[p] + i * 32 + h * 16)));
          __m512i lo = _mm512_ternarylogic_epi32(b, _mm512_set1_epi32(15), mg, 0xEA);
          __m512i hi = _mm512_or_si512(_mm512_srli_epi32(b, 4), mg);
          __m512 w0 = _mm512_fmadd_ps(s, _mm512_sub_ps(_mm512_castsi512_ps(lo), mf), o);
          __m512 w1 = _mm512_fmadd_ps(s, _mm512_sub_ps(_mm512_castsi512_ps(hi), mf), o);
          acc[p * 2 + h] = _mm512_fmadd_ps(_mm512_set1_ps(xg[2 * i]), w0, acc[p * 2 + h]);
          acc[p * 2 + h] = _mm512_fmadd_ps(_mm512_set1_ps(xg[2 * i + 1]), w1, acc[p * 2 + h]);
        }
}

int main(void) {
  for (int i = 0; i < 2 * 16 * 32; i++) ((uint8_t*)codes)[i] = (uint8_t)(i * 37);
  for (int i = 0; i < 32; i++) xg[i] = 0.001f * i;
  // clock: a chain of dependent adds, one a cycle
  long x = 1, n = 1000000000;
  double t0 = now();
  for (long i = 0; i < n; i++) __asm__ volatile("add $1, %0" : "+r"(x));
  const double ghz = n / (now() - t0) / 1e9;
  // 12 independent 512-bit FMA chains
  __m512 a[12];
  for (int i = 0; i < 12; i++) a[i] = _mm512_set1_ps(1.0f + i * 1e-3f);
  const __m512 b = _mm512_set1_ps(0.999999f), c = _mm512_set1_ps(1e-7f);
  long m = 100000000;
  t0 = now();
  for (long i = 0; i < m; i++) {
#pragma GCC unroll 12
    for (int j = 0; j < 12; j++) a[j] = _mm512_fmadd_ps(a[j], b, c);
  }
  const double fma = m * 12 / (now() - t0) / 1e9;
  float sink = 0;
  for (int i = 0; i < 12; i++) sink += _mm512_reduce_add_ps(a[i]);
  printf("clock %.2f GHz; 512-bit FMA %.2f G/s a core (%.2f a cycle)\n", ghz, fma, fma / ghz);
  __m512 acc[4];
  for (int i = 0; i < 4; i++) acc[i] = _mm512_setzero_ps();
  const long iters = 2000000;
  const double bytes = iters * 2.0 * 16 * 32;
  t0 = now();
  tile_cvt(iters, acc);
  double t = now() - t0;
  printf("exact Q4_1 tile (vcvtdq2ps): %.2f GB/s a core, %.2f cycles / 16 B\n", bytes / t / 1e9,
         t * ghz * 1e9 / (bytes / 16));
  t0 = now();
  tile_magic(iters, acc);
  t = now() - t0;
  printf("exact Q4_1 tile (2^23 trick): %.2f GB/s a core, %.2f cycles / 16 B\n", bytes / t / 1e9,
         t * ghz * 1e9 / (bytes / 16));
  for (int i = 0; i < 4; i++) sink += _mm512_reduce_add_ps(acc[i]);
  printf("(%g)\n", sink);
  return 0;
}
