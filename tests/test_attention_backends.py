"""jacobi_attention's backends (auto, cpu, sm80, sm90, flex, streams) and JACOBI_ATTN_KERNEL.

The stream-order fast path (backend="streams": two causal SDPA calls) against the float64
dense-mask reference on CPU, values and gradients, random layouts, GQA; which backend runs for
which argument / environment value (CUDA routing on fake tensors, and the policy itself as a pure
function: no GPU needed); the kernel names the ops are passed, which they run without reading the
environment; the errors. GPU tests skip without CUDA.
"""

from __future__ import annotations

import random

import pytest
import torch

from jacobi_ext import JacobiLayout, jacobi_attention
from jacobi_ext.kernels import attention as A
from jacobi_ext.kernels._attn_streams import is_two_stream, stream_indices

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
    import jacobi_ext.kernels._attn_streams as streams

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
        (None, "auto", "cpu"),
        ("", "auto", "cpu"),
        ("auto", "auto", "cpu"),
        ("streams", "auto", "streams"),
        ("flex", "auto", "flex"),
        ("sm80", "auto", "cpu"),  # CUDA kernel names leave CPU tensors on the CPU kernel
        ("sm90", "auto", "cpu"),
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


def test_environment_is_a_preference_where_it_does_not_fit(monkeypatch):
    """JACOBI_ATTN_KERNEL=streams is for the whole run: a layout that is not two streams runs
    auto's choice (as an argument, streams is refused for it: test_errors_name_...)."""
    monkeypatch.setenv("JACOBI_ATTN_KERNEL", "streams")
    calls = _spy(monkeypatch)
    for layout in (JacobiLayout(3, 2, 2, "clean_context"), JacobiLayout(3, 2, 1, "clean_context")):
        q = torch.randn(1, 2, layout.seq_len, 16)
        jacobi_attention(q, q, q, layout)
    assert calls == ["cpu", "streams"]  # one clean_context pair is two streams


@pytest.mark.parametrize(
    "env,backend,D,want",
    [
        (None, "auto", 64, "sm80"),
        (None, "auto", 80, "flex"),  # no compiled kernel: FlexAttention, as before
        (None, "sm80", 128, "sm80"),
        (None, "sm90", 128, "sm90"),
        ("sm90", "auto", 128, "sm90"),
        ("sm90", "auto", 80, "flex"),  # the variable is a preference: no kernel, FlexAttention
        ("sm80", "auto", 32, "flex"),
        ("sm80", "auto", 96, "sm80"),
        ("cpu", "auto", 64, "sm80"),  # a preference for CPU tensors: CUDA ones keep their kernel
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
    # The clean_context call: the table's backend cannot run it, the capability's default does.
    assert calls == ["streams", "sm90" if A.SM90_IS_DEFAULT else "sm80", "sm80"]


# ---- the policy as a pure function (no GPU needed) ---------------------------------------------
CUDA_FITS = ("sm80", "sm90", "flex", "streams")  # a compiled head dim, a two-stream layout


def test_sm90_is_the_default_on_hopper():
    # Set by the commit that records a GPU run passing every sm_90a attention test
    # (docs/results/h200-2026-11-28).
    assert A.SM90_IS_DEFAULT is True


@pytest.mark.parametrize("sm90_default", [False, True])
@pytest.mark.parametrize("capability", [8, 9, 10])
def test_policy_default_on_cuda(monkeypatch, sm90_default, capability):
    """auto on CUDA: sm80, sm90 on capability 9 only once SM90_IS_DEFAULT; the measured table's
    backend wins where it fits; FlexAttention where no compiled kernel fits."""
    monkeypatch.setattr(A, "SM90_IS_DEFAULT", sm90_default)
    choose = A.choose_backend
    kernel = "sm90" if sm90_default and capability == 9 else "sm80"
    assert choose("cuda", capability, "clean_context", 128, CUDA_FITS) == (kernel, "default")
    assert choose("cuda", capability, None, 64, CUDA_FITS) == (kernel, "default")
    measured = "streams" if capability == 9 else kernel  # (9, noisy_context, 128): streams
    assert choose("cuda", capability, "noisy_context", 128, CUDA_FITS) == (measured, "default")
    no_streams = ("sm80", "sm90", "flex")  # the measured backend does not fit: the kernel
    assert choose("cuda", capability, "noisy_context", 128, no_streams) == (kernel, "default")
    assert choose("cuda", capability, "clean_context", 80, ("flex",)) == ("flex", "default")
    # The environment and the argument come first; neither consults the default.
    assert choose("cuda", capability, "noisy_context", 128, CUDA_FITS, env="sm80") == (
        "sm80",
        "env",
    )
    assert choose("cuda", capability, "noisy_context", 128, CUDA_FITS, "sm90", "flex") == (
        "flex",
        "argument",
    )


def test_policy_measured_table_and_other_devices(monkeypatch):
    monkeypatch.setitem(A.MEASURED_FASTEST, (8, "clean_context", 64), "flex")
    assert A.choose_backend("cuda", 8, "clean_context", 64, CUDA_FITS) == ("flex", "default")
    assert A.choose_backend("cuda", 8, "clean_context", 96, CUDA_FITS) == ("sm80", "default")
    monkeypatch.setattr(A, "SM90_IS_DEFAULT", True)  # the CUDA default never reaches the CPU
    for env in (None, "", " auto ", "sm90", "sm80"):
        assert A.choose_backend("cpu", None, "noisy_context", 128, ("cpu", "flex"), env) == (
            "cpu",
            "default",
        )
    assert A.choose_backend("cpu", None, None, 16, ("cpu", "flex"), "cpu") == ("cpu", "env")
    assert A.choose_backend("meta", None, None, 16, ("flex",)) == ("auto", "default")


def test_policy_errors():
    with pytest.raises(ValueError, match=r"backend must be one of auto, cpu, sm80, sm90, flex"):
        A.choose_backend("cpu", None, None, 16, ("cpu",), None, "cudnn")
    with pytest.raises(ValueError, match=r"JACOBI_ATTN_KERNEL='sm100' is not an attention"):
        A.choose_backend("cpu", None, None, 16, ("cpu",), "sm100")
    # An explicit argument wins before the variable is read.
    assert A.choose_backend("cpu", None, None, 16, ("cpu",), "sm100", "cpu") == ("cpu", "argument")
    with pytest.raises(ValueError, match=r"backend='sm80' does not take .* fit: cpu, flex$"):
        A.choose_backend("cpu", None, None, 16, ("cpu", "flex"), None, "sm80")


def test_op_kernel_follows_the_policy_on_the_cpu(monkeypatch):
    q = torch.zeros(1, 1, 4, 16)
    assert A.op_kernel(q) == "cpu"
    for env in ("sm90", "streams", "flex"):
        monkeypatch.setenv("JACOBI_ATTN_KERNEL", env)
        assert A.op_kernel(q) == "cpu"
    monkeypatch.setenv("JACOBI_ATTN_KERNEL", "sm100")
    with pytest.raises(ValueError, match=r"JACOBI_ATTN_KERNEL='sm100'"):
        A.op_kernel(q)


@pytest.mark.parametrize("env,want", [(None, None), ("sm90", "sm90"), ("streams", None)])
@pytest.mark.parametrize("capability", [8, 9])
def test_op_kernel_on_cuda_without_a_gpu(monkeypatch, env, want, capability):
    """block_attention's kernel: the variable where it names a CUDA kernel, else the default
    (sm90 on capability 9 with SM90_IS_DEFAULT, else sm80; the measured table needs a variant
    and does not apply)."""
    if want is None:
        want = "sm90" if A.SM90_IS_DEFAULT and capability == 9 else "sm80"
    if env is not None:
        monkeypatch.setenv("JACOBI_ATTN_KERNEL", env)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (capability, 0))
    assert A.op_kernel(fake_cuda(1, 4, 64, 128)) == want


# ---- what the ops are passed, and what they do with it -------------------------------------
class _RecordKernels:
    """Stands in for torch.ops.jacobi_ext in a module: records the `kernel` argument of the
    attention ops, runs the real ones."""

    def __init__(self):
        self.fwd, self.bwd = [], []

    def block_attention_fwd(self, *args):
        self.fwd.append(args[7] if len(args) > 7 else "<none>")
        return ops.block_attention_fwd(*args)

    def block_attention_bwd(self, *args):
        self.bwd.append(args[11] if len(args) > 11 else "<none>")
        return ops.block_attention_bwd(*args)

    def __getattr__(self, name):
        return getattr(ops, name)


def test_front_end_and_autograd_pass_the_ops_a_kernel_name(monkeypatch):
    """block_attention names the kernel it runs (the policy's), and autograd's backward names
    the forward's, also where a raw forward was called with kernel=None (the device's portable
    kernel, which the forward ran)."""
    from jacobi_ext import block_attention
    from jacobi_ext.kernels import ops as jops

    monkeypatch.setenv("JACOBI_ATTN_KERNEL", "sm90")  # a GPU run's setting: CPU tensors keep cpu
    rec = _RecordKernels()
    monkeypatch.setattr(A, "ops", rec)
    monkeypatch.setattr(jops, "ops", rec)
    layout = JacobiLayout(3, 2, 2)
    table = layout.block_table()
    q = torch.randn(1, 2, layout.seq_len, 16, requires_grad=True)
    block_attention(q, q, q, table).sum().backward()
    ops.block_attention_fwd(q, q, q, *table.tensors(), 0.25)[0].sum().backward()
    assert rec.fwd == ["cpu"]  # the second forward was called on torch.ops directly
    assert rec.bwd == ["cpu", "cpu"]


def test_raw_op_kernel_argument_ignores_the_environment(monkeypatch):
    """The raw op runs the kernel it is named (None / "auto": the device's portable kernel) and
    never reads JACOBI_ATTN_KERNEL; jacobi_attention honours the variable (and refuses a value
    that is not a backend)."""
    layout = JacobiLayout(3, 2, 2)
    t = layout.block_table().tensors()
    q = torch.randn(1, 2, layout.seq_len, 16)
    want, _ = ops.block_attention_fwd(q, q, q, *t, 0.25)
    for kernel in ("auto", "cpu", None, ""):
        assert torch.equal(ops.block_attention_fwd(q, q, q, *t, 0.25, kernel)[0], want)
    with pytest.raises(ValueError, match=r"kernel='sm80' is a CUDA kernel but q is on the CPU"):
        ops.block_attention_fwd(q, q, q, *t, 0.25, "sm80")
    with pytest.raises(ValueError, match=r"'streams' are backends of jacobi_attention"):
        ops.block_attention_fwd(q, q, q, *t, 0.25, "streams")
    for env in ("sm90", "sm100", "flex"):  # neither a GPU run's setting nor a typo reaches the op
        monkeypatch.setenv("JACOBI_ATTN_KERNEL", env)
        assert torch.equal(ops.block_attention_fwd(q, q, q, *t, 0.25)[0], want)
        assert ops.attention_kernel(q) == ops.attention_bwd_kernel(q, False) == "cpu"
    # ... while jacobi_attention reads it: a typo is an error, flex runs FlexAttention.
    monkeypatch.setenv("JACOBI_ATTN_KERNEL", "sm100")
    with pytest.raises(ValueError, match=r"JACOBI_ATTN_KERNEL='sm100' is not an attention"):
        jacobi_attention(q, q, q, layout)
    monkeypatch.setenv("JACOBI_ATTN_KERNEL", "flex")
    calls = _spy(monkeypatch)
    jacobi_attention(q, q, q, layout)
    assert calls == ["flex"]


def test_attention_kernel_op_names_the_family_that_runs():
    q = torch.randn(1, 2, 8, 16)
    assert ops.attention_kernel(q) == ops.attention_kernel(q, "auto") == "cpu"
    with pytest.raises(ValueError, match=r"kernel='sm90' is a CUDA kernel"):
        ops.attention_kernel(q, "sm90")


def test_autograd_asks_for_a_deterministic_backward_on_the_cpu():
    from jacobi_ext.kernels.ops import _deterministic_backward

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
def test_cuda_raw_op_runs_sm80_and_the_policy_names_sm90(monkeypatch):
    """A raw op call with kernel=None runs the sm_80 kernel on every GPU, whatever
    JACOBI_ATTN_KERNEL says; the Python policy (op_kernel, what block_attention passes) follows
    the variable, and its default is sm90 on Hopper (SM90_IS_DEFAULT), sm80 elsewhere."""
    from jacobi_ext.kernels import _native

    q = torch.randn(1, 2, 64, 128, device="cuda", dtype=torch.bfloat16)
    hopper = torch.cuda.get_device_capability(q.device)[0] == 9
    assert ops.attention_kernel(q) == ops.attention_kernel(q, "auto") == "sm80"
    assert ops.attention_kernel(q, "sm80") == "sm80"
    assert A.op_kernel(q) == ("sm90" if A.SM90_IS_DEFAULT and hopper else "sm80")
    monkeypatch.setenv("JACOBI_ATTN_KERNEL", "sm90")
    assert ops.attention_kernel(q) == "sm80"  # the op never reads the variable
    assert A.op_kernel(q) == "sm90"
    # sm90 runs where it exists (compute capability 9.x, a build with 90a, bf16/fp16 at head dim
    # 64/128); elsewhere it falls back to sm80 (with a warning, once per process, so not
    # asserted here).
    with_90a = hopper and "90a" in _native.CUDA_ARCHS
    assert ops.attention_kernel(q, A.op_kernel(q)) == ("sm90" if with_90a else "sm80")
    monkeypatch.setenv("JACOBI_ATTN_KERNEL", "bogus")
    with pytest.raises(ValueError, match=r"JACOBI_ATTN_KERNEL='bogus'"):
        A.op_kernel(q)
    assert ops.attention_kernel(q) == "sm80"


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["streams", "sm80", "sm90", "auto"])
@pytest.mark.parametrize("D", [64, 128])
def test_cuda_backends_match_reference(backend, D):
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # sm90 on a GPU without the sm_90a kernel: sm80, warned
        check(JacobiLayout(100, 32, 6), 2, 8, 2, D, torch.bfloat16, backend, device="cuda")
