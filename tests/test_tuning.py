"""Roofline tuning: the curve, the acceptance model, the choice, and the online AR fallback."""

from __future__ import annotations

import json
import statistics
import warnings

import pytest
import torch

from jacobi_ext import generate
from jacobi_ext.decoding import loop, tuning
from jacobi_ext.decoding.controller import FallbackController
from jacobi_ext.models import tiny_llama


@pytest.fixture(autouse=True)
def _private_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("JACOBI_EXT_CACHE", str(tmp_path))


def _curve(times: dict[int, float]) -> tuning.StepCurve:
    sizes = sorted(times)
    return tuning.StepCurve(sizes, [times[s] for s in sizes], 256, "cpu", "float32", 2, "test")


def test_acceptance_model_round_trip() -> None:
    for rho in (0.0, 0.3, 0.8, 0.95):
        for w in (4, 16, 64):
            e = tuning.expected_accepted(rho, w)
            assert 1.0 <= e <= w
            if 1.0 < e < w - 1e-6:
                assert tuning.estimate_rho(e, w) == pytest.approx(rho, abs=1e-6)
    assert tuning.expected_accepted(0.0, 16) == 1.0


def test_curve_time_at_a_measured_size_is_its_measured_time() -> None:
    """At a measured size the curve returns the stored time itself: the interpolation formula
    y0 + (y1 - y0) * 1 rounds this pair one ulp above y1 (a CI run failed a `<=` on it)."""
    y0, y1 = 0.00026437391608286943, 0.0006609347902071736
    assert y0 + (y1 - y0) * 14 / 14 != y1  # the rounding the curve must not do
    curve = _curve({1: y0, 2: y0, 16: y1, 64: 2 * y1})
    assert [curve.time(q) for q in curve.sizes] == curve.seconds
    assert curve.time(9) == pytest.approx((y0 + y1) / 2)  # between sizes: interpolated


def test_choice_follows_the_curve_and_acceptance() -> None:
    # Flat up to 16 tokens, then linear: the knee is 16.
    flat = _curve({1: 1.0, 2: 1.0, 4: 1.0, 8: 1.0, 16: 1.05, 32: 2.0, 64: 4.0, 128: 8.0})
    assert flat.knee() == 16
    hi = tuning.choose_settings(None, "jacobi", rho=0.9, curve=flat)
    assert hi.method == "jacobi" and hi.block_size == 16 and hi.expected_speedup > 5
    # Base-model acceptance (~4%) cannot pay for even a 36% dearer step: AR.
    steep = _curve({1: 1.0, 2: 1.6, 4: 1.41, 8: 1.36, 16: 1.57, 32: 2.06, 64: 3.0})
    lo = tuning.choose_settings(None, "multiblock", rho=0.04, curve=steep)
    assert lo.method == "ar" and lo.expected_speedup == 1.0


def test_multiblock_weighs_one_block_without_candidates() -> None:
    # Flat to 16 tokens and dear beyond (bf16 on a CPU with AMX): one block (n tokens a step)
    # commits more per cost than two blocks with a pool of 4 (3 n tokens a step).
    flat16 = _curve({1: 1.0, 2: 1.0, 4: 1.02, 8: 1.05, 16: 1.22, 32: 1.9, 64: 3.6, 128: 7.0})
    s = tuning.choose_settings(None, "multiblock", num_blocks=2, pool_size=4, rho=0.6, curve=flat16)
    assert (s.method, s.num_blocks, s.pool_size) == ("multiblock", 1, 0)
    one = {n: tuning.predict(flat16, 0.6, n, 1, 0) for n in tuning.BLOCK_SIZES}
    two = max(tuning.predict(flat16, 0.6, n, 2, 4) for n in tuning.BLOCK_SIZES)
    assert s.block_size == max(one, key=one.get) and s.expected_speedup == max(one.values()) > two
    # Flat far beyond (a GPU): the blocks and the pool are free, and they are kept.
    gpu = _curve({q: 1.0 for q in tuning.SIZES})
    s = tuning.choose_settings(None, "multiblock", num_blocks=2, pool_size=4, rho=0.6, curve=gpu)
    assert (s.num_blocks, s.pool_size) == (2, 4)
    # Steep (fp32 on a small CPU): AR, whichever shape.
    steep = _curve({1: 1.0, 2: 1.6, 4: 1.41, 8: 1.36, 16: 1.57, 32: 2.06, 64: 3.0})
    assert tuning.choose_settings(None, "multiblock", rho=0.04, curve=steep).method == "ar"


def test_a_merged_adapter_gets_its_own_profile() -> None:
    # A merged LoRA adapter changes the projections, not the output embeddings; its acceptance
    # must not be blended with its base model's.
    base = tiny_llama(seed=0)
    tuned = tiny_llama(seed=0)
    assert tuning.model_key(base) == tuning.model_key(tuned)
    with torch.no_grad():
        tuned.model.layers[0].self_attn.q_proj.weight.mul_(1.01)
    assert tuning.model_key(base) != tuning.model_key(tuned)


def test_curve_is_made_monotone() -> None:
    # a load spike at small sizes must not make the one-token forward look expensive
    assert tuning.monotone([1.2, 0.9, 0.1, 0.2, 4.3, 0.7]) == [0.1, 0.1, 0.1, 0.2, 0.7, 0.7]


def test_controller_keeps_parallel_when_it_pays() -> None:
    ctl = FallbackController(cost_ratio=lambda q: 1.5, window=4)
    for _ in range(4):
        ctl.observe(2, 16)  # 2 tokens per step against AR's 1.5 in the same time
    assert not ctl.should_fall_back()
    for _ in range(3):
        ctl.observe(1, 16)
    assert ctl.should_fall_back()  # last 4 steps: 5 tokens < 4 * 1.5


def test_curve_is_measured_once_and_cached() -> None:
    """A tuned call measures the few widths it needs (the quick curve); `full` (the tune
    command, the demo's plot) measures every size once and replaces it."""
    model = tiny_llama(seed=0)
    c1 = tuning.step_curve(model)
    assert c1.sizes == list(tuning.QUICK_SIZES) and all(s > 0 for s in c1.seconds)
    assert c1.context == tuning.QUICK_CONTEXT
    c2 = tuning.step_curve(model)
    assert c2 == c1  # read back from the profile, not re-measured
    full = tuning.step_curve(model, full=True)
    assert full.sizes == list(tuning.SIZES) and full.context == 256
    assert tuning.step_curve(model) == full  # the full curve is what tuned calls use now
    assert tuning.step_curve(model, full=True) == full  # and it is not measured again


def test_tuned_generation_is_lossless_and_learns_acceptance() -> None:
    model = tiny_llama(vocab_size=64, seed=3, dtype=torch.float64)
    ids = torch.randint(0, 64, (1, 9))
    want = generate(model, ids, max_new_tokens=60, method="ar").tokens
    res = generate(model, ids, max_new_tokens=60, method="multiblock", block_size=None)
    assert torch.equal(res.tokens, want)
    prof = tuning.load_profile(model)
    # The tuner may pick AR on a busy machine (the measured curve decides); then the method is
    # "ar" or "ar+lookup" and no parallel acceptance was observed.
    if res.block_size > 1:
        assert 0.0 <= prof["rho"] <= 1.0 and prof["rho_weight"] > 0


def test_controller_falls_back_to_ar_losslessly() -> None:
    model = tiny_llama(vocab_size=64, seed=4, dtype=torch.float64)
    ids = torch.randint(0, 64, (1, 9))
    want = generate(model, ids, max_new_tokens=80, method="ar").tokens[0].tolist()
    cfg = loop.DecodeConfig(
        max_new=80, eos=set(), block_size=8, num_blocks=2, pool_size=2, activation_ratio=0.85,
        cost_ratio=lambda q: 1e9, fallback_window=4,  # AR "infinitely fast"
    )  # fmt: skip
    (res,), stats = loop.decode(model, ids.tolist(), cfg, torch.Generator().manual_seed(0))
    assert res.tokens == want
    assert stats.forwards > 4
    # decided after exactly one window of parallel steps, then AR took over (one token a step)
    assert all(a == 1 for a in res.accepted[4:-1]), res.accepted


def test_tuned_calls_race_parallel_against_ar_with_lookup() -> None:
    # The prediction credits parallel steps with an acceptance that repetition raises, and
    # weighs them against plain AR; with lookup drafts on, the alternative is AR with lookup,
    # so the two modes race on their measured speed over plain AR.
    model = tiny_llama(seed=0)
    flat = _curve({1: 1.0, 2: 1.0, 4: 1.0, 8: 1.0, 16: 1.05, 32: 2.0, 64: 4.0, 128: 8.0})

    def pick(lookup=True):
        return tuning.choose_settings(model, "multiblock", rho=0.9, curve=flat, lookup=lookup)

    assert pick().method == "multiblock"  # nothing measured: the prediction
    tuning.remember_mode_speed(model, tuning.PARALLEL, 1.3, weight=100)
    assert pick().method == "ar"  # AR with lookup has no figure yet: measure it once
    tuning.remember_mode_speed(model, tuning.AR_LOOKUP, 1.6, weight=100)
    got = pick()
    assert got.method == "ar" and got.expected_speedup == pytest.approx(1.6)  # the faster
    assert pick(lookup=False).method == "multiblock"  # plain AR is what the prediction weighs
    for _ in range(tuning.RETRY_LOSER_EVERY - 3):  # calls 3 .. 9: one in ten runs the loser
        tuning.remember_mode_speed(model, tuning.AR_LOOKUP, 1.6, weight=100)
    retry = pick()
    assert retry.method == "multiblock" and retry.expected_speedup == pytest.approx(1.3)
    tuning.remember_mode_speed(model, tuning.PARALLEL, 2.9, weight=10_000)  # it got faster
    assert pick().method == "multiblock"
    prof = tuning.load_profile(model)
    assert prof["tuned_calls"] == tuning.RETRY_LOSER_EVERY
    # recent calls count: the old weight is capped, so 10 000 tokens at 2.9 outweigh the past
    assert prof["modes"][tuning.PARALLEL]["speedup"] > 2.5


def test_a_tuned_call_records_its_mode_speed() -> None:
    model = tiny_llama(vocab_size=64, seed=3, dtype=torch.float64)
    ids = torch.randint(0, 64, (1, 9))
    want = generate(model, ids, max_new_tokens=40, method="ar").tokens
    for call in (1, 2):
        res = generate(model, ids, max_new_tokens=40, method="multiblock", block_size=None)
        assert torch.equal(res.tokens, want)  # whichever mode ran
        prof = tuning.load_profile(model)
        mode = tuning.PARALLEL if res.block_size > 1 else tuning.AR_LOOKUP
        assert prof["tuned_calls"] == call and prof["modes"][mode]["speedup"] > 0
    # after a parallel call, the next one measured AR with lookup (or the curve chose AR twice)
    assert tuning.AR_LOOKUP in prof["modes"]


def test_steps_tuned_calls_run_refine_the_curve() -> None:
    """A tuned call's own step times (forward + verification) refine the probe's curve: its
    widths are stored with their observed ratios, at the probe's pace (the call's median ratio
    observed / probe is 1), and the curve takes them. A width seen fewer than 3 times does not
    count, nor a call with a single counted width (it says nothing of the curve's shape)."""
    model = tiny_llama(seed=5)
    probe = tuning.step_curve(model)
    tuning.remember_step_times(
        model, [16, 16, 16, 2, 2, 2, 4], [0.02, 0.03, 0.025, 0.011, 0.009, 0.010, 9.0]
    )
    prof = tuning.load_profile(model)
    assert set(prof["observed"]) == {"2", "16"} and prof[tuning.PACED_OBSERVATIONS]
    seen = {int(w): o["seconds"] for w, o in prof["observed"].items()}
    assert seen[16] / seen[2] == pytest.approx(2.5)  # the call's own ratio
    assert statistics.median([seen[16] / probe.time(16), seen[2] / probe.time(2)]) == (
        pytest.approx(1.0)
    )  # at the probe's pace
    curve = tuning.step_curve(model)  # (then made monotone with the probe's other widths)
    assert {2, 16} <= set(curve.sizes) and curve.time(2) <= seen[2] and curve.time(16) <= seen[16]
    tuning.remember_step_times(model, [8, 8, 8], [1.0, 1.0, 1.0])  # one width: nothing learnt
    assert tuning.load_profile(model)["observed"] == prof["observed"]
    assert tuning.step_curve(model, full=True).sizes == list(tuning.SIZES)  # as measured


def test_step_times_of_calls_at_different_paces_keep_the_curves_shape() -> None:
    """Calls in a fast minute and in a slow one (the host's pace halved), each seeing other
    widths: the refined curve's ratios are the steps' own, not the minutes'. (Blended as absolute
    times, width 7 seen only in the fast minute read half as dear against width 4 as it is.)"""
    model = tiny_llama(seed=7)
    probe = tuning.step_curve(model)

    def step(w: int, pace: float) -> float:  # a real step: the probe's forward and host work
        return pace * 1.3 * probe.time(w)

    tuning.remember_step_times(model, [1] * 3 + [7] * 3, [step(1, 1.0)] * 3 + [step(7, 1.0)] * 3)
    for _ in range(5):
        tuning.remember_step_times(
            model, [1] * 3 + [4] * 3, [step(1, 2.0)] * 3 + [step(4, 2.0)] * 3
        )
    curve = tuning.step_curve(model)
    assert curve.time(7) / curve.time(4) == pytest.approx(probe.time(7) / probe.time(4))
    assert curve.time(4) / curve.time(1) == pytest.approx(probe.time(4) / probe.time(1))


def test_absolute_step_times_of_an_older_profile_are_dropped() -> None:
    """Observed times an older version stored unpaced (absolute) do not mix with paced ones."""
    model = tiny_llama(seed=8)
    probe = tuning.step_curve(model)
    prof = tuning.load_profile(model)
    prof["observed"] = {"4": {"seconds": 1e-9, "weight": 200.0}}  # absurdly cheap, unpaced
    tuning.save_profile(model, prof)
    assert tuning.step_curve(model).time(4) == pytest.approx(probe.time(4))
    assert "observed" not in tuning.load_profile(model)


def test_priced_generate_records_its_step_times() -> None:
    """A call whose steps are priced by the curve (tuned, or with lookup drafts) records them,
    where it ran at least two widths 3 times or more (a fixed small block keeps the step count
    up whatever the tuner would pick; fixed ids: drafts then lengthen some steps, which for a few
    of random ids they never do, and a call of one width records nothing)."""
    model = tiny_llama(vocab_size=64, seed=6)
    ids = torch.randint(0, 64, (1, 7), generator=torch.Generator().manual_seed(0))
    res = generate(model, ids, max_new_tokens=80, method="jacobi", block_size=4, lookup=True)
    assert res.forwards >= 2 * tuning.MIN_OBSERVED_STEPS
    observed = tuning.load_profile(model).get("observed")
    assert observed and len(observed) >= 2
    assert all(o["weight"] >= tuning.MIN_OBSERVED_STEPS for o in observed.values())


def _write_profiles(args) -> str:
    """A child process: save the same model's profile many times (as a parallel eval shard does
    after every call); returns the path it wrote."""
    cache, writer, times, start = args
    import os
    import time

    os.environ["JACOBI_EXT_CACHE"] = cache
    model = tiny_llama(seed=0).eval()
    time.sleep(max(0.0, start - time.time()))  # all writers begin together
    for i in range(times):
        tuning.save_profile(model, {"writer": writer, "i": i})
    return str(tuning._profile_path(model))


def test_processes_saving_one_profile_at_once_never_collide(tmp_path) -> None:
    """Eval shards decoding the same model save its profile after every call: their writes
    raced on one temporary file (FileNotFoundError in the slower rename). Each writer now has
    its own, the last rename wins, and no temporary file is left behind."""
    import multiprocessing as mp
    import time

    start = time.time() + 8.0  # after the children's imports
    with mp.get_context("spawn").Pool(3) as pool:
        done = pool.map(_write_profiles, [(str(tmp_path), s, 1000, start) for s in range(3)])
    (profile,) = (tmp_path / "profiles").glob("*.json")
    assert set(done) == {str(profile)}  # one model, one profile, written by all three
    assert json.loads(profile.read_text())["i"] == 999  # whole: some writer's last save
    assert not list((tmp_path / "profiles").glob("*.tmp"))


def test_an_unwritable_cache_warns_once_and_decoding_goes_on(tmp_path, monkeypatch) -> None:
    blocker = tmp_path / "not-a-folder"
    blocker.write_text("a file where the cache folder should be")
    monkeypatch.setenv("JACOBI_EXT_CACHE", str(blocker))
    monkeypatch.setattr(tuning, "_warned_unwritable", [])
    model = tiny_llama(seed=0).eval()
    with pytest.warns(UserWarning, match="could not write the tuning profile"):
        tuning.save_profile(model, {"a": 1})
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        tuning.save_profile(model, {"a": 2})  # said once per process
        ids = torch.tensor([[1, 5, 7, 9]])
        want = generate(model, ids, method="ar", max_new_tokens=8).tokens
        assert torch.equal(generate(model, ids, max_new_tokens=8).tokens, want)  # tuned
