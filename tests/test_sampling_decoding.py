"""Sampling through the decoding engine: every method returns `ar`'s sample token for
token (batch 1 and ragged batches, lookup on and off, EOS inside a block), a sequence's sample
does not depend on its batch, greedy stays greedy, and bad options fail clearly. Tiny random
Llama and Qwen2 models in float64, so that the different summation orders of one-token and
many-token forwards cannot flip an argmax: what is tested is the algorithm."""

from __future__ import annotations

import random

import pytest
import torch

from jacobi_ext import generate
from jacobi_ext.decoding import left_pad
from jacobi_ext.models import tiny_llama

VOCAB = 64


@pytest.fixture(scope="module")
def models():
    return {
        (fam, seed): tiny_llama(vocab_size=VOCAB, seed=seed, dtype=torch.float64, family=fam)
        for fam in ("llama", "qwen2")
        for seed in range(2)
    }


def _filters(rng: random.Random) -> dict:
    return dict(
        temperature=rng.choice([0.3, 0.7, 1.0, 1.5]),
        top_k=rng.choice([0, 5, 50]),
        top_p=rng.choice([1.0, 0.9, 0.5]),
        min_p=rng.choice([None, 0.05]),
    )


def _eos_inside(tokens: list[int], rng: random.Random) -> int | None:
    """An EOS id that the sample itself reaches at some position, so that decoding stops there,
    typically in the middle of a block."""
    if len(tokens) < 3:
        return None
    return tokens[rng.randrange(1, len(tokens))]


@pytest.mark.parametrize("case", range(30))
def test_sampled_methods_equal_ar_sample(models, case: int) -> None:
    rng = random.Random(7000 + case)
    model = models[(rng.choice(["llama", "qwen2"]), rng.randrange(2))]
    ids = torch.tensor([[rng.randrange(VOCAB) for _ in range(rng.randint(1, 16))]])
    max_new = rng.randint(1, 70)
    kw = dict(do_sample=True, seed=rng.randrange(2**40), **_filters(rng))
    free = generate(model, ids, max_new_tokens=max_new, method="ar", **kw).tokens[0].tolist()
    eos = _eos_inside(free, rng) if case % 3 else None
    ar = generate(model, ids, max_new_tokens=max_new, method="ar", eos_token_id=eos, **kw)
    want = ar.tokens[0].tolist()
    if eos is None:
        assert want == free
    else:  # the same sample, cut at the first EOS
        assert want == free[: free.index(eos) + 1]
    for method, extra in [
        ("ar", dict(lookup=True)),
        ("jacobi", dict(block_size=rng.choice([2, 3, 5, 8, 16]), lookup=case % 2 == 0)),
        (
            "multiblock",
            dict(
                block_size=rng.choice([2, 4, 7, 16]),
                num_blocks=rng.randint(1, 4),
                pool_size=rng.randint(0, 5),
                activation_ratio=rng.choice([0.25, 0.5, 0.85, 1.0]),
                lookup=case % 2 == 1,
            ),
        ),
    ]:
        res = generate(
            model, ids, max_new_tokens=max_new, method=method, eos_token_id=eos, **kw, **extra
        )
        assert res.tokens[0].tolist() == want, (method, extra, kw)
        assert res.forwards <= max(len(want), 1)
        assert res.seed == kw["seed"] and res.sampling is not None


def _left_pad(prompts: list[list[int]], pad_value: int = 7):
    return left_pad(prompts, pad=pad_value)


@pytest.mark.parametrize("case", range(16))
def test_ragged_batch_sample_is_each_sequence_alone(models, case: int) -> None:
    """Every sequence of a ragged batch gets, for every method, the sample `ar` gives its prompt
    alone: its noise stream is its own, whatever the batch around it."""
    rng = random.Random(8000 + case)
    model = models[(rng.choice(["llama", "qwen2"]), rng.randrange(2))]
    B = rng.choice([2, 3, 5])
    prompts = [[rng.randrange(VOCAB) for _ in range(rng.randint(1, 14))] for _ in range(B)]
    if case % 4 == 0:
        prompts[-1] = list(prompts[0])  # a duplicate: its own (second) stream
    max_new = rng.randint(1, 50)
    eos = rng.choice([None, rng.randrange(VOCAB)])
    kw = dict(do_sample=True, seed=rng.randrange(2**40), eos_token_id=eos, **_filters(rng))
    seen: dict[tuple, int] = {}
    want = []
    for p in prompts:
        if tuple(p) in seen:  # the second copy of a prompt: a batch of two copies, row 1
            two = generate(model, torch.tensor([p, p]), max_new_tokens=max_new, method="ar", **kw)
            want.append(two.tokens[1, : two.lengths[1]].tolist())
        else:
            one = generate(model, torch.tensor([p]), max_new_tokens=max_new, method="ar", **kw)
            want.append(one.tokens[0].tolist())
        seen[tuple(p)] = 1
    ids, mask = _left_pad(prompts)
    method = rng.choice(["ar", "jacobi", "multiblock"])
    extra = {} if method == "ar" else dict(block_size=rng.choice([2, 4, 7]))
    if method == "multiblock":
        extra.update(num_blocks=rng.randint(1, 3), pool_size=rng.randint(0, 4))
    extra["lookup"] = case % 2 == 0
    res = generate(
        model, ids, attention_mask=mask, max_new_tokens=max_new, method=method, **kw, **extra
    )
    got = [res.tokens[b, : res.lengths[b]].tolist() for b in range(B)]
    assert got == want, (method, extra)


def test_batch_composition_does_not_change_a_sample(models) -> None:
    model = models[("llama", 0)]
    x, y = [3, 1, 4, 1, 5], [9, 2, 6]
    kw = dict(max_new_tokens=24, method="multiblock", block_size=4, do_sample=True, seed=11)
    alone = generate(model, torch.tensor([y]), **kw).tokens[0].tolist()
    ids, mask = _left_pad([x, y])
    both = generate(model, ids, attention_mask=mask, **kw)
    assert both.tokens[1, : both.lengths[1]].tolist() == alone
    ids2, mask2 = _left_pad([y, x])
    sw = generate(model, ids2, attention_mask=mask2, **kw)
    assert sw.tokens[0, : sw.lengths[0]].tolist() == alone
    # identical prompts: independent streams, so (almost surely) different samples
    dup = generate(model, torch.tensor([y, y, y]), **kw)
    rows = {tuple(dup.tokens[b].tolist()) for b in range(3)}
    assert len(rows) == 3
    assert dup.tokens[0].tolist() == alone
    # another seed, another sample
    other = generate(model, torch.tensor([y]), **{**kw, "seed": 12}).tokens[0].tolist()
    assert other != alone


def test_greedy_unchanged_and_seed_semantics(models) -> None:
    model = models[("qwen2", 1)]
    ids = torch.tensor([[5, 9, 5, 9, 2]])
    g0 = generate(model, ids, max_new_tokens=30, method="multiblock", block_size=4)
    g1 = generate(
        model, ids, max_new_tokens=30, method="multiblock", block_size=4, do_sample=False, seed=0
    )
    ar = generate(model, ids, max_new_tokens=30, method="ar")
    assert g0.tokens.equal(g1.tokens) and g0.tokens.equal(ar.tokens)
    assert g0.forwards == g1.forwards and g0.accepted == g1.accepted  # same drafts: seed 0
    assert g0.sampling is None and g0.seed == 0
    # top_k=1 keeps the argmax alone: sampling collapses to greedy, whatever the seed
    s = generate(model, ids, max_new_tokens=30, method="ar", do_sample=True, top_k=1, seed=5)
    assert s.tokens.equal(ar.tokens)
    # seed None under sampling: drawn from torch's generator, reported, reproducible
    torch.manual_seed(123)
    a = generate(model, ids, max_new_tokens=20, method="ar", do_sample=True)
    torch.manual_seed(123)
    b = generate(model, ids, max_new_tokens=20, method="ar", do_sample=True)
    assert a.seed == b.seed and a.tokens.equal(b.tokens)
    c = generate(model, ids, max_new_tokens=20, method="jacobi", block_size=4, do_sample=True,
                 seed=a.seed)  # fmt: skip
    assert c.tokens.equal(a.tokens)


def test_sampling_options_ignored_without_do_sample_warn(models) -> None:
    model = models[("llama", 1)]
    ids = torch.tensor([[1, 2, 3]])
    ar = generate(model, ids, max_new_tokens=8, method="ar")
    with pytest.warns(UserWarning, match="temperature, top_p only apply to sampling"):
        res = generate(model, ids, max_new_tokens=8, method="ar", temperature=0.5, top_p=0.9)
    assert res.tokens.equal(ar.tokens)


@pytest.mark.parametrize(
    "kw, match",
    [
        (dict(temperature=0.0), r"temperature must be a float > 0"),
        (dict(temperature=-1.0), r"temperature must be a float > 0"),
        (dict(temperature=float("nan")), r"temperature must be a float > 0"),
        (dict(top_p=0.0), r"top_p must be a float in \(0, 1\]"),
        (dict(top_p=1.5), r"top_p must be a float in \(0, 1\]"),
        (dict(top_k=-1), r"top_k must be an int >= 0"),
        (dict(top_k=2.5), r"top_k must be an int >= 0"),
        (dict(min_p=1.5), r"min_p must be a float in \[0, 1\]"),
        (dict(min_p=-0.1), r"min_p must be a float in \[0, 1\]"),
        (dict(repetition_penalty=1.2), r"repetition_penalty=1.2 is not supported.*prefix"),
        (dict(no_repeat_ngram_size=3), r"no_repeat_ngram_size=3 is not supported"),
        (dict(num_beams=4), r"num_beams=4 is not supported"),
        (dict(seed=1.5), r"seed must be an int or None"),
    ],
)
def test_bad_sampling_options(models, kw: dict, match: str) -> None:
    model = models[("llama", 0)]
    with pytest.raises(ValueError, match=match):
        generate(model, torch.tensor([[1, 2]]), max_new_tokens=4, do_sample=True, **kw)


def test_neutral_and_unknown_options(models) -> None:
    model = models[("llama", 0)]
    ids = torch.tensor([[1, 2]])
    a = generate(model, ids, max_new_tokens=6, method="ar", do_sample=True, seed=1)
    b = generate(model, ids, max_new_tokens=6, method="ar", do_sample=True, seed=1,
                 repetition_penalty=1.0, num_beams=1)  # fmt: skip
    assert a.tokens.equal(b.tokens)
    with pytest.raises(TypeError, match="unexpected keyword argument 'tempreature'"):
        generate(model, ids, max_new_tokens=6, do_sample=True, tempreature=0.5)


def test_defaults_come_from_the_generation_config(models) -> None:
    """As in transformers: unset filters take the model's generation_config values."""
    from jacobi_ext.decoding.sampling import SamplingConfig, sampling_config

    model = tiny_llama(vocab_size=VOCAB, seed=3, dtype=torch.float64)
    assert sampling_config(model) == SamplingConfig(1.0, 50, 1.0, 0.0)
    model.generation_config.top_k = 1
    model.generation_config.temperature = 0.5
    assert sampling_config(model, top_p=0.9) == SamplingConfig(0.5, 1, 0.9, 0.0)
    ids = torch.tensor([[4, 4, 2]])
    s = generate(model, ids, max_new_tokens=12, method="ar", do_sample=True, seed=9)
    g = generate(model, ids, max_new_tokens=12, method="ar")
    assert s.tokens.equal(g.tokens)  # top_k=1 from the config: the argmax


@pytest.mark.gpu
def test_cuda_sampled_decoding_equals_cpu(models) -> None:
    """On CUDA (graphs on and off) every method gives the CPU `ar` sample: the same noise, the
    same filters, float64 logits."""
    cpu = models[("llama", 0)]
    gpu = tiny_llama(vocab_size=VOCAB, seed=0, dtype=torch.float64).cuda()
    rng = random.Random(5)
    for case in range(6):
        ids = torch.tensor([[rng.randrange(VOCAB) for _ in range(rng.randint(2, 12))]])
        kw = dict(max_new_tokens=40, do_sample=True, seed=case, **_filters(rng))
        want = generate(cpu, ids, method="ar", **kw).tokens[0].tolist()
        for graphs in (True, False):
            for method, extra in [("ar", {}), ("jacobi", dict(block_size=8)),
                                  ("multiblock", dict(block_size=4, lookup=True))]:  # fmt: skip
                res = generate(gpu, ids.cuda(), method=method, cuda_graphs=graphs, **kw, **extra)
                assert res.tokens[0].tolist() == want, (method, graphs)
