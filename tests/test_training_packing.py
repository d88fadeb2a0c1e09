"""Noise metric, schedule, state selection and packing vs hand-worked examples (docs/method.md
§2, §3)."""

from __future__ import annotations

import random

import pytest
import torch

from python_training.packing import (
    IGNORE,
    first_divergence,
    noise,
    pack,
    pad_after_eos,
    select_state,
    target_noise,
)


def test_noise_is_first_divergence_not_hamming():
    fixed = [1, 2, 3, 4]
    assert first_divergence([1, 2, 3, 4], fixed) == 4
    assert noise([1, 2, 3, 4], fixed) == 0.0
    # One wrong token at offset 1: Hamming would say 1/4, first divergence says 3/4.
    assert noise([1, 9, 3, 4], fixed) == 0.75
    assert noise([9, 2, 3, 4], fixed) == 1.0
    assert noise([1, 2, 3, 9], fixed) == 0.25


def test_linear_schedule_is_a_sawtooth():
    assert [target_noise(j, 3) for j in range(7)] == [0.0, 0.5, 1.0, 0.0, 0.5, 1.0, 0.0]
    assert [target_noise(j, 3, "reverse") for j in range(4)] == [1.0, 0.5, 0.0, 1.0]
    assert target_noise(5, 1) == 0.0
    levels = {target_noise(j, 5, "random", random.Random(0)) for j in range(50)}
    assert levels <= {0.0, 0.25, 0.5, 0.75, 1.0}
    with pytest.raises(ValueError):
        target_noise(0, 3, "random")
    with pytest.raises(ValueError):
        target_noise(0, 3, "bogus")


def test_select_nearest_ties_earliest():
    fixed = [1, 2, 3, 4]
    states = [[9, 9, 9, 9], [1, 9, 9, 9], [1, 2, 9, 9], [1, 2, 3, 9], fixed]  # 1, .75, .5, .25, 0
    assert select_state(states, 0.0) == 4
    assert select_state(states, 1.0) == 0
    assert select_state(states, 0.55) == 2
    # 0.625 is equally far from 0.75 (state 1) and 0.5 (state 2): the earlier state wins.
    assert select_state(states, 0.625) == 1
    # Duplicate noise levels: the earliest of the equal states.
    assert select_state([[1, 9, 0, 0], [1, 8, 0, 0], [1, 2, 0, 0]], 0.75) == 0


def test_pad_after_eos():
    assert pad_after_eos([5, 7, 0, 6], 4, {7}, 0) == [5, 7, 0, 0]
    assert pad_after_eos([5, 7], 4, {7}, 0) == [5, 7, 0, 0]
    assert pad_after_eos([5, 6, 8, 9], 4, {7}, 0) == [5, 6, 8, 9]


def test_pack_hand_worked():
    # P=2, n=3, W=2: block 0 target 0.0 (the fixed point), block 1 target 1.0.
    prompt = [50, 51]
    b0 = [[10, 90, 91], [10, 11, 92], [10, 11, 12]]
    b1 = [[13, 93, 94], [13, 14, 95], [13, 14, 15]]  # noise 2/3, 1/3, 0
    ex = pack(prompt, [b0, b1], 3, eos_ids=[99], pad_id=0, window=2)
    # noisy_1 = the state nearest 1.0 = [13, 93, 94] (noise 2/3).
    assert ex.input_ids.tolist() == [50, 51, 10, 11, 12, 10, 11, 12, 13, 93, 94, 13, 14, 15]
    assert ex.position_ids.tolist() == [0, 1, 2, 3, 4, 2, 3, 4, 5, 6, 7, 5, 6, 7]
    assert ex.noise_levels == [0.0, pytest.approx(2 / 3)]
    I = IGNORE  # noqa: E741
    # prompt pair (0->51), bridge (1->clean_0[0]), clean_0 in-block, bridge clean_0 -> clean_1,
    # clean_1 in-block; the last clean logit has no known target.
    assert ex.ar_labels.tolist() == [51, 10, I, I, I, 11, 12, 13, I, I, I, 14, 15, I]
    # Pair 0 is converged: no terms. Pair 1 diverges at f=1: offsets 1 and 2.
    assert ex.cons_noisy.tolist() == [9, 10]
    assert ex.cons_clean.tolist() == [12, 13]
    assert ex.cons_block.tolist() == [1, 1]
    assert ex.layout.seq_len == 14 and ex.layout.num_blocks == 2
    assert torch.equal(ex.position_ids, ex.layout.position_ids())


def test_pack_without_prompt_ar_pairs():
    """ar_prompt=False drops exactly the prompt's own next-token pairs (the bridge into the
    answer stays: it is the answer's first token); everything else is the same example."""
    prompt = [50, 51, 52]
    b0 = [[10, 90, 91], [10, 11, 12]]
    b1 = [[13, 93, 94], [13, 14, 15]]
    kw = dict(eos_ids=[99], pad_id=0, window=2, seed=3, synthetic_fraction=0.5)
    full = pack(prompt, [b0, b1], 3, **kw)
    ans = pack(prompt, [b0, b1], 3, ar_prompt=False, **kw)
    assert full.ar_labels[:2].tolist() == [51, 52]
    assert ans.ar_labels[:2].tolist() == [IGNORE, IGNORE]
    assert torch.equal(ans.ar_labels[2:], full.ar_labels[2:]) and int(ans.ar_labels[2]) == 10
    for f in ("input_ids", "position_ids", "cons_noisy", "cons_clean", "cons_block"):
        assert torch.equal(getattr(ans, f), getattr(full, f)), f


def test_pack_eos_and_pad():
    # EOS (7) at offset 1 of block 1; PAD = EOS's id, as SmolLM2's tokenizer sets it. The EOS
    # appears in the prompt too (chat turns end with it): prompt targets keep it.
    prompt = [7, 50]
    b0 = [[10, 90, 91], [10, 11, 12]]
    b1 = [[13, 20, 21], [13, 7]]  # fixed point cut by EOS: padded to [13, 7, 7]
    b2 = [[1, 2, 3]]  # after the EOS block: dropped
    ex = pack(prompt, [b0, b1, b2], 3, eos_ids=[7], pad_id=7, window=2)
    assert ex.layout.num_blocks == 2
    assert ex.input_ids.tolist() == [7, 50, 10, 11, 12, 10, 11, 12, 13, 20, 21, 13, 7, 7]
    I = IGNORE  # noqa: E741
    # clean_1: 13 -> EOS is a target; nothing after the EOS; the last logit predicts nothing.
    assert ex.ar_labels.tolist() == [50, 10, I, I, I, 11, 12, 13, I, I, I, 7, I, I]
    # Pair 1: f=1; offsets t < e_clean=1 only -> none kept beyond... t in [1, 0] is empty.
    assert ex.cons_noisy.tolist() == []
    # With the EOS one later, offset 1 survives (it predicts the EOS) but offset 2 does not.
    b1b = [[13, 20, 21], [13, 14, 7]]
    ex2 = pack(prompt, [b0, b1b], 3, eos_ids=[7], pad_id=7, window=2)
    assert ex2.cons_noisy.tolist() == [9]
    assert ex2.cons_clean.tolist() == [12]
    # A noisy block with its own early EOS: positions after that EOS are masked.
    b1c = [[13, 7, 21], [13, 14, 15]]  # normalised noisy = [13, 7, 7]
    ex3 = pack(prompt, [b0, b1c], 3, eos_ids=[7], pad_id=7, window=2)
    assert ex3.input_ids[8:11].tolist() == [13, 7, 7]
    assert ex3.cons_noisy.tolist() == [9]  # offset 1 (the noisy EOS) kept, offset 2 masked


def test_pack_deterministic_given_seed():
    rng = random.Random(1)
    blocks = []
    for _ in range(6):
        fixed = [rng.randrange(1, 50) for _ in range(4)]
        states = [[fixed[0]] + [rng.randrange(50, 60) for _ in range(3)]]
        states += [fixed[:2] + [55, 56], fixed]
        blocks.append(states)
    kw = dict(eos_ids=[99], pad_id=0, window=3, schedule="random")
    a = pack([1, 2, 3], blocks, 4, seed=5, **kw)
    b = pack([1, 2, 3], blocks, 4, seed=5, **kw)
    assert torch.equal(a.input_ids, b.input_ids) and a.noise_levels == b.noise_levels
    others = {tuple(pack([1, 2, 3], blocks, 4, seed=s, **kw).noise_levels) for s in range(8)}
    assert len(others) > 1  # the seed really drives the random schedule
