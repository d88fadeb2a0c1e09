"""Pure-Python restatement of the verify-accept-recycle step (csrc/include/jacobi/verify.h),
for one sequence (verify_step) and for a batch (verify_batch).

Written from docs/method.md §4-§5 without looking at indices the C++ way, so that the randomized
tests comparing it with torch.ops.jacobi_ext.verify_step check the semantics, not a transliteration.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from .next_draft import accepted_length, next_main_row  # the next-draft rule, shared


@dataclass
class StepResult:
    accept: list[int]
    winner: int
    accepted: int
    finished: bool
    commit: list[int]
    next_tokens: list[int]
    next_block_ends: list[int]
    candidates: list[list[int]]  # one per pool row; [] = no candidate
    pool: list[list[int]] = field(default_factory=list)
    pool_head: int = 0


def verify_step(
    rows: list[list[int]],
    greedy: list[list[int]],
    block_ends: list[int],
    init_tokens: list[int],
    pool: list[list[int]],
    pool_head: int,
    block_size: int,
    max_blocks: int,
    activation_ratio: float | None = None,
    spawn_threshold: int | None = None,
    eos: int | None = None,
) -> StepResult:
    """rows[0] is the main row (blocks in flight); rows[1:] are candidates ([] = absent)."""
    n = block_size
    thr = spawn_threshold if spawn_threshold is not None else math.ceil(activation_ratio * n)
    accept = [accepted_length(r, g, eos) for r, g in zip(rows, greedy, strict=True)]
    winner = max(range(len(rows)), key=lambda r: (accept[r], -r))
    a = accept[winner]
    row = rows[winner]
    commit = row[:a]
    finished = eos is not None and commit[-1] == eos
    nxt, ends = next_main_row(
        rows[0], greedy[0], a, block_ends, init_tokens, n, max_blocks, thr, finished,
        win_row=row, win_greedy=greedy[winner],
    )  # fmt: skip

    pool = [list(e) for e in pool]
    if pool and not finished and len(row) - a >= 2:
        pool[pool_head] = row[a:]  # the winner's rejected draft tail (width-capped by caller)
        pool_head = (pool_head + 1) % len(pool)
    candidates: list[list[int]] = []
    first_len = ends[0] if ends else 0
    for entry in pool:
        cand: list[int] = []
        if not finished and first_len >= 2 and nxt[0] in entry:
            j = entry.index(nxt[0])
            if j + 1 < len(entry):
                c = [entry[j + i] if j + i < len(entry) else nxt[i] for i in range(first_len)]
                if c != nxt[:first_len] and c not in candidates:
                    cand = c
        candidates.append(cand)
    return StepResult(accept, winner, a, finished, commit, nxt, ends, candidates, pool, pool_head)


def verify_batch(
    steps: list[dict | None],
    block_size: int,
    max_blocks: int,
    spawn_threshold: int,
    eos: int | None = None,
) -> list[StepResult | None]:
    """The batched op: sequence by sequence, sharing the sizes and knobs. steps[b] holds
    verify_step's arguments of sequence b (rows, greedy, block_ends, init_tokens, pool,
    pool_head), or is None for a sequence that takes no part this step (finished, or decoding as
    AR): its result is None, i.e. nothing accepted or committed, and its pool stays as it was."""
    return [
        None
        if s is None
        else verify_step(
            **s,
            block_size=block_size,
            max_blocks=max_blocks,
            spawn_threshold=spawn_threshold,
            eos=eos,
        )
        for s in steps
    ]


def ar_step_row(toks: list[int], tgt: list[int], fed: int, eos: set[int], width: int,
                tail: int) -> tuple[list[int], int]:  # fmt: skip
    """One sequence's packed row of an AR step (the ar_accept op's, jacobi/step_row.h), from the
    rule: it fed toks[:fed] (the seed, then lookup drafts) and the model predicted tgt. Accepted:
    1 + the longest run of drafts equal to the target before them, cut after the first EOS fed
    (over the seed alone where nothing was fed: such a row commits nothing). Returns (the row:
    summary, the fed tokens in `width` commit slots then -1, `tail` zeros; tokens to commit)."""
    from .step_row import FIELDS

    q = min(fed, len(toks))
    live = toks[: max(q, 1)]
    acc = 1
    while acc < len(live) and live[acc] == tgt[acc - 1]:
        acc += 1
    for i, t in enumerate(live[:acc]):
        if t in eos:
            acc = i + 1
            break
    fields = dict(accepted=acc, finished=int(toks[acc - 1] in eos), next_len=1, next_blocks=1,
                  next_seed=tgt[acc - 1])  # fmt: skip
    summary = [fields.get(f, 0) for f in FIELDS]
    commit = [toks[i] if i < q else -1 for i in range(width)]
    return summary + commit + [0] * tail, acc if fed > 0 else 0
