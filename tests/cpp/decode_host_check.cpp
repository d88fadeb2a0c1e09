// Host restatement of the CUDA decode attention's walk (csrc/cuda/decode_cuda.cu), from the same
// header functions (jacobi/decode_step.h: step_committed, step_key_slot, step_sees_*,
// step_live_splits, split_weight; jacobi/online_softmax.h): the committed range clamped as the
// kernel clamps it, keys in the kernel's order, in splits of `split_keys` and chunks of 32, each
// chunk's online-softmax update, then the splits that hold keys merged. The caches are read
// through .at(): a read outside them (another head's rows, past the allocation) throws. Run by
// tests/test_decode_host_check.py against a float64 reference, so that the order, the plan's
// rule and the merge are checked on a CPU before a GPU runs the kernel.
//
// stdin: B Hq Hkv D Q capacity split_keys scale, then q [B, Q, Hq, D], k and v [B, Hkv,
// capacity, D] (the step's keys already in scratch slots [0, Q)), seg and off [B, Q], lo and hi
// [B]. stdout: out [B, Q, Hq, D], one value a line.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <iostream>
#include <stdexcept>
#include <vector>

#include "jacobi/decode_step.h"
#include "jacobi/online_softmax.h"

namespace dm = jacobi::decode;
namespace attn = jacobi::attn;

int main() {
  int64_t B, Hq, Hkv, D, Q, cap, split_keys;
  float scale;
  std::cin >> B >> Hq >> Hkv >> D >> Q >> cap >> split_keys >> scale;
  auto read = [](int64_t n, auto& v) {
    v.resize(static_cast<size_t>(n));
    for (auto& x : v) std::cin >> x;
  };
  std::vector<float> q, k, v;
  std::vector<int64_t> seg, off, lo, hi;
  read(B * Q * Hq * D, q);
  read(B * Hkv * cap * D, k);
  read(B * Hkv * cap * D, v);
  read(B * Q, seg);
  read(B * Q, off);
  read(B, lo);
  read(B, hi);
  constexpr int64_t kKeys = 32;
  const int64_t G = Hq / Hkv, splits = (cap + Q + split_keys - 1) / split_keys;
  const float to_log2 = scale * attn::kLog2e;
  for (int64_t b = 0; b < B; ++b)
    for (int64_t i = 0; i < Q; ++i)
      for (int64_t h = 0; h < Hq; ++h) {
        const float* qr = &q[static_cast<size_t>(((b * Q + i) * Hq + h) * D)];
        const int64_t head = (b * Hkv + h / G) * cap;
        const dm::StepRange range = dm::step_committed(lo[b], hi[b], Q, cap);
        const int64_t L = range.lo, H = range.hi;
        const int64_t n = dm::step_keys(L, H, Q);
        const int64_t live = std::min(splits, dm::step_live_splits(n, split_keys));
        // A cache element of this sequence and kv head: its own rows only.
        auto at = [&](const std::vector<float>& c, int64_t slot, int64_t d) {
          if (slot < 0 || slot >= cap) throw std::out_of_range("slot outside the cache");
          return c.at(static_cast<size_t>((head + slot) * D + d));
        };
        std::vector<float> maxes, sums, accs;
        for (int64_t s = 0; s < live; ++s) {
          attn::SoftmaxRow row = attn::softmax_init();
          std::vector<float> acc(static_cast<size_t>(D), 0.f);
          const int64_t k1 = std::min(n, (s + 1) * split_keys);
          for (int64_t c0 = s * split_keys; c0 < k1; c0 += kKeys) {
            float x[kKeys];
            float tile_max = -INFINITY;
            for (int64_t j = 0; j < kKeys; ++j) {
              const int64_t t = c0 + j;
              bool visible = false;
              if (t < k1) {
                const int64_t slot = dm::step_key_slot(t, L, H);
                visible = t < H - L
                              ? dm::step_sees_committed(seg[b * Q + i], slot, L, H)
                              : dm::step_sees_scratch(seg[b * Q + i], off[b * Q + i],
                                                      seg[b * Q + slot], off[b * Q + slot],
                                                      slot == i);
                if (visible) {
                  float dot = 0.f;
                  for (int64_t d = 0; d < D; ++d) dot += qr[d] * at(k, slot, d);
                  x[j] = dot;
                }
              }
              if (!visible) x[j] = -INFINITY;
              tile_max = std::fmax(tile_max, x[j]);
            }
            const float corr = attn::softmax_rescale(row, tile_max, to_log2);
            const float base = attn::softmax_exp_base(row) * to_log2;
            float sum = 0.f;
            for (float& d : acc) d *= corr;
            for (int64_t j = 0; j < kKeys; ++j) {
              const float p = std::exp2(x[j] * to_log2 - base);
              sum += p;
              if (p == 0.f) continue;
              const int64_t slot = dm::step_key_slot(c0 + j, L, H);
              for (int64_t d = 0; d < D; ++d) acc[d] += p * at(v, slot, d);
            }
            attn::softmax_add(row, corr, sum);
          }
          maxes.push_back(row.max);
          sums.push_back(row.sum);
          accs.insert(accs.end(), acc.begin(), acc.end());
        }
        float all_max = -INFINITY;
        for (float m : maxes) all_max = std::fmax(all_max, m);
        for (int64_t d = 0; d < D; ++d) {
          float num = 0.f, den = 0.f;
          for (int64_t s = 0; s < live; ++s) {
            const float w = dm::split_weight(maxes[s], all_max, to_log2);
            den += w * sums[s];
            num += w * accs[s * D + d];
          }
          std::printf("%.9g\n", den > 0.f ? num / den : 0.f);
        }
      }
  return 0;
}
