// verify_step: argument checks and the CPU implementation.
#include "verify_ops.h"

#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <torch/library.h>

#include <c10/util/SmallVector.h>

#include <algorithm>
#include <cstdint>
#include <optional>
#include <tuple>

#include "cpu/verify_cpu.h"
#include "checks.h"

namespace jacobi::ops {

VerifyLaunch prepare_verify(const at::Tensor& tokens, const at::Tensor& greedy,
                            const at::Tensor& row_len, const at::Tensor& block_ends,
                            const at::Tensor& init_tokens, const at::Tensor& pool,
                            const at::Tensor& pool_len, const at::Tensor& pool_head,
                            int64_t spawn_threshold, int64_t eos_token_id) {
  namespace ck = jacobi::checks;
  // One sequence: the shapes below; a batch: the same with a leading [batch] on every tensor.
  TORCH_CHECK_VALUE(tokens.dim() == 2 || tokens.dim() == 3, "tokens must be 2-D [rows, width] "
                    "(one sequence) or 3-D [batch, rows, width], got shape ", tokens.sizes());
  const bool batched = tokens.dim() == 3;
  const int64_t d = batched ? 1 : 0;
  ck::rank(tokens, "tokens", 2 + d, batched ? "[batch, rows, width]" : "[rows, width]");
  ck::rank(greedy, "greedy", 2 + d, batched ? "[batch, rows, width]" : "[rows, width]");
  ck::rank(row_len, "row_len", 1 + d, batched ? "[batch, rows]" : "[rows]");
  ck::rank(block_ends, "block_ends", 1 + d, batched ? "[batch, max_blocks]" : "[max_blocks]");
  ck::rank(init_tokens, "init_tokens", 1 + d, batched ? "[batch, block_size]" : "[block_size]");
  ck::rank(pool, "pool", 2 + d, batched ? "[batch, pool_size, pool_width]"
                                        : "[pool_size, pool_width]");
  ck::rank(pool_len, "pool_len", 1 + d, batched ? "[batch, pool_size]" : "[pool_size]");
  ck::rank(pool_head, "pool_head", 1 + d, batched ? "[batch, 1]" : "[1]");
  for (auto [t, name] : {std::pair{&tokens, "tokens"}, {&greedy, "greedy"},
                         {&init_tokens, "init_tokens"}, {&pool, "pool"}}) {
    ck::dtype(*t, name, at::kLong);
  }
  for (auto [t, name] : {std::pair{&row_len, "row_len"}, {&block_ends, "block_ends"},
                         {&pool_len, "pool_len"}, {&pool_head, "pool_head"}}) {
    ck::dtype(*t, name, at::kInt);
  }
  const int64_t B = batched ? tokens.size(0) : 1;
  for (auto [t, name] :
       {std::pair{&tokens, "tokens"}, {&greedy, "greedy"}, {&row_len, "row_len"},
        {&block_ends, "block_ends"}, {&init_tokens, "init_tokens"}, {&pool, "pool"},
        {&pool_len, "pool_len"}, {&pool_head, "pool_head"}}) {
    ck::contiguous(*t, name);
    ck::same_device(*t, name, tokens, "tokens");
    TORCH_CHECK_VALUE(!batched || t->size(0) == B, name, " must have one entry per sequence (",
                      B, "), got shape ", t->sizes());
  }
  const int64_t R = tokens.size(d), W = tokens.size(d + 1);
  TORCH_CHECK_VALUE(R >= 1 && W >= 1, "tokens must hold at least one row and one column, got ",
                    tokens.sizes());
  TORCH_CHECK_VALUE(B <= INT32_MAX, "at most 2^31 - 1 sequences, got ", B);
  TORCH_CHECK_VALUE(greedy.sizes() == tokens.sizes(), "greedy must have the shape of tokens ",
                    tokens.sizes(), ", got ", greedy.sizes());
  TORCH_CHECK_VALUE(row_len.size(d) == R, "row_len must have one entry per row (", R, "), got ",
                    row_len.size(d));
  const int64_t K = block_ends.size(d), n = init_tokens.size(d);
  const int64_t p = pool.size(d), pw = pool.size(d + 1);
  TORCH_CHECK_VALUE(K >= 1, "block_ends must have max_blocks >= 1 entries");
  TORCH_CHECK_VALUE(n >= 2, "init_tokens must have block_size >= 2 entries, got ", n);
  TORCH_CHECK_VALUE(pool_len.size(d) == p, "pool_len must have one entry per pool row (", p,
                    "), got ", pool_len.size(d));
  TORCH_CHECK_VALUE(pool_head.size(d) == 1, "pool_head must have exactly one entry per sequence");
  TORCH_CHECK_VALUE(spawn_threshold >= 1 && spawn_threshold <= n,
                    "spawn_threshold must be in [1, block_size=", n, "], got ", spawn_threshold);
  // Host-side value checks are only affordable on the CPU (a GPU read would be a sync); the
  // CUDA path trusts the engine, which keeps these invariants by construction.
  if (tokens.device().is_cpu()) {
    for (int64_t b = 0; b < B; ++b) {
      const int32_t* rl = row_len.data_ptr<int32_t>() + b * R;
      const int32_t* be = block_ends.data_ptr<int32_t>() + b * K;
      const char* who = batched ? "of a sequence " : "";
      if (batched && rl[0] == 0) {  // takes no part: its other rows must be empty too
        for (int64_t r = 1; r < R; ++r)
          TORCH_CHECK_VALUE(rl[r] == 0, "row_len[", b, "] has an empty main row (the sequence "
                            "takes no part) but row ", r, " has length ", rl[r]);
        continue;
      }
      TORCH_CHECK_VALUE(rl[0] >= 1 && rl[0] <= W, "row_len[0] (the main row", who, ") must be in "
                        "[", batched ? 0 : 1, ", ", W, "], got ", rl[0]);
      int nb = 0, prev = 0;
      while (nb < K && be[nb] > 0) {
        TORCH_CHECK_VALUE(be[nb] > prev && be[nb] - prev <= n, "block_ends must increase by at "
                          "most block_size=", n, " per block, got ", block_ends);
        prev = be[nb++];
      }
      for (int b2 = nb; b2 < K; ++b2)
        TORCH_CHECK_VALUE(be[b2] == 0, "block_ends must be 0 after the last block, got ",
                          block_ends);
      TORCH_CHECK_VALUE(nb >= 1 && prev == rl[0], "block_ends must end at the main row's length ",
                        rl[0], ", got ", block_ends);
      for (int64_t r = 1; r < R; ++r)
        TORCH_CHECK_VALUE(rl[r] == 0 || rl[r] == be[0], "row_len[", r, "] (a candidate) must be "
                          "0 or the first block's length ", be[0], ", got ", rl[r]);
      const int32_t head = pool_head.data_ptr<int32_t>()[b];
      TORCH_CHECK_VALUE(p == 0 || (head >= 0 && head < p), "pool_head must be in [0, pool_size)");
    }
  }

  const auto opt = tokens.options();
  auto shape = [&](std::initializer_list<int64_t> dims) {  // [batch] + dims for a batch
    c10::SmallVector<int64_t, 4> v;
    if (batched) v.push_back(B);
    for (const int64_t x : dims) v.push_back(x);
    return v;
  };
  at::Tensor accept = at::empty(shape({R}), opt.dtype(at::kInt));
  at::Tensor summary = at::empty(shape({kSummarySize}), opt.dtype(at::kLong));
  at::Tensor commit = at::empty(shape({W}), opt);
  at::Tensor next_tokens = at::empty(shape({W + n}), opt);
  at::Tensor next_block_ends = at::empty(shape({K}), opt.dtype(at::kInt));
  at::Tensor candidates = at::empty(shape({p, n}), opt);
  at::Tensor candidate_len = at::empty(shape({p}), opt.dtype(at::kInt));

  VerifyLaunch l;
  l.batch = static_cast<int>(B);
  l.shape = VerifyShape{static_cast<int>(R),
                        static_cast<int>(W),
                        static_cast<int>(K),
                        static_cast<int>(n),
                        static_cast<int>(spawn_threshold),
                        static_cast<int>(p),
                        static_cast<int>(pw),
                        eos_token_id};
  l.args = VerifyArgs<int64_t>{tokens.data_ptr<int64_t>(),     greedy.data_ptr<int64_t>(),
                               row_len.data_ptr<int32_t>(),    block_ends.data_ptr<int32_t>(),
                               init_tokens.data_ptr<int64_t>(), pool.data_ptr<int64_t>(),
                               pool_len.data_ptr<int32_t>(),   pool_head.data_ptr<int32_t>(),
                               accept.data_ptr<int32_t>(),     summary.data_ptr<int64_t>(),
                               commit.data_ptr<int64_t>(),     next_tokens.data_ptr<int64_t>(),
                               next_block_ends.data_ptr<int32_t>(),
                               candidates.data_ptr<int64_t>(), candidate_len.data_ptr<int32_t>()};
  l.outputs = {accept, summary, commit, next_tokens, next_block_ends, candidates, candidate_len};
  return l;
}

namespace {

VerifyResult verify_step_cpu(const at::Tensor& tokens, const at::Tensor& greedy,
                             const at::Tensor& row_len, const at::Tensor& block_ends,
                             const at::Tensor& init_tokens, at::Tensor& pool,
                             at::Tensor& pool_len, at::Tensor& pool_head, int64_t spawn_threshold,
                             int64_t eos_token_id) {
  VerifyLaunch l = prepare_verify(tokens, greedy, row_len, block_ends, init_tokens, pool, pool_len,
                                  pool_head, spawn_threshold, eos_token_id);
  jacobi::cpu::verify_step(l.shape, l.args, l.batch);
  return l.outputs;
}

// The decoding step's AR rows (jacobi_ext/decoding/step.py: BatchStep._ar_rows, whose ~25 torch
// ops it replaces on a CPU, ~0.25 ms a step), per sequence b with q = fed[b]:
// accepted = 1 + the longest run of fed drafts toks[b, i] (1 <= i < q) equal to tgt[b, i - 1],
// capped at 1 + the first fed EOS; the seed is tgt[b, accepted - 1]; finished = whether
// toks[b, accepted - 1] is an EOS. row[b] = the summary (0, accepted, finished, 1, 1, seed, 0, 0),
// then `width` commit slots (toks[b, i] for i < min(q, Q), else -1), then `tail` zeros;
// count[b] = accepted where q > 0, else 0.
std::tuple<at::Tensor, at::Tensor> cpu_ar_accept(const at::Tensor& toks, const at::Tensor& tgt,
                                                 const at::Tensor& fed,
                                                 const std::optional<at::Tensor>& eos,
                                                 int64_t width, int64_t tail) {
  namespace ck = jacobi::checks;
  ck::rank(toks, "toks", 2, "[B, Q]");
  ck::dtype(toks, "toks", at::kLong);
  ck::dtype(tgt, "tgt", at::kLong);
  ck::dtype(fed, "fed", at::kLong);
  const int64_t B = toks.size(0), Q = toks.size(1);
  TORCH_CHECK_VALUE(tgt.sizes() == toks.sizes(), "tgt must be [B, Q] like toks ", toks.sizes(),
                    ", got ", tgt.sizes());
  TORCH_CHECK_VALUE(fed.dim() == 1 && fed.size(0) == B, "fed must be [B = ", B, "], got ",
                    fed.sizes());
  TORCH_CHECK_VALUE(Q >= 1, "a step feeds at least one token, got Q = ", Q);
  TORCH_CHECK_VALUE(width >= Q && tail >= 0, "width (", width, ") must hold the step's ", Q,
                    " tokens and tail (", tail, ") be >= 0");
  at::Tensor e;
  if (eos.has_value()) {
    ck::dtype(*eos, "eos", at::kLong);
    TORCH_CHECK_VALUE(eos->dim() == 1, "eos must be [E] token ids, got ", eos->sizes());
    e = eos->contiguous();
  }
  const at::Tensor tc = toks.contiguous(), gc = tgt.contiguous(), fc = fed.contiguous();
  const int64_t *t = tc.data_ptr<int64_t>(), *g = gc.data_ptr<int64_t>(),
                *q = fc.data_ptr<int64_t>();
  const int64_t* ep = e.defined() ? e.data_ptr<int64_t>() : nullptr;
  const int64_t E = e.defined() ? e.size(0) : 0;
  auto is_eos = [&](int64_t tok) {  // false for every token without EOS ids
    for (int64_t k = 0; k < E; ++k) {
      if (ep[k] == tok) return true;
    }
    return false;
  };
  const int64_t L = 8 + width + tail;
  at::Tensor rows = at::zeros({B, L}, toks.options());
  at::Tensor count = at::empty({B}, toks.options());
  int64_t* s = rows.data_ptr<int64_t>();
  int64_t* c = count.data_ptr<int64_t>();
  for (int64_t b = 0; b < B; ++b) {
    const int64_t* tb = t + b * Q;
    const int64_t* gb = g + b * Q;
    int64_t acc = 1;
    while (acc < Q && acc < q[b] && tb[acc] == gb[acc - 1]) ++acc;
    for (int64_t i = 0; i < Q && i < q[b]; ++i) {
      if (is_eos(tb[i])) {
        acc = std::min(acc, i + 1);
        break;
      }
    }
    int64_t* row = s + b * L;
    row[1] = acc;
    row[2] = is_eos(tb[acc - 1]) ? 1 : 0;
    row[3] = row[4] = 1;
    row[5] = gb[acc - 1];
    for (int64_t i = 0; i < width; ++i) row[8 + i] = i < Q && i < q[b] ? tb[i] : -1;
    c[b] = q[b] > 0 ? acc : 0;
  }
  return {rows, count};
}

// The parallel sequences' side of a decoding step on a CPU (jacobi_ext/decoding/step.py:
// BatchStep._verify, whose ~20 tensor ops it replaces there, ~0.25 ms a step on a 2-core EPYC):
// each sequence's rows cut from the step's tokens and targets (row_start, row_len; -1 past a
// row's end), the spawned block's drafts read from its context (init_idx), one verify_step over
// the batch, then, for each sequence that took part (row_len[b][0] > 0), its next main row and
// candidates into src, its block ends, the committed tokens appended to ctx (ctx_len advanced);
// and every sequence's packed row (summary, the commit padded to `width` with -1, next block ends,
// candidate lengths, acceptances, the next first block, the candidates). Returns (rows, each
// winner row's first query, tokens committed (0 where it took no part), which took part).
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> cpu_verify_rows(
    const at::Tensor& toks, const at::Tensor& tgt, const at::Tensor& row_start,
    const at::Tensor& row_len, const at::Tensor& init_idx, at::Tensor& src,
    at::Tensor& block_ends, at::Tensor& pool, at::Tensor& pool_len, at::Tensor& pool_head,
    at::Tensor& ctx, at::Tensor& ctx_len, int64_t spawn_threshold, int64_t eos_token_id,
    int64_t width) {
  namespace ck = jacobi::checks;
  for (auto [t, name] : {std::pair{&toks, "toks"}, {&tgt, "tgt"}, {&row_start, "row_start"},
                         {&row_len, "row_len"}, {&init_idx, "init_idx"}, {&src, "src"},
                         {&ctx, "ctx"}, {&ctx_len, "ctx_len"}}) {
    ck::dtype(*t, name, at::kLong);
    TORCH_CHECK_VALUE(t->device().is_cpu(), name, " must be a CPU tensor, got ", t->device());
  }
  ck::rank(toks, "toks", 2, "[B, Q]");
  ck::rank(pool, "pool", 3, "[B, pool_size, pool_width]");
  ck::rank(block_ends, "block_ends", 2, "[B, max_blocks]");
  for (auto [t, name] : {std::pair{&src, "src"}, {&ctx, "ctx"}, {&ctx_len, "ctx_len"}})
    ck::contiguous(*t, name);
  const int64_t B = toks.size(0), Q = toks.size(1), R = row_len.size(1), n = init_idx.size(1);
  const int64_t Wv = pool.size(2), K = block_ends.size(1), p = pool.size(1);
  const int64_t cand0 = Wv + n, host0 = cand0 + p * n, cap = ctx.size(1) - 1;
  TORCH_CHECK_VALUE(tgt.sizes() == toks.sizes() && row_start.dim() == 2 &&
                        row_start.sizes() == row_len.sizes() && row_len.size(0) == B &&
                        init_idx.size(0) == B && src.dim() == 2 && src.size(0) == B &&
                        src.size(1) >= host0 && ctx.dim() == 2 && ctx.size(0) == B &&
                        ctx_len.dim() == 1 && ctx_len.size(0) == B && width >= Wv,
                    "cpu_verify_rows: inconsistent shapes (toks ", toks.sizes(), ", row_len ",
                    row_len.sizes(), ", init_idx ", init_idx.sizes(), ", src ", src.sizes(),
                    ", ctx ", ctx.sizes(), ", pool ", pool.sizes(), ", width ", width, ")");
  const auto opt = toks.options();
  at::Tensor tok_rows = at::empty({B, R, Wv}, opt), tgt_rows = at::empty({B, R, Wv}, opt);
  at::Tensor lens = at::empty({B, R}, opt.dtype(at::kInt)), init = at::empty({B, n}, opt);
  const at::Tensor tc = toks.contiguous(), gc = tgt.contiguous();
  const int64_t *tp = tc.data_ptr<int64_t>(), *gp = gc.data_ptr<int64_t>();
  const auto rs = row_start.accessor<int64_t, 2>(), rl = row_len.accessor<int64_t, 2>();
  const auto ii = init_idx.accessor<int64_t, 2>();
  int64_t *ctx_p = ctx.data_ptr<int64_t>(), *ctx_n = ctx_len.data_ptr<int64_t>();
  int64_t *trp = tok_rows.data_ptr<int64_t>(), *grp = tgt_rows.data_ptr<int64_t>();
  int64_t* initp = init.data_ptr<int64_t>();
  int32_t* lensp = lens.data_ptr<int32_t>();
  for (int64_t b = 0; b < B; ++b) {
    for (int64_t r = 0; r < R; ++r) {
      lensp[b * R + r] = static_cast<int32_t>(rl[b][r]);
      for (int64_t i = 0; i < Wv; ++i) {
        const int64_t at = std::min(rs[b][r] + i, Q - 1);  // (as the Python: clamped, masked)
        const bool in = i < rl[b][r];
        TORCH_CHECK_VALUE(!in || at >= 0, "row_start[", b, "][", r, "] is negative");
        trp[(b * R + r) * Wv + i] = in ? tp[b * Q + at] : -1;
        grp[(b * R + r) * Wv + i] = in ? gp[b * Q + at] : -1;
      }
    }
    for (int64_t j = 0; j < n; ++j) {
      TORCH_CHECK_VALUE(ii[b][j] >= 0 && ii[b][j] <= cap, "init_idx[", b, "][", j, "] = ",
                        ii[b][j], " is outside the context's ", cap + 1, " slots");
      initp[b * n + j] = ctx_p[b * (cap + 1) + ii[b][j]];
    }
  }
  auto [accept, summary, commit, nxt, ends, cands, cand_len] =
      verify_step_cpu(tok_rows, tgt_rows, lens, block_ends, init, pool, pool_len, pool_head,
                      spawn_threshold, eos_token_id);
  const int64_t tail = K + p + R + n + p * n, L = kSummarySize + width + tail;
  at::Tensor rows = at::empty({B, L}, opt), first = at::empty({B}, opt);
  at::Tensor count = at::empty({B}, opt), par = at::empty({B}, opt.dtype(at::kBool));
  const int64_t* sm = summary.data_ptr<int64_t>();
  const int64_t *cm = commit.data_ptr<int64_t>(), *nx = nxt.data_ptr<int64_t>(),
                *cd = cands.data_ptr<int64_t>();
  const int32_t *en = ends.data_ptr<int32_t>(), *cl = cand_len.data_ptr<int32_t>(),
                *ac = accept.data_ptr<int32_t>();
  int64_t* sp = src.data_ptr<int64_t>();
  int32_t* be = block_ends.data_ptr<int32_t>();
  for (int64_t b = 0; b < B; ++b) {
    const bool part = rl[b][0] > 0;
    const int64_t acc = sm[b * kSummarySize + 1];
    if (part) {  // the next step's state (kept where the sequence took no part)
      std::copy(nx + b * cand0, nx + (b + 1) * cand0, sp + b * src.size(1));
      std::copy(cd + b * p * n, cd + (b + 1) * p * n, sp + b * src.size(1) + cand0);
      std::copy(en + b * K, en + (b + 1) * K, be + b * K);
    }
    // the committed tokens join the context (the rest of the commit to the dump slot `cap`)
    for (int64_t i = 0; i < Wv; ++i) {
      const int64_t at = part && i < acc ? ctx_n[b] + i : cap;
      TORCH_CHECK(at >= 0 && at <= cap, "cpu_verify_rows: context position ", at,
                  " past the context's ", cap + 1, " slots");
      ctx_p[b * (cap + 1) + at] = cm[b * Wv + i];
    }
    if (part) ctx_n[b] += acc;
    int64_t* row = rows.data_ptr<int64_t>() + b * L;
    std::copy(sm + b * kSummarySize, sm + (b + 1) * kSummarySize, row);
    int64_t o = kSummarySize;
    for (int64_t i = 0; i < width; ++i) row[o + i] = i < Wv ? cm[b * Wv + i] : -1;
    o += width;
    for (int64_t i = 0; i < K; ++i) row[o++] = en[b * K + i];
    for (int64_t i = 0; i < p; ++i) row[o++] = cl[b * p + i];
    for (int64_t i = 0; i < R; ++i) row[o++] = ac[b * R + i];
    for (int64_t i = 0; i < n; ++i) row[o++] = nx[b * cand0 + i];
    for (int64_t i = 0; i < p * n; ++i) row[o++] = cd[b * p * n + i];
    const int64_t w = sm[b * kSummarySize];
    TORCH_CHECK(w >= 0 && w < R, "cpu_verify_rows: winner row ", w, " of ", R);
    first.data_ptr<int64_t>()[b] = rs[b][w];
    count.data_ptr<int64_t>()[b] = part ? acc : 0;
    par.data_ptr<bool>()[b] = part;
  }
  return {rows, first, count, par};
}

}  // namespace

TORCH_LIBRARY_IMPL(jacobi_ext, CPU, m) {
  m.impl("verify_step", &verify_step_cpu);
  m.impl("cpu_verify_rows", &cpu_verify_rows);
  m.impl("cpu_ar_accept", &cpu_ar_accept);
}

}  // namespace jacobi::ops
