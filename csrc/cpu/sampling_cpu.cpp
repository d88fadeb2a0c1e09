// The filtered perturbed argmax on the CPU, one row (one step position) at a time.
//
// The thresholds of jacobi/sampling.h found the cheap way for a CPU: top-k with a k-element
// min-heap in one pass (most tokens cost one compare), top-p by sorting only the head of the
// law (a partial sort of 64 tokens, widened 4x while the head has not reached p), min-p and the
// noise per kept token only. With transformers' default top_k=50, a row costs about two passes
// over the vocabulary and ~50 noise draws.
#include "cpu/sampling_cpu.h"

#include "jacobi/decode_step.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <functional>
#include <limits>
#include <utility>
#include <vector>

namespace jacobi::cpu {
namespace {

constexpr double kNegInf = -std::numeric_limits<double>::infinity();

struct Scratch {
  std::vector<double> x;                     // scaled logits of the row
  std::vector<double> heap;                  // top-k min-heap
  std::vector<std::pair<double, int64_t>> c;  // top-p candidates
};

// t_k: the k-th largest x, counted with multiplicity (-inf when top-k is off or keeps all).
double top_k_threshold(const std::vector<double>& x, int64_t k, std::vector<double>& heap) {
  const int64_t V = static_cast<int64_t>(x.size());
  if (k <= 0 || k >= V) return kNegInf;
  heap.assign(x.begin(), x.begin() + k);
  std::make_heap(heap.begin(), heap.end(), std::greater<double>());
  for (int64_t v = k; v < V; ++v) {
    if (x[v] > heap.front()) {  // strictly: an equal value leaves the k-th value as it is
      std::pop_heap(heap.begin(), heap.end(), std::greater<double>());
      heap.back() = x[v];
      std::push_heap(heap.begin(), heap.end(), std::greater<double>());
    }
  }
  return heap.front();
}

// t_p = max{t : sum_{x_u >= t, x_u >= t_k} e_u >= top_p * Z}: the value at which the descending
// cumulative mass of the top-k set first reaches top_p of its total.
double top_p_threshold(const std::vector<double>& x, double x_max, double t_k, double top_p,
                       std::vector<std::pair<double, int64_t>>& c) {
  c.clear();
  double Z = 0.0;
  for (int64_t v = 0; v < static_cast<int64_t>(x.size()); ++v) {
    if (x[v] >= t_k) {
      c.emplace_back(x[v], v);
      Z += std::exp(x[v] - x_max);
    }
  }
  const size_t n = c.size();
  if (n == 0) return kNegInf;
  const double target = top_p * Z;
  auto desc = [](const std::pair<double, int64_t>& a, const std::pair<double, int64_t>& b) {
    return a.first > b.first || (a.first == b.first && a.second < b.second);
  };
  for (size_t m = std::min<size_t>(64, n);; m = std::min(n, 4 * m)) {
    std::partial_sort(c.begin(), c.begin() + m, c.end(), desc);
    double acc = 0.0;
    for (size_t i = 0; i < m; ++i) {
      acc += std::exp(c[i].first - x_max);
      if (acc >= target) return c[i].first;
    }
    if (m == n) return c[n - 1].first;  // rounding left the total just short of p*Z: keep all
  }
}

template <typename T>
int64_t sample_row(const T* row, int64_t V, const SamplingParams& p, uint64_t seed,
                   uint64_t stream, int64_t pos, Scratch& s) {
  s.x.resize(V);
  double x_max = kNegInf;
  for (int64_t v = 0; v < V; ++v) {
    s.x[v] = scaled_logit(static_cast<double>(row[v]), p.temperature);
    x_max = std::max(x_max, s.x[v]);
  }
  const double t_k = top_k_threshold(s.x, p.top_k, s.heap);
  const double t_p = p.top_p < 1.0 ? top_p_threshold(s.x, x_max, t_k, p.top_p, s.c) : kNegInf;
  double best_s = kNegInf;
  int64_t best_v = -1;
  for (int64_t v = 0; v < V; ++v) {
    if (!sampling_keep(s.x[v], x_max, t_k, t_p, p.min_p)) continue;
    const double score = s.x[v] + gumbel_noise(seed, stream, pos, v);
    if (best_v < 0 || sampling_better(score, v, best_s, best_v)) {
      best_s = score;
      best_v = v;
    }
  }
  return best_v < 0 ? 0 : best_v;  // nothing kept only for a row of NaN
}

}  // namespace

template <typename T>
void gumbel_argmax(const T* logits, int64_t rows, int64_t vocab, int64_t row_per_key,
                   const int64_t* keys, const int64_t* positions, const SamplingParams& p,
                   int64_t* out) {
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    Scratch s;
    for (int64_t r = begin; r < end; ++r) {
      const int64_t* key = keys + 2 * (r / row_per_key);
      out[r] = sample_row(logits + r * vocab, vocab, p, static_cast<uint64_t>(key[0]),
                          static_cast<uint64_t>(key[1]), positions[r], s);
    }
  });
}

void debug_noise(int64_t rows, int64_t vocab, int64_t row_per_key, const int64_t* keys,
                 const int64_t* positions, bool uniform, double* out) {
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t* key = keys + 2 * (r / row_per_key);
    const uint64_t seed = static_cast<uint64_t>(key[0]), stream = static_cast<uint64_t>(key[1]);
    for (int64_t v = 0; v < vocab; ++v) {
      out[r * vocab + v] = uniform ? noise_uniform(noise_bits(seed, stream, positions[r], v))
                                   : gumbel_noise(seed, stream, positions[r], v);
    }
  }
}

namespace {
// One chunk's pick: {first NaN or -1, first maximum} of x[begin, end) (begin < end).
template <typename T>
std::pair<int64_t, int64_t> chunk_pick(const T* x, int64_t begin, int64_t end) {
  int64_t best = begin;
  T top = x[begin];
  if (top != top) return {begin, begin};
  for (int64_t i = begin + 1; i < end; ++i) {
    const T v = x[i];
    if (v != v) return {i, i};
    if (v > top) {
      top = v;
      best = i;
    }
  }
  return {-1, best};
}
}  // namespace

template <typename T>
void argmax_rows(const T* x, int64_t rows, int64_t vocab, int64_t* out) {
  constexpr int64_t kChunk = 4096;  // ~16 KB of fp32: big enough that a chunk outweighs a call
  const int64_t chunks = (vocab + kChunk - 1) / kChunk;
  std::vector<std::pair<int64_t, int64_t>> picks(static_cast<size_t>(rows * chunks));
  at::parallel_for(0, rows * chunks, 1, [&](int64_t begin, int64_t end) {
    for (int64_t u = begin; u < end; ++u) {
      const int64_t r = u / chunks, c = u % chunks;
      const T* row = x + r * vocab;
      picks[u] = chunk_pick(row, c * kChunk, std::min(vocab, (c + 1) * kChunk));
    }
  });
  for (int64_t r = 0; r < rows; ++r) {
    const T* row = x + r * vocab;
    int64_t best = -1;
    for (int64_t c = 0; c < chunks; ++c) {  // (jacobi/decode_step.h: the CUDA kernel's order)
      const auto [nan, top] = picks[r * chunks + c];
      const int64_t pick = nan >= 0 ? nan : top;
      if (best < 0 || decode::greedy_better(row[pick], pick, row[best], best)) best = pick;
    }
    out[r] = best;
  }
}

template void argmax_rows<double>(const double*, int64_t, int64_t, int64_t*);

template void gumbel_argmax<float>(const float*, int64_t, int64_t, int64_t, const int64_t*,
                                   const int64_t*, const SamplingParams&, int64_t*);
template void gumbel_argmax<double>(const double*, int64_t, int64_t, int64_t, const int64_t*,
                                    const int64_t*, const SamplingParams&, int64_t*);

}  // namespace jacobi::cpu
