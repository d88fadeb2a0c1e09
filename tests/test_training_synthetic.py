"""Synthetic progressive-masking noise (packing.synthetic_state and pack(synthetic_fraction=...)):
exact noise levels, tokens from the look-back window, determinism per seed, fresh draws per
packing in the trainer, fixed-point-only collection, the consistency reductions."""

from __future__ import annotations

import json
import random

import pytest
import torch

from python_training import trainer as tr
from python_training.loss import example_loss
from python_training.packing import (
    context_pool,
    first_divergence,
    noise,
    noise_tokens,
    pack,
    synthetic_state,
    target_noise,
)
from python_training.trajectories import make_record, read_trajectories

N = 8


def test_noise_tokens_maps_levels_to_counts():
    assert [noise_tokens(k / 4, 8) for k in range(5)] == [0, 2, 4, 6, 8]
    assert noise_tokens(1.0, 8, max_tokens=7) == 7
    assert noise_tokens(0.0, 8, max_tokens=7) == 0
    assert noise_tokens(0.5, 16) == 8
    with pytest.raises(ValueError):
        noise_tokens(0.5, 8, max_tokens=9)
    with pytest.raises(ValueError):
        noise_tokens(1.5, 8)


@pytest.mark.parametrize("k", range(N + 1))
def test_synthetic_state_replaces_exactly_the_rightmost_k(k):
    fixed = list(range(100, 100 + N))
    pool = [1, 2, 3, 100 + N - 1]  # one pool token equals a fixed-point token
    for seed in range(20):
        s = synthetic_state(fixed, k, pool, random.Random(seed))
        assert len(s) == N
        assert s[: N - k] == fixed[: N - k]
        assert all(t in pool for t in s[N - k :])
        # docs/method.md §2: noise is the first divergence, exactly k/n whatever the later
        # tokens are.
        assert first_divergence(s, fixed) == N - k
        assert noise(s, fixed) == k / N


def test_synthetic_state_first_token_always_differs():
    fixed = [5] * N
    # The pool is mostly the fixed point's own token: the first replaced one must still differ.
    pool = [5] * 50 + [6]
    for seed in range(30):
        s = synthetic_state(fixed, 3, pool, random.Random(seed))
        assert s[N - 3] == 6 and noise(s, fixed) == 3 / N
    # A pool of nothing else falls back to a neighbouring id.
    s = synthetic_state(fixed, 2, [5, 5], random.Random(0))
    assert s[:6] == [5] * 6 and s[6] != 5 and s[7] == 5


def test_synthetic_state_deterministic_per_seed():
    fixed, pool = list(range(N)), list(range(50, 90))
    a = synthetic_state(fixed, 6, pool, random.Random(7))
    assert a == synthetic_state(fixed, 6, pool, random.Random(7))
    draws = {tuple(synthetic_state(fixed, 6, pool, random.Random(s))) for s in range(20)}
    assert len(draws) == 20  # 40^6 possible tails: distinct seeds give distinct states


def test_context_pool_is_the_lookback_window_before_the_block():
    prompt = list(range(1000, 1010))
    blocks = [list(range(j * 10, j * 10 + 4)) for j in range(3)]
    assert context_pool(prompt, blocks, 0, 128) == prompt
    assert context_pool(prompt, blocks, 2, 128) == prompt + blocks[0] + blocks[1]
    assert context_pool(prompt, blocks, 2, 6) == blocks[0][2:] + blocks[1]
    assert context_pool(prompt, blocks, 1, 3) == blocks[0][1:]


def _record(T=6, P=12, seed=0, eos_at=None):
    rng = random.Random(seed)
    prompt = [rng.randrange(200, 400) for _ in range(P)]
    toks = [rng.randrange(10, 200) for _ in range(T * N)]
    if eos_at is not None:
        toks[eos_at] = 3
    blocks = [[toks[j * N : (j + 1) * N]] for j in range(T)]  # fixed points only
    return prompt, blocks


def test_pack_synthetic_levels_window_and_consistency_start():
    prompt, blocks = _record(T=6)
    W, look = 4, 5
    for seed in range(10):
        ex = pack(prompt, blocks, N, {3}, 0, window=W, seed=seed, synthetic_fraction=1.0,
                  lookback=look)  # fmt: skip
        ids = ex.input_ids.tolist()
        P = len(prompt)
        fixed = [b[-1] for b in blocks]
        for j in range(6):
            k = noise_tokens(target_noise(j, W), N)
            noisy = ids[P + 2 * j * N : P + 2 * j * N + N]
            clean = ids[P + 2 * j * N + N : P + 2 * (j + 1) * N]
            assert clean == fixed[j]
            assert ex.noise_levels[j] == k / N == noise(noisy, clean)
            window = (prompt + sum(fixed[:j], []))[-look:]
            assert all(t in window for t in noisy[N - k :]), (j, noisy, window)
            # Consistency terms of pair j: offsets f_j .. n-1 with f_j = n - k (docs/method.md §3).
            rows = (ex.cons_block == j).nonzero().flatten()
            offs = (ex.cons_noisy[rows] - (P + 2 * j * N)).tolist()
            assert offs == list(range(N - k, N))


def test_pack_synthetic_is_deterministic_and_fresh_per_seed():
    prompt, blocks = _record(T=4)
    kw = dict(window=4, synthetic_fraction=1.0, random_phase=True)
    a = pack(prompt, blocks, N, {3}, 0, seed=11, **kw)
    b = pack(prompt, blocks, N, {3}, 0, seed=11, **kw)
    assert torch.equal(a.input_ids, b.input_ids) and a.noise_levels == b.noise_levels
    seen = {tuple(pack(prompt, blocks, N, {3}, 0, seed=s, **kw).input_ids.tolist())
            for s in range(30)}  # fmt: skip
    assert len(seen) == 30


def test_random_phase_covers_every_level_for_short_answers():
    prompt, blocks = _record(T=2)
    fixed_phase = {
        lv for s in range(40)
        for lv in pack(prompt, blocks, N, {3}, 0, window=8, seed=s,
                       synthetic_fraction=1.0).noise_levels
    }  # fmt: skip
    # Two blocks of a W=8 saw-tooth: only its first two teeth (0 and 1/7 -> 1 token).
    assert fixed_phase == {0.0, 1 / N}
    levels = {
        lv for s in range(200)
        for lv in pack(prompt, blocks, N, {3}, 0, window=8, seed=s, synthetic_fraction=1.0,
                       random_phase=True).noise_levels
    }  # fmt: skip
    assert levels == {noise_tokens(t / 7, N) / N for t in range(8)}


def test_synthetic_fraction_mixes_with_collected_states():
    prompt, _ = _record(T=8)
    rng = random.Random(5)
    blocks = []
    for _ in range(8):  # collected states: a fully wrong draft, then the fixed point
        fixed = [rng.randrange(10, 200) for _ in range(N)]
        blocks.append([[1] * N, fixed])
    n_syn = n_real = 0
    for s in range(20):
        ex = pack(prompt, blocks, N, {3}, 0, window=2, seed=s, synthetic_fraction=0.5)
        P = len(prompt)
        for j in range(1, 8, 2):  # odd blocks: target noise 1
            noisy = ex.input_ids[P + 2 * j * N : P + 2 * j * N + N].tolist()
            if noisy == [1] * N:
                n_real += 1
            else:
                n_syn += 1
                assert noise(noisy, blocks[j][-1]) == 1.0
    assert n_syn > 15 and n_real > 15
    ex0 = pack(prompt, blocks, N, {3}, 0, window=2, seed=0, synthetic_fraction=0.0)
    ex1 = pack(prompt, blocks, N, {3}, 0, window=2, seed=1, synthetic_fraction=0.0)
    assert torch.equal(ex0.input_ids, ex1.input_ids)  # no synthetic noise: nothing random


def test_synthetic_eos_block_terms_stop_at_eos():
    # EOS at offset 4 of block 1: blocks after it are dropped; the EOS block's consistency
    # terms stop before the EOS position's logit (it predicts nothing) whatever the noise.
    prompt, blocks = _record(T=3, eos_at=N + 4)
    for s in range(20):
        ex = pack(prompt, blocks, N, {3}, 0, window=2, seed=s, synthetic_fraction=1.0,
                  random_phase=True)  # fmt: skip
        assert ex.num_blocks == 2
        base = len(prompt) + 2 * N
        offs = (ex.cons_noisy[(ex.cons_block == 1).nonzero().flatten()] - base).tolist()
        assert all(o <= 3 for o in offs)


def test_trainer_redraws_noise_every_packing(tmp_path):
    d = tmp_path / "traj"
    d.mkdir()
    prompt, blocks = _record(T=4)
    rec = make_record("p0", prompt, blocks, N, {3}, 0)
    (d / "trajectories.jsonl").write_text(json.dumps(rec) + "\n")
    c = tr.TrainConfig(data=[str(d)], window=4, synthetic_fraction=1.0, random_phase=True)
    recs = tr.load_examples(c)
    exs = [tr.example_at(recs, c, i) for i in range(12)]  # 12 epochs of the one record
    assert len({tuple(e.input_ids.tolist()) for e in exs}) == 12
    assert torch.equal(tr.example_at(recs, c, 3).input_ids, exs[3].input_ids)  # resumable


def test_consistency_reductions():
    from jacobi_ext.models import tiny_llama

    model = tiny_llama(vocab_size=400, eos_token_id=3, seed=1, attn_implementation="jacobi")
    prompt, blocks = _record(T=4)
    ex = pack(prompt, blocks, N, {3}, 0, window=4, seed=0, synthetic_fraction=1.0)
    with torch.no_grad():
        a = example_loss(model, ex, 1.0, consistency_reduction="mean_div_T")
        b = example_loss(model, ex, 1.0, consistency_reduction="mean")
    assert a.consistency > 0
    assert b.consistency == pytest.approx(a.consistency * ex.num_blocks, rel=1e-5)
    assert b.ar == a.ar
    with pytest.raises(ValueError):
        example_loss(model, ex, consistency_reduction="sum")


def test_collect_fixed_points_only(tmp_path):
    from jacobi_ext.decoding import generate
    from jacobi_ext.models import tiny_llama
    from python_training.prompts import Prompt
    from python_training.trajectories import collect

    model = tiny_llama(vocab_size=96, eos_token_id=3, seed=3)

    def encode(p):
        g = torch.Generator().manual_seed(int(p.id[1:]))
        return torch.randint(4, 96, (1, 6), generator=g)

    ps = [Prompt(f"p{i}", text="x") for i in range(4)]
    collect(model, None, ps, tmp_path, block_size=4, max_new_tokens=16, progress=False,
            encode=encode, fixed_points_only=True)  # fmt: skip
    assert json.loads((tmp_path / "meta.json").read_text())["states"] == "fixed_point"
    recs = read_trajectories(tmp_path)
    assert len(recs) == 4
    for p, r in zip(ps, recs, strict=True):
        greedy = generate(model, encode(p), method="ar", max_new_tokens=16).tokens[0].tolist()
        assert all(len(states) == 1 for states in r["blocks"])
        flat = sum((states[0] for states in r["blocks"]), [])
        assert flat[: len(greedy)] == greedy
    # The same directory refuses a Jacobi-trajectory collection (other settings).
    with pytest.raises(ValueError):
        collect(model, None, ps, tmp_path, block_size=4, max_new_tokens=16, progress=False,
                encode=encode)  # fmt: skip
