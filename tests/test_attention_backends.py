"""jacobi_attention's backends (auto, cpu, sm80, sm90, flex, streams) and JACOBI_ATTN_KERNEL.

The stream-order fast path (backend="streams": two causal SDPA calls) against the float64
dense-mask reference on CPU, values and gradients, random layouts, GQA; which backend runs for
which argument / environment value (CUDA routing on fake tensors, no GPU needed); the errors.
GPU tests skip without CUDA.
"""

from __future__ import annotations

import random

import pytest
import torch

from jacobi_ext import JacobiLayout, jacobi_attention
from jacobi_ext import attention as A
from jacobi_ext._attn_streams import is_two_stream, stream_indices

ops = torch.ops.jacobi_ext
TOL = {torch.float32: 2e-5, torch.bfloat16: 1.5e-2, torch.float16: 2e-3}


@pytest.fixture(autouse=True)
def _no_env(monkeypatch):
    monkeypatch.delenv("JACOBI_ATTN_KERNEL", raising=False)


def reference(q, k, v, mask, scale=None):
    q, k, v = q.double(), k.double(), v.double()
    g = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    s = (q @ k.transpose(-1, -2)) * scale
    return torch.softmax(s.masked_fill(~mask, float("-inf")), dim=-1) @ v


def rel_err(got, want) -> float:
    assert not torch.isnan(got).any()
    return ((got.double() - want).abs().max() / want.abs().max().clamp(min=0.1)).item()


def check(layout, B, Hq, Hkv, D, dtype, backend="streams", scale=None, device="cpu"):
    S = layout.seq_len
    q, k, v = (
        torch.randn(B, h, S, D, device=device).to(dtype).requires_grad_() for h in (Hq, Hkv, Hkv)
    )
    out = jacobi_attention(q, k, v, layout, scale=scale, backend=backend)
    assert out.shape == q.shape and out.dtype == dtype
    qd, kd, vd = (x.detach().cpu().double().requires_grad_() for x in (q, k, v))
    want = reference(qd, kd, vd, layout.dense_mask(), scale)
    grad = torch.randn_like(want)
    want.backward(grad)
    out.backward(grad.to(device, dtype))
    tol = TOL[dtype]
    assert rel_err(out.cpu(), want) < tol
    for name, got, ref in (("q", q.grad, qd.grad), ("k", k.grad, kd.grad), ("v", v.grad, vd.grad)):
        assert got.dtype == dtype and got.shape == ref.shape
        assert rel_err(got.cpu(), ref) < 2 * tol, f"grad {name}"


# ---- the stream-order fast path ------------------------------------------------------------------
@pytest.mark.parametrize(
    "P,n,T,B,Hq,Hkv,D,dtype",
    [
        (5, 3, 4, 2, 4, 2, 16, torch.float32),
        (0, 4, 3, 1, 3, 1, 32, torch.float32),  # no prompt
        (9, 4, 0, 1, 2, 1, 16, torch.float32),  # T = 0: a causal prompt
        (1, 1, 1, 1, 1, 1, 8, torch.float32),
        (37, 8, 6, 2, 6, 2, 64, torch.bfloat16),
        (17, 5, 5, 1, 8, 8, 128, torch.bfloat16),
    ],
)
def test_streams_matches_reference(P, n, T, B, Hq, Hkv, D, dtype):
    check(JacobiLayout(P, n, T), B, Hq, Hkv, D, dtype)


@pytest.mark.parametrize("seed", range(10))
def test_streams_random_layouts(seed):
    rng = random.Random(seed)
    layout = JacobiLayout(
        rng.choice([0, 1, rng.randint(2, 60)]), rng.randint(1, 12), rng.randint(1, 6)
    )
    hkv = rng.choice([1, 2, 4])
    hq = hkv * rng.choice([1, 2, 3])
    D = rng.choice([8, 24, 64, 80])
    dtype = rng.choice([torch.float32, torch.float32, torch.bfloat16])
    check(layout, rng.choice([1, 2]), hq, hkv, D, dtype, scale=rng.choice([None, 0.3]))


def test_streams_matches_the_cpu_kernel():
    layout = JacobiLayout(23, 7, 5)
    q, k, v = (torch.randn(2, h, layout.seq_len, 32, requires_grad=True) for h in (6, 2, 2))
    g = torch.randn(2, 6, layout.seq_len, 32)
    got, want = (jacobi_attention(q, k, v, layout, backend=b) for b in ("streams", "cpu"))
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    for a, b in zip(
        torch.autograd.grad(got, (q, k, v), g), torch.autograd.grad(want, (q, k, v), g), strict=True
    ):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_streams_hand_sdpa_contiguous_output_gradients(monkeypatch):
    """SDPA's CUDA backwards have misread strided output gradients (on an H200 this backend's dQ
    was wrong while its forward matched): each stream's gradient must reach SDPA contiguous."""
    import jacobi_ext._attn_streams as streams

    seen = []

    class Spy(torch.autograd.Function):
        @staticmethod
        def forward(x):
            return x.clone()

        @staticmethod
        def setup_context(ctx, inputs, output):
            pass

        @staticmethod
        def backward(ctx, grad):
            seen.append(grad.is_contiguous())
            return grad

    real = streams.F.scaled_dot_product_attention
    monkeypatch.setattr(
        streams.F, "scaled_dot_product_attention", lambda *a, **kw: Spy.apply(real(*a, **kw))
    )
    layout = JacobiLayout(5, 4, 3)
    q, k, v = (torch.randn(1, 2, layout.seq_len, 8, requires_grad=True) for _ in range(3))
    jacobi_attention(q, k, v, layout, backend="streams").backward(torch.randn(1, 2, 29, 8))
    assert seen == [True, True]


def test_stream_indices():
    layout = JacobiLayout(3, 2, 2)  # [p p p][n0 n0][c0 c0][n1 n1][c1 c1]
    noisy, clean, inv, order = stream_indices(layout)
    assert noisy.tolist() == [0, 1, 2, 3, 4, 7, 8]
    assert clean.tolist() == [0, 1, 2, 5, 6, 9, 10]
    assert order.tolist() == [0, 1, 2, 3, 4, 7, 8, 5, 6, 9, 10]
    assert torch.equal(order[inv], torch.arange(11))


@pytest.mark.parametrize(
    "layout,two",
    [
        (JacobiLayout(5, 3, 4), True),
        (JacobiLayout(5, 3, 4, "windowed", 4), True),  # one window: the noisy_context mask
        (JacobiLayout(5, 3, 4, "windowed", 9), True),
        (JacobiLayout(5, 3, 1, "clean_context"), True),  # one pair: nothing to tell apart
        (JacobiLayout(5, 3, 0, "clean_context"), True),
        (JacobiLayout(5, 3, 4, "windowed", 3), False),
        (JacobiLayout(5, 3, 2, "clean_context"), False),
        (JacobiLayout(0, 3, 4, "clean_context"), False),
    ],
)
def test_two_stream_layouts_are_decided_by_the_mask(layout, two):
    assert is_two_stream(layout) is two
    P, n, T = layout.prompt_len, layout.block_size, layout.num_blocks
    assert two is torch.equal(layout.dense_mask(), JacobiLayout(P, n, T).dense_mask())
    if two:
        check(layout, 1, 2, 1, 16, torch.float32)
    else:
        q = torch.randn(1, 2, layout.seq_len, 16)
        with pytest.raises(
            ValueError, match=r"two causal streams .* Backends that fit: cpu, flex$"
        ):
            jacobi_attention(q, q[:, :1], q[:, :1], layout, backend="streams")


# ---- backend names, JACOBI_ATTN_KERNEL ---------------------------------------------------------
def _spy(monkeypatch):
    """Record which backend jacobi_attention runs (and the kernel name the op would get)."""
    calls = []
    monkeypatch.setattr(A, "streams_attention", lambda *a, **kw: calls.append("streams"))
    monkeypatch.setattr(A, "_flex_attention", lambda *a, **kw: calls.append("flex"))
    monkeypatch.setattr(A, "_run_plan", lambda *a, kernel=None, **kw: calls.append(kernel))
    monkeypatch.setattr(A, "_stream_plan", lambda layout, device: None)
    monkeypatch.setattr(A, "_block_table", lambda layout, device: None)
    return calls


def fake_cuda(*shape, dtype=torch.bfloat16):
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        return torch.empty(shape, dtype=dtype, device="cuda")


@pytest.mark.parametrize(
    "env,backend,want",
    [
        (None, "auto", "auto"),
        ("", "auto", "auto"),
        ("auto", "auto", "auto"),
        ("streams", "auto", "streams"),
        ("flex", "auto", "flex"),
        ("sm80", "auto", "auto"),  # CUDA kernel names leave CPU tensors on the CPU kernel
        ("sm90", "auto", "auto"),
        ("cpu", "auto", "cpu"),
        ("streams", "cpu", "cpu"),  # an explicit argument wins over the variable
        ("flex", "streams", "streams"),
    ],
)
def test_cpu_routing(monkeypatch, env, backend, want):
    if env is not None:
        monkeypatch.setenv("JACOBI_ATTN_KERNEL", env)
    calls = _spy(monkeypatch)
    layout = JacobiLayout(3, 2, 2)
    q = torch.randn(1, 2, layout.seq_len, 16)
    jacobi_attention(q, q, q, layout, backend=backend)
    assert calls == [want]


@pytest.mark.parametrize(
    "env,backend,D,want",
    [
        (None, "auto", 64, "auto"),
        (None, "auto", 80, "flex"),  # no compiled kernel: FlexAttention, as before
        (None, "sm80", 128, "sm80"),
        (None, "sm90", 128, "sm90"),
        ("sm90", "auto", 128, "sm90"),
        ("sm90", "auto", 80, "flex"),  # the variable is a preference: no kernel, FlexAttention
        ("sm80", "auto", 32, "flex"),
        ("sm80", "auto", 96, "sm80"),
        ("streams", "auto", 80, "streams"),
        ("flex", "auto", 64, "flex"),
        ("sm90", "streams", 64, "streams"),
    ],
)
def test_cuda_routing_without_a_gpu(monkeypatch, env, backend, D, want):
    if env is not None:
        monkeypatch.setenv("JACOBI_ATTN_KERNEL", env)
    calls = _spy(monkeypatch)
    # An A100: no measured table entry (test_measured_table_* cover Hopper's).
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    layout = JacobiLayout(0, 16, 2)
    q, k = fake_cuda(1, 4, 64, D), fake_cuda(1, 2, 64, D)
    jacobi_attention(q, k, k, layout, backend=backend)
    assert calls == [want]


def test_measured_table_names_hopper_noisy_context_streams():
    # The H100 and H200 runs (docs/results/h100-2026-11-26, h200-2026-11-26): streams 2.3-3.5x
    # the sm80 kernel, fwd+bwd, 7B shape; nothing else measured yet.
    assert A.MEASURED_FASTEST == {(9, "noisy_context", 128): "streams"}


def test_measured_table_picks_a_backend_on_cuda(monkeypatch):
    calls = _spy(monkeypatch)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    monkeypatch.setitem(A.MEASURED_FASTEST, (9, "noisy_context", 64), "streams")
    monkeypatch.setitem(A.MEASURED_FASTEST, (9, "clean_context", 64), "streams")  # cannot fit
    q, k = fake_cuda(1, 4, 64, 64), fake_cuda(1, 2, 64, 64)
    jacobi_attention(q, k, k, JacobiLayout(0, 16, 2))
    jacobi_attention(q, k, k, JacobiLayout(0, 16, 2, "clean_context"))
    jacobi_attention(q, k, k, JacobiLayout(0, 16, 2), backend="sm80")
    assert calls == ["streams", "auto", "sm80"]


def test_errors_name_the_backends_that_fit(monkeypatch):
    layout = JacobiLayout(3, 2, 2)
    q = torch.randn(1, 2, layout.seq_len, 16)
    with pytest.raises(ValueError, match=r"backend must be one of auto, cpu, sm80, sm90, flex"):
        jacobi_attention(q, q, q, layout, backend="cudnn")
    with pytest.raises(ValueError, match=r"'sm90' is a CUDA kernel .* fit: cpu, flex, streams"):
        jacobi_attention(q, q, q, layout, backend="sm90")
    monkeypatch.setenv("JACOBI_ATTN_KERNEL", "hopper")
    with pytest.raises(ValueError, match=r"JACOBI_ATTN_KERNEL='hopper' is not an attention"):
        jacobi_attention(q, q, q, layout)
    monkeypatch.delenv("JACOBI_ATTN_KERNEL")
    qc, kc = (
        fake_cuda(1, 4, 64, 64, dtype=torch.float32),
        fake_cuda(1, 2, 64, 64, dtype=torch.float32),
    )
    with pytest.raises(ValueError, match=r"'cpu' is the CPU kernel .* fit: flex, streams"):
        jacobi_attention(qc, kc, kc, JacobiLayout(0, 16, 2), backend="cpu")
    with pytest.raises(ValueError, match=r"backend='sm80': the CUDA attention takes bfloat16"):
        jacobi_attention(qc, kc, kc, JacobiLayout(0, 16, 2), backend="sm80")
    with pytest.raises(ValueError, match=r"seq_len 64 but"):
        jacobi_attention(qc, kc, kc, JacobiLayout(0, 16, 3), backend="streams")


def test_raw_op_kernel_argument_and_environment(monkeypatch):
    layout = JacobiLayout(3, 2, 2)
    t = layout.block_table().tensors()
    q = torch.randn(1, 2, layout.seq_len, 16)
    want, _ = ops.block_attention_fwd(q, q, q, *t, 0.25)
    for kernel in ("auto", "cpu", None):
        assert torch.equal(ops.block_attention_fwd(q, q, q, *t, 0.25, kernel)[0], want)
    with pytest.raises(ValueError, match=r"kernel='sm80' is a CUDA kernel but q is on the CPU"):
        ops.block_attention_fwd(q, q, q, *t, 0.25, "sm80")
    with pytest.raises(ValueError, match=r"'streams' are backends of jacobi_attention"):
        ops.block_attention_fwd(q, q, q, *t, 0.25, "streams")
    monkeypatch.setenv("JACOBI_ATTN_KERNEL", "sm90")  # a GPU run's setting: CPU calls still run
    assert torch.equal(ops.block_attention_fwd(q, q, q, *t, 0.25)[0], want)
    monkeypatch.setenv("JACOBI_ATTN_KERNEL", "sm100")
    with pytest.raises(ValueError, match=r"JACOBI_ATTN_KERNEL='sm100' is not an attention kernel"):
        ops.block_attention_fwd(q, q, q, *t, 0.25)


def test_attention_kernel_op_names_the_family_that_runs():
    q = torch.randn(1, 2, 8, 16)
    assert ops.attention_kernel(q) == ops.attention_kernel(q, "auto") == "cpu"
    with pytest.raises(ValueError, match=r"kernel='sm90' is a CUDA kernel"):
        ops.attention_kernel(q, "sm90")


def test_autograd_asks_for_a_deterministic_backward_on_the_cpu():
    from jacobi_ext.ops import _deterministic_backward

    q = torch.zeros(1, 1, 4, 16)
    assert _deterministic_backward(q, None) is True
    assert _deterministic_backward(q, "sm90") is True  # no sm90 off CUDA: never the atomic one


def test_attention_bwd_kernel_op_on_the_cpu():
    """attention_bwd_kernel names the backward's family: the CPU backward for CPU tensors
    (deterministic or not), and a CUDA kernel name is refused as attention_kernel refuses it."""
    q = torch.randn(1, 2, 8, 16)
    assert ops.attention_bwd_kernel(q, False) == ops.attention_bwd_kernel(q, True, "auto") == "cpu"
    with pytest.raises(ValueError, match=r"kernel='sm90' is a CUDA kernel"):
        ops.attention_bwd_kernel(q, False, "sm90")


def test_opcheck_with_a_kernel_argument():
    layout = JacobiLayout(3, 2, 2)
    t = layout.block_table().tensors()
    q, k, v = (torch.randn(1, h, layout.seq_len, 16, requires_grad=True) for h in (2, 1, 1))
    torch.library.opcheck(ops.block_attention_fwd.default, (q, k, v, *t, 0.25, "cpu"))
    out, lse = ops.block_attention_fwd(q.detach(), k.detach(), v.detach(), *t, 0.25)
    bargs = (torch.randn_like(out), q.detach(), k.detach(), v.detach(), out, lse, *t, 0.25, True)
    torch.library.opcheck(ops.block_attention_bwd.default, (*bargs, "cpu"))


# ---- GPU ----------------------------------------------------------------------------------------
@pytest.mark.gpu
def test_cuda_default_stays_sm80_until_the_sm90_kernel_has_run(monkeypatch):
    """Issue 21 part 5: `auto` runs the sm_80 kernel on every GPU, sm_90 included, until a GPU
    run has passed the attention tests with the sm_90a kernel (then kSm90IsDefault flips)."""
    q = torch.randn(1, 2, 64, 128, device="cuda", dtype=torch.bfloat16)
    assert ops.attention_kernel(q) == "sm80"
    assert ops.attention_kernel(q, "sm80") == "sm80"
    monkeypatch.setenv("JACOBI_ATTN_KERNEL", "sm90")
    # The override runs the sm_90a forward where it exists (compute capability 9.x, a build with
    # 90a, bf16/fp16 at head dim 64/128); elsewhere sm90 falls back to sm80 (with a warning, once
    # per process, so not asserted here).
    from jacobi_ext import _native

    hopper = torch.cuda.get_device_capability(q.device)[0] == 9 and "90a" in _native.CUDA_ARCHS
    assert ops.attention_kernel(q) == ("sm90" if hopper else "sm80")
    monkeypatch.setenv("JACOBI_ATTN_KERNEL", "bogus")
    with pytest.raises(ValueError, match=r"JACOBI_ATTN_KERNEL='bogus'"):
        ops.attention_kernel(q)


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["streams", "sm80", "sm90", "auto"])
@pytest.mark.parametrize("D", [64, 128])
def test_cuda_backends_match_reference(backend, D):
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # sm90 on a GPU without the sm_90a kernel: sm80, warned
        check(JacobiLayout(100, 32, 6), 2, 8, 2, D, torch.bfloat16, backend, device="cuda")
