"""The CUDA decode ops (csrc/cuda/decode_cuda.cu) against their CPU twins and float64
references, and the CUDA lean forward (jacobi_ext/decoding/lean.py: CudaLeanDecoder) against
transformers' forward and our own AR. All marked `gpu`: they skip without a CUDA device."""

import pytest
import torch
from test_decode_plan_attention import CASES, make_case, reference

from jacobi_ext.decoding import lean, prepack
from jacobi_ext.kernels import _native  # noqa: F401  (registers torch.ops.jacobi_ext)

pytestmark = pytest.mark.gpu
DTYPES = [torch.float32, torch.bfloat16]
ops = torch.ops.jacobi_ext


def _tol(dtype):
    return dict(rtol=2e-2, atol=2e-2) if dtype == torch.bfloat16 else dict(rtol=1e-5, atol=1e-5)


@pytest.fixture(autouse=True)
def _cuda_ops():
    if not prepack.cuda_decode_available():
        pytest.fail("this jacobi_ext has no CUDA decode ops (build it with JACOBI_EXT_CUDA=ON)")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("rows,n", [(1, 576), (64, 576), (3, 4096), (5, 100)])
def test_add_rms_norm_matches_the_cpu_op(rows, n, dtype):
    g = torch.Generator().manual_seed(rows * n)
    x = torch.randn(rows, n, generator=g).to(dtype)
    r = torch.randn(rows, n, generator=g).to(dtype)
    w = torch.randn(n, generator=g).to(dtype)
    h_cpu, y_cpu = ops.fused_add_rms_norm(x, r, w, 1e-5)
    h, y = ops.fused_add_rms_norm(x.cuda(), r.cuda(), w.cuda(), 1e-5)
    assert torch.equal(h.cpu(), h_cpu)  # the residual add: one rounding, the same bits
    torch.testing.assert_close(y.cpu(), y_cpu, **_tol(dtype))
    torch.testing.assert_close(ops.rms_norm(x.cuda(), w.cuda(), 1e-5).cpu(),
                               ops.rms_norm(x, w, 1e-5), **_tol(dtype))  # fmt: skip


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_silu_mul_matches_the_cpu_op(dtype):
    gu = (torch.randn(37, 2 * 1536, generator=torch.Generator().manual_seed(0)) * 4).to(dtype)
    torch.testing.assert_close(ops.silu_and_mul(gu.cuda()).cpu(), ops.silu_and_mul(gu),
                               **_tol(dtype))  # fmt: skip


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"B{c[0]}-Hq{c[1]}-Hkv{c[2]}-D{c[3]}-Q{c[4]}")
def test_plan_attention_matches_cpu_twin_and_float64(case, dtype):
    """Rotary, cache write and attention over the plan: the cache's new slots bitwise the CPU
    twin's (one formula, jacobi/decode_step.h), the output to rounding of both and of float64;
    slots past a sequence's end (garbage here) are never read."""
    B, Hq, Hkv, D, Q, cap, ctx = case
    cpu = make_case(B, Hq, Hkv, D, Q, cap, ctx, dtype)
    qkv, cos, sin, kc, vc, seg, off, lo, hi = cpu
    scale = D**-0.5
    want, _, _ = reference(*cpu[:1], Hq, Hkv, *cpu[1:], scale)
    g = [t.cuda() for t in cpu]
    for b in range(B):  # poison every slot outside the plan: a kernel reading them sees NaN
        for cache in (g[3], g[4]):
            cache[b, :, Q : int(lo[b])] = float("nan")
            cache[b, :, int(hi[b]) :] = float("nan")
    twin = ops.rope_attention(qkv, Hq, Hkv, cos, sin, kc, vc, seg, off, lo, hi, scale)
    got = ops.rope_attention(g[0], Hq, Hkv, *g[1:], scale)
    assert torch.equal(g[3][:, :, :Q].cpu(), kc[:, :, :Q])
    assert torch.equal(g[4][:, :, :Q].cpu(), vc[:, :, :Q])
    assert not got.isnan().any()
    torch.testing.assert_close(got.cpu(), twin, **_tol(dtype))
    torch.testing.assert_close(got.cpu().double(), want, **_tol(dtype))


def test_plan_attention_reads_the_plan_from_strided_views():
    """The runtime passes seg[:, :Q] of its [B, scratch] buffers: rows strided."""
    B, Hq, Hkv, D, Q, cap, ctx = CASES[1]
    cpu = make_case(B, Hq, Hkv, D, Q, cap, ctx, torch.float32)
    g = [t.cuda() for t in cpu]
    wide_seg = torch.full((B, 2 * Q), -1, dtype=torch.long, device="cuda")
    wide_off = torch.zeros(B, 2 * Q, dtype=torch.long, device="cuda")
    wide_seg[:, :Q], wide_off[:, :Q] = g[5], g[6]
    a = ops.rope_attention(g[0], Hq, Hkv, *g[1:5], g[5], g[6], g[7], g[8], 0.1)
    b = ops.rope_attention(
        g[0], Hq, Hkv, *g[1:5], wide_seg[:, :Q], wide_off[:, :Q], g[7], g[8], 0.1
    )
    assert torch.equal(a, b)


def test_plan_attention_main_row_is_independent_of_the_rest_of_the_step():
    """Row 0's tokens at positions p meet their keys at the same places in any step: the output
    of a one-token step and of the same token inside a wider step (with candidates) agree
    bitwise when the committed prefix makes up the difference."""
    torch.manual_seed(0)
    Hq, Hkv, D, cap, dtype = 9, 3, 64, 600, torch.bfloat16
    n_ctx, Q = 300, 8
    qkv = torch.randn(1, Q, (Hq + 2 * Hkv) * D, device="cuda").to(dtype)
    theta = torch.rand(1, Q, D // 2, device="cuda") * 6
    cos = torch.cat([theta.cos()] * 2, -1).to(dtype)
    sin = torch.cat([theta.sin()] * 2, -1).to(dtype)
    kc = torch.randn(1, Hkv, cap, D, device="cuda").to(dtype)
    vc = torch.randn(1, Hkv, cap, D, device="cuda").to(dtype)
    lo = torch.tensor([Q], device="cuda")
    hi = lo + n_ctx
    seg = torch.tensor([[0, 0, 0, 0, 1, 1, -1, -1]], device="cuda")
    off = torch.tensor([[0, 1, 2, 3, 0, 1, 0, 0]], device="cuda")
    wide = ops.rope_attention(qkv, Hq, Hkv, cos, sin, kc, vc, seg, off, lo, hi, 0.125)
    # The same token 3 of row 0 as an AR step: its row's first three tokens committed.
    kc2, vc2 = kc.clone(), vc.clone()
    end = Q + n_ctx  # hi
    kc2[:, :, end : end + 3] = kc[:, :, :3]
    vc2[:, :, end : end + 3] = vc[:, :, :3]
    one = ops.rope_attention(
        qkv[:, 3:4], Hq, Hkv, cos[:, 3:4], sin[:, 3:4], kc2, vc2, seg[:, :1], off[:, :1], lo,
        hi + 3, 0.125,
    )  # fmt: skip
    assert torch.equal(one[0, 0], wide[0, 3])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
def test_argmax_matches_the_cpu_op_and_torch(dtype):
    """The first NaN, else the first of tied maxima: torch's max(-1).indices, on every row."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(7, 49152, generator=g).to(dtype)
    x[1, 100] = x[1, 40000] = x[1].max() + 1  # a tie: the first
    x[2, 7] = float("nan")
    x[2, 3] = float("nan")  # two NaNs: the first
    x[3] = 0.0  # all equal: index 0
    x[4, -1] = float("inf")
    x[5] = 0.0
    x[5, 10] = torch.finfo(dtype).tiny / 4  # a denormal beats zeros (no flush to zero)
    x[6] = -1.0
    x[6, 20] = -torch.finfo(dtype).tiny / 4  # a negative denormal beats -1, loses to nothing
    got = ops.argmax(x.cuda()).cpu()
    assert torch.equal(got, ops.argmax(x))
    assert torch.equal(got, x.max(-1).indices)
    assert got[1] == 100 and got[2] == 3 and got[3] == 0 and got[4] == 49151
    assert got[5] == 10 and got[6] == 20


@pytest.mark.parametrize(
    "dtype,D",
    [(torch.float32, 64), (torch.bfloat16, 64), (torch.bfloat16, 33), (torch.float64, 512)],
    ids=str,
)  # (33: rows of 16-bit units; 512 fp64: rows longer than one pass of the kernel)
def test_kv_commit_matches_the_cpu_op(dtype, D):
    g = torch.Generator().manual_seed(0)
    caches = [torch.randn(3, 2, 80, D, generator=g).to(dtype) for _ in range(6)]
    src = torch.tensor([0, 20, 5])
    dst = torch.tensor([40, 24, 5])  # apart, overlapping (moving up), no move
    count = torch.tensor([7, 9, 4])
    gpu = [c.cuda() for c in caches]
    ops.kv_commit(caches, src, dst, count, [])
    ops.kv_commit(gpu, src.cuda(), dst.cuda(), count.cuda(), [])
    for a, b in zip(gpu, caches, strict=True):
        assert torch.equal(a.cpu(), b)
    down = [c.clone() for c in caches]
    ops.kv_commit(down, torch.tensor([30, 10, 0]), torch.tensor([25, 2, 0]),
                      torch.tensor([10, 12, 0]), [])  # fmt: skip
    gdown = [c.cuda() for c in caches]
    ops.kv_commit(gdown, torch.tensor([30, 10, 0]).cuda(), torch.tensor([25, 2, 0]).cuda(),
                      torch.tensor([10, 12, 0]).cuda(), [])  # fmt: skip
    for a, b in zip(gdown, down, strict=True):
        assert torch.equal(a.cpu(), b)
    # caches of two shapes in one call (layers with their own head counts): one launch each
    mixed = [caches[0].clone(), caches[1][:, :1].clone(), caches[2].clone()]
    gmixed = [c.cuda() for c in mixed]
    ops.kv_commit(mixed, src, dst, count, [])
    ops.kv_commit(gmixed, src.cuda(), dst.cuda(), count.cuda(), [])
    for a, b in zip(gmixed, mixed, strict=True):
        assert torch.equal(a.cpu(), b)


def test_kv_commit_moves_16_bit_units_from_2_byte_aligned_caches():
    """bf16 caches that start 2 bytes into a word (views into a larger buffer): rows of an even
    number of elements, yet 32-bit units would fault; the op moves them as 16-bit ones."""
    shape, g = (2, 2, 40, 64), torch.Generator().manual_seed(1)
    n = torch.Size(shape).numel()
    bufs = [torch.randn(n + 1, generator=g).to(torch.bfloat16) for _ in range(3)]
    caches = [b[1:].view(shape) for b in bufs]
    gpu = [b.cuda()[1:].view(shape) for b in bufs]
    assert all(c.data_ptr() % 4 == 2 for c in gpu)
    src, dst, count = torch.tensor([0, 3]), torch.tensor([20, 6]), torch.tensor([9, 5])
    ops.kv_commit(caches, src, dst, count, [])
    ops.kv_commit(gpu, src.cuda(), dst.cuda(), count.cuda(), [])
    torch.cuda.synchronize()
    for a, b in zip(gpu, caches, strict=True):
        assert torch.equal(a.cpu(), b)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_plan_attention_clamps_a_plan_past_the_cache(dtype):
    """hi past the capacity (a commit that did not fit while hi moved) reads nothing outside
    the sequence's own cache rows: the output is the plan's with hi at the capacity, bitwise, and
    the other sequences' are unchanged."""
    B, Hq, Hkv, D, Q, cap, ctx = CASES[1]
    g = [t.cuda() for t in make_case(B, Hq, Hkv, D, Q, cap, ctx, dtype)]
    qkv, cos, sin, kc, vc, seg, off, lo, hi = g
    at_cap = hi.clone()
    at_cap[0] = cap
    past = hi.clone()
    past[0] = cap + 37
    want = ops.rope_attention(qkv, Hq, Hkv, cos, sin, kc.clone(), vc.clone(), seg, off,
                                     lo, at_cap, D**-0.5)  # fmt: skip
    got = ops.rope_attention(qkv, Hq, Hkv, cos, sin, kc.clone(), vc.clone(), seg, off,
                                    lo, past, D**-0.5)  # fmt: skip
    assert torch.equal(got, want)


def test_plan_attention_refuses_caches_off_16_byte_alignment():
    B, Hq, Hkv, D, Q, cap, ctx = CASES[1]
    qkv, cos, sin, kc, vc, seg, off, lo, hi = [
        t.cuda() for t in make_case(B, Hq, Hkv, D, Q, cap, ctx, torch.float32)
    ]
    n = kc.numel()
    shifted = torch.zeros(n + 1, device="cuda")[1:].view(kc.shape)  # 4 bytes into a vector
    with pytest.raises(ValueError, match="16-byte aligned"):
        ops.rope_attention(qkv, Hq, Hkv, cos, sin, shifted, vc, seg, off, lo, hi, 0.1)


def test_fused_ops_capture_in_a_cuda_graph():
    """A layer's fused ops replay from one CUDA graph with new plan values (no host reads)."""
    B, Hq, Hkv, D, Q, cap, ctx = CASES[2]
    cpu = make_case(B, Hq, Hkv, D, Q, cap, ctx, torch.bfloat16)
    g = [t.cuda() for t in cpu]
    qkv, cos, sin, kc, vc, seg, off, lo, hi = g
    x = torch.randn(B, Q, 512, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(512, device="cuda", dtype=torch.bfloat16)

    def step():
        out = ops.rope_attention(qkv, Hq, Hkv, cos, sin, kc, vc, seg, off, lo, hi, 0.1)
        h, y = ops.fused_add_rms_norm(x, x, w, 1e-6)
        return out, ops.silu_and_mul(y)

    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        step()
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = step()
    hi.sub_(5)  # a new plan, read on the device at replay
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(outs[0], step()[0])


# ---- the CUDA lean forward ---------------------------------------------------------------------


def _model(family, dtype, seed=0):
    from jacobi_ext.models import tiny_llama

    m = tiny_llama(
        vocab_size=101, hidden_size=256, num_layers=2, num_heads=4, num_kv_heads=1, seed=seed,
        family=family,
    )  # head dim 64, GQA 4  # fmt: skip
    return m.to(device="cuda", dtype=dtype)


@pytest.mark.gpu_timeout(180)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3"])
def test_cuda_lean_logits_match_transformers_forward(family, dtype, monkeypatch):
    from jacobi_ext.decoding.runtime import StaticRuntime

    model = _model(family, dtype)
    assert lean.why_not(model) is None
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 101, (2, 11), generator=g).cuda()
    pad = torch.tensor([0, 3]).cuda()
    got = {}
    for env in ("0", "1"):
        monkeypatch.setenv("JACOBI_EXT_LEAN", env)
        rt = StaticRuntime(model, 2, 64, 16, cuda_graphs=False)
        keep = lambda logits, pos: logits.clone()  # noqa: E731
        rt.prefill(ids, pad, None, rule=keep)
        assert isinstance(rt._lean, lean.CudaLeanDecoder) == (env == "1")
        with torch.inference_mode():
            rt.ids[:, :5] = torch.arange(5, device="cuda")[None] + 7
            rt.seg[:, :5] = 0
            rt.off[:, :5] = torch.arange(5, device="cuda")[None]
            got[env] = rt.forward(5, rt.scratch + 11, rule=keep)
    scale = float(got["0"].abs().max())
    tol = dict(rtol=0, atol=(0.03 if dtype == torch.bfloat16 else 1e-4) * scale)
    torch.testing.assert_close(got["1"], got["0"], **tol)


@pytest.mark.gpu_timeout(300)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_every_method_is_our_ar_on_cuda(family, dtype):
    from jacobi_ext.decoding.engine import generate

    model = _model(family, dtype, seed=4)
    ids = torch.randint(0, 101, (3, 9), generator=torch.Generator().manual_seed(2)).cuda()
    ar = generate(model, ids, max_new_tokens=48, method="ar").tokens
    assert isinstance(model.__dict__.get(lean._ATTR), lean.CudaLeanDecoder)
    runs = {
        "jacobi n=8": dict(method="jacobi", block_size=8, lookup=False),
        "jacobi n=16 lookup": dict(method="jacobi", block_size=16, lookup=True),
        "multiblock": dict(method="multiblock", block_size=4, num_blocks=3, pool_size=2),
    }
    for name, kw in runs.items():
        assert torch.equal(generate(model, ids, max_new_tokens=48, **kw).tokens, ar), name


@pytest.mark.gpu_timeout(180)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_captured_chunked_prefill_is_the_one_pass_prefill(dtype, monkeypatch):
    """The prefill as CUDA graph replays of 8-token chunks (the plan path) against one eager
    pass: the same positions and slots, the logits and committed K/V to rounding, and replays
    counted (two graphs: a middle chunk and the last)."""
    from jacobi_ext.decoding.runtime import StaticRuntime

    model = _model("llama", dtype, seed=2)
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, 101, (3, 29), generator=g).cuda()
    pad = torch.tensor([0, 4, 17]).cuda()
    drafts = torch.randint(0, 101, (3, 3), generator=g).cuda()
    got = {}
    for chunk in ("0", "8"):
        monkeypatch.setenv("JACOBI_EXT_PREFILL_CHUNK", chunk)
        rt = StaticRuntime(model, 3, 48, 16)
        keep = lambda logits, pos: logits.clone()  # noqa: E731
        logits = rt.prefill(ids, pad, drafts, rule=keep)
        kv = [c.keys[b, :, int(rt.lo[b]) : int(rt.hi[b])].clone()
              for c in rt.cache.layers for b in range(3)]  # fmt: skip
        got[chunk] = (logits, rt.lo.clone(), rt.hi.clone(), kv, rt.graph_replays)
    (l0, lo0, hi0, kv0, _), (l1, lo1, hi1, kv1, replays) = got["0"], got["8"]
    assert replays == 4  # 29 + 3 tokens: four chunks of 8
    assert torch.equal(lo0, lo1) and torch.equal(hi0, hi1)
    scale = float(l0.abs().max())
    tol = dict(rtol=0, atol=(0.03 if dtype == torch.bfloat16 else 1e-4) * scale)
    torch.testing.assert_close(l1, l0, **tol)
    for k1, k0 in zip(kv1, kv0, strict=True):
        torch.testing.assert_close(k1, k0, **_tol(dtype))


def test_bad_arguments_raise_value_errors():
    """Shapes, dtypes and devices the kernels do not take are refused with ValueError (never a
    crash): head dim 96, float16, a plan on the CPU, a CPU cache beside CUDA q/k/v."""
    B, Hq, Hkv, D, Q, cap, ctx = CASES[1]
    g = [t.cuda() for t in make_case(B, Hq, Hkv, D, Q, cap, ctx, torch.float32)]
    qkv, cos, sin, kc, vc, seg, off, lo, hi = g
    op = ops.rope_attention
    with pytest.raises(ValueError, match="head dims"):
        k96 = torch.zeros(B, Hkv, cap, 96, device="cuda")
        op(qkv, Hq, Hkv, cos, sin, k96, k96.clone(), seg, off, lo, hi, 0.1)
    with pytest.raises(ValueError, match="float32 or bfloat16"):
        op(qkv.half(), Hq, Hkv, cos, sin, kc, vc, seg, off, lo, hi, 0.1)
    with pytest.raises(ValueError, match="must be on"):
        op(qkv, Hq, Hkv, cos, sin, kc, vc, seg.cpu(), off, lo, hi, 0.1)
    with pytest.raises(ValueError, match="CUDA tensor"):
        op(qkv.cpu(), Hq, Hkv, cos, sin, kc, vc, seg, off, lo, hi, 0.1)
    with pytest.raises(ValueError, match="multiple"):
        op(qkv, Hq, 2, cos, sin, kc, vc, seg, off, lo, hi, 0.1)
    with pytest.raises(ValueError, match="transposed"):
        ops.kv_commit([kc], lo, hi, lo, [kc])
    with pytest.raises(ValueError, match="contiguous"):
        ops.kv_commit([kc, kc.transpose(1, 2)], lo, hi, lo, [])
    with pytest.raises(ValueError, match="float32 or bfloat16"):
        ops.silu_and_mul(torch.zeros(3, 8, device="cuda", dtype=torch.float16))
    with pytest.raises(ValueError, match="features"):
        ops.rms_norm(torch.zeros(3, 8, device="cuda"), torch.ones(7, device="cuda"), 1e-6)


@pytest.mark.gpu_timeout(300)
def test_a_larger_probe_leaves_the_kept_runtimes_graphs_correct():
    """The silent wrong-token case: generate (graphs captured, gathering rotary rows), a
    StepProbe with more positions, then generate again on the kept runtime: the same tokens,
    and the tables the graphs read are the ones they were captured with."""
    from jacobi_ext.decoding.engine import generate
    from jacobi_ext.decoding.runtime import StepProbe

    model = _model("llama", torch.bfloat16, seed=5)
    ids = torch.randint(0, 101, (1, 12), generator=torch.Generator().manual_seed(6)).cuda()
    kw = dict(max_new_tokens=40, method="jacobi", block_size=8)
    first = generate(model, ids, **kw).tokens
    rt = model._jacobi_runtime
    assert rt.use_graphs and rt.graph_replays > 0
    reads = rt.step_reads()
    probe = StepProbe(model, context=rt.capacity + 300, max_q=64)
    for q in (1, 8, 64):
        probe(q)
    torch.cuda.synchronize()
    again = generate(model, ids, **kw).tokens
    assert model._jacobi_runtime is rt and rt.step_reads() == reads
    assert torch.equal(again, first)
    assert torch.equal(again, generate(model, ids, max_new_tokens=40, method="ar").tokens)


@pytest.mark.gpu_timeout(180)
def test_float32_norms_beside_bfloat16_linears_on_cuda():
    """Norm weights kept in float32 in a bf16 model: cast once when the plan is made, so the
    model decodes as with its norms cast (every method our AR)."""
    import copy

    from jacobi_ext.decoding.engine import generate

    model = _model("llama", torch.bfloat16, seed=7)
    cast = copy.deepcopy(model)
    for mod in model.modules():
        if type(mod).__name__.endswith("RMSNorm"):
            mod.weight.data = mod.weight.data.float()
    ids = torch.randint(0, 101, (2, 9), generator=torch.Generator().manual_seed(8)).cuda()
    want = generate(cast, ids, max_new_tokens=24, method="ar").tokens
    for kw in (dict(method="ar"), dict(method="jacobi", block_size=8)):
        assert torch.equal(generate(model, ids, max_new_tokens=24, **kw).tokens, want), kw
