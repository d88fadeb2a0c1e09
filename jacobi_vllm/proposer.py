"""JacobiProposer: Jacobi decoding as a vLLM `custom_class` speculative proposer.

    LLM(model=DIR, dtype="float32",
        speculative_config={"model": "jacobi_vllm.JacobiProposer", "num_speculative_tokens": 15},
        additional_config={"jacobi": {"block_size": 16}})

vLLM verifies the proposed chain with its own rejection sampler, so the output is vLLM's greedy
output whatever the drafts are. The drafts are our engine's: after each step the request's main
row becomes the model's own predictions at the positions it did not accept (the Jacobi update,
jacobi_ext/decoding/next_draft.py, the same function the engine's reference step calls); a
converged block starts a new one from a context-lookup continuation where the context has a
match, else from context tokens; with `num_blocks` > 1 up to that many blocks ride one after the
other in the one chain vLLM verifies. The target's predictions come from the wrapper in
jacobi_vllm.hook; where it cannot be installed, drafts come from context lookup only.

Settings, all optional, in `additional_config={"jacobi": {...}}`:
- block_size (n): drafts per block; default (num_speculative_tokens + 1) // num_blocks.
- num_blocks (K): blocks in flight in the chain; default 1 (the paper's plain Jacobi).
- activation_ratio: a new block starts behind the newest one when this share of the newest has
  converged (the engine's multiblock rule); default 0.85.
- lookup: where context-lookup continuations (our NgramIndex) go, since vLLM verifies one chain
  a request and our engine's lookup row, verified beside the main row, has no place:
  "auto" (default): a new block starts from one where the context has a match, and one replaces
  the Jacobi tail for a step when lookups after a match of that length have been accepted
  longer, on average, than the tails (both learnt as the requests go, over a prior);
  "tail": one replaces the tail whenever the match has `lookup_min_match` tokens;
  "spawn": new blocks only; "off": new blocks from context tokens only.
- lookup_min_match: for "tail"; default 1.
- min_tail_accept: where each verified draft costs (a CPU), propose nothing rather than a block
  not expected to pay: while Jacobi tails have been accepted less than this many drafts a step
  on average (learnt as for "auto"), neither a tail nor a new block of context tokens (a lookup
  continuation still is). A step without drafts is a one-token forward, as vLLM's `ngram` makes
  without a match. Default 0: always a full block (a GPU, where a wide verify forward costs about
  a one-token one).
- cost_aware: size every step's drafts by what they cost, as our engine sizes its lookup drafts
  (the engine's own LookupPolicy, jacobi_ext/decoding/lookup.py): vLLM's step time per tokens
  verified is learnt from the time between the proposer's calls (StepClock), and each source's
  per-draft acceptance (the Jacobi tail; a lookup after a match of 1-3 tokens) from the steps
  verified; each step proposes the tail or the lookup continuation, cut to the length that
  commits the most tokens per unit of step time, or nothing where no length pays (a one-token
  step). For a CPU, where each verified draft costs; default False (a full block every step).
- draft_cost_prior: with cost_aware, the step time each extra verified token is assumed to add
  (a fraction of a one-token step) until two widths have been timed; default 0.1.
- seed: for the context tokens a new block starts from (they change the speed, never the
  output); default 0.
- record: keep every step's record and proposal in jacobi_vllm.hook.STATE.history and
  JacobiProposer.PROPOSALS (tests, benchmarks); default False.
- allow_untested_vllm: wrap vLLM versions other than those tested when the signature matches.

This module imports vLLM's names only inside the worker (vLLM imports it there) and never the
jacobi_ext package: the rule and the lookup index are loaded by file (jacobi_vllm._rules).
"""

from __future__ import annotations

import logging
import math
import random
import statistics
import time
from collections import deque
from dataclasses import dataclass, field

from . import hook
from ._rules import LookupPolicy, NgramIndex, accepted_length, next_main_row

logger = logging.getLogger("jacobi_vllm")

LOOKUP_MODES = ("auto", "tail", "spawn", "off")
# Prior drafts accepted a step, worth PRIOR_WEIGHT steps: the Jacobi tail, and a lookup after a
# match of g tokens (LookupPolicy's per-token priors 0.25 / 0.45 / 0.6, as rho / (1 - rho)).
PRIOR = {"jacobi": 0.5, 1: 0.33, 2: 0.8, 3: 1.5}
PRIOR_WEIGHT = 2.0


@dataclass
class _Req:
    """One request's state between steps (keyed by its vLLM request id)."""

    index: NgramIndex
    rng: random.Random
    main_len: int = 0  # 1 + drafts proposed last step (the row vLLM should verify next)
    block_ends: list[int] = field(default_factory=list)
    source: object = None  # where last step's first block came from: "jacobi", g (lookup), None


@dataclass
class Proposal:
    step: int
    req_id: str
    source: str  # "jacobi" (the tail), "spawn" (a new block), "tail-lookup", "lookup", "none"
    accepted: int  # drafts accepted in the step just verified
    draft: list[int]


class JacobiProposer:
    PROPOSALS: deque | None = None  # every proposal, when record is on (class-level: one worker)

    def __init__(self, vllm_config) -> None:
        spec = vllm_config.speculative_config
        self.k = int(spec.num_speculative_tokens)
        extra = vllm_config.additional_config
        cfg = dict((extra or {}).get("jacobi", {}) if isinstance(extra, dict) else {})
        unknown = set(cfg) - {
            "block_size", "num_blocks", "activation_ratio", "lookup", "lookup_min_match",
            "min_tail_accept", "cost_aware", "draft_cost_prior", "seed", "record",
            "allow_untested_vllm",
        }  # fmt: skip
        if unknown:
            raise ValueError(f"unknown jacobi settings in additional_config: {sorted(unknown)}")
        self.num_blocks = int(cfg.get("num_blocks", 1))
        self.block_size = int(cfg.get("block_size", (self.k + 1) // self.num_blocks))
        if self.block_size < 2 or self.num_blocks < 1:
            raise ValueError(
                f"jacobi block_size must be >= 2 and num_blocks >= 1, got {self.block_size}, "
                f"{self.num_blocks} (num_speculative_tokens={self.k})"
            )
        if self.block_size * self.num_blocks - 1 > self.k:
            raise ValueError(
                f"num_speculative_tokens={self.k} is less than block_size * num_blocks - 1 = "
                f"{self.block_size * self.num_blocks - 1}: raise it or lower the blocks"
            )
        ratio = float(cfg.get("activation_ratio", 0.85))
        self.spawn_threshold = math.ceil(ratio * self.block_size)
        self.lookup = cfg.get("lookup", "auto")
        if self.lookup not in LOOKUP_MODES:
            raise ValueError(f"jacobi lookup must be one of {LOOKUP_MODES}, got {self.lookup!r}")
        self.lookup_min_match = int(cfg.get("lookup_min_match", 1))
        self.min_tail_accept = float(cfg.get("min_tail_accept", 0.0))
        # drafts accepted a step, [sum, steps], per source ("jacobi", or a lookup's match length)
        self.accepted = {s: [v * PRIOR_WEIGHT, PRIOR_WEIGHT] for s, v in PRIOR.items()}
        self.cost_aware = bool(cfg.get("cost_aware", False))
        self.clock = StepClock(float(cfg.get("draft_cost_prior", 0.1)))
        # tokens the step's other requests verify, where a draft's cost is priced: those already
        # proposed for (1 + drafts), one for each still to come
        self._others = 0
        # per-draft acceptance, as the engine's lookup drafts learn theirs: lookups per match
        # length, and the Jacobi tail (class 1 of its own policy; prior: PRIOR["jacobi"] drafts
        # a step, as a per-draft rate)
        self.lookup_policy = LookupPolicy(self._cost_ratio)
        self.tail_policy = LookupPolicy(self._cost_ratio, max_n=1)
        rho = PRIOR["jacobi"] / (1 + PRIOR["jacobi"])
        self.tail_policy.accepted[1], self.tail_policy.rejected[1] = 2 * rho, 2 * (1 - rho)
        self.seed = int(cfg.get("seed", 0))
        self.max_model_len = int(vllm_config.model_config.max_model_len)
        record = bool(cfg.get("record", False))
        if record and JacobiProposer.PROPOSALS is None:
            JacobiProposer.PROPOSALS = deque()
        self.record = record
        self.jacobi = hook.install(
            record_history=record, allow_untested=bool(cfg.get("allow_untested_vllm", False))
        )
        self.reqs: dict[str, _Req] = {}
        logger.info(
            "jacobi_vllm: %s, block_size %d, num_blocks %d, lookup %s, %d drafts a step at most",
            "Jacobi drafts" if self.jacobi else "lookup-only drafts (see the warning above)",
            self.block_size, self.num_blocks, self.lookup, self.k,
        )  # fmt: skip

    def load_model(self, *args, **kwargs) -> None:
        """Nothing to load: the target's own predictions are the drafts."""

    # ---- vLLM's call, once a step, after the step's bookkeeping ---------------------------------
    def propose(
        self, sampled_token_ids, num_tokens_no_spec, token_ids_cpu, slot_mappings=None
    ) -> list[list[int]]:
        rec = hook.STATE.last if self.jacobi and hook.STATE.broken is None else None
        hook.STATE.last = None  # each record serves the step it was taken in, once
        if rec is not None and len(rec.req_ids) != len(sampled_token_ids):
            rec = None
        self.clock.step_ended(time.perf_counter())
        decided, pending = 0, sum(1 for s in sampled_token_ids if s)
        out: list[list[int]] = []
        live: set[str] = set()
        for i, sampled in enumerate(sampled_token_ids):
            rid = rec.req_ids[i] if rec is not None else None
            if rid is not None:
                live.add(rid)
            ntok = int(num_tokens_no_spec[i])
            room = min(self.k, self.max_model_len - ntok)
            if not sampled or room <= 0:  # a partial prefill, or no room left
                out.append([])
                continue
            ctx = token_ids_cpu[i, :ntok].tolist()
            pending -= 1
            self._others = decided + pending
            if rec is None:
                draft, source, acc = self._lookup_only(ctx, room), "lookup", -1
            else:
                draft, source, acc = self._jacobi(rid, rec.drafts[i], rec.argmax[i], sampled, ctx)
                draft = draft[:room]
                self.reqs[rid].main_len = 1 + len(draft)
            if self.record:
                JacobiProposer.PROPOSALS.append(
                    Proposal(rec.step if rec else -1, rid or str(i), source, acc, draft)
                )
            out.append(draft)
            decided += 1 + len(draft)
        if rec is not None:
            for gone in set(self.reqs) - live:  # finished, aborted or preempted
                del self.reqs[gone]
        self.clock.step_starts(time.perf_counter(), sum(1 + len(d) for d in out))
        return out

    # ---- drafts ---------------------------------------------------------------------------------
    def _rng_for(self, rid: str) -> random.Random:
        """The generator of a request's context tokens (a new block's drafts)."""
        return random.Random(f"{self.seed}:{rid}")

    def _state(self, rid: str, ctx: list[int]) -> _Req:
        st = self.reqs.get(rid)
        if st is None or len(st.index.toks) > len(ctx):
            st = _Req(NgramIndex(ctx), self._rng_for(rid))
            self.reqs[rid] = st
        else:
            st.index.extend(ctx[len(st.index.toks) :])
        return st

    def _jacobi(self, rid, verified, greedy, sampled, ctx) -> tuple[list[int], str, int]:
        st = self._state(rid, ctx)
        n, seed = self.block_size, ctx[-1]
        # The row vLLM verified: the token fed first (the previous step's bonus token, now the
        # last committed one before this step's tokens) and the drafts after it.
        row = [ctx[len(ctx) - len(sampled) - 1], *verified]
        a = accepted_length(row, greedy, None)
        if list(sampled) != row[1:a] + [greedy[a - 1]] or seed != greedy[a - 1]:
            # vLLM committed something else than the argmax chain (sampling, a logits
            # processor): the tail is not the model's greedy continuation; restart from lookup.
            st.block_ends, st.source = [], None
            return self._lookup_only(ctx, n - 1, st.index), "lookup", -1
        if st.source is not None and len(row) > 1:  # learn what last step's source gave
            acc = self.accepted.setdefault(st.source, [0.0, 0.0])
            acc[0] += a - 1
            acc[1] += 1
            policy, cls = self._policy(st.source)
            policy.observe(cls, len(row) - 1, a - 1)
        ends = st.block_ends if st.main_len == len(row) and st.block_ends else [len(row)]
        left = [e - a for e in ends if e - a > 0]
        g, j = st.index.match() if self.lookup != "off" else (0, -1)
        if not left and g > 0:
            init = [seed, *st.index.continuation(j, n - 1)]
        else:
            init = [seed] + [ctx[st.rng.randrange(len(ctx))] for _ in range(n - 1)]
        nxt, ends = next_main_row(
            row, greedy, a, ends, init, n, self.num_blocks, self.spawn_threshold, False
        )
        if self.cost_aware:
            return self._by_cost(st, nxt, ends, bool(left), g, j, seed, n, a)
        source, st.source = ("jacobi", "jacobi") if left else ("spawn", g or None)
        if left and g > 0 and self._lookup_beats_tail(g):
            cont = st.index.continuation(j, n - 1)
            if cont != nxt[1:n]:
                nxt, ends, source, st.source = [seed, *cont], [n], "tail-lookup", g
        if self._not_worth_it(source, g):  # a one-token step; the next starts a new block
            st.block_ends, st.source = [], None
            return [], "none", a - 1
        st.block_ends = ends
        return nxt[1:], source, a - 1

    # ---- cost_aware: each step's drafts cut to the length that pays -------------------------
    def _policy(self, source) -> tuple[LookupPolicy, int]:
        """The acceptance model of a step's source: the tail's, or the lookups' after g tokens."""
        return (self.tail_policy, 1) if source == "jacobi" else (self.lookup_policy, source)

    def _cost_ratio(self, q: int) -> float:
        """The step's time with this request verifying q tokens, over its time with this request
        verifying one (the other requests as proposed so far, one token each for those to come):
        the engine's cost curve, vLLM's measured."""
        return self.clock.ratio(self._others + q, self._others + 1)

    def _by_cost(self, st, nxt, ends, left, g, j, seed, n, a) -> tuple[list[int], str, int]:
        """The step's drafts under cost_aware: the Jacobi row (a tail, or a new block of context
        tokens) and, after a lookup match, the lookup continuation, each cut to the length its
        policy finds best; the one committing more per unit of time, or nothing."""
        options = []  # (gain, row, ends, source, what to learn from)
        if left or g == 0:
            k = self.tail_policy.size(1)
            cut = [e for e in ends if e < 1 + k] + [1 + k]
            learn = "jacobi" if left else None  # (a block of context tokens: nothing to learn)
            options.append((self.tail_policy.gain(1, k), nxt[: 1 + k], cut,
                            "jacobi" if left else "spawn", learn))  # fmt: skip
        if g > 0:
            k = min(self.lookup_policy.size(g), n - 1)
            row = [seed, *st.index.continuation(j, k)]
            options.append((self.lookup_policy.gain(g, k), row, [1 + k],
                            "tail-lookup" if left else "spawn", g))  # fmt: skip
        _, row, ends, source, learn = max(options, key=lambda o: o[0])
        if len(row) == 1:  # no length pays: a one-token step; the next starts afresh
            st.block_ends, st.source = [], None
            return [], "none", a - 1
        st.block_ends, st.source = ends, learn
        return row[1:], source, a - 1

    def _not_worth_it(self, source: str, g: int) -> bool:
        """min_tail_accept (see the module docstring): whether to propose nothing this step."""
        if self.min_tail_accept <= 0 or not (source == "jacobi" or (source == "spawn" and g == 0)):
            return False  # (a lookup continuation is always proposed)
        # a tail, or a new block of context tokens (what pays there is the tails' convergence)
        total, steps = self.accepted["jacobi"]
        return total / steps < self.min_tail_accept

    def _lookup_beats_tail(self, g: int) -> bool:
        if self.lookup == "tail":
            return g >= self.lookup_min_match
        if self.lookup != "auto":
            return False
        mean = {s: v[0] / v[1] for s, v in self.accepted.items() if v[1] > 0}
        return mean.get(g, 0.0) > mean["jacobi"]

    def _lookup_only(self, ctx, k, index=None) -> list[int]:
        """Drafts from context lookup only (the fallback): what followed the context's last 2-3
        tokens the last time they occurred."""
        index = index or NgramIndex(ctx[-4096:])
        g, j = index.match()
        return index.continuation(j, k) if g >= 2 else []


class StepClock:
    """vLLM's step time against the tokens the step verified, learnt from the proposer's own
    calls: vLLM calls propose() once a step, after the step's forward and sampling, so the time
    from one call's return to the next call is a step's, and the tokens it verified are the rows
    the first call proposed (1 + drafts for each request). The median of the last `keep` times
    per width; between widths timed, linear; beyond them, the nearest two's slope, or with one
    width timed `prior_slope` of its time per token. Non-decreasing in the width (a noisy wider
    step that timed faster does not make drafts look free)."""

    def __init__(self, prior_slope: float = 0.1, keep: int = 15) -> None:
        self.prior_slope = prior_slope
        self.keep = keep
        self.times: dict[int, deque] = {}
        self._started: tuple[float, int] | None = None  # (when, width) of the step under way
        self._seen: list[tuple[int, float]] | None = None  # _curve's, until a step is timed

    def step_starts(self, now: float, width: int) -> None:
        self._started = (now, width) if width > 0 else None

    def step_ended(self, now: float) -> None:
        if self._started is not None:
            t0, w = self._started
            self.times.setdefault(w, deque(maxlen=self.keep)).append(now - t0)
            self._seen = None
        self._started = None

    def _curve(self) -> list[tuple[int, float]]:
        """(width, time) of the widths timed, non-decreasing; made once a step (a step's
        proposals price every draft length of every request against it)."""
        if self._seen is None:
            seen, top = [], 0.0
            for w in sorted(self.times):
                top = max(top, statistics.median(self.times[w]))
                seen.append((w, top))
            self._seen = seen
        return self._seen

    def time(self, w: int) -> float | None:
        """The expected time of a step verifying w tokens (None: nothing timed yet)."""
        seen = self._curve()
        if not seen:
            return None
        if len(seen) == 1:
            w0, t0 = seen[0]
            return t0 * max(1.0 + self.prior_slope * (w - w0), 1e-3)
        pairs = list(zip(seen, seen[1:], strict=False))
        (w0, t0), (w1, t1) = pairs[0] if w < seen[0][0] else pairs[-1]
        for (a0, b0), (a1, b1) in pairs:
            if a0 <= w <= a1:
                (w0, t0), (w1, t1) = (a0, b0), (a1, b1)
                break
        return max(t0 + (t1 - t0) * (w - w0) / (w1 - w0), 1e-9)

    def ratio(self, w: int, base: int) -> float:
        """time(w) / time(base); before any step is timed, the prior's."""
        tw, tb = self.time(w), self.time(base)
        if tw is None or tb is None:
            return max(1.0 + self.prior_slope * (w - base), 1e-3)
        return tw / tb
