"""Noise-scheduled packing of Jacobi trajectories into training sequences (docs/method.md §2, §3).

One trajectory record (python_training.trajectories) becomes one packed sequence
``[prompt P][noisy_0 n][clean_0 n] ... [noisy_{T-1}][clean_{T-1}]`` with its JacobiLayout,
shared position ids, AR targets and the (noisy, clean) index pairs of the consistency loss.
Everything here is plain integer bookkeeping; the loss (python_training.loss) consumes it.
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from jacobi_ext.kernels.layout import JacobiLayout

SCHEDULES = ("linear", "random", "reverse")
IGNORE = -100  # cross_entropy's ignore_index


def first_divergence(state: Sequence[int], fixed: Sequence[int]) -> int:
    """Index of the first position where ``state`` differs from ``fixed`` (len if equal)."""
    for i, (a, b) in enumerate(zip(state, fixed, strict=True)):
        if a != b:
            return i
    return len(fixed)


def noise(state: Sequence[int], fixed: Sequence[int]) -> float:
    """docs/method.md §2: the left-to-right unconverged fraction (n - d) / n, not a Hamming
    distance."""
    n = len(fixed)
    return (n - first_divergence(state, fixed)) / n


def target_noise(
    j: int,
    window: int,
    schedule: str = "linear",
    rng: random.Random | None = None,
    offset: int = 0,
):
    """Target noise of block j. "linear": linspace(0, 1, W)[j mod W], a saw-tooth repeating every
    W blocks (the published schedule); "reverse": the same teeth descending; "random": a level
    of the same grid drawn from ``rng`` (ablations). ``offset`` shifts the saw-tooth's phase
    (block j takes tooth position (j + offset) mod W): drawn per packing, it lets answers of
    fewer than W blocks meet every noise level over the steps instead of only the lowest ones."""
    if window < 1:
        raise ValueError(f"window must be >= 1, got {window}")
    levels = [k / (window - 1) for k in range(window)] if window > 1 else [0.0]
    if schedule == "linear":
        return levels[(j + offset) % window]
    if schedule == "reverse":
        return levels[window - 1 - (j + offset) % window]
    if schedule == "random":
        if rng is None:
            raise ValueError("schedule='random' needs an rng")
        return rng.choice(levels)
    raise ValueError(f"schedule must be one of {SCHEDULES}, got {schedule!r}")


def select_state(states: Sequence[Sequence[int]], target: float) -> int:
    """Index of the state whose noise (against the last state, the fixed point) is nearest
    ``target``; ties go to the earliest state."""
    fixed = states[-1]
    best, best_d = 0, float("inf")
    for i, s in enumerate(states):
        d = abs(noise(s, fixed) - target)
        if d < best_d - 1e-12:  # strict: an equal distance later keeps the earlier state
            best, best_d = i, d
    return best


LOOKBACK = 128  # tokens of context the synthetic noise draws from


def noise_tokens(target: float, n: int, max_tokens: int | None = None) -> int:
    """k, the number of rightmost tokens a synthetic state replaces for target noise ``target``:
    round(target * K) with K = ``max_tokens`` (default n) the count at target 1."""
    k_max = n if max_tokens is None else max_tokens
    if not 0 <= k_max <= n:
        raise ValueError(f"max_tokens must be in [0, {n}], got {max_tokens}")
    if not 0.0 <= target <= 1.0:
        raise ValueError(f"target noise must be in [0, 1], got {target}")
    return int(math.floor(target * k_max + 0.5))


def synthetic_state(
    fixed: Sequence[int], k: int, pool: Sequence[int], rng: random.Random
) -> list[int]:
    """A progressive-masking noisy state: ``fixed`` with its rightmost k tokens replaced by
    tokens drawn uniformly (with replacement) from ``pool`` (the context's look-back window).

    The first replaced token (offset n-k) is drawn among the pool tokens that differ from
    ``fixed[n-k]``, so the state's first divergence is exactly n-k and its noise exactly k/n
    (docs/method.md §2); the later ones may coincide with the fixed point by chance, as a Jacobi
    draft's may. A pool holding nothing but that token falls back to a neighbouring id.
    """
    n = len(fixed)
    if not 0 <= k <= n:
        raise ValueError(f"k must be in [0, {n}], got {k}")
    out = list(fixed)
    if k == 0:
        return out
    if not pool:
        raise ValueError("synthetic noise needs a non-empty context pool")
    d = n - k
    others = [t for t in pool if t != fixed[d]]
    if others:
        out[d] = others[rng.randrange(len(others))]
    else:
        out[d] = fixed[d] - 1 if fixed[d] > 0 else fixed[d] + 1
    for i in range(d + 1, n):
        out[i] = pool[rng.randrange(len(pool))]
    return out


def context_pool(
    prompt_ids: Sequence[int], fixed_blocks: Sequence[Sequence[int]], j: int, lookback: int
) -> list[int]:
    """The last ``lookback`` tokens before block j: the prompt and the fixed points of blocks
    < j (the committed context a Jacobi draft of block j is initialised from,
    docs/method.md §4)."""
    ctx = list(prompt_ids[-lookback:]) if lookback > 0 else []
    for b in fixed_blocks[:j]:
        ctx += b
    return ctx[-lookback:] if lookback > 0 else []


def pad_after_eos(tokens: Sequence[int], n: int, eos_ids: set[int], pad_id: int) -> list[int]:
    """``tokens`` cut after its first EOS (kept) and padded with ``pad_id`` to n."""
    out = list(tokens[:n])
    for i, t in enumerate(out):
        if t in eos_ids:
            out = out[: i + 1]
            break
    return out + [pad_id] * (n - len(out))


def eos_index(block: Sequence[int], eos_ids: set[int]) -> int | None:
    for i, t in enumerate(block):
        if t in eos_ids:
            return i
    return None


@dataclass
class PackedExample:
    """One packed sequence and its loss bookkeeping (all 1-D LongTensors on the CPU).

    ``ar_labels[i]`` is the token the logit at i must predict (IGNORE where none);
    ``cons_noisy[k]`` / ``cons_clean[k]`` index the logits of the k-th consistency term (the same
    offset of noisy_j and clean_j); ``cons_block[k]`` is its pair j.
    """

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    layout: JacobiLayout
    ar_labels: torch.Tensor
    cons_noisy: torch.Tensor
    cons_clean: torch.Tensor
    cons_block: torch.Tensor
    noise_levels: list[float]

    @property
    def num_blocks(self) -> int:
        return self.layout.num_blocks


def pack(
    prompt_ids: Sequence[int],
    blocks: Sequence[Sequence[Sequence[int]]],
    block_size: int,
    eos_ids: set[int] | Sequence[int],
    pad_id: int,
    window: int = 16,
    schedule: str = "linear",
    seed: int = 0,
    variant: str = "noisy_context",
    mask_window: int | None = None,
    max_blocks: int | None = None,
    synthetic_fraction: float = 0.0,
    lookback: int = LOOKBACK,
    max_noise_tokens: int | None = None,
    random_phase: bool = False,
    ar_prompt: bool = True,
) -> PackedExample:
    """Pack one trajectory (docs/method.md §2), derive its AR targets and consistency pairs (§3).

    ``blocks[j]`` is block j's list of states (the last is the fixed point). States are
    normalised to n tokens with PAD after the first EOS.

    Synthetic noise (progressive masking): each block is, with probability
    ``synthetic_fraction``, given a freshly drawn state instead of a collected one: its fixed
    point with the rightmost k = :func:`noise_tokens` (t_j, n, ``max_noise_tokens``) tokens
    replaced by tokens of the ``lookback``-token context window before the block
    (:func:`synthetic_state`); the other blocks take the collected state nearest t_j. With
    ``random_phase`` the saw-tooth's phase is drawn per call. Everything random is drawn from
    ``random.Random(seed)``: the same seed gives the same example, and a trainer that passes a
    new seed per use never shows the same synthetic state twice.

    ``ar_prompt``: whether the AR loss includes the prompt's own next-token pairs
    (docs/method.md §3 and the reference do). Without them the AR term is about the answer alone:
    the teacher's answer, so it anchors the student to the teacher's outputs instead of also
    fine-tuning it on the prompts' text (here docstrings of installed packages, which the base model
    predicts at an NLL of ~2 against ~0.3 on its own answers, so they dominate that term's
    gradient).
    """
    n = block_size
    eos = set(eos_ids)
    rng = random.Random(seed)
    if not 0.0 <= synthetic_fraction <= 1.0:
        raise ValueError(f"synthetic_fraction must be in [0, 1], got {synthetic_fraction}")
    blocks = list(blocks[:max_blocks] if max_blocks is not None else blocks)
    for j, states in enumerate(blocks):  # nothing after the EOS block is part of the answer
        if eos_index(pad_after_eos(states[-1], n, eos, pad_id), eos) is not None:
            blocks = blocks[: j + 1]
            break
    if not blocks:
        raise ValueError("a trajectory needs at least one block")
    P, T = len(prompt_ids), len(blocks)
    if P < 1:
        raise ValueError("a trajectory needs a prompt")
    layout = JacobiLayout(
        prompt_len=P, block_size=n, num_blocks=T, variant=variant, window=mask_window
    )
    ids = list(prompt_ids)
    labels = [IGNORE] * layout.seq_len
    if ar_prompt:
        labels[: P - 1] = list(prompt_ids[1:])  # prompt next-token pairs
    cons_noisy, cons_clean, cons_block, levels = [], [], [], []
    prev_last = P - 1  # the logit that predicts clean_j[0]: last prompt / last of clean_{j-1}
    offset = rng.randrange(window) if random_phase else 0
    fixed_points = [pad_after_eos(states[-1], n, eos, pad_id) for states in blocks]
    for j, states in enumerate(blocks):
        states = [pad_after_eos(s, n, eos, pad_id) for s in states]
        clean = states[-1]
        t_j = target_noise(j, window, schedule, rng, offset)
        if synthetic_fraction > 0 and (
            synthetic_fraction >= 1 or rng.random() < synthetic_fraction
        ):
            k = noise_tokens(t_j, n, max_noise_tokens)
            pool = context_pool(prompt_ids, fixed_points, j, lookback)
            noisy = synthetic_state(clean, k, pool, rng)
        else:
            noisy = states[select_state(states, t_j)]
        levels.append(noise(noisy, clean))
        base = P + 2 * j * n  # noisy_j starts here, clean_j at base + n
        ids += noisy + clean
        e_clean = eos_index(clean, eos)
        valid = n if e_clean is None else e_clean + 1  # real tokens, EOS included
        # AR: bridge into clean_j[0], then in-block pairs up to and including EOS.
        if prev_last is not None:
            labels[prev_last] = clean[0]
        for t in range(valid - 1):
            labels[base + n + t] = clean[t + 1]
        # After EOS nothing follows: no bridge out of this block.
        prev_last = base + 2 * n - 1 if e_clean is None else None
        # Consistency: offsets f_j..n-1; the logit at t predicts token t+1, so keep t only while
        # that prediction is of a real clean token (t < e_clean: up to and including EOS) and
        # the noisy token at t is not past the noisy block's own EOS.
        f = first_divergence(noisy, clean)
        e_noisy = eos_index(noisy, eos)
        hi = n - 1
        if e_clean is not None:
            hi = min(hi, e_clean - 1)
        if e_noisy is not None:
            hi = min(hi, e_noisy)
        for t in range(f, hi + 1):
            cons_noisy.append(base + t)
            cons_clean.append(base + n + t)
            cons_block.append(j)
    # PAD targets never appear: labels stop at each block's EOS (PAD may share EOS's id, and
    # chat prompts contain that id, so PAD is excluded by position, not by value).

    def lt(x):
        return torch.tensor(x, dtype=torch.long)

    return PackedExample(
        input_ids=lt(ids),
        position_ids=layout.position_ids(),
        layout=layout,
        ar_labels=lt(labels),
        cons_noisy=lt(cons_noisy),
        cons_clean=lt(cons_clean),
        cons_block=lt(cons_block),
        noise_levels=levels,
    )


def pack_record(record: dict, **kwargs) -> PackedExample:
    """:func:`pack` for a record of the on-disk trajectory format."""
    return pack(
        record["prompt_ids"],
        record["blocks"],
        record["block_size"],
        record["eos_ids"],
        record["pad_id"],
        **kwargs,
    )
