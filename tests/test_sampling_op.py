"""torch.ops.jacobi_ext.gumbel_argmax and its noise: the Philox generator against
known answers and a pure-torch restatement, the op against the torch reference of its rules for
every dtype and filter, its exactness in distribution against transformers' own logits
processors (chi-square at a fixed significance, with a wrong variant the test rejects), bad
arguments, and CUDA against CPU (skipped without a GPU)."""

from __future__ import annotations

import math

import pytest
import torch

from jacobi_ext.decoding.sampling import (
    SamplingConfig,
    gumbel_argmax_reference,
    gumbel_noise,
    noise_bits,
    philox4x32_10,
)

op = torch.ops.jacobi_ext.gumbel_argmax
ALPHA = 1e-3  # significance of the chi-square tests (their seeds are fixed: deterministic)


def _run(logits, keys, pos, c: SamplingConfig):
    return op(logits, keys, pos, c.temperature, c.top_k, c.top_p, c.min_p)


# ---- the generator -----------------------------------------------------------------------------
@pytest.mark.parametrize(
    "ctr, key, want",
    [  # Random123's known-answer vectors for philox4x32_10
        ((0, 0, 0, 0), (0, 0), (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)),
        ((0xFFFFFFFF,) * 4, (0xFFFFFFFF,) * 2, (0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD)),
        (
            (0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344),
            (0xA4093822, 0x299F31D0),
            (0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1),
        ),
    ],
)
def test_philox_known_answers(ctr, key, want) -> None:
    out = philox4x32_10([torch.tensor([c]) for c in ctr], key)
    assert tuple(int(o) for o in out) == want


KEYS = torch.tensor([[0, 0], [5, -7], [2**62 + 3, 99], [-1, 2**40]])
POS = torch.tensor([[0, 1, 2], [17, 2**32 - 1, 4], [5, 6, 7], [1000, 0, 3]])


def test_cpu_noise_equals_the_reference() -> None:
    V = 777
    u = torch.ops.jacobi_ext.debug_gumbel_noise(KEYS, POS, V, True)
    g = torch.ops.jacobi_ext.debug_gumbel_noise(KEYS, POS, V, False)
    for b in range(KEYS.shape[0]):
        s, st = (int(k) for k in KEYS[b])
        for q in range(POS.shape[1]):
            bits = noise_bits(s, st, int(POS[b, q]), V)
            assert torch.equal(u[b, q], (bits.double() + 0.5) * 2.0**-53)  # bit for bit
            # -log(-log u): libm's log vs torch's, each within an ulp
            torch.testing.assert_close(g[b, q], gumbel_noise(s, st, int(POS[b, q]), V),
                                       rtol=4e-16, atol=4e-16)  # fmt: skip
    assert 0.0 < float(u.min()) and float(u.max()) < 1.0
    # every key component matters: seed, stream, position, vocabulary index
    assert len({tuple(r.tolist()) for r in u.view(-1, V)[:, :8]}) == u.shape[0] * u.shape[1]


def test_noise_is_standard_gumbel() -> None:
    """Mean = Euler's gamma, variance = pi^2 / 6, over 2^20 draws (tolerances ~6 sigma)."""
    pos = torch.arange(256).view(1, 256)
    g = torch.ops.jacobi_ext.debug_gumbel_noise(torch.tensor([[3, 4]]), pos, 4096, False)
    assert abs(float(g.mean()) - 0.5772156649) < 6 * math.sqrt(math.pi**2 / 6 / g.numel())
    assert abs(float(g.var()) - math.pi**2 / 6) < 0.02


# ---- the op against its reference --------------------------------------------------------------
CONFIGS = [
    SamplingConfig(1.0, 0, 1.0, 0.0),  # plain softmax sampling
    SamplingConfig(0.7, 50, 1.0, 0.0),  # transformers' default top_k
    SamplingConfig(0.7, 5, 0.9, 0.05),
    SamplingConfig(1.3, 0, 0.5, 0.0),
    SamplingConfig(0.5, 3, 1.0, 0.2),
    SamplingConfig(2.0, 100, 0.95, 0.0),
    SamplingConfig(1.0, 0, 0.999, 0.01),
]


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("cfg", CONFIGS)
def test_op_equals_reference(dtype, cfg) -> None:
    g = torch.Generator().manual_seed(hash((str(dtype), cfg)) % 2**31)
    x = (torch.randn(4, 3, 300, generator=g, dtype=torch.float64) * 3).to(dtype)
    pos = POS.clone()
    got = _run(x, KEYS, pos, cfg)
    want = gumbel_argmax_reference(x, KEYS, pos, cfg)
    assert torch.equal(got, want)
    # a row's token depends on its own logits, key and position only
    perm = torch.tensor([2, 0, 3, 1])
    assert torch.equal(_run(x[perm], KEYS[perm], pos[perm], cfg), got[perm])
    assert torch.equal(_run(x[:, 1:2].contiguous(), KEYS, pos[:, 1:2].contiguous(), cfg),
                       got[:, 1:2])  # fmt: skip


def test_ties_in_bf16_follow_the_rules() -> None:
    """bf16 logits tie often; ties at the top-k value and at the top-p cut are kept whole."""
    g = torch.Generator().manual_seed(1)
    x = torch.randint(-4, 5, (3, 4, 40), generator=g).to(torch.bfloat16)  # many equal values
    keys = KEYS[:3]
    pos = POS[:3, :].repeat(1, 2)[:, :4].contiguous()
    for cfg in [SamplingConfig(1.0, 3, 1.0, 0.0), SamplingConfig(0.8, 0, 0.6, 0.0),
                SamplingConfig(1.0, 7, 0.7, 0.3)]:  # fmt: skip
        assert torch.equal(_run(x, keys, pos, cfg), gumbel_argmax_reference(x, keys, pos, cfg))


def test_degenerate_filters_give_the_argmax() -> None:
    g = torch.Generator().manual_seed(2)
    x = torch.randn(4, 3, 500, generator=g, dtype=torch.float64)
    am = x.argmax(-1)
    for cfg in [SamplingConfig(1.0, 1, 1.0, 0.0), SamplingConfig(1.0, 0, 1.0, 1.0),
                SamplingConfig(1e-9, 0, 1.0, 0.0), SamplingConfig(0.7, 0, 1e-6, 0.0)]:  # fmt: skip
        assert torch.equal(_run(x, KEYS, POS, cfg), am), cfg
    # top_k >= V is off; an empty batch is fine
    c = SamplingConfig(0.9, 0, 1.0, 0.0)
    assert torch.equal(
        _run(x, KEYS, POS, SamplingConfig(0.9, 500, 1.0, 0.0)), _run(x, KEYS, POS, c)
    )
    assert _run(x[:, :0], KEYS, POS[:, :0], c).shape == (4, 0)


def test_never_samples_outside_the_filtered_support() -> None:
    """Over many positions, every token drawn survives transformers' filters, and every token
    with probability above 1% there is drawn."""
    pytest.importorskip("transformers")
    g = torch.Generator().manual_seed(3)
    x = torch.randn(1, 1, 64, generator=g, dtype=torch.float64) * 2
    cfg = SamplingConfig(0.8, 20, 0.8, 0.05)
    p = _hf_probs(x[0, 0], cfg)
    pos = torch.arange(20000).view(1, -1)
    toks = _run(x.expand(1, pos.shape[1], 64).contiguous(), torch.tensor([[1, 2]]), pos, cfg)
    drawn = set(toks.flatten().tolist())
    assert drawn <= set(torch.nonzero(p > 0).flatten().tolist())
    assert set(torch.nonzero(p > 0.01).flatten().tolist()) <= drawn


# ---- exact in distribution ---------------------------------------------------------------------
def _hf_probs(logits: torch.Tensor, cfg: SamplingConfig) -> torch.Tensor:
    """transformers' law for one logits row [V]: its own processors, in its own order."""
    from transformers.generation.logits_process import (
        LogitsProcessorList,
        MinPLogitsWarper,
        TemperatureLogitsWarper,
        TopKLogitsWarper,
        TopPLogitsWarper,
    )

    procs = LogitsProcessorList()
    if cfg.temperature != 1.0:
        procs.append(TemperatureLogitsWarper(cfg.temperature))
    if cfg.top_k:
        procs.append(TopKLogitsWarper(cfg.top_k))
    if cfg.top_p < 1.0:
        procs.append(TopPLogitsWarper(cfg.top_p))
    if cfg.min_p:
        procs.append(MinPLogitsWarper(cfg.min_p))
    scores = procs(torch.zeros(1, 1, dtype=torch.long), logits[None].clone())
    return scores.softmax(-1)[0]


def chi_square_gof(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """p-value of Pearson's goodness-of-fit test; cells expecting < 5 draws are pooled."""
    n = float(counts.sum())
    exp = probs.double() * n
    big = exp >= 5
    obs = torch.cat([counts[big].double(), counts[~big].double().sum().view(1)])
    ex = torch.cat([exp[big], exp[~big].sum().view(1)])
    keep = ex > 0  # (draws where the law has no mass are asserted absent separately)
    obs, ex = obs[keep], ex[keep]
    stat = float(((obs - ex) ** 2 / ex).sum())
    df = int(obs.numel()) - 1
    return float(torch.special.gammaincc(torch.tensor(df / 2.0), torch.tensor(stat / 2.0)))


@pytest.mark.parametrize("cfg", CONFIGS[1:] + [SamplingConfig(0.6, 0, 1.0, 0.0)])
def test_op_is_exact_in_distribution(cfg) -> None:
    """20 000 positions of one logits row: their tokens follow transformers' law (chi-square at
    ALPHA), and the same test rejects the op run with the temperature applied twice."""
    g = torch.Generator().manual_seed(4)
    V = 24
    x = torch.randn(V, generator=g, dtype=torch.float64) * 0.5
    p = _hf_probs(x, cfg)
    assert int((p > 0).sum()) >= 3  # a law worth testing
    N = 20000
    pos = torch.arange(N).view(1, N)
    rows = x.expand(1, N, V).contiguous()
    keys = torch.tensor([[12345, 678]])
    counts = torch.bincount(_run(rows, keys, pos, cfg).flatten(), minlength=V)
    assert int(counts[p == 0].sum()) == 0
    assert chi_square_gof(counts, p) > ALPHA
    # temperature applied twice (at T = 1, where that changes nothing, T = 0.8 instead of 1)
    t = cfg.temperature**2 if cfg.temperature != 1.0 else 0.8
    wrong = SamplingConfig(t, cfg.top_k, cfg.top_p, cfg.min_p)
    bad = torch.bincount(_run(rows, keys, pos, wrong).flatten(), minlength=V)
    assert chi_square_gof(bad, p) < ALPHA


# ---- argument checks ---------------------------------------------------------------------------
@pytest.mark.parametrize(
    "args, match",
    [
        ((1.0, 0, 1.0, 0.0), None),
        ((0.0, 0, 1.0, 0.0), r"temperature must be a float > 0"),
        ((1.0, -1, 1.0, 0.0), r"top_k must be an int >= 0"),
        ((1.0, 0, 0.0, 0.0), r"top_p must be in \(0, 1\]"),
        ((1.0, 0, 1.0, 2.0), r"min_p must be in \[0, 1\]"),
    ],
)
def test_op_value_checks(args, match) -> None:
    x = torch.randn(1, 2, 10)
    keys, pos = torch.tensor([[1, 2]]), torch.tensor([[3, 4]])
    if match is None:
        assert op(x, keys, pos, *args).shape == (1, 2)
    else:
        with pytest.raises(ValueError, match=match):
            op(x, keys, pos, *args)


def test_op_shape_checks() -> None:
    x = torch.randn(2, 3, 10)
    keys, pos = torch.zeros(2, 2, dtype=torch.long), torch.zeros(2, 3, dtype=torch.long)
    with pytest.raises(ValueError, match=r"logits must be 3-D \[batch, positions, vocab\]"):
        op(x[0], keys, pos, 1.0, 0, 1.0, 0.0)
    with pytest.raises(ValueError, match=r"keys must be \[batch=2, 2\]"):
        op(x, keys[:1], pos, 1.0, 0, 1.0, 0.0)
    with pytest.raises(ValueError, match=r"positions must be \[2, 3\]"):
        op(x, keys, pos[:, :2], 1.0, 0, 1.0, 0.0)
    with pytest.raises(ValueError, match=r"logits must be floating point"):
        op(x.long(), keys, pos, 1.0, 0, 1.0, 0.0)
    with pytest.raises(ValueError, match=r"keys must have dtype Long"):
        op(x, keys.int(), pos, 1.0, 0, 1.0, 0.0)
    with pytest.raises(ValueError, match=r"positions must be in \[0, 2\^32\)"):
        op(x, keys, pos - 1, 1.0, 0, 1.0, 0.0)


def test_op_under_torch_compile_fake_tensors() -> None:
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        out = op(torch.randn(2, 3, 10), torch.zeros(2, 2, dtype=torch.long),
                 torch.zeros(2, 3, dtype=torch.long), 1.0, 0, 1.0, 0.0)  # fmt: skip
        assert out.shape == (2, 3) and out.dtype == torch.long


# ---- CUDA --------------------------------------------------------------------------------------
@pytest.mark.gpu
def test_cuda_noise_equals_cpu() -> None:
    V = 50000
    u_cpu = torch.ops.jacobi_ext.debug_gumbel_noise(KEYS, POS, V, True)
    u_gpu = torch.ops.jacobi_ext.debug_gumbel_noise(KEYS.cuda(), POS.cuda(), V, True)
    assert torch.equal(u_gpu.cpu(), u_cpu)  # the same integers, the same uniforms
    g_cpu = torch.ops.jacobi_ext.debug_gumbel_noise(KEYS, POS, V, False)
    g_gpu = torch.ops.jacobi_ext.debug_gumbel_noise(KEYS.cuda(), POS.cuda(), V, False)
    torch.testing.assert_close(g_gpu.cpu(), g_cpu, rtol=4e-16, atol=4e-16)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("cfg", CONFIGS)
def test_cuda_op_equals_cpu(dtype, cfg) -> None:
    g = torch.Generator().manual_seed(6)
    for V in (300, 49152):
        x = (torch.randn(4, 3, V, generator=g, dtype=torch.float64) * 3).to(dtype)
        assert torch.equal(_run(x.cuda(), KEYS.cuda(), POS.cuda(), cfg).cpu(),
                           _run(x, KEYS, POS, cfg))  # fmt: skip
