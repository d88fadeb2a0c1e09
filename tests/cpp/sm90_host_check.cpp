// Host-side pieces of the sm_90a forward, run without a GPU (tests/test_sm90_layouts.py compiles
// this with g++ and checks its output against Python references):
//   plan      stdin: a block table, seq_len, tile sizes; stdout: the stream order (perm) and the
//             forward tile lists with their masks, from jacobi/attention_plan.h + tile_list.h
//             (the very functions the op's host side runs);
//   softmax   stdin: rows of scores cut into tiles (-inf = masked); stdout: per row the lse and
//             the normalised weights, from jacobi/online_softmax.h walked tile by tile as the
//             kernels do (with partial sums split over 4 "threads", as a quad splits a row);
//   fragments (built with -DJACOBI_WITH_CUTE and the CUTLASS headers) the register views of
//             fwd_sm90.h: for every consumer thread, the accumulator of S = Q K^T reinterpreted
//             as the A operand of O += P V must hold, at each A-fragment slot, the element whose
//             (row, key) coordinate that slot expects; and rowcol() must give one row per view row;
//             the same for the backward's views (bwd_sm90.h: S^T / dP^T as A operands, rowcol of
//             its accumulators, the transposed shared-memory views).
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <iostream>
#include <vector>

#include "jacobi/attention_plan.h"
#include "jacobi/online_softmax.h"
#include "jacobi/tile_list.h"

#ifdef JACOBI_WITH_CUTE
#include <cute/atom/mma_atom.hpp>
#include <cute/tensor.hpp>

#include "cuda/attention/sm90/fragment_layouts.h"
#endif

namespace ja = jacobi::attn;

static int plan_mode() {
  int nb, S, tm, tn;
  std::cin >> nb;
  std::vector<int32_t> bs(nb + 1), kp(nb + 1);
  for (auto& x : bs) std::cin >> x;
  for (auto& x : kp) std::cin >> x;
  std::vector<int32_t> ki(kp[nb] > 0 ? kp[nb] : 1);
  for (int e = 0; e < kp[nb]; ++e) std::cin >> ki[e];
  std::cin >> S >> tm >> tn;
  const jacobi::BlockTable t{bs.data(), kp.data(), ki.data(), nb};
  std::vector<int32_t> order(nb), scratch(2 * nb + 1), pstart(nb + 1);
  ja::plan_block_order(t, order.data(), scratch.data());
  ja::plan_block_starts(t, order.data(), pstart.data());
  const ja::StreamOrder so{order.data(), pstart.data()};
  std::printf("perm");
  for (int p = 0; p < S; ++p) std::printf(" %d", ja::plan_token(t, order.data(), pstart.data(), p).token);
  std::printf("\n");
  const int nq = ja::ceil_div(S, tm), nk = ja::ceil_div(S, tn);
  std::vector<uint8_t> cls(size_t(nq) * nk);
  int32_t partial = 0;
  const int32_t listed = ja::tile_classes(t, so, S, tm, tn, cls.data(), &partial);
  std::vector<int32_t> fp(nq + 1), ft(listed + 1), fm(listed + 1), bp(nk + 1), bt(listed + 1),
      bm(listed + 1);
  ja::tile_lists(cls.data(), nq, nk, fp.data(), ft.data(), fm.data(), bp.data(), bt.data(), bm.data());
  const int wpr = ja::mask_words(tn);
  std::vector<uint32_t> words(size_t(tm) * wpr);
  for (int i = 0; i < nq; ++i) {
    for (int e = fp[i]; e < fp[i + 1]; ++e) {
      std::printf("entry %d %d %d", i, ft[e], fm[e]);
      if (fm[e] >= 0) {
        ja::tile_mask(t, so, S, tm, tn, i, ft[e], words.data());
        for (uint32_t w : words) std::printf(" %u", w);
      }
      std::printf("\n");
    }
  }
  // The deterministic dQ's turns, as the backward kernel reads them: per backward-list entry
  // (key tile j, query tile i), dq_turn over the lists the kernel holds.
  const ja::TileLists lists{fp.data(), ft.data(), fm.data(), bp.data(), bt.data(), bm.data(),
                            nullptr, nq, nk, tm, tn};
  for (int j = 0; j < nk; ++j) {
    for (int e = bp[j]; e < bp[j + 1]; ++e) std::printf("turn %d %d %d\n", bt[e], j, ja::dq_turn(lists, bt[e], j));
  }
  return 0;
}

static int softmax_mode() {
  int rows, n, tile;
  std::cin >> rows >> n >> tile;
  for (int r = 0; r < rows; ++r) {
    std::vector<float> x(n);
    for (auto& v : x) {
      std::string s;
      std::cin >> s;
      v = s == "-inf" ? -INFINITY : std::stof(s);
    }
    const float scale = 0.37f, to_log2 = scale * ja::kLog2e;
    // 4 partial states, one per "thread" of a quad; the max is shared (quad-reduced).
    ja::SoftmaxRow st[4];
    for (auto& s : st) s = ja::softmax_init();
    std::vector<float> p(n, 0.f);
    for (int c0 = 0; c0 < n; c0 += tile) {
      const int c1 = c0 + tile < n ? c0 + tile : n;
      float tmax = -INFINITY;
      for (int c = c0; c < c1; ++c) tmax = std::fmax(tmax, x[c]);
      float corr = 0.f;
      for (auto& s : st) corr = ja::softmax_rescale(s, tmax, to_log2);
      for (int c = 0; c < c0; ++c) p[c] *= corr;  // the output accumulator's rescale
      const float base = ja::softmax_exp_base(st[0]) * to_log2;
      float sums[4] = {0, 0, 0, 0};
      for (int c = c0; c < c1; ++c) {
        p[c] = std::exp2(x[c] * to_log2 - base);
        sums[c % 4] += p[c];
      }
      for (int k = 0; k < 4; ++k) ja::softmax_add(st[k], corr, sums[k]);
    }
    ja::SoftmaxRow total = st[0];
    total.sum = st[0].sum + st[1].sum + st[2].sum + st[3].sum;
    const float inv = ja::softmax_inv_sum(total);
    std::printf("row %.9g", ja::softmax_lse(total, scale));
    for (float v : p) std::printf(" %.9g", v * inv);
    std::printf("\n");
  }
  return 0;
}

#ifdef JACOBI_WITH_CUTE
template <int kHeadDim>
static int check_fragments() {
  using namespace cute;
  using Element = cutlass::bfloat16_t;
  using TileQK = Shape<_128, _128, Int<kHeadDim>>;
  using TilePV = Shape<_128, Int<kHeadDim>, _128>;
  using WG = Layout<Shape<_2, _1, _1>>;
  auto mma_qk = make_tiled_mma(GMMA::ss_op_selector<Element, Element, float, TileQK>(), WG{});
  auto mma_pv = make_tiled_mma(
      GMMA::rs_op_selector<Element, Element, float, TilePV, GMMA::Major::K, GMMA::Major::MN>(), WG{});
  int bad = 0;
  for (int t = 0; t < 256; ++t) {
    auto cS = mma_qk.get_thread_slice(t).partition_C(make_identity_tensor(Shape<_128, _128>{}));
    auto cA = mma_pv.get_thread_slice(t).partition_A(make_identity_tensor(Shape<_128, _128>{}));
    auto frag = partition_fragment_C(mma_qk, Shape<_128, _128>{});  // the kernel's tSrS
    // Slot i of the accumulator holds S at coordinate cS(i); write those coordinates in registers.
    auto coords = make_tensor<int>(frag.layout());
    for (int i = 0; i < size(frag); ++i) coords(i) = get<0>(cS(i)) * 1000 + get<1>(cS(i));
    auto asA = make_tensor(coords.data(), jacobi::cuda::attn::sm90::acc_as_operand_a(frag.layout()));
    if (size(asA) != size(cA)) {
      std::printf("size mismatch %d %d\n", int(size(asA)), int(size(cA)));
      return 1;
    }
    for (int i = 0; i < size(cA); ++i) {
      const int want = get<0>(cA(i)) * 1000 + get<1>(cA(i));
      if (asA(i) != want && bad++ < 5)
        std::printf("thread %d A slot %d holds (%d,%d), expects (%d,%d)\n", t, i, asA(i) / 1000,
                    asA(i) % 1000, want / 1000, want % 1000);
    }
    auto rc = make_tensor(coords.data(), jacobi::cuda::attn::sm90::rowcol(frag.layout()));
    for (int m = 0; m < size<0>(rc); ++m)
      for (int n = 0; n < size<1>(rc); ++n) {
        if (rc(m, n) / 1000 != rc(m, 0) / 1000 && bad++ < 5) std::printf("rowcol row %d mixes rows\n", m);
        if (n % 2 == 1 && rc(m, n) != rc(m, n - 1) + 1 && bad++ < 5)
          std::printf("rowcol pair (%d, %d) not adjacent columns\n", m, n);
      }
    // The output accumulator of O += P V: same rowcol rules (the epilogue writes column pairs).
    auto cO = mma_pv.get_thread_slice(t).partition_C(make_identity_tensor(Shape<_128, Int<kHeadDim>>{}));
    auto fo = partition_fragment_C(mma_pv, Shape<_128, Int<kHeadDim>>{});
    auto oc = make_tensor<int>(fo.layout());
    for (int i = 0; i < size(fo); ++i) oc(i) = get<0>(cO(i)) * 1000 + get<1>(cO(i));
    auto orc = make_tensor(oc.data(), jacobi::cuda::attn::sm90::rowcol(fo.layout()));
    for (int m = 0; m < size<0>(orc); ++m)
      for (int n = 0; n < size<1>(orc); ++n) {
        if (orc(m, n) / 1000 != orc(m, 0) / 1000 && bad++ < 5) std::printf("O rowcol mixes rows\n");
        if (n % 2 == 1 && orc(m, n) != orc(m, n - 1) + 1 && bad++ < 5)
          std::printf("O pair not adjacent\n");
      }
  }
  std::printf("fragments D=%d: %d threads, %d bad\n", kHeadDim, 256, bad);
  return bad != 0;
}

// The backward's views (bwd_sm90.h, types from fragment_layouts.h BwdLayouts): the S^T / dP^T
// accumulator (keys x queries) reinterpreted as the A operand of dV += P^T dO / dK += dS^T Q; the
// rowcol() views of S^T (a thread's two keys r, r + 8 share one 32-key mask word), dK/dV and dQ
// (column pairs adjacent and even: 64-bit stores); and the transposed shared-memory views
// K^T, Q^T / dO^T and dS, which must address the very bytes of the tiles they transpose.
template <int kHeadDim>
static int check_bwd_fragments() {
  using namespace cute;
  using Lay = jacobi::cuda::attn::sm90::BwdLayouts<cutlass::bfloat16_t, kHeadDim>;
  using jacobi::cuda::attn::sm90::acc_as_operand_a;
  using jacobi::cuda::attn::sm90::rowcol;
  typename Lay::MmaSdP mma_sdp;
  typename Lay::MmaKV mma_kv;
  typename Lay::MmaDq mma_dq;
  int bad = 0;
  auto complain = [&](const char* what, int t, int a, int b) {
    if (bad++ < 8) std::printf("D=%d thread %d: %s (%d, %d)\n", kHeadDim, t, what, a, b);
  };
  // rowcol of a C fragment: one row per view row, column pairs adjacent, first of a pair even.
  auto check_rowcol = [&](auto const& mma, auto shape, int t, const char* name) {
    auto c = mma.get_thread_slice(t).partition_C(make_identity_tensor(shape));
    auto frag = partition_fragment_C(mma, shape);
    auto coords = make_tensor<int>(frag.layout());
    for (int i = 0; i < size(frag); ++i) coords(i) = get<0>(c(i)) * 1000 + get<1>(c(i));
    auto rc = make_tensor(coords.data(), rowcol(frag.layout()));
    for (int m = 0; m < size<0>(rc); ++m)
      for (int n = 0; n < size<1>(rc); ++n) {
        if (rc(m, n) / 1000 != rc(m, 0) / 1000) complain(name, t, m, n);
        if (n % 2 == 1 && rc(m, n) != rc(m, n - 1) + 1) complain(name, t, m, n);
        if (n % 2 == 0 && rc(m, n) % 2 != 0) complain(name, t, m, n);
      }
    return rc;
  };
  for (int t = 0; t < 256; ++t) {
    // P^T / dS^T as the A operand of the dV / dK GEMMs.
    auto cS = mma_sdp.get_thread_slice(t).partition_C(make_identity_tensor(Shape<_128, _64>{}));
    auto cA = mma_kv.get_thread_slice(t).partition_A(make_identity_tensor(Shape<_128, _64>{}));
    auto frag = partition_fragment_C(mma_sdp, Shape<_128, _64>{});
    auto coords = make_tensor<int>(frag.layout());
    for (int i = 0; i < size(frag); ++i) coords(i) = get<0>(cS(i)) * 1000 + get<1>(cS(i));
    auto asA = make_tensor(coords.data(), acc_as_operand_a(frag.layout()));
    if (size(asA) != size(cA)) {
      std::printf("bwd size mismatch %d %d\n", int(size(asA)), int(size(cA)));
      return 1;
    }
    for (int i = 0; i < size(cA); ++i) {
      const int want = get<0>(cA(i)) * 1000 + get<1>(cA(i));
      if (asA(i) != want) complain("A slot holds the wrong element", t, i, asA(i));
    }
    auto rc = check_rowcol(mma_sdp, Shape<_128, _64>{}, t, "S^T rowcol");
    if (size<0>(rc) != 2) complain("S^T: not 2 keys per thread", t, int(size<0>(rc)), 0);
    const int k0 = rc(0, 0) / 1000, k1 = rc(1, 0) / 1000;
    if (k1 != k0 + 8 || k0 / 32 != k1 / 32) complain("S^T keys not r, r + 8 in one word", t, k0, k1);
    check_rowcol(mma_kv, Shape<_128, Int<kHeadDim>>{}, t, "dK/dV rowcol");
    check_rowcol(mma_dq, Shape<_64, Int<kHeadDim>>{}, t, "dQ rowcol");
  }
  // The dQ tile in shared memory (SmemdQ): every (query, d) written by exactly one thread, a
  // thread's column pairs adjacent in memory (64-bit stores), rows 16-byte aligned (the bulk
  // reduce's rule), and no bank conflict within a half warp's 64-bit store.
  {
    typename Lay::SmemdQ sdq;
    std::vector<int> owner(size_t(cosize(sdq)), -1);
    for (int t = 0; t < 256; ++t) {
      auto c = mma_dq.get_thread_slice(t).partition_C(make_identity_tensor(Shape<_64, Int<kHeadDim>>{}));
      auto frag = partition_fragment_C(mma_dq, Shape<_64, Int<kHeadDim>>{});
      auto off = make_tensor<int>(frag.layout());
      for (int i = 0; i < size(frag); ++i) {
        off(i) = sdq(get<0>(c(i)), get<1>(c(i)));
        if (owner[off(i)] >= 0) complain("dQ smem element written twice", t, i, off(i));
        owner[off(i)] = t;
      }
      auto rc = make_tensor(off.data(), rowcol(frag.layout()));
      for (int m = 0; m < size<0>(rc); ++m)
        for (int n = 1; n < size<1>(rc); n += 2)
          if (rc(m, n) != rc(m, n - 1) + 1 || rc(m, n - 1) % 2) complain("dQ smem pair", t, m, n);
    }
    int written = 0;
    for (int q = 0; q < 64; ++q)
      for (int d = 0; d < kHeadDim; ++d) written += owner[sdq(q, d)] >= 0;
    if (written != 64 * kHeadDim) complain("dQ smem elements not written", -1, written, 0);
    if ((Lay::kDqRowStride * 4) % 16) complain("dQ smem rows not 16-byte aligned", -1, 0, 0);
    // Banks of one 64-bit store instruction (same register pair index) over lanes 0-15 and 16-31.
    auto frag = partition_fragment_C(mma_dq, Shape<_64, Int<kHeadDim>>{});
    for (int w = 0; w < 8; ++w)
      for (int i = 0; i < size(frag); i += 2)
        for (int h = 0; h < 2; ++h) {
          unsigned used = 0;
          for (int l = 16 * h; l < 16 * h + 16; ++l) {
            auto c = mma_dq.get_thread_slice(32 * w + l).partition_C(make_identity_tensor(Shape<_64, Int<kHeadDim>>{}));
            const int bank = sdq(get<0>(c(i)), get<1>(c(i))) % 32;
            if (used & (3u << bank)) complain("dQ smem bank conflict", 32 * w + l, i, bank);
            used |= 3u << bank;
          }
        }
  }
  // Every element of each tile has one home, and the transposed views read it there.
  typename Lay::SmemK sk;
  typename Lay::SmemKt skt;
  for (int d = 0; d < kHeadDim; ++d)
    for (int k = 0; k < 128; ++k)
      if (skt(d, k) != sk(k, d)) complain("K^T view", -1, d, k);
  typename Lay::SmemQ sq;
  typename Lay::SmemQt sqt;
  for (int st = 0; st < 2; ++st)
    for (int d = 0; d < kHeadDim; ++d)
      for (int q = 0; q < 64; ++q)
        if (sqt(d, q, st) != sq(q, d, st)) complain("Q^T view", st, d, q);
  typename Lay::SmemdSt sdst;
  typename Lay::SmemdS sds;
  for (int st = 0; st < 2; ++st)
    for (int q = 0; q < 64; ++q)
      for (int k = 0; k < 128; ++k)
        if (sds(q, k, st) != sdst(k, q, st)) complain("dS view", st, q, k);
  std::printf("bwd fragments D=%d: %d threads, %d bad\n", kHeadDim, 256, bad);
  return bad != 0;
}
#endif

int main(int argc, char** argv) {
  if (argc < 2) return 2;
  if (!std::strcmp(argv[1], "plan")) return plan_mode();
  if (!std::strcmp(argv[1], "softmax")) return softmax_mode();
#ifdef JACOBI_WITH_CUTE
  if (!std::strcmp(argv[1], "fragments")) {
    return check_fragments<64>() | check_fragments<128>() | check_bwd_fragments<64>() |
           check_bwd_fragments<128>();
  }
#endif
  return 2;
}
