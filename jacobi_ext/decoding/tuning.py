"""Roofline tuning: choose block size, blocks in flight and pool size from this machine's
measured forward-time curve and the acceptance the model shows.

A decoding step that feeds Q tokens costs t(Q) (measured once per model / device / dtype /
thread count and cached as JSON) and commits E[a] tokens. Greedy AR commits 1 token per t(1).
A parallel configuration pays off only where E[a] / t(Q) > 1 / t(1).

Acceptance model: each draft token is accepted with probability rho given the ones before it
were, so a window of w tokens commits E[a](w) = (1 - rho^w) / (1 - rho) tokens (the seed always
counts). rho is estimated from what the engine observes (docs/method.md §4: drafts converge over
iterations, so this is an effective, not a per-iteration, rate) and remembered per model; a
model never seen before starts from an optimistic prior, and the engine's online controller
(engine._Controller) falls back to AR within a few steps when acceptance is too low.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import statistics
import tempfile
import time
import warnings
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch

from ..cache import cache_dir
from . import prepack

SIZES = (1, 2, 4, 8, 16, 32, 64, 128, 256)
BLOCK_SIZES = (4, 8, 16, 32, 64)
PRIOR_RHO = 0.6  # optimistic: a distilled model's effective acceptance on code is about this


def cpu_name() -> str:
    """The CPU's model name (/proc/cpuinfo), else what platform says."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def model_key(model) -> str:
    """Identity of (model weights, dtype, device, threads, compiled kernels): what the curve
    depends on.

    Read a few times per tuned `generate` call, so it is computed once per state of the
    weights: the cached key stands while every parameter keeps its storage and its version
    counter (an in-place update, a move or a cast changes one of them)."""
    params = list(model.parameters())
    try:
        stamp = (
            torch.get_num_threads(),
            prepack.backend(model),
            *((w.data_ptr(), w._version) for w in params),
        )
    except RuntimeError:  # inference tensors keep no version counter: no cache
        stamp = None
    cached = getattr(model, "_jacobi_ext_key", None)
    if stamp is not None and cached is not None and cached[0] == stamp:
        return cached[1]
    p = params[0]
    dev = str(p.device)
    hw = torch.cuda.get_device_name(p.device) if p.device.type == "cuda" else cpu_name()
    name = getattr(model.config, "_name_or_path", "") or model.config.model_type
    nparams = sum(x.numel() for x in params)
    # A few values of every weight tell a distilled checkpoint from its base model: a merged
    # LoRA adapter changes the attention and MLP projections, never the output embeddings, and
    # the two must not share an acceptance rate.
    # (One host sync for all: the sums stay on the device until the last one.)
    probe = float(
        torch.stack(
            [w.detach().flatten()[:: max(1, w.numel() // 8)][:8].double().sum() for w in params]
        ).sum()
    )
    from ..kernels._native import build_id

    raw = f"{name}|{nparams}|{probe:.6e}|{p.dtype}|{dev}|{hw}|{torch.get_num_threads()}"
    raw += f"|{build_id()}"  # the kernels measured: a rebuild measures again
    which = prepack.backend(model)
    if which is not None:  # packed CPU linears cost differently: a curve of their own
        raw += "|prepack" if which == "onednn" else f"|{which}"
    from ..models.quantized import describe, is_quantized, kv_cache_dtype

    if is_quantized(model):  # GGUF codes: their types and mode (8-bit activations) cost apart
        raw += f"|{describe(model)}"  # (and a half K/V cache)
    elif kv_cache_dtype(model) != p.dtype:  # a half K/V cache costs apart
        raw += f"|kv {kv_cache_dtype(model)}"
    key = hashlib.sha1(raw.encode()).hexdigest()[:16]
    if stamp is not None:
        model._jacobi_ext_key = (stamp, key)
    return key


@dataclass
class StepCurve:
    """Median forward time (s) for Q new tokens over a cache of `context` tokens."""

    sizes: list[int]
    seconds: list[float]
    context: int
    device: str
    dtype: str
    threads: int
    hardware: str

    def time(self, q: int) -> float:
        """t(q), interpolated linearly between measured sizes (extrapolated past the end)."""
        xs, ys = self.sizes, self.seconds
        if q <= xs[0]:
            return ys[0]
        for i in range(1, len(xs)):
            if q == xs[i]:  # a measured size: its own time (the formula may round it)
                return ys[i]
            if q < xs[i]:
                x0, x1, y0, y1 = xs[i - 1], xs[i], ys[i - 1], ys[i]
                return y0 + (y1 - y0) * (q - x0) / (x1 - x0)
        slope = (ys[-1] - ys[-2]) / (xs[-1] - xs[-2])
        return ys[-1] + slope * (q - xs[-1])

    def cost_ratio(self, q: int) -> float:
        """t(q) / t(1): what a forward of q tokens costs in one-token forwards (the decoding
        engine weighs parallel steps and lookup drafts by it)."""
        return self.time(q) / self.time(1)

    def knee(self) -> int:
        """Largest measured size whose cost is within 25% of a single-token forward: below it
        the forward is bound by reading the weights, above it by arithmetic."""
        base = self.seconds[0]
        k = self.sizes[0]
        for q, s in zip(self.sizes, self.seconds, strict=True):
            if s <= 1.25 * base:
                k = q
        return k


#: What a tuned call measures when it finds no curve for this model: one token, the usual block,
#: a wide one, over a cache of QUICK_CONTEXT tokens, one forward each after the probe's prefill
#: (a few forwards, against SIZES x 5 rounds for the full curve that `jacobi-forcing tune` and
#: the demo's plot measure: docs/decoding.md, "Tuning", has the times). A first tuned call should
#: not wait seconds for its answer: on a fresh cache it stays within 1.3x of the same call warm.
#: The steps tuned calls then run are timed and refine the curve (Tuner.add_step_times).
#: Every size runs on the same CPU kernel (the 8-bit linear's AMX tile starts past 64 rows:
#: csrc/cpu/linear_gguf_cpu.cpp, kAmxMinRows), so the sizes between them interpolate one kernel.
QUICK_SIZES = (1, 16, 64)
QUICK_CONTEXT = 8
QUICK_REPEATS = 1


@torch.inference_mode()
def measure_step_curve(
    model,
    sizes=SIZES,
    context: int = 256,
    repeats: int = 5,
    progress: bool = False,
    reduce=statistics.median,
    warmup=True,
) -> StepCurve:
    """Time one decoding step of q new tokens over a cache of `context` tokens, for each q, as
    the engine runs it (StepProbe: the static runtime; CUDA graph replay on GPUs). One warm-up
    call per size (`warmup`: True; or a tuple of the sizes to warm up), then `repeats` rounds,
    reduced per size by `reduce` (median)."""
    from .runtime import StepProbe

    p = next(model.parameters())
    dev = p.device
    probe = StepProbe(model, context=context, max_q=max(sizes))

    def one(q: int) -> float:
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        t0 = time.perf_counter()
        probe(q)
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        return time.perf_counter() - t0

    for q in sizes if warmup is True else (warmup or ()):
        one(q)
    # Rounds visit every size in turn, so a burst of load from another process lands on one
    # sample of each size rather than on all samples of one size; medians drop such samples.
    rounds = range(repeats)
    if progress:
        from tqdm import tqdm

        rounds = tqdm(rounds, desc="measuring forward time vs tokens", unit="round")
    times: dict[int, list[float]] = {q: [] for q in sizes}
    for _ in rounds:
        for q in sizes:
            times[q].append(one(q))
    secs = monotone([reduce(times[q]) for q in sizes])
    hw = torch.cuda.get_device_name(dev) if dev.type == "cuda" else cpu_name()
    return StepCurve(
        list(sizes), secs, context, str(dev), str(p.dtype), torch.get_num_threads(), hw
    )


def measure_quick_curve(model) -> StepCurve:
    """The few widths a tuned call needs (QUICK_SIZES), cheaply: see QUICK_SIZES."""
    return measure_step_curve(
        model, sizes=QUICK_SIZES, context=QUICK_CONTEXT, repeats=QUICK_REPEATS, reduce=min,
        warmup=(),
    )  # fmt: skip


def monotone(seconds: list[float]) -> list[float]:
    """A forward over more tokens never costs less: replace each time by the smallest time at
    that size or above (a noisy spike at a small size is corrected by the larger ones)."""
    out = list(seconds)
    for i in range(len(out) - 2, -1, -1):
        out[i] = min(out[i], out[i + 1])
    return out


def _profile_path(model) -> Path:
    return cache_dir() / "profiles" / f"{model_key(model)}.json"


def load_profile(model) -> dict:
    path = _profile_path(model)
    if path.is_file():
        try:
            return json.loads(path.read_text())
        except (OSError, json.JSONDecodeError):
            return {}
    return {}


def save_profile(model, profile: dict) -> None:
    """Write the profile atomically (an interrupted write never leaves a broken file). Each
    writer has its own temporary file, so processes decoding the same model at once (parallel
    eval shards) never rename each other's; the last rename wins. The profile is a cache: when it
    cannot be written (read-only or full disk), decoding goes on and says so once."""
    path = _profile_path(model)
    tmp = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, name = tempfile.mkstemp(dir=path.parent, prefix=path.stem + ".", suffix=".tmp")
        tmp = Path(name)
        with os.fdopen(fd, "w") as f:
            f.write(json.dumps(profile, indent=1))
        tmp.replace(path)
    except OSError as exc:
        if tmp is not None:
            tmp.unlink(missing_ok=True)
        if not _warned_unwritable:
            _warned_unwritable.append(str(path))
            warnings.warn(
                f"jacobi_ext: could not write the tuning profile {path} ({exc}); decoding goes "
                "on without saving it. Set JACOBI_EXT_CACHE to a writable folder to keep it.",
                stacklevel=2,
            )


_warned_unwritable: list[str] = []  # a failed profile write is reported once per process


def step_curve(
    model, remeasure: bool = False, progress: bool = False, full: bool = False
) -> StepCurve:
    """The cached curve for this model / device / dtype / threads (Tuner.curve), its profile
    written if it was measured now."""
    tuner = Tuner(model)
    curve = tuner.curve(remeasure=remeasure, progress=progress, full=full)
    tuner.save()
    return curve


#: Steps of one width a call must have run before its median time counts.
MIN_OBSERVED_STEPS = 3
#: The profile key that says its observed step times are at the probe's pace (add_step_times).
PACED_OBSERVATIONS = "observed_paced"


def remember_step_times(model, widths: list[int], seconds: list[float]) -> None:
    """Tuner.add_step_times, written to the model's profile."""
    tuner = Tuner(model)
    tuner.add_step_times(widths, seconds)
    tuner.save()


def refined(curve: StepCurve, observed: dict) -> StepCurve:
    """The probe's curve corrected by the step times tuned calls observed (at the probe's pace:
    Tuner.add_step_times): at an observed width, the observed time; elsewhere the probe's time
    scaled by the median ratio observed / probe over the observed widths (the host work a real
    step adds, in proportion)."""
    pts = {int(w): o["seconds"] for w, o in observed.items() if o.get("weight", 0) > 0}
    if not pts:
        return curve
    scale = statistics.median(s / curve.time(w) for w, s in pts.items())
    sizes = sorted(set(curve.sizes) | set(pts))
    secs = [pts[q] if q in pts else curve.time(q) * scale for q in sizes]
    return replace(curve, sizes=sizes, seconds=monotone(secs))


def _blend(old: float, w_old: float, new: float, weight: float, cap: float) -> tuple[float, float]:
    """(value, weight) after blending `new` (weight `weight`) into `old` (weight `w_old`, capped
    at `cap` so that recent observations keep counting)."""
    w_old = min(w_old, cap)
    total = w_old + weight
    return ((old * w_old + new * weight) / total if total else new), total


def remember_acceptance(model, rho: float, weight: float) -> None:
    """Tuner.add_acceptance, written to the model's profile."""
    tuner = Tuner(model)
    tuner.add_acceptance(rho, weight)
    tuner.save()


#: Modes a tuned call with lookup drafts races (measured speed over plain AR, see below).
PARALLEL, AR_LOOKUP = "parallel", "ar+lookup"
#: One tuned call in this many runs the mode that measured slower, so its figure stays current.
RETRY_LOSER_EVERY = 10


def remember_mode_speed(model, mode: str, speedup: float, weight: float) -> None:
    """Tuner.add_mode_speed, written to the model's profile."""
    tuner = Tuner(model)
    tuner.add_mode_speed(mode, speedup, weight)
    tuner.save()


def expected_accepted(rho: float, window: int) -> float:
    """E[tokens committed] for a draft window of `window` tokens (the seed included)."""
    if rho >= 1.0:
        return float(window)
    return (1.0 - rho**window) / (1.0 - rho)


def estimate_rho(mean_accepted: float, window: int) -> float:
    """Invert expected_accepted by bisection."""
    if mean_accepted <= 1.0:
        return 0.0
    if mean_accepted >= window:
        return 0.999
    lo, hi = 0.0, 0.999
    for _ in range(50):
        mid = (lo + hi) / 2
        if expected_accepted(mid, window) < mean_accepted:
            lo = mid
        else:
            hi = mid
    return (lo + hi) / 2


@dataclass
class Settings:
    method: str  # "ar" | "jacobi" | "multiblock"
    block_size: int
    num_blocks: int
    pool_size: int
    expected_speedup: float  # tokens/s over greedy AR: predicted, or measured once raced
    rho: float


def tokens_per_step(n: int, K: int, pool: int) -> int:
    """Tokens fed per forward at most: K blocks plus `pool` candidates of one block."""
    return n * K + pool * n


def predict(curve: StepCurve, rho: float, n: int, K: int, pool: int) -> float:
    """Predicted speed over AR. Extra blocks and candidates widen the effective window; we
    credit them conservatively: K blocks act as one window of n + (K-1) * n / 2 tokens, and
    recycling adds nothing to the estimate (it is measured, not assumed)."""
    window = n + (K - 1) * n // 2
    return expected_accepted(rho, window) / curve.time(tokens_per_step(n, K, pool)) * curve.time(1)


def choose_settings(
    model,
    method: str = "multiblock",
    num_blocks: int = 2,
    pool_size: int = 4,
    rho: float | None = None,
    curve: StepCurve | None = None,
    lookup: bool = False,
) -> Settings:
    """Tuner.choose for `model` (None: no profile, the prior acceptance; `curve` then needed)."""
    return Tuner(model).choose(method, num_blocks, pool_size, lookup, rho=rho, curve=curve)


class Tuner:
    """The roofline tuner of one model, as a tuned `generate` call uses it: it reads the model's
    profile (its curve, acceptance and measured mode speeds; one JSON file per model_key) once,
    chooses the settings, takes what the call observed, and writes the profile once."""

    def __init__(self, model) -> None:
        self.model = model
        self._profile: dict | None = None
        self._changed = False

    @property
    def profile(self) -> dict:
        if self._profile is None:
            self._profile = load_profile(self.model) if self.model is not None else {}
        return self._profile

    def save(self) -> None:
        """Write the profile if this tuner changed it."""
        if self._changed and self.model is not None:
            save_profile(self.model, self.profile)
        self._changed = False

    def _observed(self) -> dict:
        """The profile's observed step times; dropped where an older version wrote them as
        absolute times (before PACED_OBSERVATIONS), which do not mix with paced ones."""
        prof = self.profile
        if "observed" in prof and not prof.get(PACED_OBSERVATIONS):
            del prof["observed"]
            self._changed = True
        return prof.get("observed", {})

    def curve(self, remeasure: bool = False, progress: bool = False, full: bool = False):
        """The cached curve, measured on first use: the quick curve (a few widths, ~0.2 s) for a
        tuned call, the full one (every size in SIZES, seconds) with `full` (`jacobi-forcing
        tune`, the demo's plot), which then replaces the quick one. Where tuned calls have timed
        their own steps (add_step_times), the curve is refined by them (`refined`), except with
        `full` (what was measured, as measured)."""
        prof = self.profile
        if "curve" in prof and not remeasure:
            curve = StepCurve(**prof["curve"])
            if not full or list(curve.sizes) == list(SIZES):
                return curve if full else refined(curve, self._observed())
        model = self.model
        curve = measure_step_curve(model, progress=progress) if full else measure_quick_curve(model)
        prof["curve"] = asdict(curve)
        if remeasure:
            prof.pop("observed", None)
        self._changed = True
        return curve

    def add_step_times(self, widths: list[int], seconds: list[float]) -> None:
        """Blend the median time of the steps a call ran at each width into the profile (per
        width, recent calls counting most). These are whole steps as decoding runs them
        (forward, verification, bookkeeping), timed where the tuner's probe times the forward
        alone, so `refined` uses their ratios to each other and to the probe, not their size.

        Each call's times are first brought to the probe's pace: divided by the call's median
        ratio observed / probe over its widths. Calls run in different minutes of a host whose
        pace moves (by 2x within one benchmark run on a shared machine), and each sees only
        some widths (AR with lookup: 1 and its drafts'; a parallel call: its block's): blended
        as they were, a width seen only in a fast minute looked cheaper than a smaller one seen
        in all minutes, and the tuner picked a block twice the best one. Paced, a call informs
        the curve's shape (its widths' times relative to each other), not the minute's pace;
        a call with one width counted (plain AR, a parallel call without drafts) tells none."""
        by: dict[int, list[float]] = {}
        for w, sec in zip(widths, seconds, strict=True):
            by.setdefault(int(w), []).append(sec)
        med = {w: statistics.median(v) for w, v in by.items() if len(v) >= MIN_OBSERVED_STEPS}
        prof = self.profile
        if len(med) < 2 or "curve" not in prof:  # (priced steps were priced by a curve)
            return
        obs = self._observed()
        probe = StepCurve(**prof["curve"])
        pace = statistics.median(s / probe.time(w) for w, s in med.items())
        for w, s in med.items():
            old = obs.get(str(w), {"seconds": 0.0, "weight": 0.0})
            val, wt = _blend(old["seconds"], old["weight"], s / pace, len(by[w]), 200.0)
            obs[str(w)] = {"seconds": val, "weight": wt}
        prof["observed"] = obs
        prof[PACED_OBSERVATIONS] = True
        self._changed = True

    def add_acceptance(self, rho: float, weight: float) -> None:
        """Blend an observed acceptance rate into the profile (weight = steps observed)."""
        prof = self.profile
        prof["rho"], prof["rho_weight"] = _blend(
            prof.get("rho", PRIOR_RHO), prof.get("rho_weight", 0.0), rho, weight, cap=200.0
        )
        self._changed = True

    def add_mode_speed(self, mode: str, speedup: float, weight: float) -> None:
        """Blend a tuned call's measured speed over plain AR into the profile, and count the
        call. `speedup`: tokens committed / the steps' cost in one-token forwards (the curve's
        ratios t(q) / t(1), so how busy the machine was during the call does not bias it);
        `weight`: tokens committed. Recent calls count (the old weight is capped)."""
        prof = self.profile
        modes = prof.setdefault("modes", {})
        old = modes.get(mode, {"speedup": speedup, "weight": 0.0})
        v, w = _blend(old["speedup"], old["weight"], speedup, weight, cap=2000.0)
        modes[mode] = {"speedup": v, "weight": w}
        prof["tuned_calls"] = prof.get("tuned_calls", 0) + 1
        self._changed = True

    def observe(self, results, stats, n: int, K: int, lookup: bool, priced: bool,
                tuned: bool, greedy: bool) -> None:  # fmt: skip
        """What a call teaches: the time of the steps it priced (`priced`: it weighed steps or
        drafts by the curve), the acceptance of greedy parallel steps (a fixed `jacobi` n = 16
        call before the first tuned one, as in the demo, informs it; a sampled call converges
        later, and its own controller falls back to AR when that does not pay), and, for a
        tuned greedy call with lookup, its speed over plain AR (the race of `choose`)."""
        if priced:
            self.add_step_times(stats.widths, stats.step_seconds)
        if greedy and n > 1:
            window = n + (K - 1) * n // 2  # as `predict` credits K blocks
            for r in results:
                if r.mean_accepted_parallel is not None:  # None unless parallel steps ran
                    rho = estimate_rho(r.mean_accepted_parallel, window)
                    self.add_acceptance(rho, weight=len(r.accepted))
        if tuned and greedy and lookup:
            cost = sum(r.cost or 0.0 for r in results)
            if cost > 0:
                committed = sum(len(r.tokens) for r in results)
                mode = PARALLEL if n > 1 else AR_LOOKUP
                self.add_mode_speed(mode, committed / cost, weight=committed)

    def choose(
        self,
        method: str = "multiblock",
        num_blocks: int = 2,
        pool_size: int = 4,
        lookup: bool = False,
        rho: float | None = None,
        curve: StepCurve | None = None,
    ) -> Settings:
        """The block size (and, where parallel decoding cannot pay, "ar") that maximises predicted
        tokens/s for `method` with the given blocks and pool.

        With `lookup` (the tuned default) the alternative to parallel decoding is AR with lookup
        drafts, which the prediction (against plain AR, with an acceptance that repetition raises
        for both) cannot weigh. So the two race on measured speed: the engine records each tuned
        call's tokens per one-token-forward cost (`add_mode_speed`); once the parallel pick has
        a figure, the next call runs AR with lookup to get one, then the faster runs, and one call
        in RETRY_LOSER_EVERY runs the slower again. (Measured: the prediction picked a
        `multiblock` setting for the distilled model that AR with lookup beat side by side on a
        CPU; docs/results/cpu-fast-paths-2026-11-26.)"""
        curve = curve or self.curve()
        prof = self.profile
        if rho is None:
            rho = prof.get("rho", PRIOR_RHO)
        # `multiblock` also weighs one block without candidates (a Jacobi step inside the multiblock
        # engine): where a wide forward costs little more than a narrow one (bf16 on a CPU with
        # AMX, a GPU), n = 16 alone commits more per cost than K blocks of n = 4 with a pool
        # (docs/results/cpu-fast-paths-2026-11-26); where it costs more, the prediction says so.
        shapes = [(1, 0)] if method == "jacobi" else [(num_blocks, pool_size)]
        if method == "multiblock" and (num_blocks, pool_size) != (1, 0):
            shapes.append((1, 0))
        ar = Settings("ar", 1, 1, 0, 1.0, rho)
        best = ar
        for K, p in shapes:
            for n in BLOCK_SIZES:
                s = predict(curve, rho, n, K, p)
                if s > best.expected_speedup:
                    best = Settings(method, n, K, p, s, rho)
        modes = prof.get("modes", {})
        if not lookup or best is ar or PARALLEL not in modes:
            return best
        if AR_LOOKUP not in modes:
            return ar  # measure AR with lookup once
        par, arl = modes[PARALLEL]["speedup"], modes[AR_LOOKUP]["speedup"]
        retry = prof.get("tuned_calls", 0) % RETRY_LOSER_EVERY == RETRY_LOSER_EVERY - 1
        if (par >= arl) != retry:
            return replace(best, expected_speedup=par)
        return replace(ar, expected_speedup=arl)
