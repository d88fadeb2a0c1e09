"""rope_attention, the attention block of a decoding step read from the step plan (seg,
off, lo, hi) instead of a bool mask: its CPU twin (which runs here) against a float64 reference
built from jacobi_ext.decoding.masks.step_mask, on GQA ratios 1, 3 and 4, head dims 64 and 128,
plans with a main row, a candidate row, padding and left-padded sequences. The CUDA kernel is
compared against this twin in test_cuda_decode_ops.py (gpu)."""

import pytest
import torch

from jacobi_ext.decoding.masks import step_mask
from jacobi_ext.kernels import _native  # noqa: F401  (registers torch.ops.jacobi_ext)


def rotate(x, cos, sin, dtype):
    """transformers' apply_rotary_pos_emb in `dtype` (each product and the sum rounded)."""
    half = x.shape[-1] // 2
    rh = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return (x * cos).to(dtype) + (rh * sin).to(dtype)


def make_case(B, Hq, Hkv, D, Q, cap, context, dtype, seed=0, device="cpu"):
    """Random inputs of one step: qkv, cos / sin of the tokens' positions, caches holding
    `context[b]` committed tokens at [lo, hi), and a plan with a main row, a candidate row and
    padding."""
    g = torch.Generator().manual_seed(seed)
    qkv = torch.randn(B, Q, (Hq + 2 * Hkv) * D, generator=g).to(dtype)
    theta = torch.rand(B, Q, D // 2, generator=g) * 6.0
    cos = torch.cat([theta.cos()] * 2, -1).to(dtype)
    sin = torch.cat([theta.sin()] * 2, -1).to(dtype)
    k_cache = torch.randn(B, Hkv, cap, D, generator=g).to(dtype)
    v_cache = torch.randn(B, Hkv, cap, D, generator=g).to(dtype)
    S = Q  # scratch slots: the step's tokens
    lo = torch.tensor([S + 1 + b for b in range(B)])  # left padding differs per sequence
    hi = lo + torch.tensor(context)
    seg = torch.full((B, Q), -1, dtype=torch.long)
    off = torch.zeros(B, Q, dtype=torch.long)
    main = max(1, (2 * Q) // 3)
    seg[:, :main] = 0
    off[:, :main] = torch.arange(main)
    cand = min(Q - main, 3)
    if cand > 0:
        seg[:, main : main + cand] = 1
        off[:, main : main + cand] = torch.arange(cand)
    if B > 1:
        seg[B - 1, :] = -1  # a sequence that takes no part this step
    t = [qkv, cos, sin, k_cache, v_cache, seg, off, lo, hi]
    return [x.to(device) for x in t]


def reference(qkv, Hq, Hkv, cos, sin, k_cache, v_cache, seg, off, lo, hi, scale):
    """float64 attention over the caches after the step's writes, masked by step_mask."""
    dtype = qkv.dtype
    B, Q, _ = qkv.shape
    D = k_cache.shape[-1]
    q, k, v = qkv.split([Hq * D, Hkv * D, Hkv * D], dim=-1)
    c, s = cos[:, :, None], sin[:, :, None]
    q = rotate(q.view(B, Q, Hq, D), c, s, dtype)
    k = rotate(k.view(B, Q, Hkv, D), c, s, dtype)
    kc, vc = k_cache.clone(), v_cache.clone()
    kc[:, :, :Q] = k.transpose(1, 2)
    vc[:, :, :Q] = v.view(B, Q, Hkv, D).transpose(1, 2)
    mask = step_mask(seg, off, lo, hi, kc.shape[2])[:, 0]  # [B, Q, cap]
    G = Hq // Hkv
    kk = kc.double().repeat_interleave(G, dim=1)  # [B, Hq, cap, D]
    vv = vc.double().repeat_interleave(G, dim=1)
    scores = torch.einsum("bqhd,bhkd->bhqk", q.double(), kk) * scale
    scores = scores.masked_fill(~mask[:, None], float("-inf"))
    out = torch.einsum("bhqk,bhkd->bqhd", scores.softmax(-1), vv)
    return out, kc, vc


CASES = [
    # B, Hq, Hkv, D, Q, capacity, committed tokens per sequence
    (1, 4, 4, 64, 1, 96, [40]),  # GQA 1, one AR token
    (2, 9, 3, 64, 7, 160, [100, 33]),  # GQA 3 (SmolLM2's), a Jacobi step
    (2, 8, 2, 128, 5, 128, [90, 17]),  # GQA 4, head dim 128
    (1, 6, 2, 128, 16, 700, [600]),  # long context: several splits on CUDA
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"B{c[0]}-Hq{c[1]}-Hkv{c[2]}-D{c[3]}-Q{c[4]}")
def test_cpu_plan_attention_matches_float64_reference(case, dtype):
    B, Hq, Hkv, D, Q, cap, ctx = case
    qkv, cos, sin, kc, vc, seg, off, lo, hi = make_case(B, Hq, Hkv, D, Q, cap, ctx, dtype)
    scale = D**-0.5
    want, kc_want, vc_want = reference(qkv, Hq, Hkv, cos, sin, kc, vc, seg, off, lo, hi, scale)
    got = torch.ops.jacobi_ext.rope_attention(
        qkv, Hq, Hkv, cos, sin, kc, vc, seg, off, lo, hi, scale
    )
    assert got.shape == (B, Q, Hq, D) and got.dtype == dtype
    assert torch.equal(kc, kc_want) and torch.equal(vc, vc_want)  # rotary as transformers'
    tol = 2e-2 if dtype == torch.bfloat16 else 1e-5
    torch.testing.assert_close(got.double(), want, rtol=tol, atol=tol)


def test_cpu_plan_attention_is_cpu_rope_attention_with_the_step_mask():
    """The twin is exactly cpu_rope_attention under cpu_step_mask (the same rule, bitwise)."""
    B, Hq, Hkv, D, Q, cap, ctx = CASES[1]
    qkv, cos, sin, kc, vc, seg, off, lo, hi = make_case(B, Hq, Hkv, D, Q, cap, ctx, torch.float32)
    kc2, vc2 = kc.clone(), vc.clone()
    ops = torch.ops.jacobi_ext
    got = ops.rope_attention(qkv, Hq, Hkv, cos, sin, kc, vc, seg, off, lo, hi, 0.125)
    width = int(hi.max())
    mask = ops.cpu_step_mask(seg, off, lo, hi, width)
    assert torch.equal(mask, step_mask(seg, off, lo, hi, width))
    want = ops.cpu_rope_attention(
        qkv, Hq, Hkv, cos, sin, kc2, vc2, torch.arange(Q), width, mask, 0.125
    )
    assert torch.equal(got, want) and torch.equal(kc, kc2) and torch.equal(vc, vc2)


def test_cpu_plan_attention_rejects_bad_plans():
    B, Hq, Hkv, D, Q, cap, ctx = CASES[1]
    qkv, cos, sin, kc, vc, seg, off, lo, hi = make_case(B, Hq, Hkv, D, Q, cap, ctx, torch.float32)
    op = torch.ops.jacobi_ext.rope_attention
    with pytest.raises(ValueError, match="committed slots"):
        op(qkv, Hq, Hkv, cos, sin, kc, vc, seg, off, lo, hi + cap, 0.1)
    with pytest.raises(ValueError, match="seg and off"):
        op(qkv, Hq, Hkv, cos, sin, kc, vc, seg[:, :2], off, lo, hi, 0.1)
    with pytest.raises(ValueError, match="multiple"):
        op(qkv, Hq, 2, cos, sin, kc, vc, seg, off, lo, hi, 0.1)
