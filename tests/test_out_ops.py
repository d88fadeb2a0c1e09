"""The registered out= forms of the CPU step's ops (csrc/torch/module.cpp: `*.out`, the C++
`*_out` functions LeanLayers calls): bitwise the functional op's result, written into the given
tensor (returned, the same storage, any shape of the right size), and a clear error for an
output of the wrong size, dtype or layout."""

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from gguf_fixtures import random_rows
from test_decode_plan_attention import make_case

import jacobi_ext  # noqa: F401  (loads the ops)
from jacobi_ext.decoding.masks import step_mask

ops = torch.ops.jacobi_ext


def _same(got: torch.Tensor, out: torch.Tensor, want: torch.Tensor) -> None:
    assert got.data_ptr() == out.data_ptr()  # written in place, returned
    assert torch.equal(got.reshape(want.shape), want)


@pytest.mark.parametrize("M", [1, 5])
@pytest.mark.parametrize("bias", [False, True])
def test_linear_out_is_the_linear(M, bias):
    g = torch.Generator().manual_seed(M)
    w = torch.randn(48, 64, generator=g)
    b = torch.randn(48, generator=g) if bias else None
    x = torch.randn(M, 64, generator=g)
    packed = ops.cpu_linear_pack(w)
    want = ops.cpu_linear(x, packed, 48, b)
    out = torch.empty(M * 48)  # any shape of the result's size
    _same(ops.cpu_linear.out(x, packed, 48, b, out=out), out, want)
    with pytest.raises((ValueError, RuntimeError), match="y"):
        ops.cpu_linear.out(x, packed, 48, b, out=torch.empty(M * 48 - 1))


@pytest.mark.parametrize("int8", [False, True])
def test_linear_gguf_out_is_the_linear(int8):
    rng = np.random.default_rng(0)
    raw = torch.from_numpy(random_rows(Q.Q8_0, 40, 64, rng))
    packed = ops.cpu_linear_gguf_pack([raw], int(Q.Q8_0))
    x = torch.randn(3, 64, generator=torch.Generator().manual_seed(1))
    want = ops.cpu_linear_gguf(x, packed, int(Q.Q8_0), 40, int8_activations=int8)
    out = torch.empty(3, 40)
    got = ops.cpu_linear_gguf.out(x, packed, int(Q.Q8_0), 40, int8_activations=int8, out=out)
    _same(got, out, want)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_norm_and_silu_out_are_the_ops(dtype):
    g = torch.Generator().manual_seed(2)
    x = torch.randn(4, 3, 96, generator=g).to(dtype)
    r = torch.randn(4, 3, 96, generator=g).to(dtype)
    w = (1 + 0.2 * torch.randn(96, generator=g)).to(dtype)
    h_want, y_want = ops.fused_add_rms_norm(x, r, w, 1e-6)
    h, y = torch.empty_like(x), torch.empty(4 * 3 * 96, dtype=dtype)
    h_got, y_got = ops.fused_add_rms_norm.out(x, r, w, 1e-6, h=h, y=y)
    _same(h_got, h, h_want)
    _same(y_got, y, y_want)
    gu = torch.randn(4, 3, 2 * 96, generator=g).to(dtype)
    want = ops.silu_and_mul(gu)
    out = torch.empty(4, 3, 96, dtype=dtype)
    _same(ops.silu_and_mul.out(gu, out=out), out, want)
    with pytest.raises((ValueError, RuntimeError)):  # the wrong dtype
        ops.silu_and_mul.out(gu, out=torch.empty(4, 3, 96, dtype=torch.float64))
    with pytest.raises((ValueError, RuntimeError)):  # not contiguous
        ops.silu_and_mul.out(gu, out=torch.empty(4, 3, 2 * 96, dtype=dtype)[..., ::2])


def test_rope_attention_out_is_the_op():
    B, Hq, Hkv, D, Q_, cap, ctx = 2, 4, 2, 64, 5, 40, 9
    qkv, cos, sin, kc, vc, seg, off, lo, hi = make_case(B, Hq, Hkv, D, Q_, cap, ctx, torch.float32)
    width = int(hi.max())
    mask = step_mask(seg, off, lo, hi, width)
    slots = torch.arange(Q_)
    kc2, vc2 = kc.clone(), vc.clone()
    want = ops.cpu_rope_attention(qkv, Hq, Hkv, cos, sin, kc, vc, slots, width, mask, 0.125)
    out = torch.empty(B * Q_ * Hq * D)
    got = ops.cpu_rope_attention.out(
        qkv, Hq, Hkv, cos, sin, kc2, vc2, slots, width, mask, 0.125, out=out
    )
    _same(got, out, want)
    assert torch.equal(kc2, kc) and torch.equal(vc2, vc)  # the caches written alike


def test_fake_kernels_match_the_ops():
    """Every out= form and the step's mask-taking attention ops have fake kernels (meta tensors,
    tracing) with the real ops' shapes, dtypes and aliasing: torch.library.opcheck on each; the
    functional ops also through AOT dispatch with dynamic shapes. (The out= forms return their
    output, an alias of an input: torch's functionalization refuses such custom ops, so a
    torch.compile'd caller takes the functional forms.)"""
    out_checks = ("test_schema", "test_faketensor")
    g = torch.Generator().manual_seed(5)
    w, b, x = torch.randn(48, 64, generator=g), torch.randn(48, generator=g), torch.randn(3, 64)
    packed = ops.cpu_linear_pack(w)
    torch.library.opcheck(ops.cpu_linear.out, (x, packed, 48, b), {"out": torch.empty(3, 48)},
                          test_utils=out_checks)  # fmt: skip
    raw = torch.from_numpy(random_rows(Q.Q8_0, 40, 64, np.random.default_rng(0)))
    gp = ops.cpu_linear_gguf_pack([raw], int(Q.Q8_0))
    torch.library.opcheck(ops.cpu_linear_gguf.out, (x, gp, int(Q.Q8_0), 40),
                          {"out": torch.empty(3, 40)}, test_utils=out_checks)  # fmt: skip
    xr = torch.randn(2, 3, 96, generator=g)
    torch.library.opcheck(ops.fused_add_rms_norm.out, (xr, xr.clone(), torch.ones(96), 1e-6),
                          {"h": torch.empty_like(xr), "y": torch.empty_like(xr)},
                          test_utils=out_checks)  # fmt: skip
    torch.library.opcheck(ops.silu_and_mul.out, (xr,), {"out": torch.empty(2, 3, 48)},
                          test_utils=out_checks)  # fmt: skip
    B, Hq, Hkv, D, Q_, cap, ctx = 2, 4, 2, 64, 5, 40, 9
    qkv, cos, sin, kc, vc, seg, off, lo, hi = make_case(B, Hq, Hkv, D, Q_, cap, ctx, torch.float32)
    width = int(hi.max())
    args = (qkv, Hq, Hkv, cos, sin, kc, vc, torch.arange(Q_), width,
            step_mask(seg, off, lo, hi, width), 0.125)  # fmt: skip
    torch.library.opcheck(ops.cpu_rope_attention.default, args)
    torch.library.opcheck(ops.cpu_rope_attention.out, args, {"out": torch.empty(B, Q_, Hq, D)},
                          test_utils=out_checks)  # fmt: skip
    q = torch.randn(B, Hq, Q_, D, generator=g)
    k, v = torch.randn(B, Hkv, 12, D, generator=g), torch.randn(B, Hkv, 12, D, generator=g)
    mask = torch.ones(B, 1, Q_, 12, dtype=torch.bool).tril(12 - Q_)
    torch.library.opcheck(ops.cpu_decode_attention.default, (q, k, v, mask, 0.125))


def test_fake_out_forms_refuse_a_wrong_output():
    """On meta tensors (no kernel runs) a wrong output is refused as the C++ side refuses it."""
    x, packed = torch.empty(3, 64, device="meta"), ops.cpu_linear_pack(torch.randn(48, 64))
    with pytest.raises(ValueError, match="out must be a contiguous torch.float32 tensor of 144"):
        ops.cpu_linear.out(x, packed.to("meta"), 48, out=torch.empty(143, device="meta"))
    gu = torch.empty(4, 192, device="meta")
    with pytest.raises(ValueError, match="not contiguous"):
        ops.silu_and_mul.out(gu, out=torch.empty(4, 192, device="meta")[:, ::2])
    got = ops.silu_and_mul.out(gu, out=torch.empty(384, device="meta"))
    assert got.shape == (384,)  # the output as given, not resized
