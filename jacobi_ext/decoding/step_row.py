"""The packed result row of a decoding step, as csrc/include/jacobi/step_row.h declares it.

A step ends with one int64 row per sequence, the only thing the host reads back:

    [summary | commit (width) | block ends (K) | candidate lengths (p) | acceptances (R) |
     next first block (n) | candidates (p * n)]

The layout is declared once, in that header, which the CPU ops and the CUDA kernels that write
rows include; Python reads it from the extension here (the step_summary_fields and
step_row_layout ops) rather than restating it.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch

from ..kernels import _native  # noqa: F401  (registers torch.ops.jacobi_ext)

#: The summary's fields in index order (winner, accepted, finished, next_len, next_blocks,
#: next_seed, num_candidates, reserved).
FIELDS: tuple[str, ...] = tuple(torch.ops.jacobi_ext.step_summary_fields().split(","))
SUMMARY = len(FIELDS)  # the summary's length (the commit slots start here)

# Plain ints (the host reads a few of them per sequence and step).
WINNER = FIELDS.index("winner")
ACCEPTED = FIELDS.index("accepted")
FINISHED = FIELDS.index("finished")
NEXT_LEN = FIELDS.index("next_len")
NEXT_BLOCKS = FIELDS.index("next_blocks")
NEXT_SEED = FIELDS.index("next_seed")


class RowLayout(NamedTuple):
    """Offsets of a step row's parts for one setting (and the row's length, `size`)."""

    commit: int
    block_ends: int
    candidate_len: int
    accept: int
    next_block: int
    candidates: int
    size: int

    @property
    def tail(self) -> int:
        """What follows the commit slots: the verify op's next state (zeros for an AR row)."""
        return self.size - self.block_ends


@functools.cache
def row_layout(
    width: int, num_blocks: int, pool_size: int, rows: int, block_size: int
) -> RowLayout:
    """The layout of a step row with `width` commit slots, `num_blocks` blocks, `pool_size` pool
    rows, `rows` verified rows and blocks of `block_size` tokens."""
    return RowLayout(
        *torch.ops.jacobi_ext.step_row_layout(width, num_blocks, pool_size, rows, block_size)
    )
