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
    for run, g in enumerate(grads[1:], 1):
        for name, a, b in zip("qkv", grads[0], g, strict=True):
            # Say where and by how much, should it ever fail again (it failed once in a full
            # suite run, 2026-11-26, and never in 1 000+ runs alone; cause not found yet).
            diff = (a != b).nonzero()
            assert diff.numel() == 0, (
                f"d{name} of run {run} differs from run 0 at {len(diff)} places, first "
                f"{diff[0].tolist()}, max |diff| {(a - b).abs().max().item():.3g}"
            )


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
    # With the sm_90a tile lists (read only where that kernel runs; the CPU ignores them).
    lists = list(ops.attention_tile_lists(*t, q.shape[2], 128, 128))
    torch.library.opcheck(ops.block_attention_bwd.default, (*args, None, lists))
    want = ops.block_attention_bwd(*args)
    for a, b in zip(ops.block_attention_bwd(*args, None, lists), want, strict=True):
        assert torch.equal(a, b)


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
@pytest.mark.parametrize("D", [64, 96, 128, 256])
def test_cuda_matches_cpu(variant, w, dtype, D):
    from jacobi_ext.kernels.ops import has_kernel

    if not jacobi_ext.WITH_CUDA or not has_kernel("block_attention_fwd", torch.device("cuda")):
        pytest.skip("jacobi_ext has no CUDA kernel for block_attention_fwd in this build")
    from test_attention_cuda import skip_unless_compiled

    skip_unless_compiled(dtype, D)
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


# ---- the ordered ops (table in processing order + each block's memory row) --------------------
def test_ordered_op_with_identity_rows_is_the_plain_op():
    layout = JacobiLayout(9, 5, 4, "windowed", 2)
    q, k, v = make_qkv(2, 4, 2, layout.seq_len, 32, torch.float32, requires_grad=False)
    t = layout.block_table()
    rows = t.block_start[:-1].clone()
    a = ops.block_attention_fwd(q, k, v, *t.tensors(), 0.2)
    b = ops.block_attention_ordered_fwd(q, k, v, *t.tensors(), rows, 0.2)
    for x, y in zip(a, b, strict=True):
        assert torch.equal(x, y)


def test_block_attention_with_an_order_on_a_custom_table():
    # blocks [0,4) [4,6) [6,9) [9,12); 2 sees 0; 3 sees 1. Order 0, 2, 1, 3 is valid.
    table = BlockTable(
        torch.tensor([0, 4, 6, 9, 12], dtype=torch.int32),
        torch.tensor([0, 0, 0, 1, 2], dtype=torch.int32),
        torch.tensor([0, 1], dtype=torch.int32),
    )
    q, k, v = make_qkv(1, 2, 1, 12, 16, torch.float32)
    out = block_attention(q, k, v, table, order=[0, 2, 1, 3])
    qd, kd, vd = (x.detach().double().requires_grad_() for x in (q, k, v))
    want = reference(qd, kd, vd, table.dense_mask())
    g = torch.randn_like(want)
    want.backward(g)
    out.backward(g.float())
    assert rel_err(out, want) < 1e-5
    for got, ref in ((q.grad, qd.grad), (k.grad, kd.grad), (v.grad, vd.grad)):
        assert rel_err(got, ref) < 1e-5


def test_gather_fallback_for_devices_without_the_ordered_kernel(monkeypatch):
    # What runs on a device whose kernel implements only block_attention_fwd/bwd (e.g. CUDA).
    from jacobi_ext.kernels import ops as jops

    layout = JacobiLayout(11, 4, 5, "noisy_context")
    q, k, v = make_qkv(1, 3, 1, layout.seq_len, 16, torch.float32)
    want = jacobi_attention(q, k, v, layout)
    gw = torch.autograd.grad(want.square().sum(), (q, k, v))
    monkeypatch.setattr(jops, "has_kernel", lambda op, device: False)
    got = jacobi_attention(q, k, v, layout)
    gg = torch.autograd.grad(got.square().sum(), (q, k, v))
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    for a, b in zip(gg, gw, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_ordered_op_rejects_bad_block_rows():
    layout, q, k, v = _args()
    t = layout.block_table().tensors()  # block lengths 2, 2, 2, 2, 2
    fwd = ops.block_attention_ordered_fwd
    with pytest.raises(ValueError, match=r"one entry per block \(5\)"):
        fwd(q, k, v, *t, torch.tensor([0, 2, 4, 6], dtype=torch.int32), 0.25)
    with pytest.raises(ValueError, match=r"outside \[0, 10\)"):
        fwd(q, k, v, *t, torch.tensor([0, 2, 4, 6, 9], dtype=torch.int32), 0.25)
    with pytest.raises(ValueError, match=r"must not overlap"):
        fwd(q, k, v, *t, torch.tensor([0, 2, 4, 6, 7], dtype=torch.int32), 0.25)


def test_opcheck_ordered_ops():
    layout = JacobiLayout(3, 2, 3)
    plan = layout.stream_plan("cpu")
    q, k, v = make_qkv(1, 2, 1, layout.seq_len, 16, torch.float32)
    args = (q, k, v, *plan.table.tensors(), plan.block_row, 0.25)
    torch.library.opcheck(ops.block_attention_ordered_fwd.default, args)
    out, lse = ops.block_attention_ordered_fwd(*(x.detach() for x in args[:3]), *args[3:])
    bargs = (torch.randn_like(out), *(x.detach() for x in (q, k, v)), out, lse, *args[3:], True)
    torch.library.opcheck(ops.block_attention_ordered_bwd.default, bargs)


# ---- the Python validator and the CUDA routing (metadata only: no GPU needed) -------------------
def fake_cuda(*shape, dtype=torch.bfloat16, head_dim_step=1):
    """A tensor that claims to live on CUDA but has no storage: shape/dtype/device/strides only
    (a FakeTensor; only its metadata may be read outside the mode)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    # Every head_dim_step-th element of a row (like x[..., ::step] of a wider tensor).
    stride, n = [head_dim_step], head_dim_step * shape[-1]
    for size in reversed(shape[:-1]):
        stride.insert(0, n)
        n *= size
    with FakeTensorMode():
        return torch.empty_strided(shape, stride, dtype=dtype, device="cuda")


def qkv_cuda(B=1, Hq=4, Hkv=2, S=64, D=64, dtype=torch.bfloat16):
    return fake_cuda(B, Hq, S, D, dtype=dtype), *(fake_cuda(B, Hkv, S, D, dtype=dtype),) * 2


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(Hq=3, Hkv=2), r"query heads \(3\) must be a multiple of .* key/value heads \(2\)"),
        (dict(Hq=2, Hkv=0), r"query heads \(2\) must be a multiple"),
        (dict(D=80), r"head dim 80 has no CUDA kernel \(compiled: 64, 96, 128, 256\)"),
        (dict(D=32), r"head dim 32 has no CUDA kernel.*FlexAttention"),
        (dict(D=264), r"head_dim must be in \[1, 256\]"),
        (dict(dtype=torch.float32), r"bfloat16 or float16 .* q.to\(torch.bfloat16\)"),
        (dict(B=8193, Hq=8, Hkv=8), r"batch \* query heads \(8193 \* 8\) must be at most 65535"),
    ],
)
def test_validator_rejects_bad_cuda_inputs_without_a_gpu(kwargs, match):
    from jacobi_ext.kernels.ops import check_attention_inputs

    q, k, v = qkv_cuda(**kwargs)
    with pytest.raises(ValueError, match=match):
        check_attention_inputs(q, k, v)


@pytest.mark.parametrize("D", [64, 96, 128, 256])
def test_validator_accepts_every_compiled_cuda_head_dim(D):
    from jacobi_ext.kernels.ops import check_attention_inputs

    assert check_attention_inputs(*qkv_cuda(D=D)) is True
    assert check_attention_inputs(*qkv_cuda(D=D), allow_fallback=True) is True


@pytest.mark.parametrize(
    "D,fallback", [(32, True), (48, True), (80, True), (200, True), (16, False)]
)
def test_validator_routes_other_cuda_head_dims_to_flex(D, fallback):
    from jacobi_ext.kernels.ops import check_attention_inputs

    if fallback:
        assert check_attention_inputs(*qkv_cuda(D=D), allow_fallback=True) is False
    else:
        with pytest.raises(ValueError, match=rf"head dim {D} has no CUDA kernel"):
            check_attention_inputs(*qkv_cuda(D=D), allow_fallback=True)


def test_validator_rejects_mismatched_devices_dtypes_shapes_and_strides():
    from jacobi_ext.kernels.ops import check_attention_inputs, check_block_table_tensors

    q, k, v = qkv_cuda()
    kc = torch.empty(k.shape, dtype=k.dtype, device="meta")
    with pytest.raises(ValueError, match=r"k is on meta but q is on cuda:0; move them"):
        check_attention_inputs(q, kc, v)
    with pytest.raises(ValueError, match=r"v must have dtype torch.bfloat16 \(like q\)"):
        check_attention_inputs(q, k, fake_cuda(*v.shape, dtype=torch.float16))
    with pytest.raises(ValueError, match=r"k and v must have the same shape"):
        check_attention_inputs(q, k, fake_cuda(1, 2, 64, 32))
    with pytest.raises(ValueError, match=r"to match q"):
        check_attention_inputs(q, fake_cuda(1, 2, 60, 64), fake_cuda(1, 2, 60, 64))
    with pytest.raises(ValueError, match=r"q must be 4-D"):
        check_attention_inputs(fake_cuda(4, 64, 64), k, v)
    # CPU (here: meta) kernels need a unit head_dim stride; CUDA copies such rows itself.
    qm, km, vm = (torch.empty(1, 2, 8, 32, device="meta")[..., ::2] for _ in range(3))
    with pytest.raises(ValueError, match=r"q must be contiguous in its last dim .*contiguous\(\)"):
        check_attention_inputs(qm, km, vm)
    qs = fake_cuda(1, 4, 64, 64, head_dim_step=2)
    ks = fake_cuda(1, 2, 64, 64, head_dim_step=2)
    assert qs.shape[-1] == 64 and qs.stride(-1) == 2
    assert check_attention_inputs(qs, ks, ks) is True
    # block table tensors
    i32 = dict(dtype=torch.int32)
    bs, kp, ki = fake_cuda(3, **i32), fake_cuda(3, **i32), fake_cuda(1, **i32)
    check_block_table_tensors(q, bs, kp, ki)
    with pytest.raises(ValueError, match=r"block_start must have dtype torch.int32"):
        check_block_table_tensors(q, fake_cuda(3, dtype=torch.int64), kp, ki)
    with pytest.raises(ValueError, match=r"kv_ptr is on cpu but q is on cuda:0; move the block"):
        check_block_table_tensors(q, bs, torch.zeros(3, **i32), ki)
    with pytest.raises(ValueError, match=r"kv_idx must be a 1-D int32 tensor"):
        check_block_table_tensors(q, bs, kp, fake_cuda(1, 1, **i32))
    with pytest.raises(ValueError, match=r"num_blocks \+ 1 entries, got 3 and 2"):
        check_block_table_tensors(q, bs, fake_cuda(2, **i32), ki)


def test_fake_kernels_apply_the_cuda_rules():
    """Under torch.compile / FakeTensorMode the ops reject what the CUDA kernels reject."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        i32 = dict(dtype=torch.int32, device="cuda")
        t = (torch.zeros(3, **i32), torch.zeros(3, **i32), torch.zeros(0, **i32))
        q, k, v = (
            torch.empty(1, h, 64, 96, dtype=torch.bfloat16, device="cuda") for h in (4, 2, 2)
        )
        out, lse = ops.block_attention_fwd(q, k, v, *t, 0.1)
        assert out.shape == q.shape and lse.shape == (1, 4, 64) and lse.dtype == torch.float32
        dq, dk, dv = ops.block_attention_bwd(out, q, k, v, out, lse, *t, 0.1, False)
        assert dq.shape == q.shape and dk.shape == k.shape
        q80, k80 = (torch.empty(1, h, 64, 80, dtype=torch.bfloat16, device="cuda") for h in (4, 2))
        with pytest.raises(ValueError, match=r"head dim 80 has no CUDA kernel"):
            ops.block_attention_fwd(q80, k80, k80, *t, 0.1)
        q3 = torch.empty(1, 3, 64, 96, dtype=torch.bfloat16, device="cuda")
        with pytest.raises(ValueError, match=r"must be a multiple"):
            ops.block_attention_fwd(q3, k, v, *t, 0.1)
        with pytest.raises(ValueError, match=r"lse must have dtype torch.float32"):
            ops.block_attention_bwd(out, q, k, v, out, lse.double(), *t, 0.1, False)


@pytest.mark.parametrize("front_end", ["jacobi_attention", "block_attention"])
@pytest.mark.parametrize("D,route", [(64, "kernel"), (96, "kernel"), (256, "kernel"), (80, "flex")])
def test_cuda_front_ends_route_by_head_dim(monkeypatch, front_end, D, route):
    """Both front ends validate first, then pick the kernel or FlexAttention; nothing else runs."""
    from jacobi_ext.kernels import attention as A

    layout = JacobiLayout(0, 16, 2)
    table = layout.block_table()
    calls = []
    monkeypatch.setattr(A, "_block_table", lambda layout, device: table)
    monkeypatch.setattr(A, "_stream_plan", lambda layout, device: None)
    monkeypatch.setattr(A, "_run_plan", lambda *a, **kw: calls.append("kernel"))
    monkeypatch.setattr(A, "_run", lambda *a, **kw: calls.append("kernel"))
    monkeypatch.setattr(A, "_flex_attention", lambda *a, **kw: calls.append("flex"))
    monkeypatch.setattr(BlockTable, "to", lambda self, device: self)
    # An A100: Hopper's measured table (test_attention_backends.py) would route to "streams".
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    q, k, v = qkv_cuda(D=D)
    if front_end == "jacobi_attention":
        jacobi_attention(q, k, v, layout)
    else:
        block_attention(q, k, v, table)
    assert calls == [route]
    q3, k3, _ = qkv_cuda(Hq=3, Hkv=2, D=D)
    with pytest.raises(ValueError, match=r"must be a multiple"):
        (
            jacobi_attention(q3, k3, k3, layout)
            if front_end == "jacobi_attention"
            else block_attention(q3, k3, k3, table)
        )
    assert calls == [route], "nothing may run after a rejected input"


def test_flex_fallback_warns_once_per_head_dim(monkeypatch):
    from jacobi_ext.kernels import attention as A

    monkeypatch.setattr(A, "_flex_warned", set())
    with pytest.warns(RuntimeWarning, match=r"head dim 80 has no compiled CUDA attention kernel"):
        A._warn_flex(80)
    with pytest.warns(RuntimeWarning, match=r"head dim 48"):
        A._warn_flex(48)
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        A._warn_flex(80)  # second time: silent
        A._warn_flex(48)


@pytest.mark.parametrize(
    "variant,w", [("noisy_context", None), ("clean_context", None), ("windowed", 2)]
)
def test_flex_fallback_math_on_cpu(variant, w):
    """The FlexAttention fallback (forward; CPU flex has no backward) computes the layout's
    attention: same mask (from the block table), GQA without repeating k/v, scale."""
    import warnings

    from jacobi_ext.kernels import attention as A

    layout = JacobiLayout(13, 4, 5, variant, w)
    q, k, v = make_qkv(2, 6, 2, layout.seq_len, 40, torch.float32, requires_grad=False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        got = A._flex_attention(q, k, v, layout.block_table(), 0.3, key=layout)
        again = A._flex_attention(q, k, v, layout.block_table(), 0.3, key=layout)  # cached mask
    want = reference(q, k, v, layout.dense_mask(), 0.3)
    assert rel_err(got, want) < 1e-5
    assert torch.equal(got, again)
    from torch.nn.attention.flex_attention import create_mask

    mask = create_mask(
        A.flex_mask_mod(layout.block_table()), None, None, *(layout.seq_len,) * 2, device="cpu"
    )
    assert torch.equal(mask[0, 0], layout.dense_mask())
