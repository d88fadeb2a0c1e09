"""The decoding loop: a batch of sequences, one model forward per step for all of them.

Each sequence decodes in one of two modes and may switch from the first to the second:
  - parallel (`jacobi`, `multiblock`): its rows are the main row (the blocks in flight) and
    candidate rows (recycled drafts, the context-lookup row) for the first block; the fused op
    torch.ops.jacobi_ext.verify_step decides acceptance, winner, commit, next drafts, spawning
    and the recycling pool (docs/method.md §4-§5), one launch for every parallel sequence of the
    batch;
  - ar: its row is the next token (the seed, always correct) and, with lookup, draft tokens
    after it; the longest matching prefix is committed (prompt-lookup decoding).
Either way a step commits, per sequence, a prefix of one of its rows whose K/V this very
forward computed exactly, and knows the next token (the seed) for free: output is token for
token what greedy decoding produces.

Per step the host plans each sequence's rows (sequence.py) into one input tensor, the device
runs the whole step (step.py: the forward, the verify op, the K/V commit, the next drafts; one
CUDA graph replay on GPUs), and one device->host copy brings back, for every sequence, the step
summary and its committed tokens. Everything the host decides next (row layout, lookup drafts)
comes from that copy.

Owns `decode` (prefill, then the step loop over the batch) and `DecodeStats`; each sequence's
host state and plans live in sequence.py, the device step in step.py, the cache and the forward
in runtime.py.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from .lookup import NgramIndex
from .runtime import StaticRuntime, runtime_for
from .sequence import DecodeConfig, SeqResult, _Seq
from .step import MAX_AR_DRAFT, BatchStep
from .step_row import ACCEPTED
from .stopping import StopCheck
from .trajectory import TrajectoryRecorder

__all__ = ["DecodeConfig", "DecodeStats", "SeqResult", "decode"]


@dataclass
class DecodeStats:
    forwards: int = 0
    seconds: float = 0.0
    prefill_seconds: float = 0.0
    host_seconds: float = 0.0  # host work outside the device step (planning, bookkeeping)
    warmup_seconds: float = 0.0
    graph_replays: int = 0
    widths: list[int] = field(default_factory=list)
    step_seconds: list[float] = field(default_factory=list)  # each step, device step to host


def _sync(dev) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def _own_copy(gen: torch.Generator) -> torch.Generator:
    """Each sequence draws its initial drafts from its own copy of the generator, so what it
    does (its drafts, its trajectory) is what it would do alone, whatever its batch."""
    g = torch.Generator(device=gen.device)
    g.set_state(gen.get_state())
    return g


def _settle(seqs: list[_Seq], before: list[int], stop: StopCheck | None, streamer) -> None:
    """After the sequences took their step's tokens: the stopping criteria cut each row where
    they fire, then the streamer (batch 1) gets what stays, so it never sees a token past a stop."""
    if stop is not None:
        stop.check(seqs, before)
    if streamer is not None:
        new = seqs[0].out[before[seqs[0].b] :]
        if new:
            streamer.put(torch.tensor(new, dtype=torch.long))


@torch.inference_mode()
def decode(
    model,
    prompts: list[list[int]],
    cfg: DecodeConfig,
    gen: torch.Generator,
    streamer=None,
    recorders: list[TrajectoryRecorder] | None = None,
    keys: torch.Tensor | None = None,
    stop: StopCheck | None = None,
) -> tuple[list[SeqResult], DecodeStats]:
    """Decode every prompt, greedily or (cfg.sampling) with the sampled argmax under the noise
    keys [B, 2] (jacobi_ext.decoding.sampling.stream_keys); one forward per step for the whole
    batch. `stop`: stopping criteria asked at every committed position (stopping.py)."""
    dev = next(model.parameters()).device
    B, P = len(prompts), max(len(p) for p in prompts)
    n, K, p = cfg.block_size, cfg.num_blocks, cfg.pool_size
    par_width = K * n + (p + 1) * n if n > 1 else 0
    ar_width = 1 + (MAX_AR_DRAFT if cfg.lookup_cost is not None else 0)
    width_max = max(par_width, ar_width)
    # A step may commit past max_new before the host cuts it: room for one more row.
    rt: StaticRuntime = runtime_for(
        model, B, P + cfg.max_new + width_max, width_max, cfg.cuda_graphs
    )
    width = rt.scratch  # commit width: a row never exceeds the scratch
    warm0, replays0 = rt.warmup_seconds, rt.graph_replays  # the runtime outlives this call
    key = BatchStep.key(n, K, p, cfg.activation_ratio, cfg.eos, cfg.sampling)
    bs = rt.batch_steps.get(key)
    if bs is None:  # kept with the runtime: its graphs are reused by the next calls
        bs = rt.batch_steps[key] = BatchStep(
            rt, n, K, p, cfg.activation_ratio, cfg.eos, cfg.sampling
        )
    bs.reset(prompts, keys)
    seqs = [_Seq(b, pr, cfg, _own_copy(gen), bs.cand0, bs.host0) for b, pr in enumerate(prompts)]
    streamer = streamer if B == 1 else None  # transformers' streamers take one sequence
    for s, rec in zip(seqs, recorders or [], strict=False):
        s.recorder = rec
    if streamer is not None:
        streamer.put(torch.tensor(prompts[0], dtype=torch.long))
    stats = DecodeStats()

    # Prefill (with drafting for the parallel methods): prompt ++ n context tokens; the argmax
    # over the draft slots is the first draft. Only the prompt's K/V are kept.
    pad = torch.tensor([P - len(pr) for pr in prompts], dtype=torch.long, device=dev)
    ids = torch.zeros(B, P, dtype=torch.long)
    for b, pr in enumerate(prompts):
        ids[b, P - len(pr) :] = torch.tensor(pr, dtype=torch.long)
    ids = ids.to(dev)
    _sync(dev)
    t0 = time.perf_counter()
    drafts = bs.drafts([s.sample_positions() for s in seqs]) if n > 1 else None
    greedy = rt.prefill(ids, pad, drafts, bs.rule)  # the prompt's last token's, the drafts'
    first = greedy[:, : max(n, 1)]
    bs.start(first)
    first_host = first.tolist()
    for s in seqs:
        s.seed = first_host[s.b][0]
        if s.policy is not None:
            s.index = NgramIndex(s.prompt + [s.seed])
        s._maybe_finish_with_seed()
    _settle(seqs, [0] * B, stop, streamer)
    _sync(dev)
    t1 = time.perf_counter()
    stats.prefill_seconds = t1 - t0

    hi_host = [rt.scratch + P] * B
    fast = B == 1 and not (recorders and recorders[0]) and bs.ar_fast()  # (step.BatchStep.ar_row)
    while True:
        active = [s for s in seqs if not s.done]
        if not active:
            break
        th = time.perf_counter()
        plans = {s.b: s.plan() for s in active}
        for s in active:
            if s.recorder is not None and s.parallel:
                s.recorder.before_forward(bs.main_row(s.b, s.main_len))
        Q = rt.width(max(pl.q for pl in plans.values()))
        stats.host_seconds += time.perf_counter() - th
        ts = time.perf_counter()
        if fast:  # one AR sequence on a CPU: the same step from lists
            rows = [bs.ar_row(plans[0], hi_host[0])]
        else:
            packed = bs.run(plans, Q, max(hi_host))  # the whole step, on the device
            rows = packed.tolist()  # the step's one device -> host copy
        stats.forwards += 1
        stats.widths.append(Q)
        tv = time.perf_counter()
        stats.step_seconds.append(tv - ts)
        before = [len(s.out) for s in seqs]
        for s in active:
            row = rows[s.b]
            hi_host[s.b] += row[ACCEPTED]
            if hi_host[s.b] > rt.capacity:  # (free: the host's copy; the runtime is sized so)
                raise RuntimeError(
                    f"sequence {s.b} committed past the cache's {rt.capacity} slots (a sizing "
                    "bug: the device skips such a commit, so its tokens would be lost)"
                )
            s.advance(row, width, plans[s.b].q)
        _settle(active, before, stop, streamer)
        stats.host_seconds += time.perf_counter() - tv
    _sync(dev)
    stats.seconds = time.perf_counter() - t1
    stats.warmup_seconds = rt.warmup_seconds - warm0
    stats.graph_replays = rt.graph_replays - replays0
    return [s.result() for s in seqs], stats
