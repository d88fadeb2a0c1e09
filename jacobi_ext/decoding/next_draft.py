"""The Jacobi next-draft rule, once: what a sequence's main row holds after a verified step.

Standard library only, and no imports from this package: the engine's reference step
(reference.verify_step, which tests/test_verify_op.py holds against the C++ verify op) calls it,
and so does the vLLM proposer (jacobi_vllm), which loads this file by its path inside vLLM's
worker without importing jacobi_ext (whose __init__ loads the compiled extension). Keep it that
way: tests/test_vllm_rule.py checks that this file imports nothing else.

Conventions (docs/method.md §4-§5). A row is the next token (the "seed": always right, the
previous step's bonus token) followed by draft tokens; `greedy[i]` is the model's argmax after
row[i], i.e. its prediction for row position i + 1. The main row holds up to `max_blocks` blocks
of `block_size` drafts one after the other; `block_ends[j]` is where block j ends in the row.
"""

from __future__ import annotations


def accepted_length(tokens: list[int], greedy: list[int], eos: int | None) -> int:
    """1 + longest prefix with tokens[i+1] == greedy[i], capped at the first EOS (inclusive)."""
    if not tokens:
        return 0
    a = 1
    for i in range(1, len(tokens)):
        if tokens[0] == eos or tokens[a - 1] == eos:
            break
        if tokens[i] != greedy[i - 1]:
            break
        a += 1
    return a


def next_main_row(
    main_row: list[int],
    main_greedy: list[int],
    a: int,
    block_ends: list[int],
    init_tokens: list[int],
    block_size: int,
    max_blocks: int,
    spawn_threshold: int,
    finished: bool,
    win_row: list[int] | None = None,
    win_greedy: list[int] | None = None,
) -> tuple[list[int], list[int]]:
    """(next main row, its block ends) after a step that accepted `a` tokens of the winning row
    (the main row unless `win_row` / `win_greedy` name a candidate row that won).

    The Jacobi update: every position p >= a of the row takes the model's argmax at p - 1 (from
    the winner where the winner reaches, else from the main row), the rejected positions
    included; so the next row is the new seed followed by the model's own predictions for the
    positions it did not accept. Blocks wholly committed leave the row. A new block of
    `block_size` is spawned at the end of the row when there is room (fewer than `max_blocks`
    in flight) and either no block is left or the newest one has at least `spawn_threshold`
    converged tokens; its first token is the seed (no block left) or the argmax after the row's
    last token, and the rest are `init_tokens[1:block_size]` (the caller's choice: context
    tokens in the engine, a context-lookup continuation where one matches). A finished sequence
    (EOS committed) spawns nothing.
    """
    n = block_size
    row = main_row if win_row is None else win_row
    g_w = main_greedy if win_greedy is None else win_greedy
    main_len = len(main_row)

    def greedy_before(p: int) -> int:  # the Jacobi update: position p takes the argmax at p-1
        return g_w[p - 1] if p - 1 < len(row) else main_greedy[p - 1]

    nxt = [greedy_before(p) for p in range(a, main_len)]
    ends = [e - a for e in block_ends if e - a > 0]
    # converged tokens of the newest block in flight (before this step's commit)
    if len(block_ends) == 1:
        converged = (n - block_ends[0]) + min(a, block_ends[0])
    else:
        s, e = block_ends[-2], block_ends[-1]
        converged = accepted_length(main_row[s:e], main_greedy[s:e], None)
    seed = g_w[a - 1]
    if not finished and len(ends) < max_blocks and (not ends or converged >= spawn_threshold):
        first = seed if not ends else greedy_before(main_len)
        ends.append(len(nxt) + n)
        nxt += [first] + list(init_tokens[1:n])
    return nxt, ends
