"""The decoding engine: greedy AR, plain Jacobi, and multi-block Jacobi with rejection recycling.

Every method produces exactly the tokens greedy autoregressive decoding produces (SPEC §1, §6):
a token is committed only when it equals the model's own argmax given the committed prefix.

One step of the parallel methods is one model forward over packed rows that share the committed
KV cache (no per-row cache copies):

    [ main row: the blocks in flight ][ candidate 1 ][ candidate 2 ] ...
      positions L .. L+M-1              L .. L+m-1     L .. L+m-1

The main row attends causally; each candidate (an alternative for the first block: recycled
from rejected drafts, or the context-lookup row, see NgramIndex) attends the committed prefix and
itself only (a block-diagonal "tree" mask). The fused op
torch.ops.jacobi_ext.verify_step then decides everything (acceptance per row, winner, commit,
next drafts, spawning, recycling pool) in one call; the host reads one small summary tensor,
moves the winner's accepted K/V into place when a candidate won, and truncates the cache.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

import torch

from .. import _native  # noqa: F401  (registers torch.ops.jacobi_ext)
from .cache import TruncatableCache

METHODS = ("ar", "jacobi", "multiblock")


@dataclass
class GenerateResult:
    """What `generate` returns. `tokens` holds only the generated tokens (EOS included if hit);
    for a batch, rows shorter than the longest are padded with `pad_token_id` and `lengths`
    gives each row's length."""

    tokens: torch.Tensor
    forwards: int
    seconds: float
    method: str
    block_size: int
    num_blocks: int
    pool_size: int
    prefill_seconds: float = 0.0
    lengths: list[int] = field(default_factory=list)
    accepted: list[int] = field(default_factory=list)  # tokens committed by each forward
    verify_seconds: float = 0.0  # time in the verify op and host bookkeeping, not the model
    candidate_wins: int = 0  # steps whose committed tokens came from a candidate row
    lookup_wins: int = 0  # of those, steps won by the context-lookup candidate

    @property
    def new_tokens(self) -> int:
        return sum(self.lengths) if self.lengths else int(self.tokens.shape[-1])

    @property
    def tokens_per_forward(self) -> float:
        return self.new_tokens / max(self.forwards, 1)

    @property
    def tokens_per_second(self) -> float:
        return self.new_tokens / self.seconds if self.seconds > 0 else float("nan")


def _eos_ids(model, eos_token_id) -> set[int]:
    if eos_token_id is None:
        cfg = getattr(model, "generation_config", None)
        eos_token_id = getattr(cfg, "eos_token_id", None)
        if eos_token_id is None:
            eos_token_id = getattr(model.config, "eos_token_id", None)
    if eos_token_id is None:
        return set()
    if isinstance(eos_token_id, int):
        return {eos_token_id}
    return {int(e) for e in eos_token_id}


def _max_positions(model) -> int | None:
    return getattr(model.config, "max_position_embeddings", None)


def _check_args(
    model, input_ids, max_new_tokens, method, block_size, num_blocks, pool_size, activation_ratio
) -> None:
    if method not in METHODS:
        raise ValueError(f"method must be one of {METHODS}, got {method!r}")
    if not isinstance(input_ids, torch.Tensor) or input_ids.dtype != torch.long:
        raise ValueError("input_ids must be a LongTensor of shape [batch, prompt_len]")
    if input_ids.dim() == 1:
        raise ValueError(
            f"input_ids must be 2-D [batch, prompt_len], got shape {tuple(input_ids.shape)}; "
            "use input_ids[None] for a single prompt"
        )
    if input_ids.dim() != 2 or input_ids.shape[0] < 1:
        raise ValueError(f"input_ids must be [batch, prompt_len], got {tuple(input_ids.shape)}")
    if input_ids.shape[1] == 0:
        raise ValueError("the prompt is empty: generation needs at least one prompt token")
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    if block_size is not None and block_size < 2:
        raise ValueError(f"block_size must be >= 2 (or None to tune it), got {block_size}")
    if num_blocks < 1:
        raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
    if pool_size < 0:
        raise ValueError(f"pool_size must be >= 0, got {pool_size}")
    if not 0.0 < activation_ratio <= 1.0:
        raise ValueError(f"activation_ratio must be in (0, 1], got {activation_ratio}")
    vocab = model.get_output_embeddings().weight.shape[0]
    if int(input_ids.max()) >= vocab or int(input_ids.min()) < 0:
        raise ValueError(f"input_ids hold token ids outside the model's vocabulary [0, {vocab})")


class _Streams:
    """Forwards committed tokens to a transformers-style streamer (put / end)."""

    def __init__(self, streamer, prompt: torch.Tensor) -> None:
        self.streamer = streamer
        if streamer is not None:
            streamer.put(prompt.cpu())

    def put(self, toks: list[int]) -> None:
        if self.streamer is not None and toks:
            self.streamer.put(torch.tensor(toks, dtype=torch.long))

    def end(self) -> None:
        if self.streamer is not None:
            self.streamer.end()


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

    def size(self, g: int) -> int:
        if g <= 0:
            return 0
        rho, best, best_k = min(self.rho(g), 0.999), 1.0, 0
        for k in self.SIZES:
            gain = (1.0 - rho ** (k + 1)) / (1.0 - rho) / self.cost_ratio(1 + k)
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


def _ar_loop(
    model,
    cache,
    L: int,
    tok: int,
    out: list[int],
    max_new: int,
    eos: set[int],
    streams: _Streams,
    lookup: tuple[NgramIndex, LookupPolicy] | None = None,
) -> list[int]:
    """Greedy AR from a committed prefix of L cached tokens and the next token `tok` (already
    appended to `out`). With `lookup`, a step also verifies up to k context-lookup draft tokens
    after `tok` (prompt-lookup decoding: lossless, since a draft token is committed only when it
    equals the argmax after its prefix). Returns the tokens committed by each forward."""
    dev = next(model.parameters()).device
    hist: list[int] = []
    pos = torch.empty(1, 1, dtype=torch.long, device=dev)
    ids = torch.empty(1, 1, dtype=torch.long, device=dev)
    while len(out) < max_new and tok not in eos:
        draft, g = [], 0
        if lookup is not None:
            g, j = lookup[0].match()
            room = max_new - len(out) - 1  # a step commits its drafts and one more token
            draft = lookup[0].continuation(j, min(lookup[1].size(g), room))
        if not draft:
            ids.fill_(tok)
            pos.fill_(L)
            logits = model(
                input_ids=ids, position_ids=pos, past_key_values=cache, use_cache=True,
                logits_to_keep=1,
            ).logits  # fmt: skip
            L += 1
            tok = int(logits[0, -1].argmax())
            new = [tok]
        else:
            q = 1 + len(draft)
            x = torch.tensor([tok] + draft, dtype=torch.long, device=dev)[None]
            p = torch.arange(L, L + q, device=dev)[None]
            logits = model(input_ids=x, position_ids=p, past_key_values=cache, use_cache=True)
            am = logits.logits[0].argmax(-1).tolist()
            j = 0
            while j < len(draft) and draft[j] == am[j]:
                j += 1
            lookup[1].observe(g, len(draft), j)
            new = draft[:j] + [am[j]]
            for i, t in enumerate(new):
                if t in eos:  # an accepted EOS ends generation: nothing after it counts
                    new = new[: i + 1]
                    break
            L += 1 + j
            cache.truncate(L)
            tok = new[-1]
        out += new
        if lookup:
            lookup[0].extend(new)
        streams.put(new)
        hist.append(len(new))
    return hist


@torch.inference_mode()
def _decode_ar(
    model,
    prompt: torch.Tensor,
    max_new: int,
    eos: set[int],
    streams: _Streams,
    policy: LookupPolicy | None = None,
):
    """Greedy AR with the same cache as the parallel methods (the baseline they must equal).
    With a lookup policy, lookup drafts ride along when they pay."""
    P = prompt.numel()
    cache = TruncatableCache(model.config, capacity=P + max_new + 1)
    t0 = time.perf_counter()
    logits = model(
        input_ids=prompt[None], past_key_values=cache, use_cache=True, logits_to_keep=1
    ).logits
    tok = int(logits[0, -1].argmax())
    t1 = time.perf_counter()
    out = [tok]
    streams.put([tok])
    lookup = (NgramIndex(prompt.tolist() + out), policy) if policy is not None else None
    hist = _ar_loop(model, cache, P, tok, out, max_new, eos, streams, lookup)
    t2 = time.perf_counter()
    return out, len(hist), t2 - t1, t1 - t0, hist, 0.0, (0, 0)


class TrajectoryRecorder:
    """Records plain Jacobi's trajectory (SPEC §2): for every n-token block, every iteration's
    full state (the block's committed prefix ++ the current draft), each a fresh list, ending with
    the fixed point (greedy's tokens). A block cut short by EOS or the token cap ends with its
    shorter committed tokens; the caller pads it."""

    def __init__(self) -> None:
        self.blocks: list[list[list[int]]] = []
        self._prefix: list[int] = []
        self._states: list[list[int]] = []

    def before_forward(self, draft: list[int]) -> None:
        self._states.append(self._prefix + draft)

    def after_commit(self, committed: list[int], draft_len: int, stop: bool) -> None:
        if len(committed) >= draft_len or stop:
            final = self._prefix + committed
            if self._states[-1] != final:
                self._states.append(final)
            self.blocks.append(self._states)
            self._prefix, self._states = [], []
        else:
            self._prefix = self._prefix + committed


class _Controller:
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


def _tree_mask(model, L: int, main_len: int, cand_len: int, n_cand: int, device, dtype):
    """Attention mask [1, 1, Q, L+Q] for the packed rows: the main row causal, each candidate row
    causal over the committed prefix and itself. Bool for SDPA-like backends, additive for eager."""
    Q = main_len + n_cand * cand_len
    seg = torch.zeros(Q, dtype=torch.long, device=device)
    idx = torch.arange(Q, device=device)
    for c in range(n_cand):
        seg[main_len + c * cand_len : main_len + (c + 1) * cand_len] = c + 1
    new = (seg[:, None] == seg[None, :]) & (idx[None, :] <= idx[:, None])
    mask = torch.cat([torch.ones(Q, L, dtype=torch.bool, device=device), new], dim=1)[None, None]
    if getattr(model.config, "_attn_implementation", "sdpa") == "eager":
        return torch.zeros(mask.shape, dtype=dtype, device=device).masked_fill_(
            ~mask, torch.finfo(dtype).min
        )
    return mask


@torch.inference_mode()
def _decode_parallel(
    model,
    prompt: torch.Tensor,
    max_new: int,
    eos: set[int],
    n: int,
    K: int,
    pool_size: int,
    activation_ratio: float,
    generator: torch.Generator,
    streams: _Streams,
    controller: _Controller,
    recorder: TrajectoryRecorder | None = None,
    lookup: LookupPolicy | None = None,
):
    dev = prompt.device
    P = prompt.numel()
    eos_id = min(eos) if eos else -1
    extra_eos = eos - {eos_id}  # the op knows one EOS id; any others are checked on the host
    W = K * n  # widest main row
    cap = P + max_new + W + pool_size * n + 1
    cache = TruncatableCache(model.config, capacity=cap)
    dtype = next(model.parameters()).dtype

    # Context tokens (prompt + committed) from which draft tokens are sampled (SPEC §1).
    ctx = torch.empty(P + max_new + W, dtype=torch.long, device=dev)
    ctx[:P] = prompt
    ctx_len = P

    def sample_init() -> torch.Tensor:
        idx = torch.randint(0, ctx_len, (n,), generator=generator, device=generator.device)
        return ctx[idx.to(dev)]

    # Prefill with drafting: prompt ++ n context tokens; the argmax over the draft slots is the
    # first draft. Only the prompt's K/V are kept.
    t0 = time.perf_counter()
    x = torch.cat([prompt, sample_init()])
    logits = model(input_ids=x[None], past_key_values=cache, use_cache=True).logits[0]
    g = logits[P - 1 :].argmax(-1)
    cache.truncate(P)
    main = g[:n].clone()  # g[0] is the seed (exact); g[1:n] the draft
    block_ends = torch.zeros(K, dtype=torch.int32, device=dev)
    block_ends[0] = n
    main_len = n
    t1 = time.perf_counter()

    pool = torch.full((pool_size, W), -1, dtype=torch.long, device=dev)
    pool_len = torch.zeros(pool_size, dtype=torch.int32, device=dev)
    pool_head = torch.zeros(1, dtype=torch.int32, device=dev)
    cands = torch.empty(0, n, dtype=torch.long, device=dev)
    spawn_threshold = max(1, min(n, math.ceil(activation_ratio * n)))

    # Context-lookup candidate (with `lookup`): one more candidate row per step, the seed and
    # then what followed the context's last 1-3 tokens the last time they occurred. The index
    # holds prompt + committed + the next seed (the seed is always committed next).
    index = NgramIndex(prompt.tolist() + [int(main[0])]) if lookup is not None else None
    lk: tuple[int, int] | None = None  # (match length g, row) of this step's lookup candidate

    out: list[int] = []
    accepted_hist: list[int] = []
    L = P
    forwards = wins = lookup_wins = 0
    verify_s = 0.0
    while True:
        C = cands.shape[0]
        m = int(block_ends[0]) if C else 0
        ids = torch.cat([main[:main_len], cands[:, :m].reshape(-1)]) if C else main[:main_len]
        pos = torch.cat(
            [torch.arange(L, L + main_len, device=dev)] + [torch.arange(L, L + m, device=dev)] * C
        )
        mask = _tree_mask(model, L, main_len, m, C, dev, dtype) if C else None
        if recorder is not None:
            recorder.before_forward(main[:main_len].tolist())
        logits = model(
            input_ids=ids[None],
            position_ids=pos[None],
            attention_mask=mask,
            past_key_values=cache,
            use_cache=True,
        ).logits[0]
        forwards += 1
        tv = time.perf_counter()
        greedy = logits.argmax(-1)
        R, Wr = 1 + C, max(main_len, m)
        tok_rows = torch.full((R, Wr), -1, dtype=torch.long, device=dev)
        g_rows = torch.full((R, Wr), -1, dtype=torch.long, device=dev)
        tok_rows[0, :main_len] = ids[:main_len]
        g_rows[0, :main_len] = greedy[:main_len]
        if C:
            tok_rows[1:, :m] = cands[:, :m]
            g_rows[1:, :m] = greedy[main_len:].view(C, m)
        row_len = torch.tensor([main_len] + [m] * C, dtype=torch.int32, device=dev)
        (_acc, summary, commit, next_tokens, next_ends, next_cands, next_cand_len) = (
            torch.ops.jacobi_ext.verify_step(
                tok_rows,
                g_rows,
                row_len,
                block_ends,
                sample_init(),
                pool,
                pool_len,
                pool_head,
                spawn_threshold,
                eos_id,
            )
        )
        # (kNextSeed: the next main row's first token, read here with the rest, no extra sync)
        w, a, finished, next_len, _, seed = summary[:6].tolist()
        if lk is not None:  # what the lookup row would have committed: its class's record
            lookup.observe(lk[0], m - 1, int(_acc[lk[1]]) - 1)
            lookup_wins += w == lk[1]
        committed = commit[:a].tolist()
        if extra_eos:  # other EOS ids: cut after the first one
            for i, t in enumerate(committed):
                if t in extra_eos:
                    committed, a, finished = committed[: i + 1], i + 1, 1
                    break
        if len(out) + a > max_new:
            committed, a = committed[: max_new - len(out)], max_new - len(out)
        if w > 0:  # a candidate won: its accepted K/V sit after the main row
            cache.move(L + main_len + (w - 1) * m, L, a)
            wins += 1
        L += a
        cache.truncate(L)
        out += committed
        ctx[ctx_len : ctx_len + a] = commit[:a]
        ctx_len += a
        accepted_hist.append(a)
        streams.put(committed)
        te = time.perf_counter()
        verify_s += te - tv
        stop = bool(finished) or len(out) >= max_new
        if recorder is not None:
            recorder.after_commit(committed, main_len, stop)
        if stop:
            break
        controller.observe(a, main_len + C * m)
        main, block_ends, main_len = next_tokens, next_ends, next_len
        if index is not None:
            index.extend(committed[1:] + [seed])
        if controller.should_fall_back():
            out.append(seed)
            streams.put([seed])
            # The same index and acceptance record go on serving AR's lookup drafts.
            ar_lookup = (index, lookup) if lookup is not None else None
            ar_hist = _ar_loop(model, cache, L, seed, out, max_new, eos, streams, ar_lookup)
            forwards += len(ar_hist)
            accepted_hist += ar_hist
            break
        cands = next_cands[next_cand_len > 0]  # [0, n] without a pool
        lk = None
        if index is not None:
            cands, lk = _add_lookup_candidate(index, lookup, seed, main, int(block_ends[0]), cands)
        verify_s += time.perf_counter() - te  # the rest of the host loop counts too
    t2 = time.perf_counter()
    return out, forwards, t2 - t1, t1 - t0, accepted_hist, verify_s, (wins, lookup_wins)


def _add_lookup_candidate(
    index: NgramIndex,
    policy: LookupPolicy,
    seed: int,
    main: torch.Tensor,
    m: int,
    cands: torch.Tensor,
) -> tuple[torch.Tensor, tuple[int, int] | None]:
    """Append the context-lookup candidate for the next step's first block (length m, starting
    with the seed, main[0]) to `cands`, when the context has a match whose class the policy
    still finds worth drafting, and the row differs from the main row and every recycled
    candidate (a duplicate cannot win). Returns (candidates, (g, row) or None); row counts the
    main row as 0."""
    g, j = index.match()
    if m < 2 or g == 0 or policy.size(g) == 0:
        return cands, None
    row = torch.full((1, cands.shape[1]), -1, dtype=cands.dtype, device=cands.device)
    row[0, :m] = torch.tensor([seed] + index.continuation(j, m - 1), dtype=row.dtype)
    if torch.equal(row[0, :m], main[:m]) or bool((cands[:, :m] == row[:, :m]).all(1).any()):
        return cands, None
    return torch.cat([cands, row]), (g, 1 + cands.shape[0])


def generate(
    model,
    input_ids: torch.Tensor,
    max_new_tokens: int = 256,
    method: str = "multiblock",
    block_size: int | None = None,
    num_blocks: int = 2,
    pool_size: int = 4,
    activation_ratio: float = 0.85,
    eos_token_id: int | list[int] | None = None,
    streamer=None,
    seed: int = 0,
    pad_token_id: int | None = None,
    trajectory: TrajectoryRecorder | None = None,
    lookup: bool | None = None,
) -> GenerateResult:
    """Generate greedily with `method` ("ar" | "jacobi" | "multiblock"); the tokens equal
    greedy autoregressive decoding's for every method.

    block_size None = chosen for this machine and model by the roofline tuner
    (`jacobi_ext.decoding.tuning`). "jacobi" is one block and no recycling; "multiblock" keeps up
    to `num_blocks` blocks in flight (a new one starts when the newest has converged
    `activation_ratio` of its tokens) and verifies up to `pool_size` recycled candidates per
    step. Generation stops at EOS (`eos_token_id`, default: the model's generation config) or
    after `max_new_tokens`. A batch is decoded one sequence at a time (correct, not batched).
    `trajectory` (method "jacobi" with a fixed block_size, batch 1) records every iteration's
    block states for distillation (python_training).

    `lookup` verifies context-lookup drafts too (lossless, like prompt-lookup decoding): in the
    parallel methods one more candidate row per step, in AR the drafts after the next token;
    how many, and whether at all, per match class from the measured cost curve and the
    acceptance such drafts have shown. Default (None): on for "multiblock" and for tuned
    settings (block_size=None), off for "ar" and a fixed-size "jacobi" (the paper's plain
    methods). `res.method` then ends in "+lookup".
    """
    _check_args(
        model,
        input_ids,
        max_new_tokens,
        method,
        block_size,
        num_blocks,
        pool_size,
        activation_ratio,
    )
    if trajectory is not None and (
        method != "jacobi" or block_size is None or input_ids.shape[0] != 1 or lookup
    ):
        raise ValueError(
            "recording a trajectory needs method='jacobi', a fixed block_size, "
            "a batch of one prompt and lookup off (a lookup win is not a Jacobi iteration)"
        )
    if lookup is None:
        lookup = method == "multiblock" or (method == "jacobi" and block_size is None)
    eos = _eos_ids(model, eos_token_id)
    limit = _max_positions(model)
    if limit is not None and input_ids.shape[1] + max_new_tokens > limit:
        raise ValueError(
            f"prompt ({input_ids.shape[1]} tokens) + max_new_tokens ({max_new_tokens}) exceeds "
            f"the model's context of {limit} positions"
        )
    cost_ratio = None  # no controller unless the settings are tuned
    if method == "ar":
        n, K, p = 1, 1, 0
    else:
        if block_size is None:
            # Tuned: the block size from the measured curve and the acceptance this model has
            # shown, and an online fallback to AR when the acceptance observed now is too low.
            from .tuning import choose_settings, step_curve

            curve = step_curve(model)
            s = choose_settings(
                model, method=method, num_blocks=num_blocks, pool_size=pool_size, curve=curve
            )
            block_size, num_blocks, pool_size = s.block_size, s.num_blocks, s.pool_size
            method = s.method
            cost_ratio = curve.cost_ratio
        n = block_size
        K, p = (1, 0) if method == "jacobi" else (num_blocks, pool_size)
    lookup_cost = cost_ratio
    if lookup and lookup_cost is None:  # a fixed block size: still weigh drafts by their cost
        from .tuning import step_curve

        lookup_cost = step_curve(model).cost_ratio
    device = next(model.parameters()).device
    gen = torch.Generator(device="cpu").manual_seed(seed)
    rows, total_f, total_s, total_pre, hist, verify_s = [], 0, 0.0, 0.0, [], 0.0
    wins = lookup_wins = 0
    for b in range(input_ids.shape[0]):
        prompt = input_ids[b].to(device)
        streams = _Streams(streamer if input_ids.shape[0] == 1 else None, prompt)
        policy = LookupPolicy(lookup_cost) if lookup else None
        if method == "ar" or n == 1:
            res = _decode_ar(model, prompt, max_new_tokens, eos, streams, policy)
        else:
            ctl = _Controller(cost_ratio)
            res = _decode_parallel(
                model,
                prompt,
                max_new_tokens,
                eos,
                n,
                K,
                p,
                activation_ratio,
                gen,
                streams,
                ctl,
                trajectory,
                policy,
            )
            if cost_ratio is not None and ctl.acc:
                from .tuning import estimate_rho, remember_acceptance

                window = n + (K - 1) * n // 2  # as tuning.predict credits K blocks
                rho = estimate_rho(sum(ctl.acc) / len(ctl.acc), window)
                remember_acceptance(model, rho, weight=len(ctl.acc))
        streams.end()
        toks, f, s, pre, h, vs, (cw, lw) = res
        rows.append(toks)
        total_f, total_s, total_pre = total_f + f, total_s + s, total_pre + pre
        verify_s, wins, lookup_wins = verify_s + vs, wins + cw, lookup_wins + lw
        hist += h
    width = max(len(r) for r in rows)
    pad = pad_token_id if pad_token_id is not None else (min(eos) if eos else 0)
    tokens = torch.full((len(rows), width), pad, dtype=torch.long)
    for i, r in enumerate(rows):
        tokens[i, : len(r)] = torch.tensor(r, dtype=torch.long)
    if lookup:
        method += "+lookup"
    return GenerateResult(
        tokens=tokens,
        forwards=total_f,
        seconds=total_s,
        method=method,
        block_size=n,
        num_blocks=K,
        pool_size=p,
        prefill_seconds=total_pre,
        lengths=[len(r) for r in rows],
        accepted=hist,
        verify_seconds=verify_s,
        candidate_wins=wins,
        lookup_wins=lookup_wins,
    )
