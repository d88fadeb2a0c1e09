"""The device side of one decoding step for the whole batch, as one CUDA graph replay.

Owns `BatchStep`: the static device buffers of a batch's decoding state (each sequence's next
main row, recycled candidates, block ends, recycling pool, sampling context) and the step itself,
from the host's per-sequence `Plan` to the packed result rows: gather the fed tokens, the forward
(runtime.py), its targets, AR acceptance, one launch of the batched verify op for every parallel
sequence, the K/V commit, the next drafts and the packed rows. Everything in it is fixed-shape
for a step width Q and reads no host value, so on CUDA the whole step is captured once per width
bucket and replayed; the host writes one input tensor before and reads one result tensor after.
What a sequence feeds and what the host does with the result is sequence.py; the loop, loop.py.

A sequence's row of the inputs (int64), fields in this order:
  seg[S], off[S]   row id (-1: padding) and offset in its row of each fed token (the mask)
  idx[S]           where each fed token comes from in the sequence's source buffer, which is
                   [next main row (K*n + n) | candidates (p * n) | host tokens (H)]
  row_start[R], row_len[R]   the rows the verify op checks (main, candidates, lookup); all 0
                   when the sequence takes no part (finished, or decoding as AR)
  ar_len[1]        AR mode: the tokens fed (seed + lookup drafts), else 0
  host[H]          tokens only the host knows: AR's seed and drafts, the lookup row
  init[n]          context positions of a spawned block's draft tokens (sampled by the host)
All zero is a valid input that changes nothing (every sequence takes no part): the warm-up
before a capture runs on it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..kernels import _native  # noqa: F401  (registers torch.ops.jacobi_ext)
from .lookup import LookupPolicy
from .prepack import has_kernel
from .sampling import Sampler
from .step_row import (
    ACCEPTED,
    FINISHED,
    NEXT_BLOCKS,
    NEXT_LEN,
    NEXT_SEED,
    SUMMARY,
    WINNER,
    row_layout,
)

MAX_AR_DRAFT = max(LookupPolicy.SIZES)


def verify(*args):
    """The batched verify op (an indirection, so tests can count its launches)."""
    return torch.ops.jacobi_ext.verify_step(*args)


def verify_rows(*args):
    """The whole verify side of a step, one launch of the verify op inside (the same
    indirection)."""
    return torch.ops.jacobi_ext.verify_rows(*args)


@dataclass
class Plan:
    """What one sequence feeds in a step (decided on the host, sequence.py)."""

    rows: list[int]  # lengths of the rows fed, in order (parallel: main, candidates, lookup)
    idx: list[int]  # per fed token, its index in the sequence's source buffer
    host: list[int]  # the host-written tokens (index BatchStep.host0 + i)
    ar: bool  # AR mode: one row, accepted by prefix match, no verify op
    init: list[int]  # parallel: context positions of a spawned block's drafts

    @property
    def q(self) -> int:
        return sum(self.rows)


class BatchStep:
    """Static buffers and the device work of a batch's steps; see the module docstring."""

    def __init__(self, rt, block_size: int, num_blocks: int, pool_size: int,
                 activation_ratio: float, eos: set[int], sampling=None) -> None:  # fmt: skip
        self.rt, dev, B = rt, rt.device, rt.B
        n, K, p = block_size, num_blocks, pool_size
        self.n, self.K, self.p = n, K, p
        self.parallel = n > 1
        self.S = rt.scratch
        self.R = 2 + p  # main + pool candidates + lookup
        self.Wv = K * n  # the verify op's row width (the longest main row)
        self.spawn = max(1, min(n, math.ceil(activation_ratio * n)))
        self.eos_id = min(eos) if eos else -1  # the op checks one EOS; the host cuts at others
        self.eos = torch.tensor(sorted(eos), dtype=torch.long, device=dev) if eos else None
        self.cand0 = self.Wv + n
        self.host0 = self.cand0 + p * n
        self.H = max(1 + MAX_AR_DRAFT, n)
        self.src = torch.zeros(B, self.host0 + self.H, dtype=torch.long, device=dev)
        self.block_ends = torch.zeros(B, K, dtype=torch.int32, device=dev)
        self.pool = torch.full((B, p, self.Wv), -1, dtype=torch.long, device=dev)
        self.pool_len = torch.zeros(B, p, dtype=torch.int32, device=dev)
        self.pool_head = torch.zeros(B, 1, dtype=torch.int32, device=dev)
        self.ctx_cap = rt.committed  # prompt + generated + a step's overshoot fit
        self.ctx = torch.zeros(B, self.ctx_cap + 1, dtype=torch.long, device=dev)  # +1: dump
        self.ctx_len = torch.zeros(B, dtype=torch.long, device=dev)
        # Sampling: each sequence's noise key (seed, stream), static for the graphs; the rule
        # that replaces the argmax (None: greedy).
        self.keys = torch.zeros(B, 2, dtype=torch.long, device=dev)
        self.rule = Sampler(sampling, self.keys) if sampling is not None else None
        sizes = dict(seg=self.S, off=self.S, idx=self.S, row_start=self.R, row_len=self.R,
                     ar_len=1, host=self.H, init=n)  # fmt: skip
        self.at, o = {}, 0
        for name, size in sizes.items():
            self.at[name] = (o, size)
            o += size
        self.inputs = torch.zeros(B, o, dtype=torch.long, device=dev)
        # Eager steps (a CPU's): each field a view of `inputs` made once (a slice a field a step
        # cost ~5 us); graphs and torch.compile slice inside what they capture, as before.
        self._fields = (
            None
            if rt.use_graphs
            else {name: self.inputs[:, o : o + size] for name, (o, size) in self.at.items()}
        )
        self.layout = row_layout(self.S, K, p, self.R, n)  # the packed rows (step_row.py)
        self.tail = self.layout.tail  # a row's parts after the commit slots
        self._fed1 = torch.zeros(1, dtype=torch.long)  # ar_row's fed count (a CPU step's)
        # the verify side as one op (jacobi/verify_rows.h), else its torch statement (tests: off)
        self._native_verify = has_kernel("verify_rows", dev)
        self._native_ar = has_kernel("ar_accept", dev)  # (a GPU without our CUDA build: off)

    @staticmethod
    def key(block_size, num_blocks, pool_size, activation_ratio, eos, sampling=None) -> tuple:
        # The sampling filters are scalars of the captured graphs: one BatchStep per setting
        # (the seeds are not: they live in `keys`).
        return (block_size, num_blocks, pool_size, activation_ratio, tuple(sorted(eos)), sampling)

    # ---- a new batch ---------------------------------------------------------------------------
    def reset(self, prompts: list[list[int]], keys: torch.Tensor | None = None) -> None:
        """Start a batch: the contexts hold the prompts, the pools are empty, the noise keys are
        `keys` [B, 2] under sampling (in place: captured graphs keep reading these buffers)."""
        if keys is not None:
            self.keys.copy_(keys)
        ctx = torch.zeros(self.ctx.shape, dtype=torch.long)
        for b, pr in enumerate(prompts):
            ctx[b, : len(pr)] = torch.tensor(pr, dtype=torch.long)
        self.ctx.copy_(ctx)
        self.ctx_len.copy_(torch.tensor([len(pr) for pr in prompts], dtype=torch.long))
        self.pool.fill_(-1)
        self.pool_len.zero_()
        self.pool_head.zero_()
        self.block_ends.zero_()

    def start(self, first: torch.Tensor) -> None:
        """After the prefill: every sequence's main row is its first block, `first` [B, n]."""
        if self.parallel:
            self.src[:, : self.n] = first
            self.block_ends[:, 0] = self.n

    def drafts(self, positions: list[list[int]]) -> torch.Tensor:
        """The context tokens at the given positions, [B, n] (the prefill's drafts)."""
        return self.ctx.gather(1, torch.tensor(positions, dtype=torch.long).to(self.ctx.device))

    def state_tensors(self):
        """The buffers the step reads and updates in place (static inputs for torch.compile)."""
        return (self.src, self.block_ends, self.pool, self.pool_len, self.pool_head, self.ctx,
                self.ctx_len, self.inputs)  # fmt: skip

    def main_row(self, b: int, length: int) -> list[int]:
        """Sequence b's main row (a device read: for trajectory recording only)."""
        return self.src[b, :length].tolist()

    # ---- one step ------------------------------------------------------------------------------
    def ar_fast(self) -> bool:
        """Whether an AR step may take ar_row: one greedy sequence of an AR method (ar, ar with
        lookup drafts) whose step writes its K/V in place (runtime.writes_in_place: a CPU lean
        forward)."""
        return not self.parallel and self.rule is None and self.rt.writes_in_place()

    def ar_row(self, pl: Plan, hi: int) -> list[int]:
        """The packed row run() returns for one AR sequence (ar_fast()), without the batch
        step's fixed-shape bookkeeping: runtime.ar_forward, the same AR acceptance as every step
        (the ar_accept op), and the same commit (runtime.commit in place: hi += accepted). hi:
        the sequence's committed end."""
        toks = torch.tensor([pl.host[: pl.q]])  # [1, q]: made once, read by both calls
        tgt = self.rt.ar_forward(toks[0], hi)
        self._fed1.fill_(pl.q)
        rows, count = torch.ops.jacobi_ext.ar_accept(
            toks, tgt, self._fed1, self.eos, self.S, self.tail
        )
        self.rt.commit(None, count, in_place=True)  # (the K/V already in place: hi moves)
        return rows[0].tolist()

    def encode(self, plans: dict[int, Plan]) -> torch.Tensor:
        """The step's inputs on the host, [B, fields] (a sequence without a plan takes no part)."""
        B, S, R = self.rt.B, self.S, self.R
        rows = []
        for b in range(B):
            pl = plans.get(b)
            if pl is None:
                rows.append([-1] * S + [0] * (self.inputs.shape[1] - S))
                continue
            seg, off, start, o = [], [], [], 0
            for r, length in enumerate(pl.rows):
                seg += [r] * length
                off += range(length)
                start.append(o)
                o += length
            pad = S - o
            verified = [0] * R if pl.ar else pl.rows + [0] * (R - len(pl.rows))
            starts = start + [0] * (R - len(start)) if not pl.ar else [0] * R
            host = pl.host + [0] * (self.H - len(pl.host))
            init = pl.init if pl.init else [0] * self.n
            rows.append(
                seg + [-1] * pad + off + [0] * pad + pl.idx + [0] * pad
                + starts + verified + [o if pl.ar else 0] + host + init
            )  # fmt: skip
        return torch.tensor(rows, dtype=torch.long)

    def run(self, plans: dict[int, Plan], Q: int, attend: int) -> torch.Tensor:
        """One step for the whole batch: the packed result rows [B, SUMMARY + S + tail] (on the
        device; the caller's one copy brings them back). `attend`: slots an eager step sees."""
        host = self.encode(plans)
        if self.inputs.device.type == "cuda":  # pinned: no stream sync, the host runs ahead
            self.inputs.copy_(host.pin_memory(), non_blocking=True)
        else:
            self.inputs.copy_(host)
        # Which acceptances the step computes: a parallel step of every sequence skips the AR
        # rows, an AR step (fallback, or method "ar" with lookup) the verify op and its state;
        # a graph per width and mix (each path costs ~20-45 kernels a step on a GPU).
        mix = (any(pl.ar for pl in plans.values()), any(not pl.ar for pl in plans.values()))
        # A first step at this width captures on neutral inputs, then replays on these.
        fn = lambda: self._step(Q, attend, mix)  # noqa: E731
        return self.rt.replay(("step", id(self), Q, mix), fn, (self.inputs,))

    def _field(self, name: str) -> torch.Tensor:
        if self._fields is not None:
            return self._fields[name]
        o, size = self.at[name]
        return self.inputs[:, o : o + size]

    def _step(self, Q: int, attend: int, mix: tuple[bool, bool] = (True, True)) -> torch.Tensor:
        """The step on the device (captured as a graph on CUDA): no host values. `mix`: whether
        any sequence feeds an AR row, and any a parallel one (what is not fed is not computed:
        a sequence without a plan commits nothing either way)."""
        rt = self.rt
        rt.seg[:, :Q] = self._field("seg")[:, :Q]
        rt.off[:, :Q] = self._field("off")[:, :Q]
        self.src[:, self.host0 :] = self._field("host")
        # A sequence without a plan (finished) reads stale slots, -1 where its last verify left
        # no next row: its inputs are masked out, but the embedding still looks them up.
        rt.ids[:, :Q] = self.src.gather(1, self._field("idx")[:, :Q]).clamp_(min=0)
        # one sequence's AR row: its K/V written where the accepted ones stay (runtime.py)
        in_place = not self.parallel and rt.writes_in_place()
        tgt = rt.forward(Q, attend, self.rule, in_place)
        toks = rt.ids[:, :Q]
        has_ar, has_par = mix
        has_par = has_par and self.parallel
        if has_par and not has_ar:  # (a sequence outside the verify commits nothing: count 0)
            row, src, count, _ = self._verify(toks, tgt, Q)
            rt.commit(src, count, in_place)
            return row
        ar_len = self._field("ar_len")[:, 0]
        # the AR rows (jacobi/step_row.h: ar_step_row, one pass on either device)
        if self._native_ar:
            row, count = torch.ops.jacobi_ext.ar_accept(
                toks, tgt, ar_len, self.eos, self.S, self.tail
            )
        else:
            row, count = self._ar_rows_reference(toks, tgt, ar_len, Q)
        src = torch.zeros_like(count)
        if has_par:
            par_row, par_src, par_count, par = self._verify(toks, tgt, Q)
            row = torch.where(par[:, None], par_row, row)
            src = torch.where(par, par_src, src)
            count = torch.where(par, par_count, count)
        rt.commit(src, count, in_place)
        return row

    def _ar_rows_reference(self, toks, tgt, fed, Q: int):
        """ar_accept in torch ops (where this build has no kernel for the device, and for the
        tests): every sequence's AR row, 1 + the longest prefix of the fed drafts equal to the
        targets, cut after the first fed EOS; the seed the target after the last accepted token;
        the fed tokens in the commit slots (-1 past them), zeros after; the tokens to commit."""
        B, dev = toks.shape[0], toks.device
        i = torch.arange(Q, device=dev)
        live = i[None, :] < fed[:, None]
        match = (toks[:, 1:] == tgt[:, :-1]) & live[:, 1:]
        acc = 1 + match.long().cumprod(1).sum(1)
        if self.eos is not None:  # (a broadcast compare: torch.isin may sort and sync)
            is_eos = (toks[:, :, None] == self.eos).any(-1)
            acc = torch.minimum(acc, torch.where(is_eos & live, i, Q).min(1).values + 1)
        last = (acc - 1)[:, None]
        zero, one = torch.zeros_like(acc), torch.ones_like(acc)
        fin = is_eos.gather(1, last)[:, 0].long() if self.eos is not None else zero
        fields = {ACCEPTED: acc, FINISHED: fin, NEXT_LEN: one, NEXT_BLOCKS: one,
                  NEXT_SEED: tgt.gather(1, last)[:, 0]}  # fmt: skip
        summary = torch.stack([fields.get(f, zero) for f in range(SUMMARY)], dim=1)
        commit = torch.full((B, self.S), -1, dtype=torch.long, device=dev)
        commit[:, :Q] = torch.where(live, toks, -1)
        row = torch.cat([summary, commit, toks.new_zeros(B, self.layout.tail)], dim=1)
        return row, torch.where(fed > 0, acc, 0)

    def _verify(self, toks, tgt, Q: int):
        """The parallel sequences' rows through one launch of the batched verify op; the next
        drafts, block ends, candidates and context stay on the device for the next step.
        Returns (packed rows, K/V source offsets, tokens committed, which sequences took part).
        One op on either device (verify_rows, jacobi/verify_rows.h); _verify_reference states
        the same in torch ops (tests/test_decoding_step.py compares them at every step)."""
        if self._native_verify:
            return verify_rows(
                toks, tgt, self._field("row_start"), self._field("row_len"), self._field("init"),
                self.src, self.block_ends, self.pool, self.pool_len, self.pool_head, self.ctx,
                self.ctx_len, self.spawn, self.eos_id, self.S,
            )  # fmt: skip
        return self._verify_reference(toks, tgt, Q)

    def _verify_reference(self, toks, tgt, Q: int):
        """_verify in torch ops: the rows cut, verify_step, the next state and the packed rows."""
        B, R, Wv, n, p, dev = self.rt.B, self.R, self.Wv, self.n, self.p, toks.device
        row_len = self._field("row_len")
        start = self._field("row_start")
        i = torch.arange(Wv, device=dev)
        valid = i[None, None, :] < row_len[:, :, None]
        pos = (start[:, :, None] + i).clamp_(max=Q - 1).view(B, R * Wv)
        tok_rows = torch.where(valid, toks.gather(1, pos).view(B, R, Wv), -1)
        tgt_rows = torch.where(valid, tgt.gather(1, pos).view(B, R, Wv), -1)
        init = self.ctx.gather(1, self._field("init"))
        lens = row_len.to(torch.int32).contiguous()
        accept, summary, commit, nxt, ends, cands, cand_len = verify(
            tok_rows, tgt_rows, lens, self.block_ends, init, self.pool, self.pool_len,
            self.pool_head, self.spawn, self.eos_id,
        )  # fmt: skip
        par = row_len[:, 0] > 0
        acc = summary[:, ACCEPTED]
        # The next step's state, kept where a sequence took no part.
        keep = par[:, None]
        self.src[:, : self.cand0] = torch.where(keep, nxt, self.src[:, : self.cand0])
        cands = cands.view(B, p * n)
        self.src[:, self.cand0 : self.host0] = torch.where(
            keep, cands, self.src[:, self.cand0 : self.host0]
        )
        self.block_ends.copy_(torch.where(keep, ends, self.block_ends))
        # The committed tokens join the context (drafts for spawned blocks are sampled from it).
        at = self.ctx_len[:, None] + i
        ok = keep & (i[None, :] < acc[:, None])
        self.ctx.scatter_(1, torch.where(ok, at, self.ctx_cap), commit)
        self.ctx_len.add_(torch.where(par, acc, 0))
        # the packed row, in the order of jacobi/step_row.h (tests compare it with the CPU op's)
        commit_s = F.pad(commit, (0, self.S - Wv), value=-1)
        counts = torch.cat([ends, cand_len, accept], dim=1).long()  # (int32: one cast)
        row = torch.cat([summary, commit_s, counts, nxt[:, :n], cands], dim=1)
        src = start.gather(1, summary[:, WINNER : WINNER + 1])[:, 0]  # the winner's first query
        return row, src, torch.where(par, acc, 0), par
