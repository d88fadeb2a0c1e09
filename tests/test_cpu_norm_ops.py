"""rms_norm, fused_add_rms_norm and silu_and_mul, the lean CPU forward's small ops
(csrc/cpu/decode_cpu.cpp): against float64 references on random shapes (widths off every vector
and chain width), fp32 and bf16; and the property the lossless methods rest on, that a row's
output is the same bits whatever rows share the call and however many threads split it."""

from __future__ import annotations

import pytest
import torch

import jacobi_ext  # noqa: F401  (registers torch.ops.jacobi_ext)

ops = torch.ops.jacobi_ext
WIDTHS = (1, 7, 64, 93, 576)


def _rms_reference(h: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    h = h.double()
    return w.double() * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps))


@pytest.mark.parametrize("n", WIDTHS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_matches_the_float64_reference(n, dtype):
    g = torch.Generator().manual_seed(n)
    x = (torch.randn(2, 5, n, generator=g) * 3).to(dtype)
    res = torch.randn(2, 5, n, generator=g).to(dtype)
    w = torch.randn(n, generator=g).to(dtype)
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    y = ops.rms_norm(x, w, 1e-5)
    torch.testing.assert_close(y.double(), _rms_reference(x, w, 1e-5), **tol)
    h, y = ops.fused_add_rms_norm(x, res, w, 1e-5)
    assert torch.equal(h, (res.float() + x.float()).to(dtype))  # the sum rounded to the dtype
    torch.testing.assert_close(y.double(), _rms_reference(h, w, 1e-5), **tol)


def test_rms_norm_of_a_zero_row_is_zero_and_transformers_agree():
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    g = torch.Generator().manual_seed(0)
    x = torch.randn(4, 576, generator=g)
    x[1] = 0.0
    norm = LlamaRMSNorm(576, eps=1e-5)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(576, generator=g))
        want = norm(x)
    y = ops.rms_norm(x, norm.weight.detach(), 1e-5)
    assert torch.equal(y[1], torch.zeros(576))
    torch.testing.assert_close(y, want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("threads", [1, 2, 3])
def test_a_row_is_the_same_bits_in_any_call(threads):
    g = torch.Generator().manual_seed(threads)
    n, rows = 576, 300  # enough rows for the threads to split the norms
    x = torch.randn(rows, n, generator=g)
    res = torch.randn(rows, n, generator=g)
    w = torch.randn(n, generator=g)
    gu = torch.randn(rows, 2 * 93, generator=g) * 4
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        y = ops.rms_norm(x, w, 1e-6)
        h, y2 = ops.fused_add_rms_norm(x, res, w, 1e-6)
        s = ops.silu_and_mul(gu)
        for i in (0, 1, 150, rows - 1):
            assert torch.equal(ops.rms_norm(x[i : i + 1], w, 1e-6)[0], y[i])
            h1, y1 = ops.fused_add_rms_norm(x[i : i + 1], res[i : i + 1], w, 1e-6)
            assert torch.equal(h1[0], h[i]) and torch.equal(y1[0], y2[i])
            assert torch.equal(ops.silu_and_mul(gu[i : i + 1])[0], s[i])
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("n", WIDTHS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_silu_mul_matches_the_float64_reference(n, dtype):
    g = torch.Generator().manual_seed(n)
    gu = (torch.randn(3, 2 * n, generator=g) * 4).to(dtype)
    gate, up = gu.double().split(n, dim=-1)
    want = torch.nn.functional.silu(gate) * up
    tol = dict(rtol=1e-5, atol=1e-6) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(ops.silu_and_mul(gu).double(), want, **tol)


def test_qk_rms_norm_is_the_rms_norm_of_each_q_and_k_head_and_checks_its_arguments():
    """Qwen3's q/k norms in place: each q head and each k head of qkv is rms_norm's row,
    bitwise; the v heads are untouched; wrong shapes and dtypes raise ValueError."""
    g = torch.Generator().manual_seed(0)
    H, Hkv, D = 4, 2, 16
    qkv = torch.randn(2, 3, (H + 2 * Hkv) * D, generator=g)
    wq, wk = 1 + torch.randn(D, generator=g), 1 + torch.randn(D, generator=g)
    want = qkv.clone().view(2, 3, H + 2 * Hkv, D)
    want[:, :, :H] = ops.rms_norm(want[:, :, :H].contiguous(), wq, 1e-6)
    want[:, :, H : H + Hkv] = ops.rms_norm(want[:, :, H : H + Hkv].contiguous(), wk, 1e-6)
    ops.qk_rms_norm_(qkv, H, Hkv, wq, wk, 1e-6)
    assert torch.equal(qkv.view_as(want), want)
    with pytest.raises(ValueError, match="last dim"):
        ops.qk_rms_norm_(qkv, H + 1, Hkv, wq, wk, 1e-6)
    with pytest.raises(ValueError, match="k_weight must be"):
        ops.qk_rms_norm_(qkv, H, Hkv, wq, wk[:-1], 1e-6)
    with pytest.raises(ValueError, match="q_weight must be"):
        ops.qk_rms_norm_(qkv, H, Hkv, wq.double(), wk, 1e-6)
