"""Lossless is the contract: every method's tokens equal greedy AR's, token for token, and our
AR equals transformers' own greedy generate. Tiny random models in float64, so the different
summation orders of one-token and many-token forwards cannot flip an argmax."""

from __future__ import annotations

import random

import pytest
import torch

from jacobi_ext import generate
from jacobi_ext.models import tiny_llama

VOCAB = 64


def _hf_greedy(model, ids: torch.Tensor, max_new: int, eos: int | None) -> list[int]:
    out = model.generate(
        ids,
        attention_mask=torch.ones_like(ids),  # never infer padding from token values
        max_new_tokens=max_new,
        do_sample=False,
        eos_token_id=eos,
        pad_token_id=eos if eos is not None else 0,
    )[0, ids.shape[1] :].tolist()
    if eos is not None and eos in out:  # generate pads after EOS; we stop there
        out = out[: out.index(eos) + 1]
    return out


@pytest.fixture(scope="module")
def models():
    return {
        (fam, seed): tiny_llama(vocab_size=VOCAB, seed=seed, dtype=torch.float64, family=fam)
        for fam in ("llama", "qwen2")
        for seed in range(3)
    }


@pytest.mark.parametrize("case", range(24))
def test_all_methods_equal_greedy(models, case: int) -> None:
    rng = random.Random(case)
    fam = rng.choice(["llama", "qwen2"])
    model = models[(fam, rng.randrange(3))]
    P = rng.randint(1, 20)
    ids = torch.tensor([[rng.randrange(VOCAB) for _ in range(P)]])
    max_new = rng.randint(1, 90)
    eos = rng.choice([None, rng.randrange(VOCAB)])
    want = _hf_greedy(model, ids, max_new, eos)
    ar = generate(model, ids, max_new_tokens=max_new, method="ar", eos_token_id=eos)
    assert ar.tokens[0].tolist() == want
    for method, kw in [
        ("jacobi", dict(block_size=rng.choice([2, 3, 5, 8, 16]), lookup=case % 3 == 0)),
        (
            "multiblock",
            dict(
                block_size=rng.choice([2, 4, 7, 16]),
                num_blocks=rng.randint(1, 4),
                pool_size=rng.randint(0, 5),
                activation_ratio=rng.choice([0.25, 0.5, 0.85, 1.0]),
                lookup=case % 2 == 0,  # with and without the context-lookup candidate row
            ),
        ),
    ]:
        res = generate(
            model, ids, max_new_tokens=max_new, method=method, eos_token_id=eos, seed=case, **kw
        )
        assert res.tokens[0].tolist() == want, (method, kw)
        assert res.forwards <= max(len(want), 1)
        # every token is credited to the forward whose argmax confirmed it; only a one-token
        # answer can come from the prefill alone
        assert sum(res.accepted) == len(want) - (res.forwards == 0)


@pytest.mark.parametrize("case", range(6))
def test_qwen3_methods_equal_greedy(case: int) -> None:
    """Qwen3 (per-head q/k norms, jacobi_ext/models/families/qwen3.py), float64: every method
    returns transformers' greedy token for token."""
    rng = random.Random(100 + case)
    model = tiny_llama(vocab_size=VOCAB, seed=case % 3, dtype=torch.float64, family="qwen3")
    ids = torch.tensor([[rng.randrange(VOCAB) for _ in range(rng.randint(1, 20))]])
    max_new = rng.randint(1, 60)
    eos = rng.choice([None, rng.randrange(VOCAB)])
    want = _hf_greedy(model, ids, max_new, eos)
    for method, kw in [
        ("ar", {}),
        ("jacobi", dict(block_size=rng.choice([3, 8]), lookup=case % 2 == 0)),
        ("multiblock", dict(block_size=4, num_blocks=rng.randint(1, 3), pool_size=2)),
    ]:
        res = generate(model, ids, max_new_tokens=max_new, method=method, eos_token_id=eos, **kw)
        assert res.tokens[0].tolist() == want, (method, kw)


def test_recycling_candidates_win_and_stay_lossless(models) -> None:
    """A repetitive continuation makes recycled candidates win; the commit path that moves
    their K/V into place must still reproduce greedy exactly."""
    model = models[("llama", 0)]
    ids = torch.tensor([[5, 9, 5, 9, 5, 9, 5, 9]])
    want = _hf_greedy(model, ids, 120, None)
    res = generate(
        model,
        ids,
        max_new_tokens=120,
        method="multiblock",
        block_size=6,
        num_blocks=3,
        pool_size=6,
        activation_ratio=0.5,
        lookup=False,  # recycled candidates only
    )
    assert res.candidate_wins > 0, "no candidate won: this test would not exercise the K/V move"
    assert res.tokens[0].tolist() == want


def test_batch_is_each_sequence_lossless(models) -> None:
    model = models[("qwen2", 1)]
    ids = torch.randint(0, VOCAB, (3, 7))
    res = generate(model, ids, max_new_tokens=30, method="multiblock", block_size=4, eos_token_id=3)
    for b in range(3):
        want = _hf_greedy(model, ids[b : b + 1], 30, 3)
        assert res.lengths[b] == len(want)
        assert res.tokens[b, : len(want)].tolist() == want


@pytest.mark.parametrize("fused", ["1", "0"])
def test_a_half_kv_cache_decodes_exactly_its_own_ar(monkeypatch, fused) -> None:
    """A float16 K/V cache (set_kv_cache_dtype; the 8-bit mode's default) rounds every key and
    value alike whichever step writes it: every method, and a batch, returns exactly that cache's
    own `ar`, on the fused CPU ops and on the model's own attention (JACOBI_EXT_FUSED=0). Back to
    the model's dtype, the exact tokens again (a new cache: the runtime is not reused across)."""
    from jacobi_ext.models.quantized import describe, kv_cache_dtype, set_kv_cache_dtype

    monkeypatch.setenv("JACOBI_EXT_FUSED", fused)
    model = tiny_llama(vocab_size=VOCAB, seed=2)  # float32
    ids = torch.randint(0, VOCAB, (2, 11), generator=torch.Generator().manual_seed(7))
    exact = generate(model, ids, max_new_tokens=50, method="ar").tokens
    set_kv_cache_dtype(model, torch.float16)
    assert kv_cache_dtype(model) == torch.float16 and describe(model).endswith("fp16 K/V cache")
    ar = generate(model, ids, max_new_tokens=50, method="ar").tokens
    layers = model._jacobi_runtime.cache.layers
    assert {(lay.keys.dtype, lay.values.dtype) for lay in layers} == {(torch.float16,) * 2}
    if fused == "1":
        assert {lay.keys_t.dtype for lay in layers} == {torch.float16}
    for kw in (
        dict(method="jacobi", block_size=8),
        dict(method="jacobi", block_size=16, lookup=True),
        dict(method="multiblock", block_size=4, num_blocks=3, pool_size=2),
        {},  # the tuned default
    ):
        assert torch.equal(generate(model, ids, max_new_tokens=50, **kw).tokens, ar), kw
    one = generate(model, ids[1:], max_new_tokens=50, method="jacobi", block_size=8).tokens
    assert torch.equal(one[0], ar[1, : one.shape[1]])
    set_kv_cache_dtype(model, None)
    assert torch.equal(generate(model, ids, max_new_tokens=50, method="ar").tokens, exact)
    assert {lay.keys.dtype for lay in model._jacobi_runtime.cache.layers} == {torch.float32}


def test_a_half_kv_cache_needs_a_float32_model(models) -> None:
    from jacobi_ext.models.quantized import set_kv_cache_dtype

    with pytest.raises(ValueError, match="goes with a float32 model"):
        set_kv_cache_dtype(models[("llama", 0)], torch.float16)  # float64
    with pytest.raises(ValueError, match="float16 or float32"):
        set_kv_cache_dtype(tiny_llama(vocab_size=VOCAB), torch.bfloat16)


def test_the_kv_cache_dtype_option_reaches_the_model(monkeypatch) -> None:
    """`--kv-cache-dtype` / load_model(kv_cache_dtype=...) set the model's cache type; a name
    that is not one is refused before anything loads."""
    import argparse

    import jacobi_ext.models as models_mod
    from jacobi_ext.apps.cli_args import add_model_args
    from jacobi_ext.models.quantized import kv_cache_dtype

    loads = []
    monkeypatch.setattr(
        models_mod,
        "_load_model",
        lambda *a: loads.append(a) or (tiny_llama(vocab_size=VOCAB), None),
    )
    parser = argparse.ArgumentParser()
    add_model_args(parser)
    model, _ = models_mod.load_from_args(parser.parse_args(["--kv-cache-dtype", "float16"]))
    assert kv_cache_dtype(model) == torch.float16
    model, _ = models_mod.load_model(kv_cache_dtype="float32")
    assert kv_cache_dtype(model) == torch.float32 and len(loads) == 2
    with pytest.raises(ValueError, match="kv_cache_dtype is float16 or float32"):
        models_mod.load_model(kv_cache_dtype="int8")
    assert len(loads) == 2


def test_streamer_receives_exactly_the_tokens(models) -> None:
    class Collect:
        def __init__(self) -> None:
            self.calls: list[list[int]] = []
            self.ended = False

        def put(self, t: torch.Tensor) -> None:
            self.calls.append(t.reshape(-1).tolist())

        def end(self) -> None:
            self.ended = True

    model = models[("llama", 2)]
    ids = torch.randint(0, VOCAB, (1, 6))
    s = Collect()
    res = generate(model, ids, max_new_tokens=40, method="multiblock", block_size=5, streamer=s)
    assert s.calls[0] == ids[0].tolist() and s.ended
    assert sum(s.calls[1:], []) == res.tokens[0].tolist()


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(method="beam"), "method must be one of"),
        (dict(block_size=1), "block_size must be >= 2"),
        (dict(num_blocks=0), "num_blocks must be >= 1"),
        (dict(pool_size=-1), "pool_size must be >= 0"),
        (dict(max_new_tokens=0), "max_new_tokens must be >= 1"),
        (dict(activation_ratio=0.0), "activation_ratio"),
        (dict(max_new_tokens=5000), "exceeds the model's context"),
    ],
)
def test_bad_arguments(models, kwargs, match) -> None:
    ids = torch.randint(0, VOCAB, (1, 4))
    with pytest.raises(ValueError, match=match):
        generate(models[("llama", 0)], ids, **kwargs)


def test_bad_prompts(models) -> None:
    model = models[("llama", 0)]
    with pytest.raises(ValueError, match="prompt is empty"):
        generate(model, torch.zeros(1, 0, dtype=torch.long))
    with pytest.raises(ValueError, match="2-D"):
        generate(model, torch.zeros(4, dtype=torch.long))
    with pytest.raises(ValueError, match="vocabulary"):
        generate(model, torch.tensor([[VOCAB + 3]]))


def test_trajectory_states_end_at_greedy_fixed_points(models) -> None:
    from jacobi_ext.decoding.engine import TrajectoryRecorder

    model = models[("llama", 1)]
    ids = torch.randint(0, VOCAB, (1, 8))
    n = 6
    rec = TrajectoryRecorder()
    res = generate(model, ids, max_new_tokens=4 * n, method="jacobi", block_size=n, trajectory=rec)
    assert len(rec.blocks) == 4
    fixed = [b[-1] for b in rec.blocks]
    assert sum(fixed, []) == res.tokens[0].tolist()  # the last states are greedy's tokens
    for b in rec.blocks:
        assert all(len(s) == n for s in b)
        assert len({id(s) for s in b}) == len(b)  # every state its own list (no aliasing)
        # the converged prefix never shrinks from one iteration to the next
        d = [next((i for i in range(n) if s[i] != b[-1][i]), n) for s in b]
        assert d == sorted(d) and d[-1] == n
    assert sum(len(b) for b in rec.blocks) - len(rec.blocks) <= res.forwards
    with pytest.raises(ValueError, match="trajectory"):
        generate(model, ids, method="multiblock", block_size=4, trajectory=TrajectoryRecorder())


@pytest.mark.gpu
@pytest.mark.parametrize("case", range(4))
def test_all_methods_equal_greedy_on_cuda(case: int) -> None:
    """The same contract on a GPU: the verify step runs as the CUDA op, the cache on device."""
    rng = random.Random(100 + case)
    model = tiny_llama(vocab_size=VOCAB, seed=case, dtype=torch.float64).cuda()
    ids = torch.tensor([[rng.randrange(VOCAB) for _ in range(rng.randint(1, 16))]]).cuda()
    max_new = rng.randint(20, 80)
    want = _hf_greedy(model, ids, max_new, None)
    for kw in (
        dict(method="ar"),
        dict(method="jacobi", block_size=8),
        dict(method="multiblock", block_size=6, num_blocks=3, pool_size=4, lookup=False),
        dict(method="multiblock", block_size=6, num_blocks=3, pool_size=4, lookup=True),
    ):
        res = generate(model, ids, max_new_tokens=max_new, **kw)
        assert res.tokens[0].tolist() == want, kw
