"""torch.ops.jacobi_ext.cpu_linear: the decode-shaped CPU linear y = x W^T (+ bias) from a weight
packed once (csrc/cpu/linear_cpu.h).

What the decoding runtime relies on, checked here: the result is a float32 dot product within
its rounding error of float64 (bf16: rounded once, to the output); every output is one float32
chain over k in order, so a row's bits never depend on the other rows, their number, the thread
count or the layout of x (what lets every decoding method equal AR token for token); the same
holds for every ISA variant (baseline / AVX2 / AVX-512, chosen at process start); bad arguments
fail with a ValueError that says what is wrong; and the fake kernels (jacobi_ext/kernels/ops.py)
give the real kernels' shapes, so the ops trace under torch.compile."""

from __future__ import annotations

import itertools

import pytest
import torch
from conftest import ISAS

import jacobi_ext
from jacobi_ext.kernels._native import ops
from jacobi_ext.kernels.ops import cpu_linear_packed_shape

DTYPES = (torch.float32, torch.bfloat16)
# M: 1 (one token), around the register tile heights (4 rows on AVX2 / baseline, 8 on AVX-512)
# and the M tiles' split; K and N off every multiple of 16 / 32 (odd K: the padded bf16 pair).
MS = (1, 2, 7, 8, 9, 13, 16, 17, 33, 64, 65, 70)
KS = (1, 3, 17, 77, 576)
NS = (1, 5, 33, 100)
U32 = 2.0**-24  # float32 unit roundoff
U16 = 2.0**-8  # bfloat16 unit roundoff


def _make(M, K, N, dtype, bias="none", seed=0):
    """x [M, K], weight [N, K] and bias (None, float32 or x's dtype), random normal values."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(M, K, generator=g).to(dtype)
    w = torch.randn(N, K, generator=g).to(dtype)
    b = torch.randn(N, generator=g)
    b = {"none": None, "f32": b, "x": b.to(dtype)}[bias]
    return x, w, b


def _linear(x, w, b=None):
    return ops.cpu_linear(x, ops.cpu_linear_pack(w), w.shape[0], b)


def _reference(x, w, b):
    """float64 x W^T + b of the same (already rounded) values, and the error bound of a float32
    chain: any order of float32 sums of K products plus the bias, fused or not, is within
    gamma_(K+1) * (sum_k |x w| + |b|) of it (Higham, Accuracy and Stability, 3.1), so this bound
    holds for every ISA's kernel and for torch's own float32 matmul alike."""
    xd, wd = x.double(), w.double()
    bd = torch.zeros(w.shape[0], dtype=torch.float64) if b is None else b.double()
    ref = xd @ wd.T + bd
    K = x.shape[-1]
    gamma = (K + 1) * U32 / (1 - (K + 1) * U32)
    return ref, gamma * (xd.abs() @ wd.abs().T + bd.abs())


def _assert_close_to_float64(y, x, w, b):
    """y against the float64 reference, with the bound of _reference; bf16 y also carries the one
    rounding of the float32 result to bf16 (at most U16 of its magnitude). Returns the float32
    bound."""
    ref, err32 = _reference(x, w, b)
    err = err32 + U16 * (ref.abs() + err32) if y.dtype == torch.bfloat16 else err32
    bad = (y.double() - ref).abs() > err
    assert not bad.any(), (
        f"{int(bad.sum())} of {y.numel()} outputs off the float64 reference by more than their "
        f"bound (shape {tuple(x.shape)} x {tuple(w.shape)}, bias "
        f"{None if b is None else b.dtype}); worst excess "
        f"{((y.double() - ref).abs() - err).max().item():.3g}"
    )
    return err32


# ---- against float64 ---------------------------------------------------------------------------
def _shapes():
    """Every M with every K (N cycling), and every K with every N (M cycling)."""
    for i, (M, K) in enumerate(itertools.product(MS, KS)):
        yield M, K, NS[i % len(NS)]
    for i, (K, N) in enumerate(itertools.product(KS, NS)):
        yield MS[i % len(MS)], K, N


@pytest.mark.parametrize("bias", ["none", "f32", "x"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_matches_float64_reference(dtype, bias):
    """Within a float32 dot product's rounding error of float64, for every shape around the tile
    and panel edges. bf16 is also compared with torch's float32-accumulated matmul rounded to
    bf16: both are within 2x the float32 bound of each other before their one rounding, far below
    a bf16 ulp, so after it they are equal or one bf16 ulp apart, and mostly equal (a kernel that
    rounded twice, e.g. before adding the bias, would not be)."""
    equal = total = 0
    for seed, (M, K, N) in enumerate(_shapes()):
        x, w, b = _make(M, K, N, dtype, bias, seed)
        y = _linear(x, w, b)
        assert y.shape == (M, N) and y.dtype == dtype
        err = _assert_close_to_float64(y, x, w, b)
        if dtype == torch.bfloat16:
            bf = torch.zeros(N) if b is None else b.float()
            r = (x.float() @ w.float().T + bf).bfloat16().float()
            yf = y.float()
            assert ((yf - r).abs() <= 2.0**-7 * torch.maximum(yf.abs(), r.abs()) + 2 * err).all()
            equal += int((yf == r).sum())
            total += y.numel()
    if dtype == torch.bfloat16:
        assert equal >= 0.97 * total, f"only {equal} of {total} bf16 outputs equal the reference"


def test_leading_dims_and_strided_x():
    """x [B, S, K] gives [B, S, N]; a slice of a wider tensor (rows further apart than K), a
    transposed x (k not contiguous: copied) and rows of a stride-0 expand give the bits of the
    same values made contiguous, since each row's result is its own chain."""
    for dtype in DTYPES:
        B, S, K, N = 2, 5, 77, 33
        g = torch.Generator().manual_seed(1)
        wide = torch.randn(B, S, K + 9, generator=g).to(dtype)
        w = torch.randn(N, K, generator=g).to(dtype)
        packed = ops.cpu_linear_pack(w)
        x = wide[..., 4 : 4 + K]
        assert not x.is_contiguous()
        y = ops.cpu_linear(x, packed, N)
        assert y.shape == (B, S, N) and y.dtype == dtype
        assert torch.equal(y, ops.cpu_linear(x.contiguous(), packed, N))
        _assert_close_to_float64(y.reshape(-1, N), x.reshape(-1, K), w, None)
        xt = torch.randn(K, 6, generator=g).to(dtype).T  # [6, K], stride(-1) = 6
        assert torch.equal(
            ops.cpu_linear(xt, packed, N), ops.cpu_linear(xt.contiguous(), packed, N)
        )
        every_other = x[:, ::2]
        assert torch.equal(
            ops.cpu_linear(every_other, packed, N),
            ops.cpu_linear(every_other.contiguous(), packed, N),
        )
        row = x[0, :1].expand(7, K)  # stride 0 between rows
        assert torch.equal(
            ops.cpu_linear(row, packed, N), ops.cpu_linear(row.contiguous(), packed, N)
        )


def test_edge_sizes():
    """Empty sizes give empty or zero results (torch.nn.functional.linear's answers): no rows
    (M = 0, also through a leading dim), no outputs (N = 0), no inputs (K = 0: y = bias, or 0)."""
    for dtype in DTYPES:
        for M, K, N in ((0, 5, 7), (3, 5, 0), (0, 5, 0), (3, 0, 7), (0, 0, 7)):
            x, w, b = _make(M, K, N, dtype, "f32")
            packed = ops.cpu_linear_pack(w)
            assert packed.shape == cpu_linear_packed_shape(dtype, N, K)
            for bias in (None, b):
                y = ops.cpu_linear(x, packed, N, bias)
                want = torch.nn.functional.linear(x.float(), w.float(), bias).to(dtype)
                assert y.shape == (M, N) and y.dtype == dtype
                assert torch.equal(y, want)
        x = torch.randn(2, 0, 5).to(dtype)  # M = 0 from a leading dim
        assert _linear(x, torch.randn(7, 5).to(dtype)).shape == (2, 0, 7)


# ---- one chain per output: row independence, bitwise ---------------------------------------------
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_rows_are_independent_bitwise(dtype):
    """A row's bits are the same alone or among M = 1 .. 40 rows, at any position of the call
    (so in any register tile, of any height): a token's logits do not depend on how many tokens
    a decoding step feeds. K odd (a padded bf16 pair) and N across panels."""
    K, N = 77, 100
    x, w, _ = _make(40, K, N, dtype, seed=2)
    b = torch.randn(N)
    packed = ops.cpu_linear_pack(w)
    alone = torch.cat([ops.cpu_linear(x[i : i + 1], packed, N, b) for i in range(40)])
    for M in range(1, 41):
        assert torch.equal(ops.cpu_linear(x[:M], packed, N, b), alone[:M]), f"M={M}"
    g = torch.Generator().manual_seed(3)
    for M in (5, 13, 40):
        perm = torch.randperm(40, generator=g)[:M]
        assert torch.equal(ops.cpu_linear(x[perm], packed, N, b), alone[perm]), f"M={M}"


def test_thread_count_does_not_change_the_bits():
    """Threads split the panels (output features), never a chain: one thread gives the bits of
    all of them (the weight here is large enough to be split)."""
    for dtype in DTYPES:
        x, w, b = _make(9, 576, 300, dtype, "f32", seed=4)
        packed = ops.cpu_linear_pack(w)
        many = ops.cpu_linear(x, packed, 300, b)
        threads = torch.get_num_threads()
        try:
            torch.set_num_threads(1)
            one = ops.cpu_linear(x, packed, 300, b)
        finally:
            torch.set_num_threads(threads)
        assert torch.equal(one, many)


def _chain(x, w, b, fused: bool):
    """The documented arithmetic, emulated: acc = 0, then acc += x[k] * w[k] in float32 for k in
    order, then + bias, then one rounding to x's dtype. Fused: each step is a float32 FMA,
    computed in float64 (the product is exact there) and rounded to float32; this could differ
    from a true FMA only by a double rounding, which the fixed inputs here do not hit. bf16
    products are exact in float32, so fused and not are the same for them."""
    xf, wf = x.float(), w.float()
    acc = torch.zeros(x.shape[0], w.shape[0])
    for k in range(x.shape[1]):
        if fused:
            acc = (xf[:, k, None].double() * wf[None, :, k].double() + acc.double()).float()
        else:
            acc = acc + xf[:, k, None] * wf[None, :, k]
    if b is not None:
        acc = acc + b.float()
    return acc.to(x.dtype)


def check_this_process(expected_isa: str) -> None:
    """The checks of one ISA variant, in a process started with JACOBI_EXT_CPU_ISA: the variant
    reported, its layout, results within the float64 bound, rows independent, and the bits of
    the documented float32 chain (fused multiply-adds where the ISA has FMA, separate multiply
    and add in the baseline) wherever the layout is panels (bf16 pairs run vdpbf16ps, whose
    rounding inside a pair is the hardware's)."""
    assert jacobi_ext.CPU_ISA == expected_isa
    nr = 32 if expected_isa == "avx512" else 16
    assert ops.cpu_linear_info(torch.float32) == f"{expected_isa} f32_panels NR={nr}"
    formats = ("bf16_panels", "bf16_pairs") if expected_isa == "avx512" else ("bf16_panels",)
    isa, fmt, nr_text = ops.cpu_linear_info(torch.bfloat16).split()
    assert isa == expected_isa and fmt in formats and nr_text == f"NR={nr}"
    for dtype in DTYPES:
        for seed, (M, K, N) in enumerate(((1, 1, 1), (5, 17, 33), (9, 77, 100), (13, 576, 5))):
            x, w, b = _make(M, K, N, dtype, ("none", "f32", "x")[seed % 3], seed)
            packed = ops.cpu_linear_pack(w)
            assert packed.shape == cpu_linear_packed_shape(dtype, N, K)
            y = ops.cpu_linear(x, packed, N, b)
            _assert_close_to_float64(y, x, w, b)
            alone = torch.cat([ops.cpu_linear(x[i : i + 1], packed, N, b) for i in range(M)])
            assert torch.equal(y, alone)
            pairs = dtype == torch.bfloat16 and fmt == "bf16_pairs"
            if not pairs:
                want = _chain(x, w, b, fused=expected_isa != "baseline")
                assert torch.equal(y, want), f"{dtype} {M}x{K}x{N} is not the float32 chain"


def test_this_process_isa():
    """The variant this process runs (the best the CPU has, unless JACOBI_EXT_CPU_ISA caps it)."""
    check_this_process(jacobi_ext.CPU_ISA)


@pytest.mark.parametrize("isa", ISAS)
def test_every_isa(isa, in_isa_process):
    """Each variant, in a process of its own (the ISA is fixed at process start). A request above
    what the CPU supports is capped to the best it has (never an illegal instruction), so on a
    CPU without AVX-512 the avx512 request checks the AVX2 variant again."""
    in_isa_process(
        isa,
        "from test_cpu_linear import check_this_process\ncheck_this_process(jacobi_ext.CPU_ISA)\n",
    )


# ---- packing -----------------------------------------------------------------------------------
def test_pack_layout_and_pack_cat():
    """The packed shape is [ceil(N / NR), k_rows, NR] (the fake kernel's formula); a strided
    weight packs like its contiguous copy, and pack_cat of several weights like their
    concatenation (without materialising it)."""
    for dtype in DTYPES:
        _, fmt, nr = ops.cpu_linear_info(dtype).split()
        nr = int(nr.removeprefix("NR="))
        for N, K in ((1, 1), (33, 17), (100, 77), (64, 576)):
            w = torch.randn(N, K).to(dtype)
            packed = ops.cpu_linear_pack(w)
            k_rows = K + K % 2 if fmt == "bf16_pairs" else K
            assert packed.shape == ((N + nr - 1) // nr, k_rows, nr) and packed.dtype == dtype
            assert packed.shape == cpu_linear_packed_shape(dtype, N, K)
        wide = torch.randn(40, 90).to(dtype)
        w = wide[:, 3:80]
        assert torch.equal(ops.cpu_linear_pack(w), ops.cpu_linear_pack(w.contiguous()))
        assert torch.equal(ops.cpu_linear_pack(wide.T), ops.cpu_linear_pack(wide.T.contiguous()))
        parts = [torch.randn(n, 77).to(dtype) for n in (5, 40, 33)]
        parts[1] = wide[:, :77]  # rows not contiguous with each other
        assert torch.equal(ops.cpu_linear_pack_cat(parts), ops.cpu_linear_pack(torch.cat(parts)))


# ---- errors ------------------------------------------------------------------------------------
def _error_cases():
    """(id, call, message pattern): patterns hold for the C++ op and the fake kernel alike."""
    f32, bf16 = torch.float32, torch.bfloat16

    def w(N=5, K=7, dtype=f32):
        return torch.randn(N, K, dtype=dtype)

    def x(M=3, K=7, dtype=f32):
        return torch.randn(M, K, dtype=dtype)

    def p(N=5, K=7, dtype=f32):
        return ops.cpu_linear_pack(w(N, K, dtype))

    dtype_msg = r"must be float32 or bfloat16 \(the CPU linear kernel's dtypes\)"
    return [
        ("pack-float64", lambda: ops.cpu_linear_pack(w().double()), "weight " + dtype_msg),
        ("pack-float16", lambda: ops.cpu_linear_pack(w().half()), "weight " + dtype_msg),
        (
            "pack-1d",
            lambda: ops.cpu_linear_pack(torch.randn(7)),
            r"weight must be 2-D \[out_features, in_features\]",
        ),
        (
            "pack-cat-K",
            lambda: ops.cpu_linear_pack_cat([w(), w(K=8)]),
            r"weights\[1\] has 8 input features, weights\[0\] has 7",
        ),
        (
            "pack-cat-dtype",
            lambda: ops.cpu_linear_pack_cat([w(), w(dtype=bf16)]),
            r"weights\[1\] has dtype",
        ),
        ("x-float64", lambda: ops.cpu_linear(x().double(), p(), 5), "x " + dtype_msg),
        ("x-float16", lambda: ops.cpu_linear(x().half(), p(), 5), "x " + dtype_msg),
        (
            "x-0d",
            lambda: ops.cpu_linear(torch.tensor(1.0), p(), 5),
            r"x must be \[\.\.\., in_features\]",
        ),
        (
            "x-vs-packed-dtype",
            lambda: ops.cpu_linear(x(dtype=bf16), p(), 5),
            "packed has dtype .* but x has .*; pack the weight in x's dtype",
        ),
        (
            "packed-other-K",
            lambda: ops.cpu_linear(x(K=9), p(K=7), 5),
            r"packed has shape .* but a 5 x 9 weight packs to .*pack it with cpu_linear_pack",
        ),
        (
            "packed-other-N",
            # N = 5 and 100 differ in panels for any NR (a weight of the same panel count packs
            # to the same shape: shapes are all the op can check).
            lambda: ops.cpu_linear(x(), p(N=5), 100),
            r"packed has shape .* but a 100 x 7 weight packs to",
        ),
        (
            "packed-not-contiguous",
            lambda: ops.cpu_linear(x(), p(N=100).transpose(1, 2).contiguous().transpose(1, 2), 100),
            r"packed must be contiguous",
        ),
        (
            "out-features-negative",
            lambda: ops.cpu_linear(x(), p(), -1),
            "out_features must be >= 0",
        ),
        ("bias-length", lambda: ops.cpu_linear(x(), p(), 5, torch.randn(4)), "bias"),
        ("bias-2d", lambda: ops.cpu_linear(x(), p(), 5, torch.randn(1, 5)), "bias"),
        (
            "bias-float64",
            lambda: ops.cpu_linear(x(), p(), 5, torch.randn(5).double()),
            r"bias must be float32 or x's dtype",
        ),
        (
            "bias-bf16-for-f32-x",
            lambda: ops.cpu_linear(x(), p(), 5, torch.randn(5).bfloat16()),
            r"bias must be float32 or x's dtype",
        ),
    ]


_ERRORS = _error_cases()


@pytest.mark.parametrize("call,match", [c[1:] for c in _ERRORS], ids=[c[0] for c in _ERRORS])
def test_errors_say_what_is_wrong(call, match):
    """A ValueError naming the argument and what is expected, never a crash or a wrong answer."""
    with pytest.raises(ValueError, match=match):
        call()


def test_bias_errors_name_the_length_and_rank():
    """The C++ op's own words for a bias of the wrong length or rank (the fake kernel says it
    in one sentence: the shared cases above only match "bias")."""
    x, w, _ = _make(3, 7, 5, torch.float32)
    packed = ops.cpu_linear_pack(w)
    with pytest.raises(ValueError, match="bias has 4 entries, out_features is 5"):
        ops.cpu_linear(x, packed, 5, torch.randn(4))
    with pytest.raises(ValueError, match=r"bias must be 1-D \[out_features\]"):
        ops.cpu_linear(x, packed, 5, torch.randn(1, 5))


@pytest.mark.parametrize("call,match", [c[1:] for c in _ERRORS], ids=[c[0] for c in _ERRORS])
def test_fake_kernels_raise_the_same_errors(call, match):
    """Under FakeTensorMode (what torch.compile traces with) the fake kernels check the same."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode(), pytest.raises(ValueError, match=match):
        call()


# ---- torch.library: fake kernels, torch.compile ------------------------------------------------
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_opcheck(dtype):
    """Schemas, fake kernels (shapes, strides, dtypes as the real ones) and AOT dispatch with
    dynamic shapes, for the pack ops and the linear, with and without bias, 2-D and 3-D x."""
    x, w, b = _make(6, 77, 100, dtype, "x")
    torch.library.opcheck(ops.cpu_linear_pack.default, (w,))
    torch.library.opcheck(ops.cpu_linear_pack_cat.default, ([w[:40], w[40:]],))
    packed = ops.cpu_linear_pack(w)
    torch.library.opcheck(ops.cpu_linear.default, (x, packed, 100))
    torch.library.opcheck(ops.cpu_linear.default, (x, packed, 100, b))
    torch.library.opcheck(ops.cpu_linear.default, (x.reshape(2, 3, 77), packed, 100, b.float()))


def test_torch_compile_runs_the_op():
    """A compiled function with the op traces whole (no graph break) and gives its bits."""
    x, w, b = _make(5, 77, 33, torch.bfloat16, "f32")
    packed = ops.cpu_linear_pack(w)

    def f(x):
        return torch.relu(ops.cpu_linear(x, packed, 33, b))

    compiled = torch.compile(f, backend="aot_eager", fullgraph=True)
    assert torch.equal(compiled(x), f(x))
