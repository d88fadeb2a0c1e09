"""Context-lookup drafting: the n-gram index on hand-worked sequences, the cost-aware draft
size, and losslessness on random tiny models, with and without EOS: drafts in AR (the tuned
engine's AR mode, the fallback from parallel decoding) and lookup candidate rows in the
parallel methods."""

from __future__ import annotations

import random

import pytest
import torch

from jacobi_ext import generate
from jacobi_ext.decoding import loop, sequence
from jacobi_ext.decoding.lookup import LookupPolicy, NgramIndex
from jacobi_ext.decoding.trajectory import TrajectoryRecorder
from jacobi_ext.models import tiny_llama

VOCAB = 48


def test_ngram_index_longest_most_recent_match() -> None:
    ix = NgramIndex([1, 2, 3, 9, 1, 2])
    g, j = ix.match()
    assert (g, j) == (2, 1)  # (1, 2) ended at position 1; (9, 1, 2) never occurred before
    assert ix.continuation(j, 3) == [3, 9, 1]
    ix = NgramIndex([1, 2, 5, 1, 2, 7, 1, 2])
    g, j = ix.match()
    assert (g, j) == (2, 4) and ix.continuation(j, 2) == [7, 1]  # the most recent occurrence
    ix.extend([7])
    assert ix.match() == (3, 5)  # (1, 2, 7) ended at 5
    # past the end the copy overlaps itself: a loop continues as a loop
    assert ix.continuation(5, 8) == [1, 2, 7, 1, 2, 7, 1, 2]
    assert NgramIndex([3, 3, 3]).continuation(1, 4) == [3, 3, 3, 3]
    assert NgramIndex([4]).match() == (0, -1)  # the suffix never matches itself
    assert NgramIndex([4, 4]).match() == (1, 0)
    assert NgramIndex([4, 4]).continuation(0, 0) == []


def test_policy_follows_cost_and_acceptance() -> None:
    free = LookupPolicy(lambda q: 1.0)
    assert free.size(3) >= 8  # drafts cost nothing: long ones (until the gain flattens)
    assert free.size(0) == 0  # no match, no draft
    dear = LookupPolicy(lambda q: float(q))  # a (1+k)-token step costs 1+k AR steps
    assert all(dear.size(g) in (0, 1) for g in (1, 2, 3))  # only probes
    steep = LookupPolicy(lambda q: 1.0 + 0.3 * (q - 1))
    k0 = steep.size(3)
    assert k0 > 0
    for _ in range(50):  # drafts after 3-gram matches keep failing at the first token
        steep.observe(3, 4, 0)
    sizes = [steep.size(3) for _ in range(64)]
    assert sizes.count(0) == 62 and sizes.count(1) == 2  # stopped paying; probed 1 in 32
    for _ in range(200):  # ... and recovers when they start to land
        steep.observe(3, 4, 4)
    assert steep.size(3) >= k0


@pytest.fixture(scope="module")
def models():
    return [tiny_llama(vocab_size=VOCAB, seed=s, dtype=torch.float64) for s in range(3)]


def _decode(model, ids, max_new, eos, n, K, p, cost_ratio=None, lookup_cost=None):
    """The decoding loop itself, with a chosen cost curve for the controller and the lookup
    policy (generate() measures the real one)."""
    cfg = loop.DecodeConfig(
        max_new=max_new, eos=eos, block_size=n, num_blocks=K, pool_size=p, activation_ratio=0.85,
        cost_ratio=cost_ratio, lookup_cost=lookup_cost, fallback_window=4,
    )  # fmt: skip
    return loop.decode(model, ids.tolist(), cfg, torch.Generator().manual_seed(0))


def _random_case(rng: random.Random, model, case: int):
    """(prompt ids, max_new_tokens, eos id or None, greedy's tokens). Odd cases repeat a short
    unit (matches and accepted drafts are common), even ones are random (misses); one in three
    has an EOS."""
    unit = [rng.randrange(VOCAB) for _ in range(rng.randint(1, 6))]
    P = rng.randint(1, 30)
    ids = (unit * 30)[:P] if case % 2 else [rng.randrange(VOCAB) for _ in range(P)]
    ids = torch.tensor([ids])
    max_new = rng.randint(1, 100)
    eos = rng.randrange(VOCAB) if case % 3 == 0 else None
    want = generate(model, ids, max_new, method="ar", eos_token_id=eos).tokens[0].tolist()
    return ids, max_new, eos, want


@pytest.mark.parametrize("case", range(16))
def test_lookup_ar_is_lossless(models, case: int) -> None:
    rng = random.Random(case)
    model = models[case % 3]
    ids, max_new, eos_id, want = _random_case(rng, model, case)
    eos = {eos_id} if eos_id is not None else set()
    ratio = rng.choice([lambda q: 1.0, lambda q: 1.0 + 0.1 * q, lambda q: 1.0 + 0.5 * q])
    (res,), stats = _decode(model, ids, max_new, eos, 1, 1, 0, lookup_cost=ratio)
    assert res.tokens == want
    assert sum(res.accepted) == len(want) - (stats.forwards == 0)
    assert stats.forwards == len(res.accepted)


def test_lookup_drafts_are_accepted_on_repetitive_text(models) -> None:
    # A random tiny model falls into loops: a free-draft policy must commit many tokens per
    # forward there, else this test exercises nothing.
    model = models[0]
    ids = torch.tensor([[7, 3, 7, 3, 7, 3]])
    want = generate(model, ids, max_new_tokens=120, method="ar").tokens[0].tolist()
    (res,), stats = _decode(model, ids, 120, set(), 1, 1, 0, lookup_cost=lambda q: 1.0)
    out, forwards = res.tokens, stats.forwards
    assert out == want
    assert forwards < 0.5 * len(out), (forwards, len(out))


def test_fallback_from_parallel_uses_lookup_losslessly(models) -> None:
    model = models[1]
    ids = torch.tensor([[5, 9, 5, 9, 5, 9]])
    want = generate(model, ids, max_new_tokens=100, method="ar").tokens[0].tolist()
    # Parallel steps (>= 8 tokens) "cost" 1e9 AR steps: fall back after one window; lookup
    # steps (<= 7 tokens) are free, so drafts ride along.
    ratio = lambda q: 1e9 if q >= 8 else 1.0  # noqa: E731
    (res,), _ = _decode(model, ids, 100, set(), 8, 2, 2, cost_ratio=ratio, lookup_cost=ratio)
    out, hist = res.tokens, res.accepted
    assert out == want
    assert max(hist[4:]) > 1  # lookup steps after the fallback committed several tokens


def test_tuned_result_names_lookup(models, tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("JACOBI_EXT_CACHE", str(tmp_path))
    from jacobi_ext.decoding import tuning

    sizes, secs = [1, 2, 4, 8, 16, 32, 64, 128, 256], [1.0, 1.3, 1.6, 2.0, 2.2, 2.8, 4, 6, 12]
    steep = tuning.StepCurve(sizes, secs, 256, "cpu", "float32", 1, "test")
    # the curve a tuned call measures (Tuner.curve), so the choice does not hang on this machine
    monkeypatch.setattr(tuning, "measure_quick_curve", lambda model: steep)
    model = models[2]
    tuning.remember_acceptance(model, 0.01, weight=100)  # this model's blocks never converge
    ids = torch.tensor([[1, 2, 3, 1, 2, 3]])
    res = generate(model, ids, max_new_tokens=40, method="multiblock", block_size=None)
    assert res.method == "ar+lookup"
    assert res.tokens[0].tolist() == generate(model, ids, 40, method="ar").tokens[0].tolist()


# ---- lookup candidates in the parallel methods ------------------------------------------------


@pytest.mark.parametrize("case", range(16))
def test_parallel_lookup_candidates_are_lossless(models, case: int) -> None:
    """One more candidate row per step (the seed + a context-lookup continuation), winning or
    not, with recycling on or off and several blocks in flight: still greedy's tokens."""
    rng = random.Random(100 + case)
    model = models[case % 3]
    ids, max_new, eos, want = _random_case(rng, model, case)
    method = rng.choice(["jacobi", "multiblock"])
    res = generate(
        model, ids, max_new, method=method, block_size=rng.choice([2, 3, 5, 8, 16]),
        num_blocks=rng.randint(1, 3), pool_size=rng.choice([0, 1, 4]), eos_token_id=eos,
        lookup=True, seed=case,
    )  # fmt: skip
    assert res.tokens[0].tolist() == want
    assert res.method == method + "+lookup"
    assert sum(res.accepted) == len(want) and res.lookup_wins <= res.candidate_wins


def test_parallel_lookup_candidates_win_on_repetitive_text(models, monkeypatch) -> None:
    # A random tiny model falls into loops, which lookup predicts: with drafts priced as free,
    # the lookup row must win steps and raise tokens per forward over the same run without it.
    real = sequence.LookupPolicy
    free = lambda cost_ratio, **kw: real(lambda q: 1.0, **kw)  # noqa: E731
    monkeypatch.setattr(sequence, "LookupPolicy", free)
    model, ids = models[0], torch.tensor([[7, 3, 7, 3, 7, 3]])
    kw = dict(max_new_tokens=120, method="multiblock", block_size=8, pool_size=0)
    plain = generate(model, ids, lookup=False, **kw)
    looked = generate(model, ids, lookup=True, **kw)
    assert looked.tokens.tolist() == plain.tokens.tolist()
    assert looked.lookup_wins > 0 and looked.candidate_wins >= looked.lookup_wins
    assert looked.forwards < plain.forwards, (looked.forwards, plain.forwards)
    assert plain.method == "multiblock" and plain.lookup_wins == 0


def test_lookup_defaults_and_trajectory_guard(models) -> None:
    model, ids = models[1], torch.tensor([[4, 8, 15, 16, 23, 42]])
    assert generate(model, ids, 10, method="ar").method == "ar"
    assert generate(model, ids, 10, method="jacobi", block_size=4).method == "jacobi"
    assert generate(model, ids, 10, method="multiblock", block_size=4).method == "multiblock+lookup"
    assert generate(model, ids, 10, method="ar", lookup=True).method == "ar+lookup"
    with pytest.raises(ValueError, match="lookup off"):
        generate(model, ids, 10, method="jacobi", block_size=4, lookup=True,
                 trajectory=TrajectoryRecorder())  # fmt: skip
