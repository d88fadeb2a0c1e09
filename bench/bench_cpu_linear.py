"""The CPU decode path at the roofline: our linear kernel against `F.linear`, alone and
in a whole decoding step, fp32 and bf16, side by side in one run.

1. The kernel alone (`torch.ops.jacobi_ext.cpu_linear`, weights packed once) against
   `F.linear` on SmolLM2-135M's MLP shape 1536 x 576, over enough distinct weights to be beyond
   the cache (212 MB), at M = 1, 4, 16, 64 rows; beside the machine's read bandwidth (`x.sum()`
   over the same bytes, interleaved with the two) and GEMM peak (`torch.mm` 2048^2) measured in
   the same run. extra_info: GB/s and GFLOP/s of both, and the kernel's share of the bandwidth
   (M = 1) and of the GEMM peak.
2. The runtime's step (StepProbe: 256 tokens of context) at widths 1, 4, 16, 64 in three
   configurations, alternating: "before" (JACOBI_EXT_CPU_LINEAR=0: fp32 `F.linear`, bf16
   oneDNN-packed weights, transformers' forward), "kernel" (our kernel behind every nn.Linear,
   transformers' forward) and "kernel+lean" (the default: our kernel and the lean forward);
   beside the roofline floor max(weight bytes / read bandwidth, FLOPs / peak), the peak being the
   faster of the library GEMM and our kernel at 256 rows (jacobi_ext.tools.roofline's rule).

    pytest bench/bench_cpu_linear.py -o python_files='bench_*.py' --benchmark-json=cpu_linear.json
    JACOBI_BENCH_QUICK=1 pytest bench/bench_cpu_linear.py -o python_files='bench_*.py'  # seconds
"""

from __future__ import annotations

import os
import statistics
import time

import pytest
import torch

from jacobi_ext.decoding import prepack

QUICK = os.environ.get("JACOBI_BENCH_QUICK", "") not in ("", "0")
ROUNDS = 3 if QUICK else int(os.environ.get("JACOBI_BENCH_ROUNDS", "11"))
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}

pytestmark = pytest.mark.skipif(not prepack.kernel_available(), reason="no CPU linear kernel")


def _interleaved(fns: dict, rounds=ROUNDS) -> dict[str, float]:
    """Median seconds of each fn, run round-robin (A, B, C, A, B, C, ...) after one warm-up
    call each, so load swings from other processes hit all of them alike."""
    for f in fns.values():
        f()
    times = {k: [] for k in fns}
    for _ in range(rounds):
        for k, f in fns.items():
            t0 = time.perf_counter()
            f()
            times[k].append(time.perf_counter() - t0)
    return {k: statistics.median(v) for k, v in times.items()}


@pytest.fixture(scope="module")
def peaks():
    """The machine's read bandwidth (GB/s) and, per dtype, compute peak (GFLOP/s) this run: the
    library GEMM (`torch.mm` 2048^2) and our kernel at 256 rows of a 1536 x 576 weight in cache;
    the floor takes the faster (as jacobi_ext.tools.roofline does: a floor must be a floor)."""
    from jacobi_ext.kernels._native import ops

    n = (1 << 20) if QUICK else (212 << 20) // 4
    x = torch.randn(n)
    t = _interleaved({"sum": lambda: x.sum()})["sum"]
    out = {"read_gbps": x.numel() * 4 / t / 1e9}
    size = 256 if QUICK else 2048
    for name, dt in DTYPES.items():
        a, b = torch.randn(size, size).to(dt), torch.randn(size, size).to(dt)
        w = torch.randn(1536, 576).to(dt)
        p, xs = ops.cpu_linear_pack(w), torch.randn(256, 576).to(dt)
        t = _interleaved(
            {
                "mm": lambda a=a, b=b: a @ b,
                "kernel": lambda p=p, xs=xs: ops.cpu_linear(xs, p, 1536),
            },
            rounds=3 if QUICK else 5,
        )
        out[f"gemm_gflops_{name}"] = 2 * size**3 / t["mm"] / 1e9
        out[f"kernel_gflops_{name}"] = 2 * 256 * 1536 * 576 / t["kernel"] / 1e9
        out[f"peak_gflops_{name}"] = max(out[f"gemm_gflops_{name}"], out[f"kernel_gflops_{name}"])
    return out


@pytest.mark.parametrize("rows", [1, 4, 16, 64])
@pytest.mark.parametrize("dtype", list(DTYPES))
def test_linear(benchmark, peaks, dtype, rows):
    """One call per weight over all of them: the weights stream from memory on every call."""
    from jacobi_ext.kernels._native import ops

    dt = DTYPES[dtype]
    out_f, in_f = (96, 64) if QUICK else (1536, 576)
    total = (1 << 20) if QUICK else 212 << 20  # bytes of weights, beyond any cache
    count = max(2, total // (out_f * in_f * dt.itemsize))
    ws = [torch.randn(out_f, in_f).to(dt) for _ in range(count)]
    packed = [ops.cpu_linear_pack(w) for w in ws]
    x = torch.randn(rows, in_f).to(dt)
    for w, p in zip(ws[:2], packed[:2], strict=True):  # the same product (another sum order)
        torch.testing.assert_close(
            ops.cpu_linear(x, p, out_f), torch.nn.functional.linear(x, w), rtol=2e-2, atol=2e-1
        )

    def f_linear():
        for w in ws:
            torch.nn.functional.linear(x, w)

    def kernel():
        for p in packed:
            ops.cpu_linear(x, p, out_f)

    nbytes = sum(w.numel() * w.element_size() for w in ws)
    buf = torch.randn(nbytes // 4)  # the read bandwidth of the same bytes, in the same rounds
    t = _interleaved({"F.linear": f_linear, "kernel": kernel, "read": lambda: buf.sum()})
    read_gbps = nbytes / t.pop("read") / 1e9
    benchmark.pedantic(kernel, rounds=1, iterations=1)
    flops = 2 * rows * sum(w.numel() for w in ws)
    peak = peaks[f"gemm_gflops_{dtype}"]  # the yardstick: the library GEMM's peak
    info = {"dtype": dtype, "rows": rows, "weights_mb": round(nbytes / 1e6, 1)}
    for k, s in t.items():
        info[f"{k}_ms"] = round(s * 1e3, 3)
        info[f"{k}_gbps"] = round(nbytes / s / 1e9, 1)
        info[f"{k}_gflops"] = round(flops / s / 1e9, 1)
    info.update(
        speedup=round(t["F.linear"] / t["kernel"], 2),
        read_gbps=round(read_gbps, 1),
        gemm_gflops=round(peak, 1),
        kernel_share_of_read_bw=round(nbytes / t["kernel"] / 1e9 / read_gbps, 3),
        kernel_share_of_gemm_peak=round(flops / t["kernel"] / 1e9 / peak, 3),
        kernel_peak_gflops=round(peaks[f"kernel_gflops_{dtype}"], 1),
        # the floor of this call: the weights read once, or the FLOPs at the GEMM peak
        kernel_vs_floor=round(
            t["kernel"] / max(nbytes / (read_gbps * 1e9), flops / (peak * 1e9)), 2
        ),
        threads=torch.get_num_threads(),
    )
    benchmark.extra_info.update(info)


GGUF_TYPES = {"Q4_1": 3, "Q8_0": 8, "Q4_K": 12, "Q6_K": 14}


@pytest.mark.parametrize("rows", [1, 16, 128])
@pytest.mark.parametrize("qtype", list(GGUF_TYPES))
def test_gguf_linear(benchmark, qtype, rows):
    """The GGUF linear (cpu_linear_gguf) on codes beyond any cache, against the read bandwidth of
    the bytes it reads and the fp32 kernel on the same weights dequantized (5-7x the bytes),
    interleaved in one run; the two agree bitwise (asserted)."""
    import numpy as np
    from gguf import GGMLQuantizationType, quants

    from jacobi_ext.kernels._native import ops

    t_id = GGUF_TYPES[qtype]
    out_f, in_f = (64, 256) if QUICK else (1536, 768)  # K: whole k-quant super-blocks
    total = (1 << 20) if QUICK else 66 << 20  # bytes of codes (the default model's layers)
    g = np.random.default_rng(0)
    w = (g.standard_normal((out_f, in_f)) * 0.05).astype(np.float32)
    if t_id in (3, 8):  # gguf quantizes these
        raw = quants.quantize(w, GGMLQuantizationType(t_id))
    else:  # it only dequantizes the k-quants: random codes with finite fp16 scales
        from gguf.constants import GGML_QUANT_SIZES

        bk, bb = GGML_QUANT_SIZES[GGMLQuantizationType(t_id)]
        raw = g.integers(0, 256, size=(out_f, in_f // bk, bb), dtype=np.uint8)
        for off in {12: (0, 2), 14: (208,)}[t_id]:
            h = (g.standard_normal(raw.shape[:2]) * 0.01).astype(np.float16)
            raw[:, :, off : off + 2] = h.view(np.uint8).reshape(*raw.shape[:2], 2)
        raw = raw.reshape(out_f, -1)
    count = max(2, total // raw.nbytes)
    packed = [ops.cpu_linear_gguf_pack([torch.from_numpy(raw.copy())], t_id) for _ in range(count)]
    deq = torch.from_numpy(np.array(quants.dequantize(raw, GGMLQuantizationType(t_id)), np.float32))
    dense = [ops.cpu_linear_pack(deq) for _ in range(count)]
    x = torch.randn(rows, in_f)
    assert torch.equal(ops.cpu_linear_gguf(x, packed[0], t_id, out_f),
                       ops.cpu_linear(x, dense[0], out_f))  # fmt: skip

    def codes():
        for p in packed:
            ops.cpu_linear_gguf(x, p, t_id, out_f)

    def fp32():
        for p in dense:
            ops.cpu_linear(x, p, out_f)

    def codes_int8():  # 8-bit activations (Q4_1, Q8_0): the tile this CPU runs
        for p in packed:
            ops.cpu_linear_gguf(x, p, t_id, out_f, int8_activations=True)

    nbytes = sum(p.numel() for p in packed)
    buf = torch.randn(nbytes // 4)
    fns = {"codes": codes, "fp32": fp32, "read": lambda: buf.sum()}
    if t_id in (3, 8):
        fns["int8"] = codes_int8
    t = _interleaved(fns)
    read_gbps = nbytes / t["read"] / 1e9
    benchmark.pedantic(codes, rounds=1, iterations=1)
    benchmark.extra_info.update(
        qtype=qtype, rows=rows, codes_mb=round(nbytes / 1e6, 1),
        fp32_mb=round(sum(p.numel() * 4 for p in dense) / 1e6, 1),
        codes_ms=round(t["codes"] * 1e3, 3), fp32_ms=round(t["fp32"] * 1e3, 3),
        codes_gbps=round(nbytes / t["codes"] / 1e9, 1), read_gbps=round(read_gbps, 1),
        codes_share_of_read_bw=round(nbytes / t["codes"] / 1e9 / read_gbps, 3),
        codes_vs_fp32=round(t["fp32"] / t["codes"], 2), threads=torch.get_num_threads(),
    )  # fmt: skip
    if "int8" in t:
        from jacobi_ext.kernels._native import CPU_INT8_TILE

        benchmark.extra_info.update(
            int8_ms=round(t["int8"] * 1e3, 3), int8_tile=CPU_INT8_TILE,
            int8_gbps=round(nbytes / t["int8"] / 1e9, 1),
            int8_vs_codes=round(t["codes"] / t["int8"], 2),
        )  # fmt: skip


@pytest.fixture(scope="module")
def models():
    from jacobi_ext.models import load_model, tiny_llama

    out = {}
    for name, dt in DTYPES.items():
        if QUICK:
            out[name] = tiny_llama(vocab_size=128, seed=0).to(dt)
        else:
            out[name] = load_model(os.environ.get("JACOBI_BENCH_MODEL") or None, dtype=dt)[0]
    return out


CONFIGS = {  # name -> environment of the runtime's forward
    "before": {"JACOBI_EXT_CPU_LINEAR": "0", "JACOBI_EXT_LEAN": "0"},
    "kernel": {"JACOBI_EXT_CPU_LINEAR": "kernel", "JACOBI_EXT_LEAN": "0"},
    "kernel+lean": {"JACOBI_EXT_CPU_LINEAR": "kernel", "JACOBI_EXT_LEAN": "1"},
}


@pytest.mark.parametrize("dtype", list(DTYPES))
def test_decoding_step(benchmark, peaks, models, dtype, monkeypatch):
    """The runtime's step at widths 1, 4, 16, 64 over 256 tokens of context, per configuration,
    all interleaved in one run; with the roofline floor of each width."""
    from jacobi_ext.decoding.runtime import StepProbe
    from jacobi_ext.tools import roofline

    model = models[dtype]
    context = 32 if QUICK else 256
    widths = (1, 4, 16, 64)
    probes = {}
    for name, env in CONFIGS.items():
        for k, v in env.items():
            monkeypatch.setenv(k, v)
        probes[name] = StepProbe(model, context=context, max_q=max(widths))  # path fixed here

    def call(name, q):
        def f():
            for k, v in CONFIGS[name].items():
                os.environ[k] = v
            return probes[name](q)

        return f

    targets = {name: call(name, 16)() for name in CONFIGS}
    if dtype == "fp32":  # the kernel sums in another order than MKL: compare the two kernels'
        assert torch.equal(targets["kernel"], targets["kernel+lean"])
    fns = {f"{name} q={q}": call(name, q) for q in widths for name in CONFIGS}
    t = _interleaved(fns)
    benchmark.pedantic(call("kernel+lean", 1), rounds=1, iterations=1)
    cost = roofline.model_cost(model)
    m = roofline.Machine(
        read_gbps=peaks["read_gbps"], peak_gflops=peaks[f"peak_gflops_{dtype}"], dtype=dtype,
        threads=torch.get_num_threads(), hardware="this run", device="cpu",
    )  # fmt: skip
    info = {"dtype": dtype, "context": context, "weight_mb": round(cost.weight_bytes / 1e6, 1)}
    for q in widths:
        floor = roofline.floor_seconds(m, cost, q, context)
        info[f"floor_ms q={q}"] = round(floor * 1e3, 2)
        for name in CONFIGS:
            s = t[f"{name} q={q}"]
            info[f"{name}_ms q={q}"] = round(s * 1e3, 2)
            info[f"{name}_x_floor q={q}"] = round(s / floor, 2)
    for name in CONFIGS:
        info[f"{name} t16/t1"] = round(t[f"{name} q=16"] / t[f"{name} q=1"], 2)
    info.update(read_gbps=round(peaks["read_gbps"], 1), gemm_gflops=round(m.peak_gflops, 1))
    benchmark.extra_info.update(info)
