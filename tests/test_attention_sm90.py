"""The sm_90a forward (csrc/cuda/attention/sm90/fwd_sm90.h) and backward (bwd_sm90.h) against the
float64 dense reference, and the backward against the sm_80 backward.

GPU only (marked `gpu`: each test runs in a child process under a timeout, tests/gpu_isolation.py,
so a hung mbarrier fails one test); every test also skips on a device that is not compute
capability 9.x, or in a build without the sm_90a forward for the dtype and head dim. The kernel is
asked for explicitly (kernel='sm90'), whatever `auto` picks (on Hopper `auto` picks it too since
these passed on an H200, docs/results/h200-2026-11-28: SM90_IS_DEFAULT). The CPU-side
pieces (stream order, tile lists, online softmax, register views) are tested without a GPU in
tests/test_sm90_layouts.py.
"""

from __future__ import annotations

import random
import warnings

import pytest
import torch
from test_attention_cuda import (
    dense_mask,
    jf_block_table,
    make_inputs,
    poison_allocator,
    reference,
)
from test_attention_tile_lists import table_mask

import jacobi_ext  # noqa: F401  (registers torch.ops.jacobi_ext)

ops = torch.ops.jacobi_ext
pytestmark = pytest.mark.gpu


def require_sm90(dtype: torch.dtype, D: int, backward: bool = False) -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("the sm_90a kernel needs a compute capability 9.x device")
    q = torch.empty(1, 1, 1, D, device="cuda", dtype=dtype)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if ops.attention_kernel(q, "sm90") != "sm90":
            pytest.skip(f"this build has no sm_90a forward for {dtype}, head dim {D}")
        if backward and ops.attention_bwd_kernel(q, False, "sm90") != "sm90":
            pytest.skip(f"this build has no sm_90a backward for {dtype}, head dim {D}")


CASES = [
    # B, Hq, Hkv, D, dtype, P, n, T, variant, w
    (1, 4, 4, 64, torch.bfloat16, 256, 32, 3, "noisy_context", 1),
    (2, 6, 2, 128, torch.float16, 37, 16, 4, "clean_context", 1),
    (1, 9, 3, 64, torch.float16, 100, 32, 5, "windowed", 2),
    (1, 8, 1, 128, torch.bfloat16, 0, 64, 2, "noisy_context", 1),
    (2, 4, 2, 128, torch.bfloat16, 64, 16, 7, "windowed", 3),
    (1, 28, 4, 128, torch.bfloat16, 512, 64, 12, "clean_context", 1),  # the 7B head shape
    (1, 2, 1, 64, torch.bfloat16, 5, 3, 1, "noisy_context", 1),  # S = 11: one ragged tile
]


def random_table(rng: random.Random, tails: tuple[int, ...]) -> tuple[list[torch.Tensor], int]:
    """A random block table (CPU int32 tensors): up to 9 blocks of 0-150 tokens (empty ones
    included), each seeing a random subset of the earlier ones, and S = the blocks' end plus a
    tail drawn from `tails` that no block covers (rows and keys that see nothing); S >= 1."""
    nb = rng.randint(1, 9)
    starts = [0]
    for _ in range(nb):
        starts.append(starts[-1] + rng.randint(0, 150))
    ptr, idx = [0], []
    for b in range(nb):
        idx += sorted(rng.sample(range(b), rng.randint(0, b)))
        ptr.append(len(idx))
    S = max(1, starts[-1] + rng.choice(tails))
    return [torch.tensor(x, dtype=torch.int32) for x in (starts, ptr, idx)], S


def check(q, k, v, starts, ptr, idx, mask, scale, tile_lists=()):
    poison_allocator()
    out, lse = ops.block_attention_fwd(q, k, v, starts, ptr, idx, scale, "sm90", list(tile_lists))
    assert torch.isfinite(out).all()
    ref, ref_lse = reference(q, k, v, mask, scale)
    tol = 2e-2 if q.dtype == torch.bfloat16 else 4e-3
    torch.testing.assert_close(out.double(), ref, atol=tol, rtol=tol)
    finite = ref_lse.isfinite()
    assert torch.equal(lse.isfinite(), finite), "rows that see nothing: lse -inf, others finite"
    torch.testing.assert_close(lse.double()[finite], ref_lse[finite], atol=1e-3, rtol=1e-3)
    return out, lse


@pytest.mark.parametrize("B,Hq,Hkv,D,dtype,P,n,T,variant,w", CASES)
def test_forward_matches_reference(B, Hq, Hkv, D, dtype, P, n, T, variant, w):
    require_sm90(dtype, D)
    S = P + 2 * T * n
    starts, ptr, idx = (t.cuda() for t in jf_block_table(P, n, T, variant, w))
    q, k, v = make_inputs(B, Hq, Hkv, S, D, dtype)
    check(q, k, v, starts, ptr, idx, dense_mask(P, n, T, variant, w).cuda(), D**-0.5)


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("D,dtype", [(64, torch.bfloat16), (128, torch.float16)])
def test_random_tables_and_host_built_lists(seed, D, dtype):
    """Random block tables (empty blocks, an uncovered tail whose rows see nothing), with the
    lists passed in (as the front end does) and built by the op (tile_lists=[])."""
    require_sm90(dtype, D)
    rng = random.Random(seed)
    cpu, S = random_table(rng, tails=(0, 7))
    mask = table_mask(*cpu, S).cuda()
    dev = [t.cuda() for t in cpu]
    Hkv = rng.choice([1, 2])
    q, k, v = make_inputs(rng.choice([1, 2]), Hkv * rng.choice([1, 3]), Hkv, S, D, dtype)
    lists = [t.cuda() for t in ops.attention_tile_lists(*cpu, S, 128, 128)]
    a = check(q, k, v, *dev, mask, D**-0.5, lists)
    b = check(q, k, v, *dev, mask, D**-0.5)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


@pytest.mark.parametrize("D", [64, 128])
def test_backward_behind_the_sm90_forward(D):
    """kernel='sm90' end to end through autograd: the sm_80 backward reads the sm_90a lse."""
    require_sm90(torch.bfloat16, D)
    P, n, T = 128, 32, 6
    S = P + 2 * T * n
    starts, ptr, idx = (t.cuda() for t in jf_block_table(P, n, T, "noisy_context"))
    q, k, v = (x.requires_grad_() for x in make_inputs(1, 6, 2, S, D, torch.bfloat16))
    out, _ = ops.block_attention_fwd(q, k, v, starts, ptr, idx, D**-0.5, "sm90")
    dout = torch.randn_like(out)
    out.backward(dout)
    qr, kr, vr = (t.detach().double().requires_grad_() for t in (q, k, v))
    ref, _ = reference(qr, kr, vr, dense_mask(P, n, T, "noisy_context").cuda(), D**-0.5)
    ref.backward(dout.double())
    for got, want, name in (
        (q.grad, qr.grad, "dq"),
        (k.grad, kr.grad, "dk"),
        (v.grad, vr.grad, "dv"),
    ):
        torch.testing.assert_close(got.double(), want, atol=8e-2, rtol=8e-2, msg=name)


def test_front_end_runs_sm90_and_matches_sm80():
    from jacobi_ext import JacobiLayout, jacobi_attention

    require_sm90(torch.bfloat16, 128)
    layout = JacobiLayout(prompt_len=200, block_size=32, num_blocks=8, variant="clean_context")
    S = layout.seq_len
    q, k, v = make_inputs(1, 8, 2, S, 128, torch.bfloat16)
    a = jacobi_attention(q, k, v, layout, backend="sm90")
    b = jacobi_attention(q, k, v, layout, backend="sm80")
    torch.testing.assert_close(a, b, atol=2e-2, rtol=2e-2)


# ---- the sm_90a backward (bwd_sm90.h) -----------------------------------------------------------
def check_backward(q, k, v, starts, ptr, idx, mask, scale, deterministic=False):
    """The sm_90a backward (kernel='sm90') against the float64 reference and against the sm_80
    backward (kernel='sm80', deterministic=True), from one sm_80 forward. Deterministic: a second
    run must give the same bits, dQ included (its sums added in key-tile order)."""
    poison_allocator()
    out, lse = ops.block_attention_fwd(q, k, v, starts, ptr, idx, scale, "sm80")
    dout = torch.randn_like(out)
    args = (dout, q, k, v, out, lse, starts, ptr, idx, scale, deterministic, "sm90")
    got = ops.block_attention_bwd(*args)
    if deterministic:
        again = ops.block_attention_bwd(*args)
        for name, a, b in zip(("dq", "dk", "dv"), got, again, strict=True):
            assert torch.equal(a, b), f"{name}: two deterministic runs differ"
    sm80 = ops.block_attention_bwd(dout, q, k, v, out, lse, starts, ptr, idx, scale, True, "sm80")
    qr, kr, vr = (t.detach().double().requires_grad_() for t in (q, k, v))
    ref, _ = reference(qr, kr, vr, mask, scale)
    ref.backward(dout.double())
    tol = 8e-2 if q.dtype == torch.bfloat16 else 1.6e-2  # the sm_80 backward's own tests
    wants = (qr.grad, kr.grad, vr.grad)
    for name, g, s8, want in zip(("dq", "dk", "dv"), got, sm80, wants, strict=True):
        assert torch.isfinite(g).all(), f"{name}: not finite"
        torch.testing.assert_close(g.double(), want, atol=tol, rtol=tol, msg=f"{name} vs fp64")
        torch.testing.assert_close(g, s8, atol=tol, rtol=tol, msg=f"{name} vs sm80")
    return got


def test_backward_op_reports_the_sm90_backward():
    """attention_bwd_kernel: sm90 for kernel='sm90', deterministic or not."""
    require_sm90(torch.bfloat16, 128, backward=True)
    q = torch.empty(1, 1, 1, 128, device="cuda", dtype=torch.bfloat16)
    assert ops.attention_bwd_kernel(q, False, "sm90") == "sm90"
    assert ops.attention_bwd_kernel(q, True, "sm90") == "sm90"  # dQ in key-tile order
    assert ops.attention_bwd_kernel(q, False, "sm80") == "sm80"


def test_autograd_runs_the_sm90_backward_where_sm90_was_chosen():
    """Autograd asks for the sm_90a backward in any order behind kernel sm90 (chosen by name), in
    key-tile order under torch.use_deterministic_algorithms(True), and for the deterministic
    sm_80 one behind every other kernel; its gradients through jacobi_attention(backend="sm90")
    match the sm80 backend's."""
    from jacobi_ext import JacobiLayout, jacobi_attention
    from jacobi_ext.kernels.ops import _deterministic_backward

    require_sm90(torch.bfloat16, 128, backward=True)
    q = torch.empty(1, 1, 1, 128, device="cuda", dtype=torch.bfloat16)
    assert _deterministic_backward(q, "sm90") is False
    assert _deterministic_backward(q, "sm80") is True
    torch.use_deterministic_algorithms(True)
    try:
        assert _deterministic_backward(q, "sm90") is True
    finally:
        torch.use_deterministic_algorithms(False)
    layout = JacobiLayout(64, 32, 3, "clean_context")
    q, k, v = make_inputs(1, 8, 2, layout.seq_len, 128, torch.bfloat16)
    grads = {}
    for backend in ("sm90", "sm80"):
        x = [t.detach().clone().requires_grad_() for t in (q, k, v)]
        jacobi_attention(*x, layout, backend=backend).float().square().sum().backward()
        grads[backend] = [t.grad for t in x]
    for name, a, b in zip("qkv", grads["sm90"], grads["sm80"], strict=True):
        torch.testing.assert_close(a, b, atol=2e-2, rtol=2e-2, msg=f"d{name}: sm90 vs sm80")


# ids "any-order" / "deterministic": a GPU job can run the two dQ modes as separate steps (-k).
DQ_MODES = pytest.mark.parametrize(
    "deterministic", [False, True], ids=["any-order", "deterministic"]
)


@DQ_MODES
@pytest.mark.parametrize("B,Hq,Hkv,D,dtype,P,n,T,variant,w", CASES)
def test_backward_matches_reference_and_sm80(B, Hq, Hkv, D, dtype, P, n, T, variant, w,
                                             deterministic):  # fmt: skip
    require_sm90(dtype, D, backward=True)
    S = P + 2 * T * n
    starts, ptr, idx = (t.cuda() for t in jf_block_table(P, n, T, variant, w))
    q, k, v = make_inputs(B, Hq, Hkv, S, D, dtype)
    mask = dense_mask(P, n, T, variant, w).cuda()
    check_backward(q, k, v, starts, ptr, idx, mask, D**-0.5, deterministic)


@DQ_MODES
@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("D,dtype", [(64, torch.bfloat16), (128, torch.float16),
                                     (128, torch.bfloat16), (64, torch.float16)])  # fmt: skip
def test_backward_random_tables(seed, D, dtype, deterministic):
    """Random block tables: empty blocks, an uncovered tail (rows and keys that see nothing:
    zero gradients), sequence lengths off the 128 grid, GQA groups of 1 to 3; in both dQ modes
    (deterministic: key tiles that see no query tile take no turn)."""
    require_sm90(dtype, D, backward=True)
    rng = random.Random(100 + seed)
    cpu, S = random_table(rng, tails=(0, 7, 70))
    mask = table_mask(*cpu, S).cuda()
    Hkv = rng.choice([1, 2])
    q, k, v = make_inputs(rng.choice([1, 2]), Hkv * rng.choice([1, 2, 3]), Hkv, S, D, dtype)
    dev = [t.cuda() for t in cpu]
    dq, dk, dv = check_backward(q, k, v, *dev, mask, D**-0.5, deterministic)
    blind = ~mask.any(dim=1)  # rows that see nothing: no gradient through their queries
    assert torch.all(dq[:, :, blind] == 0)
    unseen = ~mask.any(dim=0)  # keys nobody sees: zero dK, dV
    assert torch.all(dk[:, :, unseen] == 0) and torch.all(dv[:, :, unseen] == 0)
    # The lists passed in (as autograd passes the forward's) instead of built by the op: the same
    # walk, so dK and dV bitwise (dQ's bulk reductions may sum in another order).
    lists = [t.cuda() for t in ops.attention_tile_lists(*cpu, S, 128, 128)]
    out, lse = ops.block_attention_fwd(q, k, v, *dev, D**-0.5, "sm80")
    dout = torch.randn_like(out)
    args = (dout, q, k, v, out, lse, *dev, D**-0.5, deterministic, "sm90")
    a, b = ops.block_attention_bwd(*args, lists), ops.block_attention_bwd(*args)
    assert torch.equal(a[1], b[1]) and torch.equal(a[2], b[2])
    if deterministic:
        assert torch.equal(a[0], b[0]), "deterministic dQ: lists passed or built, the same bits"
    torch.testing.assert_close(a[0], b[0], atol=1e-2, rtol=1e-2)


def sm90_twice(deterministic: bool):
    """Two sm_90a backward runs of one 7B-shaped clean_context problem, and the argument tuple."""
    require_sm90(torch.bfloat16, 128, backward=True)
    P, n, T = 300, 32, 6
    S = P + 2 * T * n
    starts, ptr, idx = (t.cuda() for t in jf_block_table(P, n, T, "clean_context"))
    q, k, v = make_inputs(1, 8, 2, S, 128, torch.bfloat16)
    out, lse = ops.block_attention_fwd(q, k, v, starts, ptr, idx, 128**-0.5, "sm90")
    dout = torch.randn_like(out)
    args = (dout, q, k, v, out, lse, starts, ptr, idx, 128**-0.5, deterministic, "sm90")
    return ops.block_attention_bwd(*args), ops.block_attention_bwd(*args), args


def test_backward_sm90_runs_twice_alike():
    """In any order, dQ's summation order varies, nothing else: two runs agree to rounding."""
    a, b, _ = sm90_twice(False)
    assert torch.equal(a[1], b[1]) and torch.equal(a[2], b[2]), "dK, dV: no atomics, bitwise"
    torch.testing.assert_close(a[0], b[0], atol=1e-2, rtol=1e-2)


def test_backward_sm90_deterministic_runs_bitwise():
    """deterministic=True: two runs give the same bits, dQ included, and agree with a run in any
    order (dK, dV bitwise: they do not depend on the mode; dQ to rounding)."""
    c, d, args = sm90_twice(True)
    for name, x, y in zip(("dq", "dk", "dv"), c, d, strict=True):
        assert torch.equal(x, y), f"deterministic {name}: two runs differ"
    a = ops.block_attention_bwd(*args[:-2], False, "sm90")
    assert torch.equal(c[1], a[1]) and torch.equal(c[2], a[2]), "dK, dV do not depend on the mode"
    torch.testing.assert_close(c[0], a[0], atol=1e-2, rtol=1e-2)
