"""Context-lookup drafts (prompt-lookup decoding, lossless): an n-gram index over prompt +
committed tokens that proposes what followed the context's last 1-3 tokens the last time they
occurred, and a cost-aware policy that decides per step how many such drafts to verify."""

from __future__ import annotations


class NgramIndex:
    """Context n-gram index for lookup drafting: after the context's last g tokens (g = max_n
    down to 1), the tokens that followed their most recent earlier occurrence. Code repeats
    itself (names, signatures, whole lines of the prompt), so these are often exactly what
    greedy decoding produces next. O(max_n) per appended token and per query."""

    def __init__(self, tokens: list[int], max_n: int = 3) -> None:
        self.max_n = max_n
        self.toks: list[int] = []
        self.ends: list[dict[tuple[int, ...], int]] = [{} for _ in range(max_n)]
        self.extend(tokens)

    def extend(self, tokens: list[int]) -> None:
        for t in tokens:
            i = len(self.toks) - 1  # position i gains a successor: its n-grams become useful
            for g in range(1, min(self.max_n, i + 1) + 1):
                self.ends[g - 1][tuple(self.toks[i - g + 1 : i + 1])] = i
            self.toks.append(t)

    def match(self) -> tuple[int, int]:
        """(g, j): the longest g whose last-g-token n-gram occurred before, ending at position j
        (most recent occurrence); (0, -1) when even the last token is new."""
        for g in range(min(self.max_n, len(self.toks)), 0, -1):
            j = self.ends[g - 1].get(tuple(self.toks[-g:]))
            if j is not None:
                return g, j
        return 0, -1

    def continuation(self, j: int, k: int) -> list[int]:
        """k tokens copied from after position j. The copy may overlap its own output (as in
        LZ77): after a match ending just before the end, a loop of period p continues as a loop,
        instead of yielding only the p tokens that exist so far."""
        out: list[int] = []
        n = len(self.toks)
        for i in range(j + 1, j + 1 + max(k, 0)):
            out.append(self.toks[i] if i < n else out[i - n])
        return out


class LookupPolicy:
    """How many lookup-draft tokens to verify per step, from the measured cost curve and the
    acceptance such drafts have shown. A step feeding the next token plus k drafts costs
    t(1+k)/t(1) AR steps and commits 1 + j tokens (j drafts accepted); modelling j as geometric
    with per-token acceptance rho, E[1+j] = (1 - rho^(k+1)) / (1 - rho). k is the size that
    maximises E[1+j] / cost, 0 (plain AR) when no size pays.

    rho is kept per match length g (a draft after a repeated 3-gram is far likelier right than
    one after a repeated token): the maximum-likelihood estimate accepted / (accepted +
    rejections), over a prior worth two drafts. A class that stopped paying is still probed
    with one draft token every `probe_every` matches, so it can recover when the text turns
    repetitive; that costs at most t(2)/t(1) - 1 of one step in `probe_every`."""

    SIZES = (1, 2, 3, 4, 6, 8, 12, 16)
    PRIOR = {1: 0.25, 2: 0.45, 3: 0.6}

    def __init__(self, cost_ratio, max_n: int = 3, probe_every: int = 32) -> None:
        self.cost_ratio = cost_ratio
        self.probe_every = probe_every
        self.accepted = {g: 2 * self.PRIOR.get(g, 0.6) for g in range(1, max_n + 1)}
        self.rejected = {g: 2 - self.accepted[g] for g in range(1, max_n + 1)}
        self.skipped = dict.fromkeys(range(1, max_n + 1), 0)

    def rho(self, g: int) -> float:
        return self.accepted[g] / (self.accepted[g] + self.rejected[g])

    def gain(self, g: int, k: int) -> float:
        """E[1 + j] / cost with k drafts after a match of g tokens: tokens committed per
        one-token step's time."""
        rho = min(self.rho(g), 0.999)
        return (1.0 - rho ** (k + 1)) / (1.0 - rho) / self.cost_ratio(1 + k)

    def size(self, g: int) -> int:
        if g <= 0:
            return 0
        best, best_k = 1.0, 0
        for k in self.SIZES:
            gain = self.gain(g, k)
            if gain > best * 1.02:  # a 2% margin: measurement noise is not a speedup
                best, best_k = gain, k
        if best_k == 0:
            self.skipped[g] += 1
            if self.skipped[g] % self.probe_every == 0:
                return 1
        return best_k

    def observe(self, g: int, offered: int, accepted: int) -> None:
        if offered:
            self.accepted[g] += accepted
            self.rejected[g] += accepted < offered
