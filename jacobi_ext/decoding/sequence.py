"""One sequence of a decoding batch: its host state and its share of each step.

Owns `_Seq`: what the sequence feeds next (`plan`: its rows and where their tokens come from,
lookup drafts, the context positions of a spawned block's drafts) and its host bookkeeping after
the step's one copy (`advance`: output, blocks, candidates, lookup, fallback to AR). Its device
state (next main row, candidates, pool, context) lives in the batch's buffers (step.py), which
the device step updates itself; the host keeps only what it needs to plan: lengths, which
candidate slots hold a row, the lookup row. Also `DecodeConfig` (the settings every sequence
decodes under) and `SeqResult`. The batch loop that drives the sequences is loop.py.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .controller import FallbackController
from .lookup import LookupPolicy, NgramIndex
from .step import Plan
from .step_row import ACCEPTED, FINISHED, NEXT_LEN, NEXT_SEED, WINNER, row_layout
from .trajectory import TrajectoryRecorder


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
    cuda_graphs: bool | str | None = None  # True / "capture", "compile", False (runtime.py)
    fallback_window: int = 8  # parallel steps the controller judges at a time
    sampling: object = None  # jacobi_ext.decoding.sampling.SamplingConfig, or None (greedy)


@dataclass
class SeqResult:
    tokens: list[int]
    accepted: list[int] = field(default_factory=list)  # tokens committed by each forward
    candidate_wins: int = 0
    lookup_wins: int = 0
    mean_accepted_parallel: float | None = None  # for tuning.remember_acceptance
    # The steps' cost in one-token forwards, sum of t(fed) / t(1) from the curve's ratios (None
    # without a curve): tokens / cost is the speed over plain AR (tuning.remember_mode_speed).
    cost: float | None = None


class _Seq:
    """One sequence's host state: output, lengths of its rows, candidate slots, lookup index,
    policy, controller (its device state is in the batch's buffers, step.BatchStep)."""

    def __init__(
        self, b: int, prompt: list[int], cfg: DecodeConfig, gen, cand0: int, host0: int
    ) -> None:
        self.b, self.cfg, self.gen = b, cfg, gen
        self.cand0, self.host0 = cand0, host0  # source buffer offsets (step.BatchStep)
        self.out: list[int] = []
        self.accepted: list[int] = []
        self.done = False
        self.wins = self.lookup_wins = 0
        self.seed = -1  # the next token (always correct); committed by the next step
        n = cfg.block_size
        self.parallel = n > 1
        self.policy = LookupPolicy(cfg.lookup_cost) if cfg.lookup_cost is not None else None
        self.index: NgramIndex | None = None
        self.prompt = prompt
        self.R = 2 + cfg.pool_size  # rows at most: main + pool + lookup
        self.ctl = FallbackController(cfg.cost_ratio, cfg.fallback_window)
        self.ratio = cfg.cost_ratio or cfg.lookup_cost  # q -> t(q) / t(1), or None
        self.cost = 0.0
        self.recorder: TrajectoryRecorder | None = None
        self.draft: list[int] = []  # ar mode: this step's lookup drafts after the seed
        self.g = 0  # ar mode: their match class
        self.lk: tuple[int, int] | None = None  # parallel: (match class, row) of the lookup row
        self.ctx_len = len(prompt)  # the context drafts are sampled from: prompt + committed
        self.main_len, self.m = n, n  # main row length, first block length
        self.slots: list[int] = []  # pool slots holding a candidate row for the next step
        self.lookup_row: list[int] | None = None

    def sample_positions(self) -> list[int]:
        """n context positions drawn uniformly (docs/method.md §4): a spawned block's draft
        tokens."""
        return torch.randint(0, self.ctx_len, (self.cfg.block_size,), generator=self.gen).tolist()

    # ---- what this sequence feeds in the next step -------------------------------------------
    def plan(self) -> Plan:
        if not self.parallel:
            self.draft, self.g = [], 0
            if self.policy is not None:
                self.g, j = self.index.match()
                room = self.cfg.max_new - len(self.out) - 1  # a step commits drafts + 1 more
                self.draft = self.index.continuation(j, min(self.policy.size(self.g), room))
            q = 1 + len(self.draft)
            h = self.host0
            return Plan([q], list(range(h, h + q)), [self.seed] + self.draft, True, [])
        m, n = self.m, self.cfg.block_size
        rows, idx = [self.main_len], list(range(self.main_len))
        for c in self.slots:
            rows.append(m)
            idx += range(self.cand0 + c * n, self.cand0 + c * n + m)
        host: list[int] = []
        if self.lookup_row is not None:
            rows.append(m)
            idx += range(self.host0, self.host0 + m)
            host = self.lookup_row
        return Plan(rows, idx, host, False, self.sample_positions())

    # ---- host work after the one copy ---------------------------------------------------------
    def advance(self, row: list[int], width: int, fed: int) -> None:
        cfg = self.cfg
        K, p, n = cfg.num_blocks, cfg.pool_size, cfg.block_size
        lay = row_layout(width, K, p, self.R, n)  # (jacobi/step_row.h, cached)
        w, a, finished = row[WINNER], row[ACCEPTED], row[FINISHED]
        next_len, seed = row[NEXT_LEN], row[NEXT_SEED]
        committed = row[lay.commit : lay.commit + a]
        ends = row[lay.block_ends : lay.block_ends + K]
        cand_len = row[lay.candidate_len : lay.candidate_len + p]
        accs = row[lay.accept : lay.accept + self.R]
        main_head = row[lay.next_block : lay.next_block + n]
        o = lay.candidates
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
        if self.ratio is not None:
            self.cost += self.ratio(fed)
        self.wins += self.parallel and w > 0
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
        self.ctx_len += a  # the device appended the same tokens to its context
        self.ctl.observe(a, fed)
        self.main_len, self.m = next_len, ends[0]  # the device holds the row itself
        if self.ctl.should_fall_back():
            self.parallel = False  # the same index and lookup record serve AR's drafts
            self._maybe_finish_with_seed()
            return
        self.slots = [c for c in range(p) if cand_len[c] > 0]
        self.lk, self.lookup_row = None, None
        if self.index is not None:
            self._add_lookup_candidate(main_head, [cands_host[c] for c in self.slots])
        self._maybe_finish_with_seed()

    def _maybe_finish_with_seed(self) -> None:
        """The seed is greedy's next token already: when it is the last one wanted, or EOS, it
        completes the output without another forward (credited to the forward that made it)."""
        if len(self.out) + 1 >= self.cfg.max_new or self.seed in self.cfg.eos:
            self.out.append(self.seed)
            if self.accepted:
                self.accepted[-1] += 1
            if self.recorder is not None:
                self.recorder.finish_with_seed(self.seed)
            self.done = True

    def _add_lookup_candidate(self, main_head: list[int], cands: list[list[int]]) -> None:
        """Add the context-lookup row for the next first block (length m, starting with the
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
        self.lk = (g, len(self.slots) + 1)
        self.lookup_row = row

    def result(self) -> SeqResult:
        par = self.ctl.acc
        return SeqResult(
            self.out, self.accepted, int(self.wins), self.lookup_wins,
            sum(par) / len(par) if par else None, self.cost if self.ratio is not None else None,
        )  # fmt: skip
