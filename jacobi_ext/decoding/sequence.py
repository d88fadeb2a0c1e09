"""One sequence of a decoding batch: its state and its share of each step.

Owns `_Seq` (what the sequence feeds next: its rows, offsets and lookup drafts; its device-side
acceptance after the forward, packed into one result row; its host bookkeeping after the step's
one copy: output, blocks, candidates, lookup, fallback), `DecodeConfig` (the settings every
sequence decodes under), `SeqResult` and `to_device`. The batch loop that drives the sequences
is loop.py.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from .. import _native  # noqa: F401  (registers torch.ops.jacobi_ext)
from .controller import FallbackController
from .lookup import LookupPolicy, NgramIndex
from .trajectory import TrajectoryRecorder

SUMMARY = 8  # the verify op's summary (csrc/include/jacobi/verify.h, VerifySummary)
MAX_AR_DRAFT = max(LookupPolicy.SIZES)


@dataclass
class DecodeConfig:
    max_new: int
    eos: set[int]
    block_size: int  # n; 1 = AR from the start
    num_blocks: int  # K
    pool_size: int  # p
    activation_ratio: float
    cost_ratio: object = None  # q -> t(q)/t(1) for the fallback controller, or None
    lookup_cost: object = None  # q -> t(q)/t(1) for lookup drafts, or None (lookup off)
    cuda_graphs: bool | None = None
    fallback_window: int = 8  # parallel steps the controller judges at a time


@dataclass
class SeqResult:
    tokens: list[int]
    accepted: list[int] = field(default_factory=list)  # tokens committed by each forward
    candidate_wins: int = 0
    lookup_wins: int = 0
    mean_accepted_parallel: float | None = None  # for tuning.remember_acceptance


class _Seq:
    """One sequence's decoding state. Device tensors: main row, block ends, candidates, pool,
    sampling context; host: output, lookup index, policy, controller."""

    def __init__(self, b: int, prompt: list[int], cfg: DecodeConfig, dev, gen, streamer) -> None:
        self.b, self.cfg, self.dev, self.gen, self.streamer = b, cfg, dev, gen, streamer
        self.out: list[int] = []
        self.accepted: list[int] = []
        self.done = False
        self.wins = self.lookup_wins = 0
        self.seed = -1  # the next token (always correct); committed by the next step
        n, K = cfg.block_size, cfg.num_blocks
        self.parallel = n > 1
        self.policy = LookupPolicy(cfg.lookup_cost) if cfg.lookup_cost is not None else None
        self.index: NgramIndex | None = None
        self.prompt = prompt
        self.R = 2 + cfg.pool_size  # rows at most: main + pool + lookup
        self.eos_dev = torch.tensor(sorted(cfg.eos) or [-1], dtype=torch.long, device=dev)
        self.ctl = FallbackController(cfg.cost_ratio, cfg.fallback_window)
        self.recorder: TrajectoryRecorder | None = None
        self.draft: list[int] = []  # ar mode: this step's lookup drafts after the seed
        self.g = 0  # ar mode: their match class
        self.lk: tuple[int, int] | None = None  # parallel: (match class, row) of the lookup row
        if self.parallel:
            W = K * n
            self.ctx = torch.empty(len(prompt) + cfg.max_new + W, dtype=torch.long, device=dev)
            self.ctx[: len(prompt)] = torch.tensor(prompt, dtype=torch.long)
            self.ctx_len = len(prompt)
            p = cfg.pool_size
            self.pool = torch.full((p, W), -1, dtype=torch.long, device=dev)
            self.pool_len = torch.zeros(p, dtype=torch.int32, device=dev)
            self.pool_head = torch.zeros(1, dtype=torch.int32, device=dev)
            self.block_ends = torch.zeros(K, dtype=torch.int32, device=dev)
            self.block_ends[0] = n
            self.main_len, self.m = n, n
            self.cands = torch.empty(0, n, dtype=torch.long, device=dev)
            self.spawn = max(1, min(n, math.ceil(cfg.activation_ratio * n)))

    def sample_init(self) -> torch.Tensor:
        """n draft tokens drawn uniformly from the context (SPEC §1)."""
        idx = torch.randint(0, self.ctx_len, (self.cfg.block_size,), generator=self.gen)
        return self.ctx[to_device(idx, torch.long, self.dev)]

    # ---- what this sequence feeds in the next step -------------------------------------------
    def rows(self) -> tuple[list[torch.Tensor | list[int]], list[int], list[int]]:
        """(token pieces in order, row id per token, offset per token)."""
        if not self.parallel:
            self.draft, self.g = [], 0
            if self.policy is not None:
                self.g, j = self.index.match()
                room = self.cfg.max_new - len(self.out) - 1  # a step commits drafts + 1 more
                self.draft = self.index.continuation(j, min(self.policy.size(self.g), room))
            q = 1 + len(self.draft)
            return [[self.seed] + self.draft], [0] * q, list(range(q))
        C, m = self.cands.shape[0], self.m
        pieces = [self.main[: self.main_len]]
        seg, off = [0] * self.main_len, list(range(self.main_len))
        if C:
            pieces.append(self.cands[:, :m].reshape(-1))
            for c in range(C):
                seg += [c + 1] * m
                off += list(range(m))
        if self.recorder is not None:
            self.recorder.before_forward(self.main[: self.main_len].tolist())
        return pieces, seg, off

    # ---- device work after the forward: the packed result row ---------------------------------
    def verify(self, toks: torch.Tensor, greedy: torch.Tensor, width: int, R: int):
        """Run acceptance for this sequence on the device. toks/greedy: its [q] fed tokens and
        argmax. Returns (packed row [SUMMARY + width + K + p + R] int64, K/V source offset in
        scratch (device scalar), count (device scalar))."""
        dev = toks.device
        if not self.parallel:
            q = toks.shape[0]
            match = (toks[1:] == greedy[:-1]).long()
            acc = (
                1 + match.cumprod(0).sum()
                if q > 1
                else torch.ones((), dtype=torch.long, device=dev)
            )
            if self.cfg.eos:  # cap at the first EOS (inclusive)
                eos = self.eos_dev
                is_eos = torch.isin(toks, eos)
                first = torch.where(is_eos, torch.arange(q, device=dev), q).min() + 1
                acc = torch.minimum(acc, first)
            seed = greedy.gather(0, (acc - 1)[None])[0]
            fin = (
                torch.isin(toks.gather(0, (acc - 1)[None]), eos)[0].long()
                if self.cfg.eos
                else acc * 0
            )
            summary = torch.stack(
                [acc * 0, acc, fin, acc * 0 + 1, acc * 0 + 1, seed, acc * 0, acc * 0]
            )
            commit = torch.full((width,), -1, dtype=torch.long, device=dev)
            commit[:q] = toks
            extra = torch.zeros(self._tail(R), dtype=torch.long, device=dev)
            return torch.cat([summary, commit, extra]), acc * 0, acc
        C, m, ml = self.cands.shape[0], self.m, self.main_len
        Rr, Wr = 1 + C, max(ml, m)
        tok_rows = torch.full((Rr, Wr), -1, dtype=torch.long, device=dev)
        g_rows = torch.full((Rr, Wr), -1, dtype=torch.long, device=dev)
        tok_rows[0, :ml] = toks[:ml]
        g_rows[0, :ml] = greedy[:ml]
        if C:
            tok_rows[1:, :m] = toks[ml:].view(C, m)
            g_rows[1:, :m] = greedy[ml:].view(C, m)
        row_len = to_device([ml] + [m] * C, torch.int32, dev)
        eos_id = min(self.cfg.eos) if self.cfg.eos else -1
        acc, summary, commit, nxt, ends, cands, cand_len = torch.ops.jacobi_ext.verify_step(
            tok_rows, g_rows, row_len, self.block_ends, self.sample_init(), self.pool,
            self.pool_len, self.pool_head, self.spawn, eos_id,
        )  # fmt: skip
        self._next = (nxt, ends, cands, commit)
        n, p = self.cfg.block_size, cands.shape[0]
        packed = torch.full((SUMMARY + width + self._tail(R),), -1, dtype=torch.long, device=dev)
        packed[:SUMMARY] = summary
        packed[SUMMARY : SUMMARY + commit.shape[0]] = commit
        o = SUMMARY + width
        parts = [(ends, ends.shape[0]), (cand_len, p), (acc, R), (nxt[:n], n)]
        parts.append((cands.view(-1), p * n))
        for part, room in parts:
            packed[o : o + part.shape[0]] = part
            o += room
        w = summary[0]
        src = (w > 0).long() * (ml + (w - 1) * m)
        return packed, src, summary[1]

    def _tail(self, R: int) -> int:
        """Packed-row entries after the commit: next block ends, candidate lengths, acceptance
        per row, the next main row's first block, the next candidates."""
        c = self.cfg
        return c.num_blocks + c.pool_size + R + c.block_size + c.pool_size * c.block_size

    # ---- host work after the one copy ---------------------------------------------------------
    def advance(self, row: list[int], width: int, fed: int) -> None:
        cfg = self.cfg
        w, a, finished, next_len, _nb, seed, _nc, _ = row[:SUMMARY]
        committed = row[SUMMARY : SUMMARY + a]
        K, p = cfg.num_blocks, cfg.pool_size
        o = SUMMARY + width
        n = cfg.block_size
        ends, cand_len = row[o : o + K], row[o + K : o + K + p]
        o += K + p
        accs, o = row[o : o + self.R], o + self.R
        main_head, o = row[o : o + n], o + n
        cands_host = [row[o + c * n : o + (c + 1) * n] for c in range(p)]
        if self.parallel and self.lk is not None:  # what the lookup row would have committed
            self.policy.observe(self.lk[0], self.m - 1, accs[self.lk[1]] - 1)
            self.lookup_wins += w == self.lk[1]
        if not self.parallel and self.draft:
            self.policy.observe(self.g, len(self.draft), a - 1)
        extra = cfg.eos - ({min(cfg.eos)} if self.parallel and cfg.eos else set())
        if extra:  # EOS ids the device did not check: cut after the first one
            for i, t in enumerate(committed):
                if t in extra:
                    committed, a, finished = committed[: i + 1], i + 1, 1
                    break
        if len(self.out) + a > cfg.max_new:
            committed, a = committed[: cfg.max_new - len(self.out)], cfg.max_new - len(self.out)
        self.out += committed
        self.accepted.append(a)
        self.wins += self.parallel and w > 0
        self._put(committed)
        stop = bool(finished) or len(self.out) >= cfg.max_new
        if self.recorder is not None:
            self.recorder.after_commit(committed, self.main_len, stop)
        if stop:
            self.done = True
            return
        self.seed = seed
        if self.index is not None:
            self.index.extend(committed[1:] + [seed])
        if not self.parallel:
            self._maybe_finish_with_seed()
            return
        nxt, ends_t, cands, commit = self._next
        self.ctx[self.ctx_len : self.ctx_len + a] = commit[:a]
        self.ctx_len += a
        self.ctl.observe(a, fed)
        self.main, self.block_ends, self.main_len, self.m = nxt, ends_t, next_len, ends[0]
        if self.ctl.should_fall_back():
            self.parallel = False  # the same index and lookup record serve AR's drafts
            self._maybe_finish_with_seed()
            return
        keep = [c for c in range(p) if cand_len[c] > 0]
        self.cands = cands[to_device(keep, torch.long, self.dev)] if keep else cands[:0]
        self.lk = None
        if self.index is not None:
            self._add_lookup_candidate(main_head, [cands_host[c] for c in keep])
        self._maybe_finish_with_seed()

    def _maybe_finish_with_seed(self) -> None:
        """The seed is greedy's next token already: when it is the last one wanted, or EOS, it
        completes the output without another forward (credited to the forward that made it)."""
        if len(self.out) + 1 >= self.cfg.max_new or self.seed in self.cfg.eos:
            self.out.append(self.seed)
            self._put([self.seed])
            if self.accepted:
                self.accepted[-1] += 1
            if self.recorder is not None:
                self.recorder.before_forward([self.seed])
                self.recorder.after_commit([self.seed], 1, True)
            self.done = True

    def _put(self, toks: list[int]) -> None:
        if self.streamer is not None and toks:
            self.streamer.put(torch.tensor(toks, dtype=torch.long))

    def _add_lookup_candidate(self, main_head: list[int], cands: list[list[int]]) -> None:
        """Append the context-lookup row for the next first block (length m, starting with the
        seed) when the context has a match whose class still pays and the row differs from the
        main row and every recycled candidate (a duplicate cannot win). Decided on the host,
        from the tokens the step's copy brought back."""
        g, j = self.index.match()
        m = self.m
        if m < 2 or g == 0 or self.policy.size(g) == 0:
            return
        row = [self.seed] + self.index.continuation(j, m - 1)
        if row == main_head[:m] or any(row == c[:m] for c in cands):
            return
        n = self.cfg.block_size
        r = to_device([row + [-1] * (n - m)], torch.long, self.dev)
        self.lk = (g, self.cands.shape[0] + 1)
        self.cands = torch.cat([self.cands, r])

    def result(self) -> SeqResult:
        par = self.ctl.acc
        return SeqResult(
            self.out, self.accepted, int(self.wins), self.lookup_wins,
            sum(par) / len(par) if par else None,
        )  # fmt: skip


def to_device(data, dtype: torch.dtype, dev: torch.device) -> torch.Tensor:
    """A host list or tensor on `dev` without a stream sync: on CUDA through pinned memory with
    a non-blocking copy (a plain H2D copy waits for all queued GPU work, which would stop the
    host from preparing the next launches while the forward runs)."""
    t = data if isinstance(data, torch.Tensor) else torch.tensor(data, dtype=dtype)
    if dev.type != "cuda":
        return t.to(dtype)
    return t.to(dtype).pin_memory().to(dev, non_blocking=True)
