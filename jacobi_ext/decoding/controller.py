"""The fallback controller: when parallel steps stop paying, a sequence decodes as AR."""

from __future__ import annotations


class FallbackController:
    """Falls back to greedy AR when parallel steps commit fewer tokens than AR would have in the
    same time. In a step that fed q tokens, AR would have committed t(q) / t(1) tokens (the
    cost ratio from the measured curve); only ratios are used, so a machine that is busier now
    than when the curve was measured does not bias the decision. Judged on a sliding window."""

    def __init__(self, cost_ratio=None, window: int = 8) -> None:
        self.cost_ratio = cost_ratio  # q -> t(q) / t(1), or None: never fall back
        self.window = window
        self.acc: list[int] = []
        self.ar_equiv: list[float] = []

    def observe(self, accepted: int, tokens_fed: int) -> None:
        self.acc.append(accepted)
        if self.cost_ratio is not None:
            self.ar_equiv.append(self.cost_ratio(tokens_fed))

    def should_fall_back(self) -> bool:
        if self.cost_ratio is None or len(self.acc) < self.window:
            return False
        return sum(self.acc[-self.window :]) < sum(self.ar_equiv[-self.window :])
