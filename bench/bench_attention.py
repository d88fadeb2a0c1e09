"""Block-causal JF training attention on the CPU: our kernel against the baselines, one run.

    pytest bench/bench_attention.py --benchmark-json=runs/bench_attention.json
    python bench/report.py runs/bench_attention.json        # the table, ratios vs targets

Shapes: B=1, Hq=9, Hkv=3, D=64 (SmolLM2-135M), P=256, n=32, S in {1024, 2048, 4096, 8192},
fp32 and bf16, noisy_context and clean_context, forward ("fwd") and forward+backward ("fwdbwd").
Implementations:
  jacobi      jacobi_attention (this repo's kernel)
  sdpa_dense  F.scaled_dot_product_attention with the dense bool mask (enable_gqa)
  two_pass    noisy_context only: causal SDPA over the clean stream (prompt + clean blocks) and
              causal SDPA over prompt + noisy blocks, whose first P (prompt) rows are dropped; this
              bottom-right-causal trick computes the prompt rows twice (P^2/2 extra pairs, <1%).
              clean_context has no such form (a noisy query sees a clean prefix plus its own
              block: not a causal stream), so it is skipped there.
  flex        torch.compile'd FlexAttention with layout.flex_mask_mod(); forward only (its CPU
              backward is not implemented in torch 2.13); skipped if it fails to compile.
  matmul      a 2048^3 fp32 (and bf16) matmul: the machine's GEMM rate in the same run.
extra_info per benchmark: useful pairs, GFLOP/s on the useful FLOPs (fwd 4*pairs*D*Hq, fwd+bwd
3.5x that), peak extra memory (MiB) of one call, measured as the rise of the process's RSS high-
water mark (VmHWM, reset through /proc/self/clear_refs) with glibc told to mmap every allocation
>= 64 KiB, so freed tensors leave RSS at once; inputs and the module-level caches are allocated
before the reset, so the figure is what the call itself needs (outputs, grads, workspaces).

JACOBI_BENCH_QUICK=1: tiny sizes, fp32, one round (a smoke test: tests/test_bench_quick.py).
"""

from __future__ import annotations

import ctypes
import os
import time

import pytest
import torch
import torch.nn.functional as F

from jacobi_ext import JacobiLayout, jacobi_attention

QUICK = os.environ.get("JACOBI_BENCH_QUICK", "0") == "1"
B, HQ, HKV, D = 1, 9, 3, 64
P, N = (32, 16) if QUICK else (256, 32)
SIZES = [160] if QUICK else [1024, 2048, 4096, 8192]
DTYPES = {"fp32": torch.float32} if QUICK else {"fp32": torch.float32, "bf16": torch.bfloat16}
VARIANTS = ["noisy_context", "clean_context"]
IMPLS = ["jacobi", "sdpa_dense", "two_pass", "flex"]
MODES = ["fwd", "fwdbwd"]

_libc = ctypes.CDLL("libc.so.6") if os.path.exists("/proc/self/clear_refs") else None
if _libc is not None:
    _libc.mallopt(-3, 64 * 1024)  # M_MMAP_THRESHOLD: large frees go straight back to the OS


def _status_bytes(key: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key):
                return int(line.split()[1]) * 1024
    raise KeyError(key)


def peak_extra_mib(fn) -> float | None:
    """Peak RSS rise (MiB) while fn() runs; None where the kernel offers no VmHWM reset."""
    if _libc is None:
        return None
    try:
        _libc.malloc_trim(0)
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        base = _status_bytes("VmRSS")
        fn()
        return (_status_bytes("VmHWM") - base) / 2**20
    except OSError:
        return None


def layout_for(S: int, variant: str) -> JacobiLayout:
    T = (S - P) // (2 * N)
    return JacobiLayout(P, N, T, variant)


def useful_pairs(layout: JacobiLayout) -> int:
    t = layout.block_table()
    lens = t.block_start.long().diff().tolist()
    kp, ki = t.kv_ptr.tolist(), t.kv_idx.tolist()
    return sum(
        lq * sum(lens[kb] for kb in ki[kp[qb] : kp[qb + 1]]) + lq * (lq + 1) // 2
        for qb, lq in enumerate(lens)
    )


_cache: dict = {}


def make_impl(impl: str, layout: JacobiLayout, q, k, v):
    """A callable computing the attention output [B, Hq, S, D] in packed order."""
    S = layout.seq_len
    if impl == "jacobi":
        layout.stream_plan(q.device)  # host bookkeeping, once per layout (cached)
        return lambda q, k, v: jacobi_attention(q, k, v, layout)
    if impl == "sdpa_dense":
        mask = layout.dense_mask()
        return lambda q, k, v: F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, enable_gqa=True
        )
    if impl == "two_pass":
        if layout.variant != "noisy_context":
            pytest.skip("two-pass causal SDPA has no equivalent for clean_context (see docstring)")
        Pn, n = layout.prompt_len, layout.block_size
        i = torch.arange(S)
        kind = torch.where(i < Pn, 0, torch.where(((i - Pn) // n) % 2 == 0, 1, 2))
        clean = torch.nonzero((kind == 0) | (kind == 2)).flatten()  # prompt + clean blocks
        noisy = torch.nonzero((kind == 0) | (kind == 1)).flatten()  # prompt + noisy blocks
        dest = torch.cat([clean, noisy[Pn:]])
        inv = torch.empty_like(dest)
        inv[dest] = torch.arange(S)

        def two_pass(q, k, v):
            sdpa = F.scaled_dot_product_attention
            g = lambda x, idx: x.index_select(2, idx)  # noqa: E731
            oc = sdpa(g(q, clean), g(k, clean), g(v, clean), is_causal=True, enable_gqa=True)
            on = sdpa(g(q, noisy), g(k, noisy), g(v, noisy), is_causal=True, enable_gqa=True)
            return torch.cat([oc, on[:, :, Pn:]], dim=2).index_select(2, inv)

        return two_pass
    if impl == "flex":
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention

        key = ("flex", S, layout.variant, q.dtype)
        if key not in _cache:
            try:
                bm = create_block_mask(layout.flex_mask_mod(), None, None, S, S, device="cpu")
                fn = torch.compile(flex_attention, dynamic=False)
                with torch.no_grad():
                    fn(q, k, v, block_mask=bm, enable_gqa=True)  # compile outside the timing
                _cache[key] = (fn, bm)
            except Exception as exc:  # noqa: BLE001 - any compile failure means "not available"
                _cache[key] = exc
        if isinstance(_cache[key], Exception):
            pytest.skip(f"FlexAttention unavailable here: {type(_cache[key]).__name__}")
        fn, bm = _cache[key]
        return lambda q, k, v: fn(q, k, v, block_mask=bm, enable_gqa=True)
    raise ValueError(impl)


def rounds_for(S: int) -> int:
    return 1 if QUICK else (5 if S <= 2048 else 3 if S <= 4096 else 2)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("S", SIZES)
def test_attention(benchmark, S, dtype, variant, impl, mode):
    if impl == "flex" and mode == "fwdbwd":
        pytest.skip("FlexAttention has no CPU backward in this torch")
    layout = layout_for(S, variant)
    S = layout.seq_len
    torch.manual_seed(0)
    dt = DTYPES[dtype]
    q = torch.randn(B, HQ, S, D).to(dt).requires_grad_(mode == "fwdbwd")
    k = torch.randn(B, HKV, S, D).to(dt).requires_grad_(mode == "fwdbwd")
    v = torch.randn(B, HKV, S, D).to(dt).requires_grad_(mode == "fwdbwd")
    f = make_impl(impl, layout, q, k, v)
    grad = torch.randn(B, HQ, S, D).to(dt)

    if mode == "fwd":

        def run():
            with torch.no_grad():
                return f(q, k, v)
    else:

        def run():
            out = f(q, k, v)
            return torch.autograd.grad(out, (q, k, v), grad)

    run()  # warm-up (JIT kernels, caches)
    benchmark.pedantic(run, rounds=rounds_for(S), iterations=1, warmup_rounds=0)
    pairs = useful_pairs(layout)
    flops = 4 * pairs * D * HQ * (3.5 if mode == "fwdbwd" else 1.0)
    median = benchmark.stats.stats.median
    benchmark.extra_info.update(
        impl=impl,
        mode=mode,
        dtype=dtype,
        variant=variant,
        seq_len=S,
        useful_pairs=pairs,
        useful_fraction=pairs / S**2,
        useful_gflop=flops / 1e9,
        gflops=flops / median / 1e9,
        peak_extra_mib=peak_extra_mib(run),
        threads=torch.get_num_threads(),
    )


@pytest.mark.parametrize("dtype", list(DTYPES))
def test_matmul(benchmark, dtype):
    """The machine's GEMM rate, measured in the same run (the 50%-of-matmul target)."""
    n = 512 if QUICK else 2048
    a = torch.randn(n, n).to(DTYPES[dtype])
    b = torch.randn(n, n).to(DTYPES[dtype])
    a @ b
    t0 = time.perf_counter()
    benchmark.pedantic(lambda: a @ b, rounds=1 if QUICK else 10, iterations=1, warmup_rounds=1)
    del t0
    benchmark.extra_info.update(
        impl="matmul", dtype=dtype, n=n, gflops=2 * n**3 / benchmark.stats.stats.median / 1e9
    )
