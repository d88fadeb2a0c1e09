"""cpu_decode_attention, the CPU decoding step's attention (csrc/cpu/decode_cpu.cpp): against a
dense float64 reference on random shapes, GQA groups, masks and dtypes; and the property the
lossless methods rest on, that a query row's output is the same bits whatever other rows share
the call (the kernel schedules few rows by key ranges, then small row chunks; many rows by row
chunks)."""

from __future__ import annotations

import pytest
import torch
from conftest import ISAS

import jacobi_ext  # noqa: F401  (registers torch.ops.jacobi_ext)

op = torch.ops.jacobi_ext.cpu_decode_attention


def _reference(q, k, v, mask, scale):
    """[B, Q, Hq, D] in float64; rows that see no slot are zeros."""
    B, Hq, Q, D = q.shape
    G = Hq // k.shape[1]
    kk = k.double().repeat_interleave(G, dim=1)
    vv = v.double().repeat_interleave(G, dim=1)
    s = (q.double() @ kk.transpose(2, 3)) * scale
    s = s.masked_fill(~mask, float("-inf"))
    p = torch.softmax(s, dim=-1).nan_to_num(0.0)
    return (p @ vv).transpose(1, 2)


def _case(seed, Q, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    B = int(torch.randint(1, 3, (1,), generator=g))
    Hkv = int(torch.randint(1, 4, (1,), generator=g))
    Hq = Hkv * int(torch.randint(1, 5, (1,), generator=g))
    D = [8, 16, 24, 64][seed % 4]
    W = int(torch.randint(Q, Q + 70, (1,), generator=g))
    q = torch.randn(B, Hq, Q, D, generator=g).to(dtype)
    k = torch.randn(B, Hkv, W, D, generator=g).to(dtype)
    v = torch.randn(B, Hkv, W, D, generator=g).to(dtype)
    mask = torch.rand(B, 1, Q, W, generator=g) < 0.85
    if seed % 3 == 0:
        mask[:, :, 0] = False  # a row that sees nothing: zeros
    return q, k, v, mask, 1.0 / D**0.5


@pytest.mark.parametrize("Q", [1, 2, 3, 5, 16, 33])
@pytest.mark.parametrize("seed", range(6))
def test_matches_the_dense_reference(seed, Q):
    q, k, v, mask, scale = _case(seed, Q)
    got = op(q, k, v, mask, scale)
    torch.testing.assert_close(got.double(), _reference(q, k, v, mask, scale), atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("seed", range(3))
def test_bf16_matches_the_dense_reference(seed):
    q, k, v, mask, scale = _case(seed, 4, torch.bfloat16)
    got = op(q, k, v, mask, scale)
    torch.testing.assert_close(got.double(), _reference(q, k, v, mask, scale), atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("Q", [1, 3, 16, 33])
@pytest.mark.parametrize("seed", range(6))
def test_half_kv_is_the_fp32_attention_over_the_rounded_values(seed, Q):
    """fp16 keys and values with fp32 queries (a half K/V cache): bitwise the fp32 attention over
    the keys and values rounded to fp16 (each widened exactly where it is read), and so the dense
    reference on the rounded values."""
    q, k, v, mask, scale = _case(seed, Q)
    kh, vh = k.half(), v.half()
    got = op(q, kh, vh, mask, scale)
    assert got.dtype == torch.float32
    assert torch.equal(got, op(q, kh.float(), vh.float(), mask, scale))
    want = _reference(q, kh.float(), vh.float(), mask, scale)
    torch.testing.assert_close(got.double(), want, atol=2e-5, rtol=1e-5)
    if mask.any():  # (a case whose one row sees nothing is zeros either way)
        assert not torch.equal(got, op(q, k, v, mask, scale))  # the rounding is in effect


def test_half_kv_needs_fp32_queries_and_one_kv_dtype():
    q, k, v, mask, scale = _case(0, 2)
    with pytest.raises(ValueError, match="float16 \\(a half K/V cache\\) with float32 q"):
        op(q.bfloat16(), k.half(), v.half(), mask, scale)
    with pytest.raises(ValueError, match="k and v must have one dtype"):
        op(q, k.half(), v, mask, scale)


@pytest.mark.parametrize("threads", [1, 2, 3])
@pytest.mark.parametrize("seed", range(4))
def test_a_row_is_the_same_bits_whatever_rows_share_the_call(seed, threads):
    """Row i of a wide call (many rows: scheduled by row chunks) equals the same row computed
    alone (one row: scheduled by key and feature ranges), bit for bit, at any thread count; V at
    masked slots may hold anything (NaN here) without touching the result."""
    q, k, v, mask, scale = _case(seed, 24)
    mask[..., -3:] = False
    v[:, :, -3:] = float("nan")  # unwritten slots: never read into a result
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        wide = op(q, k, v, mask, scale)
        for i in (0, 7, 23):
            alone = op(q[:, :, i : i + 1].contiguous(), k, v, mask[:, :, i : i + 1], scale)
            assert torch.equal(alone[:, 0], wide[:, i])
    finally:
        torch.set_num_threads(before)
    assert not wide.isnan().any()


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("seed", range(3))
def test_a_row_is_the_same_bits_wherever_its_keys_sit(seed, threads):
    """cpu_rope_attention with context_start: a token's row gives the same bits as a draft among
    a step's tokens (its block's earlier drafts in the scratch region before the context) and as
    the one token of a step (those drafts committed into the context), for any scratch size.
    This is what makes every decoding method return exactly our AR: the methods place the same
    keys in different slots."""
    rope = torch.ops.jacobi_ext.cpu_rope_attention
    g = torch.Generator().manual_seed(seed)
    B, Hkv, G, D, P, n = 1, 3, 3, 64, 29 + 11 * seed, 6
    H = Hkv * G
    ctx_k, ctx_v = torch.randn(2, B, Hkv, P, D, generator=g)
    qkv = torch.randn(B, n, (H + 2 * Hkv) * D, generator=g)
    ang = torch.rand(B, n, D // 2, generator=g) * 6
    cos, sin = torch.cat([ang.cos()] * 2, -1), torch.cat([ang.sin()] * 2, -1)
    scale = D**-0.5

    def cache(scratch, keys, values):
        cap = scratch + keys.shape[2] + 4
        k = torch.full((B, Hkv, cap, D), float("nan"))  # never written: never read into a result
        v = torch.full((B, Hkv, cap, D), float("nan"))
        k[:, :, scratch : scratch + keys.shape[2]] = keys
        v[:, :, scratch : scratch + values.shape[2]] = values
        return k, v

    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        sJ = 8  # drafts: the step's n tokens in slots 0..n-1, row i sees slots 0..i
        kJ, vJ = cache(sJ, ctx_k, ctx_v)
        attend = sJ + P
        mask = torch.zeros(B, 1, n, attend, dtype=torch.bool)
        mask[..., sJ:] = True
        for i in range(n):
            mask[:, :, i, : i + 1] = True
        outJ = rope(qkv, H, Hkv, cos, sin, kJ, vJ, torch.arange(n), attend, mask, scale, None, sJ)
        for i in range(n):
            sA = 1 + (i + seed) % 4  # one token a step, its block's earlier tokens committed
            kA, vA = cache(
                sA, torch.cat([ctx_k, kJ[:, :, :i]], 2), torch.cat([ctx_v, vJ[:, :, :i]], 2)
            )
            attendA = sA + P + i
            maskA = torch.zeros(B, 1, 1, attendA, dtype=torch.bool)
            maskA[..., sA:] = True
            maskA[..., 0] = True
            outA = rope(qkv[:, i : i + 1], H, Hkv, cos[:, i : i + 1], sin[:, i : i + 1], kA, vA,
                        torch.tensor([0]), attendA, maskA, scale, None, sA)  # fmt: skip
            assert torch.equal(outA[:, 0], outJ[:, i]), i
    finally:
        torch.set_num_threads(before)
    assert not outJ.isnan().any()


@pytest.mark.parametrize("threads", [1, 2, 3])
@pytest.mark.parametrize("seed", range(3))
def test_a_prefill_row_is_the_same_bits_as_the_row_alone(seed, threads):
    """A prefill's rows: causal over the prompt (row i sees prompt slots first .. first + i),
    then drafts that see the whole prompt and their block's earlier drafts in the scratch slots
    before it, and a row that sees nothing. Many rows are scheduled by row chunks, each over
    the slots its rows may see (later chunks see more; they are dealt from both ends): every row
    equals the same row computed alone over every slot, bit for bit, matches the dense
    reference, and never reads V where no row of its chunk looks (NaN there)."""
    g = torch.Generator().manual_seed(seed)
    B, Hkv, G, D = 1 + seed % 2, 3, 3, [16, 64, 24][seed]
    first, P, n = 5, 37 + 13 * seed, 3  # scratch slots, prompt, drafts
    W, Q = first + P, P + n
    q = torch.randn(B, Hkv * G, Q, D, generator=g)
    k = torch.randn(B, Hkv, W, D, generator=g)
    v = torch.randn(B, Hkv, W, D, generator=g)
    mask = torch.zeros(B, 1, Q, W, dtype=torch.bool)
    for i in range(P):
        mask[:, :, i, first : first + i + 1] = True
    for d in range(n):
        mask[:, :, P + d, first:] = True
        mask[:, :, P + d, : d + 1] = True
    mask[:, :, 2] = False  # sees nothing: zeros
    v[:, :, first + P // 2 + 8 :] = float("nan")  # no row of the first chunks looks there
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        wide = op(q[:, :, : P // 2], k, v, mask[:, :, : P // 2], D**-0.5)
        assert not wide.isnan().any()
        v[:, :, first + P // 2 + 8 :] = torch.randn(B, Hkv, W - first - P // 2 - 8, D, generator=g)
        wide = op(q, k, v, mask, D**-0.5)
        for i in range(Q):
            alone = op(q[:, :, i : i + 1].contiguous(), k, v, mask[:, :, i : i + 1], D**-0.5)
            assert torch.equal(alone[:, 0], wide[:, i]), i
    finally:
        torch.set_num_threads(before)
    assert torch.equal(wide[:, 2], torch.zeros_like(wide[:, 2]))
    torch.testing.assert_close(
        wide.double(), _reference(q, k, v, mask, D**-0.5), atol=2e-5, rtol=1e-5
    )


def check_softmax_edges() -> None:
    """A row's masked maximum and softmax around the vector widths (8 and 16 lanes) and the
    scalar tail, with few rows (key-range schedule) and many (row chunks): masked slots are never
    seen (their keys hold NaN and inf here), a visible NaN score beside numbers makes its row NaN
    (it never wins the maximum, and its exp reaches the sum), a row whose scores are all +-0
    (q = +-0) averages V, and a row that sees one slot returns that slot's V."""
    for W in (1, 7, 8, 9, 15, 16, 17, 31, 32, 33, 47):
        for B, Hkv, G, Q in ((1, 1, 3, 1), (2, 4, 2, 24)):
            g = torch.Generator().manual_seed(W * 100 + Q)
            D = 16
            q = torch.randn(B, Hkv * G, Q, D, generator=g)
            k = torch.randn(B, Hkv, W, D, generator=g)
            v = torch.randn(B, Hkv, W, D, generator=g)
            mask = torch.rand(B, 1, Q, W, generator=g) < 0.7
            mask[..., W - 1] = True
            hidden = ~mask[:, 0].any(1)  # [B, W]: slots no row sees
            for b in range(B):
                k[b, :, hidden[b]] = torch.tensor([float("nan"), float("inf")]).repeat(D // 2)
            got = op(q, k, v, mask, D**-0.5)
            torch.testing.assert_close(
                got.double(), _reference(q, k, v, mask, D**-0.5), atol=2e-5, rtol=1e-5
            )
            if W > 1:  # every row sees slot 0 (a number) and slot W - 1 (NaN)
                k_nan = torch.randn(B, Hkv, W, D, generator=g)
                k_nan[:, :, W - 1, 3] = float("nan")
                both = mask.clone()
                both[..., 0] = True
                assert op(q, k_nan, v, both, D**-0.5).isnan().all(), (W, Q)
            q0 = torch.zeros_like(q)
            q0[:, ::2] = -0.0
            torch.testing.assert_close(
                op(q0, k, v, mask, D**-0.5).double(),
                _reference(q0, k, v, mask, D**-0.5),
                atol=2e-6,
                rtol=1e-6,
            )
            k1 = torch.randn(B, Hkv, W, D, generator=g)
            for j in sorted({0, W // 2, W - 1}):
                one = torch.zeros_like(mask)
                one[..., j] = True
                want = v[:, :, j].repeat_interleave(G, dim=1)[:, None].expand(B, Q, Hkv * G, D)
                assert torch.equal(op(q, k1, v, one, D**-0.5), want), (W, Q, j)


@pytest.mark.parametrize("threads", [1, 2])
def test_softmax_edges(threads):
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        check_softmax_edges()
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("isa", ISAS)
def test_every_isa(isa, in_isa_process):
    """Each ISA variant (capped to what the CPU has) in a process of its own: the softmax's edge
    cases and random shapes against the dense reference, fp32 and half K/V (each ISA widens fp16
    its own way)."""
    in_isa_process(
        isa,
        "import test_cpu_decode_attention as t\n"
        "t.check_softmax_edges()\n"
        "for seed in range(4):\n"
        "    for Q in (1, 5, 33):\n"
        "        t.test_matches_the_dense_reference(seed, Q)\n"
        "        t.test_half_kv_is_the_fp32_attention_over_the_rounded_values(seed, Q)\n",
    )
