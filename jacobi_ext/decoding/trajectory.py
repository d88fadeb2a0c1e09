"""Trajectory recording for distillation (docs/method.md §2): every Jacobi iteration's block
state."""

from __future__ import annotations


class TrajectoryRecorder:
    """Records plain Jacobi's trajectory (docs/method.md §2): for every n-token block, every
    iteration's full state (the block's committed prefix ++ the current draft), each a fresh
    list, ending with the fixed point (greedy's tokens). A block cut short by EOS or the token cap
    ends with its shorter committed tokens; the caller pads it. ``forwards`` counts this sequence's
    forwards (in a batch, the steps it took part in)."""

    def __init__(self) -> None:
        self.blocks: list[list[list[int]]] = []
        self.forwards = 0
        self._prefix: list[int] = []
        self._states: list[list[int]] = []

    def before_forward(self, draft: list[int]) -> None:
        self.forwards += 1
        self._states.append(self._prefix + draft)

    def finish_with_seed(self, seed: int) -> None:
        """The last token came with the previous forward (the seed): a one-token block, no
        forward of its own."""
        self._states.append(self._prefix + [seed])
        self.after_commit([seed], 1, True)

    def after_commit(self, committed: list[int], draft_len: int, stop: bool) -> None:
        if len(committed) >= draft_len or stop:
            final = self._prefix + committed
            if self._states[-1] != final:
                self._states.append(final)
            self.blocks.append(self._states)
            self._prefix, self._states = [], []
        else:
            self._prefix = self._prefix + committed
