"""The block-causal attention op (CPU) against a float64 dense-mask reference.

Every test here runs with JACOBI_EXT_ATTN_POISON=1: the op fills its outputs and workspaces with
NaN before the kernel runs, so a NaN-free result proves that every output element was written and
that no unwritten workspace element was read.
"""

from __future__ import annotations

import random

import pytest
import torch

import jacobi_ext
from jacobi_ext import BlockTable, JacobiLayout, block_attention, jacobi_attention

ops = torch.ops.jacobi_ext


@pytest.fixture(autouse=True)
def _poison(monkeypatch):
    monkeypatch.setenv("JACOBI_EXT_ATTN_POISON", "1")


def reference(q, k, v, mask, scale=None):
    """Plain float64 math: softmax(q k^T * scale + mask) v, GQA by repeating k/v heads."""
    q, k, v = q.double(), k.double(), v.double()
    g = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    s = (q @ k.transpose(-1, -2)) * scale
    s = s.masked_fill(~mask, float("-inf"))
    return torch.softmax(s, dim=-1) @ v


def make_qkv(B, Hq, Hkv, S, D, dtype, requires_grad=True):
    q = torch.randn(B, Hq, S, D).to(dtype)
    k = torch.randn(B, Hkv, S, D).to(dtype)
    v = torch.randn(B, Hkv, S, D).to(dtype)
    return [x.requires_grad_(requires_grad) for x in (q, k, v)]


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    assert not torch.isnan(got).any(), "NaN in the result: an element was not written"
    # relative to the largest reference entry (floored: some gradients are exactly zero)
    return ((got.double() - want).abs().max() / want.abs().max().clamp(min=0.1)).item()


TOL = {torch.float32: 2e-5, torch.bfloat16: 1.5e-2, torch.float16: 2e-3}


def check_against_reference(layout_or_table, B, Hq, Hkv, D, dtype, scale=None, natural=False):
    if isinstance(layout_or_table, JacobiLayout):
        S, mask = layout_or_table.seq_len, layout_or_table.dense_mask()
    else:
        S, mask = layout_or_table.seq_len, layout_or_table.dense_mask()
    q, k, v = make_qkv(B, Hq, Hkv, S, D, dtype)
    if isinstance(layout_or_table, JacobiLayout) and not natural:
        out = jacobi_attention(q, k, v, layout_or_table, scale=scale)
    else:
        table = (
            layout_or_table.block_table()
            if isinstance(layout_or_table, JacobiLayout)
            else layout_or_table
        )
        out = block_attention(q, k, v, table, scale=scale)
    assert out.shape == q.shape and out.dtype == dtype
    qd, kd, vd = (x.detach().double().requires_grad_() for x in (q, k, v))
    want = reference(qd, kd, vd, mask, scale)
    grad = torch.randn_like(want)
    want.backward(grad)
    out.backward(grad.to(dtype))
    tol = TOL[dtype]
    assert rel_err(out, want) < tol
    for name, got, ref in (("q", q.grad, qd.grad), ("k", k.grad, kd.grad), ("v", v.grad, vd.grad)):
        assert got.dtype == dtype and got.shape == ref.shape
        assert rel_err(got, ref) < 2 * tol, f"grad {name}"


# (P, n, T, variant, window, B, Hq, Hkv, D, dtype, tiles)
CASES = [
    (5, 3, 4, "noisy_context", None, 2, 4, 2, 16, torch.float32, None),
    (0, 4, 3, "clean_context", None, 1, 3, 1, 64, torch.float32, None),
    (37, 8, 6, "windowed", 2, 1, 6, 2, 80, torch.float32, None),
    (17, 5, 5, "noisy_context", None, 2, 2, 2, 32, torch.bfloat16, None),
    (9, 4, 0, "noisy_context", None, 1, 2, 1, 16, torch.float32, None),  # T = 0: causal prompt
    (0, 1, 1, "noisy_context", None, 1, 1, 1, 8, torch.float32, None),  # 2 tokens
    (3, 2, 7, "windowed", 3, 1, 3, 3, 128, torch.float32, None),
    (11, 6, 3, "clean_context", None, 1, 6, 3, 256, torch.float32, None),
    (11, 6, 3, "noisy_context", None, 1, 4, 1, 256, torch.bfloat16, None),
    (21, 7, 4, "noisy_context", None, 1, 6, 2, 64, torch.float16, None),
    # odd tile sizes: ragged tiles, split prompt blocks, many partial tile pairs
    (13, 3, 5, "noisy_context", None, 1, 3, 1, 24, torch.float32, "5,7"),
    (13, 3, 5, "clean_context", None, 2, 2, 1, 24, torch.float32, "4,3"),
    (13, 3, 5, "windowed", 2, 1, 2, 2, 24, torch.bfloat16, "1,1"),
    (130, 16, 4, "noisy_context", None, 1, 2, 1, 64, torch.float32, "32,32"),
]


@pytest.mark.parametrize("P,n,T,variant,w,B,Hq,Hkv,D,dtype,tiles", CASES)
def test_jacobi_attention_matches_reference(
    monkeypatch, P, n, T, variant, w, B, Hq, Hkv, D, dtype, tiles
):
    if tiles:
        monkeypatch.setenv("JACOBI_EXT_ATTN_TILES", tiles)
    layout = JacobiLayout(P, n, T, variant, w)
    check_against_reference(layout, B, Hq, Hkv, D, dtype)


@pytest.mark.parametrize("seed", range(8))
def test_random_layouts_both_token_orders(monkeypatch, seed):
    rng = random.Random(seed)
    variant = rng.choice(["noisy_context", "clean_context", "windowed"])
    w = rng.randint(1, 4) if variant == "windowed" else None
    layout = JacobiLayout(
        rng.choice([0, 1, rng.randint(2, 40)]), rng.randint(1, 9), rng.randint(0, 6), variant, w
    )
    if layout.seq_len == 0:
        layout = JacobiLayout(3, 2, 1)
    hkv = rng.choice([1, 2])
    hq = hkv * rng.choice([1, 3])
    D = rng.choice([16, 40, 64, 80])
    dtype = rng.choice([torch.float32, torch.bfloat16])
    if rng.random() < 0.5:
        monkeypatch.setenv("JACOBI_EXT_ATTN_TILES", f"{rng.randint(1, 24)},{rng.randint(1, 24)}")
    check_against_reference(layout, rng.choice([1, 2]), hq, hkv, D, dtype)
    # The packed (natural) order through the general op: same math, many PARTIAL tile pairs.
    check_against_reference(layout, 1, hq, hkv, D, dtype, natural=True)


def test_custom_block_table_and_scale():
    # A block-causal layout that is not JF: blocks [0,4) [4,5) [5,9) [9,12); block 3 sees block 0
    # and 2 but not 1; block 2 sees nothing but itself.
    table = BlockTable(
        torch.tensor([0, 4, 5, 9, 12], dtype=torch.int32),
        torch.tensor([0, 0, 1, 1, 3], dtype=torch.int32),
        torch.tensor([0, 0, 2], dtype=torch.int32),
    )
    check_against_reference(table, 2, 4, 2, 32, torch.float32, scale=0.3)
    # empty blocks are allowed
    table = BlockTable(
        torch.tensor([0, 3, 3, 6], dtype=torch.int32),
        torch.tensor([0, 0, 1, 3], dtype=torch.int32),
        torch.tensor([0, 0, 1], dtype=torch.int32),
    )
    check_against_reference(table, 1, 2, 1, 16, torch.float32)


def test_strided_inputs_match_contiguous():
    # transformers hands q/k/v as [B, S, H, D].transpose(1, 2): not contiguous, last dim unit.
    layout = JacobiLayout(7, 4, 3)
    S = layout.seq_len
    q = torch.randn(2, S, 4, 32).transpose(1, 2)
    k = torch.randn(2, S, 2, 32).transpose(1, 2)
    v = torch.randn(2, S, 2, 32).transpose(1, 2)
    table = layout.block_table()
    got = block_attention(q, k, v, table)
    want = block_attention(q.contiguous(), k.contiguous(), v.contiguous(), table)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    raw, _ = ops.block_attention_fwd(q, k, v, *table.tensors(), 32**-0.5)
    torch.testing.assert_close(raw, want, rtol=1e-6, atol=1e-6)


def test_backward_is_deterministic():
    torch.set_num_threads(max(2, torch.get_num_threads()))
    layout = JacobiLayout(40, 8, 12, "noisy_context")
    q, k, v = make_qkv(1, 6, 2, layout.seq_len, 64, torch.float32)
    grads = []
    for _ in range(3):
        for x in (q, k, v):
            x.grad = None
        out = jacobi_attention(q, k, v, layout)
        out.backward(torch.cos(out.detach() * 3))
        grads.append([x.grad.clone() for x in (q, k, v)])
    for g in grads[1:]:
        for a, b in zip(grads[0], g, strict=True):
            assert torch.equal(a, b)


def test_lse_output():
    layout = JacobiLayout(6, 3, 3)
    q, k, v = make_qkv(1, 2, 1, layout.seq_len, 16, torch.float32, requires_grad=False)
    scale = 0.25
    _, lse = ops.block_attention_fwd(q, k, v, *layout.block_table().tensors(), scale)
    s = (q.double() @ k.double().transpose(-1, -2).repeat_interleave(2, 1)) * scale
    want = s.masked_fill(~layout.dense_mask(), float("-inf")).logsumexp(-1)
    torch.testing.assert_close(lse.double(), want, rtol=1e-5, atol=1e-5)


# ---- argument checks ----------------------------------------------------------------------------
def _args(S=10, B=1, Hq=2, Hkv=1, D=16, dtype=torch.float32):
    layout = JacobiLayout(2, 2, 2)
    assert layout.seq_len == 10
    q, k, v = make_qkv(B, Hq, Hkv, S, D, dtype, requires_grad=False)
    return layout, q, k, v


@pytest.mark.parametrize("use_raw_op", [False, True])
def test_bad_inputs_raise_value_errors(use_raw_op):
    layout, q, k, v = _args()
    t = layout.block_table().tensors()

    def call(q, k, v):
        if use_raw_op:
            return ops.block_attention_fwd(q, k, v, *t, 0.25)
        return jacobi_attention(q, k, v, layout)

    with pytest.raises(ValueError, match=r"q must be 4-D"):
        call(q[0], k, v)
    with pytest.raises(ValueError, match=r"seq_len"):
        _, q2, k2, v2 = _args(S=12)
        call(q2, k2, v2)
    with pytest.raises(ValueError, match=r"multiple of the number of key/value heads"):
        _, q3, k3, v3 = _args(Hq=3, Hkv=2)
        call(q3, k3, v3)
    with pytest.raises(ValueError, match=r"k must have dtype"):
        call(q, k.bfloat16(), v)
    with pytest.raises(ValueError, match=r"float32, bfloat16 or float16"):
        call(q.double(), k.double(), v.double())
    with pytest.raises(ValueError, match=r"head_dim must be in \[1, 256\]"):
        _, q4, k4, v4 = _args(D=264)
        call(q4, k4, v4)
    with pytest.raises(ValueError, match=r"same shape"):
        call(q, k, v[:, :, :, :8])
    with pytest.raises(ValueError, match=r"to match q"):
        call(q, k[:, :, :, :8], v[:, :, :, :8])


def test_python_layer_says_what_to_do_on_length_mismatch():
    layout, q, k, v = _args(S=12)
    with pytest.raises(ValueError, match=r"P \+ 2\*T\*n = 10 tokens; pass the layout"):
        jacobi_attention(q, k, v, layout)


def test_raw_op_rejects_bad_strides_and_tables():
    layout, q, k, v = _args()
    bs, kp, ki = layout.block_table().tensors()
    fwd = ops.block_attention_fwd
    q_strided = torch.randn(1, 2, 10, 32)[..., ::2]
    with pytest.raises(ValueError, match=r"q must be contiguous in its last dim"):
        fwd(q_strided, k, v, bs, kp, ki, 0.25)
    with pytest.raises(ValueError, match=r"block_start must have dtype Int"):
        fwd(q, k, v, bs.long(), kp, ki, 0.25)
    with pytest.raises(ValueError, match=r"covers 10 tokens .* seq_len = 12"):
        _, q2, k2, v2 = _args(S=12)
        fwd(q2, k2, v2, bs, kp, ki, 0.25)
    assert kp.tolist() == [0, 0, 1, 2, 4, 6] and ki.tolist() == [0, 0, 0, 1, 0, 2]
    with pytest.raises(ValueError, match=r"strictly ascending"):
        fwd(q, k, v, bs, kp, torch.tensor([0, 0, 1, 0, 0, 2], dtype=torch.int32), 0.25)
    with pytest.raises(ValueError, match=r"must list key blocks in \[0, 1\)"):
        fwd(
            q,
            k,
            v,
            bs,
            torch.tensor([0, 0, 1, 1, 1, 1], dtype=torch.int32),
            torch.tensor([1], dtype=torch.int32),
            0.25,
        )
    with pytest.raises(ValueError, match=r"kv_ptr must have"):
        fwd(q, k, v, bs, kp[:-1], ki, 0.25)
    with pytest.raises(ValueError, match=r"non-decreasing"):
        fwd(q, k, v, torch.tensor([0, 5, 3, 10], dtype=torch.int32), kp[:4], ki[: int(kp[3])], 0.25)


def test_bwd_op_checks_its_extra_arguments():
    layout, q, k, v = _args()
    t = layout.block_table().tensors()
    out, lse = ops.block_attention_fwd(q, k, v, *t, 0.25)
    with pytest.raises(ValueError, match=r"grad_out must have q's shape"):
        ops.block_attention_bwd(out[:, :1], q, k, v, out, lse, *t, 0.25, True)
    with pytest.raises(ValueError, match=r"lse must have dtype Float"):
        ops.block_attention_bwd(out, q, k, v, out, lse.double(), *t, 0.25, True)


# ---- torch.library: fake kernels, autograd registration, torch.compile --------------------------
def test_opcheck_attention_ops():
    layout, q, k, v = _args()
    t = layout.block_table().tensors()
    q, k, v = (x.requires_grad_() for x in (q, k, v))
    torch.library.opcheck(ops.block_attention_fwd.default, (q, k, v, *t, 0.25))
    out, lse = ops.block_attention_fwd(q.detach(), k.detach(), v.detach(), *t, 0.25)
    args = (torch.randn_like(out), q.detach(), k.detach(), v.detach(), out, lse, *t, 0.25, True)
    torch.library.opcheck(ops.block_attention_bwd.default, args)


def test_opcheck_jf_block_table():
    torch.library.opcheck(
        ops.jf_block_table.default,
        (3, 2, 4, 2, 2),
        test_utils=("test_schema", "test_faketensor"),
    )


def test_torch_compile_runs_the_op():
    layout = JacobiLayout(9, 4, 3, "clean_context")
    q, k, v = make_qkv(1, 4, 2, layout.seq_len, 32, torch.float32)

    def loss(q, k, v):
        return (jacobi_attention(q, k, v, layout) ** 2).sum()

    want = loss(q, k, v)
    want_grads = torch.autograd.grad(want, (q, k, v))
    compiled = torch.compile(loss, backend="aot_eager")
    got = compiled(q, k, v)
    got_grads = torch.autograd.grad(got, (q, k, v))
    torch.testing.assert_close(got, want)
    for a, b in zip(got_grads, want_grads, strict=True):
        torch.testing.assert_close(a, b)

    # The general op traces whole (no graph break) when the table comes in as tensors.
    table = layout.block_table()
    full = torch.compile(
        lambda q, k, v: block_attention(q, k, v, table), backend="aot_eager", fullgraph=True
    )
    torch.testing.assert_close(full(q, k, v), block_attention(q, k, v, table))


# ---- CUDA vs CPU (the CUDA kernel implements the same schema) -----------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize(
    "variant,w", [("noisy_context", None), ("clean_context", None), ("windowed", 2)]
)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("D", [64, 128])
def test_cuda_matches_cpu(variant, w, dtype, D):
    if not jacobi_ext.WITH_CUDA:
        pytest.skip("jacobi_ext was built without CUDA kernels")
    layout = JacobiLayout(77, 16, 6, variant, w)
    q, k, v = make_qkv(2, 6, 2, layout.seq_len, D, dtype)
    grad = torch.randn(q.shape).to(dtype)
    results = {}
    for dev in ("cpu", "cuda"):
        qd, kd, vd = (x.detach().to(dev).requires_grad_() for x in (q, k, v))
        out = jacobi_attention(qd, kd, vd, layout)
        out.backward(grad.to(dev))
        results[dev] = [t.detach().cpu().float() for t in (out, qd.grad, kd.grad, vd.grad)]
    for name, a, b in zip(("out", "dq", "dk", "dv"), results["cuda"], results["cpu"], strict=True):
        err = ((a - b).abs().max() / b.abs().max()).item()
        assert err < 2e-2, f"{name}: relative error {err}"
